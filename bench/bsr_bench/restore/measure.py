"""One run of the default bench, layout by layout: the size series, the sweep and recompute.

How it works, per layout (largest state saved once, smaller sizes are its prefixes):

1. save the state into a :class:`~bsr.FileTier` (temporary directory or ``--path``);
2. for each size and repeat, in a rotating order so drift hits every method alike: raw read of
   the very object files (sequential, and ``io_depth`` threads), probe (``engine.lookup``), BSR
   restore (bounded window), whole-plan restore; every read in the run's page-cache mode;
3. on the first layout, a W x io_depth sweep of BSR restores at one size;
4. the recompute baseline: :meth:`BenchRun.measure_recompute` times the prefill of the same token
   counts, and the model's own KV layout is restored at those counts, so restore and recompute
   hold the same state;
5. with ``--remote mooncake`` (:mod:`.remote`), the state is also saved into a MooncakeTier on a
   loopback cluster started for the layout, and every size's rotation also probes and runs BSR
   and whole-plan restores from it (``results[].remote``); the cluster stops with the layout.

Every point is a dictionary in the shape of ``schema.json``'s ``results[]``; :mod:`.program`
assembles the document around them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bsr import Strategy

from ..common.layouts import NamedLayout
from ..common.pagecache import CacheMode, prepare
from ..common.raw import RawRead, RawReader
from ..common.stats import BenchError, Dist, ratio
from .options import BenchOptions
from .recompute import Recompute
from .remote import RemoteCluster, RemoteSizing, start_remote
from .sections import FioSetup
from .state import OpenEngine, RestoreSample, SavedState
from .ui import BenchUI


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
        "settle_s": _dist([s.settle_s for s in samples]),
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


@dataclass(frozen=True)
class _Engines:
    """The open engines a size is measured with: BSR and whole-plan on the file tier, and the
    same pair on the remote tier with ``--remote``."""

    bsr: OpenEngine
    wp: OpenEngine
    remote: tuple[OpenEngine, OpenEngine] | None = None


@dataclass
class _RawSamples:
    """Raw reads of a size's files over the repeats, sequential and ``io_depth`` threads, with
    the resident fraction before each."""

    seq: list[RawRead] = field(default_factory=list)
    par: list[RawRead] = field(default_factory=list)
    res_seq: list[float | None] = field(default_factory=list)
    res_par: list[float | None] = field(default_factory=list)

    def step(
        self, mode: CacheMode, files: Sequence[str], seq: RawReader, par: RawReader
    ) -> Callable[[], Any]:
        """The rotation's raw-read step: both readers, each after the cache mode's preparation."""

        async def do_raw() -> None:
            self.res_seq.append(prepare(mode, files))
            self.seq.append(seq.read(files))
            self.res_par.append(prepare(mode, files))
            self.par.append(par.read(files))

        return do_raw

    def to_json(self) -> dict[str, Any]:
        """``raw.sequential`` and ``raw.parallel`` of the point."""
        return {
            "sequential": _raw_json(self.seq, self.res_seq),
            "parallel": _raw_json(self.par, self.res_par),
        }


@dataclass
class _Restores:
    """One tier's probes, BSR and whole-plan restores over the repeats of a size, and the
    results of the byte checks (the first BSR and the first whole-plan restore of the largest
    size)."""

    probes: list[float] = field(default_factory=list)
    bsr: list[RestoreSample] = field(default_factory=list)
    wp: list[RestoreSample] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)

    def steps(
        self,
        state: SavedState,
        tokens: int,
        bsr: OpenEngine,
        wp: OpenEngine,
        files: list[str] | None,
        verify: bool,
    ) -> list[Callable[[], Any]]:
        """The rotation's two steps: probe + BSR restore, and whole-plan restore; ``files``
        None for a remote tier."""

        async def do_bsr() -> None:
            self.probes.append(await state.probe(bsr, tokens))
            if verify and not self.ok:
                state.clear_cache()
            self.bsr.append(await state.restore(bsr, tokens, Strategy.BOUNDED, files))
            if verify and len(self.ok) == 0:
                self.ok.append(state.verify())

        async def do_wp() -> None:
            if verify and len(self.ok) == 1:
                state.clear_cache()
            self.wp.append(await state.restore(wp, tokens, Strategy.WHOLE_PLAN, files))
            if verify and len(self.ok) == 1:
                self.ok.append(state.verify())

        return [do_bsr, do_wp]


class BenchRun:
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
        #: per layout: the FileTier's reader and read depth (``storage.read`` in the JSON)
        self.reads: dict[str, dict[str, Any]] = {}
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
        """Save ``named``'s largest state, measure every size (and the sweep), remove it."""
        o = self.opts
        sizes = self.sizes_for(named)
        state = SavedState(
            named, self.root, max(sizes), seed=o.seed, mode=self.mode, device=o.device
        )
        self._warn_below_window(named, sizes)
        stack = ExitStack()
        opened: list[OpenEngine] = []
        seq_reader: RawReader | None = None
        par_reader: RawReader | None = None
        try:
            remote = self._start_remote(named, state, stack)
            self.ui.step(f"save {named.name} ({state.max_tokens} tokens)", 1)
            with self.phase(f"save {named.name}"):
                save = await state.save(remote.tier() if remote is not None else None)
            self.ui.advance()
            if state.read_calibration is not None:
                self.reads[named.name] = state.read_calibration
            max_file = max(_sizes(state.files(named.layout.chunk_tokens)))
            direct = self.mode is CacheMode.DIRECT
            seq_reader = RawReader(max_file, 1, direct=direct)
            par_reader = RawReader(max_file, o.io_depth, direct=direct)
            engines = await self._open_engines(state, remote, opened)
            readers = (seq_reader, par_reader)
            for tokens in sizes:
                self.ui.step(f"{named.name} {tokens} tokens", o.repeats)
                with self.phase(f"measure {named.name}"):
                    point = await self._measure_size(
                        state, tokens, engines, readers, save.duration_s
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

    def _warn_below_window(self, named: NamedLayout, sizes: Sequence[int]) -> None:
        """Warn about every size of fewer than W chunks (its BSR RWS is the whole state)."""
        ct = named.layout.chunk_tokens
        for t in sizes:
            if t // ct < self.opts.window:
                self.warn(
                    f"{named.name}: {t} tokens are {t // ct} chunks < W="
                    f"{self.opts.window}; BSR RWS there is the whole state, not W x chunk"
                )

    def _start_remote(
        self, named: NamedLayout, state: SavedState, stack: ExitStack
    ) -> RemoteCluster | None:
        """The loopback remote store of ``--remote`` (stopped by ``stack``), or None."""
        o = self.opts
        if o.remote == "none":
            return None
        self.ui.log(f"starting a loopback {o.remote} store for {named.name}")
        with self.phase(f"start remote {named.name}"):
            sizing = RemoteSizing.for_state(named.layout, state.max_tokens, o.io_depth)
            remote = stack.enter_context(start_remote(sizing, o.remote))
        self.remote_info = remote.describe()
        self.remote_segment_bytes = sizing.segment_bytes
        return remote

    async def _open_engines(
        self, state: SavedState, remote: RemoteCluster | None, opened: list[OpenEngine]
    ) -> _Engines:
        """The BSR and whole-plan engines on the file tier (and on the remote tier, if any),
        each appended to ``opened`` as soon as it is open."""
        o = self.opts
        bsr = await state.open_engine(o.window, o.io_depth, prefault=True)
        opened.append(bsr)
        wp = await state.open_engine(o.window, o.io_depth, prefault=False)
        opened.append(wp)
        if remote is None:
            return _Engines(bsr, wp)
        rb = await state.open_engine(o.window, o.io_depth, prefault=True, tier=remote.tier())
        opened.append(rb)
        rw = await state.open_engine(o.window, o.io_depth, prefault=False, tier=remote.tier())
        opened.append(rw)
        return _Engines(bsr, wp, (rb, rw))

    async def _measure_size(
        self,
        state: SavedState,
        tokens: int,
        engines: _Engines,
        readers: tuple[RawReader, RawReader],
        save_s: float,
    ) -> dict[str, Any]:
        """One size's point: the rotation of every method over the repeats, then its JSON."""
        o = self.opts
        files = state.files(tokens)
        file_bytes = sum(_sizes(files))
        verify = tokens == state.max_tokens
        raw = _RawSamples()
        local = _Restores()
        remote = _Restores()
        steps: list[Callable[[], Any]] = [
            raw.step(self.mode, files, *readers),
            *local.steps(state, tokens, engines.bsr, engines.wp, files, verify),
        ]
        fio_step = self.fio.step(self.mode, files, file_bytes, source=state.named.source)
        if fio_step is not None:
            steps.append(fio_step)
        if engines.remote is not None:
            steps += remote.steps(state, tokens, *engines.remote, None, verify)
        for r in range(o.repeats):
            k = r % len(steps)
            for fn in steps[k:] + steps[:k]:
                await fn()
            self.ui.advance()
        if verify:
            self._check_verified(state, local, remote if engines.remote is not None else None)
        point = self._point_json(state, tokens, files, file_bytes, save_s, raw, local)
        if engines.remote is not None:
            b, w = point["bsr"], point["whole_plan"]
            point["remote"] = self._remote_json(
                state, file_bytes, b, w, remote.probes, remote.bsr, remote.wp
            )
        if fio_step is not None:
            fio_step.attach(point)
        return point

    def _check_verified(
        self, state: SavedState, local: _Restores, remote: _Restores | None
    ) -> None:
        """Record whether the verified restores gave back the saved bytes; raise if not."""
        name = state.named.name
        self.verified[name] = all(local.ok) and len(local.ok) == 2
        if not self.verified[name]:
            raise BenchError(f"{name}: restored bytes differ from the saved ones")
        if remote is not None:
            key = f"{name} (remote {self.opts.remote})"
            self.verified[key] = all(remote.ok) and len(remote.ok) == 2
            if not self.verified[key]:
                raise BenchError(
                    f"{name}: bytes restored from {self.opts.remote} differ from the saved ones"
                )

    def _point_json(
        self,
        state: SavedState,
        tokens: int,
        files: Sequence[str],
        file_bytes: int,
        save_s: float,
        raw_samples: _RawSamples,
        local: _Restores,
    ) -> dict[str, Any]:
        """A size's point (``results[]`` of the schema) from its file-tier samples."""
        o = self.opts
        raw = raw_samples.to_json()
        seq_bw = raw["sequential"]["bandwidth_Bps"]["median"]
        par_bw = raw["parallel"]["bandwidth_Bps"]["median"]
        best_bw = max(seq_bw, par_bw)
        b = _restore_json(local.bsr, file_bytes, o.window, o.io_depth)
        w = _restore_json(local.wp, file_bytes, o.window, o.io_depth)
        lay = state.layout
        return {
            "layout": state.named.name,
            "tokens": tokens,
            "chunks": tokens // lay.chunk_tokens,
            "state_bytes": tokens * lay.token_bytes,
            "files": len(files),
            "file_bytes": file_bytes,
            "slot_bytes": lay.slot_bytes,
            "matched_recompute": state.named.source == "recompute-model",
            "save_s": save_s,
            "probe_s": _dist(local.probes),
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
        }

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
