"""``bsr bench``: save states of growing size, then restore them every way and compare.

How it works, per layout (largest state saved once, smaller sizes are its prefixes):

1. save the state into a :class:`~bsr.FileTier` (temporary directory or ``--path``);
2. for each size and repeat, in a rotating order so drift hits every method alike: raw read of
   the very object files (sequential, and ``io_depth`` threads), probe (``engine.lookup``), BSR
   restore (bounded window), whole-plan restore; every read in the run's page-cache mode;
3. on the first layout, a W x io_depth sweep of BSR restores at one size;
4. the recompute baseline: a random-weight Llama prefills the same token counts, and the bench
   restores that model's own KV layout at those counts, so restore and recompute hold the same
   state;
5. with ``--remote mooncake`` (:mod:`.remote`), the state is also saved into a MooncakeTier on a
   loopback cluster started for the layout, and every size's rotation also probes and runs BSR
   and whole-plan restores from it (``results[].remote``); the cluster stops with the layout.

Everything lands in one JSON document (validated against ``schema.json``), PNG plots and tables.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil
import structlog
import torch

from bsr import Strategy

from .layouts import NamedLayout, resolve_layout
from .machine import commit_info, filesystem_info, machine_info
from .memory import current_rss
from .options import BenchOptions, add_arguments, resolve
from .pagecache import CacheMode, prepare, resolve_mode
from .raw import RawRead, RawReader
from .recompute import Recompute
from .remote import RemoteCluster, RemoteSizing, start_remote
from .report import (
    SCHEMA_VERSION,
    plots,
    remote_table,
    results_table,
    sweep_table,
    validate,
    write_json,
)
from .restore import OpenEngine, RestoreSample, SavedState
from .sections import FioSetup, print_sections, run_sections
from .sections import finish as finish_sections
from .stats import BenchError, Dist, ratio
from .ui import BenchUI


def _configure_logging(level: str) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _dist(values: Sequence[float]) -> dict[str, Any]:
    return Dist.of(values).to_dict()


def _restore_json(
    samples: Sequence[RestoreSample], file_bytes: int, window: int, io_depth: int
) -> dict[str, Any]:
    rws = [s.rws_peak_bytes for s in samples]
    return {
        "window": window,
        "io_depth": io_depth,
        "ttft_s": _dist([s.total_s for s in samples]),
        "probe_s": _dist([s.probe_s for s in samples]),
        "install_s": _dist([s.install_s for s in samples]),
        "commit_s": _dist([s.commit_s for s in samples]),
        "bandwidth_Bps": _dist([file_bytes / s.total_s for s in samples]),
        "rws_peak_bytes": max(rws),
        "rws_peak_bytes_values": rws,
        "rss_growth_bytes": _dist([s.rss_growth_bytes for s in samples]),
        "rss_method": samples[0].rss_method,
        "bytes_read": samples[0].bytes_read,
        "resident_fraction_before": [s.resident_before for s in samples],
    }


def _raw_json(reads: Sequence[RawRead], resident: Sequence[float | None]) -> dict[str, Any]:
    return {
        "threads": reads[0].threads,
        "direct": reads[0].direct,
        "seconds": _dist([r.seconds for r in reads]),
        "bandwidth_Bps": _dist([r.nbytes / r.seconds for r in reads]),
        "bytes": reads[0].nbytes,
        "resident_fraction_before": list(resident),
    }


class _Run:
    """State of one bench run; see the module docstring."""

    def __init__(self, opts: BenchOptions, ui: BenchUI) -> None:
        self.opts = opts
        self.ui = ui
        self.warnings: list[str] = []
        self.points: list[dict[str, Any]] = []
        self.sweep: list[dict[str, Any]] = []
        self.sweep_skipped: list[dict[str, int]] = []
        self.verified: dict[str, bool] = {}
        self.direct_active: bool | None = None
        self.mode = CacheMode.DIRECT
        self.root = Path(".")
        self.phases: dict[str, float] = {}
        self.remote_info: dict[str, Any] | None = None
        self.remote_segment_bytes = 0
        self.fio = FioSetup(getattr(opts, "fio", True), opts.quick)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the wall time of a part of the run (``phases`` in the JSON)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - t0, 3)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.ui.log(f"[yellow]warning:[/] {message}")

    # ------------------------------------------------------------------ sizes
    def sizes_for(self, named: NamedLayout) -> list[int]:
        ct = named.layout.chunk_tokens
        out = sorted({t // ct * ct for t in self.opts.sizes if t >= ct})
        if not out:
            raise BenchError(f"layout {named.name}: every size is below one chunk ({ct} tokens)")
        for t in self.opts.sizes:
            if t % ct:
                self.warn(
                    f"{named.name}: {t} tokens is not a multiple of {ct}; "
                    f"restoring {t // ct * ct} (full chunks only)"
                )
        return out

    def sweep_tokens(self, sizes: Sequence[int], chunk_tokens: int) -> int:
        if self.opts.sweep_tokens is not None:
            return self.opts.sweep_tokens // chunk_tokens * chunk_tokens
        need = max(self.opts.windows) * chunk_tokens
        return next((t for t in sizes if t >= need), sizes[-1])

    # ------------------------------------------------------------------ one layout
    async def bench_layout(
        self, named: NamedLayout, *, sweep: bool, recompute: dict[int, dict[str, Any]] | None
    ) -> None:
        o = self.opts
        sizes = self.sizes_for(named)
        state = SavedState(
            named, self.root, max(sizes), seed=o.seed, mode=self.mode, device=o.device
        )
        lay = named.layout
        for t in sizes:
            if t // lay.chunk_tokens < o.window:
                self.warn(
                    f"{named.name}: {t} tokens are {t // lay.chunk_tokens} chunks < W="
                    f"{o.window}; BSR RWS there is the whole state, not W x chunk"
                )
        stack = ExitStack()
        opened: list[OpenEngine] = []
        seq_reader: RawReader | None = None
        par_reader: RawReader | None = None
        try:
            remote: RemoteCluster | None = None
            if o.remote == "mooncake":
                self.ui.log(f"starting a loopback Mooncake cluster for {named.name}")
                with self.phase(f"start remote {named.name}"):
                    sizing = RemoteSizing.for_state(lay, state.max_tokens, o.io_depth)
                    remote = stack.enter_context(start_remote(sizing))
                self.remote_info = remote.describe()
                self.remote_segment_bytes = sizing.segment_bytes
            self.ui.step(f"save {named.name} ({state.max_tokens} tokens)", 1)
            with self.phase(f"save {named.name}"):
                save = await state.save(remote.tier() if remote is not None else None)
            self.ui.advance()
            max_file = max(_sizes(state.files(lay.chunk_tokens)))
            direct = self.mode is CacheMode.DIRECT
            seq_reader = RawReader(max_file, 1, direct=direct)
            par_reader = RawReader(max_file, o.io_depth, direct=direct)
            bsr = await state.open_engine(o.window, o.io_depth, prefault=True)
            opened.append(bsr)
            wp = await state.open_engine(o.window, o.io_depth, prefault=False)
            opened.append(wp)
            remote_engines: tuple[OpenEngine, OpenEngine] | None = None
            if remote is not None:
                rb = await state.open_engine(
                    o.window, o.io_depth, prefault=True, tier=remote.tier()
                )
                opened.append(rb)
                rw = await state.open_engine(
                    o.window, o.io_depth, prefault=False, tier=remote.tier()
                )
                opened.append(rw)
                remote_engines = (rb, rw)
            for tokens in sizes:
                self.ui.step(f"{named.name} {tokens} tokens", o.repeats)
                with self.phase(f"measure {named.name}"):
                    point = await self._measure_size(
                        state,
                        tokens,
                        bsr,
                        wp,
                        seq_reader,
                        par_reader,
                        save.duration_s,
                        remote_engines,
                    )
                if recompute is not None and tokens in recompute:
                    self._attach_recompute(point, recompute[tokens])
                self.points.append(point)
                self.ui.add_point(point)
            for e in opened:
                await e.engine.aclose()
            opened.clear()
            if sweep:
                with self.phase("sweep"):
                    await self._sweep(state, sizes)
        finally:
            for e in opened:
                await e.engine.aclose()
            if seq_reader is not None:
                seq_reader.close()
            if par_reader is not None:
                par_reader.close()
            if state.direct_active is not None:
                self.direct_active = state.direct_active
            del state
            try:
                with self.phase("stop remote"):
                    stack.close()  # the cluster, if one was started (stopped by PID)
            finally:
                if not o.keep:
                    shutil.rmtree(self.root / named.name, ignore_errors=True)

    async def _measure_size(
        self,
        state: SavedState,
        tokens: int,
        bsr: Any,
        wp: Any,
        seq: RawReader,
        par: RawReader,
        save_s: float,
        remote: tuple[OpenEngine, OpenEngine] | None = None,
    ) -> dict[str, Any]:
        o = self.opts
        files = state.files(tokens)
        file_bytes = sum(_sizes(files))
        raw_seq: list[RawRead] = []
        raw_par: list[RawRead] = []
        res_seq: list[float | None] = []
        res_par: list[float | None] = []
        probes: list[float] = []
        bsr_s: list[RestoreSample] = []
        wp_s: list[RestoreSample] = []
        verify = tokens == state.max_tokens
        ok: list[bool] = []

        async def do_raw() -> None:
            res_seq.append(prepare(self.mode, files))
            raw_seq.append(seq.read(files))
            res_par.append(prepare(self.mode, files))
            raw_par.append(par.read(files))

        async def do_bsr() -> None:
            probes.append(await state.probe(bsr, tokens))
            if verify and not ok:
                state.clear_cache()
            bsr_s.append(await state.restore(bsr, tokens, Strategy.BOUNDED, files))
            if verify and len(ok) == 0:
                ok.append(state.verify())

        async def do_wp() -> None:
            if verify and len(ok) == 1:
                state.clear_cache()
            wp_s.append(await state.restore(wp, tokens, Strategy.WHOLE_PLAN, files))
            if verify and len(ok) == 1:
                ok.append(state.verify())

        r_probes: list[float] = []
        r_bsr: list[RestoreSample] = []
        r_wp: list[RestoreSample] = []
        r_ok: list[bool] = []

        async def do_remote_bsr() -> None:
            assert remote is not None
            r_probes.append(await state.probe(remote[0], tokens))
            if verify and not r_ok:
                state.clear_cache()
            r_bsr.append(await state.restore(remote[0], tokens, Strategy.BOUNDED, None))
            if verify and len(r_ok) == 0:
                r_ok.append(state.verify())

        async def do_remote_wp() -> None:
            assert remote is not None
            if verify and len(r_ok) == 1:
                state.clear_cache()
            r_wp.append(await state.restore(remote[1], tokens, Strategy.WHOLE_PLAN, None))
            if verify and len(r_ok) == 1:
                r_ok.append(state.verify())

        steps: list[Callable[[], Any]] = [do_raw, do_bsr, do_wp]
        fio_step = self.fio.step(self.mode, files, file_bytes, source=state.named.source)
        if fio_step is not None:
            steps.append(fio_step)
        if remote is not None:
            steps += [do_remote_bsr, do_remote_wp]
        for r in range(o.repeats):
            k = r % len(steps)
            for fn in steps[k:] + steps[:k]:
                await fn()
            self.ui.advance()
        if verify:
            self.verified[state.named.name] = all(ok) and len(ok) == 2
            if not self.verified[state.named.name]:
                raise BenchError(f"{state.named.name}: restored bytes differ from the saved ones")
            if remote is not None:
                key = f"{state.named.name} (remote {o.remote})"
                self.verified[key] = all(r_ok) and len(r_ok) == 2
                if not self.verified[key]:
                    raise BenchError(
                        f"{state.named.name}: bytes restored from {o.remote} differ from the "
                        "saved ones"
                    )

        raw = {"sequential": _raw_json(raw_seq, res_seq), "parallel": _raw_json(raw_par, res_par)}
        seq_bw = raw["sequential"]["bandwidth_Bps"]["median"]
        par_bw = raw["parallel"]["bandwidth_Bps"]["median"]
        best_bw = max(seq_bw, par_bw)
        b = _restore_json(bsr_s, file_bytes, o.window, o.io_depth)
        w = _restore_json(wp_s, file_bytes, o.window, o.io_depth)
        lay = state.layout
        point: dict[str, Any] = {
            "layout": state.named.name,
            "tokens": tokens,
            "chunks": tokens // lay.chunk_tokens,
            "state_bytes": tokens * lay.token_bytes,
            "files": len(files),
            "file_bytes": file_bytes,
            "slot_bytes": lay.slot_bytes,
            "matched_recompute": state.named.source == "recompute-model",
            "save_s": save_s,
            "probe_s": _dist(probes),
            "raw": {
                **raw,
                "best": "sequential" if seq_bw >= par_bw else "parallel",
                "best_bandwidth_Bps": best_bw,
            },
            "bsr": b,
            "whole_plan": w,
            "ratios": {
                "bsr_vs_raw_bandwidth": ratio(
                    b["bandwidth_Bps"]["median"], best_bw, "bsr_vs_raw_bandwidth"
                ),
                "bsr_vs_whole_plan_ttft": ratio(
                    b["ttft_s"]["median"], w["ttft_s"]["median"], "bsr_vs_whole_plan_ttft"
                ),
                "whole_plan_vs_bsr_rws": ratio(
                    w["rws_peak_bytes"], b["rws_peak_bytes"], "whole_plan_vs_bsr_rws"
                ),
            },
            "recompute": None,
            **(
                {}
                if remote is None
                else {"remote": self._remote_json(state, file_bytes, b, w, r_probes, r_bsr, r_wp)}
            ),
        }
        if fio_step is not None:
            fio_step.attach(point)
        return point

    def _remote_json(
        self,
        state: SavedState,
        file_bytes: int,
        local_bsr: dict[str, Any],
        local_wp: dict[str, Any],
        probes: Sequence[float],
        bsr_s: Sequence[RestoreSample],
        wp_s: Sequence[RestoreSample],
    ) -> dict[str, Any]:
        o = self.opts
        rb = _restore_json(bsr_s, file_bytes, o.window, o.io_depth)
        rw = _restore_json(wp_s, file_bytes, o.window, o.io_depth)
        saved = state.remote_save_result
        return {
            "tier": o.remote,
            "segment_bytes": self.remote_segment_bytes,
            "save_s": saved.duration_s if saved is not None else None,
            "probe_s": _dist(probes),
            "bsr": rb,
            "whole_plan": rw,
            "ratios": {
                "bsr_vs_whole_plan_ttft": ratio(
                    rb["ttft_s"]["median"], rw["ttft_s"]["median"], "remote bsr_vs_whole_plan_ttft"
                ),
                "whole_plan_vs_bsr_rws": ratio(
                    rw["rws_peak_bytes"], rb["rws_peak_bytes"], "remote whole_plan_vs_bsr_rws"
                ),
                "remote_vs_file_bsr_ttft": ratio(
                    rb["ttft_s"]["median"],
                    local_bsr["ttft_s"]["median"],
                    "remote_vs_file_bsr_ttft",
                ),
                "remote_vs_file_whole_plan_ttft": ratio(
                    rw["ttft_s"]["median"],
                    local_wp["ttft_s"]["median"],
                    "remote_vs_file_whole_plan_ttft",
                ),
            },
        }

    @staticmethod
    def _attach_recompute(point: dict[str, Any], rec: dict[str, Any]) -> None:
        step = rec["first_token_step_s"]["median"]
        restore_ttft = point["bsr"]["ttft_s"]["median"] + step
        point["recompute"] = {**rec, "bsr_ttft_with_step_s": restore_ttft}
        point["ratios"]["recompute_vs_bsr_ttft"] = ratio(
            rec["prefill_s"]["median"], restore_ttft, "recompute_vs_bsr_ttft"
        )

    async def _sweep(self, state: SavedState, sizes: Sequence[int]) -> None:
        o = self.opts
        tokens = self.sweep_tokens(sizes, state.layout.chunk_tokens)
        ref = next(
            p for p in self.points if p["layout"] == state.named.name and p["tokens"] == tokens
        )
        files = state.files(tokens)
        pairs = [(w, d) for w in o.windows for d in o.io_depths if d <= w]
        self.sweep_skipped = [
            {"window": w, "io_depth": d} for w in o.windows for d in o.io_depths if d > w
        ]
        self.ui.step(
            f"sweep W x io_depth ({state.named.name}, {tokens} tokens)", len(pairs) * o.repeats
        )
        for w, d in pairs:
            opened = await state.open_engine(w, d, prefault=True)
            try:
                samples = []
                for _ in range(o.repeats):
                    samples.append(await state.restore(opened, tokens, Strategy.BOUNDED, files))
                    self.ui.advance()
            finally:
                await opened.engine.aclose()
                del opened  # free this W's staging before the next baseline is taken
            entry = {
                "layout": state.named.name,
                "tokens": tokens,
                "state_bytes": ref["state_bytes"],
                **_restore_json(samples, ref["file_bytes"], w, d),
                "raw_bandwidth_Bps": ref["raw"]["best_bandwidth_Bps"],
            }
            entry["bsr_vs_raw_bandwidth"] = ratio(
                entry["bandwidth_Bps"]["median"],
                entry["raw_bandwidth_Bps"],
                "sweep bsr_vs_raw_bandwidth",
            )
            self.sweep.append(entry)

    # ------------------------------------------------------------------ recompute
    def measure_recompute(
        self, model: Recompute, sizes: Sequence[int]
    ) -> dict[int, dict[str, Any]]:
        o = self.opts
        self.ui.step(
            f"recompute prefill ({model.size}, {model.params / 1e6:.1f}M params)",
            1 + len(sizes) * o.repeats,
        )
        model.warmup()
        self.ui.advance()
        out: dict[int, dict[str, Any]] = {}
        for tokens in sizes:
            prefill: list[float] = []
            step: list[float] = []
            for _ in range(o.repeats):
                p, s = model.measure(tokens)
                prefill.append(p)
                step.append(s)
                self.ui.advance()
            out[tokens] = {
                "tokens": tokens,
                "prefill_s": _dist(prefill),
                "first_token_step_s": _dist(step),
            }
        return out


def _sizes(paths: Sequence[str]) -> list[int]:
    return [os.path.getsize(p) for p in paths]


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


def _targets(run: _Run, points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    o = run.opts
    main = [p for p in points if p["chunks"] >= o.window]
    flat_dev = 0
    for p in main:
        flat_dev = max(flat_dev, abs(p["bsr"]["rws_peak_bytes"] - o.window * p["slot_bytes"]))
    # bandwidth and TTFT targets are about the layouts asked for; the recompute model's own
    # layout (a few MiB in sub-MiB chunks) is there for the recompute comparison only
    asked = [p for p in points if not p["matched_recompute"]] or list(points)
    bw = min(p["ratios"]["bsr_vs_raw_bandwidth"] for p in asked)
    ttft = max(p["ratios"]["bsr_vs_whole_plan_ttft"] for p in asked)
    targets: list[dict[str, Any]] = [
        {
            "name": "rws_equals_w_x_chunk",
            "description": "BSR rws_peak_bytes equals W x slot_bytes at every size with >= W "
            "chunks (value: largest deviation in bytes)",
            "value": float(flat_dev),
            "threshold": 0.0,
            "met": flat_dev == 0 and bool(main),
        },
        {
            "name": "bsr_bandwidth_vs_raw",
            "description": "BSR restore bandwidth / best raw read bandwidth of the same files "
            "(value: lowest over the requested layouts' points)",
            "value": bw,
            "threshold": 0.9,
            "met": bw >= 0.9,
        },
        {
            "name": "bsr_ttft_vs_whole_plan",
            "description": "BSR TTFT / whole-plan TTFT (value: highest over the requested "
            "layouts' points)",
            "value": ttft,
            "threshold": 1.0,
            "met": ttft <= 1.0,
        },
    ]
    rec = [p for p in points if "recompute_vs_bsr_ttft" in p["ratios"]]
    if rec:
        at = next((p for p in rec if p["tokens"] == 8192), max(rec, key=lambda p: p["tokens"]))
        v = at["ratios"]["recompute_vs_bsr_ttft"]
        targets.append(
            {
                "name": "restore_vs_recompute_8k",
                "description": "recompute TTFT / restore TTFT (+ first-token step) at "
                f"{at['tokens']} tokens of the recompute model's own KV layout ({at['layout']})"
                + ("" if at["tokens"] == 8192 else "; 8192 tokens not measured"),
                "value": v,
                "threshold": 10.0,
                "met": v >= 10.0,
            }
        )
    return targets


def _summary(points: Sequence[dict[str, Any]], first: str) -> dict[str, Any]:
    ref = max((p for p in points if p["layout"] == first), key=lambda p: p["tokens"])
    ratios = dict(ref["ratios"])
    rec = [p for p in points if "recompute_vs_bsr_ttft" in p["ratios"]]
    rec_ref = max(rec, key=lambda p: p["tokens"]) if rec else None
    if rec_ref is not None:
        ratios["recompute_vs_bsr_ttft"] = rec_ref["ratios"]["recompute_vs_bsr_ttft"]
    return {
        "reference": {"layout": ref["layout"], "tokens": ref["tokens"]},
        "recompute_reference": (
            None if rec_ref is None else {"layout": rec_ref["layout"], "tokens": rec_ref["tokens"]}
        ),
        "ratios": ratios,
    }


async def _run_async(opts: BenchOptions, ui: BenchUI) -> dict[str, Any]:
    t_start = time.time()
    random.seed(opts.seed)
    np.random.seed(opts.seed)
    torch.manual_seed(opts.seed)
    run = _Run(opts, ui)
    machine = machine_info()
    commit = commit_info()
    run.root = _make_root(opts.path)
    try:
        fs = filesystem_info(run.root)
        run.mode, cache_note = resolve_mode(opts.cache, str(run.root), fs["filesystem"])
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
        # the model, torch and transformers are long-lived: keep them out of every later gc pass
        # (a full collection over them costs ~0.3 s, and the bench collects before each restore)
        gc.collect()
        gc.freeze()
        need = _memory_needed(layouts, opts)
        avail = psutil.virtual_memory().available
        if need > 0.85 * avail:
            raise BenchError(
                f"this run needs about {need / 2**30:.1f} GiB of memory (destination cache + "
                f"whole-plan buffer of the largest state), {avail / 2**30:.1f} GiB is available; "
                "lower --sizes"
            )
        disk_need = max(max(opts.sizes) * n.layout.token_bytes for n in layouts) * 1.05
        disk_free = shutil.disk_usage(run.root).free
        if disk_need > disk_free:
            raise BenchError(
                f"{run.root} has {disk_free / 2**30:.1f} GiB free, the largest state "
                f"needs {disk_need / 2**30:.1f} GiB; lower --sizes or use --path"
            )
        ui.log(
            f"storage {run.root} ({fs['filesystem']}), cache mode {run.mode.value}: {cache_note}"
        )
        n_pairs = sum(1 for w in opts.windows for d in opts.io_depths if d <= w)
        units = sum(1 + len(run.sizes_for(n)) * opts.repeats for n in layouts)
        units += n_pairs * opts.repeats if opts.sweep else 0
        units += 1 + len(opts.sizes) * opts.repeats if model is not None else 0
        ui.start(units)
        rss0 = current_rss()
        for i, named in enumerate(layouts):
            if named.source == "recompute-model":
                continue
            await run.bench_layout(named, sweep=opts.sweep and i == 0, recompute=None)
        recompute_doc: dict[str, Any] | None = None
        if model is not None:
            named = layouts[-1]
            rec_sizes = run.sizes_for(named)
            with run.phase("recompute prefill"):
                measured = run.measure_recompute(model, rec_sizes)
            await run.bench_layout(named, sweep=False, recompute=measured)
            recompute_doc = {
                "model": model.describe(),
                "layout": named.name,
                "compared": (
                    "recompute TTFT = prefill of N random tokens to the first token's logits; "
                    "restore TTFT = BSR restore of N tokens of this model's own KV layout + one "
                    "decode step of the model on an N-token cache"
                ),
                "points": [measured[t] for t in rec_sizes],
            }
            del model
        with run.phase("machinery sections"):
            sections = await run_sections(opts, ui)
    finally:
        gc.unfreeze()
        if not opts.keep:
            shutil.rmtree(run.root, ignore_errors=True)
    try:
        load_end: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_end = None
    machine["load_average_end"] = load_end
    if machine["load_average_start"] and max(machine["load_average_start"]) > 0.5 * (
        machine["cores_logical"] or 1
    ):
        run.warnings.append(
            f"load average {machine['load_average_start']} at start on "
            f"{machine['cores_logical']} cores: other work shared the machine"
        )
    storage = {
        **fs,
        "temporary": opts.path is None,
        "kept": opts.keep,
        "cache_mode": run.mode.value,
        "cache_note": cache_note,
        "direct_io_active": run.direct_active,
        "fsync": True,
        "reader": "posix",
    }
    config = {
        "window": opts.window,
        "io_depth": opts.io_depth,
        "repeats": opts.repeats,
        "block_tokens": 16,
        "device": opts.device,
        "rss_baseline_bytes": rss0,
    }
    doc: dict[str, Any] = {
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
        "summary": _summary(run.points, layouts[0].name),
        "targets": _targets(run, run.points),
        "warnings": run.warnings,
        "phases_s": run.phases,
        "plots": [],
    }
    finish_sections(doc, sections, run.fio, opts.io_depth)
    return doc


def run(opts: BenchOptions, console: Any = None) -> dict[str, Any]:
    """Run the bench, write JSON and plots, print the tables; return the document."""
    from rich.console import Console

    _configure_logging(opts.log_level)
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


def build_parser(prog: str = "bsr bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark bounded-state restoration against whole-plan restore, raw reads "
        "of the same files and recompute.",
    )
    add_arguments(parser)
    return parser


def run_from_namespace(ns: argparse.Namespace) -> int:
    """Entry point once arguments are parsed (used by ``bsr bench``)."""
    if getattr(ns, "hcache", False):  # HCache restore vs KV restore vs recompute
        from .hcache import run_hcache_from_namespace

        return run_hcache_from_namespace(ns)
    if getattr(ns, "engine", "bsr") == "vllm":  # TTFT inside vLLM's CPU engine
        from .vllm_ttft import run_vllm_from_namespace

        return run_vllm_from_namespace(ns)
    if getattr(ns, "l1_ladder", False) or getattr(ns, "tp", None):  # paper scale
        from .paper import run_paper_from_namespace

        return run_paper_from_namespace(ns)
    try:
        opts = resolve(ns)
        run(opts)
    except BenchError as exc:
        print(f"bsr bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/bench.py`` and ``python -m bsr._bench``."""
    return run_from_namespace(build_parser().parse_args(argv))
