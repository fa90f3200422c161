"""LMCache's side of ``bsr bench --l1-ladder``, run by ``.venv-lmcache/bin/python`` as a script.

Where it runs: a child process in LMCache's own virtual environment (LMCache 0.5.6 on the CPU
build of torch; no bsr import, so bsr's environment and LMCache's never mix).

How it works: one LMCacheEngine per L1 size, built the way LMCache's standalone starter builds
one without a GPU (``MockGPUConnector``, the ``StubCPUDevice`` platform), with its local CPU
backend (L1, ``max_local_cpu_size``) and its local disk backend on one directory. A writer
engine stores the largest state chunk by chunk into the disk backend (each step waits until the
chunk files are on disk, so L1 never has to hold the state); then for every L1 budget a fresh
engine is built on the same directory, given the writer's disk index (LMCache keeps it in memory
only), its L1 emptied, and ``retrieve`` is timed for each size. ``retrieve`` is LMCache's
whole-plan path: it loads every hit chunk from disk into L1 memory objects and only then hands
them to the connector (a no-op copy on the mock connector). A retrieve still running after
``timeout_s`` is recorded as ``failed`` (LMCache busy-waits for L1 space) and the worker stops
that budget: the process is ended by the parent.

Usage: ``python lmcache_worker.py CONFIG_JSON`` writes ``lmcache.json`` next to the config and
prints one progress line per retrieve. The config names ``dir``, ``sizes``, ``budgets`` (bytes),
``chunk_tokens``, ``num_layers``, ``layer_token_bytes`` and ``seed``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


def _hwm_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class _Lmcache:
    """LMCache's classes this worker uses, and torch (imported in LMCache's environment)."""

    torch: Any
    builder: Any  # LMCacheEngineBuilder
    config: Any  # LMCacheEngineConfig
    connector: Any  # MockGPUConnector
    metadata: Any  # LMCacheMetadata


def _flush(out_path: Path, doc: dict[str, Any]) -> None:
    """Write the document as it is now."""
    out_path.write_text(json.dumps(doc), "utf-8")


def _import_lmcache(doc: dict[str, Any], out_path: Path) -> _Lmcache | None:
    """LMCache and torch, their versions recorded in ``doc``; None (recorded) if they fail."""
    # run as a script, Python puts this file's folder first on the path, and that folder holds
    # the bench's own lmcache.py: ``import lmcache`` would find it instead of LMCache
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder  # type: ignore[import-not-found]
        from lmcache.v1.config import LMCacheEngineConfig  # type: ignore[import-not-found]
        from lmcache.v1.gpu_connector import MockGPUConnector  # type: ignore[import-not-found]
        from lmcache.v1.metadata import LMCacheMetadata  # type: ignore[import-not-found]
    except Exception as exc:  # recorded: where LMCache fails on this machine
        doc.update(status="import_failed", message=repr(exc), traceback=traceback.format_exc())
        _flush(out_path, doc)
        return None
    import lmcache  # type: ignore[import-not-found]

    doc["lmcache_version"] = getattr(lmcache, "__version__", None)
    doc["torch"] = torch.__version__
    return _Lmcache(
        torch, LMCacheEngineBuilder, LMCacheEngineConfig, MockGPUConnector, LMCacheMetadata
    )


def _watch_pressure() -> threading.Event:
    """An event set whenever an LMCache logger reports that L1 is under pressure."""
    pressure = threading.Event()

    class _Pressure(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "under pressure" in record.getMessage():
                pressure.set()

    for lname in list(logging.root.manager.loggerDict):
        if lname.startswith("lmcache"):
            logging.getLogger(lname).addHandler(_Pressure())
    return pressure


class _Worker:
    """One worker process: the state's shape and tokens, the engines, the document."""

    def __init__(
        self, cfg: dict[str, Any], out_path: Path, doc: dict[str, Any], lm: _Lmcache
    ) -> None:
        self.cfg, self.out_path, self.doc, self.lm = cfg, out_path, doc, lm
        torch = lm.torch
        self.ct = ct = int(cfg["chunk_tokens"])
        self.kv_shape = (int(cfg["num_layers"]), 1, ct, 1, int(cfg["layer_token_bytes"]))
        self.chunk_bytes = self.kv_shape[0] * ct * self.kv_shape[4]
        self.root = Path(cfg["dir"])
        self.root.mkdir(parents=True, exist_ok=True)
        doc["kv_shape"] = list(self.kv_shape)
        doc["chunk_bytes"] = self.chunk_bytes
        self.sizes = sorted(int(s) for s in cfg["sizes"])
        gen = torch.Generator().manual_seed(int(cfg["seed"]))
        self.tokens = torch.randint(
            0, 2**31 - 1, (max(self.sizes),), generator=gen, dtype=torch.int64
        )
        self.pressure = _watch_pressure()

    def flush(self) -> None:
        """Write the document as it is now."""
        _flush(self.out_path, self.doc)

    def engine(self, name: str, l1_bytes: int) -> Any:
        """An LMCacheEngine with an L1 of ``l1_bytes`` and the local disk backend on ``root``."""
        lm, ct, kv_shape = self.lm, self.ct, self.kv_shape
        conf = lm.config.from_defaults(
            chunk_size=ct,
            local_cpu=True,
            max_local_cpu_size=l1_bytes / GIB,
            local_disk=f"file://{self.root}/",
            max_local_disk_size=2 * max(self.sizes) // ct * self.chunk_bytes / GIB + 1,
            lmcache_instance_id=name,
        )
        md = lm.metadata(
            model_name="bsr-bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=lm.torch.uint8,
            kv_shape=kv_shape,
            use_mla=True,  # one latent per token and layer: kv_dim 1, as the layout's bytes
        )
        eng = lm.builder.get_or_create(
            name, conf, md, lm.connector(kv_shape=kv_shape), lambda t, r: None, lambda o, r: o
        )
        eng.post_init()
        return eng

    @staticmethod
    def backends(eng: Any) -> tuple[Any, Any]:
        """The engine's L1 (local CPU) and local disk backends."""
        sm = eng.storage_manager
        return sm.storage_backends["LocalCPUBackend"], sm.storage_backends["LocalDiskBackend"]

    def stored_index(self) -> dict[Any, Any] | None:
        """The disk index of the stored state: saved by an earlier process of the run, or
        stored now by a writer engine; None (recorded) if not every chunk was stored."""
        index_path = self.root / "index.pkl"
        n_chunks = max(self.sizes) // self.ct
        if index_path.exists():  # a later process of the same run: the state is on disk already
            loaded: dict[Any, Any] = pickle.loads(index_path.read_bytes())
            return loaded
        torch, ct = self.lm.torch, self.ct
        t0 = time.perf_counter()
        step_chunks = 8
        writer = self.engine("bsr-bench-writer", (step_chunks + 2) * self.chunk_bytes)
        cpu, disk = self.backends(writer)
        for start in range(0, n_chunks, step_chunks):
            end = min(n_chunks, start + step_chunks)
            mask = torch.zeros(end * ct, dtype=torch.bool)
            mask[start * ct :] = True
            writer.store(self.tokens[: end * ct], mask=mask)
            deadline = time.monotonic() + 120
            while len(disk.dict) < end and time.monotonic() < deadline:
                time.sleep(0.01)
            cpu.clear()
        stored = len(disk.dict)
        self.doc["store"] = {
            "chunks": n_chunks,
            "stored_chunks": stored,
            "seconds": round(time.perf_counter() - t0, 3),
            "files_bytes": sum(p.stat().st_size for p in self.root.iterdir() if p.is_file()),
            "note": "MockGPUConnector.from_gpu is a no-op: the stored chunk bytes are whatever "
            "the L1 allocator held; sizes and I/O are real, contents are not compared",
        }
        if stored < n_chunks:
            self.doc.update(
                status="store_failed", message=f"only {stored} of {n_chunks} chunks stored"
            )
            self.flush()
            return None
        index = dict(disk.dict)
        index_path.write_bytes(pickle.dumps(index))
        self.lm.builder.destroy("bsr-bench-writer")
        return index

    def run_budget(self, i: int, budget: int, index: dict[Any, Any]) -> None:
        """Retrieve every size under one L1 budget from an engine given the stored index; a
        retrieve that times out ends the process (exit 3, the later budgets to a new one)."""
        points = self.doc["points"]
        name = f"bsr-bench-l1-{i}"
        try:
            eng = self.engine(name, budget)
        except Exception as exc:
            for n in self.sizes:
                points.append(_point(n, budget, "failed", 0, None, None, repr(exc)))
            self.flush()
            return
        cpu_b, disk_b = self.backends(eng)
        with disk_b.disk_lock:
            disk_b.dict.update(index)
        stop = False
        for n in self.sizes:
            if self.retrieve(eng, cpu_b, n, budget):
                stop = True
                break
        if stop:
            points.extend(
                _point(n2, budget, "skipped", 0, None, None, "a smaller state timed out")
                for n2 in self.sizes
                if not any(p["tokens"] == n2 and p["budget_bytes"] == budget for p in points)
            )
            self.flush()
            # the hung retrieve holds LMCache's locks: later budgets run in a new process
            self.doc["status"] = "partial"
            self.doc["resume_after_budget"] = budget
            self.flush()
            os._exit(3)
        self.lm.builder.destroy(name)

    def retrieve(self, eng: Any, cpu_b: Any, n: int, budget: int) -> bool:
        """Time one retrieve of ``n`` tokens from an emptied L1 and record its point; return
        True if it was still running at the timeout (or stuck under L1 pressure)."""
        cfg, points = self.cfg, self.doc["points"]
        cpu_b.clear()
        result: dict[str, Any] = {}

        def retrieve() -> None:
            try:
                result["mask"] = eng.retrieve(self.tokens[:n])
            except Exception as exc:
                result["error"] = repr(exc)

        self.pressure.clear()
        anon0 = _status("RssAnon")
        hwm = _hwm_reset()
        t1 = time.perf_counter()
        th = threading.Thread(target=retrieve, daemon=True)
        th.start()
        limit = time.monotonic() + float(cfg["timeout_s"])
        while th.is_alive() and time.monotonic() < limit:
            th.join(0.05)
            if self.pressure.is_set() and th.is_alive():  # confirm it is really stuck
                th.join(float(cfg.get("stuck_s", 3.0)))
                break
        wall = time.perf_counter() - t1
        growth = max(0, (_status("VmHWM") if hwm else _status("VmRSS")) - anon0)
        if th.is_alive():
            points.append(
                _point(
                    n,
                    budget,
                    "failed",
                    0,
                    None,
                    growth,
                    "retrieve blocked: LMCache logged 'Local cpu memory is under "
                    "pressure' and busy-waits for L1 space the retrieve itself holds "
                    "(the plan does not fit L1)"
                    if self.pressure.is_set()
                    else f"retrieve still running after {cfg['timeout_s']} s",
                )
            )
            self.flush()
            print(f"lmcache {n} tokens L1 {budget / GIB:g} GiB: timed out", flush=True)
            return True
        if "error" in result:
            points.append(_point(n, budget, "failed", 0, wall, growth, result["error"]))
        else:
            got = int(result["mask"].sum())
            outcome = "committed" if got == n else ("partial" if got else "failed")
            point = _point(n, budget, outcome, got, wall, growth, "")
            # what the retrieve held in L1: one memory object per retrieved chunk
            point["rws_peak_bytes"] = got // self.ct * self.chunk_bytes
            points.append(point)
        print(
            f"lmcache {n} tokens L1 {budget / GIB:g} GiB: {points[-1]['outcome']} "
            f"{points[-1]['committed_tokens']} tok",
            flush=True,
        )
        self.flush()
        return False


def main() -> None:
    """Store the state (once per run), retrieve every size per budget; write ``lmcache.json``."""
    cfg_path = Path(sys.argv[1])
    cfg: dict[str, Any] = json.loads(cfg_path.read_text("utf-8"))
    out_path = cfg_path.with_name("lmcache.json")
    doc: dict[str, Any] = {"status": "started", "points": [], "warnings": []}
    lm = _import_lmcache(doc, out_path)
    if lm is None:
        return
    worker = _Worker(cfg, out_path, doc, lm)
    index = worker.stored_index()
    if index is None:
        return
    doc["status"] = "running"
    worker.flush()
    for i, budget in enumerate(sorted(int(b) for b in cfg["budgets"])):
        worker.run_budget(i, budget, index)
    doc["status"] = "ok"
    worker.flush()
    os._exit(0)  # LMCache leaves non-daemon threads running


def _point(
    n: int,
    budget: int,
    outcome: str,
    got: int,
    wall: float | None,
    growth: int | None,
    message: str,
) -> dict[str, Any]:
    return {
        "tokens": n,
        "budget_bytes": budget,
        "strategy": "lmcache",
        "window": None,
        "outcome": outcome,
        "reason": None if outcome == "committed" else (message or outcome)[:200],
        "committed_tokens": got,
        "rws_peak_bytes": 0,
        "ttft_s": None if wall is None else round(wall, 4),
        "rss_growth_bytes": growth,
        "budget_enforced_by": "lmcache",
        "verified": None,
        "message": message,
    }


if __name__ == "__main__":
    main()
