"""Recompute baseline: prefill the same number of tokens with a random-weight Llama.

How it works: a ``transformers`` ``LlamaForCausalLM`` of a preset size (or a JSON dict of
``LlamaConfig`` fields) is built with random weights from the run's seed (nothing downloaded)
and prefills ``n`` random token ids; the time to the first token's logits is the recompute TTFT.
The same model then runs one decode step on the cache the prefill left behind: that step is what
a restored request still has to run to get its first token, so the bench adds it to the restore
time before comparing. The KV layout the bench restores for the comparison is this model's own
(:meth:`Recompute.layout`), so both sides hold the same state for the same tokens.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from typing import Any

import numpy as np
import torch

from bsr import kv_layout

from ..common.layouts import NamedLayout
from ..common.stats import BenchError

#: LlamaConfig fields per preset (vocab 32000, fp32 on CPU). Attention heads x head_dim = hidden.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
    },
    "small": {
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1408,
    },
    "medium": {
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
    },
    # the shape of Llama-3.2-1B (minutes per 8K prefill on a small CPU)
    "llama-3.2-1b": {
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
}


def model_fields(size: str) -> dict[str, Any]:
    """LlamaConfig fields of a preset name or an inline JSON object."""
    if size in PRESETS:
        fields = dict(PRESETS[size])
    elif size.lstrip().startswith("{"):
        try:
            fields = dict(json.loads(size))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise BenchError(f"--model-size JSON is invalid: {exc}") from exc
    else:
        raise BenchError(
            f"unknown --model-size {size!r}; use one of {sorted(PRESETS)} or a JSON object of "
            'LlamaConfig fields, e.g. \'{"num_hidden_layers": 2, "hidden_size": 256, '
            '"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 688}\''
        )
    fields.setdefault("vocab_size", 32000)
    return fields


class Recompute:
    """A random-weight Llama that prefills on ``device``; see the module docstring."""

    def __init__(self, size: str, *, seed: int, max_tokens: int, device: str = "cpu") -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        logging.getLogger("transformers").setLevel(logging.ERROR)

        self.size = size
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        fields = model_fields(size)
        fields["max_position_embeddings"] = max(
            int(fields.get("max_position_embeddings", 0)), max_tokens + 16
        )
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        try:
            self.config = LlamaConfig(**fields)
        except (TypeError, ValueError) as exc:
            raise BenchError(f"LlamaConfig rejected {fields}: {exc}") from exc
        self.config._attn_implementation = "sdpa"
        model: Any = LlamaForCausalLM(self.config)
        self.model: Any = model.to(device=self.device, dtype=self.dtype).eval()
        self.build_s = time.perf_counter() - t0
        self.fields = fields
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._rng = np.random.default_rng(seed)

    @property
    def head_dim(self) -> int:
        hd = getattr(self.config, "head_dim", None)
        return int(hd) if hd else self.config.hidden_size // self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        kvh = getattr(self.config, "num_key_value_heads", None)
        return int(kvh or self.config.num_attention_heads)

    @property
    def params(self) -> int:
        return int(sum(p.numel() for p in self.model.parameters()))

    def layout(self, chunk_tokens: int = 256) -> NamedLayout:
        """The KV layout of this model (what a server would save for it)."""
        dtype = "bfloat16" if self.dtype == torch.bfloat16 else "float32"
        layout = kv_layout(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            chunk_tokens=chunk_tokens,
        )
        return NamedLayout(
            f"recompute-{self.size if self.size in PRESETS else 'custom'}",
            layout,
            "recompute-model",
            f"KV layout of the recompute model: {self.config.num_hidden_layers} layers x "
            f"{self.num_kv_heads} KV heads x {self.head_dim} head_dim {dtype}",
        )

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.size if self.size in PRESETS else None,
            "config": {k: v for k, v in sorted(self.fields.items())},
            "head_dim": self.head_dim,
            "params": self.params,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": "sdpa",
            "torch_threads": torch.get_num_threads(),
            "build_s": self.build_s,
            "weights": "random (seeded), nothing downloaded",
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, num_tokens: int) -> tuple[float, float]:
        """(prefill seconds to first-token logits, one decode step seconds) for ``num_tokens``."""
        ids = torch.from_numpy(
            self._rng.integers(0, self.config.vocab_size, size=(1, num_tokens), dtype=np.int64)
        ).to(self.device)
        with torch.inference_mode():
            self._sync()
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            self._sync()
            prefill = time.perf_counter() - t0
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            past = out["cache"] if "cache" in out else out["past_key_values"]
            kw = {self._cache_kw: past}
            t1 = time.perf_counter()
            self.model(input_ids=nxt, use_cache=True, logits_to_keep=1, **kw)
            self._sync()
            step = time.perf_counter() - t1
        del out, past, kw
        return prefill, step

    def warmup(self) -> None:
        """One short prefill so that first-call overheads are not timed."""
        self.measure(min(256, self.config.max_position_embeddings - 2))
