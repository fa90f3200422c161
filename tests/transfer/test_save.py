"""save_chunks, the save path, against an independent model of its docstring.

"Store every object a prefix of len(keys) chunks needs into every tier lacking it": a tier that
already holds an object skips it, a retired copy is deleted and written again, a tier failing a
write is counted and the other tiers still get the object, ``on_written`` hears each object a
tier newly stored, and the staging never exceeds the window. Real host tiers; the bytes each
tier holds afterwards are compared with the cache's own chunks.
"""

from __future__ import annotations

from typing import Any

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.transfer._cache import gather_chunk
from bsr.transfer._save import save_chunks
from support.helpers import filled_cache, shuffled_blocks, tokens_for, two_group_layout

LAYOUT = two_group_layout()
N_CHUNKS, BLOCK_TOKENS, NBLOCKS = 4, 8, 32
CACHE = filled_cache(LAYOUT, NBLOCKS, BLOCK_TOKENS, seed=7)
IDS = shuffled_blocks(NBLOCKS, N_CHUNKS * LAYOUT.chunk_tokens // BLOCK_TOKENS, seed=8)
TABLES = CACHE.block_tables(IDS, N_CHUNKS * LAYOUT.chunk_tokens)  # one table for every group
NS_FP = bsr.Namespace("save-model").fingerprint(LAYOUT)
KEYS = bsr.chunk_keys(NS_FP, tokens_for(N_CHUNKS * LAYOUT.chunk_tokens), LAYOUT.chunk_tokens)
WANTED = LAYOUT.needed_objects(N_CHUNKS)
TIERS = ("a", "b", "c")


class BrokenWrites(bsr.TierWrapper[bsr.HostTier]):
    """A host tier whose writes fail with an I/O error (reads and probes still work)."""

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        raise bsr.TierIOError("disk gone", tier=self.name)


def expected_bytes(c: int, g: str) -> bytes:
    out = torch.zeros(LAYOUT.group_chunk_bytes(g), dtype=torch.uint8)
    gather_chunk(CACHE, g, CACHE.chunk_blocks(IDS, c), out)
    return out.numpy().tobytes()


obj_st = st.sampled_from(range(len(WANTED)))


@pytest.mark.anyio
@settings(max_examples=60, deadline=None)
@given(
    present=st.fixed_dictionaries({t: st.sets(obj_st) for t in TIERS}),
    retired=st.fixed_dictionaries({t: st.sets(obj_st) for t in TIERS}),
    broken=st.sets(st.sampled_from(TIERS), max_size=2),
    window=st.integers(1, 3),
    io_depth=st.integers(1, 3),
)
async def test_save_chunks_follows_the_model(
    present: dict[str, set[int]],
    retired: dict[str, set[int]],
    broken: set[str],
    window: int,
    io_depth: int,
) -> None:
    hosts = {t: bsr.HostTier(1 << 24, name=t) for t in TIERS}
    tiers = [BrokenWrites(hosts[t]) if t in broken else hosts[t] for t in TIERS]
    # a stale copy (wrong bytes) where a tier already holds an object: kept unless retired
    stale = {(t, i) for t in TIERS for i in present[t]}
    retired_keys = {
        (t, bsr.ObjectKey(KEYS[WANTED[i][0]], WANTED[i][1]).object_id)
        for t in TIERS
        for i in retired[t] & present[t]
    }
    heard: list[tuple[str, int, str]] = []

    for t, i in stale:
        c, g = WANTED[i]
        await hosts[t].write(
            KEYS[c], g, torch.full((LAYOUT.group_chunk_bytes(g),), 7, dtype=torch.uint8)
        )
    pool = bsr.StagingPool(window, LAYOUT.slot_bytes, pin=False, prefault=False)
    res = await save_chunks(
        layout=LAYOUT, tiers=tiers, account=pool.account(), cache=CACHE, tables=TABLES,
        keys=KEYS, io_depth=io_depth, log=structlog.get_logger(),
        on_written=lambda t, ok: heard.append((t.name, ok.chunk.index, ok.group)),
        is_retired=lambda t, ok: (t.name, ok.object_id) in retired_keys,
    )  # fmt: skip

    # the model
    written = dict.fromkeys(TIERS, 0)
    skipped = dict.fromkeys(TIERS, 0)
    errors = dict.fromkeys(TIERS, 0)
    nbytes = dict.fromkeys(TIERS, 0)
    holds: dict[tuple[str, int], str] = {}  # what each tier holds afterwards: good or stale
    new: set[tuple[str, int, str]] = set()
    for t in TIERS:
        for i, (c, g) in enumerate(WANTED):
            has = i in present[t]
            if has and i not in retired[t]:
                skipped[t] += 1
                holds[(t, i)] = "stale"
            elif t in broken:  # a retired copy is deleted before the write fails
                errors[t] += 1
            else:
                written[t] += 1
                nbytes[t] += LAYOUT.group_chunk_bytes(g)
                holds[(t, i)] = "good"
                new.add((t, c, g))
    assert res.objects_written == written
    assert res.objects_skipped == skipped
    assert res.errors == errors
    assert res.bytes_written == nbytes
    assert res.chunks == N_CHUNKS and res.saved_tokens == N_CHUNKS * LAYOUT.chunk_tokens
    assert sorted(heard) == sorted(new)
    assert 0 < res.rws_peak_bytes <= window * LAYOUT.slot_bytes or not new

    # what each tier holds afterwards
    for t in TIERS:
        for i, (c, g) in enumerate(WANTED):
            held = (await hosts[t].contains_many([bsr.ObjectKey(KEYS[c], g)]))[0]
            assert held is ((t, i) in holds), (t, c, g)
            if not held:
                continue
            buf = torch.zeros(LAYOUT.group_chunk_bytes(g), dtype=torch.uint8)
            await hosts[t].read_into(KEYS[c], g, buf)
            want = expected_bytes(c, g) if holds[(t, i)] == "good" else bytes([7]) * buf.numel()
            assert buf.numpy().tobytes() == want, (t, c, g)
