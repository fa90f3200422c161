"""The bench's connector for ``--vllm-cost``: BsrConnector over tiers shaped to a condition.

Loaded by vLLM from its module path (``kv_connector_module_path="bsr_bench.vllm_cost_connector"``)
in the engine's scheduler and worker processes; the condition comes from the environment
variable ``BSR_BENCH_TIERS`` (JSON): ``slow_bytes_per_s`` puts the FileTier behind a
``bsr.testing.LatencyTier`` that reads at that rate per read (a slow remote store or a cold,
shared disk), ``host_chunks`` lets the HostTier keep only each prefix's first chunks (the part a
fast tier holds). Everything else is the real connector.
"""

from __future__ import annotations

import json
import os
from typing import Any

import bsr
from bsr.testing import LatencyTier
from bsr.vllm import BsrConnector, BsrWorker

ENV = "BSR_BENCH_TIERS"


class FirstChunks(bsr.TierWrapper[bsr.Tier]):
    """Keeps only chunks ``0 .. n-1`` of every prefix (a write of a later one stores nothing)."""

    def __init__(self, inner: bsr.Tier, n: int) -> None:
        super().__init__(inner)
        self.n = n

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        if key.index >= self.n:
            return False
        return await self.inner.write(key, group, payload)


class CostBenchWorker(BsrWorker):  # type: ignore[misc]
    def wrap_tiers(self, tiers: list[bsr.Tier]) -> list[bsr.Tier]:
        cond = json.loads(os.environ.get(ENV, "{}"))
        out: list[bsr.Tier] = []
        for t in tiers:
            if isinstance(t, bsr.FileTier) and cond.get("slow_bytes_per_s"):
                t = LatencyTier(
                    t, read_latency_s=0.0, bandwidth_bytes_per_s=cond["slow_bytes_per_s"]
                )
            elif isinstance(t, bsr.HostTier) and cond.get("host_chunks") is not None:
                t = FirstChunks(t, int(cond["host_chunks"]))
            out.append(t)
        return out


class CostBenchConnector(BsrConnector):  # type: ignore[misc]
    worker_cls = CostBenchWorker
