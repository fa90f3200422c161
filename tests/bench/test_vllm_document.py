"""``bsr bench --engine vllm``: the document a run writes, built from its engines' outputs.

The sections are built by the bench's own code (``ttft_section``, ``interference.section``,
``document``) from child outputs shaped like the engines' (the real engines' outputs are checked
by the slow tests and by the committed results), and the schema is shown to refuse what a broken
run would write.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bsr_bench.cli import add_arguments
from bsr_bench.common.document import validate
from bsr_bench.common.stats import BenchError
from bsr_bench.vllm_interference import VARIANTS, Plan, section
from bsr_bench.vllm_ttft import Options, document, options_from_namespace, ttft_point, ttft_section

MACHINE = {
    "cpu": "test cpu",
    "cores_logical": 2,
    "memory_bytes": 1 << 34,
    "load_average_start": [1.0, 1.0, 1.0],
    "load_average_end": [2.0, 1.5, 1.0],
}
COMMIT = {"id": "0" * 40, "dirty": False}
ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--engine", "vllm", "--vllm-python", "/nonexistent/python", *argv])


def _engine(
    prefixes: tuple[int, ...], ttft: float, hit: int | None, start_s: float = 15.0
) -> dict[str, Any]:
    """A TTFT child's output: three samples per prefix around ``ttft`` x prefix / 1024."""
    points = []
    for n in prefixes:
        t = ttft * n / 1024
        points.append(
            {
                "prefix_tokens": n,
                "ttft_s": [t * 1.1, t, t * 0.95],
                "cached_tokens": [n if hit is None else hit] * 3,
            }
        )
    return {"mode": "x", "points": points, "start_s": start_s, "load_average": [[1.0, 1, 1], None]}


def _ttft_runs(prefixes: tuple[int, ...] = (1024, 2048)) -> dict[str, dict[str, Any]]:
    rec = _engine(prefixes, 0.5, None)
    for p in rec["points"]:
        p["cached_tokens"] = [0, 0, 0]
    return {
        "recompute": rec,
        "bsr": _engine(prefixes, 0.06, None),
        "bsr_sync": _engine(prefixes, 0.05, None),
        "offloading": {"error": "RuntimeError: CPU Offloading is currently only supported on CUDA",
                       "returncode": 1},
    }  # fmt: skip


def _round(kind: str, ttft: float, stall: float, hit: int) -> dict[str, Any]:
    gap = 0.03
    before = [-gap * k for k in range(8, -1, -1)]
    t0 = ttft - stall
    during = [t0 - gap * k for k in range(int(t0 / gap), -1, -1) if t0 - gap * k > 0]
    stamps = before + during + [ttft, ttft + gap]
    return {"kind": kind, "warmup": False, "ttft_s": ttft, "cached_tokens": hit,
            "resident_fraction": None, "decoders": [stamps] * 4}  # fmt: skip


def _rounds(name: str, prefix: int, stall: float) -> dict[str, Any]:
    hit = prefix if VARIANTS[name].load else 0
    rounds = [{**_round("variant", 1.0, stall, hit), "warmup": True}]
    for _ in range(2):
        rounds += [
            _round("local_hit", 0.3, 0.2, prefix),
            _round("variant", 0.6 + stall, stall, hit),
        ]
    return {"start_s": 20.0, "load_average": [[1.0, 1.0, 1.0], [2.0, 1.0, 1.0]],
            "max_num_batched_tokens": 8192, "chunked_prefill": True, "rounds": rounds}  # fmt: skip


def _interference(plan: Plan) -> dict[str, Any]:
    stalls = {"sync_cold": 0.6, "async_cold": 0.22, "sync_warm": 0.3, "async_warm": 0.21,
              "recompute": 12.0}  # fmt: skip
    results = {n: _rounds(n, plan.prefix_tokens, stalls[n]) for n in plan.variants}
    stored = {"objects": plan.prefix_tokens // 256, "object_bytes": plan.prefix_bytes,
              "prefill_s": 10.0}  # fmt: skip
    return section(plan, {"params": 80_000_000}, stored, results, {"store_s": 60.0}, 600.0)


def _document(opts: Options) -> dict[str, Any]:
    ttft = ttft_section(_ttft_runs(opts.prefixes), opts.repeats, 100.0)
    inter = _interference(opts.plan) if "interference" in opts.sections else None
    return document(
        opts,
        version="0.32.0",
        machine=dict(MACHINE),
        commit=dict(COMMIT),
        started_at="2026-12-01T19:00:00Z",
        duration_s=700.0,
        ttft=ttft if "ttft" in opts.sections else None,
        inter=inter,
    )


def test_a_document_with_both_sections_validates() -> None:
    opts = options_from_namespace(parse("--vllm-prefixes", "1024,2048"))
    doc = _document(opts)
    assert doc["args"]["sections"] == ["ttft", "interference"]
    assert doc["targets"] == doc["interference"]["targets"] and len(doc["targets"]) == 7
    met = {t["name"]: t["met"] for t in doc["targets"]}
    # async cold adds 0.02 s over its local hit, sync cold 0.40 s: 5% of it
    assert met["async_added_stall_cold_s"] is True and met["async_vs_sync_added_stall_cold"]
    p = doc["ttft"]["points"][1]
    assert p["prefix_tokens"] == 2048 and p["speedup_vs_recompute"] == pytest.approx(0.5 / 0.06)
    assert p["async_vs_sync_ttft"] == pytest.approx(0.06 / 0.05)
    assert doc["ttft"]["offloading_connector"]["ran"] is False
    assert doc["warnings"] == []
    validate(doc, "vllm_document")  # document() validated it; once more, explicitly


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda d: d["ttft"]["points"][0].pop("bsr_sync_ttft_s"), "ttft/points/0"),
        (lambda d: d["ttft"]["points"][0].update(async_vs_sync_ttft=0.0), "async_vs_sync_ttft"),
        (lambda d: d["ttft"]["points"][0].update(bsr_cached_tokens=[]), "bsr_cached_tokens"),
        (lambda d: d["ttft"].pop("load_average"), "/ttft"),
        (lambda d: d["interference"]["variants"]["async_cold"].pop("added_stall_s"), "async_cold"),
        (lambda d: d["targets"][0].update(met="yes"), "targets/0/met"),
        (lambda d: d["args"].update(sections=["ttft", "stalls"]), "args/sections"),
        (lambda d: d.update(interference=None, ttft={"points": []}), "/ttft"),
    ],
)
def test_the_schema_refuses_a_broken_document(break_it: Any, where: str) -> None:
    doc = _document(options_from_namespace(parse("--vllm-prefixes", "1024")))
    bad = copy.deepcopy(doc)
    break_it(bad)
    with pytest.raises(BenchError, match=r"does not match schema\.json") as err:
        validate(bad, "vllm_document")
    assert where in str(err.value)


def test_a_non_finite_figure_is_refused() -> None:
    doc = _document(options_from_namespace(parse("--vllm-sections", "ttft")))
    assert doc["interference"] is None and doc["targets"] == []
    doc["ttft"]["points"][0]["bsr_ttft_s"]["median"] = math.nan
    with pytest.raises(BenchError, match=r"non-finite number at .*bsr_ttft_s"):
        validate(doc, "vllm_document")


def test_ttft_point_by_hand() -> None:
    rec = {"prefix_tokens": 4096, "ttft_s": [3.0, 1.0, 2.0], "cached_tokens": [0, 0, 0]}
    asy = {"prefix_tokens": 4096, "ttft_s": [0.3, 0.2, 0.1], "cached_tokens": [4096] * 3}
    syn = {"prefix_tokens": 4096, "ttft_s": [0.15, 0.5, 0.1], "cached_tokens": [4096] * 3}
    p = ttft_point(rec, asy, syn)
    # medians: recompute 2.0, async 0.2, sync 0.15
    assert p["speedup_vs_recompute"] == pytest.approx(10.0)
    assert p["sync_speedup_vs_recompute"] == pytest.approx(2.0 / 0.15)
    assert p["async_vs_sync_ttft"] == pytest.approx(0.2 / 0.15)
    assert p["bsr_sync_ttft_s"]["values"] == [0.15, 0.5, 0.1]
    with pytest.raises(BenchError, match="different prefix lengths"):
        ttft_point(rec, {**asy, "prefix_tokens": 2048}, syn)


def test_ttft_section_needs_recompute_and_both_load_modes() -> None:
    runs = _ttft_runs()
    runs["bsr_sync"] = {"error": "ValueError: bad option", "returncode": 1}
    with pytest.raises(BenchError, match="the bsr_sync engine failed: ValueError: bad option"):
        ttft_section(runs, 3, 1.0)
    runs = _ttft_runs()
    runs["bsr"]["points"].pop()  # an engine that measured fewer prefixes
    with pytest.raises(ValueError):
        ttft_section(runs, 3, 1.0)


def test_a_short_hit_is_a_warning() -> None:
    runs = _ttft_runs((1024, 2048))
    runs["bsr_sync"]["points"][1]["cached_tokens"] = [2048, 1792, 2048]
    sec = ttft_section(runs, 3, 1.0)
    assert sec["warnings"] == [
        "ttft: a bsr_sync request at prefix 2048 hit fewer tokens than the prefix "
        "(see bsr_cached_tokens / bsr_sync_cached_tokens)"
    ]


def test_an_interference_section_without_a_variant_s_rounds_is_refused() -> None:
    plan = Plan(variants=("sync_cold", "async_cold"))
    stored = {"objects": 16, "object_bytes": plan.prefix_bytes, "prefill_s": 1.0}
    results = {"sync_cold": _rounds("sync_cold", plan.prefix_tokens, 0.5)}
    with pytest.raises(BenchError, match="no rounds for async_cold"):
        section(plan, {"params": 1}, stored, results, {}, 1.0)


def _committed_ttft() -> list[Path]:
    docs = []
    for p in sorted((ROOT / "bench" / "results").glob("vllm-*.json")):
        doc = json.loads(p.read_text())
        if doc.get("tool") == "bsr bench --engine vllm" and doc.get("ttft"):
            docs.append(p)
    return docs


@pytest.mark.parametrize("path", _committed_ttft(), ids=lambda p: p.name)
def test_a_committed_ttft_table_follows_from_its_own_samples(path: Path) -> None:
    doc = json.loads(path.read_text())
    validate(doc, "vllm_document")
    for p in doc["ttft"]["points"]:
        n = p["prefix_tokens"]

        def engine(key: str, hits: str, p: dict[str, Any] = p, n: int = n) -> dict[str, Any]:
            return {"prefix_tokens": n, "ttft_s": p[key]["values"], "cached_tokens": p[hits]}

        again = ttft_point(
            engine("recompute_ttft_s", "recompute_cached_tokens"),
            engine("bsr_ttft_s", "bsr_cached_tokens"),
            engine("bsr_sync_ttft_s", "bsr_sync_cached_tokens"),
        )
        assert again == p
        assert min(p["bsr_cached_tokens"] + p["bsr_sync_cached_tokens"]) == n
