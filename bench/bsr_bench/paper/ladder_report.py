"""The L1 ladder's report: the paper-shaped table (terminal and Markdown) and the plot.

``PAPER`` holds what the BSR paper reports, so every table shows this run's figure beside the
paper's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .options import GIB, MIB

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


#: the grid's tag of each outcome (others are shown as they are)
_MARK = {
    "committed": "ok",
    "invalidated": "inv",
    "config_error": "cfg",
    "skipped": "skip",
    "failed": "FAIL",
    "partial": "part",
}
#: the grid's short name of each strategy
_SHORT = {"whole_plan": "WP", "lmcache": "LMC", "bsr": "BSR"}


def ladder_markdown(doc: dict[str, Any]) -> str:
    """The paper-shaped table and the full state x budget grid, as Markdown (README)."""
    return "\n".join(_markdown_table(doc) + _markdown_grid(doc)) + "\n"


def _md_first(doc: dict[str, Any], row: dict[str, Any], strat: str) -> str:
    """A state's first budget with full reuse for ``strat``, or "none" with the reasons."""
    d = row.get(strat)
    if not d:
        return "-"
    b = d["first_full_reuse_budget_bytes"]
    if b is None:
        tried = [
            x for x in doc["points"] if x["tokens"] == row["tokens"] and x["strategy"] == strat
        ]
        why = sorted({x["reason"] or x["outcome"] for x in tried if x["outcome"] != "committed"})
        return "none (" + ", ".join(w[:40] for w in why) + ")"
    return _gib(b)


def _markdown_table(doc: dict[str, Any]) -> list[str]:
    """The paper-shaped table's lines: per state, the first budget with full reuse per
    strategy, BSR's RWS, and the paper's figures."""
    paper = {s["tokens"]: s for s in PAPER["states"]}
    lm = any(p["strategy"] == "lmcache" for p in doc["points"])
    head = ["tokens", "state", "whole-plan (bsr): first full reuse at"]
    head += ["LMCache 0.5.6: first full reuse at"] if lm else []
    head += ["paper: LMCache", "BSR: first full reuse at", "BSR RWS", "paper: BSR RWS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in doc["summary"]["states"]:
        p = paper.get(row["tokens"])
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
        cells = [
            str(row["tokens"]),
            f"{row['state_bytes'] / GIB:.3f} GiB",
            _md_first(doc, row, "whole_plan"),
        ]
        cells += [_md_first(doc, row, "lmcache")] if lm else []
        cells += [
            "-" if p is None else ("BSR only" if lmc is None else f"{lmc} GiB"),
            _md_first(doc, row, "bsr"),
            rws,
            f"{PAPER['bsr_rws_bytes'] / MIB:.2f} MiB (W=32)" if p else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _markdown_grid(doc: dict[str, Any]) -> list[str]:
    """The state x budget grid's lines (after a blank one): every strategy's outcome per cell."""
    budgets = sorted({p["budget_bytes"] for p in doc["points"]})
    grid = [
        "",
        "| tokens \\ budget | " + " | ".join(_gib(b) for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    strategies = [
        s
        for s in ("whole_plan", "lmcache", "bsr")
        if any(p["strategy"] == s for p in doc["points"])
    ]
    for tokens in sorted({p["tokens"] for p in doc["points"]}):
        cells = ["<br>".join(_grid_parts(doc, tokens, b, strategies)) for b in budgets]
        grid.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return grid


def _grid_parts(doc: dict[str, Any], tokens: int, budget: int, strategies: list[str]) -> list[str]:
    """One grid cell's entries: per strategy measured there, its outcome (W and TTFT if ok)."""
    parts = []
    for strat in strategies:
        pt = next(
            (
                p
                for p in doc["points"]
                if p["tokens"] == tokens and p["budget_bytes"] == budget and p["strategy"] == strat
            ),
            None,
        )
        if pt is None:
            continue
        tag = _MARK.get(pt["outcome"], pt["outcome"])
        if strat == "bsr" and pt["outcome"] == "committed":
            tag += f" W={pt['window']}"
        if pt["ttft_s"] and pt["outcome"] == "committed":
            tag += f" {pt['ttft_s']:.1f}s"
        parts.append(f"{_SHORT[strat]} {tag}")
    return parts


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
