"""The engine's removal seam: every object that stops being served (a tier's eviction, this
engine's quarantine of a damaged object, what an audit finds gone) reaches ``on_removed``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

import bsr
from support.engines import make_engine
from support.helpers import bsr_cli, filled_cache, shuffled_blocks, tokens_for


class Seen:
    def __init__(self) -> None:
        self.records: list[bsr.ObjectRemoved] = []
        self._lock = threading.Lock()

    def __call__(self, record: bsr.ObjectRemoved) -> None:
        with self._lock:
            self.records.append(record)

    def pairs(self, cause: bsr.Removal) -> set[tuple[str, str]]:
        return {(r.tier, r.object_id) for r in self.records if r.cause is cause}


LAYOUT = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))


@pytest.mark.anyio
async def test_quarantine_eviction_and_gc_each_reach_the_listener(tmp_path: Path) -> None:
    n = 3 * 32
    src = filled_cache(LAYOUT, 64, 8, seed=1)
    ids = shuffled_blocks(64, n // 8, seed=2)
    toks = tokens_for(n)
    one = bsr.ObjectCodec.stored_size(LAYOUT.group_chunk_bytes("kv"))
    eng = make_engine(LAYOUT, [bsr.HostTier(2 * one), bsr.FileTier(tmp_path / "l2", 1 << 24)])
    seen = Seen()
    async with eng:
        stop = eng.on_removed(seen)
        for end in (32, 64, 96):  # chunk by chunk: host keeps the last two
            await eng.save(toks[:end], src, ids)
        keys = eng.keys(toks)
        oids = [bsr.ObjectKey(k, "kv").object_id for k in keys]
        assert seen.pairs(bsr.Removal.EVICTED) == {("host", oids[0])}
        every = [(t, bsr.ObjectKey(k, "kv")) for k in keys for t in ("host", "file")]
        assert await eng.audit(every) == [False, True, True, True, True, True]

        # a damaged object: the restore finds it corrupt, the engine quarantines it
        path = eng.tiers[1].object_path(keys[0], "kv")  # type: ignore[attr-defined]
        raw = bytearray(path.read_bytes())
        raw[bsr.ObjectCodec.HEADER_SIZE + 7] ^= 0xFF
        path.write_bytes(bytes(raw))
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 64, 8), ids)
        assert not r.committed and r.quarantined == 1
        assert ("file", oids[0]) in seen.pairs(bsr.Removal.QUARANTINED)
        assert (await eng.audit([("file", bsr.ObjectKey(keys[0], "kv"))])) == [False]

        # bsr store gc in another process: the audit finds the files gone and says so
        before = len(seen.records)
        done = bsr_cli("store", "gc", str(tmp_path / "l2"), "--max-bytes", "0")
        assert done.returncode == 0, done.stderr
        held = await eng.audit(every)
        assert held == [False, False, True, False, True, False]  # host still holds two
        assert {("file", o) for o in oids[1:]} <= seen.pairs(bsr.Removal.VANISHED)
        assert len(seen.records) > before
        count = len(seen.records)
        stop()
        await eng.audit(every)
        assert len(seen.records) == count  # unsubscribed


@pytest.mark.anyio
async def test_audit_refuses_an_unknown_tier_and_answers_none_for_a_tier_that_fails(
    tmp_path: Path,
) -> None:
    async with make_engine(LAYOUT, [bsr.HostTier(1 << 20)]) as eng:
        key = eng.keys(tokens_for(32))[0]
        with pytest.raises(bsr.ConfigError, match="no tier named"):
            await eng.audit([("nope", bsr.ObjectKey(key, "kv"))])
    async with make_engine(LAYOUT, [Unanswering(bsr.HostTier(1 << 20))]) as eng:
        seen = Seen()
        eng.on_removed(seen)
        assert await eng.audit([("host", bsr.ObjectKey(key, "kv"))]) == [None]
        assert seen.records == []  # a tier that did not answer removed nothing


class Unanswering(bsr.TierWrapper[bsr.Tier]):
    """A tier whose storage cannot be asked (a remote store that is down)."""

    async def recheck_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        raise bsr.TierIOError("the store does not answer", tier=self.name)
