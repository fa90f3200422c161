"""The machinery sections of ``bsr bench`` and the targets of the Performance issue.

Where it runs: ``bsr bench``; :mod:`.measure` calls in here per point (:meth:`FioSetup.step`,
:meth:`FioStep.attach`) and :mod:`.program` per run (:func:`run_sections`, :func:`finish`,
:func:`print_sections`), so its main loop stays as it was.

How it works:

- fio (:mod:`..common.fio`): per point, one :class:`FioStep` joins the rotation of raw reads and
  restores; it reads the point's object files once per grid configuration and adds the point's
  ``fio`` entry and ``ratios.bsr_vs_fio_bandwidth``.
- ``overhead``, ``concurrency`` and ``keys`` (:mod:`.machinery`) run once per run, after the
  layouts, from a HostTier (no disk); ``cpu`` (:mod:`.cpu`) after them, from a HostTier and a
  FileTier in the run's directory (the run's cache mode, fio as the read floor).
- ``window``: from the W x io_depth sweep, the bandwidth of each W at the run's io_depth (or
  the deepest one <= W), and the smallest W reaching 95% of the best.
- :func:`issue_targets`: the issue's targets as pass/fail records beside the existing ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..common.fio import (
    FIO_GRID,
    HUGE_PAGE_TUNABLE,
    MISSING_NOTE,
    QUICK_FIO_GRID,
    FioSeries,
    fio_binary,
    fio_version,
    fitted_grid,
    run_fio,
)
from ..common.pagecache import CacheMode, prepare
from ..common.stats import BenchError, ratio
from .cpu import CPU_POINTS, CPU_REPEATS, QUICK_CPU_POINTS, cpu_targets, measure_cpu
from .machinery import (
    CONCURRENCY_LEVELS,
    KEYS_REPEATS,
    OVERHEAD_POINTS,
    QUICK_OVERHEAD_POINTS,
    measure_concurrency,
    measure_keys,
    measure_overhead,
)
from .report import fmt_bw, fmt_bytes, fmt_s

WINDOW_FRACTION = 0.95
#: (target, smallest chunk, largest chunk, threshold) of BSR / best fio on the same files
FIO_TARGETS = (
    ("bsr_bandwidth_vs_fio", 8 << 20, 33 << 20, 0.9),
    ("bsr_bandwidth_vs_fio_small_chunks", 256 << 10, 1 << 20, 0.8),
)


def _t(s: float) -> str:
    """Seconds, in microseconds below a millisecond (per-chunk figures are that small)."""
    return f"{s * 1e6:.1f} us" if s < 1e-3 else fmt_s(s)


def _gbps(bps: float) -> str:
    return fmt_bw(bps) + " GB/s"


class FioSetup:
    """Whether fio runs in this bench run, and with which grid."""

    def __init__(self, enabled: bool, quick: bool) -> None:
        self.binary = fio_binary() if enabled else None
        self.grid = QUICK_FIO_GRID if quick else FIO_GRID
        self.version = fio_version(self.binary) if self.binary else None
        if not enabled:
            self.note = "fio disabled (--no-fio)"
        elif self.binary is None:
            self.note = MISSING_NOTE
        else:
            self.note = (
                f"{self.version}: grid {', '.join(c.name for c in self.grid)}; I/O buffers on "
                f"huge pages (GLIBC_TUNABLES={HUGE_PAGE_TUNABLE})"
            )

    def step(
        self, mode: CacheMode, files: Sequence[str], file_bytes: int, *, source: str
    ) -> FioStep | None:
        """A point's fio step; None without fio and for the recompute model's own layout (a few
        MiB per size, where fio's start-up would dominate and no fio target applies)."""
        if self.binary is None or source == "recompute-model":
            return None
        return FioStep(self.binary, self.grid, mode, files, file_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "available": self.binary is not None,
            "version": self.version,
            "grid": [c.name for c in self.grid] if self.binary else [],
            "note": self.note,
        }


class FioStep:
    """One point's fio reads (an awaitable step of the rotation)."""

    def __init__(
        self,
        binary: str,
        grid: Sequence[Any],
        mode: CacheMode,
        files: Sequence[str],
        file_bytes: int,
    ) -> None:
        self.binary = binary
        self.mode = mode
        self.files = list(files)
        self.series = FioSeries(fitted_grid(grid, self.files), file_bytes)

    async def __call__(self) -> None:
        for config in self.series.grid:
            if config.name in self.series.failed:
                continue
            prepare(self.mode, self.files)
            try:
                read = run_fio(
                    self.binary, self.files, config, direct=self.mode is CacheMode.DIRECT
                )
            except BenchError as exc:
                self.series.failed[config.name] = str(exc)
                continue
            self.series.add(read)

    def attach(self, point: dict[str, Any]) -> None:
        doc = self.series.to_json()
        point["fio"] = doc
        if doc is not None:
            point["ratios"]["bsr_vs_fio_bandwidth"] = ratio(
                point["bsr"]["bandwidth_Bps"]["median"],
                doc["best_bandwidth_Bps"],
                "bsr_vs_fio_bandwidth",
            )


async def run_sections(
    opts: Any,
    ui: Any,
    *,
    root: Path | None = None,
    mode: CacheMode = CacheMode.DIRECT,
    fio_binary: str | None = None,
) -> dict[str, Any]:
    """``overhead``, ``concurrency``, ``keys`` and ``cpu`` (each None when switched off; ``cpu``
    restores from a FileTier in ``root`` too, read with ``mode``, fio's CPU as its read floor)."""
    quick = bool(opts.quick)
    repeats = max(3, 2 * opts.repeats + 1) if not quick else 2
    out: dict[str, Any] = {"overhead": None, "concurrency": None, "keys": None, "cpu": None}
    if getattr(opts, "overhead", True):
        ui.log("overhead: HostTier restores vs memcpy, 4 KiB .. 32 MiB chunks")
        points = QUICK_OVERHEAD_POINTS if quick else OVERHEAD_POINTS
        out["overhead"] = await measure_overhead(
            points, repeats, opts.window, opts.io_depth, opts.seed
        )
    if getattr(opts, "concurrency", True):
        ui.log("concurrency: N restores of different prompts on one engine")
        levels = (1, 2) if quick else CONCURRENCY_LEVELS
        out["concurrency"] = await measure_concurrency(
            levels, 4 if quick else 16, 1 << 20, repeats, opts.window, opts.io_depth, opts.seed
        )
    out["keys"] = measure_keys(
        64 * 1024 if quick else 512 * 1024, repeats if quick else max(KEYS_REPEATS, repeats)
    )
    if getattr(opts, "cpu", True):
        ui.log("cpu: CPU seconds per GiB restored (HostTier, FileTier) vs the floor")
        out["cpu"] = await measure_cpu(
            QUICK_CPU_POINTS if quick else CPU_POINTS,
            repeats if quick else max(CPU_REPEATS, repeats),
            opts.window,
            opts.io_depth,
            opts.seed,
            tiers=("host", "file") if root is not None else ("host",),
            root=root,
            mode=mode,
            fio_binary=fio_binary,
        )
    return out


def window_section(sweep: Sequence[dict[str, Any]], io_depth: int) -> dict[str, Any] | None:
    """The smallest W reaching :data:`WINDOW_FRACTION` of the best sweep bandwidth."""
    if not sweep:
        return None
    by_w: dict[int, dict[str, Any]] = {}
    for s in sweep:
        w, d = s["window"], s["io_depth"]
        if d > io_depth:
            continue
        cur = by_w.get(w)
        if cur is None or d > cur["io_depth"]:
            by_w[w] = s
    if not by_w:
        return None
    rows = [
        {"window": w, "io_depth": s["io_depth"], "bandwidth_Bps": s["bandwidth_Bps"]["median"]}
        for w, s in sorted(by_w.items())
    ]
    best = max(r["bandwidth_Bps"] for r in rows)
    for r in rows:
        r["fraction_of_best"] = r["bandwidth_Bps"] / best
    smallest = next(r["window"] for r in rows if r["fraction_of_best"] >= WINDOW_FRACTION)
    return {
        "layout": sweep[0]["layout"],
        "tokens": sweep[0]["tokens"],
        "io_depth": io_depth,
        "fraction": WINDOW_FRACTION,
        "rows": rows,
        "best_bandwidth_Bps": best,
        "smallest_window": smallest,
    }


def _target(
    name: str, description: str, value: float, threshold: float, le: bool
) -> dict[str, Any]:
    met = value <= threshold if le else value >= threshold
    return {
        "name": name,
        "description": description,
        "value": float(value),
        "threshold": float(threshold),
        "met": bool(met),
    }


def issue_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The Performance issue's targets that this run measured (see bench/README.md)."""
    out = _overhead_targets(doc) + _fio_targets(doc) + _recompute_targets(doc)
    out += _keys_targets(doc)
    if doc.get("cpu"):
        out.extend(cpu_targets(doc["cpu"]))
    return out + _concurrency_targets(doc) + _window_targets(doc)


def _overhead_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``overhead`` section's targets: time per small chunk, bandwidth at large chunks."""
    out: list[dict[str, Any]] = []
    ov = doc.get("overhead")
    if ov:
        small = min(ov["points"], key=lambda p: p["chunk_bytes"])
        out.append(
            _target(
                "per_chunk_overhead_small_s",
                "HostTier restore time per chunk beyond memcpy at "
                f"{fmt_bytes(small['chunk_bytes'])} chunks (seconds)",
                small["per_chunk_overhead_s"],
                20e-6,
                le=True,
            )
        )
        big = [p for p in ov["points"] if p["chunk_bytes"] >= 8 << 20]
        if big:
            out.append(
                _target(
                    "host_restore_vs_memcpy_large",
                    "HostTier restore bandwidth / memcpy bandwidth at >= 8 MiB chunks (lowest)",
                    min(p["bandwidth_vs_memcpy"] for p in big),
                    0.6,
                    le=False,
                )
            )
    return out


def _fio_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """BSR bandwidth over fio's best, one target per chunk-size band of ``FIO_TARGETS``."""
    out: list[dict[str, Any]] = []
    points = [p for p in doc["results"] if not p["matched_recompute"]] or doc["results"]
    for label, lo, hi, threshold in FIO_TARGETS:
        fio = [
            p["ratios"]["bsr_vs_fio_bandwidth"]
            for p in points
            if "bsr_vs_fio_bandwidth" in p["ratios"] and lo <= p["slot_bytes"] <= hi
        ]
        if fio:
            out.append(
                _target(
                    label,
                    "BSR restore bandwidth / best fio configuration (io_uring, libaio, psync; "
                    f"queue depth up to 64) on the same files, {fmt_bytes(lo)}-{fmt_bytes(hi)} "
                    "chunks (lowest over the requested layouts' points)",
                    min(fio),
                    threshold,
                    le=False,
                )
            )
    return out


def _recompute_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """BSR over raw bandwidth at the recompute model's (small) chunks, if it was measured."""
    rec = [p for p in doc["results"] if p["matched_recompute"]]
    if not rec:
        return []
    return [
        _target(
            "bsr_bandwidth_vs_raw_small_chunks",
            f"BSR / best raw bandwidth for the recompute model's layout "
            f"({fmt_bytes(rec[0]['slot_bytes'])} chunks; lowest over its points)",
            min(p["ratios"]["bsr_vs_raw_bandwidth"] for p in rec),
            0.9,
            le=False,
        )
    ]


def _keys_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``keys`` section's targets, scaled from 512K tokens to the section's token count."""
    out: list[dict[str, Any]] = []
    keys = doc.get("keys")
    if keys:
        scale = keys["tokens"] / (512 * 1024)
        for form, limit in (("list", 10e-3), ("numpy", 3e-3)):
            out.append(
                _target(
                    f"keys_{form}_s",
                    f"prepare_tokens (convert + chained keys) of a {keys['tokens']}-token "
                    f"{form} (median seconds)",
                    keys[f"{form}_s"]["median"],
                    limit * scale,
                    le=True,
                )
            )
        if "numpy_cpu_s" in keys:
            out.append(
                _target(
                    "keys_numpy_cpu_s",
                    f"prepare_tokens of a {keys['tokens']}-token numpy array, no extras "
                    "(median CPU seconds of the process)",
                    keys["numpy_cpu_s"]["median"],
                    3e-3 * scale,
                    le=True,
                )
            )
    return out


def _concurrency_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``concurrency`` section's targets: aggregate bandwidth, staging within W."""
    conc = doc.get("concurrency")
    if not conc:
        return []
    top = max(conc["levels"], key=lambda r: r["concurrent"])
    return [
        _target(
            "concurrent_aggregate_vs_single",
            f"aggregate / single-request bandwidth with {top['concurrent']} concurrent "
            "restores on one engine (HostTier)",
            top["aggregate_vs_single"],
            0.9,
            le=False,
        ),
        _target(
            "concurrent_staging_within_window",
            "peak staging slots in use over the concurrency section / W (must be <= 1)",
            conc["peak_slots_in_use"] / conc["window"],
            1.0,
            le=True,
        ),
    ]


def _window_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The smallest W at 95% of the best sweep bandwidth, if the sweep ran."""
    win = doc.get("window")
    if not win:
        return []
    return [
        _target(
            "smallest_window_at_95pct",
            f"smallest W reaching 95% of the best sweep bandwidth at io_depth <= {win['io_depth']}",
            win["smallest_window"],
            4,
            le=True,
        )
    ]


def finish(doc: dict[str, Any], sections: dict[str, Any], fio: FioSetup, io_depth: int) -> None:
    """Add the sections, ``fio`` and the issue's targets to a finished document."""
    doc.update(sections)
    doc["fio"] = fio.to_json()
    doc["window"] = window_section(doc["sweep"], io_depth)
    if fio.binary is None:
        doc["warnings"].append(fio.note)
    doc["targets"].extend(issue_targets(doc))


def print_sections(doc: dict[str, Any], console: Any) -> None:
    """Tables of the sections present in ``doc``."""
    from rich.table import Table

    ov = doc.get("overhead")
    if ov:
        t = Table(title="overhead: HostTier restore vs memcpy (medians)", title_justify="left")
        for col in (
            "chunk",
            "chunks",
            "restore",
            "memcpy",
            "restore/memcpy BW",
            "per chunk",
            "beyond memcpy",
        ):
            t.add_column(col, justify="right")
        for p in ov["points"]:
            t.add_row(
                fmt_bytes(p["chunk_bytes"]),
                str(p["chunks"]),
                _t(p["restore_s"]["median"]),
                _t(p["memcpy_s"]["median"]),
                f"{p['bandwidth_vs_memcpy']:.2f}",
                _t(p["per_chunk_s"]),
                _t(p["per_chunk_overhead_s"]),
            )
        console.print(t)
    conc = doc.get("concurrency")
    if conc:
        t = Table(
            title=f"concurrency: restores of different prompts on one engine (W={conc['window']}, "
            f"peak {conc['peak_slots_in_use']} slots)",
            title_justify="left",
        )
        for col in ("N", "wall", "aggregate", "aggregate/single"):
            t.add_column(col, justify="right")
        for r in conc["levels"]:
            t.add_row(
                str(r["concurrent"]),
                fmt_s(r["wall_s"]["median"]),
                _gbps(r["aggregate_bandwidth_Bps"]["median"]),
                f"{r['aggregate_vs_single']:.2f}",
            )
        console.print(t)
    win = doc.get("window")
    if win:
        parts = ", ".join(f"W={r['window']}: {r['fraction_of_best']:.2f}" for r in win["rows"])
        console.print(f"window: smallest W at 95% of best = {win['smallest_window']} ({parts})")
    keys = doc.get("keys")
    if keys:
        line = (
            f"keys ({keys['tokens']} tokens, prepare_tokens): list {_t(keys['list_s']['median'])},"
            f" numpy {_t(keys['numpy_s']['median'])}, torch {_t(keys['torch_s']['median'])}"
        )
        if "numpy_cpu_s" in keys:
            line += f"; CPU: numpy {_t(keys['numpy_cpu_s']['median'])}"
        console.print(line)
    cpu = doc.get("cpu")
    if cpu:
        console.print(cpu_table(cpu))
    best = sorted({p["fio"]["best"] for p in doc["results"] if p.get("fio")})
    if best:
        console.print(f"fio: best configuration per point among {', '.join(best)} (JSON)")
    if doc.get("fio") and not doc["fio"]["available"]:
        console.print(f"fio: {doc['fio']['note']}")


CPU_COLUMNS = (
    "tier",
    "chunk",
    "chunks",
    "CPU/GiB",
    "usr/sys",
    "floor/GiB",
    "(read+check&copy)",
    "CPU/floor",
    "beyond floor/chunk",
    "loop/floor",
    "wall ratio",
    "load before/after",
)


def cpu_row(p: dict[str, Any]) -> list[str]:
    """One row (medians) of the ``cpu`` section's table."""
    gib = p["bytes"] / float(1 << 30)
    f = p["floor"]
    parts = [f.get("read_cpu_s"), f["verify_copy_cpu_s"]]
    split = "+".join("-" if d is None else f"{d['median'] / gib:.3f}" for d in parts)
    usr = p["restore_usr_s"]["median"] / gib
    sys_ = p["restore_sys_s"]["median"] / gib
    w = p["wall_vs_reference"]
    name = {"memcpy": "/memcpy", "fio": "/fio", "raw": "/raw"}.get(w["reference"], "")
    la, lb = p.get("load_average_before"), p.get("load_average_after")
    load = f"{la[0]:.1f}/{lb[0]:.1f}" if la and lb else "-"
    loop = p.get("minimal_loop_vs_floor")  # a host point's minimal loop (older runs: none)
    return [
        p["tier"],
        fmt_bytes(p["chunk_bytes"]),
        str(p["chunks"]),
        f"{p['cpu_per_gib_s']:.3f} s",
        f"{usr:.2f}/{sys_:.2f}",
        f"{p['floor_per_gib_s']:.3f} s",
        split,
        f"{p['cpu_vs_floor']:.2f}",
        _t(p["machinery_per_chunk_s"]),
        "-" if loop is None else f"{loop:.2f}",
        f"{w['value']:.2f} {name}",
        load,
    ]


def cpu_table(cpu: dict[str, Any]) -> Any:
    """CPU seconds per GiB restored beside the floor (medians over the section's repeats)."""
    from rich.table import Table

    t = Table(
        title=f"cpu: CPU seconds per GiB restored vs the floor (W={cpu['window']}, io_depth "
        f"{cpu['io_depth']}, {cpu['cache_mode']}, medians of {cpu['repeats']})",
        title_justify="left",
    )
    for col in CPU_COLUMNS:
        t.add_column(col, justify="right")
    for p in cpu["points"]:
        t.add_row(*cpu_row(p))
    return t
