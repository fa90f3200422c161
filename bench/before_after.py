#!/usr/bin/env python3
"""Machinery figures of two revisions, measured side by side: ``python bench/before_after.py``.

How it works: both revisions are exported with ``git archive`` into a temporary directory (so
neither is the working tree) and a worker subprocess per revision, with that revision's ``src``
first on ``PYTHONPATH``, runs the working tree's bench code (``bench/bsr_bench``: it uses only
the public ``bsr`` API, so it runs against either) to measure the ``overhead`` and
``concurrency`` sections, the ``cpu`` section (CPU seconds per GiB restored from a HostTier and
a FileTier at 4 KiB, 512 KiB and 32 MiB chunks beside the floor measured on the same bytes),
the key derivation of a 512K-token list, numpy array and torch tensor (wall, and CPU for the
array), and FileTier restores (``O_DIRECT``, each revision's default reader) of 8K-token
states of the bench's llama3-8b (32 MiB chunks), dsv4-flash (16 MiB) and kv-512k (512 KiB)
layouts against the best raw read and the best configuration of the working tree's fio grid on
the same object files, plus the W sweep (smallest W at 95% of the best), and the SSD concurrency
figure on the dsv4-flash state (TTFT with one read in flight over TTFT at the revision's default
depth, fio io_uring qd 64 / qd 1 on the same files beside it). Rounds alternate the revisions
(ABBA...), so drift on a shared machine hits both alike; the document keeps every round and
reports, per figure, the median over rounds and the after/before ratio.

    python bench/before_after.py --before 17a7d59 --after HEAD --rounds 3 \\
        --json bench/results/before-after.json

Where it runs: a development checkout (needs git). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- worker (either revision)
def _keys_worker(tokens: int, repeats: int) -> dict[str, Any]:
    import numpy as np
    import torch

    import bsr

    try:
        derive = bsr.prepare_tokens  # type: ignore[attr-defined]
    except AttributeError:  # revisions before bsr.prepare_tokens: the engine's own call
        from bsr.core._keys import chunk_keys as derive  # type: ignore[no-redef]
    layout = bsr.StateLayout(256, (bsr.StateGroup("kv", 1, 16, dtype="uint8"),))
    ns = bsr.Namespace("before-after").fingerprint(layout)
    ids = np.random.default_rng(0).integers(0, 128_000, size=tokens, dtype=np.int64)
    out: dict[str, Any] = {}
    for name, given in (("list", ids.tolist()), ("numpy", ids), ("torch", torch.from_numpy(ids))):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            derive(ns, given, 256)
            samples.append(time.perf_counter() - t0)
        out[name + "_s"] = statistics.median(samples)
    return out


def _chunk_keys(ns: bytes, tokens: Any, chunk_tokens: int) -> list[Any]:
    import bsr

    try:
        return list(bsr.chunk_keys(ns, tokens, chunk_tokens))  # type: ignore[attr-defined]
    except AttributeError:  # revisions before the public bsr.chunk_keys
        from bsr.core._keys import chunk_keys

        return list(chunk_keys(ns, tokens, chunk_tokens))


FILE_LAYOUTS = {  # the bench's built-in layouts (bsr_bench.common.layouts): name -> tokens
    "llama3-8b": 8192,  # 32 MiB chunks
    "dsv4-flash": 8192,  # 16,408,576 B chunks in two groups (kv, indexer)
    "kv-512k": 8192,  # 512 KiB chunks
}
#: the SSD concurrency figure (the paper's row, small): this layout's saved state restored with
#: one read in flight and at the revision's default depth, cold (O_DIRECT)
SSD_LAYOUT = "dsv4-flash"


def _sizes(files: list[str]) -> list[int]:
    return [os.path.getsize(f) for f in files]


def _file_tier(root: Path, cap: int, read_depth: int | None) -> Any:
    """Each revision's own default FileTier reader (io_uring where it has one); ``read_depth``
    where the revision has it (a revision without it reads with the engine's io_depth threads
    and has no ring depth to set)."""
    import bsr

    if read_depth is None:
        return bsr.FileTier(root, cap, direct_io=True)
    try:
        return bsr.FileTier(root, cap, direct_io=True, read_depth=read_depth)  # type: ignore[call-arg]
    except TypeError:
        return bsr.FileTier(root, cap, direct_io=True)


async def _file_worker(repeats: int) -> dict[str, Any]:
    """FileTier restores (O_DIRECT) vs the best raw read and the best configuration of the fio
    grid on the same object files, rotated; the W sweep at io_depth min(W, 4); and the SSD
    concurrency figure (one read in flight vs the default depth, fio io_uring qd 1 beside it)."""
    from bsr_bench.common import fio

    binary = fio.fio_binary()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bsr-ba-file-") as tmp:
        for name, n in FILE_LAYOUTS.items():
            out[name] = await _file_layout(name, n, Path(tmp) / name, repeats, binary)
    return out


def _engine_factory(layout: Any, root: Path, cap: int) -> Callable[..., tuple[Any, Any]]:
    """``engine(w, d, read_depth=None)``: a RestoreEngine on a fresh FileTier over ``root``
    (the revision's default reader), and that tier."""
    import bsr

    def engine(
        w: int,
        d: int,
        read_depth: int | None = None,
    ) -> tuple[bsr.RestoreEngine, bsr.FileTier]:
        tier = _file_tier(root, cap, read_depth)
        eng = bsr.RestoreEngine(
            layout,
            [tier],
            window=w,
            io_depth=d,
            namespace=bsr.Namespace("ba"),
        )
        return eng, tier

    return engine


async def _file_layout(
    name: str, n: int, root: Path, repeats: int, binary: str | None
) -> dict[str, Any]:
    """One layout's figures: an ``n``-token state saved, then the rotated restores and reads
    (and the W sweep for llama3-8b, the SSD figure for ``SSD_LAYOUT``)."""
    import numpy as np
    import torch

    import bsr
    from bsr_bench.common import fio
    from bsr_bench.common.layouts import resolve_layout

    layout = resolve_layout(name).layout
    cap = 2 * n * layout.token_bytes + (64 << 20)
    tokens = np.random.default_rng(1).integers(0, 2**31 - 1, size=n, dtype=np.int64)
    blocks = np.arange(n // 16, dtype=np.int64)
    cache = bsr.PagedKVCache(layout, len(blocks), 16)
    for g in layout.groups:
        flat = cache.tensor(g.name).view(-1)
        flat[: flat.numel() // 8 * 8].view(torch.int64).random_()
    engine = _engine_factory(layout, root, cap)
    eng, tier = engine(8, 4)
    async with eng:
        await eng.save(tokens, cache, blocks)
    ns = bsr.Namespace("ba").fingerprint(layout)
    keys = _chunk_keys(ns, tokens, layout.chunk_tokens)
    files = [str(tier.object_path(keys[c], g)) for c, g in layout.needed_objects(len(keys))]
    sizes = _sizes(files)
    nbytes, biggest = sum(sizes), max(sizes)
    grid = fio.fitted_grid(fio.FIO_GRID, files) if binary else ()
    bsr_s, raw_s, fio_bw = await _file_rounds(
        name, engine, tokens, cache, blocks, files, biggest, grid, binary, repeats
    )
    bsr_bw = nbytes / statistics.median(bsr_s)
    raw_bw = nbytes / statistics.median(raw_s)
    fig: dict[str, Any] = {
        "bsr_Bps": bsr_bw,
        "raw_Bps": raw_bw,
        "bsr_vs_raw": bsr_bw / raw_bw,
    }
    if grid:
        best = max(statistics.median(v) for v in fio_bw.values())
        fig["fio_best_Bps"] = best
        fig["bsr_vs_fio"] = bsr_bw / best
    if name == "llama3-8b":
        fig["smallest_window_95"] = await _window(engine, tokens[:2048], cache, blocks, repeats)
    if name == SSD_LAYOUT:
        fig.update(await _ssd(engine, tokens, cache, blocks, files, repeats, binary))
    return fig


async def _file_rounds(
    name: str,
    engine: Callable[..., tuple[Any, Any]],
    tokens: Any,
    cache: Any,
    blocks: Any,
    files: list[str],
    biggest: int,
    grid: Any,
    binary: str | None,
    repeats: int,
) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """``repeats`` rounds of a BSR restore (W 8, io_depth 4), the best of the raw readers (1
    and 4 threads) and every fio configuration of ``grid``; the restore times, the raw read
    times and fio's bandwidths per configuration."""
    from bsr_bench.common import fio
    from bsr_bench.common.raw import RawReader

    readers = [RawReader(biggest, 1, direct=True), RawReader(biggest, 4, direct=True)]
    bsr_s: list[float] = []
    raw_s: list[float] = []
    fio_bw: dict[str, list[float]] = {c.name: [] for c in grid}
    eng, _ = engine(8, 4)
    async with eng:
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = await eng.restore(tokens, cache, blocks)
            bsr_s.append(time.perf_counter() - t0)
            if not res.committed:
                raise SystemExit(f"{name}: restore ended {res.state} ({res.reason})")
            raw_s.append(min(r.read(files).seconds for r in readers))
            for c in grid:
                read = fio.run_fio(binary or "fio", files, c, direct=True)
                fio_bw[c.name].append(read.bandwidth_Bps)
    for r in readers:
        r.close()
    return bsr_s, raw_s, fio_bw


async def _ssd(
    engine: Any,
    tokens: Any,
    cache: Any,
    blocks: Any,
    files: list[str],
    repeats: int,
    binary: str | None,
) -> dict[str, Any]:
    """TTFT with one read in flight (read depth 1 where the revision has one, io_depth 1) over
    TTFT at the default (the tier's own depth, io_depth 4, W 8), rotated; fio io_uring at
    1 MiB blocks, qd 1 and qd 64, on the same files beside it (the device's own ratio)."""
    from bsr_bench.common import fio

    ttft: dict[str, list[float]] = {"one": [], "default": []}
    engines = {"one": engine(8, 1, 1)[0], "default": engine(8, 4)[0]}
    grid = (
        fio.fitted_grid(
            [fio.FioConfig("io_uring", 1 << 20, 1), fio.FioConfig("io_uring", 1 << 20, 64)], files
        )
        if binary
        else ()
    )
    fio_bw: dict[int, list[float]] = {c.depth: [] for c in grid}
    for e in engines.values():
        await e.open()
    try:
        for r in range(repeats):
            order = ["one", "default"] if r % 2 == 0 else ["default", "one"]
            for which in order:
                t0 = time.perf_counter()
                res = await engines[which].restore(tokens, cache, blocks)
                ttft[which].append(time.perf_counter() - t0)
                if not res.committed:
                    raise SystemExit(f"ssd {which}: restore ended {res.state} ({res.reason})")
            for c in grid:
                fio_bw[c.depth].append(
                    fio.run_fio(binary or "fio", files, c, direct=True).bandwidth_Bps
                )
    finally:
        for e in engines.values():
            await e.aclose()
    one, default = (statistics.median(ttft[k]) for k in ("one", "default"))
    fig = {
        "ssd_ttft_1_s": one,
        "ssd_ttft_default_s": default,
        "ssd_ttft_1_vs_default": one / default,
    }
    if grid:
        fig["ssd_fio_qd64_vs_qd1"] = statistics.median(fio_bw[64]) / statistics.median(fio_bw[1])
    return fig


async def _window(engine: Any, tokens: Any, cache: Any, blocks: Any, repeats: int) -> int:
    """Smallest W whose median restore rate reaches 95% of the best (io_depth min(W, 4))."""
    rate = {}
    for w in (1, 2, 4, 8):
        eng, _ = engine(w, min(w, 4))
        async with eng:
            t = []
            for _ in range(max(2, repeats // 2)):
                t0 = time.perf_counter()
                await eng.restore(tokens, cache, blocks)
                t.append(time.perf_counter() - t0)
        rate[w] = 1 / statistics.median(t)
    top = max(rate.values())
    return min(w for w, v in rate.items() if v >= 0.95 * top)


def _cpu_worker(repeats: int) -> dict[str, Any]:
    """The ``cpu`` section of the working tree's bench (CPU seconds per GiB restored beside the
    floor: fio's read CPU, one xxh3 pass, one copy), O_DIRECT, on this revision's bsr."""
    import anyio

    from bsr_bench.common import fio
    from bsr_bench.common.pagecache import CacheMode
    from bsr_bench.restore.cpu import CPU_POINTS, measure_cpu

    async def run(root: Path) -> dict[str, Any]:
        binary = fio.fio_binary()
        reps = max(11, repeats)
        return await measure_cpu(
            CPU_POINTS, reps, 8, 4, 0, root=root, mode=CacheMode.DIRECT, fio_binary=binary
        )

    with tempfile.TemporaryDirectory(prefix="bsr-ba-cpu-") as tmp:
        return anyio.run(run, Path(tmp))


def _keys_cpu_worker(tokens: int, repeats: int) -> dict[str, Any]:
    """CPU seconds of the key derivation of a ``tokens``-token numpy array (no extras)."""
    import numpy as np

    import bsr

    layout = bsr.StateLayout(256, (bsr.StateGroup("kv", 1, 16, dtype="uint8"),))
    ns = bsr.Namespace("before-after").fingerprint(layout)
    ids = np.random.default_rng(0).integers(0, 128_000, size=tokens, dtype=np.int64)
    samples = []
    for _ in range(repeats):
        c0 = time.process_time()
        bsr.prepare_tokens(ns, ids, 256)
        samples.append(time.process_time() - c0)
    return {"numpy_cpu_s": statistics.median(samples)}


SECTIONS = ("overhead", "concurrency", "cpu", "file", "keys")


def worker(out: str, repeats: int, sections: tuple[str, ...] = SECTIONS) -> None:
    import anyio
    import structlog

    import bsr
    from bsr_bench.restore.machinery import (
        CONCURRENCY_LEVELS,
        OVERHEAD_POINTS,
        measure_concurrency,
        measure_overhead,
    )

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "overhead" in sections:
            out["overhead"] = await measure_overhead(OVERHEAD_POINTS, repeats, 8, 4, 0)
        if "concurrency" in sections:
            out["concurrency"] = await measure_concurrency(
                CONCURRENCY_LEVELS, 16, 1 << 20, repeats, 8, 4, 0
            )
        return out

    doc = anyio.run(main)
    if "cpu" in sections:
        doc["cpu"] = _cpu_worker(repeats)
    if "file" in sections:
        doc["file"] = anyio.run(_file_worker, repeats)
    if "keys" in sections:
        doc["keys"] = _keys_worker(512 * 1024, max(5, repeats))
        doc["keys"].update(_keys_cpu_worker(512 * 1024, max(11, repeats)))
    doc["bsr_file"] = bsr.__file__
    Path(out).write_text(json.dumps(doc))


# ---------------------------------------------------------------------- driver
def _export(rev: str, into: Path) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True)
    if archive.returncode:
        raise SystemExit(f"git archive {rev} failed: {archive.stderr.decode()[-300:]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return commit


def _run_worker(
    tree: Path, repeats: int, out: Path, sections: tuple[str, ...] = SECTIONS
) -> dict[str, Any]:
    # that revision's bsr, this tree's bench (the bench of either revision may not be there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(ROOT / "bench")])}
    cmd = [sys.executable, __file__, "--worker", str(out), "--repeats", str(repeats)]
    cmd += ["--sections", ",".join(sections)]
    proc = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"worker for {tree} failed:\n{proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(out.read_text())
    if not doc["bsr_file"].startswith(str(tree)):
        raise SystemExit(f"worker imported {doc['bsr_file']}, not the exported tree {tree}")
    return doc


def _figures(doc: dict[str, Any]) -> dict[str, float]:
    """The flat figures of one worker run (seconds, ratios)."""
    out: dict[str, float] = {}
    for p in doc.get("overhead", {}).get("points", []):
        kib = p["chunk_bytes"] >> 10
        out[f"overhead.{kib}KiB.restore_s"] = p["restore_s"]["median"]
        out[f"overhead.{kib}KiB.memcpy_s"] = p["memcpy_s"]["median"]
        out[f"overhead.{kib}KiB.bandwidth_vs_memcpy"] = p["bandwidth_vs_memcpy"]
        out[f"overhead.{kib}KiB.per_chunk_overhead_s"] = p["per_chunk_overhead_s"]
    conc = doc.get("concurrency")
    for r in conc["levels"] if conc else []:
        out[f"concurrency.N{r['concurrent']}.aggregate_vs_single"] = r["aggregate_vs_single"]
        out[f"concurrency.N{r['concurrent']}.aggregate_Bps"] = r["aggregate_bandwidth_Bps"][
            "median"
        ]
    if conc:
        out["concurrency.peak_slots_in_use"] = conc["peak_slots_in_use"]
    for k, v in doc.get("keys", {}).items():
        out[f"keys.512K.{k}"] = v
    for p in doc.get("cpu", {}).get("points", []):
        kib = p["chunk_bytes"] >> 10
        pre = f"cpu.{p['tier']}.{kib}KiB"
        out[f"{pre}.cpu_per_gib_s"] = p["cpu_per_gib_s"]
        out[f"{pre}.floor_per_gib_s"] = p["floor_per_gib_s"]
        out[f"{pre}.cpu_vs_floor"] = p["cpu_vs_floor"]
        out[f"{pre}.machinery_per_chunk_s"] = p["machinery_per_chunk_s"]
        out[f"{pre}.wall_vs_reference"] = p["wall_vs_reference"]["value"]
        if p.get("minimal_loop_vs_floor") is not None:  # a host point (an older revision: none)
            out[f"{pre}.minimal_loop_vs_floor"] = p["minimal_loop_vs_floor"]
            out[f"{pre}.cpu_vs_minimal_loop"] = p["cpu_vs_minimal_loop"]
    for layout, fig in doc.get("file", {}).items():
        for k, v in fig.items():
            out[f"file.{layout}.{k}"] = v
    return out


MARKDOWN_ROWS = (
    ("cpu.file.4KiB.cpu_vs_floor", "FileTier, 4 KiB chunks: restore CPU / floor CPU", 1, ""),
    ("cpu.file.512KiB.cpu_vs_floor", "FileTier, 512 KiB chunks: restore CPU / floor CPU", 1, ""),
    ("cpu.file.32768KiB.cpu_vs_floor", "FileTier, 32 MiB chunks: restore CPU / floor CPU", 1, ""),
    ("cpu.host.4KiB.cpu_vs_floor", "HostTier, 4 KiB chunks: restore CPU / floor CPU", 1, ""),
    ("cpu.host.512KiB.cpu_vs_floor", "HostTier, 512 KiB chunks: restore CPU / floor CPU", 1, ""),
    ("cpu.host.32768KiB.cpu_vs_floor", "HostTier, 32 MiB chunks: restore CPU / floor CPU", 1, ""),
    (
        "cpu.host.4KiB.machinery_per_chunk_s",
        "HostTier, 4 KiB chunks: CPU per chunk beyond the floor",
        1e6,
        "us",
    ),
    ("cpu.file.512KiB.cpu_per_gib_s", "FileTier, 512 KiB chunks: CPU per GiB", 1, "s"),
    ("cpu.file.512KiB.floor_per_gib_s", "the floor beside it: CPU per GiB", 1, "s"),
    ("cpu.host.512KiB.cpu_per_gib_s", "HostTier, 512 KiB chunks: CPU per GiB", 1, "s"),
    ("cpu.host.512KiB.floor_per_gib_s", "the floor beside it: CPU per GiB", 1, "s"),
    ("keys.512K.numpy_cpu_s", "keys of a 512K-token numpy array: CPU", 1e3, "ms"),
    (
        "overhead.4KiB.per_chunk_overhead_s",
        "HostTier, 4 KiB chunks: time per chunk beyond memcpy",
        1e6,
        "us",
    ),
    (
        "overhead.64KiB.per_chunk_overhead_s",
        "HostTier, 64 KiB chunks: time per chunk beyond memcpy",
        1e6,
        "us",
    ),
    (
        "overhead.1024KiB.bandwidth_vs_memcpy",
        "HostTier, 1 MiB chunks: restore / memcpy bandwidth",
        1,
        "",
    ),
    (
        "overhead.8192KiB.bandwidth_vs_memcpy",
        "HostTier, 8 MiB chunks: restore / memcpy bandwidth",
        1,
        "",
    ),
    (
        "overhead.32768KiB.bandwidth_vs_memcpy",
        "HostTier, 32 MiB chunks: restore / memcpy bandwidth",
        1,
        "",
    ),
    ("keys.512K.list_s", "keys of a 512K-token list", 1e3, "ms"),
    ("keys.512K.numpy_s", "keys of a 512K-token numpy array", 1e3, "ms"),
    ("file.llama3-8b.bsr_vs_fio", "FileTier llama3-8b 8K: BSR / best fio bandwidth", 1, ""),
    ("file.dsv4-flash.bsr_vs_fio", "FileTier dsv4-flash 8K: BSR / best fio bandwidth", 1, ""),
    ("file.llama3-8b.bsr_vs_raw", "FileTier llama3-8b 8K: BSR / best raw bandwidth", 1, ""),
    ("file.kv-512k.bsr_vs_raw", "FileTier 512 KiB chunks: BSR / best raw bandwidth", 1, ""),
    ("file.kv-512k.bsr_vs_fio", "FileTier 512 KiB chunks: BSR / best fio bandwidth", 1, ""),
    (
        "file.dsv4-flash.ssd_ttft_1_vs_default",
        "SSD concurrency, dsv4-flash 8K cold: TTFT at 1 read in flight / at the default",
        1,
        "",
    ),
    (
        "file.dsv4-flash.ssd_fio_qd64_vs_qd1",
        "the device beside it: fio io_uring 1 MiB qd 64 / qd 1 bandwidth",
        1,
        "",
    ),
    ("file.llama3-8b.smallest_window_95", "smallest W at 95% of the best (2K tokens)", 1, ""),
    (
        "concurrency.N8.aggregate_vs_single",
        "8 concurrent restores: aggregate / single bandwidth",
        1,
        "",
    ),
    ("concurrency.peak_slots_in_use", "peak staging slots in use (W = 8)", 1, ""),
)


def markdown(doc: dict[str, Any]) -> str:
    """The README table of a before/after document."""
    c = doc["commits"]
    lines = [
        f"| figure (medians) | before {c['before'][:7]} | after {c['after'][:7]} "
        "| after / before |",
        "|---|---|---|---|",
    ]
    for key, label, scale, unit in MARKDOWN_ROWS:
        s = doc["summary"].get(key)
        if s is None:
            continue
        r = s["after_vs_before"]
        lines.append(
            f"| {label} | {s['before'] * scale:.3g} {unit} | {s['after'] * scale:.3g} {unit} | "
            f"{r:.2f} |".replace("  |", " |")
        )
    return "\n".join(lines)


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (other work on a shared machine)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="17a7d59", help="the earlier revision (default 17a7d59)")
    p.add_argument("--after", default="HEAD", help="the later revision (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per figure and round")
    p.add_argument("--json", default=None, help="output (default bench/results/before-after-*)")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"what each worker measures, comma-separated (default {','.join(SECTIONS)})",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--markdown", default=None, metavar="JSON", help="print the table of a run")
    ns = p.parse_args(argv)
    sections = tuple(x for x in ns.sections.replace(" ", "").split(",") if x)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        p.error(f"--sections takes some of {','.join(SECTIONS)}, got {ns.sections!r}")
    if ns.markdown:
        print(markdown(json.loads(Path(ns.markdown).read_text())))
        return 0
    if ns.worker:
        worker(ns.worker, ns.repeats, sections)
        return 0
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = Path(ns.json or ROOT / f"bench/results/before-after-{stamp}.json")
    with tempfile.TemporaryDirectory(prefix="bsr-before-after-") as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        commits = {k: _export(getattr(ns, k), t) for k, t in trees.items()}
        rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        load_start = _load()
        loads: list[dict[str, Any]] = []
        for r in range(ns.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for which in order:
                load = _load()
                doc = _run_worker(
                    trees[which], ns.repeats, Path(tmp) / f"{which}-{r}.json", sections
                )
                rounds[which].append(_figures(doc))
                loads.append(
                    {
                        "round": r,
                        "revision": which,
                        "load_average_before": load,
                        "load_average_after": _load(),
                    }
                )
                print(f"round {r} {which} done (load {load})", file=sys.stderr)
    names = sorted(rounds["before"][0])
    summary = {}
    for name in names:
        b = statistics.median(x[name] for x in rounds["before"])
        a = statistics.median(x[name] for x in rounds["after"])
        summary[name] = {"before": b, "after": a, "after_vs_before": a / b if b else None}
    doc_out = {
        "tool": "bench/before_after.py",
        "started_at": stamp,
        "commits": commits,
        "args": vars(ns),
        "cpus": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": _load(),
        "load_average_per_worker": loads,
        "note": "medians over alternating rounds of medians over repeats; a shared machine, so "
        "read the after/before ratios, not the absolute figures",
        "rounds": rounds,
        "summary": summary,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc_out, indent=1) + "\n")
    for name, s in summary.items():
        ratio = s["after_vs_before"]
        print(f"{name:48s} {s['before']:.6g} -> {s['after']:.6g}  x{ratio:.3g}" if ratio else name)
    print(f"JSON: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
