"""bsr's view of vLLM's KV cache tensors: a StateLayout and a no-copy PagedKVCache.

Where it runs: vLLM's worker process, once, in ``register_kv_caches``; pure torch, no vLLM import.

How it works: vLLM hands over one tensor per attention layer, laid out as its attention backend
chose (the CPU backend here: ``[num_blocks, 2, block_size, kv_heads * head_dim]``; FlashAttention
style backends put K and V apart, ``[2, num_blocks, block_size, kv_heads, head_dim]``, and a
backend's stride order may permute the logical dimensions). bsr moves whole blocks as opaque
bytes, so all it needs is, per layer, *parts* whose bytes per block are contiguous. The tensor's
dimensions are put in memory order (largest stride first), the block dimension (the one of size
``num_blocks``) is found, every outer dimension before it is split off (K and V halves become two
parts) and each part is checked to hold its block's bytes contiguously; a layout with no outer
dimension (MLA's one latent vector per token, ``[num_blocks, 1, block_size, 576]`` on vLLM's
``CPU_MLA`` backend) is one part. Every part of every layer of one vLLM KV cache group is one
"layer" of a bsr :class:`~bsr.StateGroup`, so the group's ``num_layers`` is ``layers x parts``.
The layout fingerprint covers all of it: a different backend layout is a miss, never a wrong
read.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from bsr import LayoutError, PagedKVCache, StateGroup, StateLayout

_DTYPE_NAMES = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}


@dataclass(frozen=True)
class GroupSpec:
    """One vLLM KV cache group as bsr sees it.

    Attributes:
        name: the bsr group name.
        layer_names: vLLM layer names in this group, in model order.
        window_tokens: sliding-window length (``None``: full attention).
    """

    name: str
    layer_names: tuple[str, ...]
    window_tokens: int | None = None


#: vLLM KV cache specs whose every block holds every token's KV (nothing freed while a request
#: runs); subclasses that free or share blocks otherwise (R-SWA, sinks, ...) are refused
FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
#: specs of a sliding window: vLLM frees a request's blocks below its window
WINDOW_SPECS = frozenset({"SlidingWindowSpec"})


def group_window(spec: object) -> int | None:
    """The trailing tokens bsr stores for a vLLM KV cache group, from its ``kv_cache_spec``.

    Only a ``SlidingWindowSpec`` group (vLLM's hybrid manager on) keeps a window's KV: vLLM
    frees that group's blocks below the window and its prefix cache needs only the window. The
    next token attends to the last ``sliding_window - 1`` tokens, and vLLM keeps
    ``extra_retained_tokens`` more below them (and may cache them as valid), so bsr stores
    ``sliding_window - 1 + extra_retained_tokens`` trailing tokens: exactly the blocks vLLM
    keeps real after a load, no fewer (a block vLLM keeps but bsr did not write would be cached
    unwritten) and no more (vLLM hands blocks below them over as its null block).

    Every other known attention spec is full length, even one that carries a
    ``sliding_window``: with the hybrid manager off, vLLM merges a sliding-window model's layers
    into one ``FullAttentionSpec`` group whose ``sliding_window`` is set, every block holds every
    layer's KV, and a later request may reuse any block of the prefix from vLLM's own cache, so
    every chunk must be restored. ``MLAAttentionSpec`` (one latent vector per token) is full
    attention too.

    Raises:
        LayoutError: a spec kind bsr does not know how to store (Mamba state, chunked local
            attention, a ring buffer, R-SWA, ...): refusing is safer than guessing what it reuses.
    """
    kind = type(spec).__name__
    if kind in WINDOW_SPECS:
        window = int(spec.sliding_window)  # type: ignore[attr-defined]
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        if window <= 0 or extra < 0:
            raise LayoutError(
                f"KV cache group with sliding_window={window}, extra_retained_tokens={extra} "
                "is not supported"
            )
        return max(1, window - 1 + extra)
    if kind in FULL_SPECS:
        return None
    raise LayoutError(
        f"vLLM KV cache spec {kind} is not supported by BsrConnector (it stores "
        f"{sorted(FULL_SPECS | WINDOW_SPECS)} groups: full attention, MLA and sliding windows)"
    )


def layer_order(name: str) -> tuple[int, ...]:
    """Sort key: the integers in a layer name (``model.layers.10.self_attn.attn`` -> (10,))."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


def block_parts(t: torch.Tensor, num_blocks: int, what: str) -> list[torch.Tensor]:
    """Split one layer tensor into parts ``[num_blocks, ...]`` with contiguous bytes per block.

    Raises:
        LayoutError: no dimension of size ``num_blocks``, or a block's bytes are scattered
            inside a part (a layout bsr cannot move as whole blocks).
    """
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"KV cache {what} is a {type(t).__name__}, not a torch.Tensor")
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    phys = t.permute(order)
    candidates = [i for i, n in enumerate(phys.shape) if n == num_blocks]
    if not candidates:
        raise LayoutError(
            f"KV cache {what} of shape {tuple(t.shape)} has no dimension of num_blocks="
            f"{num_blocks}; this attention backend's layout is not supported"
        )
    bdim = candidates[0]
    outer = phys.shape[:bdim]
    parts = [phys[idx] for idx in itertools.product(*(range(n) for n in outer))] or [phys]
    for p in parts:
        if not p[0].is_contiguous():
            raise LayoutError(
                f"KV cache {what} (shape {tuple(t.shape)}, strides {t.stride()}) does not keep "
                "a block's bytes together; this attention backend's layout is not supported"
            )
    return parts


def _group_parts(
    kv_caches: Mapping[str, torch.Tensor], spec: GroupSpec, num_blocks: int
) -> list[torch.Tensor]:
    """The block parts (:func:`block_parts`) of every layer of one KV cache group, in the
    group's layer order; every layer laid out alike, none sharing another's tensor."""
    parts: list[torch.Tensor] = []
    signature: tuple[object, ...] | None = None
    seen: dict[int, str] = {}  # layers of other groups may share a tensor (hybrid manager)
    for name in spec.layer_names:
        t = kv_caches.get(name)
        if t is None:
            raise LayoutError(f"vLLM did not register a KV cache for layer {name!r}")
        if t.data_ptr() in seen:
            raise LayoutError(
                f"layers {seen[t.data_ptr()]!r} and {name!r} share one KV tensor; "
                "KV sharing across layers is not supported"
            )
        seen[t.data_ptr()] = name
        ps = block_parts(t, num_blocks, name)
        sig = (t.dtype, tuple(tuple(p.shape) for p in ps))
        if signature is None:
            signature = sig
        elif sig != signature:
            raise LayoutError(
                f"layer {name!r} is laid out as {sig}, the group's first layer as "
                f"{signature}; every layer of a KV cache group must match"
            )
        parts.extend(ps)
    if not parts:
        raise LayoutError(f"KV cache group {spec.name!r} has no layers")
    return parts


def _state_group(spec: GroupSpec, parts: Sequence[torch.Tensor], block_tokens: int) -> StateGroup:
    """The bsr state group of one KV cache group whose layers are ``parts``."""
    p0 = parts[0]
    block_bytes = p0[0].numel() * p0.element_size()
    if block_bytes % block_tokens:
        raise LayoutError(
            f"a block of group {spec.name!r} has {block_bytes} bytes, not a multiple of "
            f"block_size={block_tokens}"
        )
    dtype = _DTYPE_NAMES.get(p0.dtype, "uint8")
    token_bytes = block_bytes // block_tokens
    if token_bytes % p0.element_size():
        dtype = "uint8"
    return StateGroup(
        spec.name,
        num_layers=len(parts),
        token_bytes=token_bytes,
        window_tokens=spec.window_tokens,
        dtype=dtype,
    )


def derive(
    kv_caches: Mapping[str, torch.Tensor],
    groups: Sequence[GroupSpec],
    *,
    num_blocks: int,
    block_tokens: int,
    chunk_tokens: int,
) -> tuple[StateLayout, PagedKVCache]:
    """The bsr layout and a no-copy cache over vLLM's per-layer KV tensors.

    Args:
        kv_caches: vLLM's ``register_kv_caches`` argument (layer name -> tensor).
        groups: vLLM's KV cache groups (which layers, sliding window).
        num_blocks: blocks per layer tensor (vLLM's ``KVCacheConfig.num_blocks``).
        block_tokens: vLLM's block size.
        chunk_tokens: bsr's chunk size, a multiple of ``block_tokens``.

    Layers of different groups may share one tensor (vLLM's hybrid KV cache manager lays one
    layer of each group over the same buffer): the cache then knows those groups alias block
    for block (``PagedKVCache.aliased``), and each load and save gives them different blocks.

    Raises:
        LayoutError: chunk size not a multiple of the block size, a layer missing, layers of
            one group that differ in layout, two layers of one group sharing storage, layers
            of two groups sharing it other than block for block, or an unsupported backend
            layout.
    """
    if chunk_tokens % block_tokens:
        raise LayoutError(
            f"chunk_tokens={chunk_tokens} is not a multiple of vLLM's block_size={block_tokens}; "
            f"set chunk_tokens to a multiple of {block_tokens} in the bsr config"
        )
    state_groups: list[StateGroup] = []
    views: dict[str, list[torch.Tensor]] = {}
    for spec in groups:
        parts = _group_parts(kv_caches, spec, num_blocks)
        state_groups.append(_state_group(spec, parts, block_tokens))
        views[spec.name] = parts
    layout = StateLayout(chunk_tokens=chunk_tokens, groups=tuple(state_groups))
    cache = PagedKVCache.from_layer_tensors(layout, views, block_tokens)
    return layout, cache
