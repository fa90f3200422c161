"""One rank of ``bsr bench --tp N`` (started by :mod:`.tp`, one process per rank).

Where it runs: a child process of the bench, one per tensor-parallel rank, joined to the others
by a gloo process group on 127.0.0.1.

How it works: the rank saves its own shard (the same tokens on every rank, different bytes, its
own FileTier directory), then, with a barrier before each restore so the ranks start together:

1. ``repeats`` BSR restores agreed across ranks (:class:`~bsr.TorchDistributedCoordinator`),
   interleaved with ``repeats`` restores of the same shard by this rank alone (a coordinator
   that agrees with itself only), so the difference is what agreement costs;
2. the fault case: the failing rank's tier raises an I/O error on one chunk; every rank restores
   and must end Invalidated with nothing committed.

Usage: ``python -m bsr_bench.paper.tp_worker CONFIG_JSON RANK`` (the config is written by
:mod:`.tp`); the rank writes ``rank<R>.json`` next to it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import torch.distributed as dist

from bsr import RestoreEngine, RestoreResult, Tier, TorchDistributedCoordinator
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier

from ..common.layouts import resolve_layout
from ..common.memory import PeakRss
from .scale import ChunkedState, Destination, DestinationKind, SoloRank


def _sample(result: RestoreResult, wall: float, rss_growth: int) -> dict[str, Any]:
    t = result.timings
    return {
        "state": result.state.value,
        "reason": result.reason.value,
        "committed_tokens": result.committed_tokens,
        "probed_tokens": result.probed_tokens,
        "rws_peak_bytes": result.rws_peak_bytes,
        "wall_s": wall,
        "probe_s": t.probe_s,
        "install_s": t.install_s,
        "settle_s": t.settle_s,
        "commit_s": t.commit_s,
        "invalid_blocks": len(result.invalid_block_ids),
        "rss_growth_bytes": rss_growth,
    }


async def _rank(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    world = cfg["world_size"]
    named = resolve_layout(cfg["layout"])
    root = Path(cfg["root"]) / f"rank{rank}"
    state = ChunkedState(
        named,
        root,
        cfg["tokens"],
        seed=cfg["seed"],
        tp_rank=rank,
        tp_size=world,
        direct_io=cfg["direct_io"],
    )
    dest = Destination(
        named, state.num_blocks, DestinationKind(cfg["destination"]), root / "destination"
    )
    tokens = state.tokens
    ids = state.identity_ids()
    out: dict[str, Any] = {"rank": rank, "save": await state.save(dest.fresh())}

    def engine(tier: Tier, *, coordinated: bool) -> RestoreEngine:
        return RestoreEngine(
            state.layout,
            [tier],
            window=cfg["window"],
            io_depth=cfg["io_depth"],
            namespace=state.namespace,
            coordinator=TorchDistributedCoordinator() if coordinated else SoloRank(rank, world),
        )

    async def restore(eng: RestoreEngine) -> tuple[RestoreResult, dict[str, Any]]:
        cache = dest.fresh()
        await anyio.to_thread.run_sync(dist.barrier)  # the ranks start together
        with PeakRss() as peak:
            t0 = time.perf_counter()
            res = await eng.restore(tokens, cache, ids)
            wall = time.perf_counter() - t0
        sample = _sample(res, wall, max(0, peak.peak - peak_base))
        if res.committed:
            sample["verified"] = state.verify(cache, res.committed_tokens, sample=8)
        return res, sample

    from ..common.memory import current_rss

    peak_base = current_rss()
    # agreed and alone interleaved (ABAB), so drift on a shared machine hits both alike
    out["agreed"], out["alone"] = [], []
    async with (
        engine(state.tier(), coordinated=True) as agreed,
        engine(state.tier(), coordinated=False) as alone,
    ):
        for _ in range(cfg["repeats"]):
            for label, eng in (("agreed", agreed), ("alone", alone)):
                _, s = await restore(eng)
                out[label].append(s)
    fail_rank = cfg["fail_rank"]
    plan = FaultPlan(
        seed=cfg["seed"],
        faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({state.chunks // 2})),),
        ranks=frozenset({fail_rank}),
    )
    async with engine(FaultyTier(state.tier(), plan, rank=rank), coordinated=True) as eng:
        _, s = await restore(eng)
    out["fault"] = {**s, "failing_rank": fail_rank, "faulty_chunk": state.chunks // 2}
    dest.close()
    med = statistics.median
    out["agreement_overhead_s"] = med(x["wall_s"] for x in out["agreed"]) - med(
        x["wall_s"] for x in out["alone"]
    )
    # the phases that hold the collectives: the probe's MIN and the commit's vote + AND (the
    # latter includes waiting for the slowest rank to finish installing)
    out["agreement_phases_s"] = med(x["probe_s"] + x["commit_s"] for x in out["agreed"]) - med(
        x["probe_s"] + x["commit_s"] for x in out["alone"]
    )
    return out


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text("utf-8"))
    rank = int(sys.argv[2])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    try:
        result = anyio.run(_rank, cfg, rank)
        out = Path(sys.argv[1]).with_name(f"rank{rank}.json")
        out.write_text(json.dumps(result), "utf-8")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
