"""``bsr bench --engine vllm --vllm-model gemma3-tiny``: flags, argument checks, the document's
arithmetic (the figures need vLLM; ``docs/vllm.md`` gives the command)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bsr_bench import vllm_checkpoints, vllm_hybrid, vllm_ttft
from bsr_bench.cli import add_arguments, program
from bsr_bench.common.stats import BenchError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_model_flag_picks_the_program() -> None:
    assert program(parse("--engine", "vllm"))[1] is vllm_ttft.run_from_namespace
    ns = parse("--engine", "vllm", "--vllm-model", "gemma3-tiny")
    assert program(ns)[1] is vllm_hybrid.run_from_namespace
    with pytest.raises(SystemExit):
        parse("--engine", "vllm", "--vllm-model", "mistral")


def test_bad_arguments_are_bench_errors() -> None:
    ns = parse("--engine", "vllm", "--vllm-model", "gemma3-tiny", "--vllm-prefixes", "512")
    with pytest.raises(BenchError, match="at least 1024"):  # twice the window
        vllm_hybrid.run_hybrid(ns)
    ns = parse("--engine", "vllm", "--vllm-model", "gemma3-tiny", "--vllm-prefixes", "1100")
    with pytest.raises(BenchError, match="multiples of 256"):
        vllm_hybrid.run_hybrid(ns)
    ns = parse("--engine", "vllm", "--vllm-model", "gemma3-tiny", "--vllm-repeats", "0")
    with pytest.raises(BenchError, match=">= 1"):
        vllm_hybrid.run_hybrid(ns)


def _point(mode: str, ttft: list[float], loaded: float | None) -> dict[str, Any]:
    p: dict[str, Any] = {"prefix_tokens": 1024, "ttft_s": ttft, "cached_tokens": [1024]}
    if loaded is not None:
        p.update(loaded_bytes_per_restore=loaded, stored_bytes=2 * loaded, stored_objects=3)
    return p


def test_points_label_each_mode_and_take_ratios_of_medians() -> None:
    runs = {
        "recompute": {"points": [_point("recompute", [0.9, 1.0, 5.0], None)]},
        "hybrid": {"points": [_point("hybrid", [0.1, 0.2, 0.3], 1.75)]},
        "one_group": {"points": [_point("one_group", [0.3, 0.4, 0.5], 3.0)]},
    }
    runs["hybrid"]["points"][0]["cached_tokens"] = [960]
    (p,) = vllm_hybrid._points(runs)
    assert p["recompute_ttft_s"]["median"] == 1.0 and p["hybrid_ttft_s"]["median"] == 0.2
    assert p["hybrid_cached_tokens"] == [960] and p["one_group_cached_tokens"] == [1024]
    assert (p["hybrid_loaded_bytes_per_restore"], p["one_group_stored_bytes"]) == (1.75, 6.0)
    assert p["bytes_one_group_over_hybrid"] == pytest.approx(3.0 / 1.75)
    assert p["ttft_recompute_over_hybrid"] == pytest.approx(5.0)
    assert p["ttft_one_group_over_hybrid"] == pytest.approx(2.0)


# --------------------------------------------------------------------------- checkpoints
def test_sections_and_intervals_are_checked_before_any_engine() -> None:
    ns = parse("--engine", "vllm", "--vllm-model", "gemma3-tiny", "--vllm-sections", "ttft")
    with pytest.raises(BenchError, match="manager, checkpoints"):
        vllm_hybrid.run_hybrid(ns)
    ns = parse(
        "--engine", "vllm", "--vllm-model", "gemma3-tiny", "--vllm-sections", "checkpoints",
        "--vllm-checkpoint-intervals", "4,0",
    )  # fmt: skip
    with pytest.raises(BenchError, match="positive chunk counts"):
        vllm_hybrid.run_hybrid(ns)
    assert vllm_checkpoints.parse_intervals("1, 8,none") == (1, 8, None)
    assert vllm_hybrid.sections_of(parse("--engine", "vllm")) == ("manager", "checkpoints")


def test_ideal_hits_are_the_longest_shared_full_chunks_a_lookup_asks_for() -> None:
    a = list(range(10))
    prompts = [a, [*a[:7], 99, 98], a, a[:4]]
    # chunk 2: a lookup asks for every full chunk but the one with the prompt's last token
    assert vllm_checkpoints.ideal_hits(prompts, 2) == [0, 6, 8, 2]
    w = vllm_checkpoints.workload(0, 4096)
    n = len(vllm_checkpoints.DOCUMENTS) * len(vllm_checkpoints.QUESTIONS)
    assert len(w) == 2 * n and w[:n] == w[n:]
    ideal = vllm_checkpoints.ideal_hits(w, 256)
    # a document's first question shares nothing; the next ones its full chunks; again: all
    assert ideal[0] == 0 and ideal[1] == 1100 // 256 * 256
    assert ideal[n:] == [(len(p) - 1) // 256 * 256 for p in w[n:]]


def test_checkpoint_section_arithmetic() -> None:
    prompts = [[1] * 600, [1] * 600, [1] * 600, [1] * 600]
    ideal = [0, 512, 512, 512]
    run = {
        "every": 4, "cached_tokens": [0, 256, 512, 512], "ttft_s": [1.0, 0.5, 0.2, 0.3],
        "loaded_bytes": 9.0, "start_s": 1.0,
        "store": {"kv0": {"objects": 3, "bytes": 30}, "kv1": {"objects": 1, "bytes": 10}},
    }  # fmt: skip
    sec = vllm_checkpoints.section([run], prompts, ideal)
    (p,) = sec["points"]
    assert (p["stored_bytes"], p["stored_bytes_full"], p["stored_bytes_sliding"]) == (40, 30, 10)
    assert p["hit_rate_shared"] == pytest.approx(256 / 512)  # first pass: request 1 only
    assert p["hit_rate_again"] == pytest.approx(1.0)
    assert p["ttft_s_shared"]["median"] == 0.5
    assert sec["ideal_tokens_first_pass"] == 512 and sec["ideal_tokens_second_pass"] == 1024
