"""Namespaces and chained chunk keys.

How it works: a :class:`Namespace` (model id, tensor-parallel rank and size, tenant salt, and
the digest of the model config, :func:`~bsr.model_config_digest`) is combined with the layout
fingerprint and the object format version into a 16-byte namespace fingerprint. That
fingerprint starts one running SHA-256 over the whole prefix, full token chunk after full token
chunk of ``C`` tokens, and each chunk's key is the digest of everything absorbed so far::

    seed   = "bsr-chunk-v4" || ns_fp || C as u32
    key_i  = SHA-256(seed || w_0 || enc(chunk_0) || ext_0 || ... || w_i || enc(chunk_i) || ext_i)
    chunk_i = tokens[i*C:(i+1)*C]

computed as one hash object that keeps absorbing (``digest()`` after chunk ``i`` does not end
it), so a key names a *prefix*, not a chunk in isolation, and different namespaces never share
keys. ``enc`` writes a chunk's tokens little-endian in ``w_i`` bytes each: 4 when every token of
the chunk is below 2**32 (every real vocabulary), else 8; ``w_i`` itself (one byte, 0x04 or
0x08) is hashed too. Key ``i`` depends on chunks ``0..i`` only (a prefix has the keys of the
longer request). Independent of PYTHONHASHSEED, process and platform.

Extra keys: token ids alone do not say what computed a chunk's state. A tenant's salt, a LoRA
adapter, an image in the prompt, prompt embeddings all change the KV of the same token ids. A
:class:`KeyExtra` binds such a value to a token range; every chunk the range overlaps absorbs it
after its tokens::

    ext_i  = "x" || u32 count || (u32 s || u32 e || u32 len(key) || key) for each extra,
             sorted, with [s, e) its range clipped to the chunk and made relative to it

``ext_i`` is empty for a chunk no extra overlaps. The clipped range depends only on the chunk, so
an extra over the whole request (an adapter) gives a prompt and its longer continuation the same
keys, and a chunk's key still depends on chunks ``0..i`` only; an extra bound to chunk ``j``
changes every key from ``j`` on.

The encoding is injective: the seed has a fixed length (16-byte fingerprint), a chunk's token
bytes have the length its width byte says, and after them comes either the next chunk's width
byte (0x04 or 0x08) or ``"x"`` (0x78) starting ``ext_i``, whose items carry their own lengths.

Why one streaming hash (format version 4): format 3 chained separate hashes, ``key_i =
SHA-256(key_{i-1} || w_i || enc(chunk_i) || ext_i)`` seeded by ``SHA-256("bsr-chunk-v2" ||
ns_fp || C)``. Per chunk that copied a fresh context, concatenated the previous digest with the
width byte and re-hashed those 33 bytes; the running hash absorbs each chunk's bytes once and
only takes a digest (``prepare_tokens`` of 524,288 NumPy tokens: see CHANGELOG.md for the
measured CPU). It also closes a hole: under format 3 anyone who knew one key (an object header
carries it) could compute the keys of every continuation of that prefix without knowing the
prefix's tokens. Under format 4 a key is a finished SHA-256 digest of the prefix's encoding
``M``; what can be computed from it alone without ``M`` is a length extension, the digest of
``M || pad(M) || X``, and SHA-256's padding starts with the byte 0x80, where a valid encoding
has a width byte or ``"x"``. So such a message is the encoding of no prefix, and its digest is
no valid key short of a SHA-256 collision; continuing a prefix needs its tokens (the key says
nothing of them).

Earlier chains: format 1 was a BLAKE2b chain over int64 tokens (about 4 ms hashing the 4 MiB
of a 524,288-token prompt); format 2 the SHA-256 chain above over 4-byte tokens (half the bytes,
and SHA-256 runs in hardware on current x86 (SHA-NI) and ARMv8 CPUs); format 3 added the extra
keys to it (a store written by format 2 was keyed by token ids alone: its connector merged
tenants, adapters and images). Both hashes are cryptographic: a chunk key names a prefix, and a
collision would serve one tenant's state to another. The format version is part of every
namespace fingerprint (and every object header), so state stored under an earlier format is a
clean miss, never a misread.
"""

from __future__ import annotations

import array
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union, cast

import numpy as np
import torch

from .._check import int_at_least, is_int, positive_int
from .._errors import ConfigError, TokenError
from ._layout import StateLayout, utf8_name

#: Version of the stored object format and key derivation. Part of every namespace.
#: 4: one streaming SHA-256 over the prefix; 3: extra keys per token range; 2: the SHA-256 chain
#: over 4-byte tokens; 1: BLAKE2b over 8-byte tokens.
FORMAT_VERSION = 4

KEY_BYTES = 32

TokensLike = Union[Sequence[int], "np.ndarray[Any, Any]", torch.Tensor]


@dataclass(frozen=True)
class Namespace:
    """Who owns stored objects: objects of different namespaces never meet.

    Args:
        model_id: the weights whose state is stored: model, revision, fine-tune, adapters,
            quantization (anything that changes the weights a forward uses).
        tp_rank: this process's tensor-parallel rank.
        tp_size: tensor-parallel world size.
        salt: optional tenant salt, to keep tenants' prefixes apart.
        config_digest: :func:`~bsr.model_config_digest` of the model config, so a model
            whose config changes the computation (another ``rms_norm_eps``, RoPE, window ...)
            never meets state of another config. The adapters set it (``bsr.hf.namespace``,
            ``bsr.hcache.HCache.namespace``). Empty: not bound (the config is then
            ``model_id``'s job).
    """

    model_id: str
    tp_rank: int = 0
    tp_size: int = 1
    salt: bytes = b""
    config_digest: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError("Namespace.model_id must be a non-empty string, e.g. 'llama-3-8b'")
        utf8_name(self.model_id, "Namespace.model_id", error=ConfigError)
        int_at_least(self.tp_size, "Namespace.tp_size", 1)
        if not is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                f"Namespace.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        if isinstance(self.salt, str):
            utf8_name(self.salt, "Namespace.salt", error=ConfigError)
            raise ConfigError(
                "Namespace.salt must be bytes; encode a string salt first, "
                "e.g. salt.encode('utf-8')"
            )
        if not isinstance(self.salt, (bytes, bytearray)):
            raise ConfigError(
                f"Namespace.salt must be bytes, got {type(self.salt).__name__}; "
                "pass the tenant's salt as bytes"
            )
        object.__setattr__(self, "salt", bytes(self.salt))
        if not isinstance(self.config_digest, str):
            raise ConfigError(
                f"Namespace.config_digest must be a str, got {type(self.config_digest).__name__}; "
                "pass bsr.model_config_digest(config)"
            )
        utf8_name(self.config_digest, "Namespace.config_digest", error=ConfigError)

    def fingerprint(self, layout: StateLayout) -> bytes:
        """16-byte digest of model, rank, salt, layout fingerprint, format version and (when
        set) the config digest."""
        h = hashlib.blake2b(digest_size=16, person=b"bsr-namespace")
        model = self.model_id.encode()  # checked encodable at construction
        h.update(len(model).to_bytes(4, "little") + model)
        h.update(self.tp_rank.to_bytes(4, "little") + self.tp_size.to_bytes(4, "little"))
        h.update(len(self.salt).to_bytes(4, "little") + self.salt)
        h.update(layout.fingerprint)
        h.update(FORMAT_VERSION.to_bytes(4, "little"))
        if self.config_digest:  # unset: the fingerprint of a namespace without it, unchanged
            cfg = self.config_digest.encode()
            h.update(b"config" + len(cfg).to_bytes(4, "little") + cfg)
        return h.digest()


@dataclass(frozen=True)
class KeyExtra:
    """Something besides the token ids that changes the state computed for a token range.

    A tenant's salt, a LoRA adapter, an image or audio clip placed in the prompt, prompt
    embeddings: two requests with the same token ids compute different KV when any of these
    differ, so their keys must differ too. An extra binds ``key`` into the key of every chunk
    that ``[start, end)`` overlaps (and, as the keys chain, into every later chunk's key). Two
    requests share a chunk's stored state only when their tokens and the extras overlapping
    every chunk up to it are equal, range included (clipped to the chunk).

    Typical extras: a tenant salt as ``KeyExtra(b"tenant:" + salt, 0, 1)`` (the first chunk,
    hence every chunk); an adapter as ``KeyExtra(b"lora:" + adapter_digest)`` (the whole
    request); an image as ``KeyExtra(b"image:" + content_hash, offset, offset + length)`` over
    its placeholder tokens. Prefix the key with its kind so values of two kinds never meet.

    Args:
        key: the value's identity (bytes, e.g. a digest of the adapter's weights).
        start: first token the value affects.
        end: one past the last token it affects; ``None``: to the end of the request.

    Raises:
        TokenError: ``key`` is not non-empty bytes, or the range is not ``0 <= start < end``.
    """

    key: bytes
    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.key, str):
            raise TokenError(
                "KeyExtra.key must be bytes, got str; encode it first, e.g. key.encode('utf-8')"
            )
        if not isinstance(self.key, (bytes, bytearray, memoryview)) or not len(self.key):
            raise TokenError(
                f"KeyExtra.key must be non-empty bytes, got {type(self.key).__name__}; pass the "
                "identity of what changes the state (a salt, an adapter digest, a content hash)"
            )
        object.__setattr__(self, "key", bytes(self.key))
        if len(self.key) > MAX_EXTRA_KEY_BYTES:
            raise TokenError(
                f"KeyExtra.key is {len(self.key)} bytes, at most {MAX_EXTRA_KEY_BYTES}; pass a "
                "digest of the value instead of the value itself"
            )
        if not is_int(self.start) or not 0 <= self.start < MAX_EXTRA_POSITION:
            raise TokenError(f"KeyExtra.start must be an int in [0, 2**48), got {self.start!r}")
        if self.end is not None and (
            not is_int(self.end) or not self.start < self.end <= MAX_EXTRA_POSITION
        ):
            raise TokenError(
                f"KeyExtra.end must be None (to the end) or an int > start={self.start}, "
                f"got {self.end!r}"
            )
        object.__setattr__(self, "start", int(self.start))
        if self.end is not None:
            object.__setattr__(self, "end", int(self.end))

    def sort_key(self) -> tuple[int, int, bytes]:
        return (self.start, -1 if self.end is None else self.end, self.key)

    @staticmethod
    def canonical(extras: Extras | None) -> tuple[KeyExtra, ...]:
        """``extras`` (any order, a single one, or None) checked, as the sorted tuple the
        engine keys with.

        Raises:
            TokenError: an item is not a :class:`KeyExtra`.
        """
        return check_extras(extras)


#: the longest ``KeyExtra.key`` (a digest, a name: never the value itself)
MAX_EXTRA_KEY_BYTES = 4096
#: token positions an extra's range may name (far beyond any prompt)
MAX_EXTRA_POSITION = 1 << 48

Extras = Sequence[KeyExtra]


def check_extras(extras: Extras | None) -> tuple[KeyExtra, ...]:
    """``extras`` checked, as a sorted tuple (the order a caller passes them in does not
    matter); ``None`` or empty: ``()``. Public as :meth:`KeyExtra.canonical`."""
    if not extras:
        return ()
    if isinstance(extras, KeyExtra):
        extras = (extras,)
    out = tuple(extras)
    for e in out:
        if not isinstance(e, KeyExtra):
            raise TokenError(
                f"extras must be bsr.KeyExtra objects, got {type(e).__name__}; wrap each value "
                "as bsr.KeyExtra(key, start, end)"
            )
    return tuple(sorted(out, key=KeyExtra.sort_key))


def extras_by_chunk(extras: tuple[KeyExtra, ...], chunk_tokens: int, n: int) -> dict[int, bytes]:
    """``ext_i`` of every chunk below ``n`` that an extra overlaps (see the module docstring)."""
    per: dict[int, list[tuple[int, int, bytes]]] = {}
    for e in extras:
        first = e.start // chunk_tokens
        last = n - 1 if e.end is None else min(n - 1, (e.end - 1) // chunk_tokens)
        for c in range(first, last + 1):
            lo = c * chunk_tokens
            s = max(e.start, lo) - lo
            t = chunk_tokens if e.end is None else min(e.end, lo + chunk_tokens) - lo
            per.setdefault(c, []).append((s, t, e.key))
    out: dict[int, bytes] = {}
    encoded: dict[tuple[tuple[int, int, bytes], ...], bytes] = {}  # interior chunks repeat
    for c, items in per.items():
        items.sort()
        canon = tuple(items)
        ext = encoded.get(canon)
        if ext is None:
            parts = [b"x", len(items).to_bytes(4, "little")]
            for s, t, key in items:
                parts.append(
                    s.to_bytes(4, "little") + t.to_bytes(4, "little")
                    + len(key).to_bytes(4, "little") + key
                )  # fmt: skip
            ext = encoded[canon] = b"".join(parts)
        out[c] = ext
    return out


def extras_digest(extras: tuple[KeyExtra, ...]) -> bytes:
    """One canonical encoding of a sorted ``extras`` tuple (for the probe's identity check)."""
    if not extras:
        return b""
    parts = [len(extras).to_bytes(4, "little")]
    for e in extras:
        end = 0 if e.end is None else e.end + 1
        parts.append(
            e.start.to_bytes(8, "little") + end.to_bytes(8, "little")
            + len(e.key).to_bytes(4, "little") + e.key
        )  # fmt: skip
    return hashlib.sha256(b"".join(parts)).digest()


_object_new = object.__new__


@dataclass(frozen=True)
class ChunkKey:
    """The key of chunk ``index`` of a token prefix in namespace ``namespace`` (fingerprint)."""

    digest: bytes
    index: int
    namespace: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def __repr__(self) -> str:
        return f"ChunkKey({self.digest.hex()[:12]}…, index={self.index})"

    @classmethod
    def _new(cls, digest: bytes, index: int, namespace: bytes) -> ChunkKey:
        """The same key as ``ChunkKey(digest, index, namespace)``, without the frozen
        dataclass's per-field ``object.__setattr__`` (the key chain makes thousands)."""
        key = _object_new(cls)
        key.__dict__.update(digest=digest, index=index, namespace=namespace)
        return key


@dataclass(frozen=True, init=False)
class ObjectKey:
    """One stored object: a chunk key and a state group."""

    chunk: ChunkKey
    group: str

    def __init__(self, chunk: ChunkKey, group: str) -> None:
        # the frozen dataclass's own __init__ sets each field through object.__setattr__; a
        # probe makes one of these per (chunk, group) of every restore
        d = self.__dict__
        d["chunk"] = chunk
        d["group"] = group

    @property
    def object_id(self) -> str:
        """Hex digest naming the object in a tier (file names derive only from it).

        A plain property over the cached :func:`object_id`: Python 3.11's ``cached_property``
        takes a lock on every first access, and a probe makes a fresh key per object."""
        return _object_id(self.chunk.digest, self.group)

    @property
    def group_digest(self) -> bytes:
        return _group_digest(self.group)


@functools.lru_cache(maxsize=1 << 16)
def _object_id(digest: bytes, group: str) -> str:
    """Cached: a restore's probe and its reads name the same objects (with other
    ``ObjectKey`` instances: the cache is keyed by value)."""
    h = hashlib.blake2b(digest, digest_size=20, person=b"bsr-object")
    h.update(_group_bytes(group))
    return h.hexdigest()


#: the object id of ``(chunk digest, group)`` (cached): what ``ObjectKey(key, group).object_id``
#: is, without building the key (a batch read names each of its objects)
object_id = _object_id


@functools.lru_cache(maxsize=1024)
def _group_bytes(group: str) -> bytes:
    return utf8_name(group, "state group name")


@functools.lru_cache(maxsize=1024)
def _group_digest(group: str) -> bytes:
    return hashlib.blake2b(_group_bytes(group), digest_size=16, person=b"bsr-group").digest()


#: the digest of a state group's name (cached): ``ObjectKey(key, group).group_digest``
group_digest = _group_digest


def token_count(tokens: TokensLike) -> int:
    """How many tokens ``tokens`` holds, without converting it (for the :data:`OFFLOAD_TOKENS`
    decision). A ``[1, n]`` array or tensor counts ``n``; anything without a length counts 0
    (its conversion then raises the typed error)."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        return int(tokens.size if isinstance(tokens, np.ndarray) else tokens.numel())
    try:
        return len(tokens)
    except TypeError:
        return 0


def as_token_array(tokens: TokensLike) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Normalise tokens to a 1-D little-endian int64 numpy array, with clear errors.

    Pure and synchronous: an async caller may run it in a worker thread (see
    :data:`OFFLOAD_TOKENS`). An array it returned comes back as is (one conversion per request).

    How it works: numpy arrays and torch tensors are viewed or cast as a whole. A list or tuple
    goes through ``array.array("q", ...)``, one C loop that accepts only integers (floats,
    strings, numpy bools and ids beyond int64 fail it); Python bools pass that loop as 0 and 1,
    so only positions holding 0 or 1 are checked one by one. Anything the fast loop refuses is
    walked token by token to name the offending value.
    """
    return _checked_array(tokens)[0]


def _checked_array(tokens: TokensLike) -> tuple[np.ndarray[Any, np.dtype[np.int64]], int]:
    """:func:`as_token_array`'s array and its largest token (0 when empty), from one pass.

    The range check and the key chain's width both need the largest token: viewed as uint64 a
    negative int64 is at least 2**63, so one ``max`` over the unsigned view finds negatives and,
    when below 2**32, tells the chain that every token fits 4 bytes.
    """
    if isinstance(tokens, np.ndarray):
        arr = _from_numpy(tokens)
    elif isinstance(tokens, torch.Tensor):
        arr = _from_torch(tokens)
    elif isinstance(tokens, (str, bytes, bytearray)):
        raise TokenError(
            f"tokens must be token ids, got {type(tokens).__name__}; tokenize the text first"
        )
    else:
        arr = _from_sequence(tokens)
    if not arr.size:
        return np.ascontiguousarray(arr.astype(_I8, copy=False)), 0
    if arr.dtype == np.uint64:
        top = int(arr.max())  # unsigned: no negatives, and the max is the bound
        if top > _I8_MAX:
            raise TokenError("a token id does not fit in int64")
        return np.ascontiguousarray(arr.astype(_I8, copy=False)), top
    arr = np.ascontiguousarray(arr.astype(_I8, copy=False))
    top = int(arr.view(_U64).max())
    if top > _I8_MAX:  # a negative token (>= 2**63 seen unsigned)
        raise TokenError(
            f"token ids must be >= 0, found {int(arr.min())}; strip padding/sentinel ids first"
        )
    return arr, top


_I8 = np.dtype("<i8")
_U64 = np.dtype("<u8")
_I8_MAX = (1 << 63) - 1


def _check_2d(shape: tuple[int, ...]) -> None:
    if len(shape) > 1 and not (len(shape) == 2 and shape[0] == 1):
        raise TokenError(f"tokens must be 1-D (or [1, n]), got shape {shape}")


def _from_numpy(tokens: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if type(tokens) is not np.ndarray:
        if isinstance(tokens, np.matrix):  # always 2-D: reshape(-1) is [1, n], keyed as 0 chunks
            raise TokenError(
                f"tokens must be a 1-D array, got an np.matrix of shape {tokens.shape}; pass "
                "np.asarray(tokens).ravel()"
            )
        if isinstance(tokens, np.ma.MaskedArray):  # masked positions hold no token
            raise TokenError(
                "tokens must be a plain array, got a masked array; pass tokens.compressed() "
                "(the unmasked tokens) or tokens.filled(...)"
            )
        tokens = tokens.view(np.ndarray)  # a memmap or another subclass: its plain data
    if tokens.dtype.kind not in "iu":
        raise TokenError(
            f"tokens must be an integer array, got dtype {tokens.dtype}; pass token ids",
            dtype=str(tokens.dtype),
        )
    _check_2d(tokens.shape)
    return tokens if tokens.ndim == 1 else tokens.reshape(-1)


def _from_torch(tokens: torch.Tensor) -> np.ndarray[Any, Any]:
    """A dense integer tensor's tokens as a NumPy array (on the CPU).

    Refused with a TokenError: a meta tensor (it has no data), a sparse or other non-strided
    layout (COO, CSR, CSC, BSR, BSC, MKL-DNN), a nested tensor, a quantized one (its integers
    are a quantization of other values), and any tensor (a subclass such as a fake tensor)
    whose values cannot be read on the CPU.
    """
    kind = _torch_kind(tokens)
    if kind:
        raise TokenError(
            f"tokens must be a dense integer tensor with data, got {kind}; pass token ids as a "
            "plain tensor (e.g. tokens.to_dense().long(), or a list of ints)",
            kind=kind,
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TokenError(
            f"tokens must be an integer tensor, got dtype {tokens.dtype}; pass token ids "
            "(e.g. tokens.long())",
            dtype=str(tokens.dtype),
        )
    _check_2d(tuple(tokens.shape))
    cpu = tokens.detach().to("cpu")  # a device's own failure (CUDA) is not the tokens' fault
    try:
        return cpu.reshape(-1).numpy()
    except (RuntimeError, TypeError, NotImplementedError, ValueError) as exc:
        raise TokenError(
            f"tokens must be a plain integer tensor, got a {type(tokens).__name__} of dtype "
            f"{tokens.dtype} whose values cannot be read ({type(exc).__name__}: "
            f"{str(exc)[:200]}); pass token ids as a plain tensor or a list of ints",
            dtype=str(tokens.dtype),
        ) from exc


def _torch_kind(tokens: torch.Tensor) -> str:
    """What makes ``tokens`` no plain tensor of token ids ("" when nothing does)."""
    if tokens.is_nested:
        return "a nested tensor"
    if tokens.layout != torch.strided:
        return f"a tensor of layout {tokens.layout} (sparse or opaque, not dense)"
    if tokens.is_meta or tokens.device.type == "meta":
        return "a meta tensor (it holds no data)"
    if tokens.is_quantized:
        return f"a quantized tensor of dtype {tokens.dtype}"
    return ""


def _from_sequence(tokens: Any) -> np.ndarray[Any, Any]:
    items = tokens if isinstance(tokens, (list, tuple)) else None
    if items is None:
        try:
            items = list(tokens)
        except TypeError:
            raise TokenError(
                f"tokens must be a sequence of ints, a numpy array or a torch tensor, "
                f"got {type(tokens).__name__}"
            ) from None
    try:
        arr = np.frombuffer(array.array("q", items), dtype=np.int64)
    except (TypeError, OverflowError):
        return _from_sequence_slow(items)
    for i in np.flatnonzero(arr <= 1).tolist():  # bools pass array("q") as 0 / 1
        if isinstance(items[i], bool):
            return _from_sequence_slow(items)
    return arr


def _from_sequence_slow(items: Sequence[Any]) -> np.ndarray[Any, Any]:
    """The token-by-token walk: only for input the fast path refused, to name the bad token."""
    for t in items:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TokenError(f"tokens must be ints, found {type(t).__name__} {t!r}; pass token ids")
    try:
        return np.asarray(items, dtype=np.int64)
    except OverflowError:
        raise TokenError("a token id does not fit in int64") from None


#: Tokens above which an async caller should run :func:`as_token_array` /
#: :func:`prepare_tokens` in a worker thread: on a 2-core machine an array of this many tokens
#: takes about 0.5 ms to key (a list about 1.5 ms), a worker-thread hop about 0.1 ms.
OFFLOAD_TOKENS = 131072

_SHA256 = hashlib.sha256
_U32 = np.dtype("<u4")
_WIDE = 1 << 32  # a token at or above it is hashed in 8 bytes
_BLOCK_BYTES = 1 << 17  # the narrow chain converts and hashes ~128 KiB of chunks at a time


def _chain_start(namespace_fp: bytes, chunk_tokens: int) -> Any:
    """The running hash of the chain, having absorbed the seed (see the module docstring)."""
    return _SHA256(b"bsr-chunk-v4" + bytes(namespace_fp) + chunk_tokens.to_bytes(4, "little"))


def chunk_digests(
    namespace_fp: bytes,
    arr: np.ndarray[Any, np.dtype[np.int64]],
    chunk_tokens: int,
    n: int,
    extras: tuple[KeyExtra, ...] = (),
    bound: int | None = None,
) -> list[bytes]:
    """The chain's digests of the first ``n`` chunks of ``arr`` (see the module docstring).

    ``arr``: as :func:`as_token_array` returns it (tokens >= 0). ``extras``: sorted, as
    :func:`check_extras` returns them. ``bound``: the largest token of all of ``arr`` when
    known (:func:`_checked_array` found it), so the common case needs no pass of its own.
    """
    if n <= 0:
        return []
    body = arr[: n * chunk_tokens]
    if bound is None or bound >= _WIDE:  # the whole array's bound says nothing of the body
        bound = int(body.max())
    h = _chain_start(namespace_fp, chunk_tokens)
    update, digest = h.update, h.digest
    out: list[bytes] = []
    append = out.append
    if not extras and bound < _WIDE:  # every token fits 4 bytes (every vocabulary)
        # A few chunks at a time, each row its width byte and its 4-byte tokens, written into
        # one small buffer that stays in the CPU's cache while it is hashed: one update per
        # chunk, and no 2 MiB copy of a long prompt written out to memory and read back.
        row = 1 + chunk_tokens * 4
        rows = max(1, min(n, _BLOCK_BYTES // row))
        buf = np.empty((rows, row), np.uint8)
        buf[:, 0] = 4
        dst = buf[:, 1:].view(_U32)
        data = buf.data.cast("B")
        src = body.reshape(n, chunk_tokens)
        for first in range(0, n, rows):
            m = min(rows, n - first)
            np.copyto(dst[:m], src[first : first + m], casting="unsafe")  # all < 2**32
            for i in range(0, m * row, row):
                update(data[i : i + row])
                append(digest())  # the digest of everything so far; the hash goes on
        return out
    wide = (body.reshape(n, chunk_tokens) >> 32).any(axis=1)  # tokens are >= 0
    flags = cast("list[bool]", wide.tolist())
    suffix = extras_by_chunk(extras, chunk_tokens, n) if extras else {}
    data4 = body.astype(_U32).data.cast("B")  # what a chunk of tokens below 2**32 hashes
    data8 = body.data.cast("B")
    step4, step8 = chunk_tokens * 4, chunk_tokens * 8
    for i, w in enumerate(flags):
        if w:
            update(b"\x08")
            update(data8[i * step8 : (i + 1) * step8])
        else:
            update(b"\x04")
            update(data4[i * step4 : (i + 1) * step4])
        ext = suffix.get(i)
        if ext is not None:
            update(ext)
        append(digest())
    return out


def chunk_keys(
    namespace_fp: bytes,
    tokens: TokensLike,
    chunk_tokens: int,
    *,
    max_chunks: int | None = None,
    extras: Extras | None = None,
) -> list[ChunkKey]:
    """Chained keys of every full chunk of ``tokens`` (at most ``max_chunks``).

    Args:
        namespace_fp: the namespace fingerprint (:meth:`Namespace.fingerprint`) seeding the chain.
        tokens: token ids (list, tuple, numpy array, torch tensor, or what
            :func:`as_token_array` returned).
        chunk_tokens: tokens per chunk (the layout's ``chunk_tokens``).
        max_chunks: derive at most this many keys.
        extras: what besides the tokens changes the state (:class:`KeyExtra`), in any order.

    Pure and synchronous (see :data:`OFFLOAD_TOKENS`).
    """
    positive_int(chunk_tokens, "chunk_tokens")
    arr, bound = _checked_array(tokens)
    return _keys_of(namespace_fp, arr, chunk_tokens, max_chunks, check_extras(extras), bound)


def _keys_of(
    namespace_fp: bytes,
    arr: np.ndarray[Any, np.dtype[np.int64]],
    chunk_tokens: int,
    max_chunks: int | None,
    ext: tuple[KeyExtra, ...],
    bound: int | None = None,
) -> list[ChunkKey]:
    """:func:`chunk_keys` of an array :func:`as_token_array` returned and checked extras
    (``bound``: its largest token, when known)."""
    n = len(arr) // chunk_tokens
    if max_chunks is not None:
        n = max(0, min(n, max_chunks))
    ns = bytes(namespace_fp)
    cls, make = ChunkKey, _object_new
    out: list[ChunkKey] = []
    append = out.append
    for i, d in enumerate(chunk_digests(ns, arr, chunk_tokens, n, ext, bound)):
        key = make(cls)  # ChunkKey._new, inline: a 524,288-token prompt makes 2,048 of them
        fields = key.__dict__  # item by item: 0.06 us a key less than dict.update(**kwargs)
        fields["digest"] = d
        fields["index"] = i
        fields["namespace"] = ns
        append(key)
    return out


@dataclass(frozen=True)
class KeyedTokens:
    """A request's tokens converted once and the chained keys of its full chunks.

    Made by :func:`prepare_tokens`; a probe can carry it into the restore so neither the
    conversion nor the hashing runs twice.
    """

    tokens: np.ndarray[Any, np.dtype[np.int64]]
    keys: tuple[ChunkKey, ...]
    namespace: bytes
    chunk_tokens: int
    #: the extras bound into the keys, sorted (:func:`check_extras`)
    extras: tuple[KeyExtra, ...] = ()

    def keys_for(self, num_tokens: int) -> tuple[ChunkKey, ...]:
        """Keys of the full chunks of the first ``num_tokens`` tokens (a prefix shares keys)."""
        return self.keys[: max(0, num_tokens) // self.chunk_tokens]


def prepare_tokens(
    namespace_fp: bytes,
    tokens: TokensLike,
    chunk_tokens: int,
    *,
    max_chunks: int | None = None,
    extras: Extras | None = None,
) -> KeyedTokens:
    """Convert ``tokens`` and derive their chunk keys in one pure, synchronous call.

    ``extras``: what besides the token ids changes the state (:class:`KeyExtra`: a tenant's
    salt, an adapter, an image, prompt embeddings), bound into the keys of the chunks they
    overlap. The engine runs it inline for short prompts and in a worker thread when
    ``token_count(tokens) > OFFLOAD_TOKENS`` (``anyio.to_thread.run_sync(prepare_tokens, ...)``),
    so a long prompt never holds the event loop for long.
    """
    positive_int(chunk_tokens, "chunk_tokens")
    arr, bound = _checked_array(tokens)
    ext = check_extras(extras)
    keys = _keys_of(namespace_fp, arr, chunk_tokens, max_chunks, ext, bound)  # converted once
    return KeyedTokens(arr, tuple(keys), bytes(namespace_fp), chunk_tokens, ext)
