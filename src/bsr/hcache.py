"""HCache-style restoration: store each layer's input hidden state, rebuild K/V with a GEMM.

Where it runs: the serving process, next to a Hugging Face ``transformers`` model (optional extra
``bsr[hf]``, imported lazily).

How it works (HCache, EuroSys'25): instead of a layer's K and V, store the hidden state that
enters the layer. On restore, bsr moves those hidden states through the same bounded window as
any other state group (they are just a group named ``"hidden"``), then :func:`rebuild_kv`
recomputes ``K = RoPE(k_proj(norm(h)))`` and ``V = v_proj(norm(h))`` layer by layer: one GEMM per
projection instead of a full prefill. Whether this moves fewer bytes depends on the model:

* MHA (``num_key_value_heads == num_attention_heads``): hidden = ``hidden_size`` values per token
  and layer, K+V = ``2 x hidden_size``: hidden states are half the bytes.
* GQA/MQA (Llama-3-8B: hidden 4096 vs K+V 2048): hidden states are *larger*; store K/V.

:func:`compare_state_bytes` makes that call; :func:`hidden_layout` builds the layout.

Supported: Llama-family decoder layers (``input_layernorm`` then ``self_attn`` with
``k_proj``/``v_proj`` and rotary embeddings from ``model.model.rotary_emb``), all layers full
attention. Other architectures raise :class:`~bsr.LayoutError`. Not implemented: HCache's
bubble-free scheduler (splitting layers between hidden-state restore and KV load or recompute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._errors import ConfigError, LayoutError
from .core._layout import StateGroup, StateLayout, _dtype_name
from .transfer._cache import PagedKVCache

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = (
    "HIDDEN_GROUP",
    "StateBytes",
    "compare_state_bytes",
    "hidden_layout",
    "rebuild_kv",
    "write_hidden_to_cache",
)

#: name of the hidden-state group
HIDDEN_GROUP = "hidden"


@dataclass(frozen=True)
class StateBytes:
    """Bytes per token per layer of each way to store a model's reusable state."""

    kv_bytes: int
    hidden_bytes: int

    @property
    def hidden_to_kv(self) -> float:
        """hidden / K+V bytes: < 1 means HCache moves fewer bytes."""
        return self.hidden_bytes / self.kv_bytes

    @property
    def prefer_hidden(self) -> bool:
        return self.hidden_bytes < self.kv_bytes

    @property
    def method(self) -> str:
        return "hidden" if self.prefer_hidden else "kv"


def _attrs(config: Any) -> tuple[int, int, int, int, torch.dtype]:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    dtype = (
        getattr(cfg, "dtype", None)
        or getattr(cfg, "torch_dtype", None)
        or torch.get_default_dtype()
    )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    for attr in ("sliding_window", "kv_lora_rank"):
        if getattr(cfg, attr, None):
            layer_types = getattr(cfg, "layer_types", None)
            if (
                attr == "sliding_window"
                and layer_types
                and all(t == "full_attention" for t in layer_types)
            ):
                continue
            raise LayoutError(
                f"hcache supports full-attention Llama-family models only; this config has {attr}"
            )
    return layers, kv_heads, head_dim, hidden, dtype


def compare_state_bytes(config: Any, *, dtype: torch.dtype | None = None) -> StateBytes:
    """Bytes per token per layer of K+V and of the layer's input hidden state."""
    _, kv_heads, head_dim, hidden, cfg_dtype = _attrs(config)
    item = (dtype or cfg_dtype).itemsize
    return StateBytes(kv_bytes=2 * kv_heads * head_dim * item, hidden_bytes=hidden * item)


def hidden_layout(
    config: Any, *, chunk_tokens: int = 256, dtype: torch.dtype | None = None
) -> StateLayout:
    """A layout with one group ``"hidden"``: every layer's input hidden state per token."""
    layers, _, _, hidden, cfg_dtype = _attrs(config)
    dt = dtype or cfg_dtype
    return StateLayout(
        chunk_tokens=chunk_tokens,
        groups=(StateGroup(HIDDEN_GROUP, layers, hidden * dt.itemsize, dtype=_dtype_name(dt)),),
    )


def _rows(
    cache: PagedKVCache, block_ids: Any, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = cache.block_table(block_ids, num_tokens)
    t = torch.arange(num_tokens, dtype=torch.int64)
    return ids[t // cache.block_tokens].to(cache.device), (t % cache.block_tokens).to(cache.device)


def write_hidden_to_cache(
    hidden_states: Sequence[torch.Tensor],
    cache: PagedKVCache,
    block_ids: Any,
    num_tokens: int,
    *,
    batch_index: int = 0,
) -> None:
    """Copy each layer's input hidden state for tokens ``[0, num_tokens)`` into the cache.

    Args:
        hidden_states: one tensor ``[batch, seq, hidden]`` per layer, the input of that layer:
            with ``model(..., output_hidden_states=True)`` that is ``out.hidden_states[:L]``
            (``hidden_states[i]`` enters layer ``i``; the last entry is the final output).
    """
    g = cache.layout.group(HIDDEN_GROUP)
    if len(hidden_states) < g.num_layers:
        raise ConfigError(
            f"need {g.num_layers} per-layer hidden states, got {len(hidden_states)}; pass "
            "out.hidden_states[:num_layers] from a forward with output_hidden_states=True"
        )
    blocks, rows = _rows(cache, block_ids, num_tokens)
    typed = cache.typed(HIDDEN_GROUP)
    for i in range(g.num_layers):
        h = hidden_states[i][batch_index, :num_tokens]
        if h.shape[0] < num_tokens:
            raise ConfigError(
                f"layer {i} hidden state holds {h.shape[0]} tokens, need {num_tokens}"
            )
        if h.dtype != typed.dtype or h.shape[-1] != typed.shape[-1]:
            raise LayoutError(
                f"layer {i} hidden state is {h.dtype} x {h.shape[-1]}, the cache holds "
                f"{typed.dtype} x {typed.shape[-1]}; build the layout with hidden_layout(config)"
            )
        typed[i][blocks, rows] = h.to(typed.device)


def rebuild_kv(
    model: Any,
    cache: PagedKVCache,
    block_ids: Any,
    num_tokens: int,
    *,
    device: str | torch.device | None = None,
) -> DynamicCache:
    """Recompute every layer's K/V from the stored hidden states; return a ``DynamicCache``.

    Runs ``input_layernorm``, ``k_proj``, ``v_proj`` and the rotary embedding of each layer on the
    tokens ``[0, num_tokens)`` (no attention, no MLP): the HCache restore GEMMs.
    """
    from transformers import DynamicCache

    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError as exc:  # pragma: no cover
        raise LayoutError("this transformers version has no Llama rotary helper") from exc
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    rotary = getattr(inner, "rotary_emb", None)
    if layers is None or rotary is None:
        raise LayoutError("rebuild_kv needs a Llama-family model (model.model.layers, rotary_emb)")
    config = model.config
    n_layers, kv_heads, head_dim, _, _ = _attrs(config)
    out = DynamicCache(config=config)
    if num_tokens == 0:
        return out
    blocks, rows = _rows(cache, block_ids, num_tokens)
    typed = cache.typed(HIDDEN_GROUP)
    target = torch.device(device) if device is not None else next(model.parameters()).device
    positions = torch.arange(num_tokens, device=target).unsqueeze(0)
    with torch.no_grad():
        for i in range(n_layers):
            layer = layers[i]
            attn = layer.self_attn
            h = typed[i][blocks, rows].to(target).unsqueeze(0)  # [1, n, hidden]
            x = layer.input_layernorm(h)
            k = attn.k_proj(x).view(1, num_tokens, kv_heads, head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, num_tokens, kv_heads, head_dim).transpose(1, 2)
            cos, sin = rotary(x, positions)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            out.update(k.contiguous(), v.contiguous(), i)
    return out
