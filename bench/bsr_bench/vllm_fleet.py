"""``bsr bench --engine vllm --vllm-fleet``: a fleet of three ``vllm serve`` instances behind a
router, with private bsr caches, one shared pool, the KV-event router and vLLM alone; and a
prefill/decode split through the pool.

Where it runs: one child process of the interpreter that has vLLM (:mod:`.vllm_common`;
:mod:`.vllm_fleet_child`) starts the instances (``python -m vllm.entrypoints.openai.api_server``,
three at a time at most), runs bsr's router (:mod:`bsr.router`) in its own threads and sends the
requests; this module plans the run, turns the child's samples into the section, validates the
document against ``schema.json`` (``fleet_document``) and prints the table.

How it works: a random-weight Llama (the TTFT model of :mod:`.vllm_ttft`, dummy weights: TTFT
only) serves a workload of conversations: turn 0 is a ``--vllm-fleet-prefix``-token prompt, each
later turn is the previous prompt, its answer (16 tokens) and 256 new user tokens. Turns go round
by round (every conversation's turn r before any turn r + 1), in waves of three requests sent
50 ms apart (a fleet's concurrent arrivals: the router's load then means something); the
conversation count is not a multiple of three, so under round-robin a conversation's turns land on
different instances. Every instance has a small KV cache (``--vllm-fleet-gpu-tokens``): a busy
instance evicts the conversations it served a few requests ago, as a loaded fleet does. Four
variants, three instances each:

* **private_rr**: each instance with bsr over a FileTier root of its own, round-robin;
* **shared_rr**: the three over one FileTier root (the pool), round-robin;
* **shared_router**: the same pool behind the KV-event router (policy ``prefix``: the longest
  cached prefix, ties by load; the instances publish vLLM's and bsr's KV events to it);
* **vllm_rr**: vLLM alone (no connector), round-robin.

shared_rr and shared_router run on the same three instances, one after the other, each with a
``cache_salt`` of its own (bsr's keys and vLLM's prefix cache are salted apart: neither sees the
other's KV). Every instance runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM's CPU build
reserves one more core for a server with a KV connector, so without the pin the servers with and
without bsr would compute on different thread counts).

A sample is one streamed completion through the router: its TTFT is the time from sending the
request to the first streamed token, its hit the ``usage.prompt_tokens_details.cached_tokens``
vLLM reports (``--enable-prompt-tokens-details``). The pool's files were just written: loads read
from the page cache.

The P/D split: a prefill instance (``kv_producer``) and a decode instance (``kv_consumer``, a
host tier above the pool, its warm endpoint) behind :class:`bsr.router.PDSplit`, and one
``kv_both`` instance beside them; ``--vllm-fleet-pd-prompts`` fresh prompts as long as the
workload's last turn, each sent through the split and to the single instance, ``max_tokens`` 1,
not streamed: the sample is the request's latency (through the split: prefill, the wait for its
save, the decode side's load and first token), and the tokens the decode side prefilled.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .common.stats import BenchError, Dist, load_average, ratio
from .vllm_common import run_child, tokens, vllm_python, vllm_version
from .vllm_ttft import BLOCK_SIZE, CHUNK_TOKENS, MODEL

#: instances of each fleet variant (and requests in flight at once)
INSTANCES = 3
VARIANTS = ("private_rr", "shared_rr", "shared_router", "vllm_rr")
#: the tokens of each answer and of each new user message after the first turn
ANSWER_TOKENS = 16
USER_TOKENS = 256
#: KV bytes per token of :data:`MODEL` in bfloat16 (K and V, every layer)
KV_BYTES_PER_TOKEN = (
    2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"]
    * (MODEL["hidden_size"] // MODEL["num_attention_heads"]) * 2
)  # fmt: skip
#: the issue's target: shared pool + router this many times lower returning-turn TTFT p50
TARGET_SPEEDUP = 3.0


@dataclass(frozen=True)
class Workload:
    """The conversations every variant serves."""

    conversations: int
    turns: int
    prefix_tokens: int
    user_tokens: int = USER_TOKENS
    answer_tokens: int = ANSWER_TOKENS
    concurrency: int = INSTANCES
    seed: int = 0

    def check(self) -> None:
        """A :class:`BenchError` naming the flag to change when the workload cannot show a
        fleet."""
        if self.conversations < 2:
            raise BenchError(f"--vllm-fleet-conversations must be >= 2, got {self.conversations}")
        if self.conversations % INSTANCES == 0:
            raise BenchError(
                f"--vllm-fleet-conversations must not be a multiple of {INSTANCES} (got "
                f"{self.conversations}): under round-robin each conversation's turns would land "
                "on one instance"
            )
        if self.turns < 2:
            raise BenchError(
                f"--vllm-fleet-turns must be >= 2 (a returning turn), got {self.turns}"
            )
        if self.prefix_tokens < CHUNK_TOKENS:
            raise BenchError(
                f"--vllm-fleet-prefix must be >= {CHUNK_TOKENS} tokens (one bsr chunk), "
                f"got {self.prefix_tokens}"
            )

    def prompt_tokens(self, turn: int) -> int:
        """The prompt length of turn ``turn`` (0-based)."""
        return self.prefix_tokens + turn * (self.answer_tokens + self.user_tokens)

    def max_model_len(self) -> int:
        """The engines' ``--max-model-len``: the last turn and its answer, in whole blocks."""
        n = self.prompt_tokens(self.turns - 1) + self.answer_tokens
        return -(-n // BLOCK_SIZE) * BLOCK_SIZE

    def user_part(self, conversation: int, turn: int) -> list[int]:
        """The new tokens of ``turn`` (the first prompt, or a user message)."""
        n = self.prefix_tokens if turn == 0 else self.user_tokens
        seed = self.seed * 1_000_003 + conversation * 1009 + turn * 31
        return tokens(n, seed, MODEL["vocab_size"])

    def waves(self) -> list[list[tuple[int, int]]]:
        """The order of the requests: ``(conversation, turn)`` pairs, round by round, in waves
        of :attr:`concurrency` sent together (a wave never holds two turns of one
        conversation)."""
        out = []
        for r in range(self.turns):
            row = [(k, r) for k in range(self.conversations)]
            out += [row[i : i + self.concurrency] for i in range(0, len(row), self.concurrency)]
        return out

    def round_robin(self, instances: int = INSTANCES) -> dict[int, list[int]]:
        """Under round-robin: conversation -> the instance (index) each of its turns lands on."""
        order = [pair for wave in self.waves() for pair in wave]
        out: dict[int, list[int]] = {k: [] for k in range(self.conversations)}
        for i, (k, _r) in enumerate(order):
            out[k].append(i % instances)
        return out


# --------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks."""
    if not values:
        raise BenchError("a percentile of no samples")
    if not 0 <= q <= 100:
        raise BenchError(f"a percentile must be within 0-100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft_stats(values: Sequence[float]) -> dict[str, Any]:
    """min/median/max/values (schema's ``dist``) with p50 and p99."""
    d = Dist.of(list(values)).to_dict()
    return {**d, "p50": percentile(values, 50), "p99": percentile(values, 99)}


def hit_rate(samples: Sequence[dict[str, Any]]) -> float:
    """Cached prompt tokens over prompt tokens, summed over ``samples``."""
    prompt = sum(int(s["prompt_tokens"]) for s in samples)
    if prompt <= 0:
        raise BenchError("a hit rate of no prompt tokens")
    return sum(int(s["cached_tokens"]) for s in samples) / prompt


def variant_summary(samples: Sequence[dict[str, Any]], decisions: dict[str, int]) -> dict[str, Any]:
    """One variant's record: returning turns (turn >= 1) and first turns apart."""
    back = [s for s in samples if s["turn"] > 0]
    first = [s for s in samples if s["turn"] == 0]
    if not back or not first:
        raise BenchError("a variant needs first and returning turns")
    by_conv: dict[int, set[str]] = {}
    for s in samples:
        by_conv.setdefault(int(s["conversation"]), set()).add(str(s["instance"]))
    return {
        "returning": {
            "requests": len(back),
            "prompt_tokens": sum(int(s["prompt_tokens"]) for s in back),
            "cached_tokens": sum(int(s["cached_tokens"]) for s in back),
            "hit_rate": hit_rate(back),
            "ttft_s": ttft_stats([s["ttft_s"] for s in back]),
        },
        "first_turn": {
            "requests": len(first),
            "hit_rate": hit_rate(first),
            "ttft_s": ttft_stats([s["ttft_s"] for s in first]),
        },
        "decisions": dict(decisions),
        "instances_per_conversation": {str(k): len(v) for k, v in sorted(by_conv.items())},
        "samples": list(samples),
    }


def fleet_ratios(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Returning-turn TTFT p50 of each variant over private_rr's, and the issue's target."""
    p50 = {k: v["returning"]["ttft_s"]["p50"] for k, v in variants.items()}
    base = p50["private_rr"]
    ratios = {
        f"{k}_vs_private_rr": ratio(p50[k], base, f"{k}/private_rr TTFT p50")
        for k in ("shared_rr", "shared_router", "vllm_rr")
    }
    speedup = ratio(base, p50["shared_router"], "private_rr/shared_router TTFT p50")
    target = {
        "name": "returning-turn TTFT p50: shared pool + router >= 3x lower than private caches "
        "round-robin",
        "speedup": speedup,
        "threshold": TARGET_SPEEDUP,
        "met": speedup >= TARGET_SPEEDUP,
    }
    return {"ratios": ratios, "target": target}


def pd_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """The P/D record: latency through the split and on one kv_both instance, prefilled tokens."""
    samples = raw["samples"]
    if not samples:
        raise BenchError("the P/D split ran no prompts")
    split = [s["split_s"] for s in samples]
    single = [s["single_s"] for s in samples]
    prompt = sum(int(s["prompt_tokens"]) for s in samples)
    return {
        "prompts": len(samples),
        "prompt_tokens": prompt,
        "decode_prefilled_tokens": sum(int(s["decode_prefilled"]) for s in samples),
        "single_prefilled_tokens": sum(int(s["prompt_tokens"]) - int(s["single_cached"])
                                       for s in samples),
        "split_ttft_s": ttft_stats(split),
        "single_ttft_s": ttft_stats(single),
        "split_vs_single": ratio(
            percentile(split, 50), percentile(single, 50), "P/D split/single TTFT p50"
        ),
        "await_timeouts": int(raw["stats"]["await_timeouts"]),
        "measured": "the latency of a max_tokens=1, non-streamed completion: through the "
        "split, the prefill instance's request, the wait until the decode side's warm endpoint "
        "finds the prompt's whole chunks in the pool, and the decode instance's request (its "
        "load and first token); on the single kv_both instance, one request computing it all",
        "samples": samples,
    }  # fmt: skip


def fleet_section(measured: dict[str, Any], work: Workload, gpu_tokens: int,
                  duration_s: float) -> dict[str, Any]:  # fmt: skip
    """The ``fleet`` section from the child's record."""
    variants = {
        name: variant_summary(measured["variants"][name]["samples"],
                              measured["variants"][name]["decisions"])
        for name in VARIANTS
    }  # fmt: skip
    return {
        "instances": INSTANCES,
        "workload": {**asdict(work), "prompt_tokens_by_turn": [
            work.prompt_tokens(r) for r in range(work.turns)]},
        "gpu_cache_tokens": gpu_tokens,
        "variants": variants,
        **fleet_ratios(variants),
        "pd": pd_summary(measured["pd"]),
        "ttft": "time from sending a streamed completion through the router to its first "
        "streamed token (requests in waves of three, 50 ms apart)",
        "eviction": f"vLLM's KV cache holds {gpu_tokens} tokens per instance: a busy instance "
        "evicts what it served a few requests ago (no prefix-cache resets)",
        "shared_instances": "shared_rr and shared_router run on the same three instances, one "
        "after the other, each with its own cache_salt (keys and vLLM's prefix cache salted "
        "apart)",
        "cpu_pinning": "VLLM_CPU_NUM_OF_RESERVED_CPU=1 on every instance",
        "page_cache": "the pool's files were just written: loads read from the page cache",
        "engine_start_s": measured["engine_start_s"],
        "load_average": measured.get("load_average"),
        "duration_s": duration_s,
    }  # fmt: skip


# --------------------------------------------------------------------------- bench side
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM fleet (--engine vllm --vllm-fleet)")
    g.add_argument(
        "--vllm-fleet",
        action="store_true",
        help="three vllm serve instances behind bsr's router: private bsr caches, one shared "
        "pool (round-robin and the KV-event router), vLLM alone; and a prefill/decode split "
        "through the pool; needs vLLM",
    )
    g.add_argument(
        "--vllm-fleet-conversations",
        type=int,
        default=None,
        help="conversations, not a multiple of 3 (default 5; --quick 4)",
    )
    g.add_argument(
        "--vllm-fleet-turns", type=int, default=None, help="turns per conversation (default 4; "
        "--quick 3)",
    )  # fmt: skip
    g.add_argument(
        "--vllm-fleet-prefix",
        type=int,
        default=None,
        help="tokens of a conversation's first prompt (default 1024; --quick 512); each later "
        f"turn adds its answer ({ANSWER_TOKENS}) and {USER_TOKENS} user tokens",
    )
    g.add_argument(
        "--vllm-fleet-gpu-tokens",
        type=int,
        default=None,
        help="vLLM's KV cache per instance in tokens (default 4096): small, so a busy instance "
        "evicts",
    )
    g.add_argument(
        "--vllm-fleet-pd-prompts",
        type=int,
        default=None,
        help="prompts sent through the P/D split and to one kv_both instance (default 4; "
        "--quick 2)",
    )


def plan(ns: argparse.Namespace) -> dict[str, Any]:
    """The run's workload and sizes from the flags; a :class:`BenchError` naming the flag."""
    quick = bool(getattr(ns, "quick", False))

    def pick(flag: str, default: int, quick_default: int) -> int:
        value = getattr(ns, flag, None)
        return (quick_default if quick else default) if value is None else int(value)

    work = Workload(
        conversations=pick("vllm_fleet_conversations", 5, 4),
        turns=pick("vllm_fleet_turns", 4, 3),
        prefix_tokens=pick("vllm_fleet_prefix", 1024, 512),
        seed=int(getattr(ns, "seed", 0) or 0),
    )
    work.check()
    gpu = pick("vllm_fleet_gpu_tokens", 4096, 4096)
    if gpu < work.max_model_len() + 2 * BLOCK_SIZE:
        raise BenchError(
            f"--vllm-fleet-gpu-tokens must hold the last turn and two blocks more: >= "
            f"{work.max_model_len() + 2 * BLOCK_SIZE} tokens, got {gpu}"
        )
    pd = pick("vllm_fleet_pd_prompts", 4, 2)
    if pd < 1:
        raise BenchError(f"--vllm-fleet-pd-prompts must be >= 1, got {pd}")
    return {"workload": work, "gpu_tokens": gpu, "pd_prompts": pd}


def run_fleet(python: str, p: dict[str, Any]) -> dict[str, Any]:
    """The fleet section: the child's run, then its record."""
    work: Workload = p["workload"]
    root = Path(tempfile.mkdtemp(prefix="bsr-vllm-fleet-"))
    t0 = time.perf_counter()
    try:
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(MODEL))
        spec = {
            "model": str(root / "model"), "work": str(root), "workload": asdict(work),
            "gpu_tokens": p["gpu_tokens"], "max_model_len": work.max_model_len(),
            "pd_prompts": p["pd_prompts"],
        }  # fmt: skip
        measured = run_child(python, "bsr_bench.vllm_fleet_child", spec, root, "fleet", 3600)
        if "error" in measured:
            raise BenchError(f"the fleet failed: {measured['error']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return fleet_section(measured, work, p["gpu_tokens"], time.perf_counter() - t0)


def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench --engine vllm --vllm-fleet``: run, validate and write the JSON, print the
    table."""
    from .common.document import SCHEMA_VERSION, validate, write_json
    from .common.machine import commit_info, machine_info  # not in the child: psutil, torch

    p = plan(ns)
    python = vllm_python(getattr(ns, "vllm_python", None))
    version = vllm_version(python)
    machine, commit = machine_info(), commit_info()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    fleet = run_fleet(python, p)
    machine["load_average_end"] = load_average()
    doc = {
        "schema_version": SCHEMA_VERSION,
        "tool": "bsr bench --engine vllm --vllm-fleet",
        "started_at": started,
        "duration_s": time.perf_counter() - t0,
        "argv": sys.argv[1:],
        "args": {"quick": bool(getattr(ns, "quick", False)), **asdict(p["workload"]),
                 "gpu_tokens": p["gpu_tokens"], "pd_prompts": p["pd_prompts"]},
        "seed": p["workload"].seed,
        "vllm": version,
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": CHUNK_TOKENS,
        "fleet": fleet,
        "machine": machine,
        "commit": commit,
        "warnings": [] if fleet["target"]["met"] else [
            f"target not met: shared pool + router returning-turn TTFT p50 is "
            f"{fleet['target']['speedup']:.2f}x lower than private caches round-robin "
            f"(target {TARGET_SPEEDUP:g}x)"
        ],
    }  # fmt: skip
    validate(doc, "fleet_document")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(getattr(ns, "json", None) or f"bench/results/vllm-fleet-{stamp}.json")
    write_json(doc, path)
    doc["json_path"] = str(path)
    print_table(doc)
    return doc


def print_table(doc: dict[str, Any]) -> None:
    fleet = doc["fleet"]
    w = fleet["workload"]
    print(
        f"vLLM {doc['vllm']} CPU, random Llama, {fleet['instances']} instances, "
        f"{w['conversations']} conversations x {w['turns']} turns "
        f"(prompts {w['prompt_tokens_by_turn']} tokens); TTFT: first streamed token"
    )
    print(f"{'variant':<14} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'first p50':>9}"
          f" {'vs private':>10}  decisions")  # fmt: skip
    for name, v in fleet["variants"].items():
        back = v["returning"]
        vs = fleet["ratios"].get(f"{name}_vs_private_rr", 1.0)
        print(
            f"{name:<14} {back['hit_rate']:>8.1%} {back['ttft_s']['p50']:>9.3f} "
            f"{back['ttft_s']['p99']:>9.3f} {v['first_turn']['ttft_s']['p50']:>9.3f} "
            f"{vs:>10.3f}  {v['decisions']}"
        )
    t = fleet["target"]
    print(f"shared pool + router vs private caches RR: {t['speedup']:.2f}x lower returning-turn "
          f"TTFT p50 (target {t['threshold']:g}x: {'met' if t['met'] else 'NOT met'})")  # fmt: skip
    pd = fleet["pd"]
    print(
        f"P/D split: {pd['prompts']} prompts of {pd['prompt_tokens'] // pd['prompts']} tokens, "
        f"TTFT p50 {pd['split_ttft_s']['p50']:.3f} s (one kv_both instance "
        f"{pd['single_ttft_s']['p50']:.3f} s); the decode side prefilled "
        f"{pd['decode_prefilled_tokens']} of {pd['prompt_tokens']} prompt tokens"
    )
    print(f"JSON: {doc['json_path']}")
