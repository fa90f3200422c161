"""What a vLLM request's KV is keyed by, and its per-request bsr options.

Where it runs: the connector's scheduler side (vLLM's EngineCore process), once per request;
the keys travel to the workers with the lookup, the load and the save.

How it works: vLLM's own prefix cache keeps apart requests whose token ids agree but whose KV
differs (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``). bsr binds the
same inputs into its chunk keys, each as a :class:`bsr.KeyExtra` over the tokens it affects:

* the request's ``cache_salt``: the first token (so every chunk);
* its LoRA adapter: the whole request; the adapter's name, its resolved path and the size and
  modification time of every file in it (a reloaded or rewritten adapter under the same name is
  another key);
* each multimodal item: its placeholder tokens, with its identifier (vLLM's content hash, or the
  caller's UUID), modality, offset and length;
* prompt embeddings: per bsr chunk, a SHA-256 of the embedding rows of that chunk (and, in a
  prompt that mixes tokens and embeddings, which positions are which).

The token ids are vLLM's own (``all_token_ids``: an embedding position holds 0 there). What bsr
cannot key it neither loads nor saves (:attr:`RequestKeys.unkeyable` names why): an adapter whose
files the scheduler cannot read, a multimodal item without an identifier, embeddings that cannot
be read. The per-request options come from ``kv_transfer_params["bsr"]``
(:class:`RequestOptions`); a bad one is a :class:`RequestOptionError` naming the field, and the
request is then served without bsr (neither loaded nor saved), never a stopped engine.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bsr import ConfigError, KeyExtra

from .._check import Check, non_negative_int

#: the ``kv_transfer_params`` key of bsr's per-request options
PARAMS_KEY = "bsr"


class RequestOptionError(ConfigError):
    """A per-request option (``kv_transfer_params["bsr"]``) is invalid: that request is served
    without bsr (neither loaded nor saved); ``field`` names the option."""


@dataclass(frozen=True)
class RequestOptions:
    """``kv_transfer_params={"bsr": {...}}`` of one request (all optional).

    Attributes:
        load: restore this request's prefix from bsr (default true).
        store: save this request's KV through bsr when it finishes (default true); false for
            data that must not be stored ("do not store").
        max_load_tokens: load at most this many tokens past vLLM's own prefix-cache hit (whole
            chunks); None: no limit; 0: no load.
    """

    load: bool = True
    store: bool = True
    max_load_tokens: int | None = None

    @classmethod
    def from_params(cls, params: Any) -> RequestOptions:
        """The options in a request's ``kv_transfer_params`` (absent: every default).

        Raises:
            RequestOptionError: ``params["bsr"]`` is not a dict, names an unknown option (the
                closest known one is given), or holds a bad value.
        """
        if not isinstance(params, Mapping) or params.get(PARAMS_KEY) is None:
            return cls()
        data = params[PARAMS_KEY]
        where = f"kv_transfer_params.{PARAMS_KEY}"
        if not isinstance(data, Mapping):
            raise RequestOptionError(
                f"{where} must be an object such as {{'store': false}}, got {data!r}",
                field=where,
            )
        known = ("load", "store", "max_load_tokens")
        for name in data:
            if name not in known:
                close = difflib.get_close_matches(str(name), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {list(known)}"
                raise RequestOptionError(
                    f"unknown option '{where}.{name}'{hint}", field=f"{where}.{name}"
                )
        out: dict[str, Any] = {}
        for name in ("load", "store"):
            if name in data:
                out[name] = _checked(Check.flag, data[name], f"{where}.{name}")
        if data.get("max_load_tokens") is not None:
            what = f"{where}.max_load_tokens"
            out["max_load_tokens"] = _checked(non_negative_int, data["max_load_tokens"], what)
        return cls(**out)


def _checked(check: Any, value: Any, what: str) -> Any:
    """``check(value, what)`` with its ConfigError turned into a RequestOptionError."""
    try:
        return check(value, what)
    except ConfigError as exc:
        raise RequestOptionError(exc.message, field=what) from None


@dataclass(frozen=True)
class RequestKeys:
    """What one vLLM request is keyed by in bsr, and what bsr may do with it.

    Attributes:
        extras: the values besides its token ids that its KV depends on.
        unkeyable: why bsr cannot key it (then it is neither loaded nor saved), or None.
        options: its per-request options.
        error: a bad per-request option (then it is neither loaded nor saved), or None.
    """

    extras: tuple[KeyExtra, ...] = ()
    unkeyable: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    error: RequestOptionError | None = None

    @property
    def loads(self) -> bool:
        return self.usable and self.options.load and self.options.max_load_tokens != 0

    @property
    def stores(self) -> bool:
        return self.usable and self.options.store

    @property
    def usable(self) -> bool:
        return self.unkeyable is None and self.error is None


class Unkeyable(Exception):
    """An input bsr cannot key (``reason`` is the metric's label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def request_keys(request: Any, chunk_tokens: int) -> RequestKeys:
    """The keys and options of a vLLM ``Request`` (see the module docstring)."""
    error: RequestOptionError | None = None
    options = RequestOptions()
    try:
        options = RequestOptions.from_params(getattr(request, "kv_transfer_params", None))
    except RequestOptionError as exc:
        error = exc
    try:
        extras = [
            *salt_extras(getattr(request, "cache_salt", None)),
            *lora_extras(getattr(request, "lora_request", None)),
            *mm_extras(getattr(request, "mm_features", None)),
            *embeds_extras(request, chunk_tokens),
        ]
    except Unkeyable as exc:
        return RequestKeys((), exc.reason, options, error)
    return RequestKeys(KeyExtra.canonical(extras), None, options, error)


def salt_extras(salt: Any) -> list[KeyExtra]:
    if not salt:
        return []
    raw = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else repr(salt).encode()
    return [KeyExtra(b"vllm-salt:" + hashlib.sha256(raw).digest(), 0, 1)]


def lora_extras(lora: Any) -> list[KeyExtra]:
    """The adapter's identity: name, resolved path, and each file's name, size and mtime."""
    if not lora:
        return []
    name = str(getattr(lora, "lora_name", ""))
    path = str(getattr(lora, "lora_path", "") or "")
    h = hashlib.sha256()
    h.update(name.encode("utf-8", "surrogatepass") + b"\0")
    try:
        real = os.path.realpath(path)
        h.update(real.encode("utf-8", "surrogatepass") + b"\0")
        if os.path.isdir(real):
            entries = sorted(os.scandir(real), key=lambda e: e.name)
            files = [(e.name, e.stat()) for e in entries if e.is_file()]
        else:
            files = [(os.path.basename(real), os.stat(real))]
    except OSError as exc:
        raise Unkeyable(
            "lora_path", f"the files of adapter {name!r} at {path!r} cannot be read: {exc}"
        ) from None
    if not files:
        raise Unkeyable("lora_path", f"adapter {name!r} at {path!r} holds no files")
    for fname, st in files:
        h.update(f"{fname}\0{st.st_size}\0{st.st_mtime_ns}\0".encode("utf-8", "surrogatepass"))
    return [KeyExtra(b"vllm-lora:" + h.digest())]


def mm_extras(features: Any) -> list[KeyExtra]:
    """One extra per multimodal item, over its placeholder tokens."""
    out = []
    for f in features or ():
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            raise Unkeyable("mm_identifier", "a multimodal item has no identifier or position")
        offset, length = int(pos.offset), int(pos.length)
        modality = str(getattr(f, "modality", ""))
        tag = f"{modality}\0{ident}\0{offset}\0{length}".encode("utf-8", "surrogatepass")
        out.append(KeyExtra(b"vllm-mm:" + hashlib.sha256(tag).digest(), offset, offset + length))
    return out


def embeds_extras(request: Any, chunk_tokens: int) -> list[KeyExtra]:
    """Per bsr chunk, a digest of the prompt embedding rows there (and the token/embedding
    mask of a mixed prompt)."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return []
    mask = getattr(request, "prompt_is_token_ids", None)
    try:
        rows = _as_bytes_rows(embeds)
        head = f"{embeds.dtype}\0{tuple(embeds.shape)[1:]}\0".encode()
        n = len(rows)
        out = []
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            h = hashlib.sha256(head)
            h.update(rows[lo:hi].reshape(-1).data)
            if mask is not None:
                h.update(bytes(bool(m) for m in list(mask)[lo:hi]))
            out.append(KeyExtra(b"vllm-embeds:" + h.digest(), lo, hi))
    except Unkeyable:
        raise
    except Exception as exc:
        raise Unkeyable("prompt_embeds", f"the prompt embeddings cannot be read: {exc!r}") from None
    return out


def _as_bytes_rows(t: Any) -> Any:
    """A ``[n, bytes per row]`` uint8 NumPy view of a 2-D (or higher) CPU tensor's rows."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.layout != torch.strided:
        raise Unkeyable("prompt_embeds", "prompt embeddings are not a dense tensor")
    rows = t.detach().to("cpu").contiguous().reshape(t.shape[0], -1)
    return rows.view(torch.uint8).numpy()
