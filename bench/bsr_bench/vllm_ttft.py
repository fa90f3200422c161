"""``bsr bench --engine vllm``: bsr inside vLLM's CPU engine, two sections in one run.

* **ttft** (this module): time to first token of an idle engine, recompute vs bsr restore;
* **interference** (:mod:`.vllm_interference`): what a restore costs the requests already
  decoding, sync vs async loads vs recompute, over a local-hit baseline.

``--vllm-sections`` picks them (default both). Every engine runs in a child process of the
interpreter that has vLLM (:mod:`.vllm_common`). The run writes one JSON document (schema.json's
``vllm_document``: machine, commit, arguments, both sections, the targets) and prints the tables.

How the TTFT section works: a random-weight Llama (a ``config.json`` only,
``load_format="dummy"``, large enough that prefill costs real time on CPU) is served four ways,
one engine each, with vLLM's own prefix cache off so that every request either recomputes or goes
through the connector:

* **recompute**: no connector; every prompt ``prefix + fresh suffix`` is prefilled in full;
* **bsr**: :class:`bsr.vllm.BsrConnector` in its default mode (asynchronous loads) over a
  FileTier of its own; one request per prefix length stores the prefix (the save runs after the
  request; the bench waits until its objects are on disk and an untimed request restores them
  all), then each timed request restores the prefix's full chunks and prefills only the suffix;
* **bsr_sync**: the same with ``"bsr_connector": {"load": "sync"}`` (the restore runs inside the
  step that prefills the suffix), so the cost of the asynchronous mode on an idle engine (the
  load finishes one engine step, the lookup one scheduler iteration, before the prefill) is a
  ratio measured in the same run;
* **offloading**: vLLM's ``OffloadingConnector`` (CPU offload). On the CPU build it refuses to
  start; the bench records the exact error instead of a figure.

A sample is the wall time of ``LLM.generate`` for one prompt with ``max_tokens=1`` (the TTFT of an
idle engine). The section has every sample with min/median/max, ratios of medians against
recompute measured in the same run, the prefix cache hit vLLM reported (``num_cached_tokens``).
The FileTier's files were just written, so restores read from the page cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import vllm_interference as interference
from .common.stats import BenchError, Dist, load_average, ratio
from .vllm_common import object_files, run_child, tokens, vllm_python, vllm_version
from .vllm_engine import (
    EngineSpec,
    Outcome,
    bsr_config,
    bsr_transfer,
    file_tier,
    first_token,
    restore_until_hit,
    start_llm,
    suffixed,
    timed_generate,
    wait_for_objects,
)
from .vllm_interference_figures import print_table as print_interference

#: The TTFT model: GQA Llama, head_dim 64 (CPU attention kernels need >= 32).
MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
DEFAULT_PREFIXES = (1024, 2048, 4096, 8192)
SUFFIX_TOKENS = 32
BLOCK_SIZE = 128
CHUNK_TOKENS = 256
MODES = ("recompute", "bsr", "bsr_sync", "offloading")
#: the connector's load mode of each bsr engine
LOADS = {"bsr": "async", "bsr_sync": "sync"}
SECTIONS = ("ttft", "interference")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--engine vllm`` flags."""
    g = p.add_argument_group("vLLM (--engine vllm)")
    g.add_argument(
        "--engine",
        choices=("bsr", "vllm"),
        default="bsr",
        help="bsr: the default restore bench; vllm: bsr inside vLLM's CPU engine: TTFT "
        "(recompute vs bsr restore vs vLLM's offloading connector) and interference (what a "
        "restore costs the requests decoding); needs vLLM, e.g. make .venv-vllm",
    )
    g.add_argument(
        "--vllm-sections",
        default=None,
        help="comma-separated sections to run: ttft, interference (default both); with "
        "--vllm-model gemma3-tiny: manager (hybrid KV cache manager on vs off), checkpoints "
        "(window checkpoint intervals: bytes vs hits) (default both)",
    )
    g.add_argument(
        "--vllm-prefixes",
        default=None,
        help="ttft: reusable prefix lengths in tokens (default 1024,2048,4096,8192)",
    )
    g.add_argument(
        "--vllm-repeats", type=int, default=None, help="ttft: timed requests per prefix (default 5)"
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter with vLLM installed (default .venv-vllm/bin/python if present)",
    )
    interference.add_arguments(g)


# --------------------------------------------------------------------------- child side
def _transfer(mode: str, store: str) -> dict[str, Any] | None:
    """The engine's KV transfer config for ``mode`` (none for recompute)."""
    if mode in LOADS:
        return bsr_transfer(
            bsr_config([file_tier(store)], CHUNK_TOKENS), options={"load": LOADS[mode]}
        )
    if mode == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
        }
    return None


def _measure_prefix(llm: Any, spec: dict[str, Any], params: Any, n: int) -> dict[str, Any]:
    """One prefix length's point: a warm-up (with bsr: the prefix stored and hit), then
    ``repeats`` timed requests."""
    mode = spec["mode"]
    vocab = MODEL["vocab_size"]
    prefix = tokens(n, spec["seed"] + n, vocab)

    def ask(i: int) -> tuple[float, int]:
        return timed_generate(llm, suffixed(prefix, SUFFIX_TOKENS, spec["seed"], i, vocab), params)

    before = object_files(spec["store"]) if mode in LOADS else 0
    ask(-1)  # warm-up; with bsr also stores the prefix (saved after the request ends)
    if mode in LOADS:
        wait_for_objects(spec["store"], before + n // CHUNK_TOKENS, 120)
        restore_until_hit(ask, n)
    samples, cached = [], []
    for r in range(spec["repeats"]):
        s, c = ask(r)
        samples.append(s)
        cached.append(c)
    return {"prefix_tokens": n, "ttft_s": samples, "cached_tokens": cached}


def child(spec: dict[str, Any]) -> Outcome:
    """One engine: time ``prefix + suffix`` requests for every prefix length (child process)."""
    load_start = load_average()
    engine = EngineSpec(spec["model"], max(spec["prefixes"]) + 2 * SUFFIX_TOKENS, BLOCK_SIZE)
    llm, start_s = start_llm(engine, _transfer(spec["mode"], spec["store"]))
    result: dict[str, Any] = {"mode": spec["mode"], "points": [], "start_s": start_s}
    params = first_token()
    for n in spec["prefixes"]:
        result["points"].append(_measure_prefix(llm, spec, params, n))
    result["load_average"] = [load_start, load_average()]
    return result, llm


# --------------------------------------------------------------------------- bench side
def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench --engine vllm``: run, print the tables, return the document."""
    doc = run_vllm(ns)
    print_tables(doc)
    return doc


@dataclass(frozen=True)
class Options:
    """What ``--engine vllm`` runs, from its flags (checked before any engine starts)."""

    sections: tuple[str, ...]
    prefixes: tuple[int, ...]
    repeats: int
    plan: interference.Plan
    python: str
    seed: int
    quick: bool


def options_from_namespace(ns: argparse.Namespace) -> Options:
    """The run the flags ask for; a :class:`BenchError` naming the flag otherwise."""
    quick = bool(getattr(ns, "quick", False))
    given = getattr(ns, "vllm_sections", None)
    sections = tuple(s.strip() for s in given.split(",") if s.strip()) if given else SECTIONS
    if (
        not sections
        or any(s not in SECTIONS for s in sections)
        or len(set(sections)) != len(sections)
    ):
        raise BenchError(
            f"--vllm-sections takes distinct names among ttft, interference; got {given!r}"
        )
    try:
        prefixes = (
            tuple(int(x) for x in ns.vllm_prefixes.split(","))
            if getattr(ns, "vllm_prefixes", None)
            else ((1024, 2048) if quick else DEFAULT_PREFIXES)
        )
    except ValueError:
        raise BenchError(
            f"--vllm-prefixes takes comma-separated token counts, got {ns.vllm_prefixes!r}"
        ) from None
    if any(n < CHUNK_TOKENS or n % CHUNK_TOKENS for n in prefixes):
        raise BenchError(f"--vllm-prefixes must be multiples of {CHUNK_TOKENS}, got {prefixes}")
    repeats = getattr(ns, "vllm_repeats", None)
    if repeats is None:
        repeats = 2 if quick else 5
    if repeats < 1:
        raise BenchError(f"--vllm-repeats must be >= 1, got {repeats}")
    return Options(
        sections=sections,
        prefixes=prefixes,
        repeats=repeats,
        plan=interference.plan_from_namespace(ns),
        python=vllm_python(getattr(ns, "vllm_python", None)),
        seed=int(getattr(ns, "seed", 0) or 0),
        quick=quick,
    )


def run_vllm(ns: argparse.Namespace) -> dict[str, Any]:
    """Check the flags, run the sections, validate and write the document."""
    from .common.document import write_json
    from .common.machine import commit_info, machine_info  # not in the child: psutil, torch

    opts = options_from_namespace(ns)
    version = vllm_version(opts.python)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = machine_info()
    commit = commit_info()  # at the start: the tree that runs, whatever is edited meanwhile
    t_start = time.perf_counter()
    ttft = (
        run_ttft(opts.python, opts.prefixes, opts.repeats, opts.seed)
        if "ttft" in opts.sections
        else None
    )
    inter = (
        interference.run_interference(opts.plan, opts.python, opts.seed)
        if "interference" in opts.sections
        else None
    )
    machine["load_average_end"] = load_average()
    doc = document(
        opts,
        version=version,
        machine=machine,
        commit=commit,
        started_at=started,
        duration_s=time.perf_counter() - t_start,
        ttft=ttft,
        inter=inter,
    )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(getattr(ns, "json", None) or f"bench/results/vllm-{stamp}.json")
    write_json(doc, path)
    doc["json_path"] = str(path)
    return doc


def document(
    opts: Options,
    *,
    version: str,
    machine: dict[str, Any],
    commit: dict[str, Any],
    started_at: str,
    duration_s: float,
    ttft: dict[str, Any] | None,
    inter: dict[str, Any] | None,
) -> dict[str, Any]:
    """The run's document (schema.json's ``vllm_document``), validated."""
    from .common.document import validate

    plan = opts.plan
    doc: dict[str, Any] = {
        "schema_version": 1,
        "tool": "bsr bench --engine vllm",
        "started_at": started_at,
        "duration_s": duration_s,
        "argv": sys.argv[1:],
        "args": {
            "sections": list(opts.sections),
            "quick": opts.quick,
            "prefixes": list(opts.prefixes),
            "repeats": opts.repeats,
            "interference": {
                "prefix_tokens": plan.prefix_tokens,
                "arrivals": plan.arrivals,
                "variants": list(plan.variants),
                "layers": plan.layers,
            },
            "vllm_python": opts.python,
        },
        "seed": opts.seed,
        "vllm": version,
        "machine": machine,
        "commit": commit,
        "ttft": ttft,
        "interference": inter,
        "targets": [] if inter is None else inter["targets"],
        "warnings": (ttft or {}).get("warnings", []) + (inter or {}).get("warnings", []),
    }
    validate(doc, "vllm_document")
    return doc


def run_ttft(python: str, prefixes: tuple[int, ...], repeats: int, seed: int) -> dict[str, Any]:
    """The TTFT section: its engines, one after another; its record."""
    work = Path(tempfile.mkdtemp(prefix="bsr-vllm-bench-"))
    t0 = time.perf_counter()
    try:
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(MODEL))
        base = {
            "model": str(work / "model"),
            "prefixes": list(prefixes),
            "repeats": repeats,
            "seed": seed,
        }
        runs = {
            m: run_child(
                python,
                "bsr_bench.vllm_ttft",
                {**base, "mode": m, "store": str(work / f"store-{m}")},
                work,
                m,
                1800,
            )
            for m in MODES
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ttft_section(runs, repeats, time.perf_counter() - t0)


def ttft_section(
    runs: dict[str, dict[str, Any]], repeats: int, duration_s: float
) -> dict[str, Any]:
    """The TTFT section's record from its engines' outputs (``{"error": ...}`` where one failed)."""
    for m in ("recompute", *LOADS):
        if "error" in runs[m]:
            raise BenchError(f"the {m} engine failed: {runs[m]['error']}")
    points = [
        ttft_point(rec, asy, syn)
        for rec, asy, syn in zip(
            runs["recompute"]["points"],
            runs["bsr"]["points"],
            runs["bsr_sync"]["points"],
            strict=True,
        )
    ]
    off = runs["offloading"]
    return {
        "warnings": [
            f"ttft: a {mode} request at prefix {p['prefix_tokens']} hit fewer tokens than the "
            "prefix (see bsr_cached_tokens / bsr_sync_cached_tokens)"
            for p in points
            for mode, key in (("bsr", "bsr_cached_tokens"), ("bsr_sync", "bsr_sync_cached_tokens"))
            if min(p[key]) < p["prefix_tokens"]
        ],
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": CHUNK_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "repeats": repeats,
        "load": "bsr: async (the connector's default); bsr_sync: sync",
        "tier": "file (page cache warm: written by the store request)",
        "points": points,
        "offloading_connector": (
            {"ran": False, "error": off["error"]} if "error" in off else {"ran": True, **off}
        ),
        "engine_start_s": {m: runs[m].get("start_s") for m in MODES},
        "load_average": {m: runs[m].get("load_average") for m in MODES},
        "duration_s": duration_s,
    }


def ttft_point(rec: dict[str, Any], asy: dict[str, Any], syn: dict[str, Any]) -> dict[str, Any]:
    """One prefix length's figures from the three engines' samples (ratios of medians)."""
    if not rec["prefix_tokens"] == asy["prefix_tokens"] == syn["prefix_tokens"]:
        raise BenchError("the TTFT engines measured different prefix lengths")
    d_rec, d_bsr, d_sync = Dist.of(rec["ttft_s"]), Dist.of(asy["ttft_s"]), Dist.of(syn["ttft_s"])
    return {
        "prefix_tokens": rec["prefix_tokens"],
        "recompute_ttft_s": d_rec.to_dict(),
        "bsr_ttft_s": d_bsr.to_dict(),
        "bsr_sync_ttft_s": d_sync.to_dict(),
        "speedup_vs_recompute": ratio(d_rec.median, d_bsr.median, "recompute/bsr"),
        "sync_speedup_vs_recompute": ratio(d_rec.median, d_sync.median, "recompute/bsr_sync"),
        "async_vs_sync_ttft": ratio(d_bsr.median, d_sync.median, "bsr/bsr_sync"),
        "bsr_cached_tokens": asy["cached_tokens"],
        "bsr_sync_cached_tokens": syn["cached_tokens"],
        "recompute_cached_tokens": rec["cached_tokens"],
    }


def print_tables(doc: dict[str, Any]) -> None:
    """The TTFT table and the interference table, whichever ran."""
    ttft = doc["ttft"]
    if ttft is not None:
        print(f"vLLM {doc['vllm']} CPU, TTFT (median of {ttft['repeats']}, s); model: random Llama")
        print(
            f"{'prefix':>8} {'recompute':>10} {'bsr':>8} {'speedup':>8} {'bsr sync':>9} "
            f"{'async/sync':>10} {'bsr hit':>8}"
        )
        for p in ttft["points"]:
            hit = min(p["bsr_cached_tokens"] + p["bsr_sync_cached_tokens"])
            print(
                f"{p['prefix_tokens']:>8} {p['recompute_ttft_s']['median']:>10.3f} "
                f"{p['bsr_ttft_s']['median']:>8.3f} {p['speedup_vs_recompute']:>7.1f}x "
                f"{p['bsr_sync_ttft_s']['median']:>9.3f} {p['async_vs_sync_ttft']:>10.2f} {hit:>8}"
            )
        print("bsr: asynchronous loads (the default); bsr sync: load=sync; bsr hit: the lowest")
        off = ttft["offloading_connector"]
        state = "ran" if off["ran"] else f"did not start: {off['error']}"
        print("vLLM OffloadingConnector:", state)
    if doc["interference"] is not None:
        print_interference(doc["interference"])
    print(f"JSON: {doc['json_path']}")
