"""The digest of a model config: what, besides the weights, decides the state a model computes.

Two models with the same weights but a different config (another ``rms_norm_eps``, RoPE base or
scaling, sliding window, activation) compute different K/V and hidden states for the same
tokens; stored state of one is wrong for the other. A namespace therefore carries
``config_digest`` (see :class:`~bsr.Namespace`), and :func:`model_config_digest` computes it from
a plain config mapping (``hf_config.to_dict()``, a ``config.json``), so every adapter (``bsr.hf``,
``bsr.hcache``, the vLLM connector) and every custom server derive the same value.

How it works: the config minus :data:`IGNORED_CONFIG_KEYS` (dropped at every nesting level) is
written as canonical JSON (sorted keys, no whitespace, ASCII, floats in Python's shortest
round-trip form) and hashed with BLAKE2b (16 bytes, personalised), returned as 32 hex digits.
The ignore list is short on purpose: a key missing from it can only cause a miss (state saved
under one digest is not found under another), a key wrongly on it could serve wrong state.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError

#: Config keys that do not change what the model computes for a token sequence, so they do not
#: enter the digest (at any nesting level). Everything else does.
IGNORED_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        # names, paths, versions: the weights are named by the namespace's model_id
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        # the dtype: bound through the layout, whose groups record the dtype the cache holds
        # (a server may run a model in another dtype than its config.json says)
        "dtype",
        "torch_dtype",
        # which attention kernel runs, not what it computes
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        # what a forward returns, not what it computes
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "output_scores",
        "return_dict_in_generate",
        # feed-forward over slices of the sequence: the same per-token computation
        "chunk_size_feed_forward",
        # weight initialisation and training-only settings (the weights are model_id's)
        "initializer_range",
        "tf_legacy_loss",
        # tokenizer, labels and tasks
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        # generate()'s sampling defaults: they pick tokens from the logits, the state is the same
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)

_MAX_DEPTH = 64


def model_config_digest(config: Mapping[str, Any] | Any) -> str:
    """32 hex digits naming what a model config makes the model compute.

    Args:
        config: a plain mapping of JSON values, e.g. ``hf_config.to_dict()`` or a parsed
            ``config.json``; an object with a ``to_dict()`` method (a transformers
            ``PretrainedConfig``) is converted first. Tuples count as lists; nested configs
            (``text_config``, ``rope_scaling``, ``quantization_config`` ...) are included.

    Returns:
        The digest, for ``Namespace(..., config_digest=...)``. Equal for configs that differ
        only in :data:`IGNORED_CONFIG_KEYS` or in key order.

    Raises:
        ConfigError: ``config`` is not a mapping (nor has ``to_dict()``), or holds a key that is
            not a string or a value that is not JSON (the message names its path).
    """
    if not isinstance(config, Mapping):
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            raise ConfigError(
                f"model_config_digest needs a mapping such as hf_config.to_dict(), got "
                f"{type(config).__name__}"
            )
        config = to_dict()
        if not isinstance(config, Mapping):
            raise ConfigError(f"to_dict() returned {type(config).__name__}, not a mapping")
    plain = _plain(config, "config", 0)
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    h = hashlib.blake2b(text.encode("ascii"), digest_size=16, person=b"bsr-model-config")
    return h.hexdigest()


def _plain(value: Any, path: str, depth: int) -> Any:
    """``value`` as plain JSON types, ignored keys dropped; ConfigError names a bad path."""
    if depth > _MAX_DEPTH:
        raise ConfigError(f"{path}: nested deeper than {_MAX_DEPTH} levels; is it a config?")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return repr(value)  # 'nan' / 'inf' / '-inf': stable, and JSON has no such number
        return float(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{path}: key {k!r} is not a string; pass JSON-like config")
            if k not in IGNORED_CONFIG_KEYS:
                out[k] = _plain(v, f"{path}[{k!r}]", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    item = getattr(value, "item", None)  # a NumPy or torch scalar
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item(), path, depth + 1)
    to_dict = getattr(value, "to_dict", None)  # a nested config object
    if callable(to_dict):
        return _plain(to_dict(), path, depth + 1)
    raise ConfigError(
        f"{path}: a {type(value).__name__} is not a JSON value; pass hf_config.to_dict() "
        "(plain JSON values)"
    )
