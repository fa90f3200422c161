"""PagedKVCache: the destination of a restore, a paged cache in the style of vLLM.

Where it runs: the serving process, over CPU or CUDA tensors; no I/O.

How it works: each state group is either one *stacked* tensor of shape
``[num_layers, num_blocks, block_tokens, token_bytes]`` (uint8 storage; :meth:`PagedKVCache.typed`
gives a view in the group's dtype), or, built with :meth:`PagedKVCache.from_layer_tensors`, one
no-copy uint8 view ``[num_blocks, block_tokens, token_bytes]`` per layer over a serving engine's
own per-layer tensors (any dtype and shape whose bytes per block are contiguous, such as vLLM's
``[num_blocks, 2, block_size, heads * head_dim]``). Only whole blocks are moved, so the bytes of a
block are opaque: a "token row" of such a view need not hold one token's values. A request's block
table (``block_ids``) maps its token positions to blocks: token ``t`` lives in block
``block_ids[t // block_tokens]`` at row ``t % block_tokens``. A chunk of ``chunk_tokens`` tokens
therefore spans ``chunk_tokens // block_tokens`` blocks, which need not be contiguous.

:func:`gather_chunk` and :func:`install_chunk` move one chunk of one group between the cache and
a flat ``[num_layers, chunk_tokens, token_bytes]`` buffer (a staging slot region): one indexed
copy over the stacked tensor, or one per layer over per-layer views.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._check import int_at_least, positive_int
from .._errors import ConfigError, LayoutError
from .._memory import HUGE_PAGE_MIN_BYTES, anonymous_buffer
from ..core._layout import StateLayout
from ._tables import BlockTables, build_tables, table_array


def _zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A group's zeroed uint8 tensor: on the CPU, from :data:`~bsr._memory.HUGE_PAGE_MIN_BYTES`
    up, anonymous memory given the huge-page advice (installs into it walk the page tables per
    2 MiB); elsewhere torch's."""
    nbytes = math.prod(shape)
    if device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES:
        return torch.zeros(shape, dtype=torch.uint8, device=device)
    buf, _ = anonymous_buffer(nbytes)
    return torch.from_numpy(buf).view(shape)


class PagedKVCache:
    """Paged per-group cache tensors on ``device`` ("cpu" or "cuda[:n]").

    A tensor the cache makes on the CPU (4 MiB and up) lies in anonymous memory given the
    transparent huge-page advice (Linux): a restore's installs into it, and a model's reads,
    walk the page tables once per 2 MiB.

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
        int_at_least(num_blocks, "num_blocks", 1)
        int_at_least(block_tokens, "block_tokens", 1)
        if layout.chunk_tokens % block_tokens:
            raise LayoutError(
                f"chunk_tokens={layout.chunk_tokens} is not a multiple of block_tokens="
                f"{block_tokens}; choose a block size that divides the chunk size"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        #: blocks of each group: ``num_blocks`` for every group, except in a cache of
        #: :meth:`from_layer_tensors` whose groups differ (``num_blocks`` is then the fewest)
        self.group_blocks: dict[str, int] = dict.fromkeys(layout.group_names, num_blocks)
        self.block_tokens = block_tokens
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._layers: dict[str, tuple[torch.Tensor, ...]] = {}
        for g in layout.groups:
            shape = (g.num_layers, num_blocks, block_tokens, g.token_bytes)
            if tensors is _NO_TENSORS:
                continue  # from_layer_tensors sets the per-layer views
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
                self._tensors[g.name] = _zeros(shape, self.device)
        #: groups whose tensors share memory block for block (block ``b`` of one is block ``b``
        #: of the others): one request's tables must give them different blocks
        self.aliased: tuple[tuple[str, ...], ...] = ()
        if tensors is not _NO_TENSORS:
            self.aliased = _aliased_groups(self)

    @classmethod
    def from_layer_tensors(
        cls,
        layout: StateLayout,
        layers: Mapping[str, Sequence[torch.Tensor]],
        block_tokens: int,
    ) -> PagedKVCache:
        """A cache viewing an engine's own per-layer tensors, with no copy.

        Args:
            layout: the state layout; group ``g`` has ``g.num_layers`` entries in ``layers[g]``.
            layers: per group, one tensor per layer. Each is any dtype and shape whose first
                dimension is the block index and whose bytes per block are contiguous, e.g.
                vLLM's ``[num_blocks, 2, block_size, kv_heads * head_dim]`` bfloat16; its bytes
                per block must equal ``block_tokens * token_bytes`` of the group. Every layer of a
                group has the same number of blocks; groups may differ (a caller's own buffer for
                one group, sized to a request): a block table then names blocks of each group's
                own range, and one table for every group must fit the smallest, which is
                ``num_blocks`` (:attr:`group_blocks` has each). Every tensor lives on one device.
            block_tokens: tokens per block.

        Raises:
            LayoutError: a group is missing, a layer count, block size or device differs, the
                layers of a group differ in blocks, or a tensor's block bytes are not contiguous
                (split such a tensor into parts that are, e.g. the K and V halves of a
                ``[2, num_blocks, ...]`` tensor, and count each part as a layer).
        """
        positive_int(block_tokens, "block_tokens")
        if not isinstance(layout, StateLayout):
            raise ConfigError(f"layout must be a StateLayout, got {type(layout).__name__}")
        views: dict[str, tuple[torch.Tensor, ...]] = {}
        blocks: dict[str, int] = {}
        device: torch.device | None = None
        for g in layout.groups:
            ts = layers.get(g.name)
            if ts is None:
                raise LayoutError(f"layers lacks group {g.name!r}", group=g.name)
            ts = list(ts)
            if len(ts) != g.num_layers:
                raise LayoutError(
                    f"group {g.name!r} has num_layers={g.num_layers} but {len(ts)} tensors were "
                    "given; pass one tensor per layer",
                    group=g.name,
                )
            out = []
            for i, t in enumerate(ts):
                v = _block_view(t, block_tokens, g.token_bytes, f"{g.name}[{i}]")
                if device is None:
                    device = v.device
                first = blocks.setdefault(g.name, v.shape[0])
                if v.shape[0] != first or v.device != device:
                    raise LayoutError(
                        f"tensor {g.name}[{i}] has {v.shape[0]} blocks on {v.device}, the group's "
                        f"first has {first} on {device}; every layer of a group must share "
                        "blocks, and every tensor the device",
                        group=g.name,
                    )
                out.append(v)
            views[g.name] = tuple(out)
        assert device is not None
        cache = cls.__new__(cls)
        cls.__init__(cache, layout, min(blocks.values()), block_tokens, device, tensors=_NO_TENSORS)
        cache.group_blocks = blocks
        cache._layers = views
        cache.aliased = _aliased_groups(cache)
        return cache

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.chunk_tokens // self.block_tokens

    @property
    def per_layer(self) -> bool:
        """Whether this cache views per-layer tensors (:meth:`from_layer_tensors`)."""
        return bool(self._layers)

    def tensor(self, group: str) -> torch.Tensor:
        """The uint8 tensor ``[num_layers, num_blocks, block_tokens, token_bytes]`` of a group.

        Raises:
            LayoutError: the cache views per-layer tensors (use :meth:`layers`).
        """
        self.layout.group(group)
        if self._layers:
            raise LayoutError(
                "this cache views per-layer tensors and has no stacked tensor; "
                "use cache.layers(group)",
                group=group,
            )
        return self._tensors[group]

    def layers(self, group: str) -> tuple[torch.Tensor, ...]:
        """One uint8 view ``[num_blocks, block_tokens, token_bytes]`` per layer of a group."""
        self.layout.group(group)
        if self._layers:
            return self._layers[group]
        return tuple(self._tensors[group].unbind(0))

    def typed(self, group: str) -> torch.Tensor:
        """A view of the group's tensor in its dtype: ``[L, blocks, block_tokens, elems]``."""
        g = self.layout.group(group)
        return self.tensor(group).view(g.torch_dtype)

    @property
    def nbytes(self) -> int:
        if self._layers:
            return sum(v.numel() for vs in self._layers.values() for v in vs)
        return sum(t.numel() for t in self._tensors.values())

    def block_table(self, block_ids: Any, num_tokens: int) -> torch.Tensor:
        """Validate a block table for ``num_tokens`` tokens; return it as an int64 CPU tensor.

        The checks run in NumPy on the int64 ids (a sort finds repeats), never in torch: they
        run on the caller's event loop, and torch's intra-op thread pool turns a 65,536-id
        ``unique`` into 100+ ms on a busy machine.

        Raises:
            BlockTableError: not a 1-D integer sequence, too short, out of range, or a block id
                repeated among the blocks the ``num_tokens`` tokens occupy (two chunks would
                alias one block, so a restore would commit, or a save store, wrong bytes).
        """
        arr = table_array(
            block_ids, num_tokens, self.block_tokens, self.num_blocks, allow_null=False
        )
        return torch.from_numpy(arr)

    def block_tables(self, block_ids: Any, num_tokens: int) -> BlockTables:
        """Validate one request's block tables for ``num_tokens`` tokens.

        Args:
            block_ids: one 1-D table for every group, or a mapping group name -> table (every
                group of the layout, no other). An entry may be ``bsr.NULL_BLOCK`` (-1): no
                block there, e.g. a sliding-window group's blocks outside its window; bsr
                neither reads from nor writes to it.
            num_tokens: the tokens the tables must cover.

        Raises:
            BlockTableError: a table is malformed, too short, out of range or repeats a block;
                the mapping misses a group or names another; or groups whose tensors share
                memory (:attr:`aliased`) share a real block.
        """
        return build_tables(
            self.layout, block_ids, num_tokens, self.block_tokens, self.group_blocks, self.aliased
        )

    def chunk_blocks(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        bpc = self.blocks_per_chunk
        return ids[chunk * bpc : (chunk + 1) * bpc]

    def check_layout(self, layout: StateLayout) -> None:
        """Raise unless this cache was built for ``layout`` (the engine's)."""
        if layout is not self.layout and layout.fingerprint != self.layout.fingerprint:
            raise LayoutError(
                "cache layout differs from the engine's layout; build the PagedKVCache with the "
                "engine's StateLayout"
            )


#: Sentinel for ``__init__``: build no tensors (``from_layer_tensors`` supplies views).
_NO_TENSORS: dict[str, torch.Tensor] = {}


def _span(v: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` addresses of a uint8 view's bytes."""
    if v.numel() == 0:
        return v.data_ptr(), v.data_ptr()
    return v.data_ptr(), v.data_ptr() + sum((n - 1) * s for n, s in zip(v.shape, v.stride())) + 1


def _aliased_groups(cache: PagedKVCache) -> tuple[tuple[str, ...], ...]:
    """The sets of groups whose layer tensors share memory, block for block.

    Two layers may share memory only if they belong to different groups and view it
    identically (same address, shape and strides: block ``b`` of one is block ``b`` of the
    other), as vLLM's hybrid KV cache manager lays one layer of each group over one buffer.

    Raises:
        LayoutError: two layers of one group overlap, or layers of two groups overlap without
            viewing the memory block for block.
    """
    views = [
        (_span(v), g.name, i, v)
        for g in cache.layout.groups
        for i, v in enumerate(cache.layers(g.name))
    ]
    views.sort(key=lambda x: x[0])
    parent = {g: g for g in cache.layout.group_names}

    def root(g: str) -> str:
        while parent[g] != g:
            g = parent[g]
        return g

    for j, ((start, _), g, i, v) in enumerate(views):
        for (_, end_o), g_o, i_o, v_o in views[:j]:
            if end_o <= start:
                continue
            if g == g_o:
                raise LayoutError(
                    f"layers {i_o} and {i} of group {g!r} share memory; every layer of a group "
                    "needs its own blocks (KV sharing between layers is not supported)",
                    group=g,
                )
            same = (
                v.data_ptr() == v_o.data_ptr()
                and tuple(v.shape) == tuple(v_o.shape)
                and v.stride() == v_o.stride()
            )
            if not same:
                raise LayoutError(
                    f"layer {i_o} of group {g_o!r} and layer {i} of group {g!r} share memory "
                    "but do not view it block for block (same address, shape and strides); "
                    "give each group its own memory or identical views of a shared buffer",
                    group=g,
                )
            parent[root(g)] = root(g_o)
    sets: dict[str, list[str]] = {}
    for g in cache.layout.group_names:
        sets.setdefault(root(g), []).append(g)
    return tuple(tuple(gs) for gs in sets.values() if len(gs) > 1)


def _block_view(t: Any, block_tokens: int, token_bytes: int, what: str) -> torch.Tensor:
    """A uint8 ``[num_blocks, block_tokens, token_bytes]`` view sharing ``t``'s storage."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise LayoutError(f"tensor {what} must be a torch.Tensor with a block dimension first")
    per_block = t[0].numel() * t.element_size() if t.shape[0] else 0
    if per_block != block_tokens * token_bytes:
        raise LayoutError(
            f"tensor {what} holds {per_block} bytes per block ({t.dtype} {tuple(t.shape)}); the "
            f"layout needs block_tokens x token_bytes = {block_tokens} x {token_bytes}",
        )
    if not t[0].is_contiguous():
        raise LayoutError(
            f"tensor {what} ({tuple(t.shape)}, strides {t.stride()}) does not keep each block's "
            "bytes contiguous; pass parts that do (e.g. K and V halves) as separate layers",
        )
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(t.shape[0], 1)
    v = flat.view(torch.uint8).view(t.shape[0], block_tokens, token_bytes)
    if v.data_ptr() != t.data_ptr():  # pragma: no cover - reshape of a contiguous block is a view
        raise LayoutError(f"tensor {what} cannot be viewed without a copy")
    return v


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


def _layer_rows(layer: torch.Tensor, row: int, other: torch.Tensor) -> torch.Tensor:
    """One layer ``[num_blocks, block_tokens, token_bytes]`` as ``[num_blocks, row]`` words.

    The widest word that ``row``, both base addresses and the layer's block stride allow (the
    block stride of an engine's tensor may be larger than ``row`` when blocks are padded).
    """
    rows = layer.view(layer.shape[0], row)
    dtype = _wide_dtype(row, rows, other)
    while dtype != torch.uint8 and rows.stride(0) % dtype.itemsize:
        dtype = {torch.int64: torch.int32, torch.int32: torch.int16}.get(dtype, torch.uint8)
    return rows.view(dtype)


def gather_chunk(cache: PagedKVCache, group: str, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Copy one chunk of ``group`` from the cache blocks ``blocks`` into flat ``out``."""
    g = cache.layout.group(group)
    row = cache.block_tokens * g.token_bytes
    dst3 = out[: g.num_layers * len(blocks) * row].view(g.num_layers, len(blocks), row)
    if cache.per_layer:
        layers = cache.layers(group)
        idx = blocks.to(layers[0].device)
        for i, layer in enumerate(layers):
            src2 = _layer_rows(layer, row, dst3)
            dst2 = dst3[i].view(src2.dtype)
            if layer.device == out.device:
                torch.index_select(src2, 0, idx, out=dst2)
            else:
                dst2.copy_(torch.index_select(src2, 0, idx))
        return
    src = cache.tensor(group)
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
    first: int = 0,
) -> None:
    """Copy one staged chunk of ``group`` (flat ``region``) into the cache blocks ``blocks``.

    ``first``: the chunk's first ``first`` blocks are left alone (neither ``blocks[:first]`` nor
    their rows of ``region`` are touched); the rest of the chunk is installed. Entries of
    ``blocks`` that are ``NULL_BLOCK`` (no block) are skipped with their rows.
    """
    g = cache.layout.group(group)
    row = cache.block_tokens * g.token_bytes
    src3 = region[: g.num_layers * len(blocks) * row].view(g.num_layers, len(blocks), row)
    if first:
        src3, blocks = src3[:, first:], blocks[first:]
    real = blocks >= 0
    if not bool(real.all()):
        keep = torch.nonzero(real).flatten()
        src3, blocks = src3.index_select(1, keep.to(src3.device)), blocks[real]
        if not len(blocks):
            return
    if cache.per_layer:
        layers = cache.layers(group)
        if src3.device != layers[0].device:
            src3 = src3.to(layers[0].device, non_blocking=non_blocking)
        idx = blocks.to(layers[0].device, non_blocking=non_blocking)
        for i, layer in enumerate(layers):
            dst2 = _layer_rows(layer, row, src3)
            dst2.index_copy_(0, idx, src3[i].view(dst2.dtype))
        return
    dst = cache.tensor(group)
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
