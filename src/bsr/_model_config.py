"""A transformers model config read one way for :mod:`bsr.hf` and :mod:`bsr.hcache`.

Both adapters size state from a model's config (layers, heads, KV heads, head dim, sliding
window, dtype). They read it through these helpers, so the layout bsr.hf stores K/V in and the
shape bsr.hcache rebuilds K/V from cannot disagree about a config. A value the helpers cannot use
is refused with the caller's error class (``LayoutError`` for bsr.hf, ``UnsupportedModelError``
for bsr.hcache), naming ``config.<field>``; none is replaced by a guess.

Works on any object with the attributes (a ``transformers.PretrainedConfig``, or a stand-in):
transformers itself is never imported here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ._check import positive_int
from ._errors import ConfigError


def text_config(config: Any) -> Any:
    """The decoder's config of a (possibly multimodal) config: ``get_text_config(decoder=True)``
    where the config has it (older transformers: without the keyword), else ``config``."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:  # older transformers without the keyword
            return get()
    return config


def _named_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value != "auto":
        resolved = getattr(torch, value, None)
        if isinstance(resolved, torch.dtype):
            return resolved
    return None


def config_dtype(cfg: Any) -> torch.dtype:
    """The dtype a model built from ``cfg`` uses: ``cfg.dtype`` (transformers >= 4.56) if it
    names one, else ``cfg.torch_dtype`` (older versions, and stand-ins) if it names one, else
    torch's default dtype. ``"auto"`` and ``None`` name none. Where ``torch_dtype`` is only
    transformers' deprecated alias of ``dtype`` (a property), it is not read (it would warn)."""
    found = _named_dtype(getattr(cfg, "dtype", None))
    if found is None and not isinstance(inspect.getattr_static(cfg, "torch_dtype", None), property):
        found = _named_dtype(getattr(cfg, "torch_dtype", None))
    return found if found is not None else torch.get_default_dtype()


def config_int(cfg: Any, name: str, error: type[ConfigError]) -> int:
    """``cfg.<name>``, which must be a positive int (absent or ``None``: refused too)."""
    return positive_int(getattr(cfg, name, None), f"config.{name}", error=error)


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention sizes: query heads, KV heads and values per head."""

    num_heads: int
    kv_heads: int
    head_dim: int


def attention_shape(cfg: Any, error: type[ConfigError]) -> AttentionShape:
    """The attention sizes of ``cfg`` (a model's or one layer's config).

    ``num_key_value_heads`` absent or ``None``: as many as the query heads (multi-head
    attention). ``head_dim`` absent or ``None``: ``hidden_size // num_attention_heads``, which
    must divide. Any value given must be a positive int.
    """
    heads = config_int(cfg, "num_attention_heads", error)
    kv_heads = getattr(cfg, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else config_int(cfg, "num_key_value_heads", error)
    if getattr(cfg, "head_dim", None) is not None:
        return AttentionShape(heads, kv_heads, config_int(cfg, "head_dim", error))
    hidden = config_int(cfg, "hidden_size", error)
    if hidden % heads:
        raise error(
            f"config.hidden_size={hidden} is not a multiple of config.num_attention_heads={heads} "
            "and the config has no head_dim"
        )
    return AttentionShape(heads, kv_heads, hidden // heads)


def sliding_window(cfg: Any, error: type[ConfigError]) -> int | None:
    """The window of a config without ``layer_types`` (tokens a layer attends to), or ``None``
    for full attention: ``sliding_window`` unless ``use_sliding_window`` is false (Qwen2 sets a
    window it does not use). A window given must be a positive int."""
    if getattr(cfg, "sliding_window", None) is None or not getattr(cfg, "use_sliding_window", True):
        return None
    return config_int(cfg, "sliding_window", error)
