"""Small random HF models and decode helpers shared by the HCache and incremental-write tests."""

from __future__ import annotations

import inspect
from typing import Any

import torch

VOCAB = 128


def build(kind: str, *, layers: int = 3, kv_heads: int = 4, seed: int = 0, **extra: Any) -> Any:
    """A tiny random causal LM of ``kind`` (hidden 64, 4 heads), eager attention, eval mode."""
    import transformers as T

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    configs: dict[str, tuple[Any, dict[str, Any]]] = {
        "llama": (T.LlamaConfig, {}),
        "mistral": (T.MistralConfig, {"sliding_window": None}),
        "mistral_sliding": (T.MistralConfig, {"sliding_window": 64}),
        "qwen2": (T.Qwen2Config, {}),
        "gemma": (T.GemmaConfig, {"head_dim": 16}),
        "qwen3": (T.Qwen3Config, {"head_dim": 16}),
        "phi3": (T.Phi3Config, {}),
        "phi3_partial": (T.Phi3Config, {"partial_rotary_factor": 0.5}),
        "olmo2": (T.Olmo2Config, {}),
        "deepseek_v3": (
            T.DeepseekV3Config,
            {
                "kv_lora_rank": 32,
                "q_lora_rank": 32,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 3,
                "moe_intermediate_size": 32,
            },
        ),
        "gemma2": (T.Gemma2Config, {"head_dim": 16, "sliding_window": 32}),
    }
    cls, kw = configs[kind]
    cfg = cls(**{**common, **kw, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(cfg).eval()


def forward(model: Any, ids: torch.Tensor, past: Any, **kw: Any) -> Any:
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return model(input_ids=ids, use_cache=True, **{name: past}, **kw)


def next_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def decode_from(
    model: Any, prompt: torch.Tensor, start: int, past: Any, steps: int = 3
) -> list[torch.Tensor]:
    """Logits of prefilling ``prompt[:, start:]`` onto ``past`` then ``steps`` greedy steps."""
    logits = []
    with torch.no_grad():
        out = forward(model, prompt[:, start:], past)
        past = next_cache(out)
        last = out.logits[:, -1]
        logits.append(last)
        for _ in range(steps):
            out = forward(model, last.argmax(-1, keepdim=True), past)
            past = next_cache(out)
            last = out.logits[:, -1]
            logits.append(last)
    return logits


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def same_tokens(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b))


def prompt(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def shuffled(num_blocks: int, n: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n]
