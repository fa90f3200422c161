"""Helpers for serving Hugging Face ``transformers`` models with a bsr paged cache.

Where it runs: the serving process, next to the model. ``transformers`` is an optional extra
(``pip install bsr-kv[hf]``); it is imported lazily, so ``import bsr.hf`` works without it and only
:func:`read_kv_from_cache` (which builds a ``DynamicCache``) needs it.

How it works: every attention layer of the model is placed in a state group. Layers with full
attention go to the group ``"kv"``, sliding-window layers to ``"swa_kv"`` (``window_tokens`` =
the config's ``sliding_window``), each group numbering its layers in model order. One token of one
layer is stored as ``[K of every KV head..., V of every KV head...]`` in the model's dtype, so
``token_bytes = 2 * num_key_value_heads * head_dim * itemsize``. Token ``t`` of a request lives
in block ``block_ids[t // block_tokens]`` at row ``t % block_tokens``, like every
:class:`~bsr.PagedKVCache`; a mapping group -> table gives each group its own table, where the
sliding group's may hold ``bsr.NULL_BLOCK`` outside the tokens its layers keep.

Supported configs (checked against transformers 5.x, with fallbacks for the 4.x cache API):

* decoder-only models whose attention layers all have plain per-head K/V of one shape: Llama
  (MHA and GQA), Mistral (every layer sliding: one ``"swa_kv"`` group), Qwen2 (``layer_types``
  mixing full and sliding layers), Gemma 2/3 text models, and other configs with
  ``num_hidden_layers``, ``num_attention_heads``, optional ``num_key_value_heads`` /
  ``head_dim`` / ``sliding_window`` / ``layer_types``;
* heterogeneous (``per_layer_config``) configs, as long as the layers of one group share their
  KV head count, head dim and window.

Not supported (a :class:`~bsr.LayoutError` says so): MLA/latent caches (DeepSeek ``kv_lora_rank``),
chunked attention (Llama 4), linear-attention/recurrent layers, KV sharing between layers, and
sliding layers with differing windows. Only batch row ``batch_index`` of a cache is moved.

Build the engine's namespace with :func:`namespace` (``model_id`` plus the digest of the
model config), so state saved under one config is never restored into a model of another.

Sliding layers of a ``DynamicCache`` keep only their last ``sliding_window - 1`` tokens. To save
a prefix of ``n`` tokens those tokens must still be held, so write a sliding model's cache at the
prefix end (e.g. prefill the chunk-aligned prefix, write it, then prefill the rest);
:func:`write_kv_to_cache` raises when the needed tokens were already dropped. For *window
checkpoints* (``engine.save(..., window_checkpoints=True)``: the sliding group's window is also
stored every ``window_checkpoint_chunks`` chunks, so a later prompt sharing only part of this one,
a system prompt or a document, restores up to the last checkpoint below what it shares), prefill
up to each of ``engine.checkpoint_tokens(n)`` in turn and write the cache at each
(``start=`` the tokens written so far), then at the prefix end: the window at each checkpoint
then lies in the paged cache, and only there does the save read the sliding group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import NULL_BLOCK, Namespace, PagedKVCache, StateGroup, StateLayout, model_config_digest
from ._check import int_at_least, int_between
from ._errors import BlockTableError, ConfigError, LayoutError
from ._model_config import attention_shape, config_dtype, config_int, sliding_window, text_config

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = (
    "FULL_GROUP",
    "SLIDING_GROUP",
    "LayerPlacement",
    "config_digest",
    "layer_placements",
    "layout_for_config",
    "namespace",
    "read_kv_from_cache",
    "write_kv_to_cache",
)

#: group of the full-attention layers
FULL_GROUP = "kv"
#: group of the sliding-window layers
SLIDING_GROUP = "swa_kv"

_FULL_TYPES = frozenset({"full_attention", "attention"})
_SLIDING_TYPES = frozenset({"sliding_attention"})


@dataclass(frozen=True)
class LayerPlacement:
    """Where one model layer's K/V lives in a bsr layout.

    Attributes:
        layer: the model's layer index.
        group: state group name (:data:`FULL_GROUP` or :data:`SLIDING_GROUP`).
        index: the layer's index inside its group.
        num_kv_heads: KV heads of the layer.
        head_dim: elements per head.
        window: sliding window in tokens, or ``None`` for full attention.
    """

    layer: int
    group: str
    index: int
    num_kv_heads: int
    head_dim: int
    window: int | None


def layer_placements(config: Any) -> tuple[LayerPlacement, ...]:
    """Place every layer of a transformers ``config`` in the ``"kv"`` or ``"swa_kv"`` group.

    Raises:
        LayoutError: for a layer type or attention kind this adapter does not support.
    """
    cfg = text_config(config)
    num_layers = config_int(cfg, "num_hidden_layers", LayoutError)
    if getattr(cfg, "kv_lora_rank", None) is not None:
        raise LayoutError(
            "MLA (latent) attention caches are not supported by bsr.hf; describe the latent "
            "cache with a custom StateLayout instead"
        )
    if getattr(cfg, "kv_sharing_modes", None) is not None:
        raise LayoutError("configs with KV sharing between layers are not supported by bsr.hf")
    layer_types: Sequence[str] | None = getattr(cfg, "layer_types", None)
    if layer_types is not None and len(layer_types) != num_layers:
        raise LayoutError(
            f"config.layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    per_layer: Any = None
    if getattr(cfg, "is_heterogeneous", False):
        per_layer = cfg.per_layer_config
    out: list[LayerPlacement] = []
    counts = {FULL_GROUP: 0, SLIDING_GROUP: 0}
    for i in range(num_layers):
        lc = per_layer[i] if per_layer is not None else cfg
        window: int | None
        if layer_types is not None:
            kind = layer_types[i]
            if kind in _FULL_TYPES:
                window = None
            elif kind in _SLIDING_TYPES:
                window = config_int(lc, "sliding_window", LayoutError)
            else:
                raise LayoutError(
                    f"layer {i} has type {kind!r}; bsr.hf supports only full_attention and "
                    "sliding_attention layers",
                    layer=i,
                )
        else:
            if getattr(lc, "attention_chunk_size", None) is not None:
                raise LayoutError("chunked attention is not supported by bsr.hf", layer=i)
            window = sliding_window(lc, LayoutError)
        shape = attention_shape(lc, LayoutError)
        group = FULL_GROUP if window is None else SLIDING_GROUP
        out.append(LayerPlacement(i, group, counts[group], shape.kv_heads, shape.head_dim, window))
        counts[group] += 1
    for group in (FULL_GROUP, SLIDING_GROUP):
        shapes = {(p.num_kv_heads, p.head_dim, p.window) for p in out if p.group == group}
        if len(shapes) > 1:
            raise LayoutError(
                f"the {group!r} layers differ in (kv heads, head dim, window): "
                f"{sorted(shapes, key=str)}; bsr.hf needs one shape per group",
                group=group,
            )
    return tuple(out)


def layout_for_config(
    config: Any, *, chunk_tokens: int = 256, dtype: str | torch.dtype | None = None
) -> StateLayout:
    """The bsr :class:`~bsr.StateLayout` of a transformers model's KV cache.

    Args:
        config: the model's config (``model.config``); composite configs use their text decoder.
        chunk_tokens: tokens per chunk.
        dtype: the KV cache dtype; default the config's ``dtype`` if it names one, else its
            ``torch_dtype`` (older versions), else torch's default dtype (what a model built
            from the config uses); bsr.hcache reads the same (``bsr._model_config``).

    Returns:
        A layout with the group ``"kv"`` (full-attention layers) and/or ``"swa_kv"``
        (sliding-window layers, ``window_tokens = sliding_window``), in that order; groups without
        layers are left out.
    """
    placements = layer_placements(config)
    chosen = dtype if dtype is not None else config_dtype(text_config(config))
    name = StateGroup.dtype_name(chosen)
    itemsize = torch.empty((), dtype=getattr(torch, name)).element_size()
    groups: list[StateGroup] = []
    for group in (FULL_GROUP, SLIDING_GROUP):
        members = [p for p in placements if p.group == group]
        if not members:
            continue
        first = members[0]
        groups.append(
            StateGroup(
                group,
                num_layers=len(members),
                token_bytes=2 * first.num_kv_heads * first.head_dim * itemsize,
                window_tokens=first.window,
                dtype=name,
            )
        )
    return StateLayout(chunk_tokens=chunk_tokens, groups=tuple(groups))


def config_digest(model_or_config: Any) -> str:
    """:func:`bsr.model_config_digest` of a transformers model's whole config (or of a config,
    or of its ``to_dict()``)."""
    config = getattr(model_or_config, "config", model_or_config)
    return model_config_digest(config)


def namespace(
    model_or_config: Any,
    model_id: str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    salt: bytes = b"",
) -> Namespace:
    """The namespace to store a transformers model's KV under: ``model_id`` names the weights,
    the config's digest (:func:`config_digest`) binds what the config makes them compute.

    State saved by a model whose config differs in anything that changes the computation
    (``rms_norm_eps``, RoPE, windows ...) is then a miss, never wrong K/V. ``model_id`` must
    still change with the weights (another checkpoint, revision, fine-tune or quantization).
    """
    return Namespace(
        model_id, tp_rank=tp_rank, tp_size=tp_size, salt=salt,
        config_digest=config_digest(model_or_config),
    )  # fmt: skip


def _check_cache_matches(cache: PagedKVCache, placements: Sequence[LayerPlacement]) -> None:
    for group in (FULL_GROUP, SLIDING_GROUP):
        members = [p for p in placements if p.group == group]
        if not members:
            continue
        try:
            g = cache.layout.group(group)
        except KeyError:
            raise LayoutError(
                f"the cache has no group {group!r}; build it with bsr.hf.layout_for_config(config)",
                group=group,
            ) from None
        first = members[0]
        want = 2 * first.num_kv_heads * first.head_dim * g.torch_dtype.itemsize
        if g.num_layers != len(members) or g.token_bytes != want or g.window_tokens != first.window:
            raise LayoutError(
                f"cache group {group!r} ({g.num_layers} layers, {g.token_bytes} B/token, window "
                f"{g.window_tokens}) does not match the config ({len(members)} layers, {want} "
                f"B/token, window {first.window}); build it with bsr.hf.layout_for_config(config)",
                group=group,
            )


def _placements_for(
    config: Any, cache: PagedKVCache, num_layers: int
) -> tuple[LayerPlacement, ...]:
    if config is not None:
        placements = layer_placements(config)
    else:
        groups = cache.layout.groups
        if len(groups) != 1 or groups[0].name != FULL_GROUP or groups[0].window_tokens is not None:
            raise ConfigError(
                "without config= every layer is taken as full attention in the single group "
                f"{FULL_GROUP!r}; this cache has groups {list(cache.layout.group_names)}, pass "
                "config=model.config"
            )
        g = groups[0]
        if g.num_layers != num_layers:
            raise LayoutError(
                f"the model cache has {num_layers} layers, the cache group {FULL_GROUP!r} has "
                f"{g.num_layers}",
                group=FULL_GROUP,
            )
        # head shapes are checked against the tensors by the caller; only the placement counts
        head_elems = g.token_bytes // g.torch_dtype.itemsize // 2
        return tuple(
            LayerPlacement(i, FULL_GROUP, i, 1, head_elems, None) for i in range(num_layers)
        )
    if len(placements) != num_layers:
        raise LayoutError(f"the model cache has {num_layers} layers, the config {len(placements)}")
    _check_cache_matches(cache, placements)
    return placements


def _model_layers(past_key_values: Any) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per layer ``(keys, values, tokens seen)`` of a transformers cache object."""
    out: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    layers = getattr(past_key_values, "layers", None)
    if layers is not None:  # transformers >= 4.56: Cache.layers[i].keys / .values
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                raise ConfigError(
                    f"layer {i} of the model cache holds no K/V tensors ({type(layer).__name__}); "
                    "run the model with use_cache=True first",
                    layer=i,
                )
            seen = getattr(layer, "cumulative_length", None)
            out.append((k, v, int(seen) if isinstance(seen, int) else int(k.shape[-2])))
        return out
    key_cache = getattr(past_key_values, "key_cache", None)
    value_cache = getattr(past_key_values, "value_cache", None)
    if key_cache is not None and value_cache is not None:  # transformers 4.x DynamicCache
        return [(k, v, int(k.shape[-2])) for k, v in zip(key_cache, value_cache)]
    if isinstance(past_key_values, (tuple, list)):  # legacy tuple of (K, V) per layer
        for i, item in enumerate(past_key_values):
            if len(item) < 2:
                raise ConfigError(f"legacy cache entry {i} is not a (key, value) pair", layer=i)
            k, v = item[0], item[1]
            out.append((k, v, int(k.shape[-2])))
        return out
    raise ConfigError(
        f"unsupported model cache {type(past_key_values).__name__}; pass a transformers "
        "DynamicCache (outputs.past_key_values / outputs.cache) or a tuple of (K, V) per layer"
    )


def _token_rows(
    cache: PagedKVCache, ids: torch.Tensor, lo: int, hi: int, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and rows of tokens ``[lo, hi)`` in one group's table; none may be NULL_BLOCK."""
    t = torch.arange(lo, hi, dtype=torch.int64)
    blocks = ids[t // cache.block_tokens]
    if hi > lo and bool((blocks == NULL_BLOCK).any()):
        index = int(t[blocks == NULL_BLOCK][0]) // cache.block_tokens
        raise BlockTableError(
            f"the block table of group {group!r} holds NULL_BLOCK at index {index}, where tokens "
            f"[{lo}, {hi}) of that group go; give it a block there (a sliding-window group "
            "needs blocks for its last window - 1 tokens only)",
            group=group,
            index=index,
        )
    return blocks.to(cache.device), (t % cache.block_tokens).to(cache.device)


def write_kv_to_cache(
    past_key_values: Any,
    cache: PagedKVCache,
    block_ids: Any,
    num_tokens: int,
    *,
    config: Any = None,
    batch_index: int = 0,
    start: int = 0,
) -> None:
    """Copy the K/V of tokens ``[start, num_tokens)`` of a model cache into paged cache blocks.

    A multi-turn server appends: after each turn it writes only the new tokens
    (``start`` = the tokens already written), so the history is never rewritten.

    Args:
        past_key_values: the model's cache after a forward pass (a transformers ``DynamicCache``,
            a 4.x cache with ``key_cache``/``value_cache``, or a legacy tuple of ``(K, V)``);
            tensors are ``[batch, kv_heads, seq, head_dim]``.
        cache: the destination, built with :func:`layout_for_config`.
        block_ids: the request's block table (at least ``ceil(num_tokens / block_tokens)`` ids),
            or a mapping group -> table (see :meth:`bsr.PagedKVCache.block_tables`): a
            sliding-window group's table may hold ``bsr.NULL_BLOCK`` outside the tokens it
            writes (its last ``sliding_window - 1`` before ``num_tokens``).
        num_tokens: tokens to write; the model cache may hold more.
        config: the model's config; needed when the layout has a sliding-window group (without it
            every layer is taken as full attention in a single ``"kv"`` group).
        batch_index: which batch row of the model cache to copy.
        start: first token to write (tokens before it are left as they are in the paged cache);
            the model cache still counts tokens from 0 (as a ``DynamicCache`` does).

    Raises:
        LayoutError: the cache layout, dtype or shapes do not match the model cache.
        ConfigError: ``num_tokens`` exceeds what the model cache holds, ``start`` is outside
            ``[0, num_tokens]``, or a layer already dropped tokens ``[start, num_tokens)`` needs.
        BlockTableError: a table is malformed, or holds ``NULL_BLOCK`` where tokens are written.
    """
    int_at_least(num_tokens, "num_tokens", 0)
    int_between(
        start,
        "start",
        0,
        num_tokens,
        bounds=f"[0, num_tokens={num_tokens}]",
        hint="pass the number of tokens already written",
    )
    layers = _model_layers(past_key_values)
    placements = _placements_for(config, cache, len(layers))
    tables = cache.block_tables(block_ids, num_tokens)
    if num_tokens == start:
        return
    for p, (k, v, seen) in zip(placements, layers):
        ids = tables.table(p.group)
        elems = _check_layer_kv(p, k, v, cache, batch_index)
        lo, first_held = _layer_span(p, int(k.shape[-2]), seen, start, num_tokens)
        sel = slice(lo - first_held, num_tokens - first_held)
        kk = k[batch_index, :, sel, :].transpose(0, 1)  # [n, kv_heads, head_dim]
        vv = v[batch_index, :, sel, :].transpose(0, 1)
        data = torch.cat((kk, vv), dim=1).reshape(num_tokens - lo, elems)
        blocks, rows = _token_rows(cache, ids, lo, num_tokens, p.group)
        dst = cache.typed(p.group)[p.index]
        dst[blocks, rows] = data.to(cache.device)


def _check_layer_kv(
    p: Any, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, batch_index: int
) -> int:
    """Check one layer's K/V against its cache group; return the elements per token (K + V)."""
    g = cache.layout.group(p.group)
    if k.dtype != g.torch_dtype or v.dtype != g.torch_dtype:
        raise LayoutError(
            f"layer {p.layer} K/V are {k.dtype}, the cache group {p.group!r} stores "
            f"{g.torch_dtype}; build the layout with dtype={k.dtype}",
            layer=p.layer,
            group=p.group,
        )
    if k.dim() != 4 or k.shape != v.shape:
        raise LayoutError(
            f"layer {p.layer} K/V must be [batch, kv_heads, seq, head_dim] of one shape, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}",
            layer=p.layer,
        )
    if not 0 <= batch_index < k.shape[0]:
        raise ConfigError(f"batch_index {batch_index} out of range for batch {k.shape[0]}")
    elems = 2 * k.shape[1] * k.shape[3]
    if elems * k.element_size() != g.token_bytes:
        raise LayoutError(
            f"layer {p.layer} has {k.shape[1]} KV heads of dim {k.shape[3]} "
            f"({elems * k.element_size()} B/token), the cache group {p.group!r} has "
            f"{g.token_bytes} B/token",
            layer=p.layer,
            group=p.group,
        )
    return int(elems)


def _layer_span(p: Any, held: int, seen: int, start: int, num_tokens: int) -> tuple[int, int]:
    """``(first token to write, first token the layer still holds)`` for one layer."""
    first_held = seen - held  # sliding layers drop their oldest tokens
    if num_tokens > seen:
        raise ConfigError(
            f"layer {p.layer} has seen {seen} tokens, cannot write {num_tokens}", layer=p.layer
        )
    need_from = 0 if p.window is None else max(0, num_tokens - (p.window - 1))
    need_from = max(need_from, start)
    if first_held > need_from:
        raise ConfigError(
            f"layer {p.layer} (window {p.window}) holds tokens [{first_held}, {seen}) but "
            f"writing up to {num_tokens} tokens needs [{need_from}, {num_tokens}); write the "
            "cache right after prefilling the prefix, before later tokens push them out",
            layer=p.layer,
        )
    return max(first_held, need_from), first_held


def read_kv_from_cache(
    cache: PagedKVCache,
    block_ids: Any,
    num_tokens: int,
    config: Any,
    *,
    device: str | torch.device | None = None,
) -> DynamicCache:
    """Rebuild a transformers ``DynamicCache`` holding tokens ``[0, num_tokens)`` from the cache.

    The result continues decoding exactly where a model that prefilled those tokens would:
    ``model(input_ids=next_ids, past_key_values=rebuilt)``; recent 5.x releases name the
    argument ``cache=rebuilt`` and deprecate ``past_key_values``. Full-attention layers get every
    token; sliding layers their last ``sliding_window - 1`` tokens and a token count of
    ``num_tokens`` (transformers takes the next position from layer 0's count).

    Args:
        cache: the source paged cache (e.g. after a committed :meth:`RestoreEngine.restore`).
        block_ids: the request's block table, or a mapping group -> table; a sliding-window
            group's table may hold ``bsr.NULL_BLOCK`` outside its last ``sliding_window - 1``
            tokens.
        num_tokens: tokens to rebuild (e.g. ``result.committed_tokens``).
        config: the model's config.
        device: where the K/V tensors go (default: the cache's device).

    Raises:
        ModuleNotFoundError: transformers is not installed.
        LayoutError: the cache layout does not match the config.
        BlockTableError: a table is malformed, or holds ``NULL_BLOCK`` where tokens are read.
    """
    from transformers import DynamicCache

    int_at_least(num_tokens, "num_tokens", 0)
    placements = layer_placements(config)
    _check_cache_matches(cache, placements)
    tables = cache.block_tables(block_ids, num_tokens)
    target = torch.device(device) if device is not None else cache.device
    try:
        out = DynamicCache(config=config)
    except TypeError:  # transformers < 4.56: no config argument
        out = DynamicCache()
    if num_tokens == 0:
        return out
    layers = getattr(out, "layers", None)
    for p in placements:
        lo = 0 if p.window is None else max(0, num_tokens - (p.window - 1))
        blocks, rows = _token_rows(cache, tables.table(p.group), lo, num_tokens, p.group)
        data = cache.typed(p.group)[p.index][blocks, rows]  # [n, 2 * kv_heads * head_dim]
        kv = data.view(num_tokens - lo, 2, p.num_kv_heads, p.head_dim).to(target)
        k = kv[:, 0].transpose(0, 1).unsqueeze(0).contiguous()  # [1, kv_heads, n, head_dim]
        v = kv[:, 1].transpose(0, 1).unsqueeze(0).contiguous()
        if layers is not None and p.layer < len(layers):
            layer = layers[p.layer]
            layer.update(k, v)
        else:
            out.update(k, v, p.layer)
            layer = out.layers[p.layer] if layers is not None else None
        if p.window is not None:
            if (
                layer is None
                or not getattr(layer, "is_sliding", False)
                or not hasattr(layer, "cumulative_length")
            ):
                raise LayoutError(
                    f"layer {p.layer} is a sliding-window layer but this transformers version's "
                    "DynamicCache has no sliding layer for it; upgrade transformers (>= 4.56)",
                    layer=p.layer,
                )
            layer.cumulative_length = num_tokens
        elif layer is not None and getattr(layer, "is_sliding", False):
            raise LayoutError(
                f"layer {p.layer} is full attention in the config but sliding in the DynamicCache",
                layer=p.layer,
            )
    return out
