"""``bsr bench --engine vllm --vllm-model gemma3-tiny``: a sliding-window model in vLLM's CPU
engine. Section ``manager``: bytes restored and TTFT with vLLM's hybrid KV cache manager on vs
off, and recompute. Section ``checkpoints`` (:mod:`.vllm_checkpoints`): what each window
checkpoint interval stores and reads against the hits it keeps (``--vllm-sections`` picks them,
default both).

Where it runs: like :mod:`.vllm_ttft`, the bench process only orchestrates; every engine runs in
a child process of the vLLM interpreter (:mod:`.vllm_engine` running :func:`child`), which finds
this package through ``PYTHONPATH``.

How it works: a random-weight Gemma3-style text model (``config.json`` only,
``load_format="dummy"``; Gemma3's pattern of five sliding-window layers to one full-attention
layer, window :data:`WINDOW`) is served three ways, one engine each, vLLM's own prefix cache off
so that every request recomputes or goes through the connector:

* **recompute**: no connector;
* **hybrid**: :class:`bsr.vllm.BsrConnector` with vLLM's hybrid KV cache manager on (bsr
  declares ``SupportsHMA``): one KV cache group per layer kind, the sliding groups store and
  restore only the chunks their window needs;
* **one_group**: the same connector with ``disable_hybrid_kv_cache_manager``: one group, every
  layer keeps (and bsr stores and restores) full-length KV.

Per prefix length, a first request stores the prefix; untimed requests repeat until the
connector restores it whole; then each timed request ``prefix + fresh suffix`` restores the
prefix's full chunks and prefills the suffix. A sample is the wall time of ``LLM.generate`` with
``max_tokens=1``; the bytes a restore read come from bsr's ``vllm:bsr_loaded_bytes`` counter
(over the timed requests, divided by their number), the stored bytes from the object files.
The JSON keeps every sample with min/median/max and the ratios of medians measured in the run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import vllm_checkpoints
from .common.stats import BenchError, Dist, ratio
from .vllm_common import run_child, tokens, vllm_python, vllm_version
from .vllm_engine import (
    EngineSpec,
    Outcome,
    bsr_config,
    bsr_transfer,
    file_tier,
    first_token,
    loaded_bytes,
    restore_until_hit,
    settle,
    start_llm,
    suffixed,
    timed_generate,
)
from .vllm_hybrid_model import BLOCK_SIZE, CHUNK_TOKENS, MODEL, WINDOW
from .vllm_ttft import SUFFIX_TOKENS

MODELS = ("llama", "gemma3-tiny")
DEFAULT_PREFIXES = (1024, 2048, 4096)
MODES = ("recompute", "hybrid", "one_group")
SECTIONS = ("manager", "checkpoints")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flag that picks this program under ``--engine vllm``."""
    g = p.add_argument_group("vLLM hybrid models (--engine vllm --vllm-model gemma3-tiny)")
    g.add_argument(
        "--vllm-checkpoint-intervals",
        default=None,
        help="gemma3-tiny, section checkpoints: window_checkpoint_chunks values to compare, "
        "comma-separated, 'none' for no periodic checkpoints (default 1,2,4,8,16,none)",
    )
    g.add_argument(
        "--vllm-model",
        choices=MODELS,
        default="llama",
        help="llama: TTFT of a full-attention Llama (recompute, bsr, vLLM's offloading "
        "connector); gemma3-tiny: a sliding-window model, bytes restored and TTFT with vLLM's "
        "hybrid KV cache manager on vs off, and recompute",
    )


# --------------------------------------------------------------------------- child side
def _store_bytes(root: str) -> tuple[int, int]:
    files = [p for p in (Path(root) / "objects").glob("**/*.bsr") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _measure_prefix(llm: Any, spec: dict[str, Any], params: Any, n: int) -> dict[str, Any]:
    """One prefix length's point: the prefix stored and hit (with bsr), then ``repeats`` timed
    requests, with the bytes they read and the bytes the store request wrote."""
    bsr = spec["mode"] != "recompute"
    prefix = tokens(n, spec["seed"] + n, MODEL["vocab_size"])

    def ask(i: int) -> tuple[float, int]:
        prompt = suffixed(prefix, SUFFIX_TOKENS, spec["seed"], i, MODEL["vocab_size"])
        return timed_generate(llm, prompt, params)

    point: dict[str, Any] = {"prefix_tokens": n}
    before = _store_bytes(spec["store"]) if bsr else (0, 0)
    ask(-1)  # warm-up; with bsr also stores the prefix (saved after the request ends)
    if bsr:
        settle(spec["store"], nonempty=True)
        after = _store_bytes(spec["store"])
        point["stored_objects"] = after[0] - before[0]
        point["stored_bytes"] = after[1] - before[1]
        restore_until_hit(ask, n)
    loaded0 = loaded_bytes(llm) if bsr else 0.0
    samples, cached = [], []
    for r in range(spec["repeats"]):
        s, c = ask(r)
        samples.append(s)
        cached.append(c)
    if bsr:
        point["loaded_bytes_per_restore"] = (loaded_bytes(llm) - loaded0) / spec["repeats"]
    point.update(ttft_s=samples, cached_tokens=cached)
    return point


def child(spec: dict[str, Any]) -> Outcome:
    """One engine: time ``prefix + suffix`` requests for every prefix length (child process)."""
    mode = spec["mode"]
    transfer = None
    if mode != "recompute":
        transfer = bsr_transfer(bsr_config([file_tier(spec["store"])], CHUNK_TOKENS))
    engine = EngineSpec(
        spec["model"], max(spec["prefixes"]) + 2 * SUFFIX_TOKENS, BLOCK_SIZE, log_stats=True
    )
    llm, start_s = start_llm(
        engine, transfer, disable_hybrid_kv_cache_manager=(mode == "one_group")
    )
    result: dict[str, Any] = {"mode": mode, "points": [], "start_s": start_s}
    params = first_token()
    for n in spec["prefixes"]:
        result["points"].append(_measure_prefix(llm, spec, params, n))
    return result, llm


# --------------------------------------------------------------------------- bench side
def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench --engine vllm --vllm-model gemma3-tiny``: run, print, return the document."""
    doc = run_hybrid(ns)
    _print_table(doc)
    return doc


def sections_of(ns: argparse.Namespace) -> tuple[str, ...]:
    given = getattr(ns, "vllm_sections", None)
    sections = tuple(s.strip() for s in given.split(",") if s.strip()) if given else SECTIONS
    if (
        not sections
        or any(s not in SECTIONS for s in sections)
        or len(set(sections)) != len(sections)
    ):
        raise BenchError(
            "--vllm-sections with --vllm-model gemma3-tiny takes distinct names among manager, "
            f"checkpoints; got {given!r}"
        )
    return sections


def run_hybrid(ns: argparse.Namespace) -> dict[str, Any]:
    from .common.machine import commit_info, machine_info  # not in the child: psutil, torch

    sections = sections_of(ns)
    if "checkpoints" in sections:  # refuse a bad list before any engine starts
        vllm_checkpoints.parse_intervals(getattr(ns, "vllm_checkpoint_intervals", None) or "1")
    quick = bool(getattr(ns, "quick", False))
    given = getattr(ns, "vllm_prefixes", None)
    prefixes = (
        tuple(int(x) for x in given.split(","))
        if given
        else ((1024, 2048) if quick else DEFAULT_PREFIXES)
    )
    if any(n < 2 * WINDOW or n % CHUNK_TOKENS for n in prefixes):
        raise BenchError(
            f"--vllm-prefixes must be multiples of {CHUNK_TOKENS} of at least {2 * WINDOW} "
            f"tokens (twice the model's window), got {prefixes}"
        )
    repeats = getattr(ns, "vllm_repeats", None)
    if repeats is None:
        repeats = 2 if quick else 5
    if repeats < 1:
        raise BenchError("--vllm-repeats must be >= 1")
    python = vllm_python(getattr(ns, "vllm_python", None))
    version = vllm_version(python)
    seed = int(getattr(ns, "seed", 0) or 0)
    work = Path(tempfile.mkdtemp(prefix="bsr-vllm-hybrid-"))
    t_start = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    try:
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(MODEL))
        base = {"model": str(work / "model"), "prefixes": list(prefixes), "repeats": repeats}
        runs = {
            m: run_child(
                python, "bsr_bench.vllm_hybrid",
                {**base, "seed": seed, "mode": m, "store": str(work / f"store-{m}")}, work, m, 1800,
            )
            for m in (MODES if "manager" in sections else ())
        }  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for m, r in runs.items():
        if "error" in r:
            raise BenchError(f"the {m} engine failed: {r['error']}")
    checkpoints = (
        vllm_checkpoints.run_checkpoints(ns, python) if "checkpoints" in sections else None
    )
    doc = {
        "kind": "vllm_hybrid",
        "vllm": version,
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": CHUNK_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "repeats": repeats,
        "seed": seed,
        "tier": "file (page cache warm: written by the store request)",
        "sections": list(sections),
        "points": _points(runs) if runs else [],
        "engine_start_s": {m: r.get("start_s") for m, r in runs.items()},
        "checkpoints": checkpoints,
        "machine": machine_info(),
        "commit": commit_info(),
        "duration_s": time.perf_counter() - t_start,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(getattr(ns, "json", None) or f"bench/results/vllm-hybrid-{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    doc["json_path"] = str(path)
    if not getattr(ns, "no_plots", False):
        out = Path(getattr(ns, "plots", None) or "bench/results")
        if doc["points"]:
            doc["plot"] = plot(doc, out)
        if checkpoints is not None:
            doc["checkpoints_plot"] = vllm_checkpoints.plot(checkpoints, out)
    return doc


def _points(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prefix: every mode's TTFT distribution, bytes, and the ratios of medians."""
    out = []
    for rec, hyb, one in zip(*(runs[m]["points"] for m in MODES)):
        runs_at = (rec, hyb, one)
        d = {m: Dist.of(p["ttft_s"]) for m, p in zip(MODES, runs_at)}
        out.append(
            {
                "prefix_tokens": rec["prefix_tokens"],
                **{f"{m}_ttft_s": d[m].to_dict() for m in MODES},
                **{f"{m}_cached_tokens": p["cached_tokens"] for m, p in zip(MODES, runs_at)},
                **{
                    f"{m}_{k}": p[k]
                    for m, p in zip(MODES[1:], (hyb, one))
                    for k in ("loaded_bytes_per_restore", "stored_bytes", "stored_objects")
                },
                "bytes_one_group_over_hybrid": ratio(
                    one["loaded_bytes_per_restore"], hyb["loaded_bytes_per_restore"], "bytes"
                ),
                "ttft_recompute_over_hybrid": ratio(
                    d["recompute"].median, d["hybrid"].median, "recompute/hybrid"
                ),
                "ttft_one_group_over_hybrid": ratio(
                    d["one_group"].median, d["hybrid"].median, "one_group/hybrid"
                ),
            }
        )
    return out


def plot(doc: dict[str, Any], out_dir: Path) -> str:
    """Bytes read per restore and median TTFT per prefix length, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = doc["points"]
    xs = [p["prefix_tokens"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for m, label in (("hybrid", "hybrid manager on"), ("one_group", "hybrid manager off")):
        ax1.plot(xs, [p[f"{m}_loaded_bytes_per_restore"] / 2**20 for p in pts], "o-", label=label)
    ax1.set(xlabel="restored prefix (tokens)", ylabel="MiB read per restore", title="bytes")
    for m, label in (
        ("recompute", "recompute"),
        ("hybrid", "bsr, hybrid manager on"),
        ("one_group", "bsr, hybrid manager off"),
    ):
        ax2.plot(xs, [p[f"{m}_ttft_s"]["median"] for p in pts], "o-", label=label)
    ax2.set(xlabel="prefix (tokens)", ylabel="median TTFT (s)", title="time to first token")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"vLLM {doc['vllm']} CPU, tiny Gemma3 (5 sliding : 1 full, window {WINDOW})")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "vllm_hybrid.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _print_table(doc: dict[str, Any]) -> None:
    if doc["checkpoints"] is not None:
        vllm_checkpoints.print_section(doc["checkpoints"])
    if not doc["points"]:
        print(f"JSON: {doc['json_path']}")
        return
    print(f"vLLM {doc['vllm']} CPU, tiny Gemma3, TTFT median of {doc['repeats']} (s), MiB read")
    print(
        f"{'prefix':>7} {'recompute':>10} {'hybrid':>8} {'1 group':>8} "
        f"{'MiB hyb':>8} {'MiB 1grp':>9} {'bytes x':>8}"
    )
    for p in doc["points"]:
        print(
            f"{p['prefix_tokens']:>7} {p['recompute_ttft_s']['median']:>10.3f} "
            f"{p['hybrid_ttft_s']['median']:>8.3f} {p['one_group_ttft_s']['median']:>8.3f} "
            f"{p['hybrid_loaded_bytes_per_restore'] / 2**20:>8.2f} "
            f"{p['one_group_loaded_bytes_per_restore'] / 2**20:>9.2f} "
            f"{p['bytes_one_group_over_hybrid']:>7.2f}x"
        )
    print(f"JSON: {doc['json_path']}")
