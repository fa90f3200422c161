"""What the ``--engine vllm`` sections share: the vLLM interpreter and its child processes.

Every vLLM engine of the bench runs in a child process of an interpreter that has vLLM
(``--vllm-python``, default ``.venv-vllm/bin/python`` when it exists, else this one), because
vLLM spawns workers and pins its own dependency stack. That interpreter needs bsr, not the
bench: the child finds this package through ``PYTHONPATH`` (:mod:`.common.workers`). The child
is :mod:`.vllm_engine`'s entry point running a section module's ``child``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common.stats import BenchError
from .common.workers import child_env


def vllm_python(given: str | None) -> str:
    """The interpreter that runs the engines."""
    if given:
        return given
    local = Path(".venv-vllm/bin/python")
    return str(local.absolute()) if local.exists() else sys.executable  # not resolve(): a venv


def vllm_version(python: str) -> str:
    """vLLM's version in ``python``; a :class:`BenchError` naming the fix when it has none."""
    check = subprocess.run(
        [python, "-c", "import vllm, bsr; print(vllm.__version__)"], capture_output=True, text=True
    )
    if check.returncode != 0:
        raise BenchError(
            f"{python} cannot import vllm and bsr; build the vLLM environment (make .venv-vllm) "
            "or pass --vllm-python"
        )
    return check.stdout.strip()


def object_files(root: str) -> int:
    """The object files a FileTier at ``root`` holds."""
    return sum(1 for _ in (Path(root) / "objects").glob("**/*.bsr"))


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` reproducible random token ids clear of the special ids 0-2 and the last one."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 1) for _ in range(n)]


def root_cause(stderr: str) -> str:
    """The most specific error line of a failed engine start."""
    lines = [ln.split("] ", 1)[-1].strip() for ln in stderr.splitlines()]
    for needle in ("only supported on", "Error:", "error:"):
        hits = [ln for ln in lines if needle in ln and "Engine core initialization" not in ln]
        if hits:
            return hits[0][:500]
    return (lines[-1] if lines else "no output")[:500]


def run_child(
    python: str, section: str, spec: dict[str, Any], work: Path, name: str, timeout_s: float
) -> dict[str, Any]:
    """Run ``section``'s ``child`` on ``spec`` in a child process (``python -m
    bsr_bench.vllm_engine SECTION SPEC OUT``) and return OUT, or ``{"error": ..., ...}`` (the
    most specific line of its stderr) when it wrote none."""
    spec_path, out = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    # vLLM's CPU build reserves one more core when a KV connector is configured: pinned, an
    # engine without bsr and one with it compute on the same number of threads
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **child_env()}
    # vLLM's ZMQ sockets and init files, and the connector's lookup socket, go in the section's
    # work directory (removed with it): an engine stopped by its PID leaves them behind
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(tmp)
    try:
        proc = subprocess.run(
            [python, "-m", "bsr_bench.vllm_engine", section, str(spec_path), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"{name} did not finish within {timeout_s:.0f} s", "returncode": None}
    if out.exists():
        return dict(json.loads(out.read_text()))
    return {"error": root_cause(proc.stderr), "returncode": proc.returncode}
