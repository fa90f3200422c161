"""The host pool's pages as a bsr cache, and each SGLang page hash as a bsr object key.

Where it runs: SGLang's scheduler process, when the storage backend binds the host pool
(``register_mem_pool_host``) and on every storage call (the keys). No SGLang import: the host
pool is read through the attributes HiCache's own backends use (``kv_buffer``, ``layout``,
``page_size``, ``size``, ``dtype``).

How it works: one SGLang page is one bsr chunk (``chunk_tokens = block_tokens = page_size``) of
one state group, ``"kv"``. The group's "layers" are no-copy views of the host pool's buffer whose
first dimension is the page: K and V of an MHA pool (each of every layer, for ``layer_first``),
the one latent buffer of an MLA pool. Concatenated in that order, a page's views hold exactly the
bytes of the pool's flat data page (``get_data_page(index, flat=True)``), the bytes SGLang's file
backend writes: bsr's object payload is that page. A page is keyed on its own (SGLang's page hash
already chains the prefix and carries ``extra_key`` / ``cache_salt``): zero tokens plus one
:class:`bsr.KeyExtra` binding the hash, the shard (MHA: TP rank and size; every pool: PP, attention
CP, DCP), the pool layout (which orders the bytes) and SGLang's model name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bsr import ConfigError, KeyExtra, LayoutError, PagedKVCache, StateGroup, StateLayout

#: the host pool layouts whose pages are contiguous views (MHA and MLA pools of SGLang 0.5)
PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
#: the name of bsr's one state group
GROUP = "kv"


@dataclass(frozen=True)
class HostPages:
    """The host pool seen by bsr: its layout, a no-copy cache over it and a scratch page.

    Attributes:
        layout: one group, ``"kv"``, a chunk per page.
        cache: a :class:`bsr.PagedKVCache` whose block ``b`` is the pool's page at host index
            ``b * page_size``.
        page_size: tokens per page.
        page_bytes: bytes of one page (its flat data page).
        pool_layout: the pool's layout name (bound into every key).
    """

    layout: StateLayout
    cache: PagedKVCache
    page_size: int
    page_bytes: int
    pool_layout: str


def host_pages(pool: Any, *, is_mla: bool) -> HostPages:
    """Views of an SGLang host KV pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``).

    Raises:
        LayoutError: the pool lacks what HiCache's page views use, its layout is not one of
            :data:`PAGE_LAYOUTS`, or its buffer is not contiguous.
    """
    for attr in ("kv_buffer", "layout", "page_size", "size"):
        if not hasattr(pool, attr):
            raise LayoutError(
                f"the host pool {type(pool).__name__} has no {attr!r}; bsr.sglang binds SGLang's "
                "MHA and MLA host pools (an object with kv_buffer, layout, page_size and size)"
            )
    layout_name, page_size = str(pool.layout), int(pool.page_size)
    buf: torch.Tensor = pool.kv_buffer
    if layout_name not in PAGE_LAYOUTS:
        raise LayoutError(
            f"host pool layout {layout_name!r} is not supported; use one of {PAGE_LAYOUTS} "
            "(--hicache-mem-layout)"
        )
    if not buf.is_contiguous() or pool.size % page_size:
        raise LayoutError(
            "the host pool's kv_buffer must be contiguous and hold whole pages "
            f"(size={pool.size}, page_size={page_size})"
        )
    parts = [buf] if is_mla else [buf[0], buf[1]]  # MHA: K and V
    if layout_name == "layer_first":
        parts = [layer for part in parts for layer in part]
    num_pages = pool.size // page_size
    views = [p.view(num_pages, -1) for p in parts]
    block_bytes = views[0].shape[1] * buf.element_size()
    if block_bytes % page_size:
        raise LayoutError(f"a page of {block_bytes} bytes does not split into {page_size} tokens")
    dtype = StateGroup.dtype_name(buf.dtype)
    group = StateGroup(GROUP, len(views), block_bytes // page_size, dtype=dtype)
    layout = StateLayout(chunk_tokens=page_size, groups=(group,))
    cache = PagedKVCache.from_layer_tensors(layout, {GROUP: views}, block_tokens=page_size)
    return HostPages(layout, cache, page_size, block_bytes * len(views), layout_name)


def shard_identity(config: Any, pool_layout: str) -> bytes:
    """What, besides the page hash, decides a page's bytes, from a ``HiCacheStorageConfig``.

    MLA KV is the same on every TP rank (SGLang writes it from one rank): its identity leaves
    the TP rank out, as SGLang's file backend does; an MHA page is one rank's heads.
    """
    parts = [f"model={config.model_name or ''}", f"layout={pool_layout}"]
    if config.is_mla_model:
        parts.append("mla")
    else:
        parts.append(f"tp={config.tp_rank}/{config.tp_size}")
    parts.append(f"pp={config.pp_rank}/{config.pp_size}")
    parts.append(f"cp={config.attn_cp_rank}/{config.attn_cp_size}")
    dcp = getattr(config, "dcp_size", 1)
    if dcp > 1:
        parts.append(f"dcp={config.dcp_rank}/{dcp}/page={config.logical_page_size}")
    return ";".join(parts).encode()


class PageKeys:
    """Maps SGLang page hashes to bsr's key inputs (tokens and extras) for one shard."""

    def __init__(self, shard: bytes, page_size: int) -> None:
        self.shard = shard
        self.tokens = np.zeros(page_size, dtype=np.int64)

    def extras(self, page_hash: str) -> tuple[KeyExtra, ...]:
        """The extra binding ``page_hash`` and this shard (the key of one page)."""
        if not isinstance(page_hash, str) or not page_hash:
            raise ConfigError(f"a page key must be a non-empty str, got {page_hash!r}")
        return (KeyExtra(b"sglang-page\x00" + self.shard + b"\x00" + page_hash.encode()),)
