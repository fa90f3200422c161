"""The model beside the engines: which prefixes each rank's tiers hold, and in what state.

It is written from the specification, not from the engine (see ``bsr.testing._machine``): the
chunks a sliding-window group needs come from the token ranges, the source bytes of every chunk
from a hash of the prefix; what it observes is the tiers (quarantine), the faults fired and the
circuit breakers.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ..core._keys import ChunkKey, ObjectKey, chunk_keys
from ..core._layout import StateGroup
from ..transfer._cache import PagedKVCache
from ._cluster import Cluster
from ._faults import FaultKind


class Status(enum.Enum):
    """What the model knows about one stored object."""

    INTACT = "intact"  #: stored completely with the saved bytes
    BAD = "bad"  #: stored but damaged (flipped, truncated, foreign); never counted as readable
    LOST = "lost"  #: a write was acknowledged but stored nothing (visible, unreadable)


# (rank, tier index, prefix tokens up to the chunk's end, group)
_Obj = tuple[int, int, tuple[int, ...], str]


def _needed_chunks(group: StateGroup, prefix_chunks: int, chunk_tokens: int) -> range:
    """Chunks of ``group`` a prefix of ``prefix_chunks`` chunks needs (from the token ranges)."""
    if group.window_tokens is None:
        return range(prefix_chunks)
    end = prefix_chunks * chunk_tokens
    first_token = max(0, end - group.window_tokens)
    return range(first_token // chunk_tokens, prefix_chunks)


class Model(Cluster):
    """The model's state and the questions asked of it (what is stored, intact, visible)."""

    store: dict[_Obj, Status]
    blind: set[tuple[int, int, str]]
    unavailable: set[tuple[int, int]]
    prompts: list[tuple[int, ...]]
    _keys: dict[tuple[int, tuple[int, ...]], ChunkKey]
    _objs: dict[tuple[int, str], tuple[tuple[int, ...], str]]
    _content: dict[tuple[int, tuple[int, ...], str], torch.Tensor]

    def _key(self, rank: int, prefix: tuple[int, ...]) -> ChunkKey:
        k = (rank, prefix)
        if k not in self._keys:
            engine = self.ranks[rank].engine
            self._keys[k] = chunk_keys(engine.namespace_fp, list(prefix), self.chunk_tokens)[-1]
        return self._keys[k]

    def _oid(self, rank: int, prefix: tuple[int, ...], group: str) -> str:
        oid = ObjectKey(self._key(rank, prefix), group).object_id
        self._objs[(rank, oid)] = (prefix, group)
        return oid

    def content(self, rank: int, prefix: tuple[int, ...], group: str) -> torch.Tensor:
        """The source bytes of the last chunk of ``prefix`` in ``group`` on ``rank``.

        A pure function of the prefix (like real KV state), shaped ``[layers, chunk_tokens,
        token_bytes]``.
        """
        k = (rank, prefix, group)
        if k not in self._content:
            g = self.layout.group(group)
            h = hashlib.blake2b(digest_size=16, person=b"bsr-machine")
            h.update(f"{rank}|{group}|".encode())
            h.update(np.asarray(prefix, dtype="<i8").tobytes())
            rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
            shape = (g.num_layers, self.chunk_tokens, g.token_bytes)
            self._content[k] = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))
        return self._content[k]

    def _needed(self, prefix_chunks: int) -> list[tuple[int, str]]:
        return [
            (c, g.name)
            for g in self.layout.groups
            for c in _needed_chunks(g, prefix_chunks, self.chunk_tokens)
        ]

    def _holders(
        self, rank: int, prefix: tuple[int, ...], group: str
    ) -> list[tuple[int, Status, bool]]:
        """(tier, status, doubtful) of every copy; doubtful: the engine may not use it now."""
        out = []
        for ti in range(len(self.ranks[rank].tiers)):
            status = self.store.get((rank, ti, prefix, group))
            if status is not None:
                doubtful = (rank, ti) in self.unavailable or (
                    rank,
                    ti,
                    self._oid(rank, prefix, group),
                ) in self.blind
                out.append((ti, status, doubtful))
        return out

    def _visible_surely(self, rank: int, prefix: tuple[int, ...], group: str) -> bool:
        return any(s is not Status.BAD and not b for _, s, b in self._holders(rank, prefix, group))

    def _visible_maybe(self, rank: int, prefix: tuple[int, ...], group: str) -> bool:
        return bool(self._holders(rank, prefix, group))

    def _intact(self, rank: int, prefix: tuple[int, ...], group: str) -> bool:
        return any(s is Status.INTACT and not b for _, s, b in self._holders(rank, prefix, group))

    def _all_ranks(
        self, tokens: Sequence[int], p: int, have: Callable[[int, tuple[int, ...], str], bool]
    ) -> bool:
        ct = self.chunk_tokens
        return all(
            have(r, tuple(tokens[: (c + 1) * ct]), g)
            for r in range(self.world_size)
            for c, g in self._needed(p)
        )

    def _best(
        self, tokens: Sequence[int], have: Callable[[int, tuple[int, ...], str], bool]
    ) -> int:
        for p in range(len(tokens) // self.chunk_tokens, 0, -1):
            if self._all_ranks(tokens, p, have):
                return p
        return 0

    @contextlib.contextmanager
    def _as_of(self, store: dict[_Obj, Status], blind: set[tuple[int, int, str]]) -> Iterator[None]:
        """Evaluate the model as it was (before a step), with the step's breaker history."""
        now = self.store, self.blind
        self.store, self.blind = store, blind
        try:
            yield
        finally:
            self.store, self.blind = now

    def _note_breakers(self, before: list[tuple[int, int, bool, int]]) -> None:
        """Tiers whose breaker was open at the start or opened during the step: the engine may
        have skipped them (a documented policy), so the model expects nothing of them."""
        after = self._breakers()
        self.unavailable = {
            (r, ti)
            for (r, ti, was_open, trips), (_, _, is_open, trips_now) in zip(before, after)
            if was_open or is_open or trips_now != trips
        }
        stats = type(self).stats
        stats.breaker_trips += sum(b[3] for b in after) - sum(b[3] for b in before)

    def _apply_faults(self) -> None:
        stats = type(self).stats
        for rank, ti, oid, kind in self.fault_log:
            stats.faults[kind.value] = stats.faults.get(kind.value, 0) + 1
            if kind is FaultKind.READ_ERROR:
                self.blind.add((rank, ti, oid))
            if kind not in (FaultKind.CORRUPT, FaultKind.TRUNCATE):
                continue
            where = self._objs.get((rank, oid))
            if where is None:
                continue
            obj = (rank, ti, where[0], where[1])
            if self.store.get(obj) is Status.INTACT:
                self.store[obj] = Status.BAD

    def _settle(self) -> None:
        """After engine calls: learn what the faults did, follow the tiers, start a new log."""
        self._apply_faults()
        self._reconcile()
        self.fault_log.clear()

    def _reconcile(self, *, reopened: bool = False) -> None:
        """Follow what the engine did to the tiers (quarantine), and check nothing else vanished."""
        touched = {(r, ti, oid) for r, ti, oid, _ in self.fault_log}
        for rk in self.ranks:
            for ti, tier in enumerate(rk.tiers):
                entries = [(o, s) for o, s in self.store.items() if o[0] == rk.rank and o[1] == ti]
                if not entries:
                    continue
                okeys = [ObjectKey(self._key(o[0], o[2]), o[3]) for o, _ in entries]
                present = self._call(tier.inner.contains_many, okeys)
                for (obj, status), okey, here in zip(entries, okeys, present):
                    oid = okey.object_id
                    if status is Status.LOST:
                        if oid in tier.lost:
                            continue
                        if here:
                            self.store[obj] = Status.INTACT
                        else:
                            del self.store[obj]
                        continue
                    if here:
                        continue
                    del self.store[obj]
                    self._check(
                        status is not Status.INTACT or (rk.rank, ti, oid) in touched,
                        f"an intact object vanished from tier {tier.name!r} (rank {rk.rank}, chunk "
                        f"{len(obj[2]) // self.chunk_tokens - 1}, group {obj[3]!r}) with no fault "
                        f"on it{' across a reopen' if reopened else ''}",
                    )

    def _source_cache(
        self, rank: int, tokens: Sequence[int], seed: int
    ) -> tuple[PagedKVCache, torch.Tensor]:
        assert self.case is not None
        bt, bpc, ct = self.case.block_tokens, self.case.blocks_per_chunk, self.chunk_tokens
        nblocks = -(-len(tokens) // bt)
        gen = torch.Generator().manual_seed(seed)
        cache = PagedKVCache(self.layout, max(1, nblocks + 2), bt)
        for g in self.layout.groups:
            t = cache.tensor(g.name)
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        ids = torch.randperm(cache.num_blocks, generator=gen)[:nblocks]
        for c in range(len(tokens) // ct):
            blocks = ids[c * bpc : (c + 1) * bpc]
            for g in self.layout.groups:
                data = self.content(rank, tuple(tokens[: (c + 1) * ct]), g.name)
                cache.tensor(g.name)[:, blocks] = data.view(g.num_layers, bpc, bt, g.token_bytes)
        return cache, ids
