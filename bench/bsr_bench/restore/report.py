"""Tables and plots of the default run, rendered from its JSON document.

The tables are rendered from the same point dictionaries that go into the JSON, so what the
terminal shows is what the document says (the document itself: :mod:`..common.document`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


# ---------------------------------------------------------------------- formatting
def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_bw(bps: float) -> str:
    return f"{bps / 1e9:.2f}"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


TABLE_COLUMNS = (
    "layout",
    "tokens",
    "state",
    "probe",
    "raw GB/s",
    "BSR TTFT",
    "BSR GB/s",
    "BSR/raw",
    "BSR/fio",
    "WP TTFT",
    "BSR/WP",
    "BSR RWS",
    "WP RWS",
    "BSR dRSS",
    "WP dRSS",
    "recompute",
    "recomp/BSR",
)


def point_row(p: dict[str, Any]) -> list[str]:
    """One table row (medians) of a result point."""
    r = p["ratios"]
    rec = p.get("recompute")
    return [
        p["layout"],
        str(p["tokens"]),
        fmt_bytes(p["state_bytes"]),
        f"{p['probe_s']['median'] * 1e3:.2f} ms",
        fmt_bw(p["raw"]["best_bandwidth_Bps"]),
        fmt_s(p["bsr"]["ttft_s"]["median"]),
        fmt_bw(p["bsr"]["bandwidth_Bps"]["median"]),
        f"{r['bsr_vs_raw_bandwidth']:.2f}",
        f"{r['bsr_vs_fio_bandwidth']:.2f}" if "bsr_vs_fio_bandwidth" in r else "-",
        fmt_s(p["whole_plan"]["ttft_s"]["median"]),
        f"{r['bsr_vs_whole_plan_ttft']:.2f}",
        fmt_bytes(p["bsr"]["rws_peak_bytes"]),
        fmt_bytes(p["whole_plan"]["rws_peak_bytes"]),
        fmt_bytes(p["bsr"]["rss_growth_bytes"]["median"]),
        fmt_bytes(p["whole_plan"]["rss_growth_bytes"]["median"]),
        fmt_s(rec["prefill_s"]["median"]) if rec else "-",
        f"{r['recompute_vs_bsr_ttft']:.1f}x" if "recompute_vs_bsr_ttft" in r else "-",
    ]


def results_table(points: Iterable[dict[str, Any]], title: str = "bsr bench") -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    for i, col in enumerate(TABLE_COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for p in points:
        table.add_row(*point_row(p))
    return table


REMOTE_COLUMNS = (
    "layout",
    "tokens",
    "state",
    "probe",
    "BSR TTFT",
    "BSR GB/s",
    "WP TTFT",
    "BSR/WP",
    "BSR RWS",
    "WP RWS",
    "BSR/file",
    "WP/file",
)


def remote_row(p: dict[str, Any]) -> list[str]:
    """One row (medians) of a point's remote-tier figures (``point["remote"]``)."""
    r = p["remote"]
    q = r["ratios"]
    return [
        p["layout"],
        str(p["tokens"]),
        fmt_bytes(p["state_bytes"]),
        f"{r['probe_s']['median'] * 1e3:.2f} ms",
        fmt_s(r["bsr"]["ttft_s"]["median"]),
        fmt_bw(r["bsr"]["bandwidth_Bps"]["median"]),
        fmt_s(r["whole_plan"]["ttft_s"]["median"]),
        f"{q['bsr_vs_whole_plan_ttft']:.2f}",
        fmt_bytes(r["bsr"]["rws_peak_bytes"]),
        fmt_bytes(r["whole_plan"]["rws_peak_bytes"]),
        f"{q['remote_vs_file_bsr_ttft']:.2f}x",
        f"{q['remote_vs_file_whole_plan_ttft']:.2f}x",
    ]


def remote_table(points: Iterable[dict[str, Any]]) -> Any:
    """The remote-tier figures beside the FileTier ones ("/file": remote TTFT / FileTier TTFT)."""
    from rich.table import Table

    points = list(points)
    kinds = sorted({str(p["remote"]["tier"]) for p in points if p.get("remote")})
    names = {"mooncake": "Mooncake", "redis": "Redis"}
    label = ", ".join(names.get(k, k) for k in kinds) or "Mooncake"
    table = Table(
        title=f"remote tier ({label}, loopback; medians over repeats)",
        title_justify="left",
        header_style="bold",
    )
    for i, col in enumerate(REMOTE_COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for p in points:
        if p.get("remote"):
            table.add_row(*remote_row(p))
    return table


def sweep_table(sweep: Sequence[dict[str, Any]]) -> Any:
    from rich.table import Table

    first = sweep[0] if sweep else {"layout": "?", "tokens": 0}
    table = Table(
        title=f"W x io_depth sweep ({first['layout']}, {first['tokens']} tokens)",
        title_justify="left",
        header_style="bold",
    )
    for col in ("W", "io_depth", "TTFT", "GB/s", "BSR/raw", "RWS", "dRSS"):
        table.add_column(col, justify="right")
    for s in sweep:
        table.add_row(
            str(s["window"]),
            str(s["io_depth"]),
            fmt_s(s["ttft_s"]["median"]),
            fmt_bw(s["bandwidth_Bps"]["median"]),
            f"{s['bsr_vs_raw_bandwidth']:.2f}",
            fmt_bytes(s["rws_peak_bytes"]),
            fmt_bytes(s["rss_growth_bytes"]["median"]),
        )
    return table


# ---------------------------------------------------------------------- plots
def _by_layout(points: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        out.setdefault(p["layout"], []).append(p)
    for pts in out.values():
        pts.sort(key=lambda p: p["tokens"])
    return out


def _err(
    dists: Sequence[dict[str, Any]], scale: float = 1.0
) -> tuple[list[float], list[list[float]]]:
    med = [d["median"] * scale for d in dists]
    lo = [(d["median"] - d["min"]) * scale for d in dists]
    hi = [(d["max"] - d["median"]) * scale for d in dists]
    return med, [lo, hi]


def plots(doc: dict[str, Any], directory: Path) -> list[str]:
    """Write rws_vs_state.png, ttft_vs_state.png and bandwidth_vs_window.png; return paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    groups = _by_layout(doc["results"])
    per_token = {lay["name"]: lay["token_bytes"] for lay in doc["layouts"]}
    written = [
        _plot_rws(plt, doc, groups, per_token, directory / "rws_vs_state.png"),
        _plot_ttft(plt, groups, per_token, directory / "ttft_vs_state.png"),
    ]
    sweep = doc.get("sweep") or []
    if sweep:
        written.append(_plot_bandwidth(plt, sweep, directory / "bandwidth_vs_window.png"))
    return written


def _title(ax: Any, name: str, per_token: dict[str, int]) -> None:
    """Title a per-layout panel with the layout's bytes per token; label its x axis."""
    ax.set_title(f"{name} ({fmt_bytes(per_token.get(name, 0))}/token)", fontsize=10)
    ax.set_xlabel("restored tokens")


def _save(plt: Any, fig: Any, path: Path) -> str:
    """Write ``fig`` to ``path`` and close it; return the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _plot_rws(
    plt: Any,
    doc: dict[str, Any],
    groups: dict[str, list[dict[str, Any]]],
    per_token: dict[str, int],
    path: Path,
) -> str:
    """RWS (and RSS growth) against the state size, one panel per layout; return the path."""
    mib = float(1 << 20)
    n = max(1, len(groups))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False)
    for ax, (name, pts) in zip(axes[0], groups.items()):
        x = [p["tokens"] for p in pts]
        ax.plot(x, [p["bsr"]["rws_peak_bytes"] / mib for p in pts], "o-", label="BSR RWS")
        ax.plot(
            x, [p["whole_plan"]["rws_peak_bytes"] / mib for p in pts], "s--", label="whole-plan RWS"
        )
        ax.plot(
            x,
            [p["bsr"]["rss_growth_bytes"]["median"] / mib for p in pts],
            "o:",
            alpha=0.6,
            label="BSR RSS growth",
        )
        ax.plot(
            x,
            [p["whole_plan"]["rss_growth_bytes"]["median"] / mib for p in pts],
            "s:",
            alpha=0.6,
            label="whole-plan RSS growth",
        )
        _title(ax, name, per_token)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Restoration working set (W={doc['config']['window']})")
    return _save(plt, fig, path)


def _plot_ttft(
    plt: Any,
    groups: dict[str, list[dict[str, Any]]],
    per_token: dict[str, int],
    path: Path,
) -> str:
    """TTFT against the state size (remote and recompute beside), per layout; return the path."""
    n = max(1, len(groups))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False)
    for ax, (name, pts) in zip(axes[0], groups.items()):
        x = [p["tokens"] for p in pts]
        y, e = _err([p["bsr"]["ttft_s"] for p in pts])
        ax.errorbar(x, y, yerr=e, fmt="o-", capsize=3, label="BSR restore")
        y, e = _err([p["whole_plan"]["ttft_s"] for p in pts])
        ax.errorbar(x, y, yerr=e, fmt="s--", capsize=3, label="whole-plan restore")
        rem = [p for p in pts if p.get("remote")]
        if rem:
            xr = [p["tokens"] for p in rem]
            y, e = _err([p["remote"]["bsr"]["ttft_s"] for p in rem])
            ax.errorbar(xr, y, yerr=e, fmt="D-", capsize=3, label="BSR restore (Mooncake)")
            y, e = _err([p["remote"]["whole_plan"]["ttft_s"] for p in rem])
            ax.errorbar(xr, y, yerr=e, fmt="v--", capsize=3, label="whole-plan (Mooncake)")
        rec = [p for p in pts if p.get("recompute")]
        if rec:
            y, e = _err([p["recompute"]["prefill_s"] for p in rec])
            ax.errorbar(
                [p["tokens"] for p in rec],
                y,
                yerr=e,
                fmt="^-.",
                capsize=3,
                label="recompute (prefill)",
            )
            ax.set_yscale("log")
        _title(ax, name, per_token)
        ax.set_ylabel("TTFT (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Time to restored state (median, min-max bars)")
    return _save(plt, fig, path)


def _plot_bandwidth(plt: Any, sweep: Sequence[dict[str, Any]], path: Path) -> str:
    """Bandwidth against W, one line per io_depth, raw reads beside; return the path."""
    import matplotlib

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for depth in sorted({s["io_depth"] for s in sweep}):
        pts = sorted((s for s in sweep if s["io_depth"] == depth), key=lambda s: s["window"])
        y, e = _err([s["bandwidth_Bps"] for s in pts], 1e-9)
        ax.errorbar(
            [s["window"] for s in pts],
            y,
            yerr=e,
            fmt="o-",
            capsize=3,
            label=f"BSR io_depth={depth}",
        )
    raw = sweep[0]["raw_bandwidth_Bps"] / 1e9
    ax.axhline(raw, color="k", ls="--", lw=1, label="raw read (same files)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({s["window"] for s in sweep}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("window W (slots)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"Restore bandwidth vs W ({sweep[0]['layout']}, {sweep[0]['tokens']} tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)
