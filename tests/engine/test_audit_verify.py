"""``RestoreEngine.audit(verify=...)``: an object read back through its tier's verified read
before anyone is told it can be served. A damaged object (its bytes flipped behind the tier,
its file still there) is not servable and is quarantined as a restore would quarantine it; a
healthy one is; a tier whose read fails answers ``None``; the staging slot goes back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import bsr
from bsr.testing import corrupt_stored
from support.engines import make_engine
from support.helpers import filled_cache, shuffled_blocks, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))


class FailingReads(bsr.TierWrapper[bsr.Tier]):
    """A tier that holds its objects but cannot read them now (a device error)."""

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        raise bsr.TierIOError("the device failed the read", tier=self.name)


@pytest.mark.anyio
async def test_audit_verify_refuses_a_damaged_object_and_quarantines_it(tmp_path: Path) -> None:
    n = 3 * 32
    src = filled_cache(LAYOUT, 64, 8, seed=1)
    ids = shuffled_blocks(64, n // 8, seed=2)
    toks = tokens_for(n)
    file = bsr.FileTier(tmp_path / "l2", 1 << 24)
    eng = make_engine(LAYOUT, [bsr.HostTier(1 << 24), file])
    seen: list[bsr.ObjectRemoved] = []
    async with eng:
        eng.on_removed(seen.append)
        await eng.save(toks, src, ids)
        okeys = [bsr.ObjectKey(k, "kv") for k in eng.keys(toks)]
        every = [(t, o) for o in okeys for t in ("host", "file")]
        assert await eng.audit(every, verify=True) == [True] * 6
        assert corrupt_stored(file, okeys[1].chunk, "kv")
        # metadata only: the damaged file is still there, so it is "held"
        assert await eng.audit(every) == [True] * 6
        flags = [t == "file" for t, _ in every]
        held = await eng.audit(every, verify=flags)
        assert held == [True, True, True, False, True, True]
        assert ("file", okeys[1].object_id, bsr.Removal.QUARANTINED) in {
            (r.tier, r.object_id, r.cause) for r in seen
        }
        assert not file.object_path(okeys[1].chunk, "kv").exists()  # moved to quarantine/
        assert await eng.audit([("file", okeys[1])]) == [False]  # gone, and quarantined
        st = eng.statistics().staging
        assert st.in_use == 0 and st.acquired == st.released
        with pytest.raises(bsr.ConfigError, match="one per object"):
            await eng.audit(every, verify=[True])


@pytest.mark.anyio
async def test_audit_verify_answers_none_when_the_read_fails(tmp_path: Path) -> None:
    src = filled_cache(LAYOUT, 64, 8, seed=1)
    toks = tokens_for(32)
    inner = bsr.HostTier(1 << 24)
    eng = make_engine(LAYOUT, [FailingReads(inner)])
    seen: list[bsr.ObjectRemoved] = []
    async with eng:
        eng.on_removed(seen.append)
        await eng.save(toks, src, shuffled_blocks(64, 4, seed=3))
        okey = bsr.ObjectKey(eng.keys(toks)[0], "kv")
        name = eng.tiers[0].name
        assert await eng.audit([(name, okey)]) == [True]
        assert await eng.audit([(name, okey)], verify=True) == [None]  # not known good
        assert seen == []  # nothing removed: it may well be intact
        assert eng.statistics().staging.in_use == 0
