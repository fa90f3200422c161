"""A tier that lies cannot get its bytes committed: verification is the pipeline's step.

A third-party tier, registered like any plugin kind and built from a config, keeps real stored
objects and lies on read: the right length of wrong bytes under the stored header (what a tier
that skips the codec and returns a stale buffer does), or another key's intact object (a wrong
lookup). Before 0.4 the ladder checked only the returned length and 64 tokens of 0x77 were
committed as valid. Now each lie is a corrupt read like any other: the object falls down the
ladder (a FileTier below it holds the saved bytes) or the restore invalidates with nothing
committed; the lying tier's objects are quarantined. Both anyio backends, and both the async
path (the tier's ``fetch_into``) and the bulk path (a tier with blocking reads, read through
the default ``read_many_blocking``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import bsr
from bsr.testing import make_keys
from support.helpers import blocks_equal, filled_cache, tokens_for

LAYOUT = bsr.StateLayout(32, (bsr.StateGroup("kv", 2, 64),))
CT = LAYOUT.chunk_tokens
BLOCK = 8
CHUNKS = 4
LIES = ("wrong-bytes", "other-key", "stale-buffer")


class LyingTier(bsr.Tier):
    """Keeps every object as stored (header and payload, through the codec) and lies on read
    about the objects of chunks ``lie_on``."""

    def __init__(self, name: str, lie: str, lie_on: Sequence[int], blocking: bool) -> None:
        super().__init__(name)
        self.blocking_reads = blocking  # type: ignore[misc]
        self.lie, self.lie_on = lie, set(lie_on)
        self.store: dict[str, bytes] = {}
        self.lied = 0

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        return [o.object_id in self.store for o in objects]

    def fetch_into_blocking(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        okey = bsr.ObjectKey(key, group)
        blob = self.store.get(okey.object_id)
        if blob is None:
            raise bsr.ObjectNotFoundError("not stored", tier=self.name)
        got = bsr.ObjectCodec.copy_out(blob, dst)
        if key.index not in self.lie_on:
            return got
        self.lied += 1
        out = bsr.as_byte_view(dst)
        if self.lie == "wrong-bytes":  # the stored header, the right length of 0x77
            out[: got.nbytes] = b"\x77" * got.nbytes
        elif self.lie == "stale-buffer":  # the stored header, another object's payload
            other = next(b for oid, b in self.store.items() if oid != okey.object_id)
            return bsr.ObjectCodec.copy_out(blob[:4096] + other[4096:], dst)
        else:  # another key's intact object: right bytes, wrong key
            other = next(b for oid, b in self.store.items() if oid != okey.object_id)
            return bsr.ObjectCodec.copy_out(other, dst)
        return got

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        return self.fetch_into_blocking(key, group, dst)

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        okey = bsr.ObjectKey(key, group)
        if okey.object_id in self.store:
            return False
        self.store[okey.object_id] = bsr.ObjectCodec.encode(okey, payload)
        return True

    async def delete(self, key: bsr.ChunkKey, group: str) -> bool:
        return self.store.pop(bsr.ObjectKey(key, group).object_id, None) is not None


@dataclass(frozen=True)
class LyingTierOptions(bsr.TierOptions):
    kind = "lying_test_tier"
    lie: str = bsr.option(bsr.Check.text, "wrong-bytes")
    lie_on: int = bsr.option(bsr.Check.non_negative_int, 1)
    blocking: bool = bsr.option(bsr.Check.flag, False)
    name: str = bsr.option(bsr.Check.text, "liar")

    def build(self) -> bsr.Tier:
        return LyingTier(self.name, self.lie, [self.lie_on], self.blocking)


@pytest.fixture(scope="module", autouse=True)
def registered() -> Any:
    bsr.register_tier(LyingTierOptions.kind, LyingTierOptions)
    yield
    bsr.unregister_tier(LyingTierOptions.kind)


def _config(tmp_path: Path, lie: str, blocking: bool, below: bool) -> bsr.EngineConfig:
    tiers: list[dict[str, Any]] = [
        {"kind": LyingTierOptions.kind, "lie": lie, "lie_on": 1, "blocking": blocking}
    ]
    if below:
        tiers.append({"kind": "file", "path": str(tmp_path / "l2"), "capacity_bytes": 1 << 24})
    return bsr.EngineConfig.from_dict(
        {"model_id": "liar", "window": 2, "io_depth": 2, "tiers": tiers}
    )


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "bulk"])
@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("below", [True, False], ids=["file-below", "alone"])
@pytest.mark.anyio
async def test_a_lying_tier_never_gets_its_bytes_committed(
    tmp_path: Path, lie: str, blocking: bool, below: bool
) -> None:
    toks = tokens_for(CHUNKS * CT)
    ids = torch.arange(CHUNKS * CT // BLOCK)
    src = filled_cache(LAYOUT, 2 * len(ids), BLOCK, seed=4)
    eng = bsr.RestoreEngine.from_config(_config(tmp_path, lie, blocking, below), layout=LAYOUT)
    async with eng:
        liar = eng.tiers[0]
        assert isinstance(liar, LyingTier) and liar.blocking_reads is blocking
        assert (await eng.save(toks, src, ids)).ok
        dst = bsr.PagedKVCache(LAYOUT, 2 * len(ids), BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert liar.lied >= 1  # it did lie
        assert r.quarantined == 1  # its object of chunk 1, out of service
        if below:  # read from the FileTier instead: the saved bytes commit
            assert r.committed_tokens == CHUNKS * CT and r.fallbacks == 1
            assert r.bytes_by_tier["file"] == LAYOUT.group_chunk_bytes("kv")
            assert blocks_equal(LAYOUT, src, ids, dst, ids, CHUNKS)
        else:  # nothing else holds it: nothing commits, chunk 1's blocks are invalid
            assert not r.committed and r.committed_tokens == 0
            assert str(r.reason) == "corrupt"
            assert set(ids[CT // BLOCK : 2 * CT // BLOCK].tolist()) <= set(r.invalid_block_ids)
        # whatever it says, no block of the cache holds 0x77 lie bytes where it committed
        lied_blocks = ids[CT // BLOCK : 2 * CT // BLOCK]
        if r.committed:
            assert not (dst.tensor("kv")[:, lied_blocks].view(torch.uint8) == 0x77).all()
        # asked again, the probe no longer offers the lying tier's copy
        probe = await eng.lookup(toks)
        assert "liar" not in probe.holders[1]["kv"]


def test_the_lies_are_right_length_and_what_the_check_refuses() -> None:
    """The test's liar is what it claims: each lie has the stored object's length, and only
    the engine's check (not the length) tells it from the truth."""
    keys = make_keys(2)
    liar = LyingTier("liar", "wrong-bytes", [keys[0].index], blocking=True)
    for i, k in enumerate(keys):
        payload = np.random.default_rng(i).integers(0, 256, 8192, dtype=np.uint8)
        liar.store[bsr.ObjectKey(k, "kv").object_id] = bsr.ObjectCodec.encode(
            bsr.ObjectKey(k, "kv"), payload
        )
    for lie in LIES:
        liar.lie = lie
        dst = np.zeros(8192, dtype=np.uint8)
        got = liar.fetch_into_blocking(keys[0], "kv", dst)
        assert got.nbytes == 8192
        assert bsr.ObjectCodec.check_read(got.header, got.nbytes, keys[0], "kv", dst, 8192) == -1
