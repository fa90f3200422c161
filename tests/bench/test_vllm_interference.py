"""``bsr bench --engine vllm``, interference section: its flags, figures, targets and a real run.

The figures of a round are checked against values worked out by hand from its timestamps; the
targets against figures on both sides of each threshold; a committed result is re-derived from
its own raw timestamps; and, where ``.venv-vllm`` exists, the section runs for real at tiny
sizes (a 2-layer model, a 512-token prefix, one arrival) and its records are checked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bsr_bench.cli import add_arguments
from bsr_bench.common.document import validate
from bsr_bench.common.stats import BenchError
from bsr_bench.vllm_interference import QUICK_VARIANTS, VARIANTS, Plan, plan_from_namespace
from bsr_bench.vllm_interference_figures import GIB, ratios, round_figures, summarize, targets
from bsr_bench.vllm_ttft import run_vllm

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--engine", "vllm", *argv])


# --------------------------------------------------------------------------- flags
def test_defaults_restore_at_least_one_gib() -> None:
    plan = plan_from_namespace(parse())
    assert plan.variants == tuple(VARIANTS) and plan.arrivals == 7 and plan.decoders == 4
    assert plan.kv_bytes_per_token == 32 * 16 * 128 * 2 * 2 == 256 * 1024
    assert plan.prefix_bytes == plan.prefix_tokens * 256 * 1024 >= GIB
    # vLLM's pool holds the prefix, the new tokens and the decoders twice over
    assert plan.kv_cache_bytes() >= 2 * plan.prefix_bytes
    quick = plan_from_namespace(parse("--quick"))
    assert (quick.prefix_tokens, quick.arrivals, quick.variants) == (1024, 2, QUICK_VARIANTS)


def test_the_schedule_pairs_each_variant_round_with_a_local_hit_round_before_it() -> None:
    kinds = [(r["kind"], r.get("warmup", False)) for r in Plan(arrivals=3).schedule()]
    assert kinds == [("variant", True)] + [("local_hit", False), ("variant", False)] * 3


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--vllm-interference-prefix", "1000"), "--vllm-interference-prefix"),
        (("--vllm-interference-arrivals", "0"), "--vllm-interference-arrivals"),
        (("--vllm-interference-layers", "-1"), "--vllm-interference-layers"),
        (("--vllm-interference-variants", "async_cold,lmcache"), "--vllm-interference-variants"),
        (("--vllm-interference-variants", "sync_cold,sync_cold"), "--vllm-interference-variants"),
    ],
)
def test_bad_flags_name_the_flag(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(BenchError, match=flag):
        plan_from_namespace(parse(*argv))
    with pytest.raises(BenchError, match=flag):  # before any engine starts
        run_vllm(parse(*argv, "--vllm-python", "/nonexistent/python"))


# --------------------------------------------------------------------------- figures
def _round(kind: str, ttft: float, decoders: list[list[float]], **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "warmup": False, "ttft_s": ttft, "cached_tokens": 4096,
            "resident_fraction": None, "decoders": decoders, **kw}  # fmt: skip


def test_round_figures_by_hand() -> None:
    # decoder 0: steps 0.1 s apart before the arrival (at 0), one spanning it (-0.1 -> 0.05),
    # a 0.40 s stall ending with the new request's first token (0.45), then normal steps
    d0 = [-0.30, -0.20, -0.10, 0.05, 0.45, 0.50, 0.55]
    # decoder 1: a 0.9 s gap wholly before the arrival and one after the first token: neither
    # is "during"; its during gaps are 0.05 and 0.4
    d1 = [-1.20, -0.30, -0.05, 0.0, 0.05, 0.45, 1.45]
    f = round_figures(_round("variant", 0.45, [d0, d1]))
    # before: d0 0.1, 0.1; d1 0.9, 0.25, 0.05 -> median 0.1
    assert f["itl_p50_before_s"] == pytest.approx(0.1)
    # during: d0 0.15, 0.40; d1 0.05, 0.40 -> max 0.40, median 0.275
    assert f["max_gap_during_s"] == pytest.approx(0.40)
    assert f["itl_p50_during_s"] == pytest.approx(0.275)
    # delay: d0 0.15 + 0.40 - 2 x 0.1 = 0.35; d1 0.05 + 0.40 - 0.2 = 0.25 -> median 0.30
    assert f["delay_during_s"] == pytest.approx(0.30)
    assert f["ttft_s"] == 0.45


def test_a_round_without_decoder_tokens_around_the_arrival_is_refused() -> None:
    with pytest.raises(BenchError, match="no decoder token"):
        round_figures(_round("variant", 0.3, [[0.1, 0.2, 0.3]]))


def _steady(gap: float, stall: float, ttft: float) -> list[list[float]]:
    """Four decoders stepping every ``gap`` s, one ``stall`` s step ending at the first token."""
    before = [-gap * k for k in range(8, -1, -1)]
    t0 = ttft - stall
    during = [t0 - gap * k for k in range(int(t0 / gap), -1, -1) if t0 - gap * k > 0]
    return [before + during + [ttft, ttft + gap]] * 4


def _variant_result(name: str, stalls: list[float], local: list[float]) -> dict[str, Any]:
    load = VARIANTS[name].load
    rounds = [_round("variant", 1.0, _steady(0.03, 0.5, 1.0), warmup=True,
                     cached_tokens=4096 if load else 0)]  # fmt: skip
    for s, b in zip(stalls, local):
        rounds.append(_round("local_hit", b + 0.05, _steady(0.03, b, b + 0.05)))
        rounds.append(
            _round("variant", 0.6 + s, _steady(0.03, s, 0.6 + s), cached_tokens=4096 if load else 0)
        )
    return {"rounds": rounds, "start_s": 20.0, "load_average": None}


def test_added_stall_is_the_variant_median_max_gap_minus_its_local_hit_median() -> None:
    res = _variant_result("sync_cold", stalls=[0.50, 0.40, 0.70], local=[0.20, 0.18, 0.25])
    v = summarize("sync_cold", res, "sync", "cold", 4096)
    assert v["rounds"]["max_gap_during_s"]["median"] == pytest.approx(0.50)
    assert v["local_hit_rounds"]["max_gap_during_s"]["median"] == pytest.approx(0.20)
    assert v["added_stall_s"] == pytest.approx(0.30)
    # every other gap is the 0.03 s pace: the decode time lost is the stall, to within a step
    assert v["added_delay_s"] == pytest.approx(0.30, abs=0.03)
    # paired: each variant round minus the local-hit round just before it
    assert v["added_stall_paired_s"]["values"] == pytest.approx([0.30, 0.22, 0.45])
    assert v["rounds"]["ttft_s"]["n"] == 3  # the warm-up round is left out
    assert v["hits_as_expected"] is True
    res["rounds"][2]["cached_tokens"] = 3840  # a load that committed less than the prefix
    assert summarize("sync_cold", res, "sync", "cold", 4096)["hits_as_expected"] is False


def _summaries(sync_cold: float, async_cold: float, sync_warm: float, async_warm: float,
               local: float = 0.2) -> dict[str, dict[str, Any]]:  # fmt: skip
    out = {}
    for name, s in (("sync_cold", sync_cold), ("async_cold", async_cold),
                    ("sync_warm", sync_warm), ("async_warm", async_warm),
                    ("recompute", 12.0)):  # fmt: skip
        v = VARIANTS[name]
        out[name] = summarize(
            name, _variant_result(name, [s] * 3, [local] * 3), v.load, v.cache, 4096
        )
    return out


def _by_name(ts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in ts}


def test_targets_met_and_missed() -> None:
    ts = _by_name(targets(_summaries(0.60, 0.22, 0.30, 0.25)))
    # added: sync cold 0.40, async cold 0.02 (met: <= 0.05 and 5% of sync's)
    assert ts["async_added_stall_cold_s"]["value"] == pytest.approx(0.02)
    assert ts["async_added_stall_cold_s"]["met"] is True
    assert ts["async_vs_sync_added_stall_cold"]["value"] == pytest.approx(0.05)
    assert ts["async_vs_sync_added_stall_cold"]["met"] is True
    # warm: sync 0.10, async 0.05 -> 50% of sync's: missed
    assert ts["async_vs_sync_added_stall_warm"]["value"] == pytest.approx(0.5)
    assert ts["async_vs_sync_added_stall_warm"]["met"] is False
    # TTFT = 0.6 + stall: async cold 0.82 / sync 1.2 met; recompute 12.6 / 0.82 >= 10 met
    assert ts["async_vs_sync_ttft_cold"]["value"] == pytest.approx(0.82 / 1.2)
    assert ts["async_vs_sync_ttft_cold"]["met"] is True
    assert ts["recompute_vs_async_ttft_cold"]["value"] == pytest.approx(12.6 / 0.82)
    assert ts["recompute_vs_async_ttft_cold"]["met"] is True
    missed = _by_name(targets(_summaries(0.60, 0.30, 0.30, 0.50)))
    assert missed["async_added_stall_cold_s"]["met"] is False  # 0.10 s > 0.05 s
    assert missed["async_vs_sync_ttft_warm"]["met"] is False  # 1.1 / 0.9 > 1.2
    assert "async 1.100 s, sync 0.900 s" in missed["async_vs_sync_ttft_warm"]["detail"]
    r = ratios(_summaries(0.60, 0.22, 0.30, 0.25))
    assert r["sync_vs_async_ttft_cold"] == pytest.approx(1.2 / 0.82)
    assert r["sync_vs_async_added_stall_cold"] == pytest.approx(0.40 / 0.02)


def test_targets_not_measurable_or_not_run_say_so() -> None:
    # sync adds no stall (its max gap equals the local hit's): the 10% target has no value
    ts = _by_name(targets(_summaries(0.20, 0.21, 0.30, 0.25)))
    assert ts["async_vs_sync_added_stall_cold"]["met"] is None
    assert "sync adds no stall" in ts["async_vs_sync_added_stall_cold"]["detail"]
    only = {"async_cold": _summaries(0.6, 0.2, 0.3, 0.2)["async_cold"]}
    ts = _by_name(targets(only))
    assert ts["async_added_stall_cold_s"]["met"] is True
    assert ts["async_vs_sync_ttft_cold"]["met"] is None
    assert ts["async_vs_sync_ttft_cold"]["detail"] == "not run: needs sync_cold"


# --------------------------------------------------------------------------- real runs
def _committed() -> list[Path]:
    docs = []
    for p in sorted((ROOT / "bench" / "results").glob("vllm-*.json")):
        doc = json.loads(p.read_text())
        if doc.get("tool") == "bsr bench --engine vllm" and doc.get("interference"):
            docs.append(p)
    return docs


@pytest.mark.parametrize("path", _committed(), ids=lambda p: p.name)
def test_a_committed_result_follows_from_its_own_timestamps(path: Path) -> None:
    doc = json.loads(path.read_text())
    validate(doc, "vllm_document")
    sec = doc["interference"]
    prefix = sec["plan"]["prefix_tokens"]
    again = {
        name: summarize(
            name,
            {
                "rounds": v["raw_rounds"],
                "start_s": v["engine_start_s"],
                "load_average": v["load_average"],
            },
            v["load"],
            v["store"],
            prefix,
        )
        for name, v in sec["variants"].items()
    }
    for name, v in again.items():
        assert v["added_stall_s"] == pytest.approx(sec["variants"][name]["added_stall_s"])
        assert v["rounds"] == sec["variants"][name]["rounds"]
    assert targets(again) == sec["targets"] == doc["targets"]
    assert all(v["hits_as_expected"] for v in again.values())


@pytest.mark.slow
@pytest.mark.vllm_env
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make .venv-vllm)")
def test_the_section_runs_at_tiny_sizes(tmp_path: Path) -> None:
    """Two engines (async loads from a cold store, sync loads from a warm one): every load
    brings the whole prefix back, every local-hit round hits vLLM's own cache, the page-cache
    states are what they claim, and the document validates."""
    out = tmp_path / "vllm.json"
    ns = parse(
        "--vllm-sections", "interference", "--vllm-python", str(VLLM_PYTHON),
        "--vllm-interference-layers", "2", "--vllm-interference-prefix", "512",
        "--vllm-interference-arrivals", "1",
        "--vllm-interference-variants", "async_cold,sync_warm", "--json", str(out),
    )  # fmt: skip
    doc = run_vllm(ns)
    assert json.loads(out.read_text())["interference"]["variants"].keys() == {
        "async_cold",
        "sync_warm",
    }
    validate(json.loads(out.read_text()), "vllm_document")
    sec = doc["interference"]
    assert doc["ttft"] is None and sec["store"]["objects"] == 2  # 512 tokens / 256
    assert sec["prefix_bytes"] == 512 * 2 * 16 * 128 * 2 * 2
    assert any("below the issue's 1 GiB" in w for w in doc["warnings"])
    for name, v in sec["variants"].items():
        raw = v["raw_rounds"]
        assert [r["kind"] for r in raw] == ["variant", "local_hit", "variant"]
        assert [r["cached_tokens"] for r in raw] == [512, 512, 512], name
        assert v["hits_as_expected"]
        for r in raw:
            assert len(r["decoders"]) == 4 and r["ttft_s"] > 0
            for stamps in r["decoders"]:
                assert stamps == sorted(stamps) and stamps[0] < 0 < stamps[-1]
    assert sec["variants"]["async_cold"]["resident_fraction"] == [0.0]
    assert sec["variants"]["sync_warm"]["resident_fraction"] == [1.0]
    names = [t["name"] for t in doc["targets"]]
    assert "async_added_stall_cold_s" in names and len(names) == 7
