"""Reads of a whole batch at once: the same answers, reports and pins as one read at a time.

A batch of host reads borrows, pins and verifies its objects in one tier call
(``HostTier.borrow_many_blocking``, ``ObjectCodec.verified_bodies``); a batch whose first holder
is one tier is admitted once by the gate and each object read without its own admission and
report (``TierLadder.admit_batch``, ``read_admitted_blocking``, ``borrow_many_blocking``). Each
is checked here against the one-object path it stands for (the per-object borrow), with real
tiers and a real engine where bytes and quarantine matter; the ladder's admitted reads are
checked against its model in ``test_ladder.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.testing import make_keys
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8
PAYLOAD = 8192

#: what is done to one stored object of a HostTier before the batch borrow
DAMAGE = ("none", "missing", "payload", "header", "magic", "length", "foreign", "short")


def _damage(tier: bsr.HostTier, key: bsr.ChunkKey, other: bsr.ChunkKey, how: str) -> None:
    oid = bsr.ObjectKey(key, "kv").object_id
    blob = tier._index.peek(oid)
    assert blob is not None
    if how == "missing":
        tier._index.discard(oid)
    elif how == "payload":
        blob[-1] ^= 0x01  # one payload bit
    elif how == "header":
        blob[200] ^= 0x01  # a padding byte of the header: only the header checksum sees it
    elif how == "magic":
        blob[0] ^= 0x01
    elif how == "length":  # a stored object longer than its header says
        tier._index.replace_value(oid, np.concatenate([blob, np.zeros(64, np.uint8)]))
    elif how == "short":  # truncated inside its payload
        tier._index.replace_value(oid, blob[:-100].copy())
    elif how == "foreign":  # another chunk's intact object under this id
        alien = tier._index.peek(bsr.ObjectKey(other, "kv").object_id)
        assert alien is not None
        tier._index.replace_value(oid, alien.copy())


@settings(max_examples=60, deadline=None)
@given(damage=st.lists(st.sampled_from(DAMAGE), min_size=1, max_size=6))
@pytest.mark.anyio
async def test_a_batch_borrow_answers_each_object_as_one_borrow_would(damage: list[str]) -> None:
    keys = make_keys(len(damage) + 1)
    data = [np.random.default_rng(i).integers(0, 256, PAYLOAD, np.uint8) for i in range(len(keys))]
    async with bsr.HostTier(capacity_bytes=1 << 22) as one, bsr.HostTier(1 << 22) as many:
        for tier in (one, many):
            for k, d in zip(keys, data):
                assert await tier.write(k, "kv", d)
            for k, how in zip(keys, damage):
                _damage(tier, k, keys[-1], how)
        objects = [(k, "kv") for k in keys[: len(damage)]]
        lent = many.borrow_many_blocking(objects)
        pinned = many._index.statistics().pinned
        singles: list[Any] = []
        for k, g in objects:  # the model: one borrow at a time
            try:
                b = one.borrow_blocking(k, g)
            except Exception as exc:
                singles.append(exc)
            else:
                singles.append(np.array(b.payload))
                b.release()
        assert len(lent.items) == len(objects)
        for got, want, d in zip(lent.items, singles, data):
            if isinstance(want, Exception):
                assert type(got) is type(want), (got, want)
            else:
                assert isinstance(got, np.ndarray) and np.array_equal(got, want)
                assert np.array_equal(got, d)
        ok = sum(1 for w in singles if not isinstance(w, Exception))
        assert pinned == ok  # every lent object pinned, no failed one
        lent.release()
        lent.release()  # idempotent
        assert many._index.statistics().pinned == 0
        a, b = one.statistics(), many.statistics()
        assert (a.hits, a.misses, a.errors, a.bytes_read) == (
            b.hits,
            b.misses,
            b.errors,
            b.bytes_read,
        )


def _two_tier_engine(tiers: list[bsr.Tier]) -> bsr.RestoreEngine:
    return make_engine(LAYOUT, tiers, window=4, io_depth=2, model_id="batch-reads")


@pytest.mark.parametrize("n", [4, 40])
@pytest.mark.anyio
async def test_host_objects_gone_or_damaged_since_the_probe_fall_to_the_next_tier(
    tmp_path: Path, n: int
) -> None:
    """Evicted after the probe, corrupt in place, or another chunk's object under its id: each
    falls from the batch borrow to the FileTier, one fallback each, the damaged ones
    quarantined; the restore commits the saved bytes (4 chunks: one event-loop batch; 40: batches
    in worker threads)."""
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    async with _two_tier_engine([host, bsr.FileTier(tmp_path, 1 << 27)]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        keys = bsr.chunk_keys(eng.namespace_fp, toks, CT)
        probe = await eng.lookup(toks)
        _damage(host, keys[1], keys[0], "missing")
        _damage(host, keys[2], keys[0], "payload")
        _damage(host, keys[3], keys[0], "foreign")
        dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
        r = await eng.restore(toks, dst, ids, probe=probe)
        assert r.committed and r.committed_tokens == n * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
        assert r.fallbacks == 3 and r.quarantined == 2
        assert r.bytes_by_tier["file"] == 3 * LAYOUT.group_chunk_bytes("kv")
        assert host._index.statistics().pinned == 0
        assert eng.statistics().staging.in_use == 0


@pytest.mark.anyio
async def test_a_damaged_host_object_with_no_other_copy_invalidates(tmp_path: Path) -> None:
    n = 40
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    async with _two_tier_engine([host]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        keys = bsr.chunk_keys(eng.namespace_fp, toks, CT)
        _damage(host, keys[7], keys[0], "header")
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK), ids)
        assert not r.committed and r.committed_tokens == 0
        assert str(r.reason) == "corrupt" and r.quarantined == 1
        assert host._index.statistics().pinned == 0
        assert eng.statistics().staging.in_use == 0


@pytest.mark.anyio
async def test_a_corrupt_file_object_in_an_admitted_batch_falls_to_the_next_file_tier(
    tmp_path: Path,
) -> None:
    """Two FileTiers (no lending): the first holder's batch is admitted at once; its corrupt
    object is reported (quarantined) and read from the second tier."""
    n = 24
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    a = bsr.FileTier(tmp_path / "a", 1 << 27, name="a")
    b = bsr.FileTier(tmp_path / "b", 1 << 27, name="b")
    async with _two_tier_engine([a, b]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        keys = bsr.chunk_keys(eng.namespace_fp, toks, CT)
        path = a.object_path(keys[5], "kv")
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed and blocks_equal(LAYOUT, src, ids, dst, ids, n)
        assert r.fallbacks == 1 and r.quarantined == 1
        assert r.bytes_by_tier["b"] == LAYOUT.group_chunk_bytes("kv")


@pytest.mark.parametrize("damaged", [False, True])
@pytest.mark.anyio
async def test_a_lent_batch_of_several_spans_is_admitted_and_reported_once(
    monkeypatch: pytest.MonkeyPatch, damaged: bool
) -> None:
    """A batch lent span by span (here a span per chunk) is admitted by the gate once and ends
    in one report: a success when the tier lent anything, else just its end (a batch whose
    only span failed must not count as a success for the tier's breaker)."""
    from bsr.engine._decisions import RestoreGate
    from bsr.transfer import _pipeline

    monkeypatch.setattr(_pipeline, "LEND_SPAN_BYTES", 1)
    calls: dict[str, int] = {"admit_batch": 0, "report_ok": 0, "end_batch": 0}
    for name in calls:
        real = getattr(RestoreGate, name)

        def counted(self: Any, *a: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(self, *a)

        monkeypatch.setattr(RestoreGate, name, counted)
    n = 40
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    async with _two_tier_engine([host]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        if damaged:
            keys = bsr.chunk_keys(eng.namespace_fp, toks, CT)
            _damage(host, keys[0], keys[1], "payload")
        for k in calls:
            calls[k] = 0
        dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
        r = await eng.restore(toks, dst, ids)
        batches = -(-n // max(1, _pipeline.INLINE_BYTES // LAYOUT.chunk_bytes))
        assert batches > 1 and n // batches > 1  # several batches, several spans each
        # (report_ok ends its batch through end_batch: every admitted batch ends exactly once)
        if damaged:  # chunk 0's span failed; batches taken before the failure still run
            assert not r.committed and str(r.reason) == "corrupt"
            assert 1 <= calls["admit_batch"] <= batches
            assert calls["end_batch"] == calls["admit_batch"]
            assert calls["report_ok"] == calls["admit_batch"] - 1  # not chunk 0's batch
        else:
            assert r.committed_tokens == n * CT and blocks_equal(LAYOUT, src, ids, dst, ids, n)
            assert calls == {"admit_batch": batches, "report_ok": batches, "end_batch": batches}
        assert host._index.statistics().pinned == 0
