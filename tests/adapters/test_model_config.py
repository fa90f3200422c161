"""bsr.hf and bsr.hcache read a model config the same way (one reader, ``bsr._model_config``).

Each had its own copy of the config readers, and they disagreed: on a config whose ``dtype`` is
``None`` or ``"auto"`` and whose ``torch_dtype`` names one, bsr.hf stored float32 K/V and
bsr.hcache rebuilt bfloat16 (or float16); on a ``head_dim``, ``num_key_value_heads`` or
``sliding_window`` of 0, a ``hidden_size`` the heads do not divide, or a count given as a string,
bsr.hf refused and bsr.hcache quietly used another value (``hidden // heads``, all heads, no
window, ``int("2")``); a config without ``hidden_size`` was a TypeError in bsr.hcache.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bsr import ConfigError, LayoutError
from bsr.hcache import UnsupportedModelError, check_config
from bsr.hf import layer_placements, layout_for_config

BASE: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def _hf(cfg: Any) -> tuple[int, int, torch.dtype]:
    (first, *_) = layer_placements(cfg)
    group = layout_for_config(cfg, chunk_tokens=16).groups[0]
    return first.num_kv_heads, first.head_dim, group.torch_dtype


def _hcache(cfg: Any) -> tuple[int, int, torch.dtype]:
    shape = check_config(cfg)
    return shape.kv_heads, shape.head_dim, shape.dtype


def _outcome(read: Any, cfg: Any) -> tuple[int, int, torch.dtype] | str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return read(cfg)  # type: ignore[no-any-return]
    except ConfigError as exc:
        return str(exc)


AGREED = {
    "dtype None, torch_dtype bf16": ({"dtype": None, "torch_dtype": "bfloat16"}, torch.bfloat16),
    "dtype auto, torch_dtype fp16": ({"dtype": "auto", "torch_dtype": "float16"}, torch.float16),
    "dtype wins over torch_dtype": ({"dtype": torch.float16, "torch_dtype": "bfloat16"}, None),
    "torch_dtype alone": ({"torch_dtype": "bfloat16"}, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(AGREED))
def test_the_dtype_is_read_alike(name: str) -> None:
    patch, dtype = AGREED[name]
    cfg = SimpleNamespace(**{**BASE, **patch})
    want = (2, 16, dtype or torch.float16)
    assert _outcome(_hf, cfg) == _outcome(_hcache, cfg) == want


REFUSED = {
    "head_dim 0": ({"head_dim": 0}, "config.head_dim must be a positive int, got 0"),
    "kv heads 0": ({"num_key_value_heads": 0}, "config.num_key_value_heads must be a positive"),
    "window 0": ({"sliding_window": 0}, "config.sliding_window must be a positive int, got 0"),
    "layers as a string": ({"num_hidden_layers": "2"}, "config.num_hidden_layers must be a"),
    "heads do not divide hidden": (
        {"head_dim": None, "hidden_size": 66},
        "config.hidden_size=66 is not a multiple of config.num_attention_heads=4",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_value_neither_can_use_is_refused_alike(name: str) -> None:
    patch, message = REFUSED[name]
    cfg = SimpleNamespace(**{**BASE, **patch})
    with pytest.raises(LayoutError) as hf:
        _hf(cfg)
    with pytest.raises(UnsupportedModelError) as hcache:
        _hcache(cfg)
    assert str(hf.value) == str(hcache.value) and str(hf.value).startswith(message)


def test_defaults_are_read_alike() -> None:
    """No head_dim: hidden // heads; no num_key_value_heads: every head is a KV head."""
    cfg = SimpleNamespace(**{**BASE, "head_dim": None, "num_key_value_heads": None})
    assert _outcome(_hf, cfg) == _outcome(_hcache, cfg) == (4, 16, torch.get_default_dtype())


def test_hcache_needs_hidden_size_and_says_so() -> None:
    cfg = SimpleNamespace(**{**BASE, "hidden_size": None})
    with pytest.raises(UnsupportedModelError, match=r"config\.hidden_size must be a positive int"):
        check_config(cfg)


def test_a_transformers_config_is_read_without_a_warning() -> None:
    """transformers' ``torch_dtype`` is a deprecated alias of ``dtype`` (a property): it is not
    read, also when ``dtype`` is unset."""
    transformers = pytest.importorskip("transformers")
    sizes = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    cfg = transformers.LlamaConfig(**sizes, dtype="bfloat16")
    assert _outcome(_hf, cfg) == _outcome(_hcache, cfg) == (4, 16, torch.bfloat16)
    unset = transformers.LlamaConfig(**sizes)
    assert _outcome(_hf, unset) == _outcome(_hcache, unset) == (4, 16, torch.get_default_dtype())
