"""Striped roots: ``bsr bench --striped``, restore bandwidth over 1, 2 and 4 roots beside fio.

Where it runs: the bench process (CPU), on directories under ``--path`` (or a new temporary
directory), one :class:`~bsr.StripedFileTier` per configuration.

How it works: one state (``--striped-bytes``, 512 MiB by default, of the ``--layout``,
dsv4-flash by default; random bytes from ``--seed``) sits in a resident paged cache. For every
root count N of ``--striped-roots`` (1, 2, 4) it is saved through a :class:`~bsr.RestoreEngine`
into a StripedFileTier over ``stripe-<N>/root0 .. root<N-1>`` (N = 1 is the same class over one
root), and xxh3 digests of every group are kept. One engine per configuration then stays open
(each root's FileTier calibrates its own io_uring read depth when it opens, as in production)
and the rotation runs, ``--repeats`` times, for each configuration in turn: a restore into the
zeroed cache, timed, its bytes compared with the saved digests (every restore: ``verified``),
and fio (``io_uring``, 1 MiB blocks, queue depth 64, one job over the configuration's object
files in all its roots). The rotation starts one configuration later each repeat, so drift on a
shared machine hits every configuration alike. Before every restore and every fio run the page
cache is put in the run's ``--cache`` mode (:mod:`.common.pagecache`: ``direct`` = ``O_DIRECT``
reads for both, else ``cold`` buffered reads after ``POSIX_FADV_DONTNEED``).

Restore bandwidth is the state's payload bytes over the ``engine.restore`` wall time; per
configuration the JSON keeps every sample, the median, fio's median, ``bsr_vs_fio`` (bsr median /
fio median) and ``scaling_vs_1_root`` (bsr median / the 1-root median of the same run). Whether
the roots share a device is read from ``os.stat(root).st_dev``, ``/proc/self/mountinfo`` and
``/sys/dev/block`` (a partition counts as its disk); when they do, striping cannot add bandwidth
and the figure shows its overhead: the JSON says so in plain words (``note``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil
import torch
import xxhash

from bsr import Namespace, PagedKVCache, RestoreEngine, StripedFileTier, chunk_keys

from .common.document import write_json
from .common.fio import (
    MISSING_NOTE,
    FioConfig,
    FioRead,
    fio_binary,
    fio_version,
    fitted_grid,
    run_fio,
)
from .common.layouts import NamedLayout, resolve_layout
from .common.machine import commit_info, filesystem_info, machine_info
from .common.memory import release_free_memory
from .common.pagecache import CacheMode, prepare, resolve_mode
from .common.stats import BenchError, Dist, load_average, ratio
from .paper.options import MIB, parse_budgets

DEFAULT_ROOTS = (1, 2, 4)
DEFAULT_BYTES = 512 * MIB
QUICK_BYTES = 32 * MIB
DEFAULT_REPEATS = 5
QUICK_REPEATS = 1
DEFAULT_LAYOUT = "dsv4-flash"
BLOCK_TOKENS = 16
#: fio's reference: one io_uring job, 1 MiB blocks, 64 in flight over all the roots' files
FIO_CONFIG = FioConfig("io_uring", 1 << 20, 64)
#: called with each configuration's roots right after its save (tests corrupt a root here)
AfterSave = Callable[[int, Sequence[Path]], None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("striped roots (--striped)")
    g.add_argument(
        "--striped",
        action="store_true",
        help="instead of the default bench: one state saved into a StripedFileTier over 1, 2 "
        "and 4 roots under --path, restore bandwidth of each beside fio on the same files "
        "(see bench/README.md, 'Striped roots')",
    )
    g.add_argument(
        "--striped-roots",
        default=None,
        help="root counts to compare (default 1,2,4; 1 is always added: the scaling's base)",
    )
    g.add_argument(
        "--striped-bytes",
        default=None,
        help="state size, GiB or with units, e.g. 512MiB (default 512MiB; --quick 32MiB)",
    )


def _root_counts(text: str | None) -> tuple[int, ...]:
    if not text:
        return DEFAULT_ROOTS
    try:
        vals = {int(x) for x in text.replace(" ", "").split(",") if x}
    except ValueError:
        raise BenchError(f"--striped-roots: expected integers like 1,2,4, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise BenchError(f"--striped-roots: expected positive integers, got {text!r}")
    return tuple(sorted(vals | {1}))


def _state_bytes(text: str | None, quick: bool) -> int:
    if not text:
        return QUICK_BYTES if quick else DEFAULT_BYTES
    try:
        (value,) = parse_budgets(text)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise BenchError(f"--striped-bytes: give one size like 512MiB ({exc})") from None
    return value


@dataclass(frozen=True)
class StripedOptions:
    """Resolved options of one ``--striped`` run (recorded in the JSON under ``args``)."""

    roots: tuple[int, ...]
    state_bytes: int
    layout: str
    window: int
    io_depth: int
    repeats: int
    cache: str
    path: str | None
    keep: bool
    fio: bool
    seed: int
    quick: bool

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> StripedOptions:
        quick = bool(ns.quick)
        layouts = ns.layout or [DEFAULT_LAYOUT]
        if len(layouts) != 1:
            raise BenchError("--striped restores one layout; pass --layout once")
        window = int(ns.window or 8)
        io_depth = int(ns.io_depth or min(4, window))
        if window < 1 or not 1 <= io_depth <= window:
            raise BenchError(f"--io-depth must be in [1, W={window}], got {io_depth}")
        repeats = int(ns.repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS))
        return cls(
            roots=_root_counts(ns.striped_roots),
            state_bytes=_state_bytes(ns.striped_bytes, quick),
            layout=layouts[0],
            window=window,
            io_depth=io_depth,
            repeats=max(1, repeats),
            cache=ns.cache,
            path=ns.path,
            keep=bool(ns.keep),
            fio=not getattr(ns, "no_fio", False),
            seed=int(ns.seed),
            quick=quick,
        )


# ---------------------------------------------------------------------- devices


def _unescape(field_: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` for a space) decoded."""
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def _mount_of(path: str, dev: str) -> dict[str, Any]:
    """The mount holding ``path`` with device ``dev`` (``major:minor``) in /proc/self/mountinfo:
    its mount point, filesystem type and source (the block device, where it has one)."""
    best: dict[str, Any] = {"mountpoint": None, "fstype": None, "source": None}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    real = os.path.realpath(path)
    for line in lines:
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 2 or f[2] != dev:
            continue
        mp = _unescape(f[4])
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and (best["mountpoint"] is None or len(mp) > len(best["mountpoint"])):
            best = {"mountpoint": mp, "fstype": r[0], "source": _unescape(r[1])}
    return best


def _disk_of(major: int, minor: int) -> dict[str, Any]:
    """The block device behind ``major:minor`` from /sys/dev/block: its name, the whole disk
    (a partition's parent) and, for a stacked device (dm, md), the devices under it."""
    node = Path(f"/sys/dev/block/{major}:{minor}")
    if not node.exists():
        return {"block": None, "disk": None, "slaves": []}
    real = node.resolve()
    disk = real.parent.name if (real / "partition").exists() else real.name
    slaves_dir = real / "slaves"
    slaves = sorted(os.listdir(slaves_dir)) if slaves_dir.is_dir() else []
    return {"block": real.name, "disk": disk, "slaves": slaves}


def device_of(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Where ``path`` is stored: ``st_dev``, its mount and its disk (see :func:`_disk_of`)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    dev = f"{major}:{minor}"
    disk = _disk_of(major, minor)
    key = disk["disk"] or f"st_dev {dev}"
    return {"path": str(path), "st_dev": dev, **_mount_of(str(path), dev), **disk, "key": key}


def shared_devices(paths: Sequence[str | os.PathLike[str]]) -> dict[str, Any]:
    """Whether ``paths`` share a device, with a plain note on what that means for the figure."""
    roots = [device_of(p) for p in paths]
    keys = sorted({r["key"] for r in roots})
    devs = sorted({r["st_dev"] for r in roots})
    shared = len(keys) < len(roots)
    first = roots[0]
    where = f"st_dev {', '.join(devs)}"
    if first["source"]:
        where += f", {first['source']}"
    if first["disk"]:
        where += f", disk {first['disk']}"
    if len(roots) == 1:
        note = f"one root ({where}): the base of the scaling"
    elif len(keys) == 1:
        note = (
            f"all {len(roots)} roots share one device ({where}): striping cannot add bandwidth "
            "here; the figure shows its overhead"
        )
    elif shared:
        note = (
            f"{len(roots)} roots on {len(keys)} devices ({', '.join(keys)}): some share a "
            f"device, so scaling is bounded by {len(keys)} devices' bandwidth"
        )
    else:
        note = f"each of the {len(roots)} roots on its own device ({', '.join(keys)})"
    return {"shared": shared, "distinct_devices": len(keys), "roots": roots, "note": note}


# ---------------------------------------------------------------------- the state


class _State:
    """The state every configuration saves and restores: a resident paged cache of random
    bytes, its tokens and the xxh3 digest of each group."""

    def __init__(self, named: NamedLayout, state_bytes: int, seed: int) -> None:
        self.named = named
        self.layout = lay = named.layout
        if lay.chunk_tokens % BLOCK_TOKENS:
            raise BenchError(f"layout {named.name}: chunk_tokens is not a multiple of 16")
        self.chunks = max(1, state_bytes // lay.chunk_bytes)
        self.tokens_n = self.chunks * lay.chunk_tokens
        self.payload_bytes = self.chunks * lay.chunk_bytes
        avail = psutil.virtual_memory().available
        if self.payload_bytes * 3 > avail:
            raise BenchError(
                f"the state ({self.payload_bytes / MIB:.0f} MiB, resident) needs a third of the "
                f"{avail / MIB:.0f} MiB available: lower --striped-bytes"
            )
        self.tokens = np.random.default_rng(seed).integers(
            0, 2**31 - 1, size=self.tokens_n, dtype=np.int64
        )
        self.block_ids = np.arange(self.tokens_n // BLOCK_TOKENS, dtype=np.int64)
        self.cache = PagedKVCache(lay, len(self.block_ids), BLOCK_TOKENS)
        gen = torch.Generator().manual_seed(seed)
        for g in lay.groups:
            flat = self.cache.tensor(g.name).view(-1)
            n8 = flat.numel() // 8 * 8
            flat[:n8].view(torch.int64).random_(generator=gen)
            if n8 < flat.numel():
                flat[n8:].random_(0, 256, generator=gen)
        self.digests = self.digest()
        self.namespace = Namespace(model_id=f"bsr-bench/striped/{named.name}")

    def digest(self) -> dict[str, int]:
        return {
            g.name: int(
                xxhash.xxh3_64_intdigest(self.cache.tensor(g.name).numpy().reshape(-1).data)
            )
            for g in self.layout.groups
        }

    def zero(self) -> None:
        for g in self.layout.groups:
            self.cache.tensor(g.name).zero_()

    @property
    def objects(self) -> int:
        return len(self.layout.needed_objects(self.chunks))

    def files(self, tier: StripedFileTier) -> list[str]:
        """The object files of the whole state in ``tier``'s roots, in chunk order."""
        keys = chunk_keys(
            self.namespace.fingerprint(self.layout), self.tokens, self.layout.chunk_tokens
        )
        out = []
        for c, g in self.layout.needed_objects(len(keys)):
            p = tier.object_path(keys[c], g)
            if not p.is_file():
                raise BenchError(f"object file {p} is missing after the save")
            out.append(str(p))
        return out


@dataclass
class _Config:
    """One root count: its roots, files, engine and samples."""

    n: int
    paths: list[Path]
    files: list[str] = field(default_factory=list)
    save: dict[str, Any] = field(default_factory=dict)
    tier: StripedFileTier | None = None
    engine: RestoreEngine | None = None
    walls: list[float] = field(default_factory=list)
    resident: list[float | None] = field(default_factory=list)
    bytes_read: list[int] = field(default_factory=list)
    fio: list[FioRead] = field(default_factory=list)
    fio_failed: str | None = None
    verified: int = 0

    @property
    def name(self) -> str:
        return f"{self.n} root{'s' if self.n > 1 else ''}"


# ---------------------------------------------------------------------- the run


class _Run:
    def __init__(
        self,
        opts: StripedOptions,
        log: Callable[[str], None],
        after_save: AfterSave | None = None,
    ) -> None:
        self.opts = opts
        self.log = log
        self.after_save = after_save
        self.named = resolve_layout(opts.layout)
        self.fio = fio_binary() if opts.fio else None
        self.mode = CacheMode.DIRECT
        self.cache_note = ""

    def _tier(self, cfg: _Config, capacity: int) -> StripedFileTier:
        return StripedFileTier(
            tuple(str(p) for p in cfg.paths),
            capacity,
            name="file",
            file={"direct_io": self.mode is CacheMode.DIRECT},
        )

    async def _save(self, state: _State, cfg: _Config, capacity: int) -> None:
        for p in cfg.paths:
            p.mkdir(parents=True, exist_ok=True)
        tier = self._tier(cfg, capacity)
        engine = RestoreEngine(
            state.layout,
            [tier],
            window=self.opts.window,
            io_depth=self.opts.io_depth,
            namespace=state.namespace,
            prefault_staging=False,
        )
        t0 = time.perf_counter()
        async with engine:
            result = await engine.save(state.tokens, state.cache, state.block_ids)
        seconds = time.perf_counter() - t0
        written = sum(result.objects_written.values())
        if not result.ok or result.chunks != state.chunks or written != state.objects:
            raise BenchError(f"saving into {cfg.name} failed: {result}")
        cfg.files = state.files(tier)
        cfg.save = {
            "seconds": round(seconds, 3),
            "objects": written,
            "bytes_written": sum(result.bytes_written.values()),
        }
        self.log(f"saved {state.payload_bytes / MIB:.0f} MiB into {cfg.name} in {seconds:.2f} s")
        if self.after_save is not None:
            self.after_save(cfg.n, cfg.paths)

    async def _open(self, state: _State, cfg: _Config, capacity: int) -> None:
        cfg.tier = self._tier(cfg, capacity)
        cfg.engine = RestoreEngine(
            state.layout,
            [cfg.tier],
            window=self.opts.window,
            io_depth=self.opts.io_depth,
            namespace=state.namespace,
            prefault_staging=True,
        )
        await cfg.engine.open()

    async def _restore(self, state: _State, cfg: _Config) -> None:
        assert cfg.engine is not None
        state.zero()  # a match below proves this restore wrote every byte
        cfg.resident.append(prepare(self.mode, cfg.files))
        release_free_memory()
        t0 = time.perf_counter()
        r = await cfg.engine.restore(state.tokens, state.cache, state.block_ids)
        wall = time.perf_counter() - t0
        if not r.committed or r.committed_tokens != state.tokens_n:
            raise BenchError(
                f"restore from {cfg.name} ended {r.state} ({r.reason}): {list(r.errors)[:3]}"
            )
        got = state.digest()
        bad = sorted(g for g, d in state.digests.items() if got[g] != d)
        if bad:
            raise BenchError(f"restore from {cfg.name}: groups {bad} differ from the saved state")
        if r.bytes_read != state.payload_bytes:
            raise BenchError(
                f"restore from {cfg.name} read {r.bytes_read} bytes, the state has "
                f"{state.payload_bytes}"
            )
        cfg.verified += 1
        cfg.walls.append(wall)
        cfg.bytes_read.append(r.bytes_read)
        self.log(f"  bsr  {cfg.name:>8}: {state.payload_bytes / wall / 1e6:8.0f} MB/s")

    async def _fio(self, cfg: _Config) -> None:
        if self.fio is None or cfg.fio_failed is not None:
            return
        (config,) = fitted_grid([FIO_CONFIG], cfg.files)
        prepare(self.mode, cfg.files)
        try:
            read = run_fio(self.fio, cfg.files, config, direct=self.mode is CacheMode.DIRECT)
        except BenchError as exc:
            cfg.fio_failed = str(exc)
            return
        cfg.fio.append(read)
        self.log(f"  fio  {cfg.name:>8}: {read.bandwidth_Bps / 1e6:8.0f} MB/s ({config.name})")

    async def run(self, base: Path) -> dict[str, Any]:
        fs = filesystem_info(base)
        self.mode, self.cache_note = resolve_mode(self.opts.cache, str(base), fs["filesystem"])
        state = _State(self.named, self.opts.state_bytes, self.opts.seed)
        configs = [
            _Config(n, [base / f"stripe-{n}" / f"root{i}" for i in range(n)])
            for n in self.opts.roots
        ]
        need = state.payload_bytes * len(configs) * 1.05 + (64 << 20)
        if need > shutil.disk_usage(base).free:
            raise BenchError(f"{base} has too little room for {len(configs)} copies of the state")
        capacity = 2 * state.payload_bytes + (64 << 20) * max(self.opts.roots)
        for cfg in configs:
            await self._save(state, cfg, capacity)
        try:
            for cfg in configs:
                await self._open(state, cfg, capacity)
            await self._rotate(state, configs)
        finally:
            for cfg in configs:
                if cfg.engine is not None:
                    await cfg.engine.aclose()
        return self._summarize(state, configs)

    async def _rotate(self, state: _State, configs: list[_Config]) -> None:
        steps: list[tuple[str, _Config]] = []
        for cfg in configs:
            steps += [("bsr", cfg), ("fio", cfg)]
        for r in range(self.opts.repeats):
            self.log(f"repeat {r + 1}/{self.opts.repeats}")
            k = (r * 2) % len(steps)  # one configuration later each repeat
            for what, cfg in steps[k:] + steps[:k]:
                await (self._restore(state, cfg) if what == "bsr" else self._fio(cfg))

    # ------------------------------------------------------------------ the document
    def _roots_json(self, cfg: _Config) -> dict[str, Any]:
        """Where the configuration's objects went, and each root's reader."""
        assert cfg.tier is not None
        sizes = [0] * cfg.n
        counts = [0] * cfg.n
        for f in cfg.files:
            i = next(i for i, p in enumerate(cfg.paths) if Path(f).is_relative_to(p))
            counts[i] += 1
            sizes[i] += os.path.getsize(f)
        total = sum(sizes)
        share = max(sizes) / total
        readers = []
        for t in cfg.tier.roots:
            readers.append(
                {
                    "reader": getattr(t.reader, "name", type(t.reader).__name__),
                    "read_depth": getattr(t.reader, "depth", None),
                    "direct_active": getattr(t.reader, "direct_active", None),
                    "calibration": t.read_calibration,
                }
            )
        return {
            "objects_per_root": counts,
            "stored_bytes_per_root": sizes,
            "stored_bytes": total,
            "max_root_share": share,
            "ideal_scaling": 1.0 / share,
            "readers": readers,
        }

    def _row(self, state: _State, cfg: _Config) -> dict[str, Any]:
        wall = Dist.of(cfg.walls)
        bw = wall.map(lambda s: state.payload_bytes / s)
        fio_bw = Dist.of([r.bandwidth_Bps for r in cfg.fio]) if cfg.fio else None
        row: dict[str, Any] = {
            "roots": cfg.n,
            "paths": [str(p) for p in cfg.paths],
            "devices": shared_devices(cfg.paths),
            "bytes": state.payload_bytes,
            "bytes_read": cfg.bytes_read,
            **self._roots_json(cfg),
            "save": cfg.save,
            "restore_s": wall.to_dict(),
            "bandwidth_Bps": bw.to_dict(),
            "bandwidth_median_Bps": bw.median,
            "resident_before": cfg.resident,
            "fio_config": fitted_grid([FIO_CONFIG], cfg.files)[0].name,
            "fio_bandwidth_Bps": None if fio_bw is None else fio_bw.to_dict(),
            "fio_median_Bps": None if fio_bw is None else fio_bw.median,
            "fio_coverage": (
                min(r.io_bytes for r in cfg.fio) / sum(os.path.getsize(f) for f in cfg.files)
                if cfg.fio
                else None
            ),
            "fio_failed": cfg.fio_failed,
            "bsr_vs_fio": None if fio_bw is None else ratio(bw.median, fio_bw.median, "bsr_vs_fio"),
            "restores_verified": cfg.verified,
            "verified": cfg.verified == len(cfg.walls) == self.opts.repeats,
        }
        return row

    def _summarize(self, state: _State, configs: list[_Config]) -> dict[str, Any]:
        rows = [self._row(state, c) for c in configs]
        one = next(r for r in rows if r["roots"] == 1)
        for r in rows:
            r["scaling_vs_1_root"] = ratio(
                r["bandwidth_median_Bps"], one["bandwidth_median_Bps"], "scaling_vs_1_root"
            )
            r["fio_scaling_vs_1_root"] = (
                ratio(r["fio_median_Bps"], one["fio_median_Bps"], "fio_scaling_vs_1_root")
                if r["fio_median_Bps"] and one["fio_median_Bps"]
                else None
            )
        widest = max(configs, key=lambda c: c.n)
        devices = shared_devices(widest.paths)
        return {
            "state": {
                "tokens": state.tokens_n,
                "chunks": state.chunks,
                "objects": state.objects,
                "payload_bytes": state.payload_bytes,
            },
            "cache_mode": self.mode.value,
            "cache_note": self.cache_note,
            "devices": devices,
            "note": devices["note"],
            "configurations": rows,
            "verified": all(r["verified"] for r in rows),
        }


# ---------------------------------------------------------------------- output


def _table(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    st = doc["state"]
    t = Table(
        title=f"Striped roots: {doc['layout']['name']}, {st['payload_bytes'] / MIB:.0f} MiB "
        f"({st['objects']} objects), cache {doc['cache_mode']}, "
        f"W={doc['args']['window']} io_depth={doc['args']['io_depth']}",
        title_justify="left",
    )
    for col in (
        "roots",
        "objects/root",
        "bsr MB/s",
        "fio MB/s",
        "bsr/fio",
        "scaling",
        "fio scaling",
    ):
        t.add_column(col, justify="right")

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in doc["configurations"]:
        t.add_row(
            str(r["roots"]),
            ",".join(str(c) for c in r["objects_per_root"]),
            num(r["bandwidth_median_Bps"] / 1e6, ".0f"),
            num(r["fio_median_Bps"] and r["fio_median_Bps"] / 1e6, ".0f"),
            num(r["bsr_vs_fio"], ".2f"),
            num(r["scaling_vs_1_root"], ".2f"),
            num(r["fio_scaling_vs_1_root"], ".2f"),
        )
    return t


def _document(
    run: _Run, body: dict[str, Any], t_start: float, fs: dict[str, Any], machine: dict[str, Any]
) -> dict[str, Any]:
    opts = run.opts
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(opts).items()}
    return {
        "schema_version": 1,
        "tool": "bsr bench --striped",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 3),
        "machine": machine,
        "load_average_end": load_average(),
        "commit": commit_info(),
        "args": args,
        "argv": sys.argv[1:],
        "storage": {**fs, "temporary": opts.path is None},
        "fio": {
            "available": run.fio is not None,
            "version": fio_version(run.fio) if run.fio else None,
            "config": FIO_CONFIG.name,
            "note": (
                "one io_uring job over every object file of the configuration (all its roots), "
                "block size capped at the smallest file"
                if run.fio
                else ("fio disabled (--no-fio)" if not opts.fio else MISSING_NOTE)
            ),
        },
        "layout": run.named.to_dict(),
        **body,
    }


def run_striped(
    ns: argparse.Namespace, console: Any = None, *, after_save: AfterSave | None = None
) -> dict[str, Any]:
    """Run ``bsr bench --striped``, write its JSON, print the table; return the document.

    ``after_save(n, roots)`` runs after each configuration's save (tests damage a root there).
    """
    from rich.console import Console

    console = console or Console(width=200)
    opts = StripedOptions.from_namespace(ns)
    run = _Run(opts, lambda m: console.print(m, highlight=False), after_save)
    t_start = time.time()
    machine = machine_info()
    if opts.path is not None and not Path(opts.path).is_dir():
        raise BenchError(f"--path {opts.path} is not a directory")
    base = Path(tempfile.mkdtemp(prefix="bsr-striped-", dir=opts.path))
    try:
        body = anyio.run(run.run, base)
        fs = filesystem_info(base)
    finally:
        if not opts.keep:
            shutil.rmtree(base, ignore_errors=True)
    doc = _document(run, body, t_start, fs, machine)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t_start))
    path = Path(ns.json or f"bench/results/striped-{stamp}.json")
    write_json(doc, path)
    console.print(_table(doc))
    console.print(f"devices: {doc['note']}")
    console.print(f"cache: {doc['cache_mode']} ({doc['cache_note']})")
    console.print(f"every restore byte-exact: {doc['verified']}")
    console.print(f"JSON: {path}")
    return doc


def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench --striped``."""
    return run_striped(ns)
