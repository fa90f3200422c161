"""bsr.testing's key-partition suite against model deployments: it passes a store that keys by
every input, and names the problem of each broken one (a suite that cannot fail proves nothing).
The suite itself runs on vLLM's engine in tests/vllm_connector/test_key_partition.py."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from bsr.testing import (
    Completion,
    PartitionCase,
    Variant,
    assert_key_partition,
    check_key_partition,
)
from bsr.testing._key_partition import draw_prompts, metric_value

CHUNK = 64


class Deployment:
    """A model server with a prefix store. The output depends on the prompt and on a variant's
    ``"model"`` (an adapter); the store keys by the prompt and by the variant fields in ``keys``,
    and a hit serves what the first request stored under that key computed."""

    def __init__(
        self, keys: Sequence[str] = ("cache_salt", "model"), *, hits: bool = True,
        honours_store: bool = True, saves_land: bool = True,
    ) -> None:  # fmt: skip
        self.keys, self.hits = keys, hits
        self.honours_store, self.saves_land = honours_store, saves_land
        self.stored: dict[tuple[object, ...], tuple[object, ...]] = {}  # key -> computed with
        self.saved = 0

    def complete(self, prompt: Sequence[int], variant: Variant, *, store: bool) -> Completion:
        key = (tuple(prompt), *(variant.fields.get(k) for k in self.keys))
        computed_with: tuple[object, ...] = (tuple(prompt), variant.fields.get("model"))
        cached = 0
        if self.hits and key in self.stored:
            computed_with, cached = self.stored[key], (len(prompt) - 1) // CHUNK * CHUNK
        elif store or not self.honours_store:
            self.stored.setdefault(key, computed_with)
            self.saved += self.saves_land
        tokens = tuple(hashlib.sha256(repr(computed_with).encode()).digest()[:8])
        return Completion(tokens, cached)

    def saves(self) -> float:
        return float(self.saved)


CASES = [
    PartitionCase(
        "cache_salt",
        Variant("alice", {"cache_salt": "alice"}),
        Variant("bob", {"cache_salt": "bob"}),
        changes_output=False,
    ),
    PartitionCase("lora", Variant("base", {}), Variant("adapter", {"model": "a"})),
]  # fmt: skip


def problems(dep: Deployment, cases: list[PartitionCase] = CASES) -> list[str]:
    reports = check_key_partition(dep, cases, chunk_tokens=CHUNK, seed=3, save_timeout_s=0.5)
    return [f"{r.case.kind}: {p}" for r in reports for p in r.problems]


def test_a_store_keyed_by_every_input_passes() -> None:
    dep = Deployment()
    reports = check_key_partition(dep, CASES, chunk_tokens=CHUNK, seed=3)
    assert_key_partition(reports)
    assert [r.hit.cached_tokens for r in reports] == [192, 192]
    assert [list(r.prompt) for r in reports] == draw_prompts(CASES, 3)


@pytest.mark.parametrize(
    ("dep", "kind", "fragment"),
    [
        (Deployment(keys=("model",)), "cache_salt", "one cache_salt's KV served to another"),
        (Deployment(keys=("cache_salt",)), "lora", "one lora's KV served to another"),
        (Deployment(keys=("cache_salt",)), "lora", "differ from its own reference"),
        (Deployment(hits=False), "cache_salt", "must still hit"),
        (Deployment(honours_store=False), "cache_salt", "served 192 cached tokens"),
    ],
    ids=["salt-ignored", "adapter-ignored", "adapter-ignored-tokens", "never-hits", "stores-refs"],
)
def test_a_broken_store_is_named(dep: Deployment, kind: str, fragment: str) -> None:
    found = problems(dep)
    assert any(p.startswith(kind) and fragment in p for p in found), found
    with pytest.raises(AssertionError, match="key partition broken"):
        assert_key_partition(check_key_partition(dep, CASES, chunk_tokens=CHUNK, seed=4))


def test_the_control_catches_values_that_do_not_change_the_output() -> None:
    same = [
        PartitionCase("lora", Variant("x", {"cache_salt": "1"}), Variant("y", {"cache_salt": "2"}))
    ]
    assert any("control" in p for p in problems(Deployment(), same))


def test_a_save_that_never_lands_is_an_error_not_a_pass() -> None:
    with pytest.raises(AssertionError, match="did not land"):
        problems(Deployment(saves_land=False))


def test_metric_value_sums_the_matching_samples() -> None:
    text = "\n".join([
        "# HELP vllm:bsr_saves_total x",
        'vllm:bsr_saves_total{engine="0",model_name="/m,1"} 2.0',
        'vllm:bsr_saves_total{engine="1",model_name="/m,1"} 1.0',
        'vllm:bsr_saves_skipped_total{engine="0",reason="opt_out"} 3.0',
        'vllm:bsr_saves_skipped_total{engine="0",reason="busy"} 1.0',
        "vllm:bsr_saves 9.0",
    ])  # fmt: skip
    assert metric_value(text, "vllm:bsr_saves_total") == 3.0
    assert metric_value(text, "vllm:bsr_saves_total", engine="1") == 1.0
    assert metric_value(text, "vllm:bsr_saves_skipped_total", reason="opt_out") == 3.0
    assert metric_value(text, "vllm:bsr_saves") == 9.0
    assert metric_value(text, "vllm:bsr_missing") == 0.0
