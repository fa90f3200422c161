"""Installers: copy a staged chunk out of its slot into the destination cache.

Where it runs: inside the pipeline's worker-thread calls (host) or on the event loop enqueuing a
device copy (CUDA).

How it works: one small interface, ``install(chunk, slot)``. :class:`HostInstaller` computes its
views once per restore: the slot buffers and the cache tensors as NumPy arrays of the widest
machine word their rows allow, so one chunk costs a few microseconds of Python plus the copy
itself (a plain slice copy when the chunk's blocks are consecutive, one fancy-indexed copy
otherwise). Caches it cannot view that way (per-layer views of another engine's tensors,
non-contiguous tensors) go through :func:`~bsr.transfer._cache.install_chunk`, as does
:class:`CudaInstaller`, which enqueues non-blocking copies on a side stream and returns the
event that tells when the slot may be reused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..core._layout import StateLayout
from ._cache import PagedKVCache, install_chunk
from ._staging import Slot
from ._tables import BlockTables


def _word(row: int, *addresses: int) -> np.dtype[Any]:
    """The widest unsigned word dividing ``row`` to which every address is aligned."""
    for dt in (np.uint64, np.uint32, np.uint16):
        size = np.dtype(dt).itemsize
        if row % size == 0 and all(a % size == 0 for a in addresses):
            return np.dtype(dt)
    return np.dtype(np.uint8)


class HostInstaller:
    """Installs chunks into a CPU cache (any thread; the caller serialises per chunk).

    Args:
        layout: the state layout.
        cache: the destination.
        tables: the request's validated block tables (one per group; ``NULL_BLOCK`` entries
            are never written).
        first_block: blocks of the table before this index are never written (they hold state
            the caller already has; a chunk that straddles it is installed from it on).
    """

    def __init__(
        self, layout: StateLayout, cache: PagedKVCache, tables: BlockTables, first_block: int = 0
    ) -> None:
        self.layout = layout
        self.cache = cache
        self.tables = tables
        self.bpc = cache.blocks_per_chunk
        self.first_block = first_block
        self._slots: dict[Slot, np.ndarray[Any, Any]] = {}
        self._offsets = {g.name: layout.slot_offset(g.name) for g in layout.groups}
        self._dst: dict[str, tuple[np.ndarray[Any, Any], np.dtype[Any], int]] | None = None
        #: per group: (destination, word, chunk shape, chunk bytes), for the fast path
        self._fast: dict[str, tuple[np.ndarray[Any, Any], np.dtype[Any], tuple[int, ...], int]] = {}
        #: per group, per chunk: its first block when the chunk's blocks are consecutive and
        #: real (one slice copy), else -1 (made on first use)
        self._firsts: dict[str, list[int]] = {}
        #: per group, per slot: the slot's region of the group as the fast path copies it
        self._staged: dict[str, dict[Slot, np.ndarray[Any, Any]]] = {
            g.name: {} for g in layout.groups
        }
        tensors = [cache.tensor(g.name) for g in layout.groups] if not cache.per_layer else []
        if tensors and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            self._dst = {}
            for g, t in zip(layout.groups, tensors):
                row = cache.block_tokens * g.token_bytes
                arr = t.numpy().reshape(g.num_layers, cache.num_blocks, row)
                word = _word(row, t.data_ptr())
                words = row // word.itemsize
                self._dst[g.name] = (arr.view(word), word, words)
                shape = (g.num_layers, self.bpc, words)
                self._fast[g.name] = (arr.view(word), word, shape, g.num_layers * self.bpc * row)

    def slot_array(self, slot: Slot) -> np.ndarray[Any, Any]:
        """The slot as a flat uint8 NumPy array (made once per slot and restore)."""
        arr = self._slots.get(slot)  # a Slot's buffer never changes: key by identity
        if arr is None:
            arr = self._slots[slot] = slot.tensor.numpy()
        return arr

    def _stage(self, group: str, slot: Slot) -> np.ndarray[Any, Any]:
        """The slot's region of ``group`` shaped as the fast path copies it (made once per slot,
        group and restore: a slot's buffer never changes)."""
        _, word, shape, n = self._fast[group]
        off = self._offsets[group]
        staged = self.slot_array(slot)[off : off + n].view(word).reshape(shape)
        self._staged[group][slot] = staged
        return staged

    def _chunk_firsts(self, group: str) -> list[int]:
        """Per chunk of ``group``'s table: its first block if its blocks are consecutive real
        blocks (the usual table), else -1."""
        firsts = self._firsts.get(group)
        if firsts is None:
            table = self.tables.table(group).numpy()
            n = len(table) // self.bpc
            per = table[: n * self.bpc].reshape(n, self.bpc)
            ok = (per[:, 0] >= 0) & (np.diff(per, axis=1) == 1).all(axis=1)
            firsts = self._firsts[group] = np.where(ok, per[:, 0], -1).tolist()
        return firsts

    def install(
        self,
        chunk: int,
        groups: tuple[str, ...],
        slot: Slot | None,
        lent: Mapping[str, np.ndarray[Any, Any]] | None = None,
    ) -> None:
        """Copy chunk ``chunk`` (its ``groups``) from ``slot`` into the cache blocks; a group in
        ``lent`` is copied from that flat uint8 payload instead (a tier's own memory)."""
        if chunk * self.bpc >= self.first_block and self._fast:
            # the usual chunk: nothing before first_block, each group's blocks consecutive
            todo: list[str] = []
            bpc = self.bpc
            for g in groups:
                firsts = self._firsts.get(g) or self._chunk_firsts(g)
                first = firsts[chunk] if chunk < len(firsts) else -1
                if first < 0:
                    todo.append(g)
                    continue
                dst, word, shape, n = self._fast[g]
                payload = lent.get(g) if lent else None
                if payload is None:
                    assert slot is not None, "a group not lent is read into a slot"
                    staged = self._staged[g].get(slot)
                    if staged is None:
                        staged = self._stage(g, slot)
                    dst[:, first : first + bpc, :] = staged
                else:
                    dst[:, first : first + bpc, :] = payload[:n].view(word).reshape(shape)
            if not todo:
                return
            groups = tuple(todo)
        lo = chunk * self.bpc
        skip = min(max(0, self.first_block - lo), self.bpc)
        if skip == self.bpc:
            return
        if self._dst is None:
            for g in groups:
                payload = lent.get(g) if lent else None
                if payload is not None:
                    region = torch.from_numpy(payload)
                else:
                    assert slot is not None, "a group not lent is read into a slot"
                    region = slot.tensor[self.layout.slot_offset(g) :]
                install_chunk(self.cache, g, self.tables.chunk_blocks(g, chunk), region, first=skip)
            return
        src = None if slot is None else self.slot_array(slot)
        for g in groups:
            blocks = self.tables.blocks(g)[lo + skip : lo + self.bpc]
            rows: list[int] | None = None
            if min(blocks) < 0:  # placeholders: no block there, nothing to write
                rows = [skip + i for i, b in enumerate(blocks) if b >= 0]
                blocks = [b for b in blocks if b >= 0]
                if not blocks:
                    continue
            dst, word, words = self._dst[g]
            layers = dst.shape[0]
            n = layers * self.bpc * words * word.itemsize
            payload = lent.get(g) if lent else None
            if payload is not None:
                flat = payload[:n]
            else:
                assert src is not None, "a group not lent is read into a slot"
                off = self._offsets[g]
                flat = src[off : off + n]
            chunk3 = flat.view(word).reshape(layers, self.bpc, words)
            staged = chunk3[:, skip:] if rows is None else chunk3[:, rows]
            n_blocks, first = len(blocks), blocks[0]
            if blocks[-1] - first == n_blocks - 1 and blocks == list(
                range(first, first + n_blocks)
            ):
                dst[:, first : first + n_blocks, :] = staged
            else:
                dst[:, blocks, :] = staged


class CudaInstaller:
    """Enqueues host-to-device copies of staged chunks on one side stream.

    Args:
        layout: the state layout.
        cache: the destination (on a CUDA device).
        tables: the request's block tables (``NULL_BLOCK`` entries are never written).
        stream: the side stream (made once per engine).
        first_block: blocks of the table before this index are never written.
    """

    def __init__(
        self,
        layout: StateLayout,
        cache: PagedKVCache,
        tables: BlockTables,
        stream: Any,
        first_block: int = 0,
    ) -> None:
        self.layout = layout
        self.cache = cache
        self.tables = tables
        self.stream = stream
        self.first_block = first_block

    def install(
        self,
        chunk: int,
        groups: tuple[str, ...],
        slot: Slot,
        lent: Mapping[str, np.ndarray[Any, Any]] | None = None,
    ) -> Any:
        """Enqueue the copy of ``chunk``; return the CUDA event recorded after it.

        A group in ``lent`` is copied from that payload where a tier keeps it (a HostTier's
        pinned object: one host-to-device copy of the chunk's bytes per group, no staging copy);
        the others from the slot. What the copies read must stay until the event completed.
        """
        bpc = self.cache.blocks_per_chunk
        skip = min(max(0, self.first_block - chunk * bpc), bpc)
        with torch.cuda.stream(self.stream):
            for g in groups if skip < bpc else ():
                payload = lent.get(g) if lent else None
                if payload is not None:
                    region = torch.from_numpy(payload)
                else:
                    region = slot.tensor[self.layout.slot_offset(g) :]
                install_chunk(
                    self.cache, g, self.tables.chunk_blocks(g, chunk), region,
                    non_blocking=True, first=skip,
                )  # fmt: skip
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return event
