"""The paper's SSD concurrency row: ``bsr bench --ssd-concurrency``.

Where it runs: the bench process, on a FileTier directory (a temporary one, or ``--path``).

How it works: one cold state of the dsv4-flash layout (131,072 tokens by default, saved chunk by
chunk as in the L1 ladder, :class:`~.scale.ChunkedState`) is restored with 1, 4, 8 and 16 reads
in flight and at bsr's default depth, every restore ``O_DIRECT`` (cold: no page cache) into an
all-zero destination (file-backed once the state exceeds a quarter of memory, as in the ladder).
"Reads in flight" is the FileTier's io_uring read depth, the requests (of at most 1 MiB) in
flight across the tier, with the engine reading ``min(depth, W)`` objects at once; the default
point is a FileTier whose depth is unset (calibrated when it opens) with the engine's default
``io_depth``. W stays the same at every point, so RWS is W x slot throughout. Beside each depth,
fio reads the very same object files with ``io_uring`` at 1 MiB blocks and that queue depth: the
device's own ratio. Restores and fio runs rotate over the repeats, so drift on a shared machine
hits every point alike; the first restore of each point is checked against the saved digests.

The paper's row: more concurrent reads took the 524,288-token restore from 43.1 s to 17.6 s
(2.45x) with RWS unchanged. The figure to read here is ``ttft(1) / ttft(default)`` beside fio's
``bw(default depth) / bw(qd 1)``: a device that gains little from depth cannot give bsr more.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import psutil

from bsr import FileTier, RestoreEngine, UringReader, chunk_keys

from ..common.document import validate, write_json
from ..common.fio import FioConfig, FioRead, fio_binary, fio_version, fitted_grid, run_fio
from ..common.layouts import resolve_layout
from ..common.machine import commit_info, filesystem_info, machine_info
from ..common.memory import release_free_memory
from ..common.stats import BenchError, Dist, ratio
from .options import GIB, _ints
from .scale import ChunkedState, Destination, DestinationKind, choose_destination

DEFAULT_TOKENS = (131072,)
DEFAULT_DEPTHS = (1, 4, 8, 16)
#: the paper's figures at 524,288 tokens of dsv4-flash (one read in flight / more)
PAPER = {"tokens": 524288, "ttft_1_s": 43.1, "ttft_more_s": 17.6, "speedup": 43.1 / 17.6}
TARGET_SPEEDUP = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SSD concurrency (--ssd-concurrency)")
    g.add_argument(
        "--ssd-concurrency",
        action="store_true",
        help="instead of the default bench: the paper's SSD row, one cold dsv4-flash state "
        "restored with 1, 4, 8, 16 reads in flight and bsr's default depth, fio beside it "
        "(sizes from --ladder-sizes, default 131072 tokens; see bench/README.md)",
    )
    g.add_argument(
        "--ssd-depths",
        default=None,
        help="reads in flight to compare (default 1,4,8,16; the default depth is always added)",
    )


def _point_name(depth: int | None) -> str:
    return "default" if depth is None else str(depth)


class _Run:
    def __init__(self, ns: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.quick = bool(ns.quick)
        layouts = ns.layout or ["dsv4-flash"]
        if len(layouts) != 1:
            raise BenchError("--ssd-concurrency restores one layout; pass --layout once")
        self.named = resolve_layout(layouts[0])
        sizes = _ints(ns.ladder_sizes) if ns.ladder_sizes else None
        self.tokens = max(sizes or ((4096,) if self.quick else DEFAULT_TOKENS))
        self.depths = _ints(ns.ssd_depths) if ns.ssd_depths else DEFAULT_DEPTHS
        self.window = int(ns.window or 8)
        self.repeats = 1 if self.quick else max(1, int(ns.repeats or 2))
        self.destination = ns.destination
        self.fio = None if getattr(ns, "no_fio", False) else fio_binary()
        self.seed = int(ns.seed)
        self.path = ns.path
        self.keep = bool(ns.keep)
        self.log = log
        self.args = {
            "layout": self.named.name,
            "tokens": self.tokens,
            "depths": list(self.depths),
            "window": self.window,
            "repeats": self.repeats,
            "destination": self.destination,
            "fio": self.fio is not None,
            "quick": self.quick,
        }

    def _engine(self, state: ChunkedState, depth: int | None) -> RestoreEngine:
        tier = FileTier(
            state.root, state.capacity_bytes, name="file", direct_io=True, read_depth=depth
        )
        io_depth = min(self.window, 4 if depth is None else depth)
        return RestoreEngine(
            state.layout,
            [tier],
            window=self.window,
            io_depth=io_depth,
            namespace=state.namespace,
            prefault_staging=True,
        )

    async def run(self, root: Path) -> dict[str, Any]:
        state = ChunkedState(self.named, root, self.tokens, seed=self.seed, direct_io=True)
        size = state.state_bytes(state.max_tokens)
        avail = psutil.virtual_memory().available
        kind = choose_destination(size, avail, self.destination)
        need = 2 * size if kind is DestinationKind.FILE else size
        free = shutil.disk_usage(root).free
        if need * 1.03 > free:
            raise BenchError(
                f"{root} has {free / GIB:.1f} GiB free; the state (and a file-backed "
                f"destination) need {need / GIB:.1f} GiB: lower --ladder-sizes or use --path"
            )
        dest = Destination(self.named, state.num_blocks, kind, root / "destination")
        try:
            self.log(f"saving {state.max_tokens} tokens ({size / GIB:.2f} GiB) chunk by chunk")
            save = await state.save(dest.fresh())
            return {
                "save": save,
                "destination": dest.describe(),
                **await self._measure(state, dest),
            }
        finally:
            dest.close()

    def _files(self, state: ChunkedState, tier: FileTier) -> list[str]:
        keys = chunk_keys(
            state.namespace.fingerprint(state.layout), state.tokens, state.layout.chunk_tokens
        )
        return [
            str(tier.object_path(keys[c], g)) for c, g in state.layout.needed_objects(len(keys))
        ]

    async def _measure(self, state: ChunkedState, dest: Destination) -> dict[str, Any]:
        points: list[int | None] = [*self.depths, None]
        engines = {p: self._engine(state, p) for p in points}
        ttft: dict[int | None, list[float]] = {p: [] for p in points}
        rws: dict[int | None, list[int]] = {p: [] for p in points}
        verified: dict[str, Any] = {}
        fio: dict[int | None, list[FioRead]] = {p: [] for p in points}
        fio_failed: dict[str, str] = {}
        for e in engines.values():
            await e.open()
        try:
            tier = engines[None].tiers[0]
            assert isinstance(tier, FileTier)
            reader = tier.reader
            default_depth = reader.depth if isinstance(reader, UringReader) else None
            files = self._files(state, tier)
            ids = state.identity_ids(state.max_tokens)

            async def restore(p: int | None) -> None:
                cache = dest.fresh()
                release_free_memory()
                t0 = time.perf_counter()
                r = await engines[p].restore(state.tokens, cache, ids)
                wall = time.perf_counter() - t0
                if not r.committed or r.committed_tokens != state.max_tokens:
                    raise BenchError(
                        f"restore at depth {_point_name(p)} ended {r.state} ({r.reason})"
                    )
                if _point_name(p) not in verified:
                    verified[_point_name(p)] = state.verify(cache, state.max_tokens, sample=8)
                    if not verified[_point_name(p)]["ok"]:
                        raise BenchError(f"restore at depth {_point_name(p)}: bytes differ")
                ttft[p].append(wall)
                rws[p].append(r.rws_peak_bytes)
                mib = r.rws_peak_bytes / 2**20
                self.log(f"  bsr   depth {_point_name(p):>7}: {wall:7.2f} s  RWS {mib:.0f} MiB")

            async def fio_read(p: int | None) -> None:
                qd = default_depth if p is None else p
                if self.fio is None or qd is None or _point_name(p) in fio_failed:
                    return
                # 1 MiB blocks, as bsr's requests (smaller when a file is: fio reads whole blocks)
                (config,) = fitted_grid([FioConfig("io_uring", 1 << 20, qd)], files)
                try:
                    read = run_fio(self.fio, files, config, direct=True)
                except BenchError as exc:
                    fio_failed[_point_name(p)] = str(exc)
                    return
                fio[p].append(read)
                self.log(f"  fio   qd    {qd:>7}: {read.bandwidth_Bps / 1e9:7.2f} GB/s")

            steps: list[tuple[Callable[[int | None], Any], int | None]] = []
            for p in points:
                steps += [(restore, p), (fio_read, p)]
            for r in range(self.repeats):
                k = (r * 2) % len(steps)
                for fn, p in steps[k:] + steps[:k]:
                    await fn(p)
        finally:
            for e in engines.values():
                await e.aclose()
        return self._summarize(state, points, ttft, rws, fio, fio_failed, verified, default_depth)

    def _summarize(
        self,
        state: ChunkedState,
        points: list[int | None],
        ttft: dict[int | None, list[float]],
        rws: dict[int | None, list[int]],
        fio: dict[int | None, list[FioRead]],
        fio_failed: dict[str, str],
        verified: dict[str, Any],
        default_depth: int | None,
    ) -> dict[str, Any]:
        size = state.state_bytes(state.max_tokens)
        slot = state.layout.slot_bytes
        rows: list[dict[str, Any]] = []
        for p in points:
            d = Dist.of(ttft[p])
            fio_bw = statistics.median(r.bandwidth_Bps for r in fio[p]) if fio[p] else None
            rows.append(
                {
                    "reads_in_flight": _point_name(p),
                    "read_depth": default_depth if p is None else p,
                    "io_depth": min(self.window, 4 if p is None else p),
                    "window": self.window,
                    "ttft_s": d.to_dict(),
                    "bandwidth_Bps": d.map(lambda s: size / s).to_dict(),
                    "rws_peak_bytes": max(rws[p]),
                    "fio_bandwidth_Bps": fio_bw,
                }
            )
        by = {r["reads_in_flight"]: r for r in rows}
        one = by.get("1")
        ratios: dict[str, Any] = {}
        if one is not None:
            for r in rows:
                if r is not one:
                    ratios[f"ttft_1_vs_{r['reads_in_flight']}"] = ratio(
                        one["ttft_s"]["median"], r["ttft_s"]["median"], "ssd ttft ratio"
                    )
            if one["fio_bandwidth_Bps"] and by["default"]["fio_bandwidth_Bps"]:
                ratios["fio_default_vs_1"] = ratio(
                    by["default"]["fio_bandwidth_Bps"], one["fio_bandwidth_Bps"], "fio ratio"
                )
        rws_ok = all(r["rws_peak_bytes"] == self.window * slot for r in rows)
        speedup = ratios.get("ttft_1_vs_default")
        device = ratios.get("fio_default_vs_1")
        target = {
            "name": "ssd_concurrency_speedup",
            "description": "TTFT with 1 read in flight / TTFT at bsr's default depth, same cold "
            f"state (threshold {TARGET_SPEEDUP} where the device allows: fio's own ratio at the "
            "same depths is beside it)",
            "value": speedup,
            "threshold": TARGET_SPEEDUP,
            "met": speedup is not None and speedup >= TARGET_SPEEDUP,
            "device_ratio": device,
            "device_allows": device is not None and device >= TARGET_SPEEDUP,
        }
        return {
            "tokens": state.max_tokens,
            "state_bytes": size,
            "slot_bytes": slot,
            "default_read_depth": default_depth,
            "points": rows,
            "ratios": ratios,
            "rws_equals_w_x_slot": rws_ok,
            "target": target,
            "verified": verified,
            "fio_failed": fio_failed,
        }


def _table(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(
        title=f"SSD concurrency: {doc['layout']['name']} {doc['tokens']} tokens "
        f"({doc['state_bytes'] / GIB:.2f} GiB), cold (O_DIRECT), W={doc['args']['window']}",
        title_justify="left",
    )
    for col in ("reads in flight", "read depth", "io_depth", "TTFT", "GB/s", "RWS", "fio GB/s"):
        t.add_column(col, justify="right")
    for r in doc["points"]:
        fio = r["fio_bandwidth_Bps"]
        t.add_row(
            r["reads_in_flight"],
            str(r["read_depth"]),
            str(r["io_depth"]),
            f"{r['ttft_s']['median']:.2f} s",
            f"{r['bandwidth_Bps']['median'] / 1e9:.2f}",
            f"{r['rws_peak_bytes'] / 2**20:.0f} MiB",
            "-" if fio is None else f"{fio / 1e9:.2f}",
        )
    return t


def run_ssd(ns: argparse.Namespace, console: Any = None) -> dict[str, Any]:
    """Run the SSD concurrency row, write its JSON, print the table; return the document."""
    from rich.console import Console

    console = console or Console(width=200)
    run = _Run(ns, lambda m: console.print(m, highlight=False))
    t_start = time.time()
    machine = machine_info()
    if run.path is not None and not Path(run.path).is_dir():
        raise BenchError(f"--path {run.path} is not a directory")
    root = Path(tempfile.mkdtemp(prefix="bsr-ssd-", dir=run.path))
    try:
        body = anyio.run(run.run, root)
        fs = filesystem_info(root)
    finally:
        if not run.keep:
            shutil.rmtree(root, ignore_errors=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t_start))
    doc: dict[str, Any] = {
        "schema_version": 1,
        "tool": "bsr bench --ssd-concurrency",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 3),
        "machine": machine,
        "commit": commit_info(),
        "args": run.args,
        "argv": sys.argv[1:],
        "storage": {**fs, "direct_io": True, "temporary": run.path is None},
        "fio": {
            "available": run.fio is not None,
            "version": fio_version(run.fio) if run.fio else None,
        },
        "layout": run.named.to_dict(),
        "paper": PAPER,
        **body,
    }
    validate(doc, "ssd_document")
    path = Path(ns.json or f"bench/results/ssd-concurrency-{stamp}.json")
    write_json(doc, path)
    console.print(_table(doc))
    tg = doc["target"]
    mark = "met" if tg["met"] else "missed"
    dev = "-" if tg["device_ratio"] is None else f"{tg['device_ratio']:.2f}"
    value = "-" if tg["value"] is None else f"{tg['value']:.2f}"
    console.print(
        f"target {tg['name']}: {value} (threshold {tg['threshold']}) {mark}; the device's own "
        f"fio ratio at the same depths: {dev}; paper: {PAPER['speedup']:.2f}"
    )
    console.print(f"RWS = W x slot at every point: {doc['rws_equals_w_x_slot']}")
    console.print(f"JSON: {path}")
    return doc
