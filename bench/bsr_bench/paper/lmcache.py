"""The real baseline: LMCache 0.5.6's whole-plan retrieve, run beside bsr's in ``--l1-ladder``.

Where it runs: the bench process starts :mod:`.lmcache_worker` as a script with
``.venv-lmcache/bin/python`` (LMCache pins its own dependencies, so it gets its own environment;
``make lmcache-venv`` builds it) and reads back its JSON.

How it works: the worker stores the ladder's largest state into LMCache's local disk backend
once, then retrieves every size under every L1 budget (``max_local_cpu_size``). When a plan does
not fit L1, LMCache 0.5.6 does not fail: its allocator busy-waits for L1 space that the same
retrieve holds, forever. The worker sees LMCache's own "under pressure" warning, records the
point as ``failed`` and exits (the hung thread holds LMCache's locks); this module starts a new
worker for the remaining budgets, which reuses the stored state through the saved disk index.
Budgets that do not fit this host's free memory are not tried (``skipped``, ``host_memory``).
Without the venv the ladder runs without LMCache and says so: bsr's whole-plan strategy is then
the stand-in for LMCache's retrieve, labelled as such.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ..common.stats import BenchError
from ..common.workers import BENCH_ROOT

GIB = 1 << 30
WORKER = Path(__file__).with_name("lmcache_worker.py")
STAND_IN = (
    "LMCache did not run: bsr's whole-plan strategy (strategy='whole_plan') stands in for "
    "LMCache's whole-plan retrieve in this document"
)


def venv_python(root: Path | None = None) -> Path:
    """``.venv-lmcache/bin/python`` of the repository (or of the current directory)."""
    for base in (root, BENCH_ROOT.parent, Path.cwd()):
        if base is None:
            continue
        p = base / ".venv-lmcache" / "bin" / "python"
        if p.exists():
            return p
    return Path.cwd() / ".venv-lmcache" / "bin" / "python"


def _lmcache_version(py: Path) -> str | None:
    try:
        out = subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _layout_shape(named: Any) -> tuple[int, int]:
    """LMCache's per-chunk shape for the layout: (layers, bytes per token and layer).

    LMCache keeps one tensor per layer; the layout's groups are folded into one uint8 latent of
    ``token_bytes / num_layers`` per token and layer when the groups share a layer count
    (dsv4-flash: 32 layers x 2003 B = 64,096 B/token), else into one layer of ``token_bytes``.
    """
    lay = named.layout
    counts = {g.num_layers for g in lay.groups}
    if len(counts) == 1:
        n = counts.pop()
        if lay.token_bytes % n == 0:
            return n, lay.token_bytes // n
    return 1, lay.token_bytes


def _skipped(n: int, b: int, reason: str, message: str) -> dict[str, Any]:
    """A ladder point LMCache did not run (``outcome`` skipped), with why."""
    return {
        "tokens": n,
        "budget_bytes": b,
        "strategy": "lmcache",
        "window": None,
        "outcome": "skipped",
        "reason": reason,
        "committed_tokens": 0,
        "rws_peak_bytes": 0,
        "ttft_s": None,
        "rss_growth_bytes": None,
        "budget_enforced_by": "lmcache",
        "verified": None,
        "message": message,
    }


@dataclass
class _Ladder:
    """LMCache's side of one ladder: what the workers are given, and what they gave back."""

    py: Path
    work: Path
    sizes: list[int]
    ct: int
    layers: int
    per_layer: int
    seed: int
    points: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    store: dict[str, Any] | None = None
    status: str = "ok"
    env: dict[str, str] = field(
        default_factory=lambda: {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    )

    @property
    def chunk_bytes(self) -> int:
        return self.layers * self.per_layer * self.ct

    def drop_too_big(self, budgets: Sequence[int]) -> None:
        """Skip the sizes whose plan exceeds every budget (a plan larger than every L1 of the
        run cannot be retrieved whole; what LMCache does when a plan does not fit is measured
        at the sizes that fit one budget but not another)."""
        cb = self.chunk_bytes
        too_big = [n for n in self.sizes if n // self.ct * cb > max(budgets)]
        self.sizes = [n for n in self.sizes if n not in too_big]
        for n in too_big:
            self.points.extend(
                _skipped(
                    n,
                    b,
                    "plan_exceeds_every_l1",
                    f"the plan ({n // self.ct * cb / GIB:.3f} GiB) exceeds the largest L1 "
                    "budget of the run; not stored into LMCache",
                )
                for b in sorted(budgets)
            )

    def budgets_in_memory(self, budgets: Sequence[int]) -> list[int]:
        """The budgets this host's available memory holds; the others are skipped."""
        remaining = []
        for b in sorted(budgets):
            avail = psutil.virtual_memory().available
            if b + 3 * GIB > avail:
                self.points.extend(
                    _skipped(
                        n,
                        b,
                        "host_memory",
                        f"an L1 of {b / GIB:g} GiB does not fit this host's available memory "
                        f"({avail / GIB:.1f} GiB); not tried",
                    )
                    for n in self.sizes
                )
            else:
                remaining.append(b)
        return remaining

    def config(self, budgets: list[int]) -> dict[str, Any]:
        """The worker's configuration for ``budgets`` (see :mod:`.lmcache_worker`)."""
        return {
            "dir": str(self.work / "disk"),
            "sizes": self.sizes,
            "budgets": budgets,
            "chunk_tokens": self.ct,
            "num_layers": self.layers,
            "layer_token_bytes": self.per_layer,
            "seed": self.seed,
            "timeout_s": 60 + 2 * max(self.sizes) // self.ct * self.chunk_bytes / 100e6,
            "stuck_s": 3.0,
        }

    def run_worker(self, remaining: list[int], console: Any) -> list[int]:
        """One worker over ``remaining``; return the budgets a new worker still has to run
        (empty when done or failed: ``status`` and ``warnings`` say which)."""
        cfg = self.config(remaining)
        cfg_path = self.work / "config.json"
        cfg_path.write_text(json.dumps(cfg), "utf-8")
        (self.work / "lmcache.json").unlink(missing_ok=True)
        console.print(f"lmcache: L1 budgets {[f'{b / GIB:g}' for b in remaining]} GiB")
        try:
            proc = subprocess.run(
                [str(self.py), str(WORKER), str(cfg_path)],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=cfg["timeout_s"] * (len(self.sizes) + 1) + 600,
            )
        except subprocess.TimeoutExpired:
            self.warnings.append("the LMCache worker did not finish in time")
            self.status = "failed"
            return []
        res_path = self.work / "lmcache.json"
        if not res_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
            self.status = "failed"
            self.warnings.append(
                f"LMCache worker exited {proc.returncode} without a result: {tail}"
            )
            return []
        res = json.loads(res_path.read_text("utf-8"))
        self.runs.append({k: v for k, v in res.items() if k != "points"})
        self.store = self.store or res.get("store")
        self.points.extend(res.get("points", []))
        if res["status"] in ("import_failed", "store_failed"):
            self.status = res["status"]
            self.warnings.append(f"LMCache {res['status']}: {res.get('message')}; " + STAND_IN)
            return []
        if res["status"] == "partial":
            after = int(res["resume_after_budget"])
            return [b for b in remaining if b > after]
        if res["status"] != "ok":  # the worker died mid-run (e.g. the kernel's OOM killer)
            self.worker_died(proc.returncode, remaining)
        return []

    def worker_died(self, returncode: int, remaining: list[int]) -> None:
        """Mark the point the worker died in as failed and the rest of ``remaining`` skipped."""
        self.status = "worker_died"
        why = (
            f"the LMCache worker died (exit {returncode}"
            + (
                f", signal {-returncode}: see the kernel log for the OOM killer"
                if returncode < 0
                else ""
            )
            + ") during this retrieve"
        )
        self.warnings.append(why)
        seen = {(p["tokens"], p["budget_bytes"]) for p in self.points}
        first = True
        for b in remaining:
            for n in self.sizes:
                if (n, b) not in seen:
                    pt = _skipped(n, b, "worker_died", why if first else "not reached: " + why)
                    pt["outcome"] = "failed" if first else "skipped"
                    self.points.append(pt)
                    first = False


def run_lmcache_ladder(
    opts: Any, named: Any, max_tokens: int, root: Path, console: Any
) -> dict[str, Any]:
    """LMCache's side of the ladder (``points`` with ``strategy="lmcache"``), or why not."""
    if opts.lmcache == "off":
        return {
            "status": "off",
            "message": "--lmcache off; " + STAND_IN,
            "points": [],
            "warnings": [],
        }
    py = venv_python()
    if not py.exists():
        msg = (
            f"no {py.parent.parent} (make lmcache-venv builds it: LMCache 0.5.6 on the CPU "
            "torch 2.13.0); " + STAND_IN
        )
        if opts.lmcache == "require":
            raise BenchError(msg)
        console.print(f"[yellow]lmcache skipped:[/] {msg}")
        return {"status": "skipped", "message": msg, "points": [], "warnings": [msg]}
    version = _lmcache_version(py)
    layers, per_layer = _layout_shape(named)
    ct = named.layout.chunk_tokens
    sizes = sorted(t // ct * ct for t in opts.sizes if t >= ct)
    work = root / "lmcache"
    work.mkdir(parents=True, exist_ok=True)
    lad = _Ladder(py, work, sizes, ct, layers, per_layer, opts.seed)
    lad.drop_too_big(opts.budgets)
    if not lad.sizes:
        return {
            "status": "skipped",
            "message": "every size exceeds every L1 budget",
            "version": version,
            "points": lad.points,
            "warnings": lad.warnings,
        }
    disk_need = max(lad.sizes) // ct * lad.chunk_bytes * 1.05
    if disk_need > shutil.disk_usage(root).free:
        msg = f"LMCache's local disk needs {disk_need / GIB:.1f} GiB, {root} has less; " + STAND_IN
        return {
            "status": "skipped",
            "message": msg,
            "version": version,
            "points": lad.points,
            "warnings": [msg],
        }
    remaining = lad.budgets_in_memory(opts.budgets)
    while remaining:
        remaining = lad.run_worker(remaining, console)
    shutil.rmtree(work, ignore_errors=True)
    return {
        "status": lad.status,
        "version": version,
        "python": str(py),
        "how": "LMCacheEngine (LMCache's standalone CPU path: MockGPUConnector, StubCPUDevice), "
        "local disk backend on the bench's storage, L1 = max_local_cpu_size; retrieve() of "
        "every size per L1, each from an emptied L1 (every chunk read from disk)",
        "kv_shape": [layers, 1, ct, 1, per_layer],
        "chunk_bytes": lad.chunk_bytes,
        "store": lad.store,
        "runs": lad.runs,
        "points": lad.points,
        "warnings": lad.warnings,
    }
