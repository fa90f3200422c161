"""One engine of the interference section: decoders running, long-prefix requests arriving.

Where it runs: a child process of the bench under the interpreter that has vLLM
(:mod:`.vllm_engine` running :func:`child`); the bench process only plans and analyses
(:mod:`.vllm_interference`). Three jobs, by the spec's ``job``:

* ``model``: write the random Llama with transformers ``save_pretrained`` (vLLM's own
  transformers, so that vLLM reads what it wrote);
* ``store``: an engine whose connector only saves (``kv_producer``) computes ``prefix + new``
  once and waits until every full chunk of the prefix is an object on disk;
* ``rounds``: one variant's engine runs the rounds of ``spec["rounds"]`` and records raw
  timestamps.

How a round goes: a *variant* round empties vLLM's prefix cache and puts the store's files in
the variant's page-cache state (``warm``: every file read once; ``cold``: dropped, and the tier
reads with O_DIRECT); a *local-hit* round does neither, so the prefix the round before brought
back is still in vLLM's cache. Then ``decoders`` requests with short prompts are added and
stepped until each has ``before_tokens`` tokens; one request whose prompt is the stored prefix
plus ``new_tokens`` fresh tokens arrives, and the engine is stepped until that request has its
first token and the decoders ``after_tokens`` more; the decoders are then aborted.

Timestamps: the engine core runs in its own process (vLLM's default, as in a server) and
stamps each step's outputs with ``time.monotonic()`` when it builds them
(``EngineCoreOutputs.timestamp``); the child steps the engine with ``LLMEngine.step`` and keeps,
per request, the stamp of every step that gave it a token. The arrival's time is
``time.monotonic()`` just before ``add_request``; both clocks are the system's monotonic clock.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .common.stats import load_average
from .vllm_common import tokens
from .vllm_engine import (
    EngineSpec,
    Outcome,
    bsr_config,
    bsr_transfer,
    file_tier,
    start_llm,
    wait_for_objects,
)


def object_paths(store: str) -> list[str]:
    """The FileTier's object files."""
    return sorted(str(p) for p in Path(store).glob("objects/**/*.bsr") if p.is_file())


def write_model(spec: dict[str, Any]) -> dict[str, Any]:
    """The random Llama, written by transformers (bf16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    model: Any = LlamaForCausalLM(LlamaConfig(**spec["config"]))  # transformers' stubs vary
    model.to(torch.bfloat16).save_pretrained(spec["model"])
    return {"params": sum(p.numel() for p in model.parameters())}


def _engine(spec: dict[str, Any]) -> tuple[Any, float]:
    """The job's engine: the model's own weights, vLLM's prefix cache on, stats off; bsr's
    connector in the spec's role and load mode over a FileTier (O_DIRECT reads where the spec's
    ``connector`` asks), or none."""
    conn = spec.get("connector")
    transfer = None
    if conn is not None:
        direct = bool(conn.get("direct_io", False))
        tier = file_tier(spec["store"], spec["store_capacity_bytes"], direct_io=direct)
        transfer = bsr_transfer(
            bsr_config([tier], spec["chunk_tokens"], spec["window"], spec["io_depth"]),
            role=conn["role"],
            options={"load": conn.get("load", "async")},
        )
    engine = EngineSpec(
        spec["model"],
        spec["prefix_tokens"] + spec["new_tokens"] + 64,
        spec["block_size"],
        kv_cache_bytes=spec["kv_cache_bytes"],
        dummy_weights=False,
        prefix_caching=True,
        log_stats=False,
    )
    return start_llm(engine, transfer)


class _Stepper:
    """``LLMEngine.step`` with each step's engine-core timestamp kept per request token."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        core = self.engine.engine_core
        inner = core.get_output
        self.stamp = 0.0

        def get_output() -> Any:
            out = inner()
            self.stamp = float(out.timestamp) or time.monotonic()
            return out

        core.get_output = get_output
        self.tokens: dict[str, list[float]] = {}
        self.cached: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> float:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        self.tokens[rid] = []
        t = time.monotonic()
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        return t

    def step(self) -> None:
        for o in self.engine.step():
            seen = self.tokens.get(o.request_id)
            if seen is None:
                continue
            n = len(o.outputs[0].token_ids)
            seen.extend([self.stamp] * (n - len(seen)))
            if o.num_cached_tokens is not None:
                self.cached[o.request_id] = int(o.num_cached_tokens)

    def until(self, done: Any, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while not done():
            if time.monotonic() > end:
                raise RuntimeError(f"the engine did not get there within {limit_s} s")
            self.step()

    def drain(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        end = time.monotonic() + 120
        while self.engine.has_unfinished_requests() and time.monotonic() < end:
            self.step()


def _reset_prefix_cache(llm: Any) -> None:
    end = time.monotonic() + 120
    while not llm.reset_prefix_cache():
        if time.monotonic() > end:
            raise RuntimeError("vLLM's prefix cache could not be emptied: blocks still held")
        time.sleep(0.05)


def _page_state(spec: dict[str, Any]) -> float | None:
    """Put the store's files in the round's page-cache state; the resident fraction after."""
    from .common.pagecache import CacheMode, prepare

    cache = spec.get("cache")
    if cache is None:
        return None
    return prepare(CacheMode(cache), object_paths(spec["store"]))


def run_store(spec: dict[str, Any]) -> Outcome:
    """Compute ``prefix + new`` once with a saving-only connector; wait for the objects."""
    llm, _ = _engine(spec)
    vocab = spec["config"]["vocab_size"]
    prefix = tokens(spec["prefix_tokens"], spec["seed"], vocab)
    stepper = _Stepper(llm)
    t = stepper.add("store", prefix + tokens(spec["new_tokens"], spec["seed"] + 1, vocab), 1)
    stepper.until(lambda: len(stepper.tokens["store"]) >= 1, 3600)
    prefill_s = stepper.tokens["store"][0] - t
    want = spec["prefix_tokens"] // spec["chunk_tokens"]
    if wait_for_objects(spec["store"], want, 600, poll_s=0.1) < want:
        raise RuntimeError(f"fewer than {want} objects in the store after 600 s")
    files = object_paths(spec["store"])
    result = {
        "prefill_s": prefill_s,
        "objects": len(files),
        "object_bytes": sum(os.path.getsize(p) for p in files),
    }
    return result, llm


def run_rounds(spec: dict[str, Any]) -> Outcome:
    """One variant's rounds, in the order of ``spec["rounds"]`` (see the module docstring)."""
    load_start = load_average()
    llm, start_s = _engine(spec)
    sched = llm.llm_engine.vllm_config.scheduler_config
    vocab = spec["config"]["vocab_size"]
    prefix = tokens(spec["prefix_tokens"], spec["seed"], vocab)
    stepper = _Stepper(llm)
    rounds = [_round(spec, llm, stepper, prefix, i, plan) for i, plan in enumerate(spec["rounds"])]
    out = {
        "start_s": start_s,
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "chunked_prefill": bool(sched.enable_chunked_prefill),
        "load_average": [load_start, load_average()],
        "rounds": rounds,
    }
    return out, llm


def _round(
    spec: dict[str, Any], llm: Any, stepper: _Stepper, prefix: list[int], r: int,
    plan: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """One round; times in the record are seconds from the arrival."""
    vocab = spec["config"]["vocab_size"]
    local = plan["kind"] == "local_hit"
    resident = None
    if not local:  # vLLM forgets the prefix: the variant's own way must bring it back
        _reset_prefix_cache(llm)
        resident = _page_state(spec)
    dec = [f"r{r}-d{i}" for i in range(spec["decoders"])]
    base = spec["seed"] * 1000003 + r * 101
    for i, rid in enumerate(dec):
        stepper.add(rid, tokens(spec["decoder_prompt_tokens"], base + i, vocab), 1 << 20)
    before = spec["before_tokens"]
    stepper.until(lambda: all(len(stepper.tokens[d]) >= before for d in dec), 600)
    arrival = f"r{r}-new"
    suffix = tokens(spec["new_tokens"], base + 99, vocab)
    t_arrive = stepper.add(arrival, prefix + suffix, 1)
    stepper.until(lambda: len(stepper.tokens[arrival]) >= 1, 3600)
    after = {d: len(stepper.tokens[d]) + spec["after_tokens"] for d in dec}
    stepper.until(lambda: all(len(stepper.tokens[d]) >= after[d] for d in dec), 600)
    stepper.drain(dec)
    return {
        "kind": plan["kind"],
        "warmup": bool(plan.get("warmup", False)),
        "resident_fraction": resident,
        "ttft_s": stepper.tokens[arrival][0] - t_arrive,
        "cached_tokens": stepper.cached.get(arrival),
        "decoders": [[t - t_arrive for t in stepper.tokens.pop(d)] for d in dec],
    }


def child(spec: dict[str, Any]) -> Outcome:
    """The spec's job: ``model`` (no engine), ``store`` or ``rounds``."""
    job = spec["job"]
    if job == "model":
        return write_model(spec), None
    if job == "store":
        return run_store(spec)
    if job == "rounds":
        return run_rounds(spec)
    raise ValueError(f"unknown job {job!r}")
