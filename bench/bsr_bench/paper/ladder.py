"""``bsr bench --l1-ladder``: which host staging budget each restore strategy needs.

Where it runs: the bench process (CPU), on a FileTier directory (``--path`` or a temporary one);
with ``--lmcache`` also a child process in ``.venv-lmcache`` (see :mod:`.lmcache`).

How it works: the largest state of ``--ladder-sizes`` (dsv4-flash by default, the BSR paper's
per-rank layout) is saved once, chunk by chunk (:class:`~.scale.ChunkedState`); smaller sizes are
its prefixes. For every size and every host staging budget of ``--ladder-budgets`` (the L1 a
server could give to staging), two engines restore it:

* **whole-plan** (``strategy="whole_plan"``, the LMCache-style baseline): stages the whole plan in
  host memory, so a plan larger than the budget must end Invalidated with reason
  ``staging_budget`` before allocating anything, never with an OOM kill or a partial prefix;
* **BSR** (bounded window) with ``W = min(--ladder-max-window, budget // slot_bytes)``: a budget
  below one slot is a :class:`~bsr.ConfigError` when the engine is built; otherwise the restore
  commits with RWS exactly ``W x slot_bytes``.

The budget is the engine's own ``staging_budget_bytes``. Destinations larger than a quarter of
memory are file-backed (:class:`~.scale.Destination`) and labelled so. With LMCache, its side
runs first and its stored state is removed before bsr saves its own. The document (JSON,
validated against ``schema.json``'s ``ladder_document``), a table in the shape of the paper's
and a plot are written.
"""

from __future__ import annotations

import gc
import inspect
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import psutil

from bsr import ConfigError, Reason, RestoreEngine, RestoreResult, Strategy

from ..common.document import validate, write_json
from ..common.layouts import NamedLayout, resolve_layout
from ..common.machine import commit_info, filesystem_info, machine_info
from ..common.memory import release_free_memory
from ..common.stats import BenchError
from .ladder_report import PAPER, ladder_plot, ladder_table
from .options import GIB, MIB, LadderOptions
from .scale import (
    AnonPeak,
    ChunkedState,
    Destination,
    DestinationKind,
    choose_destination,
)


def engine_has_budget() -> bool:
    """Whether this bsr's RestoreEngine enforces ``staging_budget_bytes`` itself."""
    return "staging_budget_bytes" in inspect.signature(RestoreEngine.__init__).parameters


def _budget_reason() -> str:
    reason = getattr(Reason, "STAGING_BUDGET", None)
    return str(reason.value) if reason is not None else "staging_budget"


def bsr_window(budget: int, slot_bytes: int, max_window: int) -> int:
    """W for a budget: as many slots as fit, at most ``max_window`` (0: not even one)."""
    return min(max_window, budget // slot_bytes)


def _engine(
    state: ChunkedState, window: int, io_depth: int, budget: int, *, prefault: bool
) -> RestoreEngine:
    if not engine_has_budget():
        raise BenchError(
            "this bsr's RestoreEngine has no staging_budget_bytes; the ladder needs bsr >= 0.2"
        )
    return RestoreEngine(
        state.layout,
        [state.tier()],
        window=window,
        io_depth=min(io_depth, window),
        namespace=state.namespace,
        prefault_staging=prefault,
        staging_budget_bytes=budget,
    )


def _outcome(
    result: RestoreResult | None,
    *,
    tokens: int,
    strategy: str,
    budget: int,
    window: int | None,
    wall: float | None,
    rss_growth: int | None,
    enforced: str,
    outcome: str | None = None,
    reason: str | None = None,
    message: str = "",
) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "budget_bytes": budget,
        "strategy": strategy,
        "window": window,
        "outcome": outcome or (result.state.value.lower() if result is not None else "skipped"),
        "reason": reason if result is None else result.reason.value,
        "committed_tokens": 0 if result is None else result.committed_tokens,
        "probed_tokens": None if result is None else result.probed_tokens,
        "rws_peak_bytes": 0 if result is None else result.rws_peak_bytes,
        "bytes_read": 0 if result is None else result.bytes_read,
        "invalid_blocks": 0 if result is None else len(result.invalid_block_ids),
        "ttft_s": None if wall is None else round(wall, 4),
        "bandwidth_Bps": None,
        "rss_growth_bytes": rss_growth,
        "budget_enforced_by": enforced,
        "verified": None,
        "message": message,
    }


class _Ladder:
    def __init__(self, opts: LadderOptions, named: NamedLayout, root: Path, log: Any) -> None:
        self.opts = opts
        self.named = named
        self.root = root
        self.log = log
        self.state = ChunkedState(
            named, root, max(opts.sizes), seed=opts.seed, direct_io=opts.direct_io
        )
        self.enforced = "engine"
        self.points: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.verified_full: set[tuple[int, str]] = set()

    async def restore(
        self,
        engine: RestoreEngine,
        dest: Destination,
        tokens: int,
        strategy: Strategy,
    ) -> tuple[RestoreResult, float, int, Any]:
        cache = dest.fresh()
        ids = self.state.identity_ids(tokens)
        release_free_memory()
        with AnonPeak() as peak:
            t0 = time.perf_counter()
            result = await engine.restore(self.state.tokens[:tokens], cache, ids, strategy=strategy)
            wall = time.perf_counter() - t0
        # anonymous memory only: a file-backed destination's written pages are not staging
        return result, wall, peak.growth, cache

    def _check_success(self, point: dict[str, Any], cache: Any, tokens: int, key: str) -> None:
        full = (tokens, key) not in self.verified_full
        self.verified_full.add((tokens, key))
        point["verified"] = self.state.verify(cache, tokens, sample=None if full else 8)
        if not point["verified"]["ok"]:
            raise BenchError(
                f"{key} restore of {tokens} tokens committed bytes that differ from the saved "
                f"state in chunks {point['verified']['mismatched']}"
            )
        if point["ttft_s"]:
            point["bandwidth_Bps"] = round(self.state.state_bytes(tokens) / point["ttft_s"], 1)

    async def whole_plan(self, dest: Destination, tokens: int, budget: int) -> dict[str, Any]:
        plan = self.state.plan_bytes(tokens)
        common: dict[str, Any] = {
            "tokens": tokens,
            "strategy": "whole_plan",
            "budget": budget,
            "window": None,
        }
        avail = psutil.virtual_memory().available
        if plan <= budget and plan + 3 * GIB > avail:
            return _outcome(
                None,
                **common,
                wall=None,
                rss_growth=None,
                enforced=self.enforced,
                outcome="skipped",
                reason="host_memory",
                message=f"the plan ({plan / GIB:.2f} GiB) fits the budget but not this host's "
                f"available memory ({avail / GIB:.2f} GiB); not run to avoid an OOM kill",
            )
        try:  # the engine's own one-slot window must fit the budget too
            engine = _engine(self.state, 1, 1, budget, prefault=False)
        except ConfigError as exc:
            return _outcome(
                None,
                **common,
                wall=None,
                rss_growth=0,
                enforced=self.enforced,
                outcome="config_error",
                reason="config_error",
                message=str(exc),
            )
        async with engine:
            result, wall, growth, cache = await self.restore(
                engine, dest, tokens, Strategy.WHOLE_PLAN
            )
        point = _outcome(result, **common, wall=wall, rss_growth=growth, enforced=self.enforced)
        if result.committed:
            self._check_success(point, cache, tokens, "whole_plan")
        elif result.committed_tokens:
            raise BenchError(f"whole-plan at {tokens} tokens committed a partial prefix")
        return point

    async def bsr(self, dest: Destination, tokens: int, budget: int) -> dict[str, Any]:
        slot = self.state.layout.slot_bytes
        w = bsr_window(budget, slot, self.opts.max_window)
        common: dict[str, Any] = {"tokens": tokens, "strategy": "bsr", "budget": budget}
        try:
            engine = _engine(self.state, max(1, w), self.opts.io_depth, budget, prefault=True)
        except ConfigError as exc:
            return _outcome(
                None,
                **common,
                window=max(1, w),
                wall=None,
                rss_growth=0,
                enforced=self.enforced,
                outcome="config_error",
                reason="config_error",
                message=str(exc),
            )
        async with engine:
            result, wall, growth, cache = await self.restore(engine, dest, tokens, Strategy.BOUNDED)
        point = _outcome(
            result, **common, window=w, wall=wall, rss_growth=growth, enforced=self.enforced
        )
        if not result.committed:
            raise BenchError(
                f"BSR restore of {tokens} tokens at W={w} ended {result.state} ({result.reason})"
            )
        self._check_success(point, cache, tokens, "bsr")
        return point

    async def run(self) -> dict[str, Any]:
        o = self.opts
        avail = psutil.virtual_memory().available
        biggest = self.state.state_bytes(self.state.max_tokens)
        kind = choose_destination(biggest + max(o.budgets), avail, o.destination)
        if kind is DestinationKind.MEMORY and biggest > 0.5 * avail:
            raise BenchError(
                f"a resident destination of {biggest / GIB:.1f} GiB does not fit "
                f"({avail / GIB:.1f} GiB available); use --destination file"
            )
        disk_need = 2 * biggest if kind is DestinationKind.FILE else biggest
        free = shutil.disk_usage(self.root).free
        if disk_need * 1.03 > free:
            raise BenchError(
                f"{self.root} has {free / GIB:.1f} GiB free; the stored state"
                + (
                    " and its file-backed destination need"
                    if kind is DestinationKind.FILE
                    else " needs"
                )
                + f" {disk_need / GIB:.1f} GiB; lower --ladder-sizes or use --path"
            )
        dest = Destination(self.named, self.state.num_blocks, kind, self.root / "destination")
        try:
            self.log(
                f"saving {self.state.max_tokens} tokens ({biggest / GIB:.3f} GiB) chunk by chunk"
            )
            save = await self.state.save(dest.fresh())
            for tokens in sorted(o.sizes):
                for budget in o.budgets:
                    for fn in (self.whole_plan, self.bsr):
                        point = await fn(dest, tokens, budget)
                        self.points.append(point)
                        self.log(_line(point, self.state))
                        gc.collect()
        finally:
            dest.close()
        return {"save": save, "destination": dest.describe()}


def _line(p: dict[str, Any], state: ChunkedState) -> str:
    rws = f"RWS {p['rws_peak_bytes'] / MIB:.2f} MiB" if p["rws_peak_bytes"] else ""
    t = f"{p['ttft_s']:.2f} s" if p["ttft_s"] else ""
    return (
        f"{p['tokens']:>7} tok {state.state_bytes(p['tokens']) / GIB:7.3f} GiB | budget "
        f"{p['budget_bytes'] / GIB:6.3f} GiB | {p['strategy']:<10} W={p['window']} "
        f"{p['outcome']:<12} {p['reason'] or ''} {rws} {t}"
    )


def summarize(points: Sequence[dict[str, Any]], layout: NamedLayout) -> dict[str, Any]:
    """Per state: the smallest budget at which each strategy gave full reuse, and the checks."""
    slot = layout.layout.slot_bytes
    ct = layout.layout.chunk_tokens
    states = []
    for tokens in sorted({p["tokens"] for p in points}):
        row: dict[str, Any] = {
            "tokens": tokens,
            "state_bytes": tokens // ct * layout.layout.chunk_bytes,
            "plan_bytes": tokens // ct * slot,
        }
        for strat in sorted({p["strategy"] for p in points}):
            mine = sorted(
                (p for p in points if p["tokens"] == tokens and p["strategy"] == strat),
                key=lambda p: p["budget_bytes"],
            )
            ok = [
                p for p in mine if p["outcome"] == "committed" and p["committed_tokens"] == tokens
            ]
            row[strat] = {
                "first_full_reuse_budget_bytes": ok[0]["budget_bytes"] if ok else None,
                "rws_peak_bytes": [p["rws_peak_bytes"] for p in ok],
                "outcomes": [p["outcome"] for p in mine],
            }
        states.append(row)
    bsr_ok = [p for p in points if p["strategy"] == "bsr" and p["outcome"] == "committed"]
    rws_dev = max((abs(p["rws_peak_bytes"] - p["window"] * slot) for p in bsr_ok), default=0)
    wp_below = [p for p in points if p["strategy"] == "whole_plan" and p["outcome"] != "committed"]
    invariants = {
        "bsr_rws_equals_w_x_slot": {
            "description": "every BSR success has rws_peak_bytes == W x slot_bytes",
            "checked": len(bsr_ok),
            "max_deviation_bytes": rws_dev,
            "holds": bool(bsr_ok) and rws_dev == 0,
        },
        "whole_plan_fails_cleanly": {
            "description": "every whole-plan restore that did not commit exposed no prefix "
            "(committed_tokens == 0) and, when refused for its budget, staged nothing",
            "checked": len(wp_below),
            "holds": all(
                p["committed_tokens"] == 0
                and (p["reason"] != _budget_reason() or p["rws_peak_bytes"] == 0)
                for p in wp_below
            ),
        },
    }
    return {"states": states, "invariants": invariants}


def run_ladder(opts: LadderOptions, console: Any = None) -> dict[str, Any]:
    """Run the ladder, write JSON (+ plot), print the table; return the document."""
    from rich.console import Console

    console = console or Console(width=200)
    named = resolve_layout(opts.layout)
    t_start = time.time()
    machine = machine_info()
    if opts.path is not None and not Path(opts.path).is_dir():
        raise BenchError(f"--path {opts.path} is not a directory")
    root = Path(tempfile.mkdtemp(prefix="bsr-ladder-", dir=opts.path))
    lad = _Ladder(opts, named, root, lambda m: console.print(m, highlight=False))
    lm_doc: dict[str, Any] | None = None
    try:
        from .lmcache import run_lmcache_ladder

        # LMCache first: its stored state is removed before bsr saves its own, so the disk never
        # holds both (at 524,288 tokens bsr's state and its file-backed destination take 63 GiB)
        lm_doc = run_lmcache_ladder(opts, named, lad.state.max_tokens, root, console)
        lm_points = lm_doc.pop("points", [])
        extra = anyio.run(lad.run)
        lad.points.extend(lm_points)
        fs = filesystem_info(root)
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
    doc: dict[str, Any] = {
        "schema_version": 1,
        "tool": "bsr bench --l1-ladder",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 3),
        "machine": machine,
        "commit": commit_info(),
        "args": opts.to_dict(),
        "argv": sys.argv[1:],
        "seed": opts.seed,
        "storage": {**fs, "direct_io": opts.direct_io, "temporary": opts.path is None},
        "layout": named.to_dict(),
        "budget_enforced_by": lad.enforced,
        "save": extra["save"],
        "destination": extra["destination"],
        "points": lad.points,
        "summary": summarize(lad.points, named),
        "lmcache": lm_doc,
        "paper": PAPER,
        "warnings": lad.warnings + (lm_doc or {}).get("warnings", []),
        "plots": [],
    }
    if not opts.no_plots:
        try:
            doc["plots"] = ladder_plot(doc, Path(opts.plots))
        except Exception as exc:  # the JSON is the record; a plot is a convenience
            doc["warnings"].append(f"plot failed: {exc!r}")
    validate(doc, "ladder_document")
    write_json(doc, Path(opts.json))
    console.print(ladder_table(doc))
    inv = doc["summary"]["invariants"]
    for name, v in inv.items():
        console.print(
            f"invariant {name}: {'holds' if v['holds'] else 'BROKEN'} ({v['description']})"
        )
    for w in doc["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    console.print(f"JSON: {opts.json}  plots: {', '.join(doc['plots']) or '-'}")
    return doc
