"""Shared fixtures (helper functions live in support/)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from hypothesis import HealthCheck, settings

import bsr
from support.helpers import two_group_layout

#: "cpu": run the portable part of the ``cuda`` tests on the CPU (the dry run of bench/gpu/run.py)
CUDA_TESTS_ON = "BSR_CUDA_TESTS_ON"
#: "1": a ``cuda`` test without a CUDA device fails instead of skipping (bench/gpu/run.py on a GPU)
REQUIRE_CUDA = "BSR_REQUIRE_CUDA"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.cuda`` tests need a CUDA device; without one they skip, saying so."""
    if item.get_closest_marker("cuda") is None or torch.cuda.is_available():
        return
    if os.environ.get(REQUIRE_CUDA) == "1":
        pytest.fail(f"{REQUIRE_CUDA}=1 but torch.cuda.is_available() is False", pytrace=False)
    if os.environ.get(CUDA_TESTS_ON) != "cpu":
        pytest.skip(
            "needs a CUDA device (torch.cuda.is_available() is False); bench/gpu/run.py runs "
            "the cuda tests on a GPU machine (docs/gpu.md)"
        )


# Hypothesis under CI (.ci/run sets CI=true): derandomized, so every CI run draws the same
# examples and a failure reproduces from its seed; no example database; no per-example deadline
# (a loaded machine is slow, not wrong). Example counts are not cut: each test's own
# max_examples (and the default 100) hold, so every property a mutation was caught by is
# checked as before. `pytest --hypothesis-profile=ci` loads it anywhere.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
if os.environ.get("CI", "").strip().lower() == "true":
    settings.load_profile("ci")

# vLLM's CPU build gives its worker every core but a reserved few (one more with a KV connector
# configured), and on some CPUs the thread count changes bf16 reductions: a run without a
# connector and one with bsr then part at a near-tie token (seen in CI: one token of 32). Every
# engine the tests start (in-process forks, `vllm serve`, fleets) reserves one core, so runs
# that compare tokens run the same kernels on the same number of threads.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

#: modules whose tests are long, independent and share no module-scoped fixture: under
#: pytest-xdist each of their tests is a unit of its own, so the workers run them side by side
SPLIT_MODULES = frozenset({"tests/proof/test_connector_spin.py"})

#: the modules that take longest (``--durations``, on three workers), longest first: handed out
#: right after :data:`SPLIT_MODULES`, before the modules with the most tests, so that none starts
#: last and runs alone at the end (the bench's vLLM sections are one test each, minutes long;
#: the vLLM suite's engine fixtures run one engine after another)
LONG_MODULES = (
    "tests/bench/test_vllm_ttft.py",
    "tests/bench/test_vllm_interference.py",
    "tests/vllm_connector/test_connector.py",
    "tests/vllm_connector/test_key_partition.py",
    "tests/vllm_connector/test_adapters.py",
    "tests/vllm_connector/test_fleet_pools.py",
    "tests/vllm_connector/test_hybrid.py",
    "tests/vllm_connector/test_stuck_store.py",
    "tests/proof/test_campaign.py",
    "tests/vllm_connector/test_async_faults.py",
    "tests/vllm_connector/test_fleet_router.py",
    "tests/vllm_connector/test_fleet.py",
    "tests/vllm_connector/test_serve.py",
    "tests/vllm_connector/test_pd_split.py",
    "tests/vllm_connector/test_mla.py",
    "tests/vllm_connector/test_sliding.py",
    "tests/vllm_connector/test_window_checkpoints.py",
)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test`` runs the main suite on pytest-xdist workers (``-n 3``). A module is one unit
    of work, as with ``--dist loadfile``: a worker runs all of it, so a module-scoped fixture (a
    server, a cluster, a model, a bench run, a report) is built once, by that worker, which owns
    it (its ports, its processes, its temp directory). Units are handed out largest first. The
    tests of :data:`SPLIT_MODULES` are units of their own and go first (the longest tests of
    the suite: started last, one would run alone at the end). Another ``--dist`` than load,
    loadfile or loadscope gets xdist's own scheduler."""
    if config.getoption("dist") not in ("load", "loadfile", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the workers' collection order (below) is the order

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module in SPLIT_MODULES else module

    return ModuleScheduling(config, log)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: the order the scheduler hands units out in (see
    :func:`pytest_xdist_make_scheduler`). :data:`SPLIT_MODULES` first, then :data:`LONG_MODULES`,
    then the modules with the most tests; each module's tests stay together and in order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[_module(item)] = counts.get(_module(item), 0) + 1
    long = {m: i for i, m in enumerate(LONG_MODULES)}

    def order(item: pytest.Item) -> tuple[bool, int, int]:
        module = _module(item)
        return module not in SPLIT_MODULES, long.get(module, len(long)), -counts[module]

    items.sort(key=order)


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs() -> Iterator[None]:
    """Keep structlog quiet in tests (warnings still print)."""
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True, scope="session")
def _vllm_temp_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Where vLLM's processes leave their files: a directory of this session's, removed at its
    end. vLLM binds its ZMQ sockets in ``VLLM_RPC_BASE_PATH`` and writes its
    ``vllm_dist_*`` init files in the temporary directory, and an engine stopped by its PID (as
    the tests stop theirs) leaves both: thousands of sockets in /tmp after a run of the suite.
    Only where vLLM is installed; this process's own temporary directory (pytest's
    ``tmp_path``) is the system's as before: the children's ``TMPDIR`` alone moves."""
    import contextlib
    import importlib.util
    import shutil
    import sys
    import tempfile

    if importlib.util.find_spec("vllm") is None:
        yield
        return
    tmp_path_factory.getbasetemp()  # pytest's directories first, in the system's tempdir
    tempfile.gettempdir()  # and this process's tempdir fixed before TMPDIR moves
    own = Path(tempfile.mkdtemp(prefix="bsr-tests-vllm-"))  # not the connector's own prefix
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "VLLM_RPC_BASE_PATH")}
    os.environ["TMPDIR"] = os.environ["VLLM_RPC_BASE_PATH"] = str(own)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # the session's engines are stopped by now: all of it goes (sockets, init files, the
        # connector's lookup directories, torch's compile cache) but a log the engine fork
        # server kept for reading (it died under a run; the failure names the file)
        engines = sys.modules.get("vllm_engines")
        forks = getattr(engines, "_FORKS", None)
        kept = forks._log if forks is not None and forks._keep_log else None
        for f in own.iterdir():
            if f == kept:
                continue
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            own.rmdir()  # unless that log is there


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every ``@pytest.mark.anyio`` test runs once under asyncio and once under trio."""
    return str(request.param)


@pytest.fixture
def layout() -> bsr.StateLayout:
    return two_group_layout()


@pytest.fixture
def l2_path(tmp_path: Path) -> Path:
    return tmp_path / "l2"
