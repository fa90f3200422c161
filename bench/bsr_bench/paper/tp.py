"""``bsr bench --tp N``: N tensor-parallel ranks restore their shards and agree (gloo).

Where it runs: the bench process starts N worker processes (:mod:`.tp_worker`), one per rank,
on this machine; they form a gloo group on 127.0.0.1 and each restores its own shard through a
:class:`~bsr.TorchDistributedCoordinator`.

How it works: every rank saves its shard (same tokens, its own bytes and FileTier directory),
then restores it ``--repeats`` times agreed with the other ranks and ``--repeats`` times alone;
the difference of the medians is the agreement overhead (the probe's MIN and the commit's AND
over gloo). Last, the fault case: rank ``N-1``'s tier fails one read, and every rank must end
Invalidated with nothing committed. This process gathers the ranks' records into one JSON
document (``schema.json``'s ``tp_document``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..common.document import validate, write_json
from ..common.layouts import resolve_layout
from ..common.machine import commit_info, machine_info
from ..common.stats import BenchError
from ..common.workers import child_env, free_port

MIB = 1 << 20


@dataclass(frozen=True)
class TpOptions:
    """Resolved options of one ``--tp`` run (recorded in the JSON under ``args``)."""

    world_size: int
    layout: str
    tokens: int
    window: int
    io_depth: int
    repeats: int
    destination: str
    direct_io: bool
    path: str | None
    seed: int
    timeout_s: float
    json: str
    quick: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_tp(ns: argparse.Namespace) -> TpOptions:
    """Options of a ``--tp`` run from the parsed ``bsr bench`` flags."""
    quick = bool(ns.quick)
    if ns.tp < 2:
        raise BenchError(f"--tp needs at least 2 ranks, got {ns.tp}")
    layouts = ns.layout or ["dsv4-flash"]
    if len(layouts) != 1:
        raise BenchError("--tp restores one layout; pass --layout once")
    if ns.ladder_sizes:
        try:
            sizes = [int(x) for x in ns.ladder_sizes.split(",") if x.strip()]
        except ValueError:
            raise BenchError(
                f"--ladder-sizes: expected integers, got {ns.ladder_sizes!r}"
            ) from None
        if len(sizes) != 1 or sizes[0] < 1:
            raise BenchError("--tp restores one size per rank: pass one --ladder-sizes value")
        tokens = sizes[0]
    else:
        tokens = 1024 if quick else 16384
    window = ns.window or (2 if quick else 32)
    io_depth = ns.io_depth or min(window, 2 if quick else 8)
    if not 1 <= io_depth <= window:
        raise BenchError(f"--io-depth must be in [1, W={window}], got {io_depth}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return TpOptions(
        world_size=ns.tp,
        layout=layouts[0],
        tokens=tokens,
        window=window,
        io_depth=io_depth,
        repeats=ns.repeats or (1 if quick else 3),
        destination="memory" if ns.destination == "auto" else ns.destination,
        direct_io=ns.cache in ("auto", "direct"),
        path=ns.path,
        seed=int(ns.seed),
        timeout_s=120.0,
        json=ns.json or f"bench/results/tp{ns.tp}-{stamp}.json",
        quick=quick,
    )


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run_tp(opts: TpOptions, console: Any = None) -> dict[str, Any]:
    """Start the ranks, gather their records, write the JSON, print the table."""
    from rich.console import Console

    console = console or Console(width=200)
    named = resolve_layout(opts.layout)
    lay = named.layout
    if opts.tokens < lay.chunk_tokens * 2:
        raise BenchError(f"--tp needs at least 2 chunks ({2 * lay.chunk_tokens} tokens) per rank")
    if opts.path is not None and not Path(opts.path).is_dir():
        raise BenchError(f"--path {opts.path} is not a directory")
    t_start = time.time()
    machine = machine_info()
    root = Path(tempfile.mkdtemp(prefix="bsr-tp-", dir=opts.path))
    cfg = {
        **opts.to_dict(),
        "root": str(root),
        "port": free_port(),
        "fail_rank": opts.world_size - 1,
    }
    cfg_path = root / "config.json"
    cfg_path.write_text(json.dumps(cfg), "utf-8")
    env = child_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    console.print(
        f"--tp {opts.world_size}: {opts.tokens} tokens of {named.name} per rank "
        f"({opts.tokens // lay.chunk_tokens * lay.chunk_bytes / MIB:.1f} MiB), W={opts.window}"
    )
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bsr_bench.paper.tp_worker", str(cfg_path), str(r)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(opts.world_size)
        ]
        outputs = []
        deadline = time.monotonic() + 600 + 60 * opts.repeats
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise BenchError("a --tp rank did not finish in time") from None
            outputs.append(out)
        for r, p in enumerate(procs):
            if p.returncode != 0:
                tail = "\n".join(outputs[r].strip().splitlines()[-15:])
                raise BenchError(f"--tp rank {r} exited with {p.returncode}:\n{tail}")
        ranks = [
            json.loads((root / f"rank{r}.json").read_text("utf-8")) for r in range(opts.world_size)
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = build_document(opts, named.to_dict(), ranks, machine, t_start)
    validate(doc, "tp_document")
    write_json(doc, Path(opts.json))
    console.print(tp_table(doc))
    for name, v in doc["invariants"].items():
        console.print(
            f"invariant {name}: {'holds' if v['holds'] else 'BROKEN'} ({v['description']})"
        )
    console.print(f"JSON: {opts.json}")
    return doc


def _rank_row(r: dict[str, Any]) -> dict[str, Any]:
    """One rank's entry of ``ranks``: its records and the medians of agreed vs alone."""
    agreed, alone = r["agreed"], r["alone"]
    return {
        "rank": r["rank"],
        "save": r["save"],
        "agreed": agreed,
        "alone": alone,
        "rws_peak_bytes": max(s["rws_peak_bytes"] for s in agreed),
        "committed_tokens": [s["committed_tokens"] for s in agreed],
        "ttft_s_median": _median([s["wall_s"] for s in agreed]),
        "alone_ttft_s_median": _median([s["wall_s"] for s in alone]),
        "commit_s_median": _median([s["commit_s"] for s in agreed]),
        "alone_commit_s_median": _median([s["commit_s"] for s in alone]),
        "probe_s_median": _median([s["probe_s"] for s in agreed]),
        "alone_probe_s_median": _median([s["probe_s"] for s in alone]),
        "agreement_overhead_s": r["agreement_overhead_s"],
        "agreement_phases_s": r["agreement_phases_s"],
    }


def _invariants(
    opts: TpOptions, layout: dict[str, Any], ranks: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``--tp`` invariants (RWS, agreement and commit, the fault) and whether they hold."""
    slot = int(layout["slot_bytes"])
    fault = [r["fault"] for r in ranks]
    want_rws = opts.window * slot
    agreed_all = [s for r in ranks for s in r["agreed"]]
    return {
        "rws_equals_w_x_slot": {
            "description": "every agreed restore on every rank has rws_peak_bytes == W x "
            "slot_bytes",
            "holds": all(s["rws_peak_bytes"] == want_rws for s in agreed_all)
            if opts.tokens // int(layout["chunk_tokens"]) >= opts.window
            else all(s["rws_peak_bytes"] <= want_rws for s in agreed_all),
        },
        "ranks_agree_and_commit": {
            "description": "every agreed restore committed the whole shard on every rank, with "
            "the bytes saved (sampled digests)",
            "holds": all(
                s["state"] == "Committed"
                and s["committed_tokens"]
                == opts.tokens // int(layout["chunk_tokens"]) * int(layout["chunk_tokens"])
                and s.get("verified", {}).get("ok", False)
                for s in agreed_all
            ),
        },
        "fault_invalidates_every_rank": {
            "description": "with one rank's tier failing a read, every rank ends Invalidated "
            "with committed_tokens == 0",
            "holds": all(f["state"] == "Invalidated" and f["committed_tokens"] == 0 for f in fault),
        },
    }


def build_document(
    opts: TpOptions,
    layout: dict[str, Any],
    ranks: list[dict[str, Any]],
    machine: dict[str, Any],
    t_start: float,
) -> dict[str, Any]:
    """The ``--tp`` JSON document from the ranks' records."""
    per_rank = [_rank_row(r) for r in ranks]
    fault = [r["fault"] for r in ranks]
    invariants = _invariants(opts, layout, ranks)
    overhead = [p["agreement_overhead_s"] for p in per_rank]
    return {
        "schema_version": 1,
        "tool": "bsr bench --tp",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 3),
        "machine": machine,
        "commit": commit_info(),
        "args": opts.to_dict(),
        "argv": sys.argv[1:],
        "world_size": opts.world_size,
        "layout": layout,
        "backend": "gloo (torch.distributed, 127.0.0.1), one process per rank",
        "ranks": per_rank,
        "agreement": {
            "method": "median wall time of agreed restores minus the same rank's restores "
            "alone (a coordinator that agrees with itself only), interleaved, same shard and "
            "settings",
            "overhead_s_per_rank": overhead,
            "overhead_s_max": max(overhead),
            "phases_method": "median (probe_s + commit_s) agreed minus alone: the phases that "
            "hold the MIN and the vote + AND; commit_s includes waiting for the slowest rank",
            "phases_s_per_rank": [p["agreement_phases_s"] for p in per_rank],
        },
        "fault": {
            "failing_rank": fault[0]["failing_rank"],
            "faulty_chunk": fault[0]["faulty_chunk"],
            "ranks": fault,
        },
        "invariants": invariants,
        "warnings": [],
    }


def tp_table(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"TP={doc['world_size']} restore ({doc['layout']['name']}, gloo), medians")
    for c in (
        "rank",
        "committed",
        "RWS",
        "TTFT agreed",
        "TTFT alone",
        "overhead (wall)",
        "probe+commit delta",
        "commit agreed",
        "commit alone",
        "fault case",
    ):
        t.add_column(c, justify="right")
    for p, f in zip(doc["ranks"], doc["fault"]["ranks"]):
        t.add_row(
            str(p["rank"]),
            str(p["committed_tokens"][0]),
            f"{p['rws_peak_bytes'] / MIB:.2f} MiB",
            f"{p['ttft_s_median'] * 1e3:.1f} ms",
            f"{p['alone_ttft_s_median'] * 1e3:.1f} ms",
            f"{p['agreement_overhead_s'] * 1e3:+.1f} ms",
            f"{p['agreement_phases_s'] * 1e3:+.1f} ms",
            f"{p['commit_s_median'] * 1e3:.2f} ms",
            f"{p['alone_commit_s_median'] * 1e3:.2f} ms",
            f"{f['state']} ({f['reason']}), {f['committed_tokens']} tok",
        )
    return t
