"""PagedKVCache: the destination of a restore, a paged cache in the style of vLLM.

Each state group owns one tensor of shape ``[num_layers, num_blocks, block_tokens, token_bytes]``
(uint8 storage; :meth:`PagedKVCache.typed` gives a view in the group's dtype). A request's block
table (``block_ids``) maps its token positions to blocks: token ``t`` lives in block
``block_ids[t // block_tokens]`` at row ``t % block_tokens``. A chunk of ``chunk_tokens`` tokens
therefore spans ``chunk_tokens // block_tokens`` blocks, which need not be contiguous.

:func:`gather_chunk` and :func:`install_chunk` move one chunk of one group between the cache and
a flat ``[num_layers, chunk_tokens, token_bytes]`` buffer (a staging slot region).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._errors import BlockTableError, ConfigError, LayoutError
from ..core._layout import StateLayout


class PagedKVCache:
    """Paged per-group cache tensors on ``device`` ("cpu" or "cuda[:n]").

    Args:
        layout: the state layout; ``chunk_tokens`` must be a multiple of ``block_tokens``.
        num_blocks: blocks per group.
        block_tokens: tokens per block (e.g. 16).
        device: where the tensors live.
        tensors: optional existing per-group tensors (e.g. views of an engine's KV cache), each of
            shape ``[num_layers, num_blocks, block_tokens, token_bytes]`` and dtype uint8.
    """

    def __init__(
        self,
        layout: StateLayout,
        num_blocks: int,
        block_tokens: int = 16,
        device: str | torch.device = "cpu",
        *,
        tensors: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if layout.chunk_tokens % block_tokens:
            raise LayoutError(
                f"chunk_tokens={layout.chunk_tokens} is not a multiple of block_tokens="
                f"{block_tokens}; choose a block size that divides the chunk size"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        for g in layout.groups:
            shape = (g.num_layers, num_blocks, block_tokens, g.token_bytes)
            if tensors is not None:
                t = tensors.get(g.name)
                if t is None:
                    raise LayoutError(f"tensors lacks group {g.name!r}", group=g.name)
                if tuple(t.shape) != shape or t.dtype != torch.uint8:
                    raise LayoutError(
                        f"tensor of group {g.name!r} must be uint8 {shape}, got {t.dtype} "
                        f"{tuple(t.shape)}",
                        group=g.name,
                    )
                self._tensors[g.name] = t
            else:
                self._tensors[g.name] = torch.zeros(shape, dtype=torch.uint8, device=self.device)

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.chunk_tokens // self.block_tokens

    def tensor(self, group: str) -> torch.Tensor:
        """The uint8 tensor ``[num_layers, num_blocks, block_tokens, token_bytes]`` of a group."""
        self.layout.group(group)
        return self._tensors[group]

    def typed(self, group: str) -> torch.Tensor:
        """A view of the group's tensor in its dtype: ``[L, blocks, block_tokens, elems]``."""
        g = self.layout.group(group)
        return self._tensors[group].view(g.torch_dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    def block_table(self, block_ids: Any, num_tokens: int) -> torch.Tensor:
        """Validate a block table for ``num_tokens`` tokens; return it as an int64 CPU tensor."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise BlockTableError(f"block_ids must be integers, got {block_ids.dtype}")
            ids = block_ids.detach().to("cpu", torch.int64).reshape(-1)
        else:
            try:
                arr = np.asarray(block_ids)
            except Exception:
                raise BlockTableError("block_ids must be a sequence of ints") from None
            if arr.size and arr.dtype.kind not in "iu":
                raise BlockTableError(f"block_ids must be integers, got dtype {arr.dtype}")
            ids = torch.from_numpy(arr.astype(np.int64).reshape(-1))
        needed = -(-num_tokens // self.block_tokens)
        if len(ids) < needed:
            raise BlockTableError(
                f"{num_tokens} tokens need {needed} blocks of {self.block_tokens} tokens, "
                f"block_ids has {len(ids)}; pass the request's full block table",
                needed=needed,
                got=len(ids),
            )
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise BlockTableError(
                f"block ids must be in [0, {self.num_blocks}), got range "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        return ids

    def chunk_blocks(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        bpc = self.blocks_per_chunk
        return ids[chunk * bpc : (chunk + 1) * bpc]

    def check_layout(self, layout: StateLayout) -> None:
        """Raise unless this cache was built for ``layout`` (the engine's)."""
        if layout.fingerprint != self.layout.fingerprint:
            raise LayoutError(
                "cache layout differs from the engine's layout; build the PagedKVCache with the "
                "engine's StateLayout"
            )


def chunk_view(
    region: torch.Tensor, num_layers: int, chunk_tokens: int, token_bytes: int
) -> torch.Tensor:
    """View a flat staging region as ``[num_layers, chunk_tokens, token_bytes]``."""
    n = num_layers * chunk_tokens * token_bytes
    return region[:n].view(num_layers, chunk_tokens, token_bytes)


def _wide_dtype(row: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest element type dividing ``row`` that every (contiguous) tensor is aligned to.

    CPU ``index_copy_``/``index_select`` on uint8 move one byte per element (about 0.5 GB/s on a
    small CPU); the same bytes as int64 move several times faster. Bytes are unchanged.
    """
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def gather_chunk(cache: PagedKVCache, group: str, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Copy one chunk of ``group`` from the cache blocks ``blocks`` into flat ``out``."""
    g = cache.layout.group(group)
    src = cache.tensor(group)
    row = cache.block_tokens * g.token_bytes
    dst3 = out[: g.num_layers * len(blocks) * row].view(g.num_layers, len(blocks), row)
    idx = blocks.to(src.device)
    if not src.is_contiguous():
        dst3.copy_(torch.index_select(src, 1, idx).reshape(g.num_layers, len(blocks), row))
        return
    dtype = _wide_dtype(row, src, dst3)
    src3 = src.view(g.num_layers, cache.num_blocks, row).view(dtype)
    if src.device == out.device:
        torch.index_select(src3, 1, idx, out=dst3.view(dtype))
    else:
        dst3.view(dtype).copy_(torch.index_select(src3, 1, idx))


def install_chunk(
    cache: PagedKVCache,
    group: str,
    blocks: torch.Tensor,
    region: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> None:
    """Copy one staged chunk of ``group`` (flat ``region``) into the cache blocks ``blocks``."""
    g = cache.layout.group(group)
    dst = cache.tensor(group)
    row = cache.block_tokens * g.token_bytes
    src3 = region[: g.num_layers * len(blocks) * row].view(g.num_layers, len(blocks), row)
    if src3.device != dst.device:
        src3 = src3.to(dst.device, non_blocking=non_blocking)
    idx = blocks.to(dst.device, non_blocking=non_blocking)
    if not dst.is_contiguous():
        dst.index_copy_(
            1, idx, src3.view(g.num_layers, len(blocks), cache.block_tokens, g.token_bytes)
        )
        return
    dtype = _wide_dtype(row, dst, src3)
    dst3 = dst.view(g.num_layers, cache.num_blocks, row).view(dtype)
    dst3.index_copy_(1, idx, src3.view(dtype))
