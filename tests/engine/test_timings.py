"""Where a restore's time is booked: each phase in its own field of ``RestoreResult.timings``."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import bsr
import bsr.engine._engine
import bsr.engine._job
import bsr.engine._request
from bsr.testing import corrupt_stored
from support.engines import make_engine
from support.helpers import filled_cache, shuffled_blocks, tokens_for, two_group_layout

#: what the clock jumps by while a tier moves a corrupt object out (settle); no real wait
JUMP_S = 1000.0


class Clock:
    """``time.perf_counter`` plus an offset the test moves: phases measured without sleeping."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


class SlowQuarantine(bsr.TierWrapper[bsr.HostTier]):
    """A host tier whose quarantine of an object takes JUMP_S on the engine's clock."""

    def __init__(self, inner: bsr.HostTier, clock: Clock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.moved = 0

    async def quarantine(self, key: bsr.ChunkKey, group: str, reason: str) -> None:
        self.clock.offset += JUMP_S
        self.moved += 1
        await super().quarantine(key, group, reason)


@pytest.mark.anyio
async def test_settle_time_is_booked_as_settle_not_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The corrupt object's move out of its tier happens in settle: its time is ``settle_s``."""
    clock = Clock()
    fake_time = SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(bsr.engine._engine, "time", fake_time)
    monkeypatch.setattr(bsr.engine._job, "time", fake_time)
    monkeypatch.setattr(bsr.engine._request, "time", fake_time)
    layout = two_group_layout()
    n = 3 * layout.chunk_tokens
    src = filled_cache(layout, 32, 8, seed=1)
    ids = shuffled_blocks(32, n // 8, seed=2)
    toks = tokens_for(n)
    host = SlowQuarantine(bsr.HostTier(1 << 26), clock)
    async with make_engine(layout, [host, bsr.FileTier(tmp_path, 1 << 26)]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        assert corrupt_stored(host, eng.keys(toks)[1], "kv")
        res = await eng.restore(toks, bsr.PagedKVCache(layout, 32, 8), ids)
    assert res.committed and res.fallbacks == 1 and host.moved == 1
    t = res.timings
    assert t.settle_s >= JUMP_S
    assert t.commit_s < JUMP_S and t.probe_s < JUMP_S and t.install_s < JUMP_S
    assert t.total_s >= t.probe_s + t.install_s + t.settle_s + t.commit_s
