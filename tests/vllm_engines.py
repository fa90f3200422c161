"""Helpers of the vLLM tests: small random models written by transformers, engine runs.

Import with ``from vllm_engines import ...`` (``tests/`` is on pytest's ``pythonpath``; a module
named ``vllm`` would be shadowed by the ``tests/vllm`` directory). Each engine runs in its own
process (``tests/vllm/run_engine.py``): vLLM spawns workers, and a test process must not hold an
engine.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

RUN_ENGINE = Path(__file__).parent / "vllm" / "run_engine.py"

LLAMA = {  # a small random Llama: head_dim 64 (the CPU attention kernels need >= 32)
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: A tiny Gemma3 text model: layers 0 and 2 attend to a 64-token sliding window, 1 and 3 to
#: everything (vLLM's hybrid manager makes two KV cache groups of it).
GEMMA3 = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def write_llama(path: Path, seed: int = 0, **overrides: Any) -> None:
    """Real random weights written by transformers (vLLM's dummy weights ignore the context)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))
    model.to(torch.bfloat16).save_pretrained(path)


def write_gemma3(path: Path, seed: int = 0, **overrides: Any) -> None:
    """A random tiny Gemma3 (sliding-window and full-attention layers), written by transformers."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**GEMMA3, **overrides}))
    model.to(torch.bfloat16).save_pretrained(path)


def toks(n: int, seed: int) -> list[int]:
    """``n`` random token ids in [3, 500) (clear of bos/eos/pad), reproducible by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def file_store_connector(path: Path, *, chunk: int, model_id: str, **opts: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for one FileTier store at ``path``."""
    return {
        "bsr": {
            "tiers": [{"kind": "file", "path": str(path), "capacity_bytes": 1 << 30}],
            "chunk_tokens": chunk,
            "window": 4,
            "io_depth": 2,
            "model_id": model_id,
        },
        "bsr_connector": {"lookup_timeout_s": 5.0, **opts},
    }


def run(tmp: Path, name: str, model: str = "model", **spec: Any) -> dict[str, Any]:
    """Run one engine over ``spec`` in its own process; its log is kept as ``<name>.log``."""
    spec["model"] = str(tmp / model)
    spec.setdefault("load_format", "auto")
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    out = tmp / f"{name}.out.json"
    env = dict(os.environ)
    if spec.get("tensor_parallel_size", 1) > 1:  # one core per rank (auto binding refuses)
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores[:2])
    proc = subprocess.run(
        [sys.executable, str(RUN_ENGINE), str(tmp / f"{name}.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)  # bsr's and vLLM's events
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return dict(json.loads(out.read_text()))


def tokens_of(result: dict[str, Any]) -> list[list[list[int]]]:
    """Generated tokens, per batch and prompt."""
    return [[r["tokens"] for r in b["rows"]] for b in result["batches"]]


def cached_of(result: dict[str, Any]) -> list[list[int]]:
    """vLLM's ``num_cached_tokens``, per batch and prompt."""
    return [[r["cached"] for r in b["rows"]] for b in result["batches"]]


def store_objects(root: Path) -> list[Path]:
    """Object files of a FileTier root, or of the per-rank roots below it (TP > 1)."""
    return sorted(p for p in root.glob("**/objects/**/*.bsr") if p.is_file())
