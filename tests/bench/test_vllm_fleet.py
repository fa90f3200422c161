"""``bsr bench --engine vllm --vllm-fleet``: the flag picks the program, bad arguments are bench
errors, the workload spreads conversations over instances under round-robin, the statistics and
ratios, the schema; and (vLLM's environment) the section at tiny sizes."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bsr_bench import vllm_fleet
from bsr_bench.cli import add_arguments, program
from bsr_bench.common.document import validate
from bsr_bench.common.stats import BenchError

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_flag_picks_the_program_and_bad_arguments_are_bench_errors() -> None:
    ns = parse("--engine", "vllm", "--vllm-fleet")
    assert program(ns)[1] is vllm_fleet.run_from_namespace
    p = vllm_fleet.plan(ns)
    assert (p["workload"].conversations, p["workload"].turns, p["workload"].prefix_tokens) == (
        5, 4, 1024,
    )  # fmt: skip
    assert (p["gpu_tokens"], p["pd_prompts"]) == (4096, 4)
    quick = vllm_fleet.plan(parse("--vllm-fleet", "--quick"))
    assert (quick["workload"].conversations, quick["workload"].turns, quick["pd_prompts"]) == (
        4, 3, 2,
    )  # fmt: skip
    for argv, match in [
        (("--vllm-fleet-conversations", "6"), "not be a multiple of 3"),
        (("--vllm-fleet-conversations", "1"), ">= 2"),
        (("--vllm-fleet-turns", "1"), "a returning turn"),
        (("--vllm-fleet-prefix", "100"), ">= 256 tokens"),
        (("--vllm-fleet-gpu-tokens", "1024"), "must hold the last turn"),
        (("--vllm-fleet-pd-prompts", "0"), ">= 1"),
    ]:
        with pytest.raises(BenchError, match=match):
            vllm_fleet.plan(parse("--vllm-fleet", *argv))


def test_turns_grow_by_answer_and_user_tokens_and_move_between_instances() -> None:
    w = vllm_fleet.Workload(conversations=5, turns=4, prefix_tokens=768)
    assert [w.prompt_tokens(r) for r in range(4)] == [768, 1040, 1312, 1584]
    assert w.max_model_len() == 1664  # 1584 + 16 in whole 128-token blocks
    waves = w.waves()
    assert [len(x) for x in waves] == [3, 2] * 4
    for wave in waves:  # a wave never holds two turns of one conversation
        assert len({k for k, _ in wave}) == len(wave)
    order = [pair for wave in waves for pair in wave]
    assert order == [(k, r) for r in range(4) for k in range(5)]
    rr = w.round_robin()
    for k, where in rr.items():  # consecutive turns on different instances, three in all
        assert all(a != b for a, b in itertools.pairwise(where)), (k, where)
        assert len(set(where)) == 3
    # a multiple of three would pin each conversation to one instance: refused
    assert set(map(len, map(set, vllm_fleet.Workload(6, 4, 768).round_robin().values()))) == {1}
    # the user parts: reproducible, distinct per conversation and turn, the right lengths
    assert w.user_part(1, 2) == w.user_part(1, 2) != w.user_part(2, 2)
    assert (len(w.user_part(0, 0)), len(w.user_part(0, 1))) == (768, 256)


def test_percentiles_interpolate_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert vllm_fleet.percentile(xs, 50) == 2.5
    assert vllm_fleet.percentile(xs, 99) == pytest.approx(3.97)
    assert vllm_fleet.percentile([7.0], 99) == 7.0
    with pytest.raises(BenchError, match="no samples"):
        vllm_fleet.percentile([], 50)
    with pytest.raises(BenchError, match="0-100"):
        vllm_fleet.percentile(xs, 101)


def sample(k: int, r: int, ttft: float, prompt: int, cached: int, where: str) -> dict[str, Any]:
    return {
        "conversation": k, "turn": r, "ttft_s": ttft, "latency_s": ttft + 0.1,
        "prompt_tokens": prompt, "cached_tokens": cached, "instance": where,
    }  # fmt: skip


def variant(returning_ttft: float, cached: int) -> list[dict[str, Any]]:
    return [
        sample(0, 0, 1.0, 512, 0, "a"),
        sample(1, 0, 1.2, 512, 0, "b"),
        sample(0, 1, returning_ttft, 1000, cached, "b"),
        sample(1, 1, returning_ttft * 2, 1000, cached, "c"),
    ]


def measured() -> dict[str, Any]:
    ttft = {"private_rr": 1.0, "shared_rr": 0.3, "shared_router": 0.2, "vllm_rr": 1.1}
    cached = {"private_rr": 0, "shared_rr": 768, "shared_router": 896, "vllm_rr": 0}
    pd = [
        {"prompt_tokens": 1040, "split_s": 2.0, "single_s": 1.5, "decode_prefilled": 16,
         "single_cached": 0},
        {"prompt_tokens": 1040, "split_s": 3.0, "single_s": 1.5, "decode_prefilled": 16,
         "single_cached": 0},
    ]  # fmt: skip
    return {
        "variants": {
            k: {"samples": variant(ttft[k], cached[k]), "decisions": {"a": 1, "b": 2, "c": 1}}
            for k in vllm_fleet.VARIANTS
        },
        "pd": {"samples": pd, "stats": {"await_timeouts": 0}},
        "engine_start_s": {"private": 40.0, "shared": 41.0, "alone": 30.0, "pd": 35.0},
        "load_average": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]],
    }


def test_the_section_splits_returning_turns_and_computes_ratios_and_the_target() -> None:
    w = vllm_fleet.Workload(conversations=2, turns=2, prefix_tokens=512)
    sec = vllm_fleet.fleet_section(measured(), w, 4096, 300.0)
    v = sec["variants"]
    back = v["shared_router"]["returning"]
    assert (back["requests"], back["prompt_tokens"], back["cached_tokens"]) == (2, 2000, 1792)
    assert back["hit_rate"] == pytest.approx(0.896)
    assert back["ttft_s"]["p50"] == pytest.approx(0.3)  # 0.2 and 0.4
    assert back["ttft_s"]["p99"] == pytest.approx(0.398)
    assert v["private_rr"]["returning"]["hit_rate"] == 0.0
    assert v["private_rr"]["first_turn"]["ttft_s"]["p50"] == pytest.approx(1.1)
    assert v["shared_rr"]["instances_per_conversation"] == {"0": 2, "1": 2}
    assert sec["ratios"] == pytest.approx(
        {"shared_rr_vs_private_rr": 0.3, "shared_router_vs_private_rr": 0.2,
         "vllm_rr_vs_private_rr": 1.1}
    )  # fmt: skip
    assert sec["target"]["speedup"] == pytest.approx(5.0) and sec["target"]["met"] is True
    pd = sec["pd"]
    assert (pd["prompt_tokens"], pd["decode_prefilled_tokens"]) == (2080, 32)
    assert pd["single_prefilled_tokens"] == 2080
    assert pd["split_vs_single"] == pytest.approx(2.5 / 1.5)
    assert sec["workload"]["prompt_tokens_by_turn"] == [512, 784]
    # slower than 3x: the target says so
    slow = measured()
    for s in slow["variants"]["shared_router"]["samples"]:
        s["ttft_s"] *= 2
    assert vllm_fleet.fleet_section(slow, w, 4096, 1.0)["target"]["met"] is False


def test_a_variant_without_returning_turns_is_an_error() -> None:
    m = measured()
    m["variants"]["vllm_rr"]["samples"] = [s for s in variant(1.0, 0) if s["turn"] == 0]
    with pytest.raises(BenchError, match="first and returning turns"):
        vllm_fleet.fleet_section(m, vllm_fleet.Workload(2, 2, 512), 4096, 1.0)


def document(sec: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": 1, "tool": "bsr bench --engine vllm --vllm-fleet",
        "started_at": "2026-12-07T00:00:00Z", "duration_s": 300.0, "argv": [],
        "args": {"quick": False, "conversations": 2, "turns": 2, "prefix_tokens": 512,
                 "gpu_tokens": 4096, "pd_prompts": 2},
        "seed": 0, "vllm": "0.0", "model": {}, "block_size": 128, "chunk_tokens": 256,
        "fleet": sec,
        "machine": {"cpu": "x", "cores_logical": 2, "memory_bytes": 1,
                    "load_average_start": None, "load_average_end": None},
        "commit": {"id": None, "dirty": None}, "warnings": [],
    }  # fmt: skip


def test_the_document_validates_and_the_schema_refuses_a_missing_variant() -> None:
    sec = vllm_fleet.fleet_section(measured(), vllm_fleet.Workload(2, 2, 512), 4096, 1.0)
    doc = json.loads(json.dumps(document(sec)))
    validate(doc, "fleet_document")
    del doc["fleet"]["variants"]["vllm_rr"]
    with pytest.raises(BenchError, match="vllm_rr"):
        validate(doc, "fleet_document")
    doc = json.loads(json.dumps(document(sec)))
    doc["fleet"]["variants"]["shared_rr"]["returning"]["hit_rate"] = 1.5
    with pytest.raises(BenchError, match="hit_rate"):
        validate(doc, "fleet_document")


@pytest.mark.slow
@pytest.mark.vllm_env
@pytest.mark.bench_run  # twelve engine starts: make test-bench-runs, not make test
@pytest.mark.timeout(900)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make .venv-vllm)")
def test_the_fleet_section_runs_at_tiny_sizes(tmp_path: Path) -> None:
    """Every phase at its smallest: two conversations of two turns, one P/D prompt. The pool
    serves returning turns that private caches under round-robin cannot, and the decode side
    prefills less than the prompt."""
    out = tmp_path / "fleet.json"
    doc = vllm_fleet.run_from_namespace(
        parse(
            "--engine", "vllm", "--vllm-fleet", "--vllm-python", str(VLLM_PYTHON),
            "--vllm-fleet-conversations", "2", "--vllm-fleet-turns", "2",
            "--vllm-fleet-prefix", "512", "--vllm-fleet-pd-prompts", "1", "--json", str(out),
        )
    )  # fmt: skip
    validate(json.loads(out.read_text()), "fleet_document")
    sec = doc["fleet"]
    assert set(sec["variants"]) == set(vllm_fleet.VARIANTS)
    rates = {k: v["returning"]["hit_rate"] for k, v in sec["variants"].items()}
    assert all(0.0 <= r <= 1.0 for r in rates.values())
    assert rates["shared_router"] > rates["private_rr"]
    assert rates["shared_rr"] > rates["private_rr"]
    for v in sec["variants"].values():  # every returning turn was served where it was routed
        assert sum(v["decisions"].values()) == len(v["samples"])
    pd = sec["pd"]
    assert pd["decode_prefilled_tokens"] < pd["prompt_tokens"]
    assert pd["single_prefilled_tokens"] == pd["prompt_tokens"]


def test_the_committed_runs_validate_and_report_every_variant() -> None:
    runs = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("vllm-fleet-*"))
    assert runs, "no committed fleet run in bench/results"
    for path in runs:
        doc = json.loads(path.read_text())
        validate(doc, "fleet_document")
        fleet = doc["fleet"]
        assert fleet["target"]["speedup"] == pytest.approx(
            1 / fleet["ratios"]["shared_router_vs_private_rr"]
        )
