"""GatedConnector: BsrConnector over tiers that hang on demand, for the vLLM tests.

Loaded by vLLM from its module path (``kv_connector_module_path="gated_connector"``, with this
directory on ``PYTHONPATH``) in the engine's scheduler and worker processes. The directory named
by ``BSR_TEST_GATE`` is the gate: while ``<gate>/hang-lookup`` exists every tier's metadata query
waits, while ``<gate>/hang-read`` exists every read waits (a paused remote store; the read is
stuck in a thread, as a read stuck in the kernel is); marker files say what waited
(``contains-waiting``, ``read-waiting``) and that a held read came back (``read-returned``).
While ``<gate>/corrupt-first`` exists, a read of a prompt's first chunk finds it corrupt (the
object is then quarantined, as a damaged one is).

It also checks the worst bug an asynchronous load can have: a write into blocks vLLM was told
it may reuse. When the worker reports the load of a finished (aborted) request received, it
fills the blocks bsr could have written with a poison pattern (marker ``poisoned``), then, once
every held read came back and bsr's staging is idle, checks they still hold it and writes
``<gate>/poison.json``.
Everything else is the real connector over the real tiers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

import bsr
from bsr.vllm import BsrConnector
from bsr.vllm._metadata import NULL_BLOCK_ID, LoadJob
from bsr.vllm._worker import BsrWorker

POISON = 0x5A

# bsr's events in the engine's log, so a failing test shows what bsr did
_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter(f"bsr[{os.getpid()}] %(levelname)s %(message)s"))
logging.getLogger("bsr").addHandler(_handler)
logging.getLogger("bsr").setLevel(logging.INFO)


def gate() -> Path:
    return Path(os.environ["BSR_TEST_GATE"])


class GateTier(bsr.TierWrapper[bsr.Tier]):
    """Waits while ``<gate>/hang-lookup`` / ``hang-read`` exist; marks what waited."""

    def __init__(self, inner: bsr.Tier, where: Path) -> None:
        super().__init__(inner)
        self.where = where

    def _held(self, what: str = "read") -> bool:
        return (self.where / f"hang-{what}").exists()

    def _mark(self, name: str) -> None:
        (self.where / name).touch()

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        if self._held("lookup"):
            self._mark("contains-waiting")
            while self._held("lookup"):  # noqa: ASYNC110 - a file, not an event
                await anyio.sleep(0.05)
        return await self.inner.contains_many(objects)

    def fetch_into_blocking(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        held = self._held()
        if held:
            self._mark("read-waiting")
            while self._held():
                time.sleep(0.05)
        try:
            self._corrupt(key, group)
            return self.inner.fetch_into_blocking(key, group, dst)
        finally:
            if held:
                self._mark("read-returned")

    def _corrupt(self, key: bsr.ChunkKey, group: str) -> None:
        if key.index == 0 and (self.where / "corrupt-first").exists():
            raise bsr.CorruptObjectError("injected by the test", tier=self.name, group=group)

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        held = self._held()
        if held:
            self._mark("read-waiting")
            while self._held():  # noqa: ASYNC110 - a file, not an event
                await anyio.sleep(0.05)
        try:
            self._corrupt(key, group)
            return await self.inner.fetch_into(key, group, dst)
        finally:
            if held:
                self._mark("read-returned")


class GatedWorker(BsrWorker):
    """The real worker side over gated tiers, poisoning the blocks of aborted loads."""

    def wrap_tiers(self, tiers: list[bsr.Tier]) -> list[bsr.Tier]:
        where = gate()
        return [GateTier(t, where) for t in tiers]

    def transfer_results(self, finished_req_ids: set[str]) -> Any:
        before = dict(self._loads)
        out = super().transfer_results(finished_req_ids)
        for rid in out.finished_recving:
            load = before.get(rid)
            if load is not None and load.aborted:
                self._poison(load.job)
        return out

    def _blocks(self, job: LoadJob) -> list[int]:
        """The blocks bsr could write for ``job``: from vLLM's own hit on."""
        first = job.start_tokens // self.settings.block_size
        return [b for table in job.block_ids for b in table[first:] if b != NULL_BLOCK_ID]

    def _views(self, block: int) -> list[Any]:
        assert self.cache is not None
        return [
            layer[block] for g in self.cache.layout.groups for layer in self.cache.layers(g.name)
        ]

    def _poison(self, job: LoadJob) -> None:
        blocks = self._blocks(job)
        for b in blocks:
            for view in self._views(b):
                view.fill_(POISON)
        (gate() / "poisoned").touch()
        threading.Thread(target=self._check, args=(blocks,), daemon=True).start()

    def _staging_idle(self) -> bool:
        async def in_use() -> int:
            assert self.engine is not None
            return int(self.engine.statistics().staging.in_use)

        assert self.loop is not None
        return self.loop.call(in_use) == 0

    def _check(self, blocks: list[int]) -> None:
        where = gate()
        end = time.monotonic() + 300
        waited = (where / "read-waiting").exists()
        while time.monotonic() < end:
            returned = not waited or (where / "read-returned").exists()
            if returned and self._staging_idle():
                break
            time.sleep(0.05)
        time.sleep(0.5)  # the install a late reader would do follows its return at once
        intact = sum(all(bool((v == POISON).all()) for v in self._views(b)) for b in blocks)
        (where / "poison.json").write_text(json.dumps({"blocks": len(blocks), "intact": intact}))


class GatedConnector(BsrConnector):
    worker_cls = GatedWorker
