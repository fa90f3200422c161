"""``bsr bench --engine vllm --vllm-cost``: the flag picks the program, bad arguments are bench
errors, and the document's arithmetic (the figures need vLLM; ``docs/vllm.md`` has the run)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bsr_bench import vllm_cost
from bsr_bench.cli import add_arguments, program
from bsr_bench.common.stats import BenchError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_flag_picks_the_program_and_bad_arguments_are_bench_errors() -> None:
    assert program(parse("--engine", "vllm", "--vllm-cost"))[1] is vllm_cost.run_from_namespace
    plan = vllm_cost._plan(parse("--engine", "vllm", "--vllm-cost"))
    assert plan == {"prefix_tokens": 2048, "prefixes": 2, "repeats": 4, "slow_bytes_per_s": 5e5}
    with pytest.raises(BenchError, match="multiple of 512"):
        vllm_cost._plan(parse("--vllm-cost", "--vllm-cost-tokens", "768"))
    with pytest.raises(BenchError, match=">= 1"):
        vllm_cost._plan(parse("--vllm-cost", "--vllm-repeats", "0"))


def run(load: list[float], recompute: list[float], cost: list[float]) -> dict[str, Any]:
    return {
        "load": {"ttft_s": {"load": load, "recompute": recompute},
                 "cached_tokens": {"load": [2048], "recompute": [0]}},
        "cost": {"ttft_s": {"cost": cost}, "cached_tokens": {"cost": [1024]},
                 "decisions": {"partial": 4.0}},
    }  # fmt: skip


def test_conditions_compare_the_cost_policy_with_the_better_of_the_two() -> None:
    runs: dict[str, dict[str, Any]] = {}
    for cond, (ld, rc, co) in {
        "fast": ([0.1, 0.2, 0.3], [1.0, 1.1, 1.2], [0.2, 0.21, 0.25]),
        "slow": ([4.0, 5.0, 6.0], [1.0, 1.1, 1.2], [1.05, 1.5, 2.0]),
        "mixed": ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.6, 0.7, 0.8]),
    }.items():
        r = run(ld, rc, co)
        runs[f"{cond}-load"], runs[f"{cond}-cost"] = r["load"], r["cost"]
    fast, slow, mixed = vllm_cost.conditions(runs)
    assert (fast["better_of_the_two"], slow["better_of_the_two"]) == ("load", "recompute")
    assert fast["cost_over_best"] == pytest.approx(0.21 / 0.2) and fast["target_met"]
    assert slow["cost_over_best"] == pytest.approx(1.5 / 1.1) and not slow["target_met"]
    assert mixed["cost_over_best"] == pytest.approx(0.7) and mixed["cost_decisions"]
