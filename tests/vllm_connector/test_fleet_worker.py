"""KV events at the worker's save: only a save that landed is announced.

The worker side's own save path (``BsrWorker._save_one``: the save bounded by
``save_timeout_s``, then ``WorkerFleet.after_save``) over a real bsr engine with a HostTier
whose writes can be held (a tier wrapper in this module). A save cut by ``save_timeout_s``
announces nothing, not even the chunks it wrote before it was cut (they stay stored, and a
later save or lookup finds them; a router just does not hear of them from this save). The
control, the same save with the writes let through, announces every chunk.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import bsr

pytest.importorskip("vllm")
from bsr.vllm._events import SaveEvents
from bsr.vllm._fleet import WorkerFleet
from bsr.vllm._metadata import SaveJob
from bsr.vllm._worker import SAVE_TIMED_OUT, BsrWorker
from vllm_settings import connector_settings

pytestmark = pytest.mark.anyio

CHUNK, BLOCK = 32, 8
LAYOUT = bsr.StateLayout(chunk_tokens=CHUNK, groups=(bsr.StateGroup("kv", 2, 256),))
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 500, 3 * CHUNK)]


class HeldWrites(bsr.TierWrapper[bsr.Tier]):
    """Lets ``allowed`` writes through, then holds every later one until cancelled."""

    def __init__(self, inner: bsr.Tier, allowed: int) -> None:
        super().__init__(inner)
        self.allowed = allowed

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        if self.allowed <= 0:
            await anyio.sleep_forever()
        self.allowed -= 1
        return await self.inner.write(key, group, payload)


@dataclass
class Rig:
    worker: BsrWorker
    fleet: WorkerFleet
    host: bsr.HostTier


def block_hashes(tokens: list[int]) -> tuple[bytes, ...]:
    """Stand-ins for vLLM's chained block hashes."""
    return tuple(
        hashlib.sha256(str(tokens[: (b + 1) * BLOCK]).encode()).digest()
        for b in range(len(tokens) // BLOCK)
    )


@asynccontextmanager
async def rig(allowed: int, *more: bsr.Tier, timeout_s: float = 60.0) -> AsyncIterator[Rig]:
    host = bsr.HostTier(1 << 24)
    tier = HeldWrites(host, allowed)
    engine = bsr.RestoreEngine(
        LAYOUT, [tier, *more], window=2, io_depth=1, namespace=bsr.Namespace("fleet-worker")
    )
    cache = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
    kv = cache.tensor("kv")
    gen = np.random.default_rng(0)
    kv.copy_(torch.from_numpy(gen.integers(0, 256, tuple(kv.shape), dtype=np.uint8)))
    settings = connector_settings(BLOCK, CHUNK, {"save_timeout_s": timeout_s}, kv_events=True)
    await engine.open()
    worker = BsrWorker(settings, None)
    worker.engine, worker.cache, worker.groups = engine, cache, ("kv",)
    fleet = WorkerFleet(settings, engine, ("kv",), [("full_attention", None)], 0, worker.stats)
    worker.fleet = fleet
    try:
        yield Rig(worker, fleet, host)
    finally:
        fleet.close()
        await engine.aclose()


def job() -> SaveJob:
    blocks = (tuple(range(1, 1 + len(TOKENS) // BLOCK)),)  # vLLM's block 0 is its null block
    return SaveJob("r", tuple(TOKENS), blocks, (), SaveEvents(block_hashes(TOKENS)))


async def test_a_save_cut_by_save_timeout_s_announces_nothing() -> None:
    # chunk 0 lands, chunk 1's write hangs; 3 s leaves a busy machine ample time for chunk 0
    async with rig(allowed=1, timeout_s=3.0) as r:
        with anyio.fail_after(60):  # a hang guard, not a timing claim
            out = await r.worker._save_one(job())
        assert out == SAVE_TIMED_OUT
        assert r.host.usage().objects == 1  # chunk 0 was stored before the cut ...
        assert r.fleet.notices() == []  # ... and is not announced by the cut save
        assert r.fleet.journal is not None and r.fleet.journal.announced() == []


async def test_control_a_save_that_lands_announces_every_chunk() -> None:
    async with rig(allowed=1 << 30) as r:
        with anyio.fail_after(120):  # a hang guard
            out = await r.worker._save_one(job())
        assert isinstance(out, bsr.SaveResult) and out.chunks == 3
        notices = r.fleet.notices()
        assert [n.stored for n in notices] == [True] * 3
        assert [n.info.block_hashes for n in notices] == [
            block_hashes(TOKENS)[c * 4 : (c + 1) * 4] for c in range(3)
        ]


async def test_a_tier_the_save_skipped_as_root_locked_is_not_announced(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    file = bsr.FileTier(root, 1 << 24, lock_timeout_s=0.2)
    async with rig(1 << 30, file) as r:
        fd = os.open(root / ".bsr-ledger", os.O_RDWR)  # another holder of the root's lock
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with anyio.fail_after(120):  # a hang guard
                out = await r.worker._save_one(job())
        finally:
            os.close(fd)
        assert isinstance(out, bsr.SaveResult) and out.skipped.get("root_locked", 0) >= 1
        notices = r.fleet.notices()
        assert {n.tier for n in notices} == {"host"} and len(notices) == 3


async def test_removals_are_counted_in_the_stats_of_the_step_that_carries_them() -> None:
    # vLLM takes a step's connector stats before its worker metadata
    # (``kv_connector_model_runner_mixin``): the removals the metadata carries must be counted
    # in those stats, not in the next step's (which never comes to an idle engine)
    async with rig(allowed=1 << 30) as r:
        with anyio.fail_after(120):  # a hang guard
            out = await r.worker._save_one(job())
        assert isinstance(out, bsr.SaveResult) and out.chunks == 3
        r.worker.take_stats(), r.worker.worker_meta()  # the save's step
        assert r.fleet.journal is not None
        for _, okey in r.fleet.journal.announced()[:2]:
            assert await r.host.delete(okey.chunk, okey.group)
        stats = r.worker.take_stats()  # the next step, in vLLM's order
        meta = r.worker.worker_meta()
        assert meta is not None
        gone = [n for n in meta.events if not n.stored]
        assert len(gone) == 2 and {n.cause for n in gone} == {"deleted"}
        assert stats is not None and stats.data["object_removals"] == {"deleted": 2}
        assert r.worker.take_stats() is None and r.worker.worker_meta() is None  # nothing twice


def test_wrapped_tiers_keep_every_engine_setting_of_the_config() -> None:
    """``BsrWorker.wrap_tiers`` is the seam for wrapping the config's tiers: the engine is still
    built from the config. The earlier way (override ``build_engine`` and rebuild a
    RestoreEngine from the built one's attributes) dropped window_checkpoint_chunks,
    pin_staging and prefault_staging in each of the three wrappers that did it."""
    knobs = {
        "window": 3, "io_depth": 2, "policy": "truncate", "deadline_s": 7.0,
        "breaker_threshold": 5, "breaker_cooldown_s": 2.0, "pin_staging": False,
        "prefault_staging": False, "window_checkpoint_chunks": 2, "shield_timeout_s": 1.5,
        "staging_budget_bytes": 1 << 20,
    }  # fmt: skip
    config = bsr.EngineConfig.from_dict(
        {"tiers": [{"kind": "host", "capacity_bytes": 1 << 20}], **knobs}
    )
    settings = connector_settings(BLOCK, CHUNK, engine=config, config_digest="d")

    class Wrapping(BsrWorker):
        def wrap_tiers(self, tiers: list[bsr.Tier]) -> list[bsr.Tier]:
            return [HeldWrites(t, 1) for t in tiers]

    engine = Wrapping(settings, None).build_engine(LAYOUT, None)
    (tier,) = engine.tiers
    assert isinstance(tier, HeldWrites) and isinstance(tier.inner, bsr.HostTier)
    got = {
        "window": engine.window, "io_depth": engine.io_depth, "policy": engine.policy.value,
        "deadline_s": engine.deadline_s, "breaker_threshold": engine.health.threshold,
        "breaker_cooldown_s": engine.health.cooldown_s, "pin_staging": engine.pin_staging,
        "prefault_staging": engine.prefault_staging,
        "window_checkpoint_chunks": engine.window_checkpoint_chunks,
        "shield_timeout_s": engine.shield_timeout_s,
        "staging_budget_bytes": engine.staging_budget_bytes,
    }  # fmt: skip
    assert got == knobs
    assert engine.namespace.config_digest == "d" and engine.namespace.model_id == "m"
    plain = BsrWorker(settings, None).build_engine(LAYOUT, None)
    assert isinstance(plain.tiers[0], bsr.HostTier)
