"""``bsr bench --engine vllm --vllm-cost``: load or recompute, by cost, against always-load and
always-recompute on the same shared-prefix workload inside vLLM's CPU engine.

Where it runs: like :mod:`.vllm_ttft`, the bench process only orchestrates; every engine runs in
a child process of the vLLM interpreter (:mod:`.vllm_engine` running :func:`child`).

How it works: the TTFT bench's random Llama (:data:`.vllm_ttft.MODEL`, 4 KiB of KV per token)
serves a shared-prefix workload: ``--vllm-cost-prefixes`` distinct prefixes of
``--vllm-cost-tokens`` tokens, every request one of them plus a fresh 32-token suffix, vLLM's own
prefix cache off (every hit is bsr's). Three store conditions, each with two engines over its own
store (``bsr_bench.vllm_cost_connector`` shapes the tiers):

* **fast**: a FileTier just written (page cache warm): loading is fast;
* **slow**: the same FileTier read at ``--vllm-cost-slow-mbps`` per read (a slow remote store,
  a cold shared disk): loading is slower than recomputing;
* **mixed**: a HostTier holding each prefix's first half, the slow FileTier the rest: the host
  part is worth loading, the rest is not.

Engine **load** (``policy="all_or_nothing"``, today's default) times each request twice, loading
(always-load) and with ``{"bsr": {"load": false}}`` (always-recompute: the same engine, bsr not
asked); engine **cost** (``policy="cost"``) times each request once. Before the timed requests
each prefix is stored by a first request and restored by two untimed ones (so the cost engine has
measured its tiers and vLLM's prefill). A sample is the wall time of ``LLM.generate`` with
``max_tokens=1``. The document keeps every sample, min/median/max, the decisions the cost engine
counted (``vllm:bsr_load_decisions``), and per condition the ratio of the cost policy's median
to the better of the other two (the target: at most 1.1, noise included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common.stats import BenchError, Dist, load_average, ratio
from .vllm_common import object_files, run_child, tokens, vllm_python, vllm_version
from .vllm_engine import (
    EngineSpec,
    Outcome,
    bsr_config,
    bsr_transfer,
    file_tier,
    first_token,
    metric_values,
    start_llm,
    suffixed,
    timed_generate,
    wait_for_objects,
)
from .vllm_ttft import BLOCK_SIZE, CHUNK_TOKENS, MODEL, SUFFIX_TOKENS

CONDITIONS = ("fast", "slow", "mixed")
POLICIES = ("load", "cost")
#: the target: the cost policy's median TTFT over the better of always-load and always-recompute
TARGET = 1.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM cost policy (--engine vllm --vllm-cost)")
    g.add_argument(
        "--vllm-cost",
        action="store_true",
        help="policy 'cost' vs always-load vs always-recompute on a shared-prefix workload, "
        "three store conditions (fast, slow, mixed); needs vLLM",
    )
    g.add_argument(
        "--vllm-cost-tokens", type=int, default=None, help="prefix tokens (default 2048)"
    )
    g.add_argument(
        "--vllm-cost-prefixes", type=int, default=None, help="distinct prefixes (default 2)"
    )
    g.add_argument(
        "--vllm-cost-slow-mbps",
        type=float,
        default=None,
        help="the slow tier's read rate per read, MB/s (default 0.5)",
    )


# --------------------------------------------------------------------------- child side
def _tiers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The condition's tiers, shaped by the connector through ``BSR_BENCH_TIERS`` (set here):
    a FileTier, slow under ``slow`` and ``mixed``, a HostTier before it under ``mixed``."""
    cond, n = spec["condition"], spec["prefix_tokens"]
    slow = spec["slow_bytes_per_s"] if cond in ("slow", "mixed") else None
    host = (n // CHUNK_TOKENS) // 2 if cond == "mixed" else None
    os.environ["BSR_BENCH_TIERS"] = json.dumps({"slow_bytes_per_s": slow, "host_chunks": host})
    tiers = [file_tier(spec["store"])]
    if cond == "mixed":
        tiers.insert(0, {"kind": "host", "capacity_bytes": 1 << 30})
    return tiers


def _transfer(spec: dict[str, Any], tiers: list[dict[str, Any]]) -> dict[str, Any]:
    """The cost bench's connector over ``tiers`` with the spec's policy."""
    policy = "cost" if spec["policy"] == "cost" else "all_or_nothing"
    return bsr_transfer(
        bsr_config(tiers, CHUNK_TOKENS, policy=policy),
        connector="CostBenchConnector",
        module="bsr_bench.vllm_cost_connector",
    )


def _ask(
    llm: Any, spec: dict[str, Any], prefix: list[int], i: int, load: bool = True
) -> tuple[float, int]:
    """One request ``prefix`` + a fresh suffix (bsr not asked to load unless ``load``);
    return its wall time and the tokens vLLM found cached."""
    prompt = suffixed(prefix, SUFFIX_TOKENS, spec["seed"], i, MODEL["vocab_size"])
    extra = None if load else {"kv_transfer_params": {"bsr": {"load": False}}}
    return timed_generate(llm, prompt, first_token(extra))


def _prepare(llm: Any, spec: dict[str, Any], prefixes: list[list[int]]) -> None:
    """Store each prefix (waiting for its files), then restore each twice, untimed."""
    n = spec["prefix_tokens"]
    for i, p in enumerate(prefixes):  # store each prefix (saved after the request ends)
        before = object_files(spec["store"])
        _ask(llm, spec, p, -1 - i)
        wait_for_objects(spec["store"], before + n // CHUNK_TOKENS, 300, poll_s=0.1)
    for i, p in enumerate(prefixes):  # untimed restores: every tier and the prefill measured
        for j in range(2):
            _ask(llm, spec, p, -100 - 10 * i - j)


def child(spec: dict[str, Any]) -> Outcome:
    """One engine: the workload under one condition and one policy (child process)."""
    cond, policy, n = spec["condition"], spec["policy"], spec["prefix_tokens"]
    tiers = _tiers(spec)
    load_start = load_average()
    engine = EngineSpec(spec["model"], n + 2 * SUFFIX_TOKENS, BLOCK_SIZE, log_stats=True)
    llm, start_s = start_llm(engine, _transfer(spec, tiers))
    vocab = MODEL["vocab_size"]
    prefixes = [tokens(n, spec["seed"] + 1000 * i + n, vocab) for i in range(spec["prefixes"])]
    _prepare(llm, spec, prefixes)
    decisions0 = metric_values(llm, "vllm:bsr_load_decisions")
    samples: dict[str, list[float]] = {}
    cached: dict[str, list[int]] = {}
    for r in range(spec["repeats"]):
        for i, p in enumerate(prefixes):
            ways = [("cost", True)] if policy == "cost" else [("load", True), ("recompute", False)]
            for way, load in ways:
                s, c = _ask(llm, spec, p, r * 100 + i, load)
                samples.setdefault(way, []).append(s)
                cached.setdefault(way, []).append(c)
    decisions = {
        k: v - decisions0.get(k, 0.0)
        for k, v in metric_values(llm, "vllm:bsr_load_decisions").items()
    }
    result = {
        "condition": cond, "policy": policy, "start_s": start_s, "ttft_s": samples,
        "cached_tokens": cached, "decisions": {k: v for k, v in decisions.items() if v},
        "load_average": [load_start, load_average()],
    }  # fmt: skip
    return result, llm


# --------------------------------------------------------------------------- bench side
def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench --engine vllm --vllm-cost``: run, print the table, return the document."""
    doc = run_cost(ns)
    print_table(doc)
    return doc


def _plan(ns: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(ns, "quick", False))
    n = getattr(ns, "vllm_cost_tokens", None) or (1024 if quick else 2048)
    k = getattr(ns, "vllm_cost_prefixes", None) or (1 if quick else 2)
    repeats = getattr(ns, "vllm_repeats", None)
    repeats = (2 if quick else 4) if repeats is None else repeats
    mbps = getattr(ns, "vllm_cost_slow_mbps", None) or 0.5
    if n < 2 * CHUNK_TOKENS or n % (2 * CHUNK_TOKENS):
        raise BenchError(
            f"--vllm-cost-tokens must be a multiple of {2 * CHUNK_TOKENS} (two chunks at least: "
            f"the mixed condition splits it in halves), got {n}"
        )
    if k < 1 or repeats < 1 or not mbps > 0:
        raise BenchError(
            "--vllm-cost-prefixes and --vllm-repeats must be >= 1 and --vllm-cost-slow-mbps > 0"
        )
    return {"prefix_tokens": n, "prefixes": k, "repeats": repeats, "slow_bytes_per_s": mbps * 1e6}


def run_cost(ns: argparse.Namespace) -> dict[str, Any]:
    from .common.machine import commit_info, machine_info  # not in the child: psutil, torch

    plan = _plan(ns)
    python = vllm_python(getattr(ns, "vllm_python", None))
    version = vllm_version(python)
    seed = int(getattr(ns, "seed", 0) or 0)
    machine, commit = machine_info(), commit_info()
    work = Path(tempfile.mkdtemp(prefix="bsr-vllm-cost-"))
    t_start = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    try:
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(MODEL))
        for cond in CONDITIONS:
            for policy in POLICIES:
                name = f"{cond}-{policy}"
                spec = {
                    **plan, "model": str(work / "model"), "seed": seed, "condition": cond,
                    "policy": policy, "store": str(work / f"store-{name}"),
                }  # fmt: skip
                runs[name] = run_child(python, "bsr_bench.vllm_cost", spec, work, name, 3600)
                if "error" in runs[name]:
                    raise BenchError(f"the {name} engine failed: {runs[name]['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine["load_average_end"] = load_average()
    doc = {
        "kind": "vllm_cost",
        "vllm": version,
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": CHUNK_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        **plan,
        "seed": seed,
        "argv": sys.argv[1:],
        "target": f"cost median <= {TARGET} x the better of always-load and always-recompute",
        "conditions": conditions(runs),
        "engine_start_s": {k: v.get("start_s") for k, v in runs.items()},
        "load_average": {k: v.get("load_average") for k, v in runs.items()},
        "machine": machine,
        "commit": commit,
        "duration_s": time.perf_counter() - t_start,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(getattr(ns, "json", None) or f"bench/results/vllm-cost-{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    doc["json_path"] = str(path)
    return doc


def conditions(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per condition: each policy's TTFT distribution, cached tokens, the cost engine's
    decisions, and the cost policy's median over the better of the other two."""
    out = []
    for cond in CONDITIONS:
        load, cost = runs[f"{cond}-load"], runs[f"{cond}-cost"]
        d = {
            "load": Dist.of(load["ttft_s"]["load"]),
            "recompute": Dist.of(load["ttft_s"]["recompute"]),
            "cost": Dist.of(cost["ttft_s"]["cost"]),
        }
        best = min(d["load"].median, d["recompute"].median)
        over = ratio(d["cost"].median, best, f"{cond}: cost/best")
        out.append(
            {
                "condition": cond,
                **{f"{w}_ttft_s": d[w].to_dict() for w in d},
                "load_cached_tokens": load["cached_tokens"]["load"],
                "recompute_cached_tokens": load["cached_tokens"]["recompute"],
                "cost_cached_tokens": cost["cached_tokens"]["cost"],
                "cost_decisions": cost.get("decisions", {}),
                "better_of_the_two": "load"
                if d["load"].median <= d["recompute"].median
                else "recompute",
                "cost_over_best": over,
                "target_met": over <= TARGET,
            }
        )
    return out


def print_table(doc: dict[str, Any]) -> None:
    print(
        f"vLLM {doc['vllm']} CPU, random Llama, {doc['prefixes']} prefixes of "
        f"{doc['prefix_tokens']} tokens, median TTFT (s) of {doc['repeats']} x {doc['prefixes']}"
    )
    print(
        f"{'condition':>9} {'always-load':>12} {'always-recompute':>17} {'cost':>8} "
        f"{'cost/best':>10} {'cost cached':>12}  decisions"
    )
    for c in doc["conditions"]:
        print(
            f"{c['condition']:>9} {c['load_ttft_s']['median']:>12.3f} "
            f"{c['recompute_ttft_s']['median']:>17.3f} {c['cost_ttft_s']['median']:>8.3f} "
            f"{c['cost_over_best']:>9.2f}x {min(c['cost_cached_tokens']):>12}  "
            f"{c['cost_decisions']}"
        )
    print(f"JSON: {doc['json_path']}")
