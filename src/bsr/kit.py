"""Server kit: the glue a serving loop needs around a RestoreEngine, as small public helpers.

Where it runs: the serving process's event loop, next to the engine and the paged cache.

How it works: a server keeps conversations' KV in a :class:`~bsr.PagedKVCache` whose blocks
come from a :class:`BlockAllocator` (a free list). A request is admitted with :func:`admit`:
``lookup`` (metadata only) -> allocate blocks for the whole request -> ``restore`` the reusable
prefix into them -> the :class:`Admission` says how many tokens are valid in the cache and
which to prefill. :class:`ConversationCache` adds what a multi-turn server needs on top: a
conversation's blocks stay resident between turns; when blocks run short, the least recently
used idle conversation is saved through the engine and its blocks are freed; its next turn is
admitted through bsr again.

Only full chunks are stored (``layout.chunk_tokens`` tokens each): after a restore the cache
holds ``floor(n / chunk_tokens) * chunk_tokens`` of a conversation's ``n`` tokens, and the rest
(the partial last chunk) is prefilled again. A model needs the logits of the last prompt token,
so admission always leaves at least one token to prefill.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import PagedKVCache, Probe, RestoreResult, SaveResult, as_token_array
from ._check import positive_int
from ._errors import BlockTableError, ConfigError, OutOfBlocksError

if TYPE_CHECKING:
    from . import RestoreEngine
    from .core._keys import TokensLike

__all__ = (
    "Admission",
    "BlockAllocator",
    "ConversationCache",
    "ConversationStatistics",
    "admit",
    "blocks_for",
)


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_tokens)


# --------------------------------------------------------------------- blocks
class BlockAllocator:
    """A free list over the block ids ``0 .. num_blocks - 1`` of a paged cache.

    Args:
        num_blocks: blocks in the cache.
        reserved: ids never handed out (e.g. a null block).

    Freed blocks are handed out again first (last freed, first reused).
    """

    def __init__(self, num_blocks: int, *, reserved: Iterable[int] = ()) -> None:
        positive_int(num_blocks, "BlockAllocator.num_blocks")
        reserved_set = {int(b) for b in reserved}
        self.num_blocks = num_blocks
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b not in reserved_set]
        self._used: set[int] = set()
        self.capacity = len(self._free)
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free (nothing is allocated).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"blocks to allocate must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} blocks, {len(self._free)} of {self.capacity} are free; free or "
                "evict some (ConversationCache does this), or give the cache more blocks",
                wanted=n,
                free=len(self._free),
            )
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        self.peak_used = max(self.peak_used, len(self._used))
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Give blocks back.

        Raises:
            BlockTableError: a block is not allocated (a double free); nothing is freed.
        """
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if b not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise BlockTableError(
                f"blocks {sorted(set(bad)) or ids} are not allocated (double free?)", blocks=bad
            )
        for b in ids:
            self._used.remove(b)
            self._free.append(b)


# --------------------------------------------------------------------- admission
@dataclass(frozen=True)
class Admission:
    """Where a request stands after admission.

    Attributes:
        block_ids: the request's block table (covers the tokens plus the reserve asked for).
        num_tokens: tokens of the request.
        cached_tokens: tokens ``[0, cached_tokens)`` hold valid KV in the cache: prefill
            ``tokens[cached_tokens:]`` (never empty: at least the last token).
        source: ``"resident"`` (kept in the cache), ``"restored"`` (by bsr) or ``"none"``.
        probe: the lookup (None for a resident conversation).
        restore: the restore's result (None when nothing was restored).
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    cached_tokens: int
    source: str
    probe: Probe | None = None
    restore: RestoreResult | None = None

    @property
    def prefill_tokens(self) -> int:
        """How many tokens to prefill: ``num_tokens - cached_tokens``."""
        return self.num_tokens - self.cached_tokens


async def admit(
    engine: RestoreEngine,
    tokens: TokensLike,
    cache: PagedKVCache,
    allocator: BlockAllocator,
    *,
    reserve_tokens: int = 0,
    block_ids: Sequence[int] | None = None,
    deadline_s: float | None = None,
) -> Admission:
    """lookup -> allocate -> restore -> how many tokens to prefill.

    Args:
        engine: an open engine.
        tokens: the request's tokens.
        cache: the paged cache the model reads.
        allocator: where blocks come from (unless ``block_ids`` are given).
        reserve_tokens: extra token room to allocate (e.g. tokens to be generated).
        block_ids: blocks already allocated for the request (then none are allocated).
        deadline_s: the restore's deadline.

    On an Invalidated restore nothing in the blocks is valid: the admission says prefill
    everything (the blocks stay allocated to the request). Raises
    :class:`~bsr.OutOfBlocksError` when the allocator cannot cover the request.
    """
    arr = as_token_array(tokens)
    n = len(arr)
    if n == 0:
        raise ConfigError("admit needs at least one token")
    if (
        isinstance(reserve_tokens, bool)
        or not isinstance(reserve_tokens, int)
        or reserve_tokens < 0
    ):
        raise ConfigError(f"reserve_tokens must be an int >= 0, got {reserve_tokens!r}")
    probe = await engine.lookup(arr)
    need = blocks_for(n + reserve_tokens, cache.block_tokens)
    if block_ids is None:
        ids = allocator.allocate(need)
    else:
        ids = [int(b) for b in block_ids]
        if len(ids) < need:
            raise BlockTableError(
                f"{len(ids)} blocks cannot hold {n + reserve_tokens} tokens of "
                f"{cache.block_tokens}; pass at least {need}"
            )
    if not probe.hit:
        return Admission(tuple(ids), n, 0, "none", probe)
    result = await engine.restore(arr, cache, ids, deadline_s=deadline_s, probe=probe)
    cached = min(result.committed_tokens, n - 1)
    return Admission(tuple(ids), n, cached, "restored" if cached else "none", probe, result)


# --------------------------------------------------------------------- conversations
@dataclass(frozen=True)
class ConversationStatistics:
    """Counters of a :class:`ConversationCache`."""

    resident: int
    admitted: int
    resident_hits: int
    restored: int
    restored_tokens: int
    prefilled_tokens: int
    evictions: int
    saved_tokens: int


@dataclass
class _Conversation:
    tokens: list[int]
    valid: int
    blocks: list[int]
    busy: bool = False


class ConversationCache:
    """Keeps conversations' KV resident in a paged cache, evicting through bsr when full.

    Args:
        engine: an open engine (saves on eviction, restores on admission).
        cache: the paged cache.
        allocator: its block allocator (default: every block of ``cache``).

    A turn is :meth:`admit` (reserve room for the tokens to generate), the model writes KV for
    ``tokens[cached_tokens:]``, then :meth:`commit` says which tokens the cache now holds.
    A conversation is busy from ``admit`` to ``commit`` and never evicted meanwhile.
    """

    def __init__(
        self, engine: RestoreEngine, cache: PagedKVCache, allocator: BlockAllocator | None = None
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"cache must be a bsr.PagedKVCache, got {type(cache).__name__}")
        self.engine = engine
        self.cache = cache
        self.allocator = allocator or BlockAllocator(cache.num_blocks)
        self._convs: OrderedDict[Hashable, _Conversation] = OrderedDict()
        names = [f.name for f in dataclasses.fields(ConversationStatistics) if f.name != "resident"]
        self._stats = dict.fromkeys(names, 0)

    def statistics(self) -> ConversationStatistics:
        return ConversationStatistics(resident=len(self._convs), **self._stats)

    def resident(self) -> list[Hashable]:
        """Resident conversations, least recently used first."""
        return list(self._convs)

    def block_ids(self, conv_id: Hashable) -> list[int]:
        """The block table of a resident conversation."""
        return list(self._get(conv_id).blocks)

    def _get(self, conv_id: Hashable) -> _Conversation:
        try:
            return self._convs[conv_id]
        except KeyError:
            raise ConfigError(f"conversation {conv_id!r} is not resident; admit it first") from None

    async def _make_room(self, blocks: int, keep: Hashable) -> None:
        while not self.allocator.can_allocate(blocks):
            victim = next((c for c, v in self._convs.items() if c != keep and not v.busy), None)
            if victim is None:
                raise OutOfBlocksError(
                    f"need {blocks} free blocks, {self.allocator.num_free} are free and every "
                    "other resident conversation is busy; give the cache more blocks",
                    wanted=blocks,
                    free=self.allocator.num_free,
                )
            await self.evict(victim)

    async def evict(self, conv_id: Hashable) -> SaveResult | None:
        """Save a conversation's full chunks through the engine, then free its blocks."""
        conv = self._get(conv_id)
        if conv.busy:
            raise ConfigError(f"conversation {conv_id!r} is busy (admitted, not committed)")
        saved = None
        if conv.valid >= self.engine.layout.chunk_tokens:
            saved = await self.engine.save(conv.tokens[: conv.valid], self.cache, conv.blocks)
            self._stats["saved_tokens"] += saved.saved_tokens
        del self._convs[conv_id]
        self.allocator.free(conv.blocks)
        self._stats["evictions"] += 1
        return saved

    def drop(self, conv_id: Hashable) -> None:
        """Forget a conversation without saving it (its blocks are freed)."""
        conv = self._convs.pop(conv_id, None)
        if conv is not None:
            self.allocator.free(conv.blocks)

    async def admit(
        self, conv_id: Hashable, tokens: TokensLike, *, reserve_tokens: int = 0
    ) -> Admission:
        """Admit the next turn of ``conv_id`` (``tokens``: its whole history so far).

        Resident and ``tokens`` extends what the cache holds: reuse it in place (growing the
        block table). Otherwise admit it through bsr (:func:`admit`), evicting least recently
        used idle conversations until its blocks fit.
        """
        toks = [int(t) for t in as_token_array(tokens)]
        n = len(toks)
        bt = self.cache.block_tokens
        need = blocks_for(n + reserve_tokens, bt)
        self._stats["admitted"] += 1
        conv = self._convs.get(conv_id)
        if conv is not None and conv.busy:
            raise ConfigError(f"conversation {conv_id!r} is already admitted; commit it first")
        if conv is not None and toks[: conv.valid] == conv.tokens[: conv.valid] and conv.valid:
            self._convs.move_to_end(conv_id)
            conv.busy = True
            try:
                grow = max(0, need - len(conv.blocks))
                await self._make_room(grow, conv_id)
                conv.blocks += self.allocator.allocate(grow)
            except BaseException:
                conv.busy = False
                raise
            cached = min(conv.valid, n - 1)
            conv.tokens, conv.valid = toks, cached
            self._stats["resident_hits"] += 1
            self._stats["prefilled_tokens"] += n - cached
            return Admission(tuple(conv.blocks), n, cached, "resident")
        if conv is not None:  # diverged history: start over
            self.drop(conv_id)
        await self._make_room(need, conv_id)
        adm = await admit(
            self.engine, toks, self.cache, self.allocator, reserve_tokens=reserve_tokens
        )
        self._convs[conv_id] = _Conversation(toks, adm.cached_tokens, list(adm.block_ids), True)
        if adm.source == "restored":
            self._stats["restored"] += 1
            self._stats["restored_tokens"] += adm.cached_tokens
        self._stats["prefilled_tokens"] += adm.prefill_tokens
        return adm

    def commit(self, conv_id: Hashable, tokens: TokensLike, valid_tokens: int) -> None:
        """After the model ran: ``tokens`` is the history, ``[0, valid_tokens)`` hold KV."""
        conv = self._get(conv_id)
        toks = [int(t) for t in as_token_array(tokens)]
        cap = len(conv.blocks) * self.cache.block_tokens
        if not 0 <= valid_tokens <= min(len(toks), cap):
            raise ConfigError(
                f"valid_tokens must be in [0, {min(len(toks), cap)}] (the tokens, and the room "
                f"of the conversation's {len(conv.blocks)} blocks), got {valid_tokens}"
            )
        conv.tokens, conv.valid, conv.busy = toks, valid_tokens, False
        self._convs.move_to_end(conv_id)

    async def evict_all(self) -> None:
        """Save and free every idle conversation (e.g. at shutdown)."""
        for conv_id in [c for c, v in self._convs.items() if not v.busy]:
            await self.evict(conv_id)
