"""``bsr bench --engine vllm``: argument checks and error reporting (the figures need vLLM)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from bsr_bench.cli import add_arguments
from bsr_bench.common.document import validate
from bsr_bench.common.stats import BenchError
from bsr_bench.vllm_common import root_cause
from bsr_bench.vllm_interference import QUICK_VARIANTS, VARIANTS
from bsr_bench.vllm_ttft import DEFAULT_PREFIXES, SECTIONS, options_from_namespace, run_vllm

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_engine_flag_defaults_to_the_restore_bench() -> None:
    assert parse().engine == "bsr"
    ns = parse("--engine", "vllm", "--vllm-prefixes", "512,1024", "--vllm-repeats", "2")
    assert (ns.engine, ns.vllm_prefixes, ns.vllm_repeats) == ("vllm", "512,1024", 2)


def test_options_defaults_and_quick() -> None:
    opts = options_from_namespace(parse("--engine", "vllm", "--vllm-python", "/x/python"))
    assert (opts.sections, opts.prefixes, opts.repeats) == (SECTIONS, DEFAULT_PREFIXES, 5)
    assert opts.python == "/x/python" and opts.plan.variants == tuple(VARIANTS)
    opts = options_from_namespace(
        parse("--engine", "vllm", "--quick", "--vllm-sections", " interference ,ttft")
    )
    assert opts.sections == ("interference", "ttft") and opts.quick
    assert (opts.prefixes, opts.repeats, opts.plan.variants) == ((1024, 2048), 2, QUICK_VARIANTS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--vllm-prefixes", "1000"), "--vllm-prefixes must be multiples of 256"),
        (("--vllm-prefixes", "0"), "--vllm-prefixes must be multiples of 256"),
        (("--vllm-prefixes", "1024,2k"), "--vllm-prefixes takes comma-separated token counts"),
        (("--vllm-repeats", "0"), "--vllm-repeats must be >= 1, got 0"),
        (("--vllm-sections", ","), "--vllm-sections takes distinct names"),
        (("--vllm-sections", "ttft,stalls"), "--vllm-sections takes distinct names"),
    ],
)
def test_bad_options_name_the_flag(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(BenchError, match=message):
        options_from_namespace(parse("--engine", "vllm", *argv))


def test_bad_arguments_are_bench_errors() -> None:
    with pytest.raises(BenchError, match="multiples of 256"):
        run_vllm(parse("--engine", "vllm", "--vllm-prefixes", "1000"))
    with pytest.raises(BenchError, match=">= 1"):
        run_vllm(parse("--engine", "vllm", "--vllm-repeats", "0"))
    with pytest.raises(BenchError, match="--vllm-sections"):
        run_vllm(parse("--engine", "vllm", "--vllm-sections", "ttft,stalls"))
    with pytest.raises(BenchError, match="--vllm-sections"):
        run_vllm(parse("--engine", "vllm", "--vllm-sections", "ttft,ttft"))


def test_an_interpreter_without_vllm_is_named() -> None:
    ns = parse("--engine", "vllm", "--vllm-python", sys.executable, "--vllm-prefixes", "256")
    try:
        import vllm.config  # noqa: F401
    except ImportError:
        with pytest.raises(BenchError, match="cannot import vllm"):
            run_vllm(ns)
    else:
        pytest.skip("this interpreter has vLLM")


def test_root_cause_is_the_specific_line() -> None:
    stderr = "\n".join(
        [
            "(Worker pid=1) INFO 12-01 [x.py:1] starting",
            "(Worker pid=1) ERROR 12-01 [y.py:2] ValueError: CPU Offloading is currently only "
            "supported on CUDA-alike and XPU GPUs",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert root_cause(stderr).startswith("ValueError: CPU Offloading is currently only supported")
    assert root_cause("") == "no output"


@pytest.mark.slow
@pytest.mark.vllm_env
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make .venv-vllm)")
def test_the_ttft_section_runs_at_one_chunk(tmp_path: Path) -> None:
    """Four engines at a 256-token prefix, one timed request each: both load modes hit the
    whole prefix, recompute hits nothing, the offloading connector's refusal is recorded, and
    the document on disk validates."""
    out = tmp_path / "vllm.json"
    doc = run_vllm(
        parse(
            "--engine", "vllm", "--vllm-sections", "ttft", "--vllm-python", str(VLLM_PYTHON),
            "--vllm-prefixes", "256", "--vllm-repeats", "1", "--json", str(out),
        )
    )  # fmt: skip
    validate(json.loads(out.read_text()), "vllm_document")
    assert doc["interference"] is None and doc["warnings"] == []
    (p,) = doc["ttft"]["points"]
    assert p["prefix_tokens"] == 256
    assert p["bsr_cached_tokens"] == p["bsr_sync_cached_tokens"] == [256]
    assert p["recompute_cached_tokens"] == [0]
    assert p["async_vs_sync_ttft"] == pytest.approx(
        p["bsr_ttft_s"]["median"] / p["bsr_sync_ttft_s"]["median"]
    )
    starts = doc["ttft"]["engine_start_s"]
    assert all(starts[m] > 0 for m in ("recompute", "bsr", "bsr_sync"))
    assert doc["ttft"]["offloading_connector"]["ran"] is False  # the CPU build refuses it
