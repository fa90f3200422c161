"""What the figures were measured on: machine, software versions, commit, filesystem."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

from .stats import load_average


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, OS and the versions of what the bench runs on."""
    vm = psutil.virtual_memory()
    load = load_average()
    return {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores_logical": psutil.cpu_count(logical=True) or 0,
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_bytes": int(vm.total),
        "memory_available_bytes": int(vm.available),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": bool(torch.cuda.is_available()),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transformers": _version("transformers"),
        "numpy": _version("numpy"),
        "anyio": _version("anyio"),
        "bsr": _version("bsr-kv"),
        "load_average_start": load,
    }


def commit_info() -> dict[str, Any]:
    """The git commit of the bsr source tree that ran, with a dirty flag (None outside git).

    The tree is the one the imported ``bsr`` package lives in (a checkout, with the bench beside
    it); an installed bsr outside git records ``None``.
    """
    import bsr

    src = Path(bsr.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(src), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"id": None, "dirty": None, "branch": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "id": commit,
        "dirty": None if status is None else bool(status),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
    }


def filesystem_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Filesystem type, device and mount point holding ``path`` (from /proc/mounts)."""
    real = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    try:
        parts = psutil.disk_partitions(all=True)
    except OSError:
        parts = []
    for p in parts:
        mp = p.mountpoint
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) > len(best[0])):
            best = (mp, p.fstype, p.device)
    if best is None:
        return {"path": real, "filesystem": "unknown", "device": None, "mountpoint": None}
    mountpoint, fstype, device = best
    return {"path": real, "filesystem": fstype, "device": device, "mountpoint": mountpoint}
