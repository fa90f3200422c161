"""One rank of the 2-process restore over a real Mooncake Store (tests/engine/test_mooncake_faults).

Usage: python mooncake_dist_worker.py RANK WORLD RENDEZVOUS_FILE WORKDIR CLIENT_ADDRESS KEY_PREFIX
       FAULT SSD_RANKS OUT_JSON

The ranks meet through a file (torch's FileStore), not a TCP port picked in advance.

Each rank attaches a :class:`bsr.MooncakeTier` to the test cluster's gateway ``mooncake_client``
(standalone-client mode: this process listens on no port but gloo's, on 127.0.0.1) under its own
key prefix and namespace ``tp_rank``, saves its own shard, and restores it. Only rank 1's remote
tier faults:

- ``FAULT=read_error``: rank 1's MooncakeTier is wrapped in a ``FaultyTier`` that fails the read
  of chunk 2 (group ``kv``) with ``TierIOError``;
- ``FAULT=corrupt``: rank 1 flips a payload byte of its chunk-2 ``kv`` object in the store itself
  (detected by verification, ``CorruptObjectError``);
- ``FAULT=none``: no fault.

``SSD_RANKS`` is a comma-separated list of ranks (or ``-``) that get a ``FileTier`` holding the
same prefix under the remote tier.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import anyio
import torch
import torch.distributed as dist

import bsr
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier, corrupt_stored

FAULTY_RANK = 1
FAULTY_CHUNK = 2
CHUNK_TOKENS = 16
NUM_BLOCKS = 32
BLOCK_TOKENS = 8


def layout() -> bsr.StateLayout:
    return bsr.StateLayout(
        chunk_tokens=CHUNK_TOKENS,
        groups=(bsr.StateGroup("kv", 2, 128), bsr.StateGroup("swa", 1, 256, window_tokens=20)),
    )


@dataclass(frozen=True)
class Args:
    """The command line (see the module docstring)."""

    rank: int
    world: int
    rendezvous: Path
    workdir: Path
    client_address: str
    key_prefix: str
    fault: str
    ssd_ranks: frozenset[int]
    out: Path

    @classmethod
    def parse(cls, argv: list[str]) -> Args:
        rank, world, rendezvous, workdir, address, prefix, fault, ssd, out = argv
        ssd_ranks = frozenset(int(r) for r in ssd.split(",") if r.strip() not in ("", "-"))
        return cls(int(rank), int(world), Path(rendezvous), Path(workdir), address, prefix,
                   fault, ssd_ranks, Path(out))  # fmt: skip


def source(lay: bsr.StateLayout, rank: int) -> bsr.PagedKVCache:
    gen = torch.Generator().manual_seed(200 + rank)  # each rank holds its own shard
    src = bsr.PagedKVCache(lay, NUM_BLOCKS, BLOCK_TOKENS)
    for g in lay.groups:
        t = src.tensor(g.name)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return src


def engine_for(a: Args, lay: bsr.StateLayout) -> tuple[bsr.RestoreEngine, bsr.MooncakeTier]:
    """The rank's engine (its remote tier faulty where the fault says so) and the remote tier."""
    remote = bsr.MooncakeTier(
        client_address=a.client_address,
        key_prefix=f"{a.key_prefix}rank{a.rank}/",
        timeout_s=5.0,
        local_buffer_size=16 << 20,
    )
    top: bsr.Tier = remote
    if a.fault == "read_error":
        plan = FaultPlan(
            seed=3,
            faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({FAULTY_CHUNK}), group="kv"),),
            ranks=frozenset({FAULTY_RANK}),
        )
        top = FaultyTier(remote, plan, rank=a.rank)
    tiers: list[bsr.Tier] = [top]
    if a.rank in a.ssd_ranks:
        tiers.append(bsr.FileTier(a.workdir / f"ssd{a.rank}", 1 << 26))
    engine = bsr.RestoreEngine(
        lay,
        tiers,
        window=2,
        io_depth=2,
        namespace=bsr.Namespace("mooncake-dist-model", tp_rank=a.rank, tp_size=a.world),
        coordinator=bsr.TorchDistributedCoordinator(),
        deadline_s=30.0,
    )
    return engine, remote


async def run(a: Args) -> dict[str, object]:
    """Save the rank's shard, fault it where asked, restore it; what happened, as JSON."""
    lay = layout()
    src = source(lay, a.rank)
    tokens = list(range(3000, 3000 + 6 * CHUNK_TOKENS + 5))
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(11))[:13]
    bpc = CHUNK_TOKENS // BLOCK_TOKENS
    engine, remote = engine_for(a, lay)
    async with engine:
        saved = await engine.save(tokens, src, ids)
        if a.fault == "corrupt" and a.rank == FAULTY_RANK:
            key = engine.keys(tokens)[FAULTY_CHUNK]
            if not corrupt_stored(remote, key, "kv"):
                raise RuntimeError("could not corrupt the stored object")
        probe = await engine.lookup(tokens)
        dst = bsr.PagedKVCache(lay, NUM_BLOCKS, BLOCK_TOKENS)
        t0 = time.monotonic()
        res = await engine.restore(tokens, dst, ids)
        elapsed = time.monotonic() - t0
        exact = all(
            torch.equal(
                src.tensor(g.name)[:, ids[c * bpc : (c + 1) * bpc]],
                dst.tensor(g.name)[:, ids[c * bpc : (c + 1) * bpc]],
            )
            for g in lay.groups
            for c in lay.needed_chunks(g.name, res.committed_tokens // CHUNK_TOKENS)
        )
        return {
            "rank": a.rank,
            "saved_tokens": saved.saved_tokens,
            "save_errors": saved.errors,
            "probe_tokens": probe.prefix_tokens,
            "state": res.state.value,
            "reason": res.reason.value,
            "committed_tokens": res.committed_tokens,
            "probed_tokens": res.probed_tokens,
            "bytes_by_tier": res.bytes_by_tier,
            "fallbacks": res.fallbacks,
            "exact": exact,
            "in_use": engine.staging.statistics().in_use,
            "invalid_blocks": list(res.invalid_block_ids),
            "elapsed_s": elapsed,
            "kv_chunk_bytes": lay.group_chunk_bytes("kv"),
            "expected_bytes": {
                g.name: lay.group_chunk_bytes(g.name)
                * len(lay.needed_chunks(g.name, len(tokens) // CHUNK_TOKENS))
                for g in lay.groups
            },
        }


def main() -> None:
    a = Args.parse(sys.argv[1:])
    dist.init_process_group(
        "gloo",
        init_method=a.rendezvous.resolve().as_uri(),
        rank=a.rank,
        world_size=a.world,
        timeout=timedelta(seconds=60),
    )
    result = anyio.run(run, a)
    a.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip Mooncake's static destructors (nothing is left to flush)


if __name__ == "__main__":
    main()
