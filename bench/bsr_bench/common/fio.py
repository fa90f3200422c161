"""The physical reference: fio reading the very object files a restore reads.

Where it runs: ``bsr bench``, in a subprocess per configuration, between the restore repeats of
each size (the rotation that orders raw reads, BSR and whole-plan restores also orders fio).

How it works: for each configuration of the grid (:data:`FIO_GRID`: ``psync`` with 1 and 4 jobs
at 4 MiB blocks; ``libaio`` at queue depth 4, 16 and 64 and ``io_uring`` at 16 and 64 with 1
MiB blocks; ``io_uring`` at depth 64 with 128 KiB blocks: the physical reference must be the
best the device gives) a job file lists the point's object files (symlinked under short names in
a temporary directory, so the list fits fio's option length; split over the jobs by bytes for
``psync``, all in one job for the queued engines), with ``direct=1`` when the run's cache mode
is ``direct`` (the page cache is prepared as for every other read otherwise). fio's own
aggregate bandwidth (``group_reporting``) is kept per configuration; the best configuration's
median is the reference that ``bsr_bandwidth_vs_fio`` divides by. :func:`run_fio` also serves
the SSD concurrency row (one io_uring configuration per depth, ``bsr bench --ssd-concurrency``).

fio only issues whole blocks, so a file's tail shorter than the block size is not read (object
files are a 4 KiB header plus a payload, so for large chunks this is one page), and a file
smaller than a block not at all: block sizes are capped at the smallest file of the point
(:func:`fitted_grid`), and every configuration reports ``coverage``, the fraction of the files'
bytes it read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .stats import BenchError, Dist

#: the note a run without fio carries (JSON ``fio.note`` and a warning)
MISSING_NOTE = (
    "fio is not installed: bsr_bandwidth_vs_fio is not reported and the bench's own raw reader "
    "is the only reference (install it with `apt-get install fio`, or `make system-deps`)"
)


@dataclass(frozen=True)
class FioConfig:
    """One point of the fio grid: I/O engine, block size and parallelism.

    ``depth`` is the number of jobs for ``psync`` (one read in flight each) and the queue depth
    of the single job for ``libaio`` and ``io_uring``.
    """

    engine: str
    block_bytes: int
    depth: int

    @property
    def name(self) -> str:
        kind = "jobs" if self.engine == "psync" else "qd"
        b = self.block_bytes
        size = f"{b >> 20}M" if b >= 1 << 20 and not b % (1 << 20) else f"{b >> 10}K"
        return f"{self.engine}-{size}-{kind}{self.depth}"


FIO_GRID: tuple[FioConfig, ...] = (
    FioConfig("psync", 4 << 20, 1),
    FioConfig("psync", 4 << 20, 4),
    FioConfig("libaio", 1 << 20, 4),
    FioConfig("libaio", 1 << 20, 16),
    FioConfig("libaio", 1 << 20, 64),
    FioConfig("io_uring", 1 << 20, 16),
    FioConfig("io_uring", 1 << 20, 64),
    FioConfig("io_uring", 128 << 10, 64),
)
QUICK_FIO_GRID: tuple[FioConfig, ...] = (FioConfig("psync", 4 << 20, 1),)


def fitted_grid(grid: Sequence[FioConfig], files: Sequence[str]) -> tuple[FioConfig, ...]:
    """``grid`` with every block size at most the smallest file (rounded down to a power of
    two, at least 4 KiB), so that fio reads every file (it issues whole blocks only)."""
    smallest = min(os.path.getsize(f) for f in files)
    cap = max(4096, 1 << (max(1, smallest).bit_length() - 1))
    out: list[FioConfig] = []
    for c in grid:
        fitted = FioConfig(c.engine, min(c.block_bytes, cap), c.depth)
        if fitted not in out:
            out.append(fitted)
    return tuple(out)


def fio_binary() -> str | None:
    """Path of the ``fio`` executable, or None."""
    return shutil.which("fio")


def fio_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or out.stderr.strip()


#: fio refuses option values longer than this (a job's ``filename=`` list included)
FIO_OPTION_MAX = 4000


def job_file(
    files: Sequence[str],
    config: FioConfig,
    *,
    direct: bool,
    directory: str | None = None,
    passes: int = 1,
) -> str:
    """The fio job file reading ``files`` ``passes`` times (fio's ``loops``) with ``config``.

    With ``directory``, files are named by their index in ``files`` (base 36) relative to it:
    :func:`run_fio` links them there, so that a long list fits fio's option length.
    """
    if passes < 1:
        raise BenchError(f"fio {config.name}: passes must be >= 1, got {passes}")
    jobs = config.depth if config.engine == "psync" else 1
    jobs = max(1, min(jobs, len(files)))
    lines = [
        "[global]",
        "rw=read",
        f"bs={config.block_bytes}",
        f"direct={1 if direct else 0}",
        f"ioengine={config.engine}",
        f"iodepth={1 if config.engine == 'psync' else config.depth}",
        "group_reporting=1",
        "thread=1",
        "invalidate=0",
    ]
    if passes > 1:
        lines.append(f"loops={passes}")
    if directory is not None:
        lines.append(f"directory={directory}")
        index = {f: _b36(i) for i, f in enumerate(files)}
    for j, mine in enumerate(_balanced(files, jobs)):
        names = [index[f] if directory is not None else f.replace(":", "\\:") for f in mine]
        value = ":".join(names)
        if len(value) > FIO_OPTION_MAX:
            raise BenchError(
                f"fio {config.name}: {len(mine)} files do not fit one fio job's file list; "
                "lower --sizes or pass --no-fio"
            )
        lines += [f"[read{j}]", "filename=" + value]
    return "\n".join(lines) + "\n"


def _b36(i: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        i, r = divmod(i, 36)
        out = digits[r] + out
        if i == 0:
            return out


def _balanced(files: Sequence[str], jobs: int) -> list[list[str]]:
    """``files`` split over ``jobs`` with about equal bytes each (largest first, to the lightest
    job), so no job is left with only files smaller than a block."""
    out: list[list[str]] = [[] for _ in range(jobs)]
    load = [0] * jobs
    for f in sorted(files, key=lambda f: -os.path.getsize(f)):
        j = load.index(min(load))
        out[j].append(f)
        load[j] += os.path.getsize(f)
    return [sorted(x) for x in out if x]


@dataclass(frozen=True)
class FioRead:
    """One fio run: its aggregate bandwidth and how much of the files it read."""

    config: FioConfig
    bandwidth_Bps: float
    io_bytes: int
    runtime_s: float
    #: fio's own CPU time of its jobs (``usr_cpu`` + ``sys_cpu``, percent of the summed job
    #: runtime, times that runtime): the reads' cost without fio's start-up; None where this
    #: fio's JSON lacks ``job_runtime``. Totals over every pass (``io_bytes`` and ``runtime_s``
    #: too); the bandwidth is the run's, hence a pass's.
    cpu_s: float | None = None
    usr_s: float | None = None
    sys_s: float | None = None
    #: how many times the run read the files (fio's ``loops``)
    passes: int = 1

    def per_pass(self, seconds: float | None) -> float | None:
        """``seconds`` (one of this run's totals) divided by its passes."""
        return None if seconds is None else seconds / self.passes


#: fio's I/O buffers on transparent huge pages, as bsr's staging slots are without CUDA (glibc
#: 2.35 and later: malloc advises ``MADV_HUGEPAGE`` and sizes its mappings to whole huge pages;
#: an older glibc ignores it): an O_DIRECT read pins one 2 MiB page where it pinned 512 small
#: ones. On a 2-vCPU EPYC fio's read CPU fell from 0.064 to 0.016 CPU-s/GiB (io_uring and
#: libaio, 1 MiB at depth 16, 256 MiB, three runs each): without it fio is no floor for a
#: restore reading into huge pages
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def fio_env() -> dict[str, str]:
    """The environment fio runs in: this process's, with :data:`HUGE_PAGE_TUNABLE` added to
    ``GLIBC_TUNABLES``."""
    env = dict(os.environ)
    have = env.get("GLIBC_TUNABLES")
    env["GLIBC_TUNABLES"] = f"{have}:{HUGE_PAGE_TUNABLE}" if have else HUGE_PAGE_TUNABLE
    return env


def run_fio(
    binary: str, files: Sequence[str], config: FioConfig, *, direct: bool, passes: int = 1
) -> FioRead:
    """Run one configuration over ``files`` (``passes`` times in one run: fio's CPU figure
    comes in whole milliseconds, so a small read is measured over several passes);
    :class:`BenchError` when fio fails."""
    with tempfile.TemporaryDirectory(prefix="bsr-fio-") as tmp:
        links = Path(tmp) / "files"
        links.mkdir()
        for i, f in enumerate(files):  # short names: the list must fit fio's option length
            (links / _b36(i)).symlink_to(os.path.abspath(f))
        job = Path(tmp) / "read.fio"
        job.write_text(job_file(files, config, direct=direct, directory=str(links), passes=passes))
        proc = subprocess.run(
            [binary, "--output-format=json", str(job)],
            capture_output=True,
            text=True,
            timeout=600,
            env=fio_env(),
        )
    if proc.returncode != 0:
        raise BenchError(f"fio {config.name} failed: {(proc.stderr or proc.stdout)[-400:]}")
    try:
        # fio may print notes before the JSON document
        doc = json.loads(proc.stdout[proc.stdout.index("{") :])
        job = doc["jobs"][0]
        read = job["read"]
        bw, io_bytes, runtime_ms = read["bw_bytes"], read["io_bytes"], read["runtime"]
        usr, sys_ = _cpu_seconds(job)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"fio {config.name}: unreadable output ({exc!r})") from None
    if io_bytes <= 0 or bw <= 0:
        raise BenchError(f"fio {config.name} read nothing from {len(files)} files")
    cpu = None if usr is None or sys_ is None else usr + sys_
    return FioRead(config, float(bw), int(io_bytes), runtime_ms / 1000.0, cpu, usr, sys_, passes)


def _cpu_seconds(job: dict[str, Any]) -> tuple[float | None, float | None]:
    """fio's user and system CPU seconds of a (group-reported) job.

    fio reports ``usr_cpu`` / ``sys_cpu`` as percent of the job's run time; with
    ``group_reporting`` the CPU times and run times of the group's jobs are summed first
    (``job_runtime``, ms), so percent x ``job_runtime`` is the group's CPU time. Each job is a
    thread (``thread=1``) whose CPU is counted with ``RUSAGE_THREAD``: fio's start-up and its
    reporting thread are not in it, only the reads' submission and completion work.
    """
    runtime_ms = job.get("job_runtime")
    if runtime_ms is None:
        return None, None
    scale = float(runtime_ms) / 1000.0 / 100.0
    return float(job["usr_cpu"]) * scale, float(job["sys_cpu"]) * scale


class FioSeries:
    """fio samples of one point, per configuration, over the repeats."""

    def __init__(self, grid: Sequence[FioConfig], file_bytes: int) -> None:
        self.grid = tuple(grid)
        self.file_bytes = file_bytes
        self.reads: dict[str, list[FioRead]] = {c.name: [] for c in self.grid}
        self.failed: dict[str, str] = {}

    def add(self, read: FioRead) -> None:
        self.reads[read.config.name].append(read)

    def to_json(self) -> dict[str, Any] | None:
        """The point's ``fio`` entry (None when every configuration failed)."""
        configs: list[dict[str, Any]] = []
        for c in self.grid:
            reads = self.reads[c.name]
            if not reads:
                continue
            configs.append(
                {
                    "name": c.name,
                    "engine": c.engine,
                    "block_bytes": c.block_bytes,
                    "depth": c.depth,
                    "bandwidth_Bps": Dist.of([r.bandwidth_Bps for r in reads]).to_dict(),
                    "coverage": min(r.io_bytes for r in reads) / self.file_bytes,
                }
            )
        if not configs:
            return None
        best = max(configs, key=lambda c: c["bandwidth_Bps"]["median"])
        return {
            "configs": configs,
            "best": best["name"],
            "best_bandwidth_Bps": best["bandwidth_Bps"]["median"],
            "failed": dict(self.failed),
        }
