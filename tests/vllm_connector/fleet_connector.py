"""FleetConnector: BsrConnector whose tiers lose writes on demand, for the KV event tests.

Loaded by vLLM from its module path (``kv_connector_module_path="fleet_connector"``, with this
directory on ``PYTHONPATH``) in the engine's scheduler and worker processes. While
``<BSR_TEST_GATE>/lose-writes`` exists, every tier's writes go through a
``bsr.testing.FaultyTier`` with a ``LOST_WRITE`` fault: acknowledged, stored nowhere (the save
"succeeds", the store holds nothing: a store that must never be announced). Everything else is
the real connector over the real tiers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import bsr
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier
from bsr.vllm import BsrConnector
from bsr.vllm._worker import BsrWorker


class LosingWrites(bsr.TierWrapper[bsr.Tier]):
    """Writes are lost while ``<gate>/lose-writes`` exists; the rest is the inner tier."""

    def __init__(self, inner: bsr.Tier, gate: Path) -> None:
        super().__init__(inner)
        self.gate = gate
        self.faulty = FaultyTier(inner, FaultPlan(faults=(Fault(FaultKind.LOST_WRITE),)))

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        if (self.gate / "lose-writes").exists():
            return await self.faulty.write(key, group, payload)
        return await self.inner.write(key, group, payload)


class FleetWorker(BsrWorker):
    def wrap_tiers(self, tiers: list[bsr.Tier]) -> list[bsr.Tier]:
        gate = Path(os.environ["BSR_TEST_GATE"])
        return [LosingWrites(t, gate) for t in tiers]


class FleetConnector(BsrConnector):
    worker_cls = FleetWorker
