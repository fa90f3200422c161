"""One rank of the 2-process torch.distributed restore (run by tests/engine/test_distributed.py).

Usage: python dist_worker.py RANK WORLD RENDEZVOUS_FILE WORKDIR FAIL_RANK OUT_JSON

The ranks meet through a file (torch's FileStore), not a TCP port picked in advance: a port
another process takes between the pick and the bind would make the run fail, or meet a stranger.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import anyio
import torch
import torch.distributed as dist

import bsr
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier


def main() -> None:
    rank, world, rendezvous = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    workdir, fail_rank, out = Path(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
    dist.init_process_group(
        "gloo",
        init_method=rendezvous.resolve().as_uri(),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    layout = bsr.StateLayout(
        chunk_tokens=16,
        groups=(bsr.StateGroup("kv", 2, 128), bsr.StateGroup("swa", 1, 256, window_tokens=20)),
    )
    gen = torch.Generator().manual_seed(100 + rank)  # each rank holds its own shard
    src = bsr.PagedKVCache(layout, 32, 8)
    for g in layout.groups:
        t = src.tensor(g.name)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    tokens = list(range(1000, 1000 + 6 * 16 + 5))
    ids = torch.randperm(32, generator=torch.Generator().manual_seed(7))[:13]
    plan = FaultPlan(
        seed=1,
        faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({2}), group="kv"),),
        ranks=frozenset({fail_rank}),
    )

    async def run() -> dict[str, object]:
        tier = FaultyTier(bsr.FileTier(workdir / f"rank{rank}", 1 << 26), plan, rank=rank)
        engine = bsr.RestoreEngine(
            layout,
            [tier],
            window=2,
            io_depth=2,
            namespace=bsr.Namespace("dist-model", tp_rank=rank, tp_size=world),
            coordinator=bsr.TorchDistributedCoordinator(),
        )
        async with engine:
            await engine.save(tokens, src, ids)
            probe = await engine.lookup(tokens)
            dst = bsr.PagedKVCache(layout, 32, 8)
            res = await engine.restore(tokens, dst, ids)
            exact = all(
                torch.equal(
                    src.tensor(g.name)[:, ids[c * 2 : c * 2 + 2]],
                    dst.tensor(g.name)[:, ids[c * 2 : c * 2 + 2]],
                )
                for g in layout.groups
                for c in layout.needed_chunks(g.name, res.committed_tokens // 16)
            )
            return {
                "rank": rank,
                "probe_tokens": probe.prefix_tokens,
                "state": res.state.value,
                "reason": res.reason.value,
                "committed_tokens": res.committed_tokens,
                "exact": exact,
                "in_use": engine.staging.statistics().in_use,
                "invalid_blocks": list(res.invalid_block_ids),
            }

    result = anyio.run(run)
    out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
