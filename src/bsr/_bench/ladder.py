"""``bsr bench --l1-ladder``: which host staging budget each restore strategy needs.

Where it runs: the bench process (CPU), on a FileTier directory (``--path`` or a temporary one);
with ``--lmcache`` also a child process in ``.venv-lmcache`` (see :mod:`.lmcache_baseline`).

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

import argparse
import gc
import inspect
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import psutil

from bsr import ConfigError, Reason, RestoreEngine, RestoreResult, Strategy

from .layouts import NamedLayout, resolve_layout
from .machine import commit_info, filesystem_info, machine_info
from .memory import release_free_memory
from .scale import (
    BLOCK_TOKENS,
    AnonPeak,
    ChunkedState,
    Destination,
    DestinationKind,
    choose_destination,
)
from .stats import BenchError

GIB = 1 << 30
MIB = 1 << 20
#: the paper's states: 1.956 / 7.823 / 15.646 GiB of dsv4-flash per rank
DEFAULT_LADDER_TOKENS = (32768, 131072, 262144)
DEFAULT_BUDGETS = tuple(int(g * GIB) for g in (0.25, 0.5, 1, 2, 4, 8, 16))
#: what the BSR paper reports (DeepSeek-V4-Flash, TP=2, per rank): LMCache's whole-plan
#: retrieve first succeeds at this L1 size; BSR's RWS is 500.75 MiB at W=32 for every state
PAPER: dict[str, Any] = {
    "source": "BSR paper, headline table (DeepSeek-V4-Flash, 16,408,576 B per 256-token chunk "
    "per rank, TP=2)",
    "bsr_rws_bytes": 32 * 16_408_576,
    "bsr_window": 32,
    "states": [
        {"tokens": 32768, "state_gib": 1.956, "lmcache_first_success_gib": 2},
        {"tokens": 131072, "state_gib": 7.823, "lmcache_first_success_gib": 8},
        {"tokens": 262144, "state_gib": 15.646, "lmcache_first_success_gib": 16},
        {"tokens": 524288, "state_gib": 31.277, "lmcache_first_success_gib": None},
    ],
}
_UNITS = {"b": 1, "kib": 1 << 10, "mib": MIB, "gib": GIB, "k": 1 << 10, "m": MIB, "g": GIB}


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"0.25,0.5,1"`` (GiB) or with units ``"64MiB,1GiB,4096B"`` -> bytes, ascending."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low = part.lower()
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if low.endswith(u)), None)
        num = low[: -len(unit)] if unit else low
        try:
            value = float(num) * (_UNITS[unit] if unit else GIB)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected budgets like 0.25,1,16 (GiB) or 64MiB,1GiB, got {part!r}"
            ) from None
        if not math.isfinite(value) or value < 1:
            raise argparse.ArgumentTypeError(f"a budget must be at least 1 byte, got {part!r}")
        out.append(int(value))
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one budget, got {text!r}")
    return tuple(sorted(set(out)))


def add_ladder_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--l1-ladder`` flags (called from :func:`.options.add_arguments`)."""
    g = p.add_argument_group("paper scale (--l1-ladder, --tp)")
    g.add_argument(
        "--l1-ladder",
        action="store_true",
        help="instead of the default bench: restore states of growing size whole-plan and BSR "
        "under host staging budgets (see bench/README.md, 'Paper scale')",
    )
    g.add_argument(
        "--ladder-sizes",
        default=None,
        help="state sizes in tokens for --l1-ladder / --tp (default 32768,131072,262144: the "
        "paper's 1.956/7.823/15.646 GiB of dsv4-flash; 524288 is its 31.28 GiB point)",
    )
    g.add_argument(
        "--ladder-budgets",
        type=parse_budgets,
        default=None,
        help="host staging budgets, GiB or with units (default 0.25,0.5,1,2,4,8,16)",
    )
    g.add_argument(
        "--ladder-max-window",
        type=int,
        default=32,
        help="BSR uses W = min(this, budget // slot_bytes) (default 32, as in the paper)",
    )
    g.add_argument(
        "--destination",
        choices=("auto", "memory", "file"),
        default="auto",
        help="destination of --l1-ladder / --tp restores: resident memory, a file-backed "
        "(mmap) cache, or auto: file once the state exceeds a quarter of memory",
    )
    g.add_argument(
        "--lmcache",
        choices=("auto", "off", "require"),
        default="auto",
        help="--l1-ladder: also run LMCache 0.5.6's whole-plan retrieve side by side from "
        ".venv-lmcache (make lmcache-venv); auto skips it with a note when the venv is absent",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="instead of the default bench: N ranks (processes, gloo) restore their shards and "
        "agree on prefix and commit; reports per-rank RWS, agreement overhead and a fault case",
    )


@dataclass(frozen=True)
class LadderOptions:
    """Resolved options of one ``--l1-ladder`` run (recorded in the JSON under ``args``)."""

    layout: str
    sizes: tuple[int, ...]
    budgets: tuple[int, ...]
    max_window: int
    io_depth: int
    path: str | None
    keep: bool
    destination: str
    direct_io: bool
    lmcache: str
    seed: int
    json: str
    plots: str
    no_plots: bool
    quick: bool

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x.replace("_", "")) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchError(
            f"--ladder-sizes: expected comma-separated integers, got {text!r}"
        ) from None
    if not vals or min(vals) < 1:
        raise BenchError(f"--ladder-sizes: expected positive integers, got {text!r}")
    return tuple(sorted(set(vals)))


def resolve_ladder(ns: argparse.Namespace) -> LadderOptions:
    """Options of a ladder run from the parsed ``bsr bench`` flags."""
    quick = bool(ns.quick)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    layouts = ns.layout or ["dsv4-flash"]
    if len(layouts) != 1:
        raise BenchError("--l1-ladder restores one layout; pass --layout once")
    sizes = (
        _ints(ns.ladder_sizes)
        if ns.ladder_sizes
        else ((1024, 4096) if quick else DEFAULT_LADDER_TOKENS)
    )
    budgets = ns.ladder_budgets or (
        tuple(int(x * MIB) for x in (8, 32, 64)) if quick else DEFAULT_BUDGETS
    )
    if ns.ladder_max_window < 1:
        raise BenchError(f"--ladder-max-window must be >= 1, got {ns.ladder_max_window}")
    return LadderOptions(
        layout=layouts[0],
        sizes=sizes,
        budgets=budgets,
        max_window=ns.ladder_max_window,
        io_depth=ns.io_depth or 8,
        path=ns.path,
        keep=bool(ns.keep),
        destination=ns.destination,
        direct_io=ns.cache in ("auto", "direct"),
        lmcache=ns.lmcache,
        seed=int(ns.seed),
        quick=quick,
        json=ns.json or f"bench/results/ladder-{stamp}.json",
        plots=ns.plots or "bench/results",
        no_plots=bool(ns.no_plots),
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


def ladder_table(doc: dict[str, Any]) -> Any:
    """The paper-shaped table: per state, the first budget with full reuse, and BSR's RWS."""
    from rich.table import Table

    paper = {s["tokens"]: s for s in PAPER["states"]}
    lm = any(r.get("lmcache") for r in doc["summary"]["states"])
    t = Table(title="L1 ladder: smallest host staging budget with full reuse (this run | paper)")
    for col in (
        "tokens",
        "state",
        "whole-plan (bsr)",
        *(["LMCache 0.5.6"] if lm else []),
        "paper: LMCache",
        "BSR",
        "BSR RWS (W)",
        "paper: BSR RWS",
    ):
        t.add_column(col, justify="right")
    for row in doc["summary"]["states"]:
        p = paper.get(row["tokens"])

        def first(strat: str, row: dict[str, Any] = row) -> str:
            d = row.get(strat)
            if not d:
                return "-"
            b = d["first_full_reuse_budget_bytes"]
            return "none" if b is None else f"{b / GIB:g} GiB"

        bsr_pts = [
            x
            for x in doc["points"]
            if x["tokens"] == row["tokens"]
            and x["strategy"] == "bsr"
            and x["outcome"] == "committed"
        ]
        rws = (
            f"{max(x['rws_peak_bytes'] for x in bsr_pts) / MIB:.2f} MiB "
            f"(W={max(x['window'] for x in bsr_pts)})"
            if bsr_pts
            else "-"
        )
        lmc = p["lmcache_first_success_gib"] if p else None
        t.add_row(
            str(row["tokens"]),
            f"{row['state_bytes'] / GIB:.3f} GiB",
            first("whole_plan"),
            *([first("lmcache")] if lm else []),
            "-" if p is None else ("not reported" if lmc is None else f"{lmc} GiB"),
            first("bsr"),
            rws,
            f"{PAPER['bsr_rws_bytes'] / MIB:.2f} MiB (W=32)" if p else "-",
        )
    return t


def _gib(b: float) -> str:
    return f"{b / GIB:g} GiB" if b >= GIB // 4 else f"{b / MIB:g} MiB"


def ladder_markdown(doc: dict[str, Any]) -> str:
    """The paper-shaped table and the full state x budget grid, as Markdown (README)."""
    paper = {s["tokens"]: s for s in PAPER["states"]}
    lm = any(p["strategy"] == "lmcache" for p in doc["points"])
    head = ["tokens", "state", "whole-plan (bsr): first full reuse at"]
    head += ["LMCache 0.5.6: first full reuse at"] if lm else []
    head += ["paper: LMCache", "BSR: first full reuse at", "BSR RWS", "paper: BSR RWS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in doc["summary"]["states"]:
        p = paper.get(row["tokens"])

        def first(strat: str, row: dict[str, Any] = row) -> str:
            d = row.get(strat)
            if not d:
                return "-"
            b = d["first_full_reuse_budget_bytes"]
            if b is None:
                tried = [
                    x
                    for x in doc["points"]
                    if x["tokens"] == row["tokens"] and x["strategy"] == strat
                ]
                why = sorted(
                    {x["reason"] or x["outcome"] for x in tried if x["outcome"] != "committed"}
                )
                return "none (" + ", ".join(w[:40] for w in why) + ")"
            return _gib(b)

        ok = [
            x
            for x in doc["points"]
            if x["tokens"] == row["tokens"]
            and x["strategy"] == "bsr"
            and x["outcome"] == "committed"
        ]
        w_max = max((x["window"] for x in ok), default=0)
        top = max((x["rws_peak_bytes"] for x in ok if x["window"] == w_max), default=0)
        rws = f"{top / MIB:.2f} MiB (W={w_max})" if ok else "-"
        lmc = p["lmcache_first_success_gib"] if p else None
        cells = [str(row["tokens"]), f"{row['state_bytes'] / GIB:.3f} GiB", first("whole_plan")]
        cells += [first("lmcache")] if lm else []
        cells += [
            "-" if p is None else ("BSR only" if lmc is None else f"{lmc} GiB"),
            first("bsr"),
            rws,
            f"{PAPER['bsr_rws_bytes'] / MIB:.2f} MiB (W=32)" if p else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    budgets = sorted({p["budget_bytes"] for p in doc["points"]})
    grid = [
        "",
        "| tokens \\ budget | " + " | ".join(_gib(b) for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    mark = {
        "committed": "ok",
        "invalidated": "inv",
        "config_error": "cfg",
        "skipped": "skip",
        "failed": "FAIL",
        "partial": "part",
    }
    strategies = [
        s
        for s in ("whole_plan", "lmcache", "bsr")
        if any(p["strategy"] == s for p in doc["points"])
    ]
    short = {"whole_plan": "WP", "lmcache": "LMC", "bsr": "BSR"}
    for tokens in sorted({p["tokens"] for p in doc["points"]}):
        cells = []
        for b in budgets:
            parts = []
            for strat in strategies:
                pt = next(
                    (
                        p
                        for p in doc["points"]
                        if p["tokens"] == tokens
                        and p["budget_bytes"] == b
                        and p["strategy"] == strat
                    ),
                    None,
                )
                if pt is None:
                    continue
                tag = mark.get(pt["outcome"], pt["outcome"])
                if strat == "bsr" and pt["outcome"] == "committed":
                    tag += f" W={pt['window']}"
                if pt["ttft_s"] and pt["outcome"] == "committed":
                    tag += f" {pt['ttft_s']:.1f}s"
                parts.append(f"{short[strat]} {tag}")
            cells.append("<br>".join(parts))
        grid.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines + grid) + "\n"


def ladder_plot(doc: dict[str, Any], directory: Path) -> list[str]:
    """l1_ladder.png: staging used per state and budget; failures marked at the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    sizes = sorted({p["tokens"] for p in doc["points"]})
    strategies = [
        s
        for s in ("whole_plan", "lmcache", "bsr")
        if any(p["strategy"] == s for p in doc["points"])
    ]
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.8), squeeze=False)
    style = {
        "whole_plan": ("s--", "whole-plan (bsr)"),
        "lmcache": ("v-.", "LMCache 0.5.6"),
        "bsr": ("o-", "BSR"),
    }
    color = {"whole_plan": "C0", "lmcache": "C2", "bsr": "C4"}
    for ax, tokens in zip(axes[0], sizes):
        for s in strategies:
            pts = sorted(
                (p for p in doc["points"] if p["tokens"] == tokens and p["strategy"] == s),
                key=lambda p: p["budget_bytes"],
            )
            ok = [p for p in pts if p["outcome"] == "committed"]
            bad = [p for p in pts if p["outcome"] not in ("committed", "skipped")]
            fmt, label = style[s]

            def held(p: dict[str, Any]) -> float:
                # LMCache reports no staging peak: what its retrieve held is its RSS growth
                return float(p["rws_peak_bytes"] or p.get("rss_growth_bytes") or 0) / GIB

            ax.plot(
                [p["budget_bytes"] / GIB for p in ok],
                [held(p) for p in ok],
                fmt,
                color=color[s],
                label=f"{label}: committed (staging held)",
            )
            if bad:
                ax.plot(
                    [p["budget_bytes"] / GIB for p in bad],
                    [0.0] * len(bad),
                    "x",
                    ms=9,
                    color=color[s],
                    label=f"{label}: "
                    + ("blocked (waits for L1 forever)" if s == "lmcache" else "refused cleanly"),
                )
        ax.plot(
            [
                min(p["budget_bytes"] for p in doc["points"]) / GIB,
                max(p["budget_bytes"] for p in doc["points"]) / GIB,
            ],
            [
                min(p["budget_bytes"] for p in doc["points"]) / GIB,
                max(p["budget_bytes"] for p in doc["points"]) / GIB,
            ],
            "k:",
            lw=0.8,
            label="budget",
        )
        st = tokens // doc["layout"]["chunk_tokens"] * doc["layout"]["chunk_bytes"]
        ax.set_title(f"{tokens} tokens ({st / GIB:.3f} GiB)", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("host staging budget (GiB)")
        ax.set_ylabel("RWS (GiB)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"L1 ladder ({doc['layout']['name']}): staging used vs budget")
    fig.tight_layout()
    path = directory / "l1_ladder.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def validate_document(doc: dict[str, Any], definition: str) -> None:
    """Check a paper-scale document against ``schema.json``'s ``$defs/<definition>``."""
    import jsonschema

    from .report import load_schema

    schema = load_schema()
    sub = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": f"#/$defs/{definition}"}
    try:
        jsonschema.validate(doc, sub)
    except jsonschema.ValidationError as exc:
        path = "/".join(str(x) for x in exc.absolute_path)
        raise BenchError(
            f"{definition} JSON does not match schema.json at /{path}: {exc.message}"
        ) from exc


def run_ladder(opts: LadderOptions, console: Any = None) -> dict[str, Any]:
    """Run the ladder, write JSON (+ plot), print the table; return the document."""
    from rich.console import Console

    from .report import write_json

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
        from .lmcache_baseline import run_lmcache_ladder

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
    validate_document(doc, "ladder_document")
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


__all__ = (
    "BLOCK_TOKENS",
    "DEFAULT_BUDGETS",
    "DEFAULT_LADDER_TOKENS",
    "PAPER",
    "LadderOptions",
    "add_ladder_arguments",
    "bsr_window",
    "engine_has_budget",
    "parse_budgets",
    "resolve_ladder",
    "run_ladder",
    "summarize",
)
