"""What a vLLM request's KV is keyed by, and its per-request bsr options.

Where it runs: the connector's scheduler side (vLLM's EngineCore process), once per request;
the keys travel to the workers with the lookup, the load and the save.

How it works: vLLM's own prefix cache keeps apart requests whose token ids agree but whose KV
differs (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``). bsr binds the
same inputs into its chunk keys, each as a :class:`bsr.KeyExtra` over the tokens it affects:

* the request's ``cache_salt``: the first token (so every chunk);
* its LoRA adapter: the whole request; here only a marker naming vLLM's adapter id
  (:func:`bsr.vllm._adapters.adapter_marker`, no file system call on the scheduler's loop),
  which each worker replaces by the digest of the weights it loaded (a rewritten or reloaded
  adapter under the same name is another key; :mod:`bsr.vllm._adapters`);
* each multimodal item: its placeholder tokens, with its identifier (vLLM's content hash, or the
  caller's UUID), modality, offset and length;
* prompt embeddings: per bsr chunk, a SHA-256 of the embedding rows of that chunk (and, in a
  prompt that mixes tokens and embeddings, which positions are which).

The token ids are vLLM's own (``all_token_ids``: an embedding position holds 0 there). What bsr
cannot key it neither loads nor saves (:attr:`RequestKeys.unkeyable` names why): a multimodal
item without an identifier, embeddings that cannot be read (an adapter the worker has not
loaded is the worker's miss). The per-request options come from ``kv_transfer_params["bsr"]``
(:class:`RequestOptions`); a bad one is a :class:`RequestOptionError` naming the field, and the
request is then served without bsr (neither loaded nor saved), never a stopped engine. A client
chooses these options: a name or value is refused past a small bound without being compared,
echoed or counted (:data:`MAX_OPTION_CHARS`), and the metric label of a refusal is one of
:data:`OPTION_FIELDS` or ``unknown`` (:func:`option_label`).
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bsr import Check, ConfigError, KeyExtra

from ._adapters import adapter_marker

#: the ``kv_transfer_params`` key of bsr's per-request options
PARAMS_KEY = "bsr"
#: the per-request options
OPTION_NAMES = ("load", "store", "max_load_tokens")
#: where the options are, as a refusal's ``field`` names them
WHERE = f"kv_transfer_params.{PARAMS_KEY}"
#: every ``field`` a refusal may carry as a metric label (:func:`option_label`), but ``unknown``
OPTION_FIELDS = (WHERE, *(f"{WHERE}.{name}" for name in OPTION_NAMES))
#: the longest option name or string value looked at (compared, suggested for, echoed)
MAX_OPTION_CHARS = 64


class RequestOptionError(ConfigError):
    """A per-request option (``kv_transfer_params["bsr"]``) is invalid: that request is served
    without bsr (neither loaded nor saved); ``field`` names the option (a name past
    :data:`MAX_OPTION_CHARS` is not echoed: ``field`` is then ``kv_transfer_params.bsr``)."""


def option_label(error: RequestOptionError) -> str:
    """The ``rejected_options{field}`` label of a refusal: a known field, or ``unknown`` for an
    option name that is not one (a client's own name never becomes a metric series)."""
    name = str(error.fields.get("field", WHERE))
    return "unknown" if error.fields.get("unknown") or name not in OPTION_FIELDS else name


def describe(value: Any) -> str:
    """What a client sent, for a message: short values as they are, long ones by kind and size
    (never copied whole into a message, a log line or a response)."""
    if isinstance(value, str):
        return (
            repr(value)
            if len(value) <= MAX_OPTION_CHARS
            else f"a string of {len(value)} characters"
        )
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    if isinstance(value, Mapping):
        return f"an object of {len(value)} keys"
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)} items"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    return f"a {type(value).__name__}"


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

        Bounded work whatever the client sent: more names than there are options, a name
        longer than :data:`MAX_OPTION_CHARS` or one that is not a string is refused without
        being compared; only a short unknown name gets the closest known one.

        Raises:
            RequestOptionError: ``params["bsr"]`` is not a dict, names an unknown option (the
                closest known one is given), or holds a bad value.
        """
        if not isinstance(params, Mapping) or params.get(PARAMS_KEY) is None:
            return cls()
        data = params[PARAMS_KEY]
        if not isinstance(data, Mapping):
            raise RequestOptionError(
                f"{WHERE} must be an object such as {{'store': false}}, got {describe(data)}",
                field=WHERE,
            )
        if len(data) > len(OPTION_NAMES):
            raise RequestOptionError(
                f"{WHERE} holds {len(data)} options; the options are {list(OPTION_NAMES)}",
                field=WHERE,
                unknown=True,
            )
        for name in data:
            if name in OPTION_NAMES:
                continue
            if not isinstance(name, str) or len(name) > MAX_OPTION_CHARS:
                raise RequestOptionError(
                    f"unknown option in {WHERE}: {describe(name)} (names are at most "
                    f"{MAX_OPTION_CHARS} characters); the options are {list(OPTION_NAMES)}",
                    field=WHERE,
                    unknown=True,
                )
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {list(OPTION_NAMES)}"
            raise RequestOptionError(
                f"unknown option '{WHERE}.{name}'{hint}", field=f"{WHERE}.{name}", unknown=True
            )
        out: dict[str, Any] = {}
        for name in ("load", "store"):
            if name in data:
                out[name] = _checked(Check.flag, data[name], f"{WHERE}.{name}")
        if data.get("max_load_tokens") is not None:
            what = f"{WHERE}.max_load_tokens"
            out["max_load_tokens"] = _checked(Check.non_negative_int, data["max_load_tokens"], what)
        return cls(**out)


def _checked(check: Any, value: Any, what: str) -> Any:
    """``check(value, what)`` with its ConfigError turned into a RequestOptionError; a value no
    option takes that is large (a long string, an array, an object, a huge int) is refused by
    its kind and size, never printed."""
    large = (
        isinstance(value, (Mapping, list, tuple, bytes, bytearray))
        or (isinstance(value, str) and len(value) > MAX_OPTION_CHARS)
        or (isinstance(value, int) and value.bit_length() > 64)
    )
    if large:
        wanted = "an int >= 0" if what.endswith("tokens") else "True or False"
        raise RequestOptionError(f"{what} must be {wanted}, got {describe(value)}", field=what)
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
    """The adapter's marker (its vLLM id), bound to the weights by each worker; no file system
    call (see :mod:`bsr.vllm._adapters`)."""
    if not lora:
        return []
    try:
        return [adapter_marker(lora)]
    except (AttributeError, TypeError, ValueError):
        raise Unkeyable("lora_id", "the request's adapter has no integer lora_int_id") from None


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
