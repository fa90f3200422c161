"""The default ``bsr bench`` run: checks, the measurement of every layout, the document.

How it works: :func:`run` resolves the layouts (and builds the recompute model), checks that
memory and disk hold the largest state, measures every layout with a :class:`.measure.BenchRun`
(see :mod:`.measure` for what is measured and in which order), runs the machinery sections
(:mod:`.sections`), and assembles one JSON document (validated against ``schema.json``), PNG
plots and tables.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil
import torch

from ..common.document import SCHEMA_VERSION, validate, write_json
from ..common.layouts import NamedLayout, resolve_layout
from ..common.machine import commit_info, filesystem_info, machine_info
from ..common.memory import current_rss
from ..common.pagecache import resolve_mode
from ..common.stats import BenchError, load_average
from .measure import BenchRun
from .options import BenchOptions, resolve
from .recompute import Recompute
from .remote import RemoteSizing
from .report import plots, remote_table, results_table, sweep_table
from .sections import finish as finish_sections
from .sections import print_sections, run_sections
from .targets import summary, targets
from .ui import BenchUI


def _make_root(path: str | None) -> Path:
    """A fresh directory for this run's state, inside ``path`` or the system temp directory."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="bsr-bench-"))
    if not os.path.isdir(path):
        raise BenchError(f"--path {path} is not a directory; create it or mount the drive")
    return Path(tempfile.mkdtemp(prefix="bsr-bench-", dir=path))


def _memory_needed(layouts: Sequence[NamedLayout], opts: BenchOptions) -> int:
    need = 0
    for n in layouts:
        lay = n.layout
        state = max(opts.sizes) // lay.chunk_tokens * lay.chunk_tokens * lay.token_bytes
        staging = (2 * opts.window + max(opts.windows)) * lay.slot_bytes
        raw = (1 + opts.io_depth) * (lay.slot_bytes + 4096)
        remote = (
            RemoteSizing.for_state(lay, max(opts.sizes), opts.io_depth).host_bytes
            if opts.remote != "none"
            else 0
        )
        need = max(need, 2 * state + staging + raw + remote)
    return need


def _seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _layouts_and_model(
    opts: BenchOptions, ui: BenchUI, run: BenchRun
) -> tuple[list[NamedLayout], Recompute | None]:
    """The requested layouts (names unique) and the recompute model, whose own KV layout is
    appended to them (the model is None with ``--no-recompute``)."""
    layouts = [resolve_layout(name) for name in opts.layouts]
    names = [n.name for n in layouts]
    if len(set(names)) != len(names):
        raise BenchError(f"layout names must be unique, got {names}")
    model: Recompute | None = None
    if opts.recompute:
        ui.log(f"building recompute model {opts.model_size!r} (random weights)")
        with run.phase("build recompute model"):
            model = Recompute(
                opts.model_size, seed=opts.seed, max_tokens=max(opts.sizes), device=opts.device
            )
        layouts.append(model.layout())
    return layouts, model


def _check_room(layouts: Sequence[NamedLayout], opts: BenchOptions, root: Path) -> None:
    """Raise unless memory and the disk at ``root`` hold the run's largest state."""
    need = _memory_needed(layouts, opts)
    avail = psutil.virtual_memory().available
    if need > 0.85 * avail:
        raise BenchError(
            f"this run needs about {need / 2**30:.1f} GiB of memory (destination cache + "
            f"whole-plan buffer of the largest state), {avail / 2**30:.1f} GiB is available; "
            "lower --sizes"
        )
    disk_need = max(max(opts.sizes) * n.layout.token_bytes for n in layouts) * 1.05
    disk_free = shutil.disk_usage(root).free
    if disk_need > disk_free:
        raise BenchError(
            f"{root} has {disk_free / 2**30:.1f} GiB free, the largest state "
            f"needs {disk_need / 2**30:.1f} GiB; lower --sizes or use --path"
        )


def _units(
    opts: BenchOptions, run: BenchRun, layouts: Sequence[NamedLayout], recompute: bool
) -> int:
    """Steps of the progress bar: saves, measured repeats, the sweep and the prefills."""
    n_pairs = sum(1 for w in opts.windows for d in opts.io_depths if d <= w)
    units = sum(1 + len(run.sizes_for(n)) * opts.repeats for n in layouts)
    units += n_pairs * opts.repeats if opts.sweep else 0
    units += 1 + len(opts.sizes) * opts.repeats if recompute else 0
    return units


async def _measure_layouts(
    opts: BenchOptions, run: BenchRun, layouts: Sequence[NamedLayout], model: Recompute | None
) -> dict[str, Any] | None:
    """Measure every layout, then the recompute baseline against the model's own layout (the
    last one); return the document's ``recompute`` (None without the model)."""
    for i, named in enumerate(layouts):
        if named.source == "recompute-model":
            continue
        await run.bench_layout(named, sweep=opts.sweep and i == 0, recompute=None)
    if model is None:
        return None
    named = layouts[-1]
    rec_sizes = run.sizes_for(named)
    with run.phase("recompute prefill"):
        measured = run.measure_recompute(model, rec_sizes)
    await run.bench_layout(named, sweep=False, recompute=measured)
    return {
        "model": model.describe(),
        "layout": named.name,
        "compared": (
            "recompute TTFT = prefill of N random tokens to the first token's logits; "
            "restore TTFT = BSR restore of N tokens of this model's own KV layout + one "
            "decode step of the model on an N-token cache"
        ),
        "points": [measured[t] for t in rec_sizes],
    }


def _note_load(machine: dict[str, Any], warnings: list[str]) -> None:
    """Record the load average at the end; warn if other work shared the machine at start."""
    machine["load_average_end"] = load_average()
    if machine["load_average_start"] and max(machine["load_average_start"]) > 0.5 * (
        machine["cores_logical"] or 1
    ):
        warnings.append(
            f"load average {machine['load_average_start']} at start on "
            f"{machine['cores_logical']} cores: other work shared the machine"
        )


async def _run_async(opts: BenchOptions, ui: BenchUI) -> dict[str, Any]:
    """Check, measure every layout and the sections; return the document (no plots yet)."""
    t_start = time.time()
    _seed_all(opts.seed)
    run = BenchRun(opts, ui)
    machine = machine_info()
    commit = commit_info()
    run.root = _make_root(opts.path)
    try:
        fs = filesystem_info(run.root)
        run.mode, cache_note = resolve_mode(opts.cache, str(run.root), fs["filesystem"])
        layouts, model = _layouts_and_model(opts, ui, run)
        # the model, torch and transformers are long-lived: keep them out of every later gc pass
        # (a full collection over them costs ~0.3 s, and the bench collects before each restore)
        gc.collect()
        gc.freeze()
        _check_room(layouts, opts, run.root)
        ui.log(
            f"storage {run.root} ({fs['filesystem']}), cache mode {run.mode.value}: {cache_note}"
        )
        ui.start(_units(opts, run, layouts, model is not None))
        rss0 = current_rss()
        recompute_doc = await _measure_layouts(opts, run, layouts, model)
        del model
        with run.phase("machinery sections"):
            sections = await run_sections(
                opts, ui, root=run.root, mode=run.mode, fio_binary=run.fio.binary
            )
    finally:
        gc.unfreeze()
        if not opts.keep:
            shutil.rmtree(run.root, ignore_errors=True)
    _note_load(machine, run.warnings)
    storage = {
        **fs,
        "temporary": opts.path is None,
        "kept": opts.keep,
        "cache_mode": run.mode.value,
        "cache_note": cache_note,
        "direct_io_active": run.direct_active,
        "fsync": True,
        "reader": next((r["reader"] for r in run.reads.values()), "posix"),
        "read": run.reads,
    }
    config = {
        "window": opts.window,
        "io_depth": opts.io_depth,
        "repeats": opts.repeats,
        "block_tokens": 16,
        "device": opts.device,
        "rss_baseline_bytes": rss0,
    }
    doc = _document(opts, run, layouts, t_start, machine, commit, storage, config, recompute_doc)
    finish_sections(doc, sections, run.fio, opts.io_depth)
    return doc


def _document(
    opts: BenchOptions,
    run: BenchRun,
    layouts: Sequence[NamedLayout],
    t_start: float,
    machine: dict[str, Any],
    commit: dict[str, Any],
    storage: dict[str, Any],
    config: dict[str, Any],
    recompute_doc: dict[str, Any] | None,
) -> dict[str, Any]:
    """The run's JSON document before the sections are added."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "bsr bench",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": time.time() - t_start,
        "machine": machine,
        "commit": commit,
        "args": opts.to_dict(),
        "argv": sys.argv[1:],
        "seed": opts.seed,
        "storage": storage,
        "config": config,
        "layouts": [n.to_dict() for n in layouts],
        "results": run.points,
        "sweep": run.sweep,
        "sweep_skipped": run.sweep_skipped,
        "recompute": recompute_doc,
        "remote": (
            None if run.remote_info is None else {**run.remote_info, "reference_tier": "file"}
        ),
        "verified": run.verified,
        "summary": summary(run.points, layouts[0].name),
        "targets": targets(opts, run.points),
        "warnings": run.warnings,
        "phases_s": run.phases,
        "plots": [],
    }


def run(opts: BenchOptions, console: Any = None) -> dict[str, Any]:
    """Run the bench, write JSON and plots, print the tables; return the document."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or a pipe: do not squeeze the tables to 80
            console = Console(width=200)
    with BenchUI(console) as ui:
        doc = anyio.run(_run_async, opts, ui)
    if not opts.no_plots:
        t0 = time.perf_counter()
        try:
            doc["plots"] = plots(doc, Path(opts.plots))
        except Exception as exc:  # plots are a convenience; the JSON is the record
            doc["warnings"].append(f"plots failed: {exc!r}")
        doc["phases_s"]["plots"] = round(time.perf_counter() - t0, 3)
    doc["duration_s"] = round(doc["duration_s"] + doc["phases_s"].get("plots", 0.0), 3)
    validate(doc)
    write_json(doc, Path(opts.json))
    _print_summary(doc, console)
    return doc


def _print_summary(doc: dict[str, Any], console: Any) -> None:
    console.print(results_table(doc["results"], "bsr bench (medians over repeats)"))
    remote = [p for p in doc["results"] if p.get("remote")]
    if remote:
        console.print(remote_table(remote))
    if doc["sweep"]:
        console.print(sweep_table(doc["sweep"]))
    st = doc["storage"]
    console.print(
        f"storage: {st['filesystem']} at {st['path']}, cache mode [bold]{st['cache_mode']}[/]"
        f" ({st['cache_note']})"
    )
    if doc["recompute"]:
        m = doc["recompute"]["model"]
        console.print(
            f"recompute model: {m['params'] / 1e6:.1f}M params, {m['dtype']}, {m['config']}"
        )
    print_sections(doc, console)
    for t in doc["targets"]:
        mark = "[green]met[/]" if t["met"] else "[red]missed[/]"
        console.print(
            f"target {t['name']}: {t['value']:.3g} (threshold {t['threshold']}) {mark}"
            f" - {t['description']}"
        )
    for w in doc["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    console.print(f"JSON: {doc['args']['json']}  plots: {', '.join(doc['plots']) or '-'}")
    console.print(f"wall time {doc['duration_s']:.1f} s")


def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench`` without a program flag: resolve the options and :func:`run`."""
    return run(resolve(ns))
