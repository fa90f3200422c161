"""Pieces the GPU bench scripts share: the paper's layout, a filled state, page-cache control,
a host-RSS peak sampler, CUDA-aware timing and the machine description.

Uses bsr's public API only (``import bsr``), never the bench package.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch

import bsr

BLOCK_TOKENS = 16
#: DeepSeek-V4-Flash per rank (TP=2), the BSR paper's state: 64,096 B per token, 16,408,576 B per
#: 256-token chunk (``bsr bench --layout dsv4-flash`` restores the same shape)
DSV4_FLASH = bsr.StateLayout(
    chunk_tokens=256,
    groups=(
        bsr.StateGroup("kv", num_layers=32, token_bytes=1792, dtype="bfloat16"),
        bsr.StateGroup("indexer", num_layers=32, token_bytes=211, dtype="uint8"),
    ),
)
DSV4_SLOT_BYTES = 16_408_576
assert DSV4_FLASH.slot_bytes == DSV4_SLOT_BYTES
GIB = 1 << 30


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def filled_cache(layout: bsr.StateLayout, tokens: int, device: str, seed: int) -> bsr.PagedKVCache:
    """A cache of exactly ``tokens`` tokens of random bytes (generated on ``device``)."""
    cache = bsr.PagedKVCache(layout, tokens // BLOCK_TOKENS, BLOCK_TOKENS, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for g in layout.groups:
        flat = cache.tensor(g.name).view(-1)
        n8 = flat.numel() // 8 * 8
        flat[:n8].view(torch.int64).random_(generator=gen)
        if n8 < flat.numel():
            flat[n8:].random_(0, 256, generator=gen)
    sync(device)
    return cache


def token_ids(tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (tokens,), generator=gen).tolist()


def same_bytes(a: bsr.PagedKVCache, b: bsr.PagedKVCache) -> bool:
    """Whether two caches of one layout hold the same bytes in every group (on their device)."""
    return all(torch.equal(a.tensor(g.name), b.tensor(g.name)) for g in a.layout.groups)


def object_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "objects").rglob("*.bsr") if p.is_file())


def drop_page_cache(files: list[Path]) -> None:
    """``posix_fadvise(DONTNEED)`` on every file: the next read comes from the device."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def direct_io_works(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs and some VMs refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".odirect-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


class RssPeak:
    """Peak growth of this process's resident memory over a block, sampled every 2 ms."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.base = self.peak = self._proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> RssPeak:
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


@contextmanager
def timed(device: str) -> Iterator[dict[str, float]]:
    """Wall time of a block, the device drained before and after it."""
    out: dict[str, float] = {}
    sync(device)
    t = time.perf_counter()
    yield out
    sync(device)
    out["s"] = time.perf_counter() - t


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def dist(xs: list[float]) -> dict[str, Any]:
    return {"samples": xs, "min": min(xs), "median": median(xs), "max": max(xs)}


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bsr": bsr.__version__,
        "bsr_path": str(Path(bsr.__file__).parent),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "device": device,
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_bytes=props.total_memory,
            gpu_multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


def filesystem(path: Path) -> dict[str, Any]:
    """Filesystem type, source device and free bytes of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best[0]):
            best = (mp, part.fstype, part.device)
    st = os.statvfs(real)
    return {
        "path": real,
        "mountpoint": best[0],
        "filesystem": best[1],
        "source": best[2],
        "free_bytes": st.f_bavail * st.f_frsize,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


class Budget:
    """Seconds left of a wall-clock budget; says whether an estimated step still fits."""

    def __init__(self, seconds: float, log: Callable[[str], None] = print) -> None:
        self.end = time.monotonic() + seconds
        self.log = log

    @property
    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, what: str, estimate_s: float) -> bool:
        if estimate_s <= self.left:
            return True
        self.log(f"skipped: {what} needs about {estimate_s:.0f} s, {self.left:.0f} s left")
        return False
