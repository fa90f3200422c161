"""The ``overhead`` and ``concurrency`` sections: what the restore machinery costs beyond the bytes.

Where it runs: inside ``bsr bench``, in the bench's event loop, on the public API only.

How it works: both sections restore from a :class:`bsr.HostTier`, so no disk is involved and
every microsecond beyond a memory copy is the engine's own (probe, key derivation, slot
accounting, worker-thread hops, verification, install).

- ``overhead``: one single-group layout per chunk size (4 KiB .. 32 MiB, one layer, 256 tokens per
  chunk), saved into a HostTier, restored ``repeats`` times with tokens as a numpy array; each
  restore is paired with a ``numpy.copyto`` of the same number of bytes (source and destination
  resident, measured right before it, so drift hits both alike). Reported: medians, the
  restore/memcpy bandwidth ratio and the time per chunk beyond data movement
  ``(restore - memcpy) / chunks``.
- ``concurrency``: ``max(levels)`` different prompts saved into one HostTier on one engine; for
  each level N, N restores of different prompts run at once (one task group); aggregate
  bandwidth = N x bytes / wall. The engine's staging statistics give the peak slots in use over
  the whole section, which must stay <= W.

Restored bytes are verified against the saved ones once per chunk size / prompt set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import torch

import bsr

from ..common.stats import BenchError, Dist, ratio

BLOCK_TOKENS = 16
CHUNK_TOKENS = 256
#: chunk sizes of the ``overhead`` section and the chunk count restored at each
OVERHEAD_POINTS: tuple[tuple[int, int], ...] = (
    (4 << 10, 256),
    (64 << 10, 256),
    (1 << 20, 64),
    (8 << 20, 16),
    (32 << 20, 16),
)
QUICK_OVERHEAD_POINTS: tuple[tuple[int, int], ...] = ((4 << 10, 64), (1 << 20, 16))
CONCURRENCY_LEVELS = (1, 2, 4, 8)


def _layout(chunk_bytes: int) -> bsr.StateLayout:
    if chunk_bytes % CHUNK_TOKENS:
        raise BenchError(f"chunk size {chunk_bytes} is not a multiple of {CHUNK_TOKENS}")
    group = bsr.StateGroup("kv", 1, chunk_bytes // CHUNK_TOKENS, dtype="uint8")
    return bsr.StateLayout(chunk_tokens=CHUNK_TOKENS, groups=(group,))


def _fill(cache: bsr.PagedKVCache, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = cache.tensor("kv").view(-1)
    n8 = t.numel() // 8 * 8
    t[:n8].view(torch.int64).random_(generator=gen)
    return t.clone()


def _engine(
    layout: bsr.StateLayout, capacity: int, window: int, io_depth: int, name: str
) -> bsr.RestoreEngine:
    return bsr.RestoreEngine(
        layout,
        [bsr.HostTier(capacity_bytes=capacity)],
        window=window,
        io_depth=io_depth,
        namespace=bsr.Namespace(model_id=f"bsr-bench/{name}"),
        prefault_staging=True,
    )


def _memcpy_s(nbytes: int, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> float:
    t0 = time.perf_counter()
    np.copyto(dst[:nbytes], src[:nbytes])
    return time.perf_counter() - t0


async def _overhead_point(
    chunk_bytes: int, chunks: int, repeats: int, window: int, io_depth: int, seed: int
) -> dict[str, Any]:
    layout = _layout(chunk_bytes)
    tokens_n = chunks * CHUNK_TOKENS
    tokens = np.random.default_rng(seed).integers(0, 2**31 - 1, size=tokens_n, dtype=np.int64)
    blocks = np.arange(tokens_n // BLOCK_TOKENS, dtype=np.int64)
    cache = bsr.PagedKVCache(layout, len(blocks), BLOCK_TOKENS)
    saved = _fill(cache, seed)
    nbytes = chunks * chunk_bytes
    src = saved.numpy()  # the saved bytes: resident, and what the restore moves too
    dst = np.ones(nbytes, dtype=np.uint8)  # touched, so the copy takes no page faults
    engine = _engine(layout, 2 * nbytes + (64 << 20), window, io_depth, f"overhead-{chunk_bytes}")
    restore_s: list[float] = []
    memcpy_s: list[float] = []
    async with engine:
        if not (await engine.save(tokens, cache, blocks)).ok:
            raise BenchError(f"overhead: saving {chunks} chunks of {chunk_bytes} B failed")
        cache.tensor("kv").zero_()
        _memcpy_s(nbytes, src, dst)  # warm both buffers
        for r in range(repeats + 1):  # the first restore is a warm-up (and the verified one)
            memcpy = _memcpy_s(nbytes, src, dst)
            t0 = time.perf_counter()
            result = await engine.restore(tokens, cache, blocks)
            wall = time.perf_counter() - t0
            if not result.committed or result.committed_tokens != tokens_n:
                raise BenchError(f"overhead: restore at {chunk_bytes} B ended {result.state}")
            if r == 0:
                if not torch.equal(cache.tensor("kv").view(-1), saved):
                    raise BenchError(f"overhead: restored bytes differ at {chunk_bytes} B chunks")
                continue
            restore_s.append(wall)
            memcpy_s.append(memcpy)
    rs = Dist.of(restore_s)
    ms = Dist.of(memcpy_s)
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "bytes": nbytes,
        "restore_s": rs.to_dict(),
        "memcpy_s": ms.to_dict(),
        "restore_bandwidth_Bps": rs.map(lambda s: nbytes / s).to_dict(),
        "memcpy_bandwidth_Bps": ms.map(lambda s: nbytes / s).to_dict(),
        "bandwidth_vs_memcpy": ratio(ms.median, rs.median, "overhead bandwidth_vs_memcpy"),
        "per_chunk_overhead_s": max(0.0, rs.median - ms.median) / chunks,
        "per_chunk_s": rs.median / chunks,
    }


async def measure_overhead(
    points: Sequence[tuple[int, int]], repeats: int, window: int, io_depth: int, seed: int
) -> dict[str, Any]:
    """The ``overhead`` section (see the module docstring)."""
    out = []
    for chunk_bytes, chunks in points:
        out.append(await _overhead_point(chunk_bytes, chunks, repeats, window, io_depth, seed))
    return {
        "tier": "host",
        "window": window,
        "io_depth": io_depth,
        "repeats": repeats,
        "tokens_as": "numpy int64",
        "points": out,
    }


async def _restore_many(
    engine: bsr.RestoreEngine,
    cache: bsr.PagedKVCache,
    prompts: Sequence[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]],
) -> tuple[float, list[int]]:
    rws: list[int] = []
    failed: list[str] = []

    async def one(tokens: np.ndarray[Any, Any], blocks: np.ndarray[Any, Any]) -> None:
        result = await engine.restore(tokens, cache, blocks)
        if not result.committed or result.committed_tokens != len(tokens):
            failed.append(f"{result.state} ({result.reason})")
        rws.append(result.rws_peak_bytes)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for tokens, blocks in prompts:
            tg.start_soon(one, tokens, blocks)
    wall = time.perf_counter() - t0
    if failed:
        raise BenchError(f"concurrency: restores ended {failed[:3]}")
    return wall, rws


async def measure_concurrency(
    levels: Sequence[int],
    chunks: int,
    chunk_bytes: int,
    repeats: int,
    window: int,
    io_depth: int,
    seed: int,
) -> dict[str, Any]:
    """The ``concurrency`` section (see the module docstring)."""
    layout = _layout(chunk_bytes)
    n = max(levels)
    per = chunks * CHUNK_TOKENS
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        tokens = rng.integers(0, 2**31 - 1, size=per, dtype=np.int64)
        blocks = np.arange(i * per // BLOCK_TOKENS, (i + 1) * per // BLOCK_TOKENS, dtype=np.int64)
        prompts.append((tokens, blocks))
    cache = bsr.PagedKVCache(layout, n * per // BLOCK_TOKENS, BLOCK_TOKENS)
    saved = _fill(cache, seed)
    nbytes = chunks * chunk_bytes
    engine = _engine(layout, 2 * n * nbytes + (64 << 20), window, io_depth, "concurrency")
    walls: dict[int, list[float]] = {k: [] for k in levels}
    rws_max = 0
    async with engine:
        for tokens, blocks in prompts:
            if not (await engine.save(tokens, cache, blocks)).ok:
                raise BenchError("concurrency: saving a prompt failed")
        cache.tensor("kv").zero_()
        await _restore_many(engine, cache, prompts)  # warm-up, verified
        if not torch.equal(cache.tensor("kv").view(-1), saved):
            raise BenchError("concurrency: restored bytes differ from the saved ones")
        for r in range(repeats):
            order = list(levels) if r % 2 == 0 else list(reversed(levels))
            for k in order:
                wall, rws = await _restore_many(engine, cache, prompts[:k])
                walls[k].append(wall)
                rws_max = max(rws_max, *rws)
        staging = engine.statistics().staging
    single_bw = Dist.of(walls[levels[0]]).map(lambda s: nbytes / s).median
    rows = []
    for k in levels:
        d = Dist.of(walls[k])
        agg = d.map(lambda s, k=k: k * nbytes / s)
        rows.append(
            {
                "concurrent": k,
                "wall_s": d.to_dict(),
                "aggregate_bandwidth_Bps": agg.to_dict(),
                "aggregate_vs_single": ratio(agg.median, single_bw, "aggregate_vs_single"),
            }
        )
    return {
        "tier": "host",
        "window": window,
        "io_depth": io_depth,
        "repeats": repeats,
        "chunk_bytes": chunk_bytes,
        "chunks_per_prompt": chunks,
        "slot_bytes": layout.slot_bytes,
        "levels": rows,
        "peak_slots_in_use": staging.peak_in_use,
        "peak_staging_bytes": staging.peak_bytes,
        "max_request_rws_bytes": rws_max,
        "window_bytes": window * layout.slot_bytes,
    }


#: timed calls of each form at least (as the ``cpu`` section's points: a median of 7 moved by
#: 5% with the machine, the size of the keys' margin to their target)
KEYS_REPEATS = 11


def measure_keys(
    tokens: int, repeats: int, chunk_tokens: int = 256, warmup: int = 1
) -> dict[str, Any]:
    """The ``keys`` section: :func:`bsr.prepare_tokens` (conversion + chained keys) on a list,
    a numpy array and a torch tensor of ``tokens`` random ids, medians over ``repeats``, in wall
    seconds (``<form>_s``) and in CPU seconds of the process (``<form>_cpu_s``), after
    ``warmup`` untimed calls of each form (a serving process keys every request: the first
    call's one-off costs, its code and buffers first touched, are not what each one pays; they
    made the first one to three of seven timed calls 10-25% slower)."""
    layout = bsr.StateLayout(chunk_tokens, (bsr.StateGroup("kv", 1, 16, dtype="uint8"),))
    ns = bsr.Namespace("bsr-bench/keys").fingerprint(layout)
    ids = np.random.default_rng(0).integers(0, 128_000, size=tokens, dtype=np.int64)
    forms: dict[str, Any] = {"list": ids.tolist(), "numpy": ids, "torch": torch.from_numpy(ids)}
    out: dict[str, Any] = {
        "tokens": tokens, "chunk_tokens": chunk_tokens, "repeats": repeats, "warmup": warmup,
    }  # fmt: skip
    ref = None
    for name, given in forms.items():
        samples = []
        cpu = []
        for _ in range(warmup):
            bsr.prepare_tokens(ns, given, chunk_tokens)
        for _ in range(repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            kt = bsr.prepare_tokens(ns, given, chunk_tokens)
            t1, c1 = time.perf_counter(), time.process_time()
            samples.append(t1 - t0)
            cpu.append(max(c1 - c0, 1e-9))
        digests = [k.digest for k in kt.keys]
        if ref is not None and digests != ref:
            raise BenchError(f"keys: {name} tokens give other keys than a list")
        ref = digests
        out[name + "_s"] = Dist.of(samples).to_dict()
        out[name + "_cpu_s"] = Dist.of(cpu).to_dict()
    return out
