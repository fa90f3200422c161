"""The open/close life of engines and tiers (bsr._resource.AsyncResource): new -> open ->
closed, close idempotent, a typed error for every use after close, never open again."""

from __future__ import annotations

from pathlib import Path

import pytest

import bsr
from support.engines import make_engine
from support.helpers import tokens_for, two_group_layout


def tiers(root: Path) -> list[bsr.Tier]:
    return [bsr.HostTier(1 << 20), bsr.FileTier(root, 1 << 20)]


@pytest.mark.anyio
async def test_engine_new_open_closed(tmp_path: Path) -> None:
    eng = make_engine(two_group_layout(), tiers(tmp_path))
    assert not eng.closed
    with pytest.raises(bsr.ClosedError, match="not open"):
        eng.statistics()
    async with eng as same:
        assert same is eng and not eng.closed
        await eng.open()  # open again while open: nothing happens
        assert eng.statistics().staging.slots == 2
    assert eng.closed and all(t.closed for t in eng.tiers)
    await eng.aclose()  # idempotent
    with pytest.raises(bsr.ClosedError, match="closed; create a new one"):
        eng.statistics()
    with pytest.raises(bsr.ClosedError, match="closed; create a new one"):
        await eng.lookup(tokens_for(64))
    with pytest.raises(bsr.ClosedError):  # never open again
        await eng.open()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["host", "file"])
async def test_tier_is_never_open_again(tmp_path: Path, kind: str) -> None:
    tier = tiers(tmp_path)[0 if kind == "host" else 1]
    async with tier as same:
        assert same is tier and not tier.closed
    assert tier.closed
    await tier.aclose()  # idempotent
    with pytest.raises(bsr.ClosedError) as err:
        await tier.open()
    assert err.value.fields["tier"] == tier.name
    with pytest.raises(bsr.ClosedError):
        await tier.contains_many([])
