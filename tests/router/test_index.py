"""The router's index against an independent model of what each instance holds.

Events are made the way vLLM makes them: every instance names a block by its own hash (a
per-instance seed, as without a fleet-wide ``PYTHONHASHSEED``), a ``BlockStored`` run carries
its parent's hash, its tokens and each block's extra keys (the ``cache_salt`` on the first
block). The model keeps, per instance and medium, the set of token prefixes held (with the
salt), and which prefixes an instance ever announced (a run whose parent it never announced is
not indexed); the index must agree with it on every prompt after every operation.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bsr.router import FleetIndex, PrefixPolicy, RoundRobinPolicy, block_digests

B = 4  # block size
INSTANCES = ("a", "b", "c")
MEDIA = ("GPU", "CPU", "STORAGE")
#: a few prompts sharing prefixes (block 0 shared by all, block 1 by the first two), two salts
BASE = [1, 2, 3, 4]
PROMPTS = [
    [*BASE, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    [*BASE, 5, 6, 7, 8, 20, 21, 22, 23],
    [*BASE, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42],
    [50, 51, 52, 53, 54, 55, 56, 57],
]
SALTS = (None, "tenant-2")


def vllm_hash(instance: str, salt: str | None, tokens: list[int]) -> bytes:
    """An instance's own name for the block ending ``tokens`` (its seed is its name)."""
    return hashlib.sha256(repr((instance, salt, tokens)).encode()).digest()[:8]


def extra(salt: str | None, block: int) -> list[Any] | None:
    return [salt] if salt and block == 0 else None


def stored(instance: str, medium: str, p: int, salt: str | None, a: int, b: int) -> dict:
    toks = PROMPTS[p]
    return {
        "type": "BlockStored",
        "block_hashes": [vllm_hash(instance, salt, toks[: (i + 1) * B]) for i in range(a, b)],
        "parent_block_hash": vllm_hash(instance, salt, toks[: a * B]) if a else None,
        "token_ids": toks[a * B : b * B],
        "block_size": B,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [extra(salt, i) for i in range(a, b)],
    }


def removed(instance: str, medium: str, p: int, salt: str | None, a: int, b: int) -> dict:
    toks = PROMPTS[p]
    hashes = [vllm_hash(instance, salt, toks[: (i + 1) * B]) for i in range(a, b)]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class Model:
    def __init__(self, shared: set[str]) -> None:
        self.shared = shared
        self.held: dict[tuple[str, str], set[tuple[Any, ...]]] = {}
        self.ever: dict[str, set[tuple[Any, ...]]] = {i: set() for i in INSTANCES}

    def store(self, i: str, m: str, p: int, salt: str | None, a: int, b: int) -> None:
        if a and (salt, *PROMPTS[p][: a * B]) not in self.ever[i]:
            return  # the parent was never announced by this instance: not indexed
        for k in range(a, b):
            content = (salt, *PROMPTS[p][: (k + 1) * B])
            self.held.setdefault((i, m), set()).add(content)
            self.ever[i].add(content)

    def remove(self, i: str, m: str, p: int, salt: str | None, a: int, b: int) -> None:
        for k in range(a, b):
            self.held.get((i, m), set()).discard((salt, *PROMPTS[p][: (k + 1) * B]))

    def clear(self, i: str) -> None:
        self.held.pop((i, "GPU"), None)

    def holds(self, i: str, m: str, content: tuple[Any, ...]) -> bool:
        if m in self.shared:
            return any(content in self.held.get((j, m), set()) for j in INSTANCES)
        return content in self.held.get((i, m), set())

    def match(self, i: str, p: int, salt: str | None) -> tuple[int, dict[str, int]]:
        n, by = 0, {}
        for k in range(len(PROMPTS[p]) // B):
            content = (salt, *PROMPTS[p][: (k + 1) * B])
            m = next((m for m in MEDIA if self.holds(i, m, content)), None)
            if m is None:
                break
            n += 1
            by[m] = by.get(m, 0) + 1
        return n, by


def op_strategy() -> st.SearchStrategy[tuple[Any, ...]]:
    def run(p: int) -> st.SearchStrategy[tuple[int, int]]:
        n = len(PROMPTS[p]) // B
        return st.tuples(st.integers(0, n - 1), st.integers(1, n)).map(
            lambda ab: (min(ab), max(ab[1], min(ab) + 1))
        )

    common = st.tuples(
        st.sampled_from(INSTANCES), st.sampled_from(MEDIA), st.integers(0, len(PROMPTS) - 1),
        st.sampled_from(SALTS),
    )  # fmt: skip
    return st.one_of(
        st.tuples(st.just("store"), common).flatmap(
            lambda t: run(t[1][2]).map(lambda ab: (t[0], *t[1], *ab))
        ),
        st.tuples(st.just("remove"), common).flatmap(
            lambda t: run(t[1][2]).map(lambda ab: (t[0], *t[1], *ab))
        ),
        st.tuples(st.just("clear"), st.sampled_from(INSTANCES)),
    )


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op_strategy(), max_size=30), shared=st.sampled_from([set(), {"STORAGE"}]))
def test_the_index_agrees_with_the_model_after_every_operation(
    ops: list[Any], shared: set[str]
) -> None:
    index = FleetIndex(shared)
    model = Model(shared)
    for op in ops:
        if op[0] == "clear":
            index.apply(op[1], [{"type": "AllBlocksCleared"}])
            model.clear(op[1])
        else:
            kind, *args = op
            index.apply(args[0], [(stored if kind == "store" else removed)(*args)])
            (model.store if kind == "store" else model.remove)(*args)
        for p in range(len(PROMPTS)):
            for salt in SALTS:
                digests = block_digests(PROMPTS[p], B, cache_salt=salt)
                for i in INSTANCES:
                    got = index.match(i, digests)
                    assert (got.blocks, got.by_medium) == model.match(i, p, salt), (op, p, salt, i)


def test_a_run_whose_parent_was_never_announced_is_not_indexed() -> None:
    index = FleetIndex()
    index.apply("a", [stored("a", "GPU", 0, None, 1, 3)])  # blocks 1-2 without block 0
    assert index.match("a", block_digests(PROMPTS[0], B)).blocks == 0
    assert index.skipped_orphans == 1
    index.apply("a", [stored("a", "GPU", 0, None, 0, 1), stored("a", "GPU", 0, None, 1, 3)])
    assert index.match("a", block_digests(PROMPTS[0], B)).blocks == 3


def test_salts_and_instances_name_blocks_apart() -> None:
    index = FleetIndex()
    index.apply("a", [stored("a", "GPU", 0, "tenant-2", 0, 4)])
    assert index.match("a", block_digests(PROMPTS[0], B, cache_salt="tenant-2")).blocks == 4
    assert index.match("a", block_digests(PROMPTS[0], B)).blocks == 0  # another tenant
    assert index.match("b", block_digests(PROMPTS[0], B, cache_salt="tenant-2")).blocks == 0


def test_a_shared_medium_counts_for_every_instance_until_its_last_holder_removes_it() -> None:
    index = FleetIndex(shared_media=["STORAGE"])
    d = block_digests(PROMPTS[1], B)
    index.apply("a", [stored("a", "STORAGE", 1, None, 0, 3)])
    index.apply("b", [stored("b", "STORAGE", 1, None, 0, 2)])
    assert [index.match(i, d).blocks for i in INSTANCES] == [3, 3, 3]
    index.apply("a", [removed("a", "STORAGE", 1, None, 0, 3)])
    assert [index.match(i, d).blocks for i in INSTANCES] == [2, 2, 2]  # b still announces 2
    index.apply("b", [removed("b", "STORAGE", 1, None, 0, 2)])
    assert [index.match(i, d).blocks for i in INSTANCES] == [0, 0, 0]


def test_forgetting_an_instance_drops_its_claims_and_its_pool_share() -> None:
    index = FleetIndex(shared_media=["STORAGE"])
    index.apply("a", [stored("a", "STORAGE", 0, None, 0, 2), stored("a", "GPU", 0, None, 0, 4)])
    index.forget("a")
    d = block_digests(PROMPTS[0], B)
    assert index.match("a", d).blocks == index.match("b", d).blocks == 0
    assert index.held_count("a", "GPU") == 0


def test_the_prefix_policy_prefers_the_fastest_media_then_the_least_load() -> None:
    index = FleetIndex(shared_media=["STORAGE"])
    d = block_digests(PROMPTS[0], B)
    policy = PrefixPolicy()
    assert policy.choose(index, INSTANCES, d, {"a": 2, "b": 1, "c": 1}).instance == "b"
    index.apply("c", [stored("c", "STORAGE", 0, None, 0, 4)])  # the pool: everyone, ties by load
    got = policy.choose(index, INSTANCES, d, {"a": 0, "b": 1, "c": 1})
    assert (got.instance, got.reason) == ("a", "prefix+load")
    index.apply("b", [stored("b", "CPU", 0, None, 0, 2)])  # b: two blocks from host memory
    assert policy.choose(index, INSTANCES, d, {"a": 0, "b": 5, "c": 0}).instance == "b"
    index.apply("c", [stored("c", "GPU", 0, None, 0, 2)])  # c: two from its GPU, 2 from the pool
    got = policy.choose(index, INSTANCES, d, {})
    assert (got.instance, got.match.by_medium if got.match else None) == (
        "c", {"GPU": 2, "STORAGE": 2},
    )  # fmt: skip


def test_round_robin_ignores_what_is_held() -> None:
    index = FleetIndex()
    index.apply("c", [stored("c", "GPU", 0, None, 0, 4)])
    policy = RoundRobinPolicy()
    d = block_digests(PROMPTS[0], B)
    assert [policy.choose(index, INSTANCES, d, {}).instance for _ in range(4)] == list("abca")


def test_a_policy_needs_an_instance() -> None:
    for policy in (PrefixPolicy(), RoundRobinPolicy()):
        with pytest.raises(ValueError, match="no instances to route to"):
            policy.choose(FleetIndex(), [], [], {})


def test_bad_arguments_are_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="unknown shared media"):
        FleetIndex(shared_media=["NVME"])
    with pytest.raises(ValueError, match="block_size must be > 0"):
        block_digests([1, 2], 0)
