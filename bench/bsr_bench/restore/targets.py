"""The default run's targets and summary: what BSR must show, read off the points.

A target is ``{name, description, value, threshold, met}`` (``schema.json``'s ``targets[]``);
the summary names the reference point whose ratios the README quotes. The targets of the
machinery sections are :func:`.sections.issue_targets`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .options import BenchOptions


def targets(o: BenchOptions, points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets over the size series' points (the requested layouts and the recompute one)."""
    main = [p for p in points if p["chunks"] >= o.window]
    flat_dev = 0
    for p in main:
        flat_dev = max(flat_dev, abs(p["bsr"]["rws_peak_bytes"] - o.window * p["slot_bytes"]))
    # bandwidth and TTFT targets are about the layouts asked for; the recompute model's own
    # layout (a few MiB in sub-MiB chunks) is there for the recompute comparison only
    asked = [p for p in points if not p["matched_recompute"]] or list(points)
    bw = min(p["ratios"]["bsr_vs_raw_bandwidth"] for p in asked)
    ttft = max(p["ratios"]["bsr_vs_whole_plan_ttft"] for p in asked)
    out: list[dict[str, Any]] = [
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
        out.append(
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
    return out


def summary(points: Sequence[dict[str, Any]], first: str) -> dict[str, Any]:
    """The largest point of the first layout, and of the recompute comparison, with ratios."""
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
