"""The HCache bench's derived figures: the planner's regret against every measured plan
(recompute included), each plan's regime, and the targets over the points at 1K tokens and
above, on documents built here (the measured runs are the bench's and the GPU dry run's)."""

from __future__ import annotations

from typing import Any

import pytest

from bsr_bench import hcache as bench


def _run(total: float, io: float, rebuild: float = 0.0, recompute: float = 0.0) -> dict[str, Any]:
    d = lambda v: {"min": v, "median": v, "max": v, "n": 1}  # noqa: E731
    return {
        "total_s": d(total),
        "io_s": d(io),
        "rebuild_s": d(rebuild),
        "recompute_s": d(recompute),
    }


def _tier(kv: float, hc: float, planner: float, tier: str = "file") -> dict[str, Any]:
    return {
        "tier": tier,
        "kv": _run(kv, kv),
        "hcache": _run(hc, hc / 4, rebuild=hc * 3 / 4),
        "planner": _run(planner, planner),
    }


@pytest.mark.parametrize(
    ("recompute", "kv", "hc", "planner", "best", "regret"),
    [
        (10.0, 1.0, 4.0, 1.0, "kv", 1.0),  # chose the fastest
        (10.0, 1.0, 0.5, 1.0, "hcache", 2.0),  # hidden states were faster: regret 2
        (0.8, 1.0, 4.0, 1.0, "recompute", 1.25),  # recompute counts as a plan
    ],
)
def test_regret_is_the_chosen_plan_over_the_best_measured_one(
    recompute: float, kv: float, hc: float, planner: float, best: str, regret: float
) -> None:
    point = {"recompute_s": {"median": recompute}}
    t = _tier(kv, hc, planner)
    bench._add_ratios(point, t, "cpu")
    assert t["best_measured"] == best
    assert t["planner_regret"] == pytest.approx(regret)


@pytest.mark.parametrize(
    ("tier", "device", "bound"),
    [
        ("file", "cpu", "storage-bound"),
        ("host", "cpu", "memory-bound"),
        ("host", "cuda", "PCIe-bound"),
    ],
)
def test_regime_follows_the_measured_times(tier: str, device: str, bound: str) -> None:
    t = _tier(1.0, 4.0, 1.0, tier)
    bench._add_ratios({"recompute_s": {"median": 9.0}}, t, device)
    assert t["regime"]["kv"] == bound  # reads only
    assert t["regime"]["hcache"] == "compute-bound"  # rebuild 3 s against 1 s of reads


def test_targets_hold_only_points_of_1k_tokens_and_above() -> None:
    doc: dict[str, Any] = {
        "args": {"device": "cpu"},
        "results": [
            {"tokens": 256, "rebuild_vs_gemm": 9.0, "planner_regret": 9.0},
            {"tokens": 1024, "rebuild_vs_gemm": 1.2, "planner_regret": 1.0},
            {"tokens": 4096, "rebuild_vs_gemm": 1.35, "planner_regret": 1.05},
        ],
    }
    got = bench._targets(doc)
    assert got["rebuild_vs_gemm"] == {"limit": 1.3, "worst": 1.35, "met": False}
    assert got["planner_regret"] == {"limit": 1.1, "worst": 1.05, "met": True}
    doc["args"]["device"] = "cuda:0"
    assert bench._targets(doc)["rebuild_vs_gemm"]["met"] is True  # 1.5 on a GPU
    doc["results"] = doc["results"][:1]
    assert bench._targets(doc)["planner_regret"] == {"limit": 1.1, "worst": None, "met": None}
