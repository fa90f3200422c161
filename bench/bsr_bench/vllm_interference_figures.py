"""The interference section's figures, targets and table (pure functions of the raw rounds).

A round's record (:mod:`.vllm_interference_child`) holds the timestamps of every token the
decoders got, in seconds from the new request's arrival, and its TTFT; everything here is derived
from those, so a committed result can be checked against its own raw data.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from .common.stats import BenchError, Dist

GIB = 1 << 30


def round_figures(rnd: dict[str, Any]) -> dict[str, Any]:
    """The figures of one round from its raw timestamps (seconds from the arrival).

    ``before``: every inter-token gap of every decoder that ended at or before the arrival;
    ``during``: every gap that ends after the arrival and starts before the new request's first
    token (the gap that spans the arrival and the one that ends with the first token included).
    ``delay_during_s``: how much later than at its p50 pace before the arrival each decoder got
    its tokens of the window (the sum of its during gaps minus that many p50 gaps), median over
    the decoders: a stall spread over several slow steps counts whole here, not only its
    largest step.
    """
    ttft = float(rnd["ttft_s"])
    before: list[float] = []
    during: list[list[float]] = []
    for stamps in rnd["decoders"]:
        mine: list[float] = []
        for a, b in itertools.pairwise(stamps):
            if b <= 0.0:
                before.append(b - a)
            elif a < ttft:
                mine.append(b - a)
        during.append(mine)
    flat = [g for gaps in during for g in gaps]
    if not before or not all(during):
        raise BenchError(
            "a round has no decoder token before the arrival or none during its window: "
            f"{len(before)} gaps before, {len(flat)} during"
        )
    p50 = float(statistics.median(before))
    return {
        "itl_p50_before_s": p50,
        "max_gap_during_s": max(flat),
        "itl_p50_during_s": float(statistics.median(flat)),
        "delay_during_s": float(statistics.median(sum(g) - p50 * len(g) for g in during)),
        "ttft_s": ttft,
    }


FIGURES = ("itl_p50_before_s", "max_gap_during_s", "itl_p50_during_s", "delay_during_s", "ttft_s")


def _dists(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    figs = [round_figures(r) for r in rounds]
    out: dict[str, Any] = {k: Dist.of([f[k] for f in figs]).to_dict() for k in FIGURES}
    out["cached_tokens"] = [r.get("cached_tokens") for r in rounds]
    return out


def summarize(
    name: str, result: dict[str, Any], load: str | None, store: str | None, prefix_tokens: int
) -> dict[str, Any]:
    """One variant's figures: its rounds, its local-hit rounds, the stall its loads add.

    ``load`` is the connector's mode (None: no connector, the prefix is recomputed), ``store``
    the page-cache state of its reads; every local-hit round must have hit ``prefix_tokens``
    in vLLM's cache, and every variant round too when it loads (``hits_as_expected``).
    """
    measured = [r for r in result["rounds"] if not r.get("warmup")]
    mine = [r for r in measured if r["kind"] == "variant"]
    local = [r for r in measured if r["kind"] == "local_hit"]
    if not mine or not local:
        raise BenchError(f"{name}: no measured variant or local-hit round")
    v, base = _dists(mine), _dists(local)
    added = v["max_gap_during_s"]["median"] - base["max_gap_during_s"]["median"]
    added_delay = v["delay_during_s"]["median"] - base["delay_during_s"]["median"]
    paired = [
        round_figures(b)["max_gap_during_s"] - round_figures(a)["max_gap_during_s"]
        for a, b in zip(local, mine)
    ]
    expected_hit = prefix_tokens if load is not None else 0
    return {
        "variant": name,
        "load": load,
        "store": store,
        "rounds": v,
        "local_hit_rounds": base,
        "added_stall_s": added,
        "added_stall_paired_s": Dist.of(paired).to_dict(),
        "added_delay_s": added_delay,
        "ttft_vs_local_hit": v["ttft_s"]["median"] / base["ttft_s"]["median"],
        "resident_fraction": [r.get("resident_fraction") for r in mine],
        "hits_as_expected": all(r.get("cached_tokens") == expected_hit for r in mine)
        and all(r.get("cached_tokens") == prefix_tokens for r in local),
        "engine_start_s": result.get("start_s"),
        "load_average": result.get("load_average"),
        "raw_rounds": result["rounds"],
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not (math.isfinite(num) and math.isfinite(den)):
        return None
    return num / den if den > 0 else None


def _target(
    variants: dict[str, dict[str, Any]],
    name: str,
    desc: str,
    value: float | None,
    threshold: float,
    at_most: bool,
    needs: tuple[str, ...],
    detail: str,
) -> dict[str, Any]:
    missing = [n for n in needs if n not in variants]
    met: bool | None = None
    if missing:
        detail = f"not run: needs {', '.join(missing)}"
    elif value is None:
        detail = f"not measurable: {detail}"
    else:
        met = value <= threshold if at_most else value >= threshold
    return {
        "name": name,
        "description": desc,
        "value": value,
        "threshold": threshold,
        "comparison": "<=" if at_most else ">=",
        "met": met,
        "detail": detail,
    }


def _stall(variants: dict[str, dict[str, Any]], name: str) -> float | None:
    v = variants.get(name)
    return None if v is None else float(v["added_stall_s"])


def _ttft(variants: dict[str, dict[str, Any]], name: str) -> float | None:
    v = variants.get(name)
    return None if v is None else float(v["rounds"]["ttft_s"]["median"])


def targets(variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each met / missed with its figures (``met`` None: not measurable).

    * ``async_added_stall_cold_s``: async's added stall, cold store, <= 0.05 s;
    * ``async_vs_sync_added_stall_{cold,warm}``: async's / sync's added stall <= 0.10 (not
      measurable where sync adds no stall);
    * ``async_vs_sync_ttft_{cold,warm}``: async / sync TTFT <= 1.2;
    * ``recompute_vs_async_ttft_{cold,warm}``: recompute / async TTFT >= 10.
    """
    a = _stall(variants, "async_cold")
    out = [
        _target(
            variants,
            "async_added_stall_cold_s",
            "stall an async load adds to the decoders, cold store (s)",
            a,
            0.05,
            at_most=True,
            needs=("async_cold",),
            detail=f"async cold {_fmt(a)} s over its local-hit baseline",
        )
    ]
    for store in ("cold", "warm"):
        a, s = _stall(variants, f"async_{store}"), _stall(variants, f"sync_{store}")
        out.append(
            _target(
                variants,
                f"async_vs_sync_added_stall_{store}",
                f"async's / sync's added stall, {store} store",
                _ratio(a, s) if s is not None and s > 0 else None,
                0.10,
                at_most=True,
                needs=(f"async_{store}", f"sync_{store}"),
                detail=f"async {_fmt(a)} s, sync {_fmt(s)} s"
                + ("" if s is None or s > 0 else " (sync adds no stall here)"),
            )
        )
    for store in ("cold", "warm"):
        a, s = _ttft(variants, f"async_{store}"), _ttft(variants, f"sync_{store}")
        out.append(
            _target(
                variants,
                f"async_vs_sync_ttft_{store}",
                f"async / sync TTFT, {store} store",
                _ratio(a, s),
                1.2,
                at_most=True,
                needs=(f"async_{store}", f"sync_{store}"),
                detail=f"async {_fmt(a)} s, sync {_fmt(s)} s",
            )
        )
    for store in ("cold", "warm"):
        r, a = _ttft(variants, "recompute"), _ttft(variants, f"async_{store}")
        out.append(
            _target(
                variants,
                f"recompute_vs_async_ttft_{store}",
                f"recompute / async TTFT, {store} store",
                _ratio(r, a),
                10.0,
                at_most=False,
                needs=("recompute", f"async_{store}"),
                detail=f"recompute {_fmt(r)} s, async {_fmt(a)} s",
            )
        )
    return out


def ratios(variants: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Ratios of medians measured in this run, side by side (None where a variant did not run)."""
    out: dict[str, float | None] = {}
    rec = _ttft(variants, "recompute")
    for store in ("cold", "warm"):
        a, s = _ttft(variants, f"async_{store}"), _ttft(variants, f"sync_{store}")
        out[f"sync_vs_async_ttft_{store}"] = _ratio(s, a)
        out[f"recompute_vs_async_ttft_{store}"] = _ratio(rec, a)
        out[f"recompute_vs_sync_ttft_{store}"] = _ratio(rec, s)
        out[f"sync_vs_async_added_stall_{store}"] = _ratio(
            _stall(variants, f"sync_{store}"), _stall(variants, f"async_{store}")
        )
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


# --------------------------------------------------------------------------- the table
def print_table(section: dict[str, Any]) -> None:
    """The interference table, then the targets."""
    p = section["plan"]
    print(
        f"\nInterference: {p['decoders']} requests decoding, then a request whose prompt is a "
        f"stored {p['prefix_tokens']}-token prefix ({section['prefix_bytes'] / GIB:.2f} GiB of KV) "
        f"+ {p['new_tokens']} new tokens arrives; medians of {p['arrivals']} arrivals (s)"
    )
    print(
        f"{'variant':>11} {'ITL p50':>8} {'max gap':>8} {'local-hit':>9} {'added':>7} "
        f"{'delay+':>7} {'TTFT':>7} {'local TTFT':>10} {'load':>5}"
    )
    for name, v in section["variants"].items():
        r, b = v["rounds"], v["local_hit_rounds"]
        load = (v.get("load_average") or [None])[0]
        print(
            f"{name:>11} {r['itl_p50_before_s']['median']:>8.3f} "
            f"{r['max_gap_during_s']['median']:>8.3f} {b['max_gap_during_s']['median']:>9.3f} "
            f"{v['added_stall_s']:>7.3f} {v['added_delay_s']:>7.3f} {r['ttft_s']['median']:>7.3f} "
            f"{b['ttft_s']['median']:>10.3f} {'-' if load is None else f'{load[0]:.1f}':>5}"
        )
    print(
        "ITL p50: the decoders' before the arrival; max gap: their largest inter-token gap in the "
        "window; local-hit: the same in this engine's local-hit rounds; added = max gap - "
        "local-hit; delay+: decode time lost in the window beyond the local-hit rounds; load: "
        "the 1-minute load average when the engine started"
    )
    for t in section["targets"]:
        state = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        limit = f"{t['comparison']} {t['threshold']}"
        print(f"target {t['name']}: {state} ({value} {limit}; {t['detail']})")
    for w in section["warnings"]:
        print(f"warning: {w}")
