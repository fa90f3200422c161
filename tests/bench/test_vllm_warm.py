"""``bsr bench --engine vllm --vllm-warm``: the flag picks the program, bad arguments are bench
errors, and the section's arithmetic (the figures need vLLM; ``docs/vllm.md`` has the run)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bsr_bench import vllm_warm
from bsr_bench.cli import add_arguments, program
from bsr_bench.common.stats import BenchError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_flag_picks_the_program_and_bad_arguments_are_bench_errors() -> None:
    ns = parse("--engine", "vllm", "--vllm-warm")
    assert program(ns)[1] is vllm_warm.run_from_namespace
    assert vllm_warm._plan(ns) == {"prefixes": (2048, 8192), "leads_ms": (0, 50, 200), "repeats": 5}
    quick = vllm_warm._plan(parse("--vllm-warm", "--quick", "--vllm-warm-leads", "10"))
    assert quick == {"prefixes": (2048,), "leads_ms": (10,), "repeats": 2}
    for argv, match in [
        (("--vllm-prefixes", "300"), "multiples of 256"),
        (("--vllm-warm-leads", "5,5"), "distinct"),
        (("--vllm-warm-leads", "-1"), "distinct lead times >= 0"),
        (("--vllm-warm-leads", "soon"), "comma-separated integers"),
        (("--vllm-repeats", "0"), ">= 1"),
    ]:
        with pytest.raises(BenchError, match=match):
            vllm_warm._plan(parse("--vllm-warm", *argv))


def turn(s: float, **by_tier: int) -> dict[str, Any]:
    return {"ttft_s": s, "cached": 2048 if by_tier else 0, "bytes_by_tier": by_tier}


def test_the_section_keeps_every_sample_and_ratios_of_medians() -> None:
    measured = {
        "points": [
            {
                "prefix_tokens": 2048,
                "recompute": [turn(2.0), turn(1.0), turn(3.0)],
                "cold": [turn(0.2, file=8), turn(0.4, file=8), turn(0.3, file=8)],
                "promoted": [turn(0.1, host=8), turn(0.1, host=8), turn(0.2, host=8)],
                "warm": {"0": [turn(0.3, host=8)] * 3, "50": [turn(0.15, host=8)] * 3},
            }
        ],
        "start_s": 12.0,
    }
    sec = vllm_warm.warm_section(measured, (0, 50), 99.0)
    (p,) = sec["points"]
    assert p["variants"]["cold"]["ttft_s"]["median"] == 0.3
    assert p["variants"]["cold"]["bytes_by_tier"] == {"file": 24}
    assert p["variants"]["promoted"]["bytes_by_tier"] == {"host": 24}
    assert p["variants"]["warm_50ms"]["cached_tokens"] == [2048] * 3
    assert p["ratios"] == pytest.approx(
        {
            "cold_vs_recompute": 0.15,
            "promoted_vs_cold": 1 / 3,
            "warm_0ms_vs_cold": 1.0,
            "warm_50ms_vs_cold": 0.5,
        }
    )
    assert sec["leads_ms"] == [0, 50] and sec["engine_start_s"] == 12.0
