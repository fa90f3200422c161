"""The interference section of ``bsr bench --engine vllm``: what a restore costs the requests
already decoding.

How it works: a random Llama with a large KV per token and little compute (32 layers x 16 KV
heads x head_dim 128, bf16: 256 KiB per token; hidden size 256, vocabulary 1024) is written by
transformers, and one engine whose connector only saves (``kv_producer``) stores a 4096-token
prefix (1 GiB of KV) in a FileTier. Then one engine per variant, one after another, each in its
own process (:mod:`.vllm_interference_child`), with vLLM's own prefix cache on and a connector
that only loads (``kv_consumer``, so nothing is saved during the measurements):

* ``sync_warm`` / ``sync_cold``: ``"bsr_connector": {"load": "sync"}``;
* ``async_warm`` / ``async_cold``: the default asynchronous loads;
* ``recompute``: no connector: vLLM prefills the whole prompt.

``warm``: before each round every object file is read once (page cache hot, buffered reads);
``cold``: their pages are dropped (``posix_fadvise``) and the tier reads with O_DIRECT. Each
engine runs rounds: in each, N = 4 requests with short prompts decode, then one request whose
prompt is the stored prefix plus 16 new tokens arrives. A **variant round** first empties
vLLM's prefix cache, so the variant's own way brings the prefix back (a load, or a recompute); a
**local-hit round** follows each variant round without emptying it, so vLLM's prefix cache
already holds the prefix and nothing is loaded: vLLM computes only the 16 new tokens over the
long context, which every connector pays too. Rounds alternate (one variant round of warm-up,
then local-hit, variant, local-hit, variant, ...), so every variant has its own baseline,
measured in the same engine seconds apart.

Figures per round, from the timestamps of every decoded token (:mod:`.vllm_interference_figures`):
the decoders' p50 inter-token latency before the arrival, their largest inter-token gap during
the arrival's window (from its arrival to its first token), and the new request's TTFT. Per
variant, medians over rounds; the stall a load adds = median max gap of the variant rounds
minus that of the same engine's local-hit rounds.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .common.stats import BenchError
from .vllm_common import run_child
from .vllm_interference_figures import GIB, ratios, summarize, targets

CHILD = "bsr_bench.vllm_interference_child"

#: the model: KV 256 KiB per token with 32 layers (layers x 16 heads x 128 x K,V x 2 bytes)
MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class Variant:
    """How one engine brings the prefix back in its variant rounds."""

    name: str
    load: str | None  # "sync" / "async": the connector's mode; None: no connector (recompute)
    cache: str | None  # "warm" / "cold": the store's page-cache state; None: no store read

    def connector(self) -> dict[str, Any] | None:
        if self.load is None:
            return None
        return {"role": "kv_consumer", "load": self.load, "direct_io": self.cache == "cold"}


VARIANTS = {
    v.name: v
    for v in (
        Variant("sync_cold", "sync", "cold"),
        Variant("async_cold", "async", "cold"),
        Variant("sync_warm", "sync", "warm"),
        Variant("async_warm", "async", "warm"),
        Variant("recompute", None, None),
    )
}
QUICK_VARIANTS = ("sync_cold", "async_cold")


@dataclass(frozen=True)
class Plan:
    """The section's sizes (``--vllm-interference-*`` flags, ``--quick``)."""

    prefix_tokens: int = 4096
    arrivals: int = 7
    variants: tuple[str, ...] = tuple(VARIANTS)
    layers: int = 32
    decoders: int = 4
    new_tokens: int = 16
    decoder_prompt_tokens: int = 64
    before_tokens: int = 16
    after_tokens: int = 2
    warmup: int = 1
    chunk_tokens: int = 256
    block_size: int = 128
    window: int = 8
    io_depth: int = 4

    @property
    def kv_bytes_per_token(self) -> int:
        heads, dim = int(MODEL["num_key_value_heads"]), int(MODEL["head_dim"])
        return self.layers * heads * dim * 2 * 2  # K and V, bf16

    @property
    def prefix_bytes(self) -> int:
        return self.prefix_tokens * self.kv_bytes_per_token

    def kv_cache_bytes(self) -> int:
        """vLLM's KV pool: twice what one round holds at once, so the prefix stays cached."""
        blocks = -(-(self.prefix_tokens + self.new_tokens + 1) // self.block_size)
        per_decoder = -(-(self.decoder_prompt_tokens + 4 * self.before_tokens) // self.block_size)
        blocks += self.decoders * per_decoder
        return 2 * blocks * self.block_size * self.kv_bytes_per_token

    def schedule(self) -> list[dict[str, Any]]:
        """The rounds of one engine: variant warm-up(s), then (local hit, variant) pairs."""
        out = [{"kind": "variant", "warmup": True} for _ in range(self.warmup)]
        for _ in range(self.arrivals):
            out += [{"kind": "local_hit"}, {"kind": "variant"}]
        return out


def add_arguments(g: argparse._ArgumentGroup) -> None:
    """The interference section's flags (in the ``--engine vllm`` group)."""
    g.add_argument(
        "--vllm-interference-prefix",
        type=int,
        default=None,
        help="interference: tokens of the stored prefix each arriving request restores "
        "(default 4096: 1 GiB of KV; --quick: 1024)",
    )
    g.add_argument(
        "--vllm-interference-arrivals",
        type=int,
        default=None,
        help="interference: measured arrivals per variant (default 7; --quick: 2)",
    )
    g.add_argument(
        "--vllm-interference-variants",
        default=None,
        help=f"interference: comma-separated subset of {','.join(VARIANTS)} "
        f"(default all; --quick: {','.join(QUICK_VARIANTS)})",
    )
    g.add_argument(
        "--vllm-interference-layers",
        type=int,
        default=None,
        help="interference: model layers, 8 KiB of KV per token each (default 32)",
    )


def plan_from_namespace(ns: argparse.Namespace) -> Plan:
    """The plan the flags ask for; a :class:`BenchError` naming the flag otherwise."""
    quick = bool(getattr(ns, "quick", False))
    prefix = getattr(ns, "vllm_interference_prefix", None) or (1024 if quick else 4096)
    arrivals = getattr(ns, "vllm_interference_arrivals", None)
    arrivals = (2 if quick else 7) if arrivals is None else arrivals
    given = getattr(ns, "vllm_interference_variants", None)
    variants = (
        tuple(v.strip() for v in given.split(",") if v.strip())
        if given
        else (QUICK_VARIANTS if quick else tuple(VARIANTS))
    )
    layers = getattr(ns, "vllm_interference_layers", None) or 32
    plan = Plan(prefix_tokens=prefix, arrivals=arrivals, variants=variants, layers=layers)
    if prefix < plan.chunk_tokens or prefix % plan.chunk_tokens:
        raise BenchError(
            f"--vllm-interference-prefix must be a multiple of {plan.chunk_tokens}, got {prefix}"
        )
    if arrivals < 1:
        raise BenchError(f"--vllm-interference-arrivals must be >= 1, got {arrivals}")
    if layers < 1:
        raise BenchError(f"--vllm-interference-layers must be >= 1, got {layers}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or len(set(variants)) != len(variants):
        raise BenchError(
            f"--vllm-interference-variants takes distinct names among {', '.join(VARIANTS)}; "
            f"got {given!r}"
        )
    return plan


# --------------------------------------------------------------------------- the run
def run_interference(plan: Plan, python: str, seed: int) -> dict[str, Any]:
    """Write the model, store the prefix, run every variant's engine; the section's record."""
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bsr-vllm-interference-"))
    config = {**MODEL, "num_hidden_layers": plan.layers}
    base = {
        **asdict(plan),
        "model": str(work / "model"),
        "config": config,
        "seed": seed,
        "store": str(work / "store"),
        "store_capacity_bytes": 4 * plan.prefix_bytes + GIB,
        "kv_cache_bytes": plan.kv_cache_bytes(),
    }
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        model = _child(python, {**base, "job": "model"}, work, "model", 600)
        phases["model_s"] = time.perf_counter() - t
        t = time.perf_counter()
        spec = {**base, "job": "store", "connector": {"role": "kv_producer", "load": "async"}}
        stored = _child(python, spec, work, "store", 3600)
        phases["store_s"] = time.perf_counter() - t
        results = {}
        for name in plan.variants:
            v = VARIANTS[name]
            t = time.perf_counter()
            spec = {
                **base,
                "job": "rounds",
                "connector": v.connector(),
                "cache": v.cache,
                "rounds": plan.schedule(),
            }
            results[name] = _child(python, spec, work, name, 3600)
            phases[f"{name}_s"] = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return section(plan, model, stored, results, phases, time.perf_counter() - t0)


def section(
    plan: Plan,
    model: dict[str, Any],
    stored: dict[str, Any],
    results: dict[str, dict[str, Any]],
    phases: dict[str, float],
    duration_s: float,
) -> dict[str, Any]:
    """The section's record from its engines' outputs (the ``model``, ``store`` and per-variant
    ``rounds`` jobs of :mod:`.vllm_interference_child`)."""
    config = {**MODEL, "num_hidden_layers": plan.layers}
    missing = [name for name in plan.variants if name not in results]
    if missing:
        raise BenchError(f"interference: no rounds for {', '.join(missing)}")
    variants = {
        name: summarize(
            name, results[name], VARIANTS[name].load, VARIANTS[name].cache, plan.prefix_tokens
        )
        for name in plan.variants
    }
    warnings = []
    if plan.prefix_bytes < GIB:
        warnings.append(
            f"the restored prefix is {plan.prefix_bytes / GIB:.2f} GiB, below the issue's 1 GiB "
            "(--quick or smaller --vllm-interference-prefix / --vllm-interference-layers)"
        )
    for name, summary in variants.items():
        if not summary["hits_as_expected"]:
            warnings.append(f"{name}: a round's new request did not hit as planned (see rounds)")
    first = results[plan.variants[0]]
    return {
        "plan": asdict(plan),
        "model": {
            **config,
            "params": model["params"],
            "weights": "transformers save_pretrained, random",
        },
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "prefix_bytes": plan.prefix_bytes,
        "kv_cache_bytes": plan.kv_cache_bytes(),
        "store": {
            "tier": "file",
            "objects": stored["objects"],
            "object_bytes": stored["object_bytes"],
            "store_prefill_s": stored["prefill_s"],
            "warm": "buffered reads, every object file read once before each variant round",
            "cold": "O_DIRECT reads (FileTier direct_io), pages dropped (POSIX_FADV_DONTNEED) "
            "before each variant round",
        },
        "scheduler": {
            "max_num_batched_tokens": first["max_num_batched_tokens"],
            "chunked_prefill": first["chunked_prefill"],
        },
        "variants": variants,
        "ratios": ratios(variants),
        "targets": targets(variants),
        "warnings": warnings,
        "phases_s": phases,
        "duration_s": duration_s,
    }


def _child(
    python: str, spec: dict[str, Any], work: Path, name: str, timeout_s: float
) -> dict[str, Any]:
    out = run_child(python, CHILD, spec, work, name, timeout_s)
    if "error" in out:
        raise BenchError(f"interference: the {name} engine failed: {out['error']}")
    return out
