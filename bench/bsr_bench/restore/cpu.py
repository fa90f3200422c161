"""The ``cpu`` section: CPU seconds per GiB restored, beside the floor measured on the same bytes.

Where it runs: inside ``bsr bench`` (after the layouts, in the bench's event loop) and in
``bench/before_after.py``'s workers, on the public API only.

How it works: wall time on a shared two-core machine moves as much from run to run as from
change to change; CPU time is steadier, and it is what a serving host pays for every restore.
For each point (a tier, a chunk size, a chunk count) one single-group layout is saved and then
restored ``repeats`` times, each restore timed in **CPU seconds of the bench process** (user +
system time of every thread, ``time.process_time``; the split from ``getrusage``), its wall
time beside. The **floor** is measured in the same repeat, on the same number of bytes:

- per chunk, one xxh3 pass over its saved bytes (``xxhash.xxh3_64_intdigest``: every restored
  byte is verified once), then one copy of them into their place in the very tensor the restore
  writes (``numpy.copyto``, a single-threaded memcpy: every restored byte lands once), the copy
  right after the hash, while the chunk is still in the CPU's caches, as a restore checks and
  installs a chunk (``verify_copy_cpu_s``). The saved bytes lie in memory like a HostTier's
  arena, anonymous pages given the huge-page advice (:func:`floor_source`). Until 0.4 the floor
  was the two as separate passes over all the chunks, from ordinary pages: the copy then read
  every chunk from memory again and walked the page tables a second time, about half again as
  much CPU as a restore must spend (0.16-0.17 against 0.10-0.11 s/GiB at 512 KiB chunks on a
  2-vCPU EPYC), so ``cpu_vs_floor`` read lower than bsr's machinery warrants. Those two
  passes are still measured and kept beside (``xxh3_cpu_s``, ``copy_cpu_s``), outside the
  floor;
- for a ``FileTier``, the kernel's cost of reading the object files: **fio's own CPU** (its
  jobs' ``usr_cpu`` + ``sys_cpu``, from its JSON; fio's start-up is not in it) reading the
  very same files with the best configuration of the grid (from a first run of the whole
  grid: of the configurations within 10% of the highest bandwidth, the one with the least CPU,
  :func:`best_read_config`; every configuration's figures are kept). fio reports CPU in
  whole milliseconds, so with ``O_DIRECT`` each fio run reads the files several times
  (``loops``, :func:`read_passes`: at least 512 MiB, at most 16 passes) and the floor takes
  its CPU per pass. Without fio the bench's own raw reader (one ``preadv`` per file, one
  thread, timed in CPU seconds) stands in, and the point says so.

A host point has a second reference, beside the floor and not in it: the **minimal loop**
(:class:`MinimalLoop`, ``minimal_loop_cpu_s``), the least a Python restore from memory does,
written as one plain loop: the chunks' keys, a look-up per object, and per chunk its header
checked, its payload's xxh3 compared and its copy. ``minimal_loop_vs_floor`` says what Python
and the checks cost beyond the floor; ``cpu_vs_minimal_loop`` what bsr's own steps per chunk
(probe records, window, ladder, installer, commit) cost beyond that.

The floor's passes go chunk by chunk because a restore can do no better: its bytes arrive, and
are verified and copied, a chunk at a time. One call over a whole restore's bytes is not the
same work on every machine: glibc's ``memcpy`` switches to non-temporal stores above a size it
derives from the last-level cache (``x86_non_temporal_threshold``, 3/4 of the cache's share per
thread), and a copy that skips the cache costs a third less CPU per byte. On a machine with a
480 MiB L3 that size is about 180 MiB, so one copy of a 256 MiB restore took 0.099 s/GiB where
any copy of its 32 MiB chunks took 0.16; on one with a 32 MiB L3 both sides are above it. The
one-call passes are still measured and kept beside (``xxh3_one_call_cpu_s``,
``copy_one_call_cpu_s``), outside the floor.

Per point: ``cpu_per_gib_s`` (the restore's median CPU per GiB), ``floor_per_gib_s`` (the sum
of the floor's medians per GiB), ``cpu_vs_floor`` (their ratio) and ``machinery_per_chunk_s``
(restore CPU minus floor CPU, per chunk: what bsr's own machinery costs per chunk, request
work included). The wall ratios stay beside them: a host point's memcpy time / restore time (the
``overhead`` section's figure), a file point's restore bandwidth / fio's. Each point records the
load average before and after it. Restored bytes are checked once per point (the warm-up).
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import bsr

from ..common import fio as fio_mod
from ..common.pagecache import CacheMode, prepare
from ..common.raw import RawReader, huge_page_mapping, huge_page_share
from ..common.stats import BenchError, Dist, load_average, ratio

BLOCK_TOKENS = 16
CHUNK_TOKENS = 256
GIB = float(1 << 30)
#: (chunk bytes, chunks) of every point, for both tiers: 4 KiB (where the machinery per chunk
#: shows), 512 KiB and 32 MiB
CPU_POINTS: tuple[tuple[int, int], ...] = ((4 << 10, 256), (512 << 10, 256), (32 << 20, 8))
QUICK_CPU_POINTS: tuple[tuple[int, int], ...] = ((4 << 10, 64), (512 << 10, 16))
CPU_TIERS = ("host", "file")
#: targets of the section (bench/README.md): CPU over floor at >= 512 KiB chunks, and the
#: machinery per 4 KiB chunk
CPU_VS_FLOOR_MAX = 1.3
CPU_VS_FLOOR_FROM_CHUNK = 512 << 10
MACHINERY_PER_CHUNK_MAX_S = 15e-6
#: repeats of the section at least (CPU time is steadier than wall time, not steady: on a shared
#: machine a point's samples spread by 20-40%, so its median needs a few more)
CPU_REPEATS = 11
#: untimed restores before a point's repeats (the first is checked byte for byte): the steady
#: state of a serving process, caches and the engine's own look-up caches warm
WARMUP = 3


@dataclass(frozen=True)
class CpuTimes:
    """The bench process's CPU time at one instant (every thread)."""

    total: float
    user: float
    system: float

    @classmethod
    def now(cls) -> CpuTimes:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return cls(time.process_time(), ru.ru_utime, ru.ru_stime)

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(
            self.total - other.total, self.user - other.user, self.system - other.system
        )


class CpuClock:
    """Samples of CPU time (and wall time) of one timed region, over repeats."""

    def __init__(self) -> None:
        self.cpu: list[CpuTimes] = []
        self.wall: list[float] = []

    @contextmanager
    def timed(self) -> Iterator[None]:
        c0, w0 = CpuTimes.now(), time.perf_counter()
        yield
        w1, c1 = time.perf_counter(), CpuTimes.now()
        self.cpu.append(c1 - c0)
        self.wall.append(w1 - w0)

    def total(self) -> Dist:
        # process_time never goes backwards; a region shorter than its resolution reads 0
        return Dist.of([max(c.total, 1e-9) for c in self.cpu])

    def user(self) -> Dist:
        return Dist.of([max(c.user, 0.0) for c in self.cpu])

    def system(self) -> Dist:
        return Dist.of([max(c.system, 0.0) for c in self.cpu])

    def wall_dist(self) -> Dist:
        return Dist.of([max(w, 1e-9) for w in self.wall])


def _layout(chunk_bytes: int) -> bsr.StateLayout:
    if chunk_bytes % CHUNK_TOKENS:
        raise BenchError(f"cpu: chunk size {chunk_bytes} is not a multiple of {CHUNK_TOKENS}")
    group = bsr.StateGroup("kv", 1, chunk_bytes // CHUNK_TOKENS, dtype="uint8")
    return bsr.StateLayout(chunk_tokens=CHUNK_TOKENS, groups=(group,))


#: what one fio run of the read floor reads at least (in passes over a point's files, up to
#: ``READ_FLOOR_MAX_PASSES``): fio's CPU figure comes in whole milliseconds, which for one pass
#: over 128 MiB (6-13 ms here) moved a point's floor by up to a sixth
READ_FLOOR_BYTES = 512 << 20
READ_FLOOR_MAX_PASSES = 16


def read_passes(nbytes: int, mode: CacheMode) -> int:
    """Passes of one fio run of the read floor over ``nbytes`` of files: enough for
    ``READ_FLOOR_BYTES``, at most ``READ_FLOOR_MAX_PASSES``; one unless reads bypass the page
    cache (a second pass of a ``cold`` point would read cached pages)."""
    if mode is not CacheMode.DIRECT or nbytes <= 0:
        return 1
    return max(1, min(READ_FLOOR_MAX_PASSES, -(-READ_FLOOR_BYTES // nbytes)))


#: configurations of the grid whose first-run bandwidth is within this fraction of the highest
#: read as fast as the device allows (on a shared machine one run's bandwidths spread that much)
READ_FLOOR_BANDWIDTH_TIE = 0.10


def best_read_config(rows: Sequence[dict[str, Any]]) -> str | None:
    """The configuration of the read floor from a first run of the grid (``rows``: ``name``,
    ``bandwidth_Bps``, ``cpu_s`` per configuration; failed ones lack ``cpu_s``): of those that
    read as fast as the device allows (within ``READ_FLOOR_BANDWIDTH_TIE`` of the highest
    bandwidth), the one with the least CPU per pass; None when every configuration failed.

    The highest bandwidth alone picks among near-ties by chance, and the CPU of those differs by
    configuration (four ``psync`` threads cost half again as much as one queue): the floor is
    the cheapest way to read the bytes at the device's speed."""
    usable = [r for r in rows if r.get("cpu_s") is not None]
    if not usable:
        return None
    top = max(r["bandwidth_Bps"] for r in usable)
    fast = [r for r in usable if r["bandwidth_Bps"] >= (1 - READ_FLOOR_BANDWIDTH_TIE) * top]
    return str(min(fast, key=lambda r: (r["cpu_s"], -r["bandwidth_Bps"]))["name"])


@dataclass
class ReadFloor:
    """How the kernel's cost of reading the object files is measured for a file point."""

    files: list[str]
    mode: CacheMode
    binary: str | None
    grid: tuple[fio_mod.FioConfig, ...] = ()
    best: fio_mod.FioConfig | None = None
    first_pass: tuple[dict[str, Any], ...] = ()
    raw: RawReader | None = None
    #: passes over the files per fio run (:func:`read_passes`); its figures are per pass
    passes: int = 1

    def choose(self) -> None:
        """fio: one run of each configuration of the grid, then :func:`best_read_config`;
        else the raw reader."""
        if self.binary is not None:
            self.grid = fio_mod.fitted_grid(fio_mod.FIO_GRID, self.files)
            self.passes = read_passes(sum(os.path.getsize(f) for f in self.files), self.mode)
            rows: list[dict[str, Any]] = []
            for c in self.grid:
                prepare(self.mode, self.files)
                try:
                    read = fio_mod.run_fio(
                        self.binary, self.files, c, direct=self.mode is CacheMode.DIRECT,
                        passes=self.passes,
                    )  # fmt: skip
                except BenchError as exc:
                    rows.append({"name": c.name, "failed": str(exc)})
                    continue
                rows.append(
                    {
                        "name": c.name,
                        "bandwidth_Bps": read.bandwidth_Bps,
                        "cpu_s": read.per_pass(read.cpu_s),
                    }
                )
            pick = best_read_config(rows)
            if pick is not None:
                self.best = next(c for c in self.grid if c.name == pick)
            self.first_pass = tuple(rows)
        if self.best is None:
            biggest = max(os.path.getsize(f) for f in self.files)
            self.raw = RawReader(biggest, 1, direct=self.mode is CacheMode.DIRECT)

    def read(self, clock: CpuClock, bandwidth: list[float]) -> None:
        """One read of every file: fio's own CPU, or the raw reader's in this process."""
        prepare(self.mode, self.files)
        if self.best is not None:
            assert self.binary is not None
            got = fio_mod.run_fio(
                self.binary, self.files, self.best, direct=self.mode is CacheMode.DIRECT,
                passes=self.passes,
            )  # fmt: skip
            cpu = got.per_pass(got.cpu_s)
            assert cpu is not None
            usr = got.per_pass(got.usr_s) or 0.0
            sys_ = got.per_pass(got.sys_s) or 0.0
            clock.cpu.append(CpuTimes(max(cpu, 1e-9), usr, sys_))
            clock.wall.append(got.runtime_s / got.passes)
            bandwidth.append(got.bandwidth_Bps)
            return
        assert self.raw is not None
        with clock.timed():
            read = self.raw.read(self.files)
        bandwidth.append(read.nbytes / max(read.seconds, 1e-9))

    def describe(self) -> dict[str, Any]:
        if self.best is not None:
            lowest = min(
                (r for r in self.first_pass if r.get("cpu_s") is not None),
                key=lambda r: r["cpu_s"],
            )
            return {
                "reference": "fio",
                "config": self.best.name,
                "passes": self.passes,
                "grid": list(self.first_pass),
                "lowest_cpu_config": lowest["name"],
            }
        why = "fio is not installed" if self.binary is None else "every fio configuration failed"
        return {
            "reference": "raw",
            "config": "preadv, 1 thread",
            "grid": list(self.first_pass),
            "note": f"{why}: the bench's raw reader's CPU stands in for the kernel's read cost",
        }

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()


def floor_source(saved: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], str, Any]:
    """A copy of ``saved`` for the floor's passes to read, in memory like a HostTier's arena:
    anonymous pages the kernel is asked to back with transparent huge pages (the arena's
    default, ``huge_pages=True``), so the floor reads its bytes as cheaply as a restore can
    (a pass over 4 KiB pages walks the page tables per page: the separate hash and copy passes
    over 256 chunks of 512 KiB cost 0.16 CPU-s/GiB on them here, 0.12 on huge pages).

    Returns the copy, ``"huge"`` or ``"base"`` (the advice was not taken) and what keeps the
    memory."""
    buf, huge = huge_page_mapping(len(saved))
    out = np.frombuffer(buf, dtype=np.uint8)[: len(saved)]
    np.copyto(out, saved)
    return out, "huge" if huge else "base", buf


class MinimalLoop:
    """The least a Python restore from memory must do, as one plain loop (a host point's second
    reference, beside the floor and not in it: ``minimal_loop_cpu_s``).

    Per restore: the chunks' keys (:meth:`bsr.RestoreEngine.keys`, as a restore's probe makes
    them) and a dictionary look-up of each object; per chunk, its stored header checked
    (:meth:`bsr.ObjectCodec.decode_header` and ``check_stored_size``), its payload's xxh3
    compared with the header's (``verify_payload``) and the payload copied into its place in
    the cache, right after its check. The objects are the tier's format (``ObjectCodec.encode``
    of the saved bytes), in memory like a HostTier's arena (:func:`huge_page_mapping`). No window,
    no request, no tier: what a restore's figure has beyond this loop's is the cost of bsr's
    own steps per chunk (the probe's records, the window's slots and turns, the ladder, the
    installer, the commit), what is beyond the floor here the cost of Python and the checks.
    """

    def __init__(
        self, engine: bsr.RestoreEngine, tokens: np.ndarray[Any, Any], saved: np.ndarray[Any, Any],
        dst: np.ndarray[Any, Any], chunk_bytes: int, group: str,
    ) -> None:  # fmt: skip
        self.engine, self.tokens = engine, tokens
        keys = engine.keys(tokens)
        header = bsr.ObjectCodec.HEADER_SIZE
        stride = -(-(header + chunk_bytes) // 4096) * 4096
        self._keep, _ = huge_page_mapping(stride * len(keys))
        arena = np.frombuffer(self._keep, dtype=np.uint8)
        #: key digest -> (object key, header view, payload view, stored length)
        self.objects: dict[bytes, tuple[bsr.ObjectKey, Any, Any, int]] = {}
        self.pieces: list[Any] = []
        for i, key in enumerate(keys):
            okey = bsr.ObjectKey(key, group)
            lo = i * chunk_bytes
            blob = bsr.ObjectCodec.encode(okey, saved[lo : lo + chunk_bytes])
            at = i * stride
            arena[at : at + len(blob)] = np.frombuffer(blob, np.uint8)
            view = arena[at : at + len(blob)]
            self.objects[key.digest] = (okey, view[:header], view[header:], len(blob))
            self.pieces.append(dst[lo : lo + chunk_bytes])

    def run(self) -> None:
        """One restore of every chunk (a ``BenchError`` if an object fails its check)."""
        codec, objects, pieces = bsr.ObjectCodec, self.objects, self.pieces
        try:
            for i, key in enumerate(self.engine.keys(self.tokens)):
                okey, head, body, stored = objects[key.digest]
                header = codec.decode_header(head, okey)
                codec.check_stored_size(header, stored, okey)
                codec.verify_payload(body, header, okey)
                np.copyto(pieces[i], body)
        except (KeyError, bsr.ObjectError) as exc:
            raise BenchError(f"cpu: the minimal loop's object failed its check: {exc!r}") from exc


@dataclass(frozen=True)
class _PointState:
    """A point's state: its tokens and blocks, the destination cache filled with random bytes,
    a copy of them (``saved``), and the first ``nbytes`` of both as numpy arrays (``src`` the
    saved bytes, in memory like the host tier's: :func:`floor_source`; ``dst`` the
    destination's) for the floor."""

    layout: bsr.StateLayout
    tokens_n: int
    tokens: np.ndarray[Any, Any]
    blocks: np.ndarray[Any, Any]
    cache: bsr.PagedKVCache
    dest: torch.Tensor
    saved: torch.Tensor
    nbytes: int
    src: np.ndarray[Any, Any]
    dst: np.ndarray[Any, Any]
    #: the pages ``src`` lies in (``"huge"`` or ``"base"``) and what keeps its memory
    src_pages: str = "base"
    src_keep: Any = None

    @classmethod
    def make(cls, chunk_bytes: int, chunks: int, seed: int) -> _PointState:
        """``chunks`` chunks of ``chunk_bytes`` bytes of seeded random tokens and bytes."""
        layout = _layout(chunk_bytes)
        tokens_n = chunks * CHUNK_TOKENS
        tokens = np.random.default_rng(seed).integers(0, 2**31 - 1, size=tokens_n, dtype=np.int64)
        blocks = np.arange(tokens_n // BLOCK_TOKENS, dtype=np.int64)
        cache = bsr.PagedKVCache(layout, len(blocks), BLOCK_TOKENS)
        dest = cache.tensor("kv").view(-1)
        gen = torch.Generator().manual_seed(seed)
        dest[: dest.numel() // 8 * 8].view(torch.int64).random_(generator=gen)
        saved = dest.clone()
        nbytes = chunks * chunk_bytes
        src, pages, keep = floor_source(saved.numpy()[:nbytes])
        dst = dest.numpy()[:nbytes]
        return cls(
            layout, tokens_n, tokens, blocks, cache, dest, saved, nbytes, src, dst, pages, keep
        )


@dataclass
class _PointClocks:
    """The timed regions of a point: the restore and the floor's hash, copy and read."""

    restore: CpuClock = field(default_factory=CpuClock)
    #: the floor's check and copy: per chunk, its hash, then its copy while it is cached
    verify_copy: CpuClock = field(default_factory=CpuClock)
    #: the same two as separate passes over every chunk (kept beside the floor, not in it)
    xxh3: CpuClock = field(default_factory=CpuClock)
    copy: CpuClock = field(default_factory=CpuClock)
    read: CpuClock = field(default_factory=CpuClock)
    read_bw: list[float] = field(default_factory=list)
    #: the floor's passes as one call over all the bytes (kept beside the floor, not in it)
    xxh3_one_call: CpuClock = field(default_factory=CpuClock)
    copy_one_call: CpuClock = field(default_factory=CpuClock)
    #: a host point's :class:`MinimalLoop` (kept beside the floor, not in it)
    minimal_loop: CpuClock = field(default_factory=CpuClock)


def _point_tier(
    tier_kind: str, chunk_bytes: int, capacity: int, root: Path | None, mode: CacheMode
) -> tuple[Any, Path | None]:
    """The point's tier (``host`` or ``file``) and the directory of a FileTier (else None)."""
    if tier_kind == "host":
        return bsr.HostTier(capacity_bytes=capacity), None
    if root is None:
        raise BenchError("cpu: a file point needs a directory")
    directory = root / f"cpu-file-{chunk_bytes}"
    return bsr.FileTier(directory, capacity, direct_io=mode is CacheMode.DIRECT), directory


async def _cpu_point(
    tier_kind: str,
    chunk_bytes: int,
    chunks: int,
    *,
    repeats: int,
    window: int,
    io_depth: int,
    seed: int,
    root: Path | None,
    mode: CacheMode,
    fio_binary: str | None,
) -> dict[str, Any]:
    """One point of the section: save, then the timed restores beside the floor; its JSON."""
    st = _PointState.make(chunk_bytes, chunks, seed)
    capacity = 2 * (st.nbytes + chunks * 8192) + (64 << 20)
    tier, directory = _point_tier(tier_kind, chunk_bytes, capacity, root, mode)
    engine = bsr.RestoreEngine(
        st.layout,
        [tier],
        window=window,
        io_depth=io_depth,
        namespace=bsr.Namespace(model_id=f"bsr-bench/cpu-{tier_kind}-{chunk_bytes}"),
        prefault_staging=True,
    )
    clocks = _PointClocks()
    floor_read: ReadFloor | None = None
    load_before = load_average()
    try:
        async with engine:
            if not (await engine.save(st.tokens, st.cache, st.blocks)).ok:
                raise BenchError(f"cpu: saving {chunks} chunks of {chunk_bytes} B failed")
            files: list[str] = []
            if tier_kind == "file":
                files = [str(tier.object_path(k, "kv")) for k in engine.keys(st.tokens)]
                floor_read = ReadFloor(files, mode, fio_binary)
                floor_read.choose()
            minimal = None
            if tier_kind == "host":
                minimal = MinimalLoop(
                    engine, st.tokens, st.saved.numpy()[: st.nbytes], st.dst, chunk_bytes, "kv"
                )
            await _timed_restores(
                engine, st, clocks, files, floor_read, mode, repeats, tier_kind, chunk_bytes,
                minimal,
            )  # fmt: skip
    finally:
        if floor_read is not None:
            floor_read.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    out = _point_json(tier_kind, chunk_bytes, chunks, st.nbytes, clocks, floor_read, load_before)
    out["floor"]["source_pages"] = st.src_pages
    # whether the advice was met, read once the point's pages are touched: the kernel gives a
    # huge page where it has one, and both sides' CPU per byte move with it
    out["huge_page_share"] = {
        "floor_source": huge_page_share(st.src.ctypes.data),
        "cache": huge_page_share(st.dst.ctypes.data),
    }
    return out


async def _timed_restores(
    engine: bsr.RestoreEngine,
    st: _PointState,
    clocks: _PointClocks,
    files: list[str],
    floor_read: ReadFloor | None,
    mode: CacheMode,
    repeats: int,
    tier_kind: str,
    chunk_bytes: int,
    minimal: MinimalLoop | None = None,
) -> None:
    """The warm-ups (the first checked byte for byte), then ``repeats`` timed restores, each
    followed by the floor's timed hash, copy and (for a file point) read of the same bytes, and
    by the timed :class:`MinimalLoop` of a host point (checked byte for byte once, first)."""
    tokens, cache, blocks, src, dst = st.tokens, st.cache, st.blocks, st.src, st.dst
    restore, xxh3, copy = clocks.restore, clocks.xxh3, clocks.copy
    # each chunk's bytes, as the restore verifies and copies them (views made before the clock)
    pieces = [
        (src[lo : lo + chunk_bytes], dst[lo : lo + chunk_bytes])
        for lo in range(0, st.nbytes, chunk_bytes)
    ]
    digest = xxhash.xxh3_64_intdigest
    cache.tensor("kv").zero_()
    np.copyto(dst, src)  # warm both buffers
    cache.tensor("kv").zero_()
    if minimal is not None:
        minimal.run()
        if not torch.equal(st.dest[: st.nbytes], st.saved[: st.nbytes]):
            raise BenchError(f"cpu: the minimal loop's bytes differ at {chunk_bytes} B chunks")
        cache.tensor("kv").zero_()
    gc.collect()  # once per point: a full collection walks every object of the
    # process and leaves the CPU caches cold for whatever runs next (about 0.9 ms more
    # for a small restore here); a serving process does not collect before each restore
    for r in range(repeats + WARMUP):  # warm-ups first (the first one is checked)
        if files:
            prepare(mode, files)
        with restore.timed():
            result = await engine.restore(tokens, cache, blocks)
        if not result.committed or result.committed_tokens != st.tokens_n:
            raise BenchError(
                f"cpu: {tier_kind} restore at {chunk_bytes} B ended {result.state} "
                f"({result.reason})"
            )
        if r < WARMUP:
            if r == 0 and not torch.equal(st.dest[: st.nbytes], st.saved[: st.nbytes]):
                raise BenchError(
                    f"cpu: restored bytes differ at {chunk_bytes} B chunks ({tier_kind})"
                )
            restore.cpu.clear()
            restore.wall.clear()
            continue
        with clocks.verify_copy.timed():
            for a, b in pieces:
                digest(a)  # type: ignore[arg-type]
                np.copyto(b, a)
        with xxh3.timed():
            for a, _ in pieces:
                digest(a)  # type: ignore[arg-type]
        with copy.timed():
            for a, b in pieces:
                np.copyto(b, a)
        with clocks.xxh3_one_call.timed():
            digest(src)  # type: ignore[arg-type]
        with clocks.copy_one_call.timed():
            np.copyto(dst, src)
        if minimal is not None:
            with clocks.minimal_loop.timed():
                minimal.run()
        if floor_read is not None:
            floor_read.read(clocks.read, clocks.read_bw)


def _point_json(
    tier_kind: str,
    chunk_bytes: int,
    chunks: int,
    nbytes: int,
    clocks: _PointClocks,
    floor_read: ReadFloor | None,
    load_before: list[float] | None,
) -> dict[str, Any]:
    restore, xxh3, copy, read_bw = clocks.restore, clocks.xxh3, clocks.copy, clocks.read_bw
    read = clocks.read if floor_read is not None else None
    gib = nbytes / GIB
    rc = restore.total()
    floor_parts = {"verify_copy_cpu_s": clocks.verify_copy.total()}
    if read is not None:
        floor_parts["read_cpu_s"] = read.total()
    floor_s = sum(d.median for d in floor_parts.values())
    wall = restore.wall_dist()
    floor: dict[str, Any] = {k: d.to_dict() for k, d in floor_parts.items()}
    floor["xxh3_cpu_s"] = xxh3.total().to_dict()
    floor["copy_cpu_s"] = copy.total().to_dict()
    floor["copy_wall_s"] = copy.wall_dist().to_dict()
    floor["xxh3_one_call_cpu_s"] = clocks.xxh3_one_call.total().to_dict()
    floor["copy_one_call_cpu_s"] = clocks.copy_one_call.total().to_dict()
    floor["cpu_s"] = floor_s
    minimal: dict[str, Any] = {"minimal_loop_vs_floor": None, "cpu_vs_minimal_loop": None}
    if clocks.minimal_loop.cpu:
        loop = clocks.minimal_loop.total()
        floor["minimal_loop_cpu_s"] = loop.to_dict()
        minimal["minimal_loop_vs_floor"] = ratio(loop.median, floor_s, "minimal loop vs floor")
        minimal["cpu_vs_minimal_loop"] = ratio(rc.median, loop.median, "cpu vs minimal loop")
    if read is not None and floor_read is not None:
        floor["read"] = floor_read.describe()
        floor["read_usr_s"] = read.user().to_dict()
        floor["read_sys_s"] = read.system().to_dict()
        floor["read_bandwidth_Bps"] = Dist.of(read_bw).to_dict()
    if tier_kind == "host":
        wall_ratio = {
            "reference": "memcpy",
            "value": ratio(copy.wall_dist().median, wall.median, "cpu host wall ratio"),
        }
    else:
        bw = nbytes / wall.median
        wall_ratio = {
            "reference": floor["read"]["reference"] if read is not None else "none",
            "value": ratio(bw, statistics.median(read_bw), "cpu file wall ratio"),
        }
    return {
        "tier": tier_kind,
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "bytes": nbytes,
        "restore_cpu_s": rc.to_dict(),
        "restore_usr_s": restore.user().to_dict(),
        "restore_sys_s": restore.system().to_dict(),
        "restore_wall_s": wall.to_dict(),
        "floor": floor,
        "cpu_per_gib_s": rc.median / gib,
        "floor_per_gib_s": floor_s / gib,
        "cpu_vs_floor": ratio(rc.median, floor_s, f"cpu_vs_floor {tier_kind} {chunk_bytes}"),
        "machinery_per_chunk_s": max(0.0, rc.median - floor_s) / chunks,
        **minimal,
        "wall_vs_reference": wall_ratio,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


async def measure_cpu(
    points: Sequence[tuple[int, int]],
    repeats: int,
    window: int,
    io_depth: int,
    seed: int,
    *,
    tiers: Sequence[str] = CPU_TIERS,
    root: Path | None = None,
    mode: CacheMode = CacheMode.DIRECT,
    fio_binary: str | None = None,
) -> dict[str, Any]:
    """The ``cpu`` section (see the module docstring); ``root`` holds the file points' tiers.

    The process's long-lived objects are kept out of the collector while it runs (``gc.freeze``,
    as the default run does for all its figures, unless the caller already froze them): a full
    collection walks every object of the bench process (torch, transformers, the bench), so one
    falling inside a timed restore would charge it milliseconds that depend on the bench's heap,
    not on bsr.
    """
    load_start = load_average()
    froze = gc.get_freeze_count() == 0
    if froze:
        gc.collect()
        gc.freeze()
    out = []
    try:
        for kind in tiers:
            for chunk_bytes, chunks in points:
                point = await _cpu_point(
                    kind, chunk_bytes, chunks, repeats=repeats, window=window,
                    io_depth=io_depth, seed=seed, root=root, mode=mode, fio_binary=fio_binary,
                )  # fmt: skip
                out.append(point)
    finally:
        if froze:
            gc.unfreeze()
    return {
        "clock": "time.process_time (user + system CPU of every thread of the bench process); "
        "split from getrusage(RUSAGE_SELF)",
        "floor": "xxh3 pass + numpy.copyto into the destination (+ for FileTier: fio's job CPU "
        "per pass reading the same files, the cheapest configuration within 10% of the best "
        "bandwidth)",
        "window": window,
        "io_depth": io_depth,
        "repeats": repeats,
        "cache_mode": mode.value,
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "points": out,
    }


def cpu_targets(section: dict[str, Any]) -> list[dict[str, Any]]:
    """The section's targets (``{name, description, value, threshold, met}``)."""
    out: list[dict[str, Any]] = []
    points = section["points"]
    for kind, label in (("file", "FileTier"), ("host", "HostTier")):
        big = [
            p for p in points if p["tier"] == kind and p["chunk_bytes"] >= CPU_VS_FLOOR_FROM_CHUNK
        ]
        if big:
            worst = max(p["cpu_vs_floor"] for p in big)
            out.append(
                {
                    "name": f"cpu_{kind}_vs_floor",
                    "description": f"{label} restore CPU / floor CPU (same bytes, same run) at "
                    ">= 512 KiB chunks (highest over the points)",
                    "value": float(worst),
                    "threshold": CPU_VS_FLOOR_MAX,
                    "met": bool(worst <= CPU_VS_FLOOR_MAX),
                }
            )
    small = [p for p in points if p["tier"] == "host"]
    if small:
        p = min(small, key=lambda p: p["chunk_bytes"])
        v = p["machinery_per_chunk_s"]
        out.append(
            {
                "name": "cpu_machinery_per_chunk_small_s",
                "description": "HostTier restore CPU beyond the floor, per chunk, at "
                f"{p['chunk_bytes']} B chunks (seconds)",
                "value": float(v),
                "threshold": MACHINERY_PER_CHUNK_MAX_S,
                "met": bool(v <= MACHINERY_PER_CHUNK_MAX_S),
            }
        )
    return out
