"""Warm and promote: copy a stored prefix into the fastest tier before (or after) it is needed.

Where it runs: the engine's event loop, as :meth:`RestoreEngine.warm` (a router's hint that a
prefix is about to be asked for) and as promotions (a hit read from a lower tier, copied into
the host tier after its restore committed, off that request's path).

How it works: a :class:`Warmer` belongs to one engine. Its target is the engine's first tier
when that tier lives in host memory (``Medium.HOST``) and a lower tier exists; otherwise a warm
has nothing to do (reason ``"no_target"``). A copy probes this rank's prefix (metadata only, no
agreement with other ranks: a warm is a hint), and for each object the prefix needs that the
target lacks, in chunk order, takes one slot of the engine's staging window, reads the object
from its first healthy holder below the target into it and checks it (the same check every
restore makes), then writes those bytes to the target. The target makes an object visible only
once it is whole, so a warm cut short (cancelled, a deadline, a failure) leaves complete,
verified objects or nothing. A corrupt copy is quarantined like a restore's and the next holder
is tried. Bounds: a copy keeps at most ``min(io_depth, max(1, window // 2))`` reads in flight,
so restores always find half the window; at most ``concurrency`` copies run at once (another is
refused at once, reason ``"busy"``: a hint is never queued behind others); and the bytes that
copies in flight may write into the target together stay within ``budget_bytes`` (a prefix
larger than what is left is warmed up to its leading part that fits, reason ``"budget"``), and a
prefix larger than the target's capacity is warmed up to its leading part that fits (reason
``"capacity"``: copying more would only evict its own first objects).
Objects being copied are registered, so a restore of the same prefix waits for them
(:meth:`Warmer.join`) instead of reading them a second time, and reads them from the target.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from .._errors import BsrError, ObjectError, ObjectNotFoundError, TierBusyError
from ..core._keys import ChunkKey, Extras, ObjectKey, TokensLike
from ..core._layout import StateLayout
from ..core._options import Promote
from ..core._plan import longest_prefix, needed_objects
from ..core._results import Probe
from ..tiers._base import Medium, Tier
from ..tiers._codec import ObjectCodec
from ..transfer._staging import Slot, StagingPool
from ._decisions import Quarantine, TierQuarantine
from ._health import TierHealth
from ._probe import Prober

#: promotions waiting for the engine's background task (older ones are dropped past this)
MAX_PENDING_PROMOTIONS = 256
#: prefixes remembered for ``promote="second_hit"`` (least recently seen forgotten first)
MAX_SEEN = 8192


@dataclass(frozen=True)
class WarmResult:
    """What a warm (or a promotion) did.

    Attributes:
        kind: ``"warm"`` (:meth:`RestoreEngine.warm`) or ``"promotion"`` (after a restore).
        tokens: tokens asked for.
        prefix_tokens: the stored prefix found on this rank, in tokens.
        warm_tokens: the leading tokens whose every object the target holds now: a restore of
            them reads nothing from a lower tier.
        target: the tier copied into (None: no target, see ``reason``).
        objects_copied: objects this call copied into the target.
        objects_present: objects the target held already.
        bytes_by_tier: payload bytes read, by the tier they were read from.
        quarantined: corrupt copies found (and taken out of use) while reading.
        reason: ``"warm"`` (the whole prefix is in the target), ``"miss"`` (nothing stored),
            ``"budget"`` (only the leading part that fits the warm budget), ``"capacity"`` (only
            the leading part that fits the target's capacity: copying more would evict the
            prefix's own first objects), ``"busy"`` (as many
            copies as allowed are running; nothing done), ``"no_target"`` (the engine has no
            host tier above another tier), ``"read_failed"`` / ``"write_failed"`` (an object could
            not be read from any holder / written to the target; what was copied before it
            stays), ``"deadline"`` (the deadline ended it).
        duration_s: wall time.
    """

    tokens: int
    prefix_tokens: int
    warm_tokens: int
    target: str | None
    kind: str = "warm"
    objects_copied: int = 0
    objects_present: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    reason: str = "warm"
    duration_s: float = 0.0

    @property
    def complete(self) -> bool:
        """Whether the whole stored prefix is in the target."""
        return self.target is not None and self.warm_tokens == self.prefix_tokens


@dataclass(frozen=True)
class WarmStatistics:
    """An engine's warms and promotions (:attr:`EngineStatistics.warm`).

    Attributes:
        warms: warm calls; ``warms_refused``: those refused as busy.
        promotions: promotions run; ``promotions_dropped``: those dropped unrun (queue full or
            engine closed).
        objects_copied, bytes_copied: what warms and promotions copied into the target.
        restores_joined: restores that waited for a copy in flight instead of reading twice.
        budget_bytes: the warm budget in force (None: unbounded).
    """

    warms: int = 0
    warms_refused: int = 0
    promotions: int = 0
    promotions_dropped: int = 0
    objects_copied: int = 0
    bytes_copied: int = 0
    restores_joined: int = 0
    budget_bytes: int | None = None


@dataclass
class _Copy:
    """One copy's progress (shared by its object tasks): ``cut``, what left objects out before
    it began (``"budget"``, ``"capacity"``); ``failed``, the first object's failure
    (``"read_failed"``, ``"write_failed"``), after which no more are launched."""

    cut: str | None = None
    failed: str | None = None
    copied: int = 0
    present: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    moves: list[TierQuarantine] = field(default_factory=list)


#: the target's allocation unit (a HostTier keeps objects in whole 4 KiB pages)
_PAGE = 4096


@dataclass(frozen=True)
class _Promotion:
    keys: tuple[ChunkKey, ...]
    num_tokens: int


class Warmer:
    """An engine's warms and promotions (see the module docstring).

    Args:
        layout, tiers, prober, health, quarantine: the engine's.
        pool: the engine's staging pool (raises once the engine is closed).
        move_out: the engine's ``_move_out(moves, budget_s, log)``.
        io_depth, window: the engine's; bound the reads one copy keeps in flight.
        budget_bytes: bytes copies in flight may write into the target together; None: a
            quarter of the target's capacity (unbounded if it reports none).
        concurrency: copies (warms and promotions) running at once.
        promote: the promotion policy.
        shield_timeout_s: the bound on moving corrupt copies out of their tiers.
        log: the engine's logger.
        notify: called with every result (the engine's listeners: metrics).
    """

    def __init__(
        self,
        layout: StateLayout,
        tiers: Sequence[Tier],
        prober: Prober,
        health: TierHealth,
        quarantine: Quarantine,
        pool: Callable[[], StagingPool],
        move_out: Callable[[list[TierQuarantine], float, Any], Awaitable[None]],
        *,
        io_depth: int,
        window: int,
        budget_bytes: int | None,
        concurrency: int,
        promote: Promote,
        shield_timeout_s: float,
        log: Any,
        notify: Callable[[WarmResult], None] = lambda _: None,
    ) -> None:
        self.layout = layout
        self.tiers = {t.name: t for t in tiers}
        first = tiers[0]
        self.target: Tier | None = first if len(tiers) > 1 and first.medium is Medium.HOST else None
        self._prober, self._health, self._quarantine = prober, health, quarantine
        self._pool, self._move_out = pool, move_out
        self.reads = max(1, min(io_depth, window // 2))
        self._budget_option = budget_bytes
        self.concurrency = concurrency
        self.promote = promote
        self._shield_s = shield_timeout_s
        self._log = log
        self._notify = notify
        #: object id -> set when the copy that registered it ended (copied or not)
        self._inflight: dict[str, anyio.Event] = {}
        self._reserved = 0
        self._running = 0
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._pending: deque[_Promotion] = deque()
        self._wake: anyio.Event | None = None
        self._stats = WarmStatistics()

    # ------------------------------------------------------------------ bounds
    @property
    def budget_bytes(self) -> int | None:
        if self._budget_option is not None or self.target is None:
            return self._budget_option
        capacity = self.target.usage().capacity_bytes
        return capacity // 4 if capacity else None

    def statistics(self) -> WarmStatistics:
        return replace(self._stats, budget_bytes=self.budget_bytes)

    def _add(self, **deltas: int) -> None:
        s = self._stats
        self._stats = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    # ------------------------------------------------------------------ warm
    async def warm(
        self, tokens: TokensLike, extras: Extras | None, deadline_s: float | None
    ) -> WarmResult:
        """Copy this rank's stored prefix of ``tokens`` into the target (see the module)."""
        t0 = time.perf_counter()
        self._add(warms=1)
        if self.target is None:
            return WarmResult(0, 0, 0, None, reason="no_target")
        if self._running >= self.concurrency:
            self._add(warms_refused=1)
            return WarmResult(0, 0, 0, self.target.name, reason="busy")
        self._running += 1
        state = _Copy()
        try:
            with anyio.move_on_after(deadline_s if deadline_s is not None else float("inf")) as sc:
                outcome = await self._prober.probe(
                    tokens, deadline_s=deadline_s, partial=True, agree=False, extras=extras
                )
                result = await self._copy(outcome.probe, state)
            if sc.cancelled_caught:
                result = self._copied(await self._after_deadline(tokens, extras), state)
        finally:
            self._running -= 1
        return self._done(replace(result, duration_s=time.perf_counter() - t0))

    def _done(self, result: WarmResult) -> WarmResult:
        self._log.info(
            f"bsr.{result.kind}.done", tokens=result.tokens, prefix_tokens=result.prefix_tokens,
            warm_tokens=result.warm_tokens, copied=result.objects_copied,
            present=result.objects_present, bytes_by_tier=result.bytes_by_tier,
            reason=result.reason, duration_s=round(result.duration_s, 6),
        )  # fmt: skip
        self._notify(result)
        return result

    async def _after_deadline(self, tokens: TokensLike, extras: Extras | None) -> WarmResult:
        """What the target holds of a warm its deadline ended (metadata only, shielded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._shield_s):
            probe = (
                await self._prober.probe(
                    tokens, deadline_s=self._shield_s, partial=True, agree=False, extras=extras
                )
            ).probe
            return replace(await self._measure(probe), reason="deadline")
        return WarmResult(0, 0, 0, self.target.name if self.target else None, reason="deadline")

    @staticmethod
    def _copied(result: WarmResult, state: _Copy) -> WarmResult:
        """``result`` with what the copy of ``state`` did."""
        return replace(
            result, objects_copied=state.copied, objects_present=state.present,
            bytes_by_tier=dict(state.by_tier), quarantined=len(state.moves),
        )  # fmt: skip

    async def _copy(self, probe: Probe, state: _Copy) -> WarmResult:
        """Copy what the target lacks of ``probe``'s prefix, in chunk order, within the budget
        and the target's capacity."""
        assert self.target is not None
        target = self.target.name
        todo: list[tuple[int, str]] = []
        joined: list[anyio.Event] = []
        held = 0  # what this prefix already takes in the target
        for c, g in needed_objects(self.layout, probe.local_chunks):
            holders = probe.holders[c][g]
            oid = ObjectKey(probe.keys[c], g).object_id
            if target in holders:
                state.present += 1
                held += self._stored(g)
            elif oid in self._inflight:  # another copy has it in hand: wait for that one
                joined.append(self._inflight[oid])
            else:
                todo.append((c, g))
        todo, nbytes, state.cut = self._reserve(todo, held)
        try:
            await self._copy_objects(probe, todo, state)
        finally:
            self._reserved -= nbytes
        for event in joined:
            await event.wait()
        result = self._copied(await self._measure(probe), state)
        if result.prefix_tokens == 0:
            return replace(result, reason="miss")
        if result.warm_tokens < result.prefix_tokens:
            return replace(result, reason=state.failed or state.cut or "read_failed")
        return result

    def _stored(self, group: str) -> int:
        """The bytes an object of ``group`` takes in the target (header, whole pages)."""
        n = ObjectCodec.stored_size(self.layout.group_chunk_bytes(group))
        return -(-n // _PAGE) * _PAGE

    def _reserve(
        self, todo: list[tuple[int, str]], held: int
    ) -> tuple[list[tuple[int, str]], int, str | None]:
        """The leading objects of ``todo`` that fit both the budget left and the target's
        capacity (less ``held``, what the prefix has there already: copying more would evict
        the prefix's own leading objects), the bytes reserved for them, and what cut them
        (``"budget"``, ``"capacity"`` or None)."""
        budget = self.budget_bytes
        capacity = self.target.usage().capacity_bytes if self.target is not None else 0
        room = math.inf if budget is None else budget - self._reserved
        space = capacity - held if capacity else math.inf
        take, nbytes, stored, cut = 0, 0, 0, None
        for _, g in todo:
            size, taken = self.layout.group_chunk_bytes(g), self._stored(g)
            if nbytes + size > room:
                cut = "budget"
                break
            if stored + taken > space:
                cut = "capacity"
                break
            take, nbytes, stored = take + 1, nbytes + size, stored + taken
        self._reserved += nbytes
        return todo[:take], nbytes, cut

    async def _copy_objects(self, probe: Probe, todo: list[tuple[int, str]], state: _Copy) -> None:
        """Copy ``todo`` through the staging window, at most :attr:`reads` at once; the first
        failure stops launching more (what is in flight finishes)."""
        events = {}  # object id -> its event, set when this copy ends
        for c, g in todo:
            oid = ObjectKey(probe.keys[c], g).object_id
            events[oid] = self._inflight[oid] = anyio.Event()
        pool = self._pool()
        account = pool.account()
        limiter = anyio.Semaphore(self.reads)
        try:
            async with anyio.create_task_group() as tg:
                for c, g in todo:
                    if state.failed:
                        break
                    await limiter.acquire()
                    try:
                        slot = await account.acquire()
                    except BaseException:
                        limiter.release()
                        raise
                    if state.failed:
                        account.release(slot)  # one in flight failed while this one waited
                        limiter.release()
                        break
                    tg.start_soon(self._copy_one, probe, c, g, slot, account, limiter, state)
        finally:
            for oid, event in events.items():
                if self._inflight.get(oid) is event:
                    del self._inflight[oid]
                event.set()
            if state.moves:
                with anyio.CancelScope(shield=True):
                    await self._move_out(state.moves, self._shield_s, self._log)

    async def _copy_one(
        self,
        probe: Probe,
        c: int,
        g: str,
        slot: Slot,
        account: Any,
        limiter: anyio.Semaphore,
        state: _Copy,
    ) -> None:
        assert self.target is not None
        key = probe.keys[c]
        try:
            read = await self._read(key, g, probe.holders[c][g], slot, state)
            if read is None:
                state.failed = state.failed or "read_failed"
                return
            source, n = read
            try:
                written = await self.target.write(key, g, slot.tensor[:n])
            except (BsrError, OSError) as exc:  # full of pinned objects, busy, closed
                self._log.info("bsr.warm.write_failed", tier=self.target.name, error=repr(exc))
                state.failed = state.failed or "write_failed"
                return
            oid = ObjectKey(key, g).object_id
            self._quarantine.lift(self.target.name, oid)  # a fresh, checked copy
            state.by_tier[source] = state.by_tier.get(source, 0) + n
            if written:
                state.copied += 1
                self._add(objects_copied=1, bytes_copied=n)
        finally:
            account.release(slot)
            limiter.release()

    async def _read(
        self, key: ChunkKey, g: str, holders: Sequence[str], slot: Slot, state: _Copy
    ) -> tuple[str, int] | None:
        """Read and check ``(key, g)`` into ``slot`` from its first good holder below the
        target: ``(tier, payload bytes)``, or None when none served it."""
        assert self.target is not None
        oid = ObjectKey(key, g).object_id
        for name in holders:
            if name == self.target.name or (name, oid) in self._quarantine:
                continue
            if not self._health.admit(name):
                continue
            try:
                n = await self.tiers[name].read_into(key, g, slot.tensor)
            except ObjectNotFoundError:
                self._health.success(name)  # gone since the probe: the tier answered
                continue
            except ObjectError as exc:  # corrupt: out of use, then out of its tier
                self._health.success(name)
                if self._quarantine.add(name, oid):
                    state.moves.append(TierQuarantine(name, key, g, f"warm read: {exc}"))
                continue
            except TierBusyError:
                self._health.release(name)
                continue
            except (BsrError, OSError) as exc:
                self._health.failure(name)
                self._log.info("bsr.warm.read_failed", tier=name, error=repr(exc))
                continue
            except BaseException:
                self._health.release(name)
                raise
            self._health.success(name)
            return name, n
        return None

    async def _measure(self, probe: Probe) -> WarmResult:
        """How much of ``probe``'s prefix the target holds now (metadata only)."""
        assert self.target is not None
        n = probe.local_chunks
        objs = needed_objects(self.layout, n)
        present = await self.target.contains_many([ObjectKey(probe.keys[c], g) for c, g in objs])
        name = self.target.name
        have = {
            (c, g)
            for (c, g), p in zip(objs, present, strict=True)
            if p and (name, ObjectKey(probe.keys[c], g).object_id) not in self._quarantine
        }
        warm = longest_prefix(self.layout, n, lambda c, g: (c, g) in have)
        ct = self.layout.chunk_tokens
        return WarmResult(probe.num_tokens, n * ct, warm * ct, name)

    # ------------------------------------------------------------------ restores
    async def join(
        self,
        tokens: TokensLike,
        extras: Extras | None,
        probe: Probe | None,
        deadline_at: float | None,
    ) -> Probe | None:
        """Wait (until ``deadline_at``, ``perf_counter`` time) for the copies in flight of the
        objects of ``tokens``; return ``probe`` with the target put first where a copy landed
        since the probe was made (a restore given a lookup's probe then reads them from the
        target, whether the copy was in flight at the restore or ended before it)."""
        copied_before = probe is not None and self._stats.objects_copied > 0
        if self.target is None or not (self._inflight or copied_before):
            return probe
        if self._inflight:
            keys = (
                probe.keys if probe is not None else (await self._prober.keyed(tokens, extras)).keys
            )
            groups = self.layout.group_names
            waits = [
                e for k in keys for g in groups
                if (e := self._inflight.get(ObjectKey(k, g).object_id)) is not None
            ]  # fmt: skip
            if waits:
                self._add(restores_joined=1)
                left = float("inf") if deadline_at is None else deadline_at - time.perf_counter()
                with anyio.move_on_after(max(0.0, left)):
                    for event in waits:
                        await event.wait()
        if probe is None:
            return probe  # the restore probes after this: it sees what landed
        return await self._refresh(probe)

    async def _refresh(self, probe: Probe) -> Probe:
        """``probe`` with the target first for each object of its prefix the target holds now
        (metadata only, and only when the probe found some object outside the target)."""
        assert self.target is not None
        name = self.target.name
        objs = [
            (c, g) for c, g in needed_objects(self.layout, probe.prefix_chunks)
            if name not in probe.holders[c][g]
        ]  # fmt: skip
        if not objs:
            return probe
        present = await self.target.contains_many([ObjectKey(probe.keys[c], g) for c, g in objs])
        holders = [dict(h) for h in probe.holders]
        for (c, g), p in zip(objs, present, strict=True):
            if p and (name, ObjectKey(probe.keys[c], g).object_id) not in self._quarantine:
                holders[c][g] = (name, *holders[c][g])
        return replace(probe, holders=tuple(holders))

    # ------------------------------------------------------------------ promotion
    def after_restore(
        self, keys: Sequence[ChunkKey], num_tokens: int, bytes_by_tier: dict[str, int]
    ) -> bool:
        """Note a committed restore of ``keys`` that read ``bytes_by_tier``; return whether a
        promotion was queued (some of it was read from a tier below the target)."""
        if self.target is None or self.promote is Promote.NEVER or not keys:
            return False
        if not any(n for name, n in bytes_by_tier.items() if name != self.target.name):
            return False
        if self.promote is Promote.SECOND_HIT:
            last = keys[-1].digest
            if last not in self._seen:
                self._seen[last] = None
                if len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return False
            del self._seen[last]
        if len(self._pending) >= MAX_PENDING_PROMOTIONS:
            self._pending.popleft()
            self._add(promotions_dropped=1)
        self._pending.append(_Promotion(tuple(keys), num_tokens))
        if self._wake is not None:
            self._wake.set()
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def run_promotions(self) -> list[WarmResult]:
        """Run the queued promotions one after another; return what each did."""
        out = []
        while self._pending and self.target is not None:
            p = self._pending.popleft()
            if self._running >= self.concurrency:
                self._pending.appendleft(p)
                break
            self._running += 1
            t0 = time.perf_counter()
            try:
                holders = await self._prober.holders(p.keys)
                probe = self._prober.from_keys(p.keys, holders, p.num_tokens)
                result = await self._copy(probe, _Copy())
                self._add(promotions=1)
            finally:
                self._running -= 1
            out.append(self._done(replace(
                result, kind="promotion", duration_s=time.perf_counter() - t0
            )))  # fmt: skip
        return out

    async def serve(self) -> None:
        """Run promotions as they are queued, until cancelled (the engine's background task)."""
        while True:
            self._wake = anyio.Event()
            if not self._pending:
                await self._wake.wait()
            try:
                await self.run_promotions()
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:  # a failed promotion never takes the engine down
                self._log.warning("bsr.promote.failed", error=repr(exc))
            if self._pending:  # refused as busy: let the copies in flight finish first
                await anyio.sleep(0.01)

    def drop_pending(self) -> None:
        if self._pending:
            self._add(promotions_dropped=len(self._pending))
            self._pending.clear()
