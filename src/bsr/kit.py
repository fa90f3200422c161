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

Concurrency: a server runs turns of different conversations concurrently on one event loop.
Each conversation is in one state: idle (resident, evictable), in a turn (from ``admit`` to
``commit``/``abort``) or being evicted (its save through the engine is running). Only idle
conversations are evicted, and a conversation's blocks stay allocated to it alone until its
eviction has finished, so no other turn can be handed them while it is in a turn or while its
K/V is still being read for the save. One turn per conversation at a time: a second ``admit``
while one is in flight raises :class:`~bsr.ConversationBusyError`; a turn that arrives while its
conversation is being evicted waits for the eviction and is then restored through bsr. Every
block a turn takes is given back (or stays with its conversation) when the turn fails or is
cancelled, wherever that happens (making room, the lookup, the restore).

Only full chunks are stored (``layout.chunk_tokens`` tokens each): after a restore the cache
holds ``floor(n / chunk_tokens) * chunk_tokens`` of a conversation's ``n`` tokens, and the rest
(the partial last chunk) is prefilled again. A model needs the logits of the last prompt token,
so admission always leaves at least one token to prefill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections import OrderedDict
from collections.abc import AsyncIterator, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from . import (
    KeyExtra,
    PagedKVCache,
    Probe,
    RestoreResult,
    SaveResult,
    SightingCounter,
    as_token_array,
)
from ._check import int_at_least, int_between, non_negative_int, positive_int
from ._errors import BlockTableError, ConfigError, ConversationBusyError, OutOfBlocksError

if TYPE_CHECKING:
    from . import RestoreEngine
    from .core._keys import Extras, TokensLike

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
        int_at_least(n, "blocks to allocate", 0)
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
    extras: Extras | None = None,
) -> Admission:
    """lookup -> allocate -> restore -> how many tokens to prefill.

    Args:
        engine: an open engine.
        tokens: the request's tokens.
        cache: the paged cache the model reads.
        allocator: where blocks come from (unless ``block_ids`` are given).
        reserve_tokens: extra token room to allocate (e.g. tokens to be generated).
        block_ids: blocks already allocated for the request (then none are allocated).
        deadline_s: bounds the whole admission, from the call: the lookup waits for the
            tiers at most the engine's ``probe_share`` of it (a tier still answering then is
            cut off: it holds nothing for this request, the others' hit is restored, and the
            cut counts against its circuit breaker), the restore gets what is left; None: the
            engine's ``deadline_s``.
        extras: what besides the tokens changes the request's KV (:class:`~bsr.KeyExtra`: the
            tenant's salt, the adapter, images), the same as the ``engine.save`` that stored it.

    On an Invalidated restore nothing in the blocks is valid: the admission says prefill
    everything (the blocks stay allocated to the request). Raises
    :class:`~bsr.OutOfBlocksError` when the allocator cannot cover the request. Blocks taken
    from ``allocator`` are freed again if the lookup or the restore fails or is cancelled
    (blocks passed in ``block_ids`` stay the caller's).
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
    need = blocks_for(n + reserve_tokens, cache.block_tokens)
    if block_ids is not None:
        ids = [int(b) for b in block_ids]
        if len(ids) < need:
            raise BlockTableError(
                f"{len(ids)} blocks cannot hold {n + reserve_tokens} tokens of "
                f"{cache.block_tokens}; pass at least {need}"
            )
    budget = engine.split_deadline(deadline_s)
    probe = await engine.lookup(arr, extras=extras, deadline_s=budget.lookup_s)
    if block_ids is None:
        ids = allocator.allocate(need)
    try:
        if not probe.hit:
            return Admission(tuple(ids), n, 0, "none", probe)
        result = await engine.restore(
            arr, cache, ids, deadline_s=budget.restore_s(), probe=probe, extras=extras
        )
    except BaseException:
        if block_ids is None:  # taken here: given back on failure and cancellation
            allocator.free(ids)
        raise
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
    #: evictions that saved nothing because the conversation's prefix was not seen
    #: ``admit_after_sightings`` times
    not_admitted: int = 0
    #: evictions that saved nothing because a turn said ``store=False``
    opted_out: int = 0


class _State(enum.Enum):
    IDLE = "idle"  #: resident, no turn in flight: may be evicted
    ADMITTING = "admitting"  #: a turn's admit() is running
    ADMITTED = "admitted"  #: admit() returned; commit() or abort() ends the turn
    EVICTING = "evicting"  #: its full chunks are being saved; its blocks are freed after


@dataclass(eq=False)
class _Conversation:
    tokens: list[int]
    valid: int
    blocks: list[int]
    state: _State
    #: set when an eviction of this conversation ends (saved and gone, or back to idle)
    evicted: anyio.Event | None = None
    #: what besides its tokens its KV was computed with (its tenant, adapter, images)
    extras: tuple[KeyExtra, ...] = ()
    #: may be saved (False once a turn said ``store=False``: its KV holds that turn's data)
    store: bool = True
    #: the chained digests of its history's full chunks, sighted at its last turn (None: no
    #: admission limit)
    digests: tuple[bytes, ...] | None = None


def _same_inputs(a: tuple[KeyExtra, ...], b: tuple[KeyExtra, ...], n: int) -> bool:
    """Whether two sets of extras bind the same values to the first ``n`` tokens (then KV
    computed for ``tokens[:n]`` under one serves the other)."""

    def clipped(extras: tuple[KeyExtra, ...]) -> list[tuple[bytes, int, int]]:
        return sorted(
            (e.key, e.start, n if e.end is None else min(e.end, n)) for e in extras if e.start < n
        )

    return clipped(a) == clipped(b)


class ConversationCache:
    """Keeps conversations' KV resident in a paged cache, evicting through bsr when full.

    Args:
        engine: an open engine (saves on eviction, restores on admission).
        cache: the paged cache.
        allocator: its block allocator (default: every block of ``cache``).
        admit_after_sightings: an eviction saves only the leading chunks of a conversation's
            history that turns (of any conversation) were admitted with at least this many
            times; 1 (default) saves every full chunk. A prefix seen once is not worth
            storing when nothing will ask for it again.
        sightings: the sighting counter (default: a :class:`~bsr.SightingCounter` of 2 MiB),
            e.g. one shared with another server loop.

    Where it runs: the server's event loop; turns of different conversations may run
    concurrently (see the module docstring). A turn is :meth:`admit` (reserve room for the
    tokens to generate), the model writes KV for ``tokens[cached_tokens:]``, then :meth:`commit`
    says which tokens the cache now holds, or :meth:`abort` ends the turn keeping what was valid
    at admission (:meth:`turn` does the admit and the abort-on-error around a block). A
    conversation in a turn is never evicted, and one turn per conversation runs at a time.
    """

    def __init__(
        self,
        engine: RestoreEngine,
        cache: PagedKVCache,
        allocator: BlockAllocator | None = None,
        *,
        admit_after_sightings: int = 1,
        sightings: SightingCounter | None = None,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"cache must be a bsr.PagedKVCache, got {type(cache).__name__}")
        self.engine = engine
        self.cache = cache
        self.allocator = allocator or BlockAllocator(cache.num_blocks)
        self.admit_after_sightings = positive_int(admit_after_sightings, "admit_after_sightings")
        if sightings is not None and not isinstance(sightings, SightingCounter):
            raise ConfigError(
                f"sightings must be a bsr.SightingCounter, got {type(sightings).__name__}"
            )
        self.sightings = sightings
        if self.sightings is None and self.admit_after_sightings > 1:
            self.sightings = SightingCounter()
        self._convs: OrderedDict[Hashable, _Conversation] = OrderedDict()
        names = [f.name for f in dataclasses.fields(ConversationStatistics) if f.name != "resident"]
        self._stats = dict.fromkeys(names, 0)

    def statistics(self) -> ConversationStatistics:
        return ConversationStatistics(resident=len(self.resident()), **self._stats)

    def resident(self) -> list[Hashable]:
        """Conversations holding blocks, least recently used first."""
        return [c for c, v in self._convs.items() if v.blocks]

    def block_ids(self, conv_id: Hashable) -> list[int]:
        """The block table of a resident conversation."""
        return list(self._get(conv_id).blocks)

    def state(self, conv_id: Hashable) -> str | None:
        """``"idle"``, ``"admitting"``, ``"admitted"``, ``"evicting"``, or None (not held)."""
        conv = self._convs.get(conv_id)
        return None if conv is None else conv.state.value

    def _get(self, conv_id: Hashable) -> _Conversation:
        try:
            return self._convs[conv_id]
        except KeyError:
            raise ConfigError(f"conversation {conv_id!r} is not resident; admit it first") from None

    def _busy(self, conv_id: Hashable, conv: _Conversation, doing: str) -> ConversationBusyError:
        if conv.state is _State.EVICTING:
            what, todo = "it is being evicted", "wait for the eviction to end"
        else:
            what = "a turn is in flight (admitted, not committed)"
            todo = "one turn per conversation at a time: commit() or abort() the current turn"
        return ConversationBusyError(
            f"cannot {doing}: conversation {conv_id!r} is busy, {what}; {todo}",
            conversation=conv_id,
            state=conv.state.value,
        )

    async def _take_blocks(self, n: int, keep: Hashable) -> list[int]:
        """``n`` blocks, evicting idle conversations (least recently used first) for them.

        The check and the allocation happen with no await in between, so blocks freed for this
        turn cannot be taken by another turn first.
        """
        if n > self.allocator.capacity:
            raise OutOfBlocksError(
                f"need {n} blocks, the cache has {self.allocator.capacity} in all; give the "
                "cache more blocks or the turn fewer tokens",
                wanted=n,
                free=self.allocator.num_free,
            )
        while not self.allocator.can_allocate(n):
            victim = next(
                (c for c, v in self._convs.items() if c != keep and v.state is _State.IDLE), None
            )
            if victim is not None:
                await self._evict(victim)
                continue
            pending = [v.evicted for v in self._convs.values() if v.state is _State.EVICTING]
            if pending and pending[0] is not None:
                await pending[0].wait()  # its blocks come back when its save ends
                continue
            raise OutOfBlocksError(
                f"need {n} free blocks, {self.allocator.num_free} are free and every "
                "other resident conversation is busy; give the cache more blocks",
                wanted=n,
                free=self.allocator.num_free,
            )
        return self.allocator.allocate(n)

    async def evict(self, conv_id: Hashable) -> SaveResult | None:
        """Save an idle conversation's full chunks through the engine, then free its blocks.

        Raises:
            ConversationBusyError: the conversation is in a turn or already being evicted.
        """
        conv = self._get(conv_id)
        if conv.state is not _State.IDLE:
            raise self._busy(conv_id, conv, "evict it")
        return await self._evict(conv_id)

    async def _evict(self, conv_id: Hashable) -> SaveResult | None:
        conv = self._convs[conv_id]
        conv.state, conv.evicted = _State.EVICTING, anyio.Event()
        try:
            saved = None
            chunk = self.engine.layout.chunk_tokens
            n = conv.valid
            if conv.digests is not None:  # the leading chunks seen often enough by now
                n = min(n, self._admitted(conv.digests) * chunk)
            if n >= chunk and not conv.store:
                self._stats["opted_out"] += 1
            elif n < chunk <= conv.valid:
                self._stats["not_admitted"] += 1
            elif n >= chunk:
                saved = await self.engine.save(
                    conv.tokens[:n], self.cache, conv.blocks, extras=conv.extras
                )
        except BaseException:
            conv.state = _State.IDLE  # the save failed or was cancelled: it stays resident
            raise
        else:
            del self._convs[conv_id]
            self.allocator.free(conv.blocks)
            self._stats["evictions"] += 1
            if saved is not None:
                self._stats["saved_tokens"] += saved.saved_tokens
        finally:
            conv.evicted.set()
        return saved

    def drop(self, conv_id: Hashable) -> None:
        """Forget an idle conversation without saving it (its blocks are freed).

        Raises:
            ConversationBusyError: the conversation is in a turn or being evicted.
        """
        conv = self._convs.get(conv_id)
        if conv is None:
            return
        if conv.state is not _State.IDLE:
            raise self._busy(conv_id, conv, "drop it")
        del self._convs[conv_id]
        self.allocator.free(conv.blocks)

    async def admit(
        self,
        conv_id: Hashable,
        tokens: TokensLike,
        *,
        reserve_tokens: int = 0,
        extras: Extras | None = None,
        store: bool = True,
    ) -> Admission:
        """Admit the next turn of ``conv_id`` (``tokens``: its whole history so far).

        Resident and ``tokens`` extends what the cache holds, computed with the same
        ``extras`` (:class:`~bsr.KeyExtra`: its tenant, adapter, images) over those tokens:
        reuse it in place (growing the block table). Otherwise admit it through bsr
        (:func:`admit`), evicting least recently used idle conversations until its blocks fit.
        A conversation being evicted is waited for, then admitted through bsr. The turn's
        ``extras`` are the conversation's from now on: its eviction saves under them.
        ``store=False``: this turn's data must never be stored ("do not store"): the
        conversation's KV now holds it, so its evictions save nothing from here on.

        Raises:
            ConversationBusyError: a turn of ``conv_id`` is already in flight.
            OutOfBlocksError: the blocks cannot be found even after evicting every idle
                conversation (nothing is kept: the turn took no blocks).
        """
        toks = [int(t) for t in as_token_array(tokens)]
        n = len(toks)
        if n == 0:
            raise ConfigError("admit needs at least one token")
        non_negative_int(reserve_tokens, "reserve_tokens")
        if not isinstance(store, bool):
            raise ConfigError(f"store must be True or False, got {store!r}")
        ext = KeyExtra.canonical(extras)
        need = blocks_for(n + reserve_tokens, self.cache.block_tokens)
        digests = self._sight(toks, ext)  # this turn is a sighting, before anything is evicted
        while True:
            conv = self._convs.get(conv_id)
            if conv is None or conv.state is _State.IDLE:
                break
            if conv.state is _State.EVICTING and conv.evicted is not None:
                await conv.evicted.wait()  # then resident again (save failed) or gone
                continue
            raise self._busy(conv_id, conv, "admit another turn")
        self._stats["admitted"] += 1
        if (
            conv is not None
            and conv.valid
            and toks[: conv.valid] == conv.tokens[: conv.valid]
            and _same_inputs(conv.extras, ext, conv.valid)
        ):
            conv.extras = ext
            adm = await self._admit_resident(conv_id, conv, toks, need)
        else:
            if conv is not None:  # diverged history, or other inputs: start over
                self.drop(conv_id)
            adm = await self._admit_new(conv_id, toks, reserve_tokens, need, ext)
        turn = self._convs[conv_id]
        turn.store = turn.store and store
        turn.digests = digests
        return adm

    def _sight(self, toks: list[int], extras: tuple[KeyExtra, ...]) -> tuple[bytes, ...] | None:
        """Count a turn's sighting of every prefix of its history; the chunks' digests (None:
        no admission limit)."""
        if self.sightings is None or self.admit_after_sightings <= 1:
            return None
        digests = tuple(k.digest for k in self.engine.keys(toks, extras=extras))
        self.sightings.add(digests)
        return digests

    def _admitted(self, digests: tuple[bytes, ...]) -> int:
        """Leading chunks seen at least ``admit_after_sightings`` times by now."""
        assert self.sightings is not None
        n = 0
        for d in digests:
            if self.sightings.count(d) < self.admit_after_sightings:
                break
            n += 1
        return n

    async def _admit_resident(
        self, conv_id: Hashable, conv: _Conversation, toks: list[int], need: int
    ) -> Admission:
        n = len(toks)
        self._convs.move_to_end(conv_id)
        conv.state = _State.ADMITTING
        try:
            conv.blocks += await self._take_blocks(max(0, need - len(conv.blocks)), conv_id)
        except BaseException:
            conv.state = _State.IDLE
            raise
        cached = min(conv.valid, n - 1)
        conv.tokens, conv.valid, conv.state = toks, cached, _State.ADMITTED
        self._stats["resident_hits"] += 1
        self._stats["prefilled_tokens"] += n - cached
        return Admission(tuple(conv.blocks), n, cached, "resident")

    async def _admit_new(
        self,
        conv_id: Hashable,
        toks: list[int],
        reserve_tokens: int,
        need: int,
        extras: tuple[KeyExtra, ...],
    ) -> Admission:
        # held from the start, so a second turn of this conversation sees it busy
        conv = self._convs[conv_id] = _Conversation([], 0, [], _State.ADMITTING, extras=extras)
        try:
            conv.blocks = await self._take_blocks(need, conv_id)
            adm = await admit(
                self.engine,
                toks,
                self.cache,
                self.allocator,
                reserve_tokens=reserve_tokens,
                block_ids=conv.blocks,
                extras=extras,
            )
        except BaseException:
            del self._convs[conv_id]
            if conv.blocks:
                self.allocator.free(conv.blocks)
            raise
        conv.tokens, conv.valid, conv.state = toks, adm.cached_tokens, _State.ADMITTED
        if adm.source == "restored":
            self._stats["restored"] += 1
            self._stats["restored_tokens"] += adm.cached_tokens
        self._stats["prefilled_tokens"] += adm.prefill_tokens
        return adm

    def _in_turn(self, conv_id: Hashable, doing: str) -> _Conversation:
        conv = self._get(conv_id)
        if conv.state is _State.ADMITTED:
            return conv
        if conv.state is _State.IDLE:
            raise ConfigError(
                f"cannot {doing}: conversation {conv_id!r} has no turn in flight; admit() first"
            )
        raise self._busy(conv_id, conv, doing)

    def commit(self, conv_id: Hashable, tokens: TokensLike, valid_tokens: int) -> None:
        """After the model ran: ``tokens`` is the history, ``[0, valid_tokens)`` hold KV."""
        conv = self._in_turn(conv_id, "commit")
        toks = [int(t) for t in as_token_array(tokens)]
        cap = len(conv.blocks) * self.cache.block_tokens
        top = min(len(toks), cap)
        int_between(
            valid_tokens,
            "valid_tokens",
            0,
            top,
            bounds=f"[0, {top}] (the tokens, and the room of the conversation's "
            f"{len(conv.blocks)} blocks)",
        )
        conv.tokens, conv.valid, conv.state = toks, valid_tokens, _State.IDLE
        self._convs.move_to_end(conv_id)

    def abort(self, conv_id: Hashable) -> None:
        """End a turn without new KV: the conversation keeps what was valid at admission."""
        conv = self._in_turn(conv_id, "abort")
        conv.state = _State.IDLE

    @contextlib.asynccontextmanager
    async def turn(
        self,
        conv_id: Hashable,
        tokens: TokensLike,
        *,
        reserve_tokens: int = 0,
        extras: Extras | None = None,
        store: bool = True,
    ) -> AsyncIterator[Admission]:
        """``async with cache.turn(conv_id, history) as adm:`` admit, run the model, commit.

        Leaving the block without :meth:`commit` (an error, a cancellation) aborts the turn.
        """
        adm = await self.admit(
            conv_id, tokens, reserve_tokens=reserve_tokens, extras=extras, store=store
        )
        try:
            yield adm
        finally:
            conv = self._convs.get(conv_id)
            if conv is not None and conv.state is _State.ADMITTED:
                self.abort(conv_id)

    async def evict_all(self) -> None:
        """Save and free every idle conversation (e.g. at shutdown)."""
        for conv_id in list(self._convs):
            conv = self._convs.get(conv_id)
            if conv is not None and conv.state is _State.IDLE:
                await self._evict(conv_id)
