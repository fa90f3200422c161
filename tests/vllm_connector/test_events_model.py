"""KV events at the seam: a router's view never claims a block the store cannot serve.

The worker side's real event path (``WorkerFleet``: the save, the audit of what each tier
holds, the engine's removal listener; ``EventRelay`` on the scheduler side) over a real bsr
engine with a small HostTier and a small FileTier, driven by Hypothesis: saves of prompts that
share prefixes (both tiers evict), a damaged file object that a restore then finds (quarantine),
deletes, ``bsr store gc`` on the FileTier's root (another process's removal) and audits. A
subscriber applies every published event to its view; after every step each block the view
claims in a tier must read back verified from that tier, except within the stated lag:

* objects ``bsr store gc`` removed are claimed until the next audit (the worker audits every
  ``kv_events_audit_s``);
* a damaged object no read has touched yet (bit rot is found by reading it) is claimed until a
  restore reads it.

Everything bsr itself removes (evictions, quarantines, deletes) leaves the view at once. A
mutation of the seam (no removal listener, a stored notice for an object no tier holds, no
cancel of a notice that raced an eviction) fails this test.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import bsr

pytest.importorskip("vllm")
from bsr.tiers.file import gc_store
from bsr.vllm._events import EventRelay, SaveEvents
from bsr.vllm._fleet import WorkerFleet
from bsr.vllm._metadata import SaveJob
from bsr.vllm._stats import BsrConnectorStats
from vllm_settings import connector_settings

CHUNK, BLOCK = 32, 8
LAYOUT = bsr.StateLayout(chunk_tokens=CHUNK, groups=(bsr.StateGroup("kv", 2, 256),))
OBJ = bsr.ObjectCodec.stored_size(LAYOUT.group_chunk_bytes("kv"))
FILE_OBJ = bsr.ObjectCodec.stored_size(LAYOUT.group_chunk_bytes("kv"), padded=True)
#: four prompts of three chunks; 0 and 1 share their first chunk, 2 shares two with 0
PROMPTS = [
    [1] * CHUNK + [2] * CHUNK + [3] * CHUNK,
    [1] * CHUNK + [4] * CHUNK + [5] * CHUNK,
    [1] * CHUNK + [2] * CHUNK + [6] * CHUNK,
    [7] * CHUNK + [8] * CHUNK + [9] * CHUNK,
]


def block_hashes(tokens: list[int]) -> tuple[bytes, ...]:
    """Stand-ins for vLLM's chained block hashes: each names its whole prefix."""
    return tuple(
        hashlib.sha256(str(tokens[: (b + 1) * BLOCK]).encode()).digest()
        for b in range(len(tokens) // BLOCK)
    )


class EventsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._cm = start_blocking_portal()
        self.portal: BlockingPortal = self._cm.__enter__()
        self.root = Path(tempfile.mkdtemp(prefix="bsr-events-"))
        self.host = bsr.HostTier(3 * OBJ)
        self.file = bsr.FileTier(self.root / "l2", capacity_bytes=6 * FILE_OBJ)
        self.engine = bsr.RestoreEngine(
            LAYOUT, [self.host, self.file], window=2, io_depth=1,
            namespace=bsr.Namespace("events-model"),
        )  # fmt: skip
        self.cache = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
        gen = np.random.default_rng(0)
        kv = self.cache.tensor("kv")
        kv.copy_(torch.from_numpy(gen.integers(0, 256, tuple(kv.shape), dtype=np.uint8)))
        s = connector_settings(BLOCK, CHUNK, {"kv_events_max_objects": 8}, kv_events=True)
        self.portal.call(self.engine.open)
        self.fleet = WorkerFleet(
            s, self.engine, ("kv",), [("full_attention", None)], 0, BsrConnectorStats()
        )
        self.relay = EventRelay(1)
        self.view: set[tuple[str, bytes]] = set()  # (tier, last block hash) claimed stored
        self.objects: dict[bytes, bsr.ObjectKey] = {}  # last block hash -> its object
        self.gone_behind: set[tuple[str, str]] = set()  # removed by gc since the last audit
        # damaged file objects: object id -> the inode of the damaged file (a file written
        # afresh, or moved to quarantine/ by the read that found it, is not that file)
        self.damaged: dict[str, tuple[Path, int]] = {}
        self.published = {"stored": 0, "removed": 0}

    def teardown(self) -> None:
        try:
            self.fleet.close()
            self.portal.call(self.engine.aclose)
        finally:
            self._cm.__exit__(None, None, None)
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _flush(self) -> None:
        self.relay.add(self.fleet.notices())
        for n in self.relay.take():
            key = (n.tier, n.info.block_hashes[-1])
            if n.stored:
                self.view.add(key)
                self.published["stored"] += 1
            else:
                self.view.discard(key)
                self.published["removed"] += 1

    def _okey(self, p: int, c: int) -> bsr.ObjectKey:
        return bsr.ObjectKey(self.engine.keys(PROMPTS[p][: (c + 1) * CHUNK])[c], "kv")

    async def _save(self, p: int, chunks: int) -> None:
        tokens = PROMPTS[p][: chunks * CHUNK]
        hashes = block_hashes(tokens)
        for c in range(chunks):
            self.objects[hashes[(c + 1) * (CHUNK // BLOCK) - 1]] = self._okey(p, c)
        job = SaveJob(
            f"r{p}", tuple(tokens), (tuple(range(len(tokens) // BLOCK)),), (),
            SaveEvents(hashes),
        )  # fmt: skip
        since = self.fleet.begin()
        assert since is not None
        try:
            result = await self.engine.save(list(tokens), self.cache, list(job.block_ids[0]))
            await self.fleet.after_save(job, result, since)
        finally:
            self.fleet.end(since)

    # ------------------------------------------------------------------ rules
    @rule(p=st.integers(0, 3), chunks=st.integers(1, 3))
    def save(self, p: int, chunks: int) -> None:
        self.portal.call(self._save, p, chunks)
        self._flush()

    @rule(p=st.integers(0, 3), c=st.integers(0, 2))
    def damage_and_restore(self, p: int, c: int) -> None:
        """Flip a payload byte of the file copy, drop the host copy, restore the prompt."""
        okey = self._okey(p, c)
        path = self.file.object_path(okey.chunk, "kv")
        if not path.exists():
            return
        raw = bytearray(path.read_bytes())
        raw[bsr.ObjectCodec.HEADER_SIZE + 3] ^= 0xFF
        with open(path, "r+b") as f:  # in place: the same file, damaged
            f.write(bytes(raw))
        self.damaged[okey.object_id] = (path, path.stat().st_ino)

        async def go() -> None:
            await self.host.delete(okey.chunk, "kv")
            dst = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
            await self.engine.restore(PROMPTS[p], dst, list(range(12)))

        self.portal.call(go)
        self._flush()

    @rule(p=st.integers(0, 3), c=st.integers(0, 2), which=st.sampled_from(["host", "file"]))
    def delete(self, p: int, c: int, which: str) -> None:
        okey = self._okey(p, c)
        tier = self.host if which == "host" else self.file
        self.portal.call(tier.delete, okey.chunk, "kv")
        self._flush()

    @rule(keep=st.integers(0, 6))
    def gc(self, keep: int) -> None:
        """``bsr store gc`` down to ``keep`` objects (as another process would)."""
        report = gc_store(self.root / "l2", keep * FILE_OBJ)
        for o in report.removed:
            self.gone_behind.add(("file", o.object_id))

    @rule()
    def audit(self) -> None:
        self.portal.call(self.fleet.audit_once)
        self._flush()
        self.gone_behind.clear()

    # ------------------------------------------------------------------ the invariant
    def _silently_damaged(self, oid: str) -> bool:
        got = self.damaged.get(oid)
        if got is None:
            return False
        path, ino = got
        try:
            return path.stat().st_ino == ino
        except FileNotFoundError:
            return False

    @invariant()
    def claims_only_what_can_be_served(self) -> None:
        async def servable(tier: bsr.Tier, okey: bsr.ObjectKey) -> bool:
            buf = np.zeros(LAYOUT.slot_bytes + 4096, dtype=np.uint8)
            try:
                await tier.read_into(okey.chunk, okey.group, buf)
            except bsr.BsrError:
                return False
            return True

        for name, last in sorted(self.view):
            okey = self.objects[last]
            tier = self.host if name == "host" else self.file
            if (name, okey.object_id) in self.gone_behind:
                continue  # within the lag: the next audit withdraws it
            if name == "file" and self._silently_damaged(okey.object_id):
                continue  # bit rot no read has found yet
            assert self.portal.call(servable, tier, okey), (name, okey, self.view)


def test_a_subscribers_view_never_claims_what_the_store_cannot_serve() -> None:
    run_state_machine_as_test(
        EventsModel,
        settings=settings(
            max_examples=25,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_the_model_publishes_both_kinds_of_events() -> None:
    """The model is not vacuous: a fixed run stores, evicts, quarantines and withdraws."""
    m = EventsModel()
    try:
        for p in range(4):
            m.save(p, 3)  # 12 objects: both tiers evict, the journal keeps 8
        m.claims_only_what_can_be_served()
        assert m.published["stored"] > 0 and m.published["removed"] > 0
        m.gc(0)
        m.audit()
        m.claims_only_what_can_be_served()
        assert not any(t == "file" for t, _ in m.view)  # gc emptied the root, the audit said so
        counts = dict(m.fleet.journal.counts)  # type: ignore[union-attr]
        assert counts.get("removed.vanished", 0) > 0 and counts.get("removed.evicted", 0) > 0
    finally:
        m.teardown()
