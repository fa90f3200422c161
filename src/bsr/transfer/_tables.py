"""Per-group block tables of one request: which cache block holds each token of each group.

Where it runs: the caller's event loop at the admission of a restore or a save (the checks run in
NumPy, see :meth:`~bsr.transfer._cache.PagedKVCache.block_table`), then read by the transfer's
worker threads.

How it works: a caller passes one 1-D table for every state group (the same blocks in every
group's tensors) or a mapping group -> table. Token ``t`` of group ``g`` lives in block
``tables[g][t // block_tokens]``. An entry may be :data:`NULL_BLOCK` (-1): no block at all, e.g.
a sliding-window group's blocks outside its window, which a serving engine frees (vLLM hands them
over as its null block 0; the connector maps it to -1). bsr never reads from nor writes to such
an entry:

* a restore installs a chunk into its real blocks only, and may commit a prefix only if every
  block the prefix's needed tokens occupy is real (:meth:`BlockTables.serves`): every token of a
  full-attention group, the last ``window_tokens`` tokens of a windowed one;
* a save stores only objects whose chunk lies wholly in real blocks (:meth:`BlockTables.whole`,
  planned by :func:`bsr.core._plan.plan_save`): a stored object always holds its whole chunk,
  because the same object serves every prefix whose window covers that chunk. A real block must
  therefore hold its group's state for its tokens wherever a save may read it: a full-attention
  group's prefix, a sliding-window group's window at the end of the saved tokens and, when the
  save asks for window checkpoints, at each checkpoint.

Groups whose tensors share memory (vLLM's hybrid manager lays one layer of each group over the
same buffer) alias block for block: block ``b`` of one is block ``b`` of the other, so their
tables must not hold the same real block (:attr:`~bsr.transfer._cache.PagedKVCache.aliased` says
which groups alias). Within one group a real block may appear once only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import BlockTableError
from ..core._layout import StateLayout

#: A block-table entry that names no block: bsr neither reads from nor writes to it.
NULL_BLOCK = -1


def table_array(
    block_ids: Any, num_tokens: int, block_tokens: int, num_blocks: int, *, allow_null: bool,
    group: str | None = None,
) -> np.ndarray[Any, Any]:  # fmt: skip
    """One validated 1-D int64 table for ``num_tokens`` tokens (NumPy; never torch's pool).

    Raises:
        BlockTableError: not a 1-D integer sequence, too short, out of range (``NULL_BLOCK`` is
            in range only with ``allow_null``), or a real block repeated among the blocks the
            ``num_tokens`` tokens occupy.
    """
    where = "" if group is None else f" of group {group!r}"
    fields: dict[str, Any] = {} if group is None else {"group": group}
    if isinstance(block_ids, torch.Tensor):
        dtype = block_ids.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise BlockTableError(f"block_ids{where} must be integers, got {dtype}", **fields)
        arr = _tensor_ids(block_ids, where, fields)
    else:
        try:
            arr = np.asarray(block_ids)
        except Exception:
            msg = f"block_ids{where} must be a sequence of ints"
            raise BlockTableError(msg, **fields) from None
        if arr.size and arr.dtype.kind not in "iu":
            raise BlockTableError(
                f"block_ids{where} must be integers, got dtype {arr.dtype}", **fields
            )
    if arr.ndim != 1:
        raise BlockTableError(
            f"block_ids{where} must be one request's 1-D block table, got {arr.ndim} dimensions; "
            "pass block_table[i] for request i, not the batch's 2-D table",
            ndim=arr.ndim,
            **fields,
        )
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    needed = -(-num_tokens // block_tokens)
    if len(arr) < needed:
        raise BlockTableError(
            f"{num_tokens} tokens need {needed} blocks of {block_tokens} tokens, block_ids{where} "
            f"has {len(arr)}; pass the request's full block table",
            needed=needed,
            got=len(arr),
            **fields,
        )
    if len(arr):
        lo, hi = int(arr.min()), int(arr.max())
        floor = NULL_BLOCK if allow_null else 0
        if lo < floor or hi >= num_blocks:
            null = f" or NULL_BLOCK ({NULL_BLOCK}, no block)" if allow_null else ""
            raise BlockTableError(
                f"block ids{where} must be in [0, {num_blocks}){null}, got range [{lo}, {hi}]",
                **fields,
            )
    head = arr[:needed]
    dupes = repeated_ids(head[head >= 0] if allow_null else head)
    if dupes:
        raise BlockTableError(
            f"block ids {dupes} occur more than once among the {needed} blocks of {num_tokens} "
            f"tokens{where}; every token position needs its own block",
            duplicates=dupes,
            **fields,
        )
    return np.ascontiguousarray(arr)


def _tensor_ids(t: torch.Tensor, where: str, fields: dict[str, Any]) -> np.ndarray[Any, Any]:
    """The ids of an integer tensor as a NumPy array, or a BlockTableError saying why not.

    Only a dense tensor with data can be read: a meta tensor has no values, a sparse, nested
    or quantized one is no plain sequence of ids, and anything else torch cannot copy to the
    host is refused the same way (never torch's own NotImplementedError or TypeError).
    """
    kind = (
        "meta"
        if t.is_meta
        else "nested"
        if getattr(t, "is_nested", False)
        else "quantized"
        if t.is_quantized
        else None
        if t.layout == torch.strided
        else str(t.layout).removeprefix("torch.")
    )
    fix = "pass a dense CPU (or CUDA) integer tensor, a NumPy array or a list of ints"
    if kind is not None:
        raise BlockTableError(
            f"block_ids{where} is a {kind} tensor, which holds no readable block ids; {fix}",
            kind=kind,
            **fields,
        )
    try:
        arr: np.ndarray[Any, Any] = t.detach().cpu().resolve_conj().resolve_neg().numpy()
    except Exception as exc:  # a tensor subclass or device torch cannot read back
        raise BlockTableError(
            f"block_ids{where} cannot be read back to the host ({type(exc).__name__}: {exc}); "
            f"{fix}",
            **fields,
        ) from None
    return arr


def repeated_ids(ids: np.ndarray[Any, Any]) -> list[int]:
    """The values occurring more than once in the 1-D int array ``ids``, ascending.

    A sort, then neighbours compared: O(n log n) in NumPy on one thread (well under a
    millisecond for the 65,536 blocks of a 1M-token request).
    """
    if len(ids) < 2:
        return []
    if (ids[1:] > ids[:-1]).all():  # ascending (an allocator's usual table): none repeated
        return []
    s = np.sort(ids)
    same = s[1:] == s[:-1]
    if not same.any():
        return []
    return [int(v) for v in np.unique(s[1:][same])]


class BlockTables:
    """One request's validated block tables, one per state group (see the module docstring).

    Built by :meth:`~bsr.transfer._cache.PagedKVCache.block_tables`; groups given one shared
    table share one tensor here too.
    """

    def __init__(
        self, layout: StateLayout, block_tokens: int, tables: Mapping[str, np.ndarray[Any, Any]]
    ) -> None:
        self.layout = layout
        self.block_tokens = block_tokens
        self.bpc = layout.chunk_tokens // block_tokens
        self._t: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, np.ndarray[Any, Any]] = {}
        self._lists: dict[str, list[int]] = {}  # made on first use (blocks())
        self._holes: dict[str, np.ndarray[Any, Any]] = {}  # cumulative count of NULL_BLOCK
        made: dict[int, tuple[torch.Tensor, np.ndarray[Any, Any]]] = {}
        for g in layout.group_names:
            arr = tables[g]
            if id(arr) not in made:
                holes = np.concatenate(([0], np.cumsum(arr < 0)))
                made[id(arr)] = (torch.from_numpy(arr), holes)
            self._t[g], self._holes[g] = made[id(arr)]
            self._arrays[g] = arr
        #: whether every group uses one table
        self.shared = len(made) == 1

    def table(self, group: str) -> torch.Tensor:
        """The group's table (int64 CPU tensor; ``NULL_BLOCK`` where there is no block)."""
        return self._t[group]

    def blocks(self, group: str) -> list[int]:
        """The group's table as a list of ints (made once, on first use)."""
        out = self._lists.get(group)
        if out is None:
            arr = self._arrays[group]
            same = [g for g, a in self._arrays.items() if a is arr]  # groups sharing a table
            out = arr.tolist()
            for g in same:
                self._lists[g] = out
        return out

    def chunk_blocks(self, group: str, chunk: int) -> torch.Tensor:
        """The blocks of chunk ``chunk`` of ``group`` (placeholders included)."""
        return self._t[group][chunk * self.bpc : (chunk + 1) * self.bpc]

    @property
    def has_placeholders(self) -> bool:
        return any(int(h[-1]) for h in self._holes.values())

    def all_real(self, group: str, lo: int, hi: int) -> bool:
        """Whether blocks ``[lo, hi)`` of ``group``'s table all name a block."""
        holes = self._holes[group]
        if hi <= lo:
            return True
        if hi >= len(holes):
            return False
        return int(holes[hi] - holes[lo]) == 0

    def needed_blocks(self, group: str, prefix_chunks: int) -> tuple[int, int]:
        """``[lo, hi)``: the blocks holding the tokens a prefix of ``prefix_chunks`` chunks needs
        in ``group`` (all of them, or those of the last ``window_tokens`` tokens)."""
        end = prefix_chunks * self.layout.chunk_tokens
        window = self.layout.group(group).window_tokens
        first = 0 if window is None else max(0, end - window)
        return first // self.block_tokens, prefix_chunks * self.bpc

    def unserved(self, prefix_chunks: int, first_block: int = 0) -> tuple[str, int] | None:
        """``(group, block index)`` of the first placeholder where the prefix needs a block at or
        past ``first_block`` (blocks before it hold what the caller already has), or None."""
        for g in self.layout.group_names:
            lo, hi = self.needed_blocks(g, prefix_chunks)
            lo = max(lo, first_block)
            if not self.all_real(g, lo, hi):
                tail = self.blocks(g)[lo:hi]
                bad = next((lo + i for i, b in enumerate(tail) if b < 0), len(self.blocks(g)))
                return g, bad
        return None

    def serves(self, prefix_chunks: int, first_block: int = 0) -> bool:
        """Whether a restore of ``prefix_chunks`` chunks may commit into these tables."""
        return self.unserved(prefix_chunks, first_block) is None

    def whole(self, chunk: int, group: str) -> bool:
        """Whether every block of chunk ``chunk`` of ``group`` names a block (an object of it can
        be gathered whole). The argument order is that of the planner's ``have(chunk, group)``."""
        return self.all_real(group, chunk * self.bpc, (chunk + 1) * self.bpc)

    def written_blocks(self, group: str, chunk: int, first_block: int = 0) -> list[int]:
        """The real blocks of chunk ``chunk`` of ``group`` at or past ``first_block`` (what an
        install of that chunk writes)."""
        lo = max(chunk * self.bpc, first_block)
        return [b for b in self.blocks(group)[lo : (chunk + 1) * self.bpc] if b >= 0]


def build_tables(
    layout: StateLayout,
    block_ids: Any,
    num_tokens: int,
    block_tokens: int,
    num_blocks: int | Mapping[str, int],
    aliased: Sequence[tuple[str, ...]],
) -> BlockTables:
    """Validate ``block_ids`` (one table, or a mapping group -> table) for ``num_tokens`` tokens.

    ``num_blocks``: the cache's blocks, or each group's (one table for every group must then fit
    the group with the fewest).

    Raises:
        BlockTableError: a table is malformed (see :func:`table_array`), the mapping misses a
            group or names one the layout lacks, or groups that alias memory share a real block.
    """
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    if isinstance(num_blocks, Mapping):
        bounds = dict(num_blocks)
    else:
        bounds = dict.fromkeys(layout.group_names, num_blocks)
    if isinstance(block_ids, Mapping):
        names = set(layout.group_names)
        unknown = sorted(str(g) for g in block_ids if g not in names)
        missing = [g for g in layout.group_names if g not in block_ids]
        if unknown or missing:
            raise BlockTableError(
                f"block tables by group must name every group of the layout "
                f"{list(layout.group_names)} exactly; unknown {unknown}, missing {missing}",
                unknown=unknown,
                missing=missing,
            )
        seen: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        for g in layout.group_names:
            obj, bound = block_ids[g], bounds[g]
            if (id(obj), bound) not in seen:
                seen[id(obj), bound] = table_array(
                    obj, num_tokens, block_tokens, bound, allow_null=True, group=g
                )
            arrays[g] = seen[id(obj), bound]
    else:
        fewest = min(bounds.values())
        arr = table_array(block_ids, num_tokens, block_tokens, fewest, allow_null=True)
        arrays = dict.fromkeys(layout.group_names, arr)
    needed = -(-num_tokens // block_tokens)
    for groups in aliased:
        heads = {id(arrays[g]): arrays[g][:needed] for g in groups}
        reals = [h[h >= 0] for h in heads.values()]
        if len(heads) == 1 and len(reals[0]):
            raise BlockTableError(
                f"groups {list(groups)} share memory (their tensors alias block for block), so "
                "one block table cannot serve them; pass a mapping group -> block ids whose "
                "real blocks differ between these groups",
                groups=list(groups),
            )
        dupes = repeated_ids(np.concatenate(reals)) if reals else []
        if dupes:
            raise BlockTableError(
                f"block ids {dupes} are in the tables of several of the groups {list(groups)}, "
                "whose tensors share memory block for block; each block may hold one group's "
                "state only",
                groups=list(groups),
                duplicates=dupes,
            )
    return BlockTables(layout, block_tokens, arrays)
