"""How a model's reusable state is described: state groups and the chunked layout.

A :class:`StateLayout` is a tuple of :class:`StateGroup` s plus ``chunk_tokens``. Each group is
homogeneous: ``num_layers`` layers, ``token_bytes`` bytes per token per layer, optionally only the
last ``window_tokens`` tokens needed (sliding-window attention). Everything that changes the
stored bytes is folded into :attr:`StateLayout.fingerprint`, so a layout change makes every key
different (a miss) rather than a corrupt read.

A staging *slot* holds one whole chunk across all groups; group regions inside a slot start at
:data:`ALIGNMENT`-byte boundaries so that O_DIRECT and GPU DMA reads can land directly in them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._check import positive_int, utf8_text
from .._errors import ConfigError, LayoutError, UnknownGroupError

#: Byte alignment of group regions inside a staging slot (and of O_DIRECT I/O).
ALIGNMENT = 4096

_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
        raise LayoutError(
            f"unsupported dtype {dtype}; use one of {sorted(_DTYPES)}", dtype=str(dtype)
        )
    if dtype not in _DTYPES:
        raise LayoutError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}", dtype=dtype)
    return dtype


def utf8_name(value: str, what: str, *, error: type[ConfigError] = LayoutError) -> bytes:
    """``value`` encoded as UTF-8, or ``error`` saying which character cannot be encoded.

    Names and ids are hashed into fingerprints and object ids as UTF-8 (see
    :func:`bsr._check.utf8_text`, which this is).
    """
    return utf8_text(value, what, error=error)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def _check_prefix(prefix_chunks: object) -> None:
    if isinstance(prefix_chunks, bool) or not isinstance(prefix_chunks, int) or prefix_chunks < 0:
        raise LayoutError(f"prefix_chunks must be an int >= 0, got {prefix_chunks!r}")


def check_every(every: object, what: str = "checkpoint_chunks") -> int | None:
    """``every`` as a window checkpoint interval in chunks: a positive int, or ``None`` (none)."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        raise LayoutError(
            f"{what} must be a positive int (chunks between window checkpoints) or None, "
            f"got {every!r}"
        )
    return every


def checkpoint_ends(prefix_chunks: int, every: int | None) -> range:
    """The window checkpoints strictly below a prefix of ``prefix_chunks`` chunks: every
    ``every``-th chunk boundary (``every`` chunks, ``2 * every``, ...); none when ``every`` is
    ``None``. A save with window checkpoints stores each sliding-window group's window at these
    prefix ends as well as at the prefix's own end."""
    if every is None:
        return range(0)
    return range(every, prefix_chunks, every)


@dataclass(frozen=True)
class StateGroup:
    """One homogeneous part of a model's reusable state (an allocator group).

    Args:
        name: unique name inside the layout, e.g. ``"kv"``, ``"swa_kv"``, ``"mla"``.
        num_layers: layers this group spans.
        token_bytes: bytes per token per layer (e.g. K and V of all KV heads: 2 x 8 x 128 x 2).
        window_tokens: for sliding-window groups, how many trailing tokens are needed; ``None``
            means every token of the prefix is needed.
        dtype: element type of the stored values (for typed views); ``token_bytes`` must be a
            multiple of its size.
    """

    name: str
    num_layers: int
    token_bytes: int
    window_tokens: int | None = None
    dtype: str = "bfloat16"

    @staticmethod
    def dtype_name(dtype: str | torch.dtype) -> str:
        """The name bsr uses for ``dtype`` (a torch dtype or a name such as ``"bfloat16"``).

        Raises:
            LayoutError: bsr does not support the dtype.
        """
        return _dtype_name(dtype)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(
                "a StateGroup needs a non-empty name of at most 64 bytes", group=self.name
            )
        if len(utf8_name(self.name, "StateGroup.name")) > 64:
            raise LayoutError(
                f"StateGroup name {self.name!r} is longer than 64 bytes in UTF-8; shorten it",
                group=self.name,
            )
        for attr in ("num_layers", "token_bytes"):
            positive_int(
                getattr(self, attr), f"StateGroup.{attr}", error=LayoutError, group=self.name
            )
        if self.window_tokens is not None and (
            isinstance(self.window_tokens, bool)
            or not isinstance(self.window_tokens, int)
            or self.window_tokens <= 0
        ):
            raise LayoutError(
                "StateGroup.window_tokens must be a positive int or None, "
                f"got {self.window_tokens!r}",
                group=self.name,
            )
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        itemsize = _DTYPES[self.dtype].itemsize
        if self.token_bytes % itemsize:
            raise LayoutError(
                f"token_bytes={self.token_bytes} is not a multiple of the {self.dtype} item size "
                f"({itemsize}); fix token_bytes or dtype",
                group=self.name,
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one chunk of this group (all layers)."""
        return self.num_layers * chunk_tokens * self.token_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "token_bytes": self.token_bytes,
            "window_tokens": self.window_tokens,
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class StateLayout:
    """The chunked layout of a model's reusable state on one rank.

    Args:
        chunk_tokens: tokens per chunk (only full chunks are stored). Default 256.
        groups: the state groups, in a fixed order (the order is part of the fingerprint).
    """

    chunk_tokens: int = 256
    groups: tuple[StateGroup, ...] = ()
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ct = positive_int(self.chunk_tokens, "chunk_tokens", error=LayoutError)
        groups = tuple(self.groups) if isinstance(self.groups, Iterable) else self.groups
        if not isinstance(groups, tuple) or not groups:
            raise LayoutError(
                "a StateLayout needs at least one StateGroup, "
                "e.g. groups=(StateGroup('kv', 32, 4096),)"
            )
        for g in groups:
            if not isinstance(g, StateGroup):
                raise LayoutError(f"groups must hold StateGroup objects, got {type(g).__name__}")
        names = [g.name for g in groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise LayoutError(f"duplicate state group names {dupes}; give each group a unique name")
        object.__setattr__(self, "groups", groups)
        offsets = []
        off = 0
        for g in groups:
            offsets.append(off)
            off = align_up(off + g.chunk_bytes(ct))
        object.__setattr__(self, "_offsets", tuple(offsets))

    # ------------------------------------------------------------------ lookup
    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def group(self, name: str) -> StateGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise UnknownGroupError(
            f"unknown state group {name!r}; this layout has {list(self.group_names)}", group=name
        )

    def group_index(self, name: str) -> int:
        return self.group_names.index(self.group(name).name)

    # ------------------------------------------------------------------ sizes
    def group_chunk_bytes(self, name: str) -> int:
        return self.group(name).chunk_bytes(self.chunk_tokens)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all groups (what a chunk costs to move)."""
        return sum(g.chunk_bytes(self.chunk_tokens) for g in self.groups)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one staging slot: every group's chunk, each region 4 KiB aligned.

        Equals :attr:`chunk_bytes` when every group's chunk is a multiple of 4 KiB (the usual case).
        """
        last = self.groups[-1]
        return align_up(self._offsets[-1] + last.chunk_bytes(self.chunk_tokens))

    def slot_offset(self, name: str) -> int:
        """Byte offset of group ``name`` inside a staging slot."""
        return self._offsets[self.group_index(name)]

    @property
    def token_bytes(self) -> int:
        """Bytes per token over all groups and layers."""
        return sum(g.token_bytes * g.num_layers for g in self.groups)

    def num_chunks(self, num_tokens: int) -> int:
        """Full chunks in ``num_tokens`` tokens."""
        return num_tokens // self.chunk_tokens

    def needed_chunks(self, name: str, prefix_chunks: int) -> range:
        """Chunks of group ``name`` needed to reuse a prefix of ``prefix_chunks`` chunks.

        A group without a window needs all of them; a sliding-window group needs only the chunks
        overlapping the last ``window_tokens`` tokens before the prefix end.
        """
        g = self.group(name)
        if g.window_tokens is None or prefix_chunks == 0:
            return range(prefix_chunks)
        first = max(0, prefix_chunks - math.ceil(g.window_tokens / self.chunk_tokens))
        return range(first, prefix_chunks)

    def needed_objects(self, prefix_chunks: int) -> list[tuple[int, str]]:
        """Every ``(chunk, group)`` object a prefix of ``prefix_chunks`` chunks reads, in chunk
        order (groups in layout order inside a chunk).

        With the chunk keys of the prefix (``bsr.chunk_keys``) this names exactly the stored
        objects a restore reads, e.g. ``FileTier.object_path(keys[c], g)`` for each pair.
        """
        _check_prefix(prefix_chunks)
        per_chunk: dict[int, list[str]] = {}
        for g in self.groups:
            for c in self.needed_chunks(g.name, prefix_chunks):
                per_chunk.setdefault(c, []).append(g.name)
        return [(c, name) for c in sorted(per_chunk) for name in per_chunk[c]]

    def stored_objects(
        self, prefix_chunks: int, checkpoint_chunks: int | None = None
    ) -> list[tuple[int, str]]:
        """Every ``(chunk, group)`` object a save of ``prefix_chunks`` chunks stores when every
        block holds its state, in chunk order (groups in layout order inside a chunk).

        A group without a window stores every chunk. A sliding-window group stores the chunks of
        its window at the end of the prefix and, with ``checkpoint_chunks`` = k, also at every
        k-th chunk boundary below it (a *window checkpoint*): a later prefix that shares only the
        first ``j`` chunks restores up to the last checkpoint at or below ``j``.
        """
        _check_prefix(prefix_chunks)
        check_every(checkpoint_chunks)
        ends = (*checkpoint_ends(prefix_chunks, checkpoint_chunks), prefix_chunks)
        per_chunk: dict[int, list[str]] = {}
        for g in self.groups:
            chunks = set(range(prefix_chunks)) if g.window_tokens is None else set()
            if g.window_tokens is not None:
                for e in ends:
                    chunks.update(self.needed_chunks(g.name, e))
            for c in chunks:
                per_chunk.setdefault(c, []).append(g.name)
        return [(c, name) for c in sorted(per_chunk) for name in per_chunk[c]]

    # ------------------------------------------------------------------ identity
    def to_dict(self) -> dict[str, Any]:
        return {"chunk_tokens": self.chunk_tokens, "groups": [g.to_dict() for g in self.groups]}

    @property
    def fingerprint(self) -> bytes:
        """16-byte digest of everything that affects stored bytes."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canon, digest_size=16, person=b"bsr-layout").digest()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StateLayout:
        return cls(
            chunk_tokens=int(data["chunk_tokens"]),
            groups=tuple(StateGroup(**g) for g in data["groups"]),
        )


def kv_layout(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str = "bfloat16",
    chunk_tokens: int = 256,
    window_tokens: int | None = None,
    name: str = "kv",
) -> StateLayout:
    """Layout of a plain (GQA/MHA) attention KV cache: K and V of every KV head per token."""
    itemsize = _DTYPES[_dtype_name(dtype)].itemsize
    token_bytes = 2 * num_kv_heads * head_dim * itemsize
    return StateLayout(
        chunk_tokens=chunk_tokens,
        groups=(
            StateGroup(name, num_layers, token_bytes, window_tokens=window_tokens, dtype=dtype),
        ),
    )
