"""Namespaces and chained chunk keys.

How it works: a :class:`Namespace` (model id, tensor-parallel rank and size, tenant salt) is
combined with the layout fingerprint and the object format version into a 16-byte namespace
fingerprint. That fingerprint seeds a hash chain over full token chunks::

    key_0 = BLAKE2b(seed=ns_fp, tokens[0:C])
    key_i = BLAKE2b(key_{i-1}, tokens[i*C:(i+1)*C])

so a key names a *prefix*, not a chunk in isolation, and different namespaces never share keys.
Tokens are hashed as little-endian int64, independent of PYTHONHASHSEED, process and platform.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from .._errors import ConfigError, TokenError
from ._layout import StateLayout

#: Version of the stored object format and key derivation. Part of every namespace.
FORMAT_VERSION = 1

KEY_BYTES = 32

TokensLike = Union[Sequence[int], "np.ndarray[Any, Any]", torch.Tensor]


@dataclass(frozen=True)
class Namespace:
    """Who owns stored objects: objects of different namespaces never meet.

    Args:
        model_id: the model (and revision) whose state is stored.
        tp_rank: this process's tensor-parallel rank.
        tp_size: tensor-parallel world size.
        salt: optional tenant salt, to keep tenants' prefixes apart.
    """

    model_id: str
    tp_rank: int = 0
    tp_size: int = 1
    salt: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError("Namespace.model_id must be a non-empty string, e.g. 'llama-3-8b'")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ConfigError(f"Namespace.tp_size must be an int >= 1, got {self.tp_size!r}")
        if (
            isinstance(self.tp_rank, bool)
            or not isinstance(self.tp_rank, int)
            or not 0 <= self.tp_rank < self.tp_size
        ):
            raise ConfigError(
                f"Namespace.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        if not isinstance(self.salt, (bytes, bytearray)):
            raise ConfigError("Namespace.salt must be bytes; encode a string salt first")
        object.__setattr__(self, "salt", bytes(self.salt))

    def fingerprint(self, layout: StateLayout) -> bytes:
        """16-byte digest of model, rank, salt, layout fingerprint and format version."""
        h = hashlib.blake2b(digest_size=16, person=b"bsr-namespace")
        model = self.model_id.encode()
        h.update(len(model).to_bytes(4, "little") + model)
        h.update(self.tp_rank.to_bytes(4, "little") + self.tp_size.to_bytes(4, "little"))
        h.update(len(self.salt).to_bytes(4, "little") + self.salt)
        h.update(layout.fingerprint)
        h.update(FORMAT_VERSION.to_bytes(4, "little"))
        return h.digest()


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


@dataclass(frozen=True)
class ObjectKey:
    """One stored object: a chunk key and a state group."""

    chunk: ChunkKey
    group: str

    @property
    def object_id(self) -> str:
        """Hex digest naming the object in a tier (file names derive only from it)."""
        h = hashlib.blake2b(self.chunk.digest, digest_size=20, person=b"bsr-object")
        h.update(self.group.encode())
        return h.hexdigest()

    @property
    def group_digest(self) -> bytes:
        return hashlib.blake2b(self.group.encode(), digest_size=16, person=b"bsr-group").digest()


def as_token_array(tokens: TokensLike) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Normalise tokens to a 1-D little-endian int64 numpy array, with clear errors."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TokenError(
                f"tokens must be an integer tensor, got dtype {tokens.dtype}; pass token ids "
                "(e.g. tokens.long())",
                dtype=str(tokens.dtype),
            )
        arr = tokens.detach().to("cpu").reshape(-1).numpy()
        if tokens.dim() > 1 and not (tokens.dim() == 2 and tokens.shape[0] == 1):
            raise TokenError(f"tokens must be 1-D (or [1, n]), got shape {tuple(tokens.shape)}")
    elif isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TokenError(
                f"tokens must be an integer array, got dtype {tokens.dtype}; pass token ids",
                dtype=str(tokens.dtype),
            )
        if tokens.ndim > 1 and not (tokens.ndim == 2 and tokens.shape[0] == 1):
            raise TokenError(f"tokens must be 1-D (or [1, n]), got shape {tokens.shape}")
        arr = tokens.reshape(-1)
    elif isinstance(tokens, (str, bytes, bytearray)):
        raise TokenError(
            f"tokens must be token ids, got {type(tokens).__name__}; tokenize the text first"
        )
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise TokenError(
                f"tokens must be a sequence of ints, a numpy array or a torch tensor, "
                f"got {type(tokens).__name__}"
            ) from None
        for t in items:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TokenError(
                    f"tokens must be ints, found {type(t).__name__} {t!r}; pass token ids"
                )
        try:
            arr = np.asarray(items, dtype=np.int64)
        except OverflowError:
            raise TokenError("a token id does not fit in int64") from None
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise TokenError("a token id does not fit in int64")
    arr = arr.astype("<i8", copy=False)
    if arr.size and int(arr.min()) < 0:
        raise TokenError(
            f"token ids must be >= 0, found {int(arr.min())}; strip padding/sentinel ids first"
        )
    return arr


def chunk_keys(
    namespace_fp: bytes, tokens: TokensLike, chunk_tokens: int, *, max_chunks: int | None = None
) -> list[ChunkKey]:
    """Chained keys of every full chunk of ``tokens`` (at most ``max_chunks``)."""
    arr = as_token_array(tokens)
    n = len(arr) // chunk_tokens
    if max_chunks is not None:
        n = min(n, max_chunks)
    keys: list[ChunkKey] = []
    prev = namespace_fp
    data = arr[: n * chunk_tokens].tobytes()
    step = chunk_tokens * 8
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=b"bsr-chunk")
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(ChunkKey(prev, i, namespace_fp))
    return keys
