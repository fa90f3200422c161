"""bsr.testing's key-partition suite catches what the first version missed: a deployment whose
saves become visible a request late, and an adapter whose weights change under the same name
(its files rewritten with the same sizes and times, then reloaded), as bsr's connector keyed it
by name, path, sizes and times. Model deployments as in test_key_partition_suite.py: a store
that keys by the fields in ``keys`` and serves what the first request under a key computed."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from bsr.testing import Completion, PartitionCase, Variant, assert_key_partition
from bsr.testing import check_key_partition as check

CHUNK = 64
SALTS = PartitionCase(
    "cache_salt",
    Variant("alice", {"cache_salt": "alice"}),
    Variant("bob", {"cache_salt": "bob"}),
    changes_output=False,
)


class LateStore:
    """A server whose store keys by ``keys`` only and whose saves become visible to lookups one
    request after the one that saved (an asynchronous index, a replica that lags)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = keys
        self.visible: dict[tuple[object, ...], tuple[object, ...]] = {}
        self.queued: list[tuple[tuple[object, ...], tuple[object, ...]]] = []
        self.saved = 0

    def complete(
        self, prompt: Sequence[int], variant: Variant, *, store: bool, load: bool = True
    ) -> Completion:
        key = (tuple(prompt), *(variant.fields.get(k) for k in self.keys))
        computed_with: tuple[object, ...] = (tuple(prompt), variant.fields.get("cache_salt"))
        cached = 0
        if load and key in self.visible:
            computed_with, cached = self.visible[key], (len(prompt) - 1) // CHUNK * CHUNK
        pending, self.queued = self.queued, []  # last request's saves become visible now
        for k, v in pending:
            self.visible.setdefault(k, v)
        if store and not cached:
            self.queued.append((key, computed_with))
            self.saved += 1  # counted as landed at once: the metric runs ahead of the index
        return Completion(tuple(hashlib.sha256(repr(computed_with).encode()).digest()[:8]), cached)

    def saves(self) -> float:
        return float(self.saved)


def test_a_save_visible_one_request_late_is_caught() -> None:
    """The store ignores the salt: B is served A's KV, but only from the request after A's
    hit. The cross step right after the save sees nothing; the late step does."""
    reports = check(LateStore(keys=()), [SALTS], chunk_tokens=CHUNK, seed=5, save_timeout_s=0.5)
    (rep,) = reports
    assert rep.cross.cached_tokens == 0  # what the first version of the suite looked at
    assert rep.late is not None and rep.late.cached_tokens == 192
    assert any("a save visible late" in p and "served 192" in p for p in rep.problems)


def test_a_late_store_keyed_by_every_input_passes() -> None:
    reports = check(LateStore(keys=("cache_salt",)), [SALTS], chunk_tokens=CHUNK, seed=5)
    assert_key_partition(reports)
    assert reports[0].hit.cached_tokens == 192


class Adapters:
    """A server with adapter ``a``: it computes with the weights it loaded (``loaded``), which a
    reload takes from the files (``files``); its store keys by what ``key_of`` says."""

    def __init__(self, key_by_files: bool) -> None:
        self.files = "w1"  # what the adapter's files hold (same sizes and times either way)
        self.loaded = "w1"
        self.key_by_files = key_by_files
        self.stored: dict[tuple[object, ...], str] = {}
        self.saved = 0

    def reload(self) -> None:
        self.loaded = self.files

    def complete(
        self, prompt: Sequence[int], variant: Variant, *, store: bool, load: bool = True
    ) -> Completion:
        # the old connector: name + path + each file's size and mtime (equal for w1 and w2);
        # the new one: the digest of the loaded weights
        ident = "a:same-sizes-and-times" if self.key_by_files else f"a:{self.loaded}"
        key = (tuple(prompt), ident)
        weights, cached = self.loaded, 0
        if load and key in self.stored:
            weights, cached = self.stored[key], (len(prompt) - 1) // CHUNK * CHUNK
        elif store:
            self.stored.setdefault(key, weights)
            self.saved += 1
        return Completion(tuple(hashlib.sha256(f"{prompt}{weights}".encode()).digest()[:8]), cached)

    def saves(self) -> float:
        return float(self.saved)


def changed_case(server: Adapters) -> PartitionCase:
    a = Variant("lora=a", {"model": "a"})
    return PartitionCase(
        "lora", a, Variant("lora=a (reloaded)", {"model": "a"}), change=server.reload
    )


def test_weights_changed_under_the_same_name_are_caught() -> None:
    """The files are rewritten while the server computes with the weights it loaded, then the
    adapter is reloaded in place: a store keyed by the files served the old weights' KV."""
    server = Adapters(key_by_files=True)
    server.files = "w2"  # rewritten under the running server: it still computes with w1
    (rep,) = check(server, [changed_case(server)], chunk_tokens=CHUNK, seed=6, save_timeout_s=0.5)
    assert rep.hit.cached_tokens == 192 and rep.cross.cached_tokens == 192
    assert any("changed in place" in p and "served 192" in p for p in rep.problems), rep.problems
    assert any("differ from its own reference" in p for p in rep.problems)


def test_weights_keyed_by_what_was_loaded_pass() -> None:
    server = Adapters(key_by_files=False)
    server.files = "w2"
    reports = check(server, [changed_case(server)], chunk_tokens=CHUNK, seed=6)
    assert_key_partition(reports)
    (rep,) = reports
    assert rep.cross.cached_tokens == 0 and rep.reference_a.tokens != rep.reference_b.tokens


def test_a_change_that_changes_nothing_fails_the_control() -> None:
    server = Adapters(key_by_files=False)  # files not rewritten: the reload loads w1 again
    (rep,) = check(server, [changed_case(server)], chunk_tokens=CHUNK, seed=6)
    assert any("control" in p for p in rep.problems)
