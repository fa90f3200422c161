"""Hidden-state groups: their layouts, writing captured hidden states, rebuilding K/V.

Where it runs: the serving process, next to a Hugging Face ``transformers`` model.

How it works: a hidden-state group is an ordinary :class:`~bsr.StateGroup` whose token row is
one layer's input hidden state (``hidden_size`` values). :func:`write_hidden_to_cache` copies
captured hidden states into such a group at a token offset (appending, as a server does turn by
turn); :func:`rebuild_rows` projects a group's rows into the ``"kv"`` group of a destination
:class:`~bsr.PagedKVCache` (the :mod:`bsr.hf` layout), whole blocks at a time, with the RoPE
table computed once by the caller for the whole restore. :func:`rebuild_kv` is the older entry point
that returns a ``DynamicCache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import PagedKVCache, StateGroup, StateLayout
from .._check import int_at_least
from .._errors import ConfigError, LayoutError
from ._arch import ModelAdapter, RopeTable, check_config, dtype_name

if TYPE_CHECKING:
    from transformers import DynamicCache

#: name of the hidden-state group of :func:`hidden_layout` (every layer)
HIDDEN_GROUP = "hidden"


@dataclass(frozen=True)
class StateBytes:
    """Bytes per token per layer of each way to store a model's reusable state."""

    kv_bytes: int
    hidden_bytes: int

    @property
    def hidden_to_kv(self) -> float:
        """hidden / K+V bytes: < 1 means HCache moves fewer bytes."""
        return self.hidden_bytes / self.kv_bytes

    @property
    def prefer_hidden(self) -> bool:
        return self.hidden_bytes < self.kv_bytes

    @property
    def method(self) -> str:
        return "hidden" if self.prefer_hidden else "kv"


def compare_state_bytes(config: Any, *, dtype: torch.dtype | None = None) -> StateBytes:
    """Bytes per token per layer of K+V and of the layer's input hidden state.

    Bytes only: which is *faster* depends on the read bandwidth and the projection throughput,
    which :func:`bsr.hcache.plan_layers` weighs.
    """
    s = check_config(config)
    item = (dtype or s.dtype).itemsize
    return StateBytes(kv_bytes=2 * s.kv_dim * item, hidden_bytes=s.hidden * item)


def hidden_layout(
    config: Any, *, chunk_tokens: int = 256, dtype: torch.dtype | None = None
) -> StateLayout:
    """A layout with one group ``"hidden"``: every layer's input hidden state per token."""
    s = check_config(config)
    dt = dtype or s.dtype
    return StateLayout(
        chunk_tokens=chunk_tokens,
        groups=(
            StateGroup(HIDDEN_GROUP, s.num_layers, s.hidden * dt.itemsize, dtype=dtype_name(dt)),
        ),
    )


def _int_arg(value: Any, what: str, low: int = 0) -> int:
    return int_at_least(value, what, low)


def token_rows(
    cache: PagedKVCache, ids: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, row) of tokens ``[lo, hi)`` for the validated block table ``ids``."""
    t = torch.arange(lo, hi, dtype=torch.int64)
    return ids[t // cache.block_tokens].to(cache.device), (t % cache.block_tokens).to(cache.device)


def write_hidden_to_cache(
    hidden_states: Sequence[torch.Tensor],
    cache: PagedKVCache,
    block_ids: Any,
    num_tokens: int,
    *,
    batch_index: int = 0,
    start: int = 0,
    group: str = HIDDEN_GROUP,
    offset: int | None = None,
) -> None:
    """Copy each layer's input hidden state for tokens ``[start, num_tokens)`` into the cache.

    Args:
        hidden_states: one tensor ``[batch, seq, hidden]`` per layer of ``group``, the input of
            that layer: with ``model(..., output_hidden_states=True)`` that is
            ``out.hidden_states[:L]`` (``hidden_states[i]`` enters layer ``i``).
        cache: a cache with the hidden-state group ``group``.
        block_ids: the request's block table.
        num_tokens: the end of the tokens to write.
        batch_index: which batch row to copy.
        start: the first token to write; tokens before it are left as they are (a server appends
            each turn's or decode step's tokens).
        group: the hidden-state group to write.
        offset: the token index of row 0 of ``hidden_states`` (default ``start``: a forward over
            just the new tokens); pass 0 when the tensors hold the whole history.
    """
    num_tokens = _int_arg(num_tokens, "num_tokens")
    start = _int_arg(start, "start")
    if start > num_tokens:
        raise ConfigError(f"start={start} is past num_tokens={num_tokens}")
    first = start if offset is None else _int_arg(offset, "offset")
    if first > start:
        raise ConfigError(f"offset={first} is after start={start}: rows before it are missing")
    g = cache.layout.group(group)
    if len(hidden_states) < g.num_layers:
        raise ConfigError(
            f"need {g.num_layers} per-layer hidden states, got {len(hidden_states)}; pass "
            "out.hidden_states[:num_layers] from a forward with output_hidden_states=True"
        )
    ids = cache.block_table(block_ids, num_tokens)
    if num_tokens == start:
        return
    blocks, rows = token_rows(cache, ids, start, num_tokens)
    typed = cache.typed(group)
    for i in range(g.num_layers):
        h = hidden_states[i][batch_index, start - first : num_tokens - first]
        if h.shape[0] < num_tokens - start:
            raise ConfigError(
                f"layer {i} hidden state holds tokens [{first}, "
                f"{first + hidden_states[i].shape[1]}), need [{start}, {num_tokens})"
            )
        if h.dtype != typed.dtype or h.shape[-1] != typed.shape[-1]:
            raise LayoutError(
                f"layer {i} hidden state is {h.dtype} x {h.shape[-1]}, the cache holds "
                f"{typed.dtype} x {typed.shape[-1]}; build the layout with hidden_layout(config)"
            )
        typed[i][blocks, rows] = h.to(typed.device)


#: the hidden rows one piece of a rebuild gathers at most (bytes): large enough that a piece is
#: one GEMM per layer for every chunk of a restore up to this size (16K tokens of a 1024-wide
#: fp32 model, 4K tokens of a 4096-wide bf16 one), small enough to stay a bounded scratch
PIECE_BYTES = 64 << 20


def _run_start(idx: torch.Tensor) -> int | None:
    """The first id of ``idx`` (on the CPU) when it is one ascending run of ids, else ``None``."""
    if idx.device.type != "cpu" or idx.numel() == 0:
        return None
    first = int(idx[0])
    if int(idx[-1]) - first != idx.numel() - 1:
        return None
    run = torch.arange(first, first + idx.numel(), dtype=idx.dtype)
    return first if torch.equal(idx, run) else None


def rebuild_rows(
    adapter: ModelAdapter,
    src: PagedKVCache,
    group: str,
    layers: Sequence[int],
    dst: PagedKVCache,
    ids: torch.Tensor,
    num_tokens: int,
    rope: RopeTable,
    *,
    dst_group: str = "kv",
    piece_tokens: int | None = None,
    start: int = 0,
    planes: bool = False,
    grouped: bool = False,
    src_ids: torch.Tensor | None = None,
) -> None:
    """Project the hidden states of ``group`` (model layers ``layers``) into ``dst``'s K/V rows.

    Works on whole blocks, a piece of up to ``piece_tokens`` tokens at a time (default: as many
    as :data:`PIECE_BYTES` of hidden rows hold, so a chunk or a run of chunks is one piece): per
    layer, the piece's hidden rows are gathered into a private buffer (or viewed in place when
    its blocks are one ascending run), :meth:`ModelAdapter.project_into` writes their cache rows
    ``[K | V]`` into a reusable buffer (one GEMM, the norm's row scale, RoPE), and one
    ``index_copy_`` puts those rows into the layer's blocks; a trailing partial block is
    written row by row. The number of kernels per layer and piece does not depend on the
    number of blocks. ``src`` may alias ``dst`` (the hidden rows of layer ``i`` living in the
    first bytes of layer ``i``'s K/V rows): every read of a piece's hidden rows ends before its
    rows are written, and pieces never share blocks.

    Args:
        rope: from :meth:`ModelAdapter.rope` for positions ``[0, num_tokens)`` (once per restore).
        start: project only tokens ``[start, num_tokens)`` (one restored chunk: a pipelined
            restore projects each chunk as it lands); a multiple of the block size, since a
            block's rebuild overwrites all of its hidden rows.
        planes: the destination's blocks hold their tokens' K rows, then their V rows
            (``[2, block_tokens, kv_dim]``: vLLM's per-layer layout) instead of each token's
            ``[K | V]`` row (:mod:`bsr.hf`'s); still one ``index_copy_`` per layer and piece.
        grouped: project every layer of ``layers`` at once where they allow it
            (:meth:`ModelAdapter.groupable`): per piece one gather and one copy per layer, one
            batched GEMM and one set of elementwise kernels for the group (fewer launches on a
            GPU; pieces shrink so the group's buffers stay within :data:`PIECE_BYTES`).
    """
    bt = src.block_tokens
    if start % bt:
        raise ConfigError(f"start={start} must be a multiple of block_tokens={bt}")
    if num_tokens <= start:
        return
    g, og = src.layout.group(group), dst.layout.group(dst_group)
    hid = [t.view(g.torch_dtype) for t in src.layers(group)]  # stacked or per-layer caches
    out = [t.view(og.torch_dtype) for t in dst.layers(dst_group)]
    hidden = adapter.shape.hidden
    full, first = num_tokens // bt, start // bt
    together = len(layers) if grouped and adapter.groupable(layers, rope) else 1
    if piece_tokens is None:
        piece_tokens = PIECE_BYTES // (hidden * adapter.dtype.itemsize * together)
    per = max(1, piece_tokens // bt)
    m = max(1, min(full - first, per)) * bt
    bufs = _Buffers(adapter, m * together, src.device)
    sids = ids if src_ids is None else src_ids
    pieces = _pieces(sids, ids, range(first, full, per), full, src, dst)
    land = KVLanding(adapter, [out[layer] for layer in layers], bt, planes, dst.device)
    with torch.no_grad():
        for b0, b1, sidx, didx, _run in pieces if together > 1 else ():
            h = bufs.group_rows(hid[: len(layers)], sidx, b1 - b0)
            rows = bufs.rows[: h.numel() // hidden * adapter.row_elems].view(*h.shape[:2], -1)
            adapter.project_group_into(layers, h, rope[b0 * bt : b1 * bt], rows, bufs.tmp)
            for j in range(len(layers)):
                land.blocks(j, didx, rows[j])
        for j, layer in enumerate(layers):
            for b0, b1, sidx, didx, run in pieces if together == 1 else ():
                h = bufs.hidden_rows(hid[j], sidx, run, b1 - b0)
                rows = adapter.project_into(layer, h, rope[b0 * bt : b1 * bt], bufs.rows, bufs.tmp)
                land.blocks(j, didx, rows)
            if full * bt < num_tokens:  # full * bt >= start: start is block-aligned
                blocks, r = token_rows(src, sids, full * bt, num_tokens)
                h = hid[j][blocks, r].to(adapter.device)
                rows = adapter.project(layer, h, rope[full * bt : num_tokens])
                land.tokens(j, *token_rows(dst, ids, full * bt, num_tokens), rows)


class KVLanding:
    """Where projected rows go: each layer's blocks, as ``[block, K | V]`` token rows or as K
    and V planes (``[block, 2, block_tokens, kv_dim]``: vLLM's per-layer layout)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        out: list[torch.Tensor],
        bt: int,
        planes: bool,
        device: torch.device,
    ) -> None:
        self.bt, self.kd, self.row = bt, adapter.shape.kv_dim, adapter.row_elems
        self.device = device
        self.rows = [t.view(t.shape[0], bt, self.row) for t in out]
        self.planes = [t.view(t.shape[0], 2, bt, self.kd) for t in out] if planes else None

    def blocks(self, j: int, didx: torch.Tensor, rows: torch.Tensor) -> None:
        """One ``index_copy_`` of whole blocks' rows ``[n x block_tokens, 2 kv_dim]``."""
        nblk = didx.numel()
        rows = rows.reshape(nblk, self.bt, self.row).to(self.device)
        if self.planes is not None:
            self.planes[j].index_copy_(
                0, didx, rows.view(nblk, self.bt, 2, self.kd).transpose(1, 2)
            )
        else:
            self.rows[j].index_copy_(0, didx, rows)

    def tokens(self, j: int, blocks: torch.Tensor, r: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of single tokens (a trailing partial block)."""
        at = blocks.to(self.device), r.to(self.device)
        rows = rows.to(self.device)
        if self.planes is not None:
            self.planes[j][at[0], :, at[1]] = rows.view(-1, 2, self.kd)
        else:
            self.rows[j][at] = rows


def _pieces(
    sids: torch.Tensor,
    ids: torch.Tensor,
    starts: range,
    full: int,
    src: PagedKVCache,
    dst: PagedKVCache,
) -> list[tuple[int, int, torch.Tensor, torch.Tensor, int | None]]:
    """Per piece: its block range, its ids where the hidden rows (``sids``) and the K/V
    (``ids``) live, and the start of its hidden rows' run (None: gathered)."""
    out = []
    for b0 in starts:
        b1 = min(full, b0 + starts.step)
        sidx = sids[b0:b1]
        out.append((b0, b1, sidx.to(src.device), ids[b0:b1].to(dst.device), _run_start(sidx)))
    return out


class _Buffers:
    """A rebuild's buffers, reused by every layer and piece (fresh buffers this size cost page
    faults on each use): the projected rows, RoPE's temporary, the gathered hidden rows."""

    def __init__(self, adapter: ModelAdapter, m: int, src_device: torch.device) -> None:
        dev, dt = adapter.device, adapter.dtype
        self.rows = torch.empty(m, adapter.row_elems, dtype=dt, device=dev)
        self.tmp = torch.empty(m * adapter.shape.kv_dim // 2, dtype=dt, device=dev)
        self.hidden = adapter.shape.hidden
        self.m = m
        self.dev = dev
        self.src_device = src_device
        self.gathered: torch.Tensor | None = None

    def _gather_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The gathered rows' buffer, made on first use (a piece of one run needs none)."""
        if self.gathered is None:
            self.gathered = torch.empty(self.m * self.hidden, dtype=dtype, device=self.src_device)
        return self.gathered

    def group_rows(self, hid: list[torch.Tensor], sidx: torch.Tensor, nblk: int) -> torch.Tensor:
        """The ``[G, nblk x block_tokens, hidden]`` input rows of a piece for every layer of a
        group, gathered into the buffer (one ``index_select`` per layer)."""
        per_block = hid[0][0].numel()
        flat = self._gather_buffer(hid[0].dtype)[: len(hid) * nblk * per_block]
        for j, src_l in enumerate(hid):
            into = flat[j * nblk * per_block : (j + 1) * nblk * per_block]
            torch.index_select(src_l, 0, sidx, out=into.view((nblk, *src_l.shape[1:])))
        return flat.view(len(hid), -1, self.hidden).to(self.dev)

    def hidden_rows(
        self, src_l: torch.Tensor, sidx: torch.Tensor, run: int | None, nblk: int
    ) -> torch.Tensor:
        """The ``[nblk x block_tokens, hidden]`` input rows of a piece: viewed where they lie when
        its blocks are one ascending run, else gathered into the buffer."""
        part = src_l[run : run + nblk] if run is not None else None
        if part is not None and part.is_contiguous() and self.src_device == self.dev:
            return part.view(-1, self.hidden)
        per_block = src_l[0].numel()
        into = self._gather_buffer(src_l.dtype)[: nblk * per_block].view((nblk, *src_l.shape[1:]))
        return torch.index_select(src_l, 0, sidx, out=into).view(-1, self.hidden).to(self.dev)


def rebuild_kv(
    model: Any,
    cache: PagedKVCache,
    block_ids: Any,
    num_tokens: int,
    *,
    device: str | torch.device | None = None,
) -> DynamicCache:
    """Recompute every layer's K/V from the ``"hidden"`` group; return a ``DynamicCache``.

    For a paged engine prefer :class:`bsr.hcache.HCache`, which projects straight into the
    destination :class:`~bsr.PagedKVCache` without this copy.
    """
    from transformers import DynamicCache

    adapter = ModelAdapter(model)
    s = adapter.shape
    num_tokens = _int_arg(num_tokens, "num_tokens")
    out = DynamicCache(config=model.config)
    if num_tokens == 0:
        return out
    ids = cache.block_table(block_ids, num_tokens)
    blocks, rows = token_rows(cache, ids, 0, num_tokens)
    typed = cache.typed(HIDDEN_GROUP)
    target = torch.device(device) if device is not None else adapter.device
    rope = adapter.rope(0, num_tokens)
    with torch.no_grad():
        for i in range(s.num_layers):
            h = typed[i][blocks, rows].to(adapter.device)
            kv = adapter.project(i, h, rope).view(num_tokens, 2, s.kv_heads, s.head_dim)
            k = kv[:, 0].transpose(0, 1).unsqueeze(0).contiguous().to(target)
            v = kv[:, 1].transpose(0, 1).unsqueeze(0).contiguous().to(target)
            out.update(k, v, i)
    return out
