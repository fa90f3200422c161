"""``bsr bench --engine vllm --vllm-model gemma3-tiny``: flags, argument checks, the document's
arithmetic (the figures need vLLM; ``docs/vllm.md`` gives the command)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bsr_bench import vllm_hybrid, vllm_ttft
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
