#!/usr/bin/env python3
"""Machinery figures of two revisions, measured side by side: ``python bench/before_after.py``.

How it works: both revisions are exported with ``git archive`` into a temporary directory (so
neither is the working tree), the current ``src/bsr/_bench/machinery.py`` is copied into each
(it uses only the public ``bsr`` API, so it runs against either), and a worker subprocess per
revision measures the ``overhead`` and ``concurrency`` sections and the key derivation of a
512K-token list, numpy array and torch tensor. Rounds alternate the revisions (ABBA...), so
drift on a shared machine hits both alike; the document keeps every round and reports, per
figure, the median over rounds and the after/before ratio.

    python bench/before_after.py --before 17a7d59 --after HEAD --rounds 3 \\
        --json bench/results/before-after.json

Where it runs: a development checkout (needs git). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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


def worker(out: str, repeats: int) -> None:
    import anyio
    import structlog

    import bsr
    from bsr._bench.machinery import (
        CONCURRENCY_LEVELS,
        OVERHEAD_POINTS,
        measure_concurrency,
        measure_overhead,
    )

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

    async def main() -> dict[str, Any]:
        ov = await measure_overhead(OVERHEAD_POINTS, repeats, 8, 4, 0)
        conc = await measure_concurrency(CONCURRENCY_LEVELS, 16, 1 << 20, repeats, 8, 4, 0)
        return {"overhead": ov, "concurrency": conc}

    doc = anyio.run(main)
    doc["keys"] = _keys_worker(512 * 1024, max(5, repeats))
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
    shutil.copy(ROOT / "src/bsr/_bench/machinery.py", into / "src/bsr/_bench/machinery.py")
    return commit


def _run_worker(tree: Path, repeats: int, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, __file__, "--worker", str(out), "--repeats", str(repeats)]
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
    for p in doc["overhead"]["points"]:
        kib = p["chunk_bytes"] >> 10
        out[f"overhead.{kib}KiB.restore_s"] = p["restore_s"]["median"]
        out[f"overhead.{kib}KiB.memcpy_s"] = p["memcpy_s"]["median"]
        out[f"overhead.{kib}KiB.bandwidth_vs_memcpy"] = p["bandwidth_vs_memcpy"]
        out[f"overhead.{kib}KiB.per_chunk_overhead_s"] = p["per_chunk_overhead_s"]
    for r in doc["concurrency"]["levels"]:
        out[f"concurrency.N{r['concurrent']}.aggregate_vs_single"] = r["aggregate_vs_single"]
        out[f"concurrency.N{r['concurrent']}.aggregate_Bps"] = r["aggregate_bandwidth_Bps"][
            "median"
        ]
    out["concurrency.peak_slots_in_use"] = doc["concurrency"]["peak_slots_in_use"]
    for k, v in doc["keys"].items():
        out[f"keys.512K.{k}"] = v
    return out


MARKDOWN_ROWS = (
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="17a7d59", help="the earlier revision (default 17a7d59)")
    p.add_argument("--after", default="HEAD", help="the later revision (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per figure and round")
    p.add_argument("--json", default=None, help="output (default bench/results/before-after-*)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--markdown", default=None, metavar="JSON", help="print the table of a run")
    ns = p.parse_args(argv)
    if ns.markdown:
        print(markdown(json.loads(Path(ns.markdown).read_text())))
        return 0
    if ns.worker:
        worker(ns.worker, ns.repeats)
        return 0
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = Path(ns.json or ROOT / f"bench/results/before-after-{stamp}.json")
    with tempfile.TemporaryDirectory(prefix="bsr-before-after-") as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        commits = {k: _export(getattr(ns, k), t) for k, t in trees.items()}
        rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for r in range(ns.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for which in order:
                doc = _run_worker(trees[which], ns.repeats, Path(tmp) / f"{which}-{r}.json")
                rounds[which].append(_figures(doc))
                print(f"round {r} {which} done", file=sys.stderr)
    names = sorted(rounds["before"][0])
    summary = {}
    for name in names:
        b = statistics.median(x[name] for x in rounds["before"])
        a = statistics.median(x[name] for x in rounds["after"])
        summary[name] = {"before": b, "after": a, "after_vs_before": a / b if b else None}
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    doc_out = {
        "tool": "bench/before_after.py",
        "started_at": stamp,
        "commits": commits,
        "args": vars(ns),
        "cpus": os.cpu_count(),
        "load_average_end": load,
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
