"""RestoreMachine: a Hypothesis state machine that drives a real engine beside a small model.

How it works: each example builds one :class:`~bsr.RestoreEngine` per rank over real tiers (by
default a :class:`~bsr.HostTier` above a :class:`~bsr.FileTier` in a temporary directory), each
tier wrapped in a :class:`~bsr.testing.FaultyTier` whose plan the machine swaps in and out. The
engines run on an event loop in a worker thread (``anyio.from_thread.start_blocking_portal``);
the synchronous Hypothesis rules call into it. Rules save, evict, corrupt for real, restore
(both policies, several at once, across ranks), cancel restores midway, inject faults, and
close and reopen everything over the same directories.

The model beside the engine knows, per rank and tier, which *token prefixes* were saved and
whether each stored object is intact, damaged or lost. It is written from the specification,
not from the engine: it never calls the engine's planning code; it computes which chunks a
sliding-window group needs from the token ranges, and the source bytes of every chunk from a
hash of the prefix (so expected cache contents are known without looking at the engine). What
it observes is only the environment and documented engine policy: whether a tier still holds an
object (the engine may quarantine damaged objects, which is the engine acting on the tiers),
which faults the fault injector fired on which objects, and which tiers' circuit breakers were
open during a step (``EngineStatistics.breakers``; the engine then skips that tier, so the model
expects nothing of it). Draws never depend on that observed state, so Hypothesis can replay an
example even where concurrent restores make the engine's side effects timing-dependent.

Invariants checked after every restore (and, for staging, after every step):

1. ``committed_tokens`` is 0 or the agreed probed prefix (``truncate``: a shorter chunk-aligned
   prefix); every committed block equals the saved bytes; blocks outside the committed prefix
   that the restore wrote are reported in ``invalid_block_ids``.
2. Staging in use never exceeds W and is 0 (nothing waiting) when idle.
3. Every restore ends Committed or Invalidated (it neither raises nor hangs) within its deadline.
4. With no fault active, the probe finds what the model says is there, and a prefix whose every
   needed object is intact in some tier is committed in full.
5. With several ranks, every rank ends in the same state with the same ``committed_tokens``.

Plug in your own tiers with :meth:`RestoreMachine.configured` (``tier_factory=``; tiers must
be large enough never to evict on their own); run with
``run_state_machine_as_test(Machine, settings=...)`` or ``Machine.TestCase``.

Example::

    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    from bsr.testing import RestoreMachine

    Machine = RestoreMachine.configured(tier_factory=lambda d, rank: [MyTier(d / "store")])
    run_state_machine_as_test(Machine, settings=settings(max_examples=100, deadline=None))
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio
import numpy as np
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..core._keys import ChunkKey, Namespace, ObjectKey, chunk_keys
from ..core._layout import StateGroup, StateLayout
from ..core._lifecycle import RequestState
from ..core._object import HEADER_SIZE
from ..core._results import Policy, RestoreResult
from ..engine._coordinator import Coordinator, InProcessGroup
from ..engine._engine import RestoreEngine
from ..tiers._base import Tier
from ..tiers._file import FileTier
from ..tiers._host import HostTier
from ..transfer._cache import PagedKVCache
from ._faults import Fault, FaultKind, FaultPlan, FaultyTier, corrupt_stored, truncate_stored
from ._strategies import LayoutCase, derived_tokens, fault_plans, layouts, token_streams

T = TypeVar("T")

#: ``(directory, rank) -> tiers``, fastest first, unopened. Called again with the same
#: directory when the machine reopens (durable tiers must then find their objects again).
TierFactory = Callable[[Path, int], Sequence[Tier]]


def default_tier_factory(directory: Path, rank: int) -> list[Tier]:
    """A HostTier above a FileTier under ``directory`` (capacities large enough to never evict)."""
    return [
        HostTier(1 << 30, name="host"),
        FileTier(directory / "l2", 1 << 30, name="file", reader="posix", fsync=False),
    ]


class Status(enum.Enum):
    """What the model knows about one stored object."""

    INTACT = "intact"  #: stored completely with the saved bytes
    BAD = "bad"  #: stored but damaged (flipped, truncated, foreign); never counted as readable
    LOST = "lost"  #: a write was acknowledged but stored nothing (visible, unreadable)


class InvariantViolation(AssertionError):
    """The engine did something the invariants forbid (the message says what)."""


@dataclass
class CampaignStats:
    """Figures of a campaign, accumulated over every example (shrinking replays included)."""

    examples: int = 0
    steps: int = 0
    saves: int = 0
    restores: int = 0
    committed: int = 0
    committed_nonempty: int = 0
    truncated: int = 0
    invalidated: int = 0
    cancelled: int = 0
    split_by_cancel: int = 0
    reopens: int = 0
    breaker_trips: int = 0
    corruptions: int = 0
    evictions: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    plan_fired: int = 0
    violations: int = 0
    violation_messages: list[str] = field(default_factory=list)
    rules: dict[str, int] = field(default_factory=dict)

    @property
    def faults_injected(self) -> int:
        return sum(self.faults.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "steps": self.steps,
            "saves": self.saves,
            "restores": self.restores,
            "committed": self.committed,
            "committed_nonempty": self.committed_nonempty,
            "truncated": self.truncated,
            "invalidated": self.invalidated,
            "cancelled": self.cancelled,
            "split_by_cancel": self.split_by_cancel,
            "reopens": self.reopens,
            "breaker_trips": self.breaker_trips,
            "corruptions": self.corruptions,
            "evictions": self.evictions,
            "faults_injected": self.faults_injected,
            "faults_by_kind": dict(sorted(self.faults.items())),
            "faults_fired_by_plans": self.plan_fired,
            "violations": self.violations,
            "violation_messages": sorted(set(self.violation_messages)),
            "steps_by_rule": dict(sorted(self.rules.items())),
        }


class RecordingFaultyTier(FaultyTier):
    """A FaultyTier that tells the machine which fault fired on which object."""

    def __init__(
        self,
        inner: Tier,
        plan: FaultPlan,
        *,
        rank: int,
        index: int,
        log: list[tuple[int, int, str, FaultKind]],
    ) -> None:
        super().__init__(inner, plan, rank=rank)
        self.index = index
        self.log = log

    def _faults(self, op: str, okey: ObjectKey) -> list[Fault]:
        fired = super()._faults(op, okey)
        for f in fired:
            self.log.append((self.rank, self.index, okey.object_id, f.kind))
        return fired

    @property
    def lost(self) -> set[str]:
        return self._lost


@dataclass
class _Rank:
    rank: int
    engine: RestoreEngine
    tiers: list[RecordingFaultyTier]


# (rank, tier index, prefix tokens up to the chunk's end, group)
_Obj = tuple[int, int, tuple[int, ...], str]


_CORRUPTIONS = ("header", "payload", "truncate", "foreign")
_HEADER_OFFSETS = (0, 7, 8, 10, 12, 27, 28, 59, 60, 76, 84, 92, 100, 107, 200, 4095)


def _needed_chunks(group: StateGroup, prefix_chunks: int, chunk_tokens: int) -> range:
    """Chunks of ``group`` a prefix of ``prefix_chunks`` chunks needs (from the token ranges)."""
    if group.window_tokens is None:
        return range(prefix_chunks)
    end = prefix_chunks * chunk_tokens
    first_token = max(0, end - group.window_tokens)
    return range(first_token // chunk_tokens, prefix_chunks)


class RestoreMachine(RuleBasedStateMachine):
    """Drives real engines (one per rank) through saves, damage, faults and restores.

    Class attributes configure a campaign; :meth:`configured` makes a configured subclass.
    """

    #: ranks (1: one engine; 2+: InProcessGroup, restores of all ranks run concurrently)
    world_size: ClassVar[int] = 1
    #: where the figures go
    stats: ClassVar[CampaignStats] = CampaignStats()
    #: longest token stream, in chunks
    max_chunks: ClassVar[int] = 4
    #: deadline of restores while a fault plan is active (bounds HANG faults)
    fault_deadline_s: ClassVar[float] = 0.3
    #: extra time a restore may take past its deadline before it counts as hung
    deadline_slack_s: ClassVar[float] = 5.0
    #: wall-clock bound of one step's engine calls
    step_timeout_s: ClassVar[float] = 60.0
    #: fault kinds plans are drawn from
    fault_kinds: ClassVar[tuple[FaultKind, ...]] = tuple(FaultKind)
    #: the engines' circuit breakers (a short cooldown lets campaigns see them close again)
    breaker_threshold: ClassVar[int | None] = 3
    breaker_cooldown_s: ClassVar[float] = 0.2

    def make_tiers(self, directory: Path, rank: int) -> Sequence[Tier]:
        """The unopened tiers of ``rank`` (fastest first); override or use :meth:`configured`."""
        return default_tier_factory(directory, rank)

    @classmethod
    def configured(
        cls,
        *,
        name: str | None = None,
        tier_factory: TierFactory | None = None,
        world_size: int | None = None,
        stats: CampaignStats | None = None,
        **attrs: Any,
    ) -> type[RestoreMachine]:
        """A subclass with the given settings (any class attribute may be passed in ``attrs``)."""
        body: dict[str, Any] = dict(attrs)
        if tier_factory is not None:
            factory = tier_factory

            def make_tiers(self: RestoreMachine, directory: Path, rank: int) -> Sequence[Tier]:
                return factory(directory, rank)

            body["make_tiers"] = make_tiers
        if world_size is not None:
            body["world_size"] = world_size
        body["stats"] = stats if stats is not None else CampaignStats()
        return type(name or cls.__name__, (cls,), body)

    # ------------------------------------------------------------------ setup
    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = start_blocking_portal()
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self.root = Path(tempfile.mkdtemp(prefix="bsr-machine-"))
        self.ranks: list[_Rank] = []
        self.case: LayoutCase | None = None
        self.window = 1
        self.io_depth = 1
        self.plan = FaultPlan()
        self.fault_log: list[tuple[int, int, str, FaultKind]] = []
        self.store: dict[_Obj, Status] = {}
        # copies the engine may ignore although the tier holds them: it retires a copy that
        # failed a read with an I/O error until the copy is saved again or the engine reopened
        self.blind: set[tuple[int, int, str]] = set()
        # (rank, tier index) whose circuit breaker was open at some point of the step
        self.unavailable: set[tuple[int, int]] = set()
        self.prompts: list[tuple[int, ...]] = []
        self._plans_used: dict[int, FaultPlan] = {}
        self._keys: dict[tuple[int, tuple[int, ...]], ChunkKey] = {}
        self._objs: dict[tuple[int, str], tuple[tuple[int, ...], str]] = {}
        self._content: dict[tuple[int, tuple[int, ...], str], torch.Tensor] = {}
        type(self).stats.examples += 1

    def teardown(self) -> None:
        stats = type(self).stats
        for plan in self._plans_used.values():  # what the plans themselves counted
            stats.plan_fired += plan.total_fired
        try:
            if self.ranks:
                with contextlib.suppress(Exception):
                    self._call(self._close_all)
        finally:
            self._portal_cm.__exit__(None, None, None)
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def layout(self) -> StateLayout:
        assert self.case is not None
        return self.case.layout

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def faults_active(self) -> bool:
        return bool(self.plan.faults)

    def _violation(self, message: str) -> InvariantViolation:
        stats = type(self).stats
        stats.violations += 1
        stats.violation_messages.append(message.split("\n", 1)[0][:200])
        return InvariantViolation(message)

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            raise self._violation(message)

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def guarded() -> T:
            with anyio.fail_after(self.step_timeout_s):
                return await fn(*args)

        try:
            return self.portal.call(guarded)
        except TimeoutError:
            raise self._violation(
                f"engine call {getattr(fn, '__name__', fn)} did not finish within "
                f"{self.step_timeout_s}s (a restore or save hung)"
            ) from None

    def _begin(self) -> None:
        stats = type(self).stats
        stats.steps += 1
        name = sys._getframe(1).f_code.co_name
        stats.rules[name] = stats.rules.get(name, 0) + 1
        self.fault_log.clear()

    # ------------------------------------------------------------------ engines
    def _open_all(self) -> None:
        group = InProcessGroup(self.world_size, timeout_s=10.0) if self.world_size > 1 else None
        ranks = []
        for r in range(self.world_size):
            inner = list(self.make_tiers(self.root / f"rank{r}", r))
            tiers = [
                RecordingFaultyTier(t, self.plan, rank=r, index=i, log=self.fault_log)
                for i, t in enumerate(inner)
            ]
            coordinator: Coordinator | None = group.coordinator(r) if group is not None else None
            engine = RestoreEngine(
                self.layout,
                tiers,
                window=self.window,
                io_depth=self.io_depth,
                namespace=Namespace("bsr-machine", tp_rank=r, tp_size=self.world_size),
                coordinator=coordinator,
                pin_staging=False,
                breaker_threshold=self.breaker_threshold,
                breaker_cooldown_s=self.breaker_cooldown_s,
            )
            ranks.append(_Rank(r, engine, tiers))
        self.ranks = ranks

        async def open_engines() -> None:
            for rk in ranks:
                await rk.engine.open()

        self._call(open_engines)

    async def _close_all(self) -> None:
        for rk in self.ranks:
            await rk.engine.aclose()

    def _set_plan(self, plan: FaultPlan) -> None:
        self._plans_used[id(plan)] = plan
        for rk in self.ranks:
            for t in rk.tiers:
                t.plan = plan

    @initialize(case=layouts(), window=st.integers(1, 4), data=st.data())
    def setup(self, case: LayoutCase, window: int, data: st.DataObject) -> None:
        self._begin()
        self.case = case
        self.window = window
        self.io_depth = data.draw(st.integers(1, window), label="io_depth")
        self._open_all()
        # start from some stored state, so that examples whose rule subset lacks save still hit
        streams = data.draw(
            token_streams(
                case.chunk_tokens, min_streams=0, max_streams=3, max_chunks=self.max_chunks
            ),
            label="initial_streams",
        )
        for i, tokens in enumerate(streams):
            self._save(tokens, list(range(self.world_size)), seed=i)

    # ------------------------------------------------------------------ model helpers
    def _key(self, rank: int, prefix: tuple[int, ...]) -> ChunkKey:
        k = (rank, prefix)
        if k not in self._keys:
            engine = self.ranks[rank].engine
            self._keys[k] = chunk_keys(engine.namespace_fp, list(prefix), self.chunk_tokens)[-1]
        return self._keys[k]

    def _oid(self, rank: int, prefix: tuple[int, ...], group: str) -> str:
        oid = ObjectKey(self._key(rank, prefix), group).object_id
        self._objs[(rank, oid)] = (prefix, group)
        return oid

    def content(self, rank: int, prefix: tuple[int, ...], group: str) -> torch.Tensor:
        """The source bytes of the last chunk of ``prefix`` in ``group`` on ``rank``.

        A pure function of the prefix (like real KV state), shaped ``[layers, chunk_tokens,
        token_bytes]``.
        """
        k = (rank, prefix, group)
        if k not in self._content:
            g = self.layout.group(group)
            h = hashlib.blake2b(digest_size=16, person=b"bsr-machine")
            h.update(f"{rank}|{group}|".encode())
            h.update(np.asarray(prefix, dtype="<i8").tobytes())
            rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
            shape = (g.num_layers, self.chunk_tokens, g.token_bytes)
            self._content[k] = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))
        return self._content[k]

    def _needed(self, prefix_chunks: int) -> list[tuple[int, str]]:
        return [
            (c, g.name)
            for g in self.layout.groups
            for c in _needed_chunks(g, prefix_chunks, self.chunk_tokens)
        ]

    def _holders(
        self, rank: int, prefix: tuple[int, ...], group: str
    ) -> list[tuple[int, Status, bool]]:
        """(tier, status, doubtful) of every copy; doubtful: the engine may not use it now."""
        out = []
        for ti in range(len(self.ranks[rank].tiers)):
            status = self.store.get((rank, ti, prefix, group))
            if status is not None:
                doubtful = (rank, ti) in self.unavailable or (
                    rank,
                    ti,
                    self._oid(rank, prefix, group),
                ) in self.blind
                out.append((ti, status, doubtful))
        return out

    def _visible_surely(self, rank: int, prefix: tuple[int, ...], group: str) -> bool:
        return any(s is not Status.BAD and not b for _, s, b in self._holders(rank, prefix, group))

    def _visible_maybe(self, rank: int, prefix: tuple[int, ...], group: str) -> bool:
        return bool(self._holders(rank, prefix, group))

    def _intact(self, rank: int, prefix: tuple[int, ...], group: str) -> bool:
        return any(s is Status.INTACT and not b for _, s, b in self._holders(rank, prefix, group))

    def _all_ranks(
        self, tokens: Sequence[int], p: int, have: Callable[[int, tuple[int, ...], str], bool]
    ) -> bool:
        ct = self.chunk_tokens
        return all(
            have(r, tuple(tokens[: (c + 1) * ct]), g)
            for r in range(self.world_size)
            for c, g in self._needed(p)
        )

    def _best(
        self, tokens: Sequence[int], have: Callable[[int, tuple[int, ...], str], bool]
    ) -> int:
        for p in range(len(tokens) // self.chunk_tokens, 0, -1):
            if self._all_ranks(tokens, p, have):
                return p
        return 0

    @contextlib.contextmanager
    def _as_of(self, store: dict[_Obj, Status], blind: set[tuple[int, int, str]]) -> Iterator[None]:
        """Evaluate the model as it was (before a step), with the step's breaker history."""
        now = self.store, self.blind
        self.store, self.blind = store, blind
        try:
            yield
        finally:
            self.store, self.blind = now

    def _breakers(self) -> list[tuple[int, int, bool, int]]:
        return [
            (rk.rank, ti, b.open, b.trips)
            for rk in self.ranks
            for ti, b in enumerate(rk.engine.statistics().breakers)
        ]

    def _note_breakers(self, before: list[tuple[int, int, bool, int]]) -> None:
        """Tiers whose breaker was open at the start or opened during the step: the engine may
        have skipped them (a documented policy), so the model expects nothing of them."""
        after = self._breakers()
        self.unavailable = {
            (r, ti)
            for (r, ti, was_open, trips), (_, _, is_open, trips_now) in zip(before, after)
            if was_open or is_open or trips_now != trips
        }
        stats = type(self).stats
        stats.breaker_trips += sum(b[3] for b in after) - sum(b[3] for b in before)

    # ------------------------------------------------------------------ model upkeep
    def _apply_faults(self) -> None:
        stats = type(self).stats
        for rank, ti, oid, kind in self.fault_log:
            stats.faults[kind.value] = stats.faults.get(kind.value, 0) + 1
            if kind is FaultKind.READ_ERROR:
                self.blind.add((rank, ti, oid))
            if kind not in (FaultKind.CORRUPT, FaultKind.TRUNCATE):
                continue
            where = self._objs.get((rank, oid))
            if where is None:
                continue
            obj = (rank, ti, where[0], where[1])
            if self.store.get(obj) is Status.INTACT:
                self.store[obj] = Status.BAD

    def _settle(self) -> None:
        """After engine calls: learn what the faults did, follow the tiers, start a new log."""
        self._apply_faults()
        self._reconcile()
        self.fault_log.clear()

    def _reconcile(self, *, reopened: bool = False) -> None:
        """Follow what the engine did to the tiers (quarantine), and check nothing else vanished."""
        touched = {(r, ti, oid) for r, ti, oid, _ in self.fault_log}
        for rk in self.ranks:
            for ti, tier in enumerate(rk.tiers):
                entries = [(o, s) for o, s in self.store.items() if o[0] == rk.rank and o[1] == ti]
                if not entries:
                    continue
                okeys = [ObjectKey(self._key(o[0], o[2]), o[3]) for o, _ in entries]
                present = self._call(tier.inner.contains_many, okeys)
                for (obj, status), okey, here in zip(entries, okeys, present):
                    oid = okey.object_id
                    if status is Status.LOST:
                        if oid in tier.lost:
                            continue
                        if here:
                            self.store[obj] = Status.INTACT
                        else:
                            del self.store[obj]
                        continue
                    if here:
                        continue
                    del self.store[obj]
                    self._check(
                        status is not Status.INTACT or (rk.rank, ti, oid) in touched,
                        f"an intact object vanished from tier {tier.name!r} (rank {rk.rank}, chunk "
                        f"{len(obj[2]) // self.chunk_tokens - 1}, group {obj[3]!r}) with no fault "
                        f"on it{' across a reopen' if reopened else ''}",
                    )

    # ------------------------------------------------------------------ caches
    def _source_cache(
        self, rank: int, tokens: Sequence[int], seed: int
    ) -> tuple[PagedKVCache, torch.Tensor]:
        assert self.case is not None
        bt, bpc, ct = self.case.block_tokens, self.case.blocks_per_chunk, self.chunk_tokens
        nblocks = -(-len(tokens) // bt)
        gen = torch.Generator().manual_seed(seed)
        cache = PagedKVCache(self.layout, max(1, nblocks + 2), bt)
        for g in self.layout.groups:
            t = cache.tensor(g.name)
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        ids = torch.randperm(cache.num_blocks, generator=gen)[:nblocks]
        for c in range(len(tokens) // ct):
            blocks = ids[c * bpc : (c + 1) * bpc]
            for g in self.layout.groups:
                data = self.content(rank, tuple(tokens[: (c + 1) * ct]), g.name)
                cache.tensor(g.name)[:, blocks] = data.view(g.num_layers, bpc, bt, g.token_bytes)
        return cache, ids

    def _dest_cache(
        self, tokens: Sequence[int], seed: int
    ) -> tuple[PagedKVCache, torch.Tensor, dict[str, torch.Tensor]]:
        assert self.case is not None
        bt = self.case.block_tokens
        nblocks = -(-len(tokens) // bt)
        gen = torch.Generator().manual_seed(seed)
        cache = PagedKVCache(self.layout, max(1, nblocks + 3), bt)
        before = {}
        for g in self.layout.groups:
            t = cache.tensor(g.name)
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            before[g.name] = t.clone()
        ids = torch.randperm(cache.num_blocks, generator=gen)[:nblocks]
        return cache, ids, before

    # ------------------------------------------------------------------ rules: data
    def _draw_tokens(self, data: st.DataObject, label: str = "tokens") -> list[int]:
        return data.draw(
            derived_tokens(self.chunk_tokens, self.prompts, max_chunks=self.max_chunks), label=label
        )

    # Rule order matters to Hypothesis: rules are sorted by argument count, then name, and the
    # first valid one is drawn most often. ``restore`` alone takes one argument, so it leads.
    @rule(data=st.data(), seed=st.integers(0, 2**31 - 1))
    def save(self, data: st.DataObject, seed: int) -> None:
        """Save a token stream on every rank (or, with several ranks, on some of them)."""
        self._begin()
        tokens = self._draw_tokens(data)
        ranks = list(range(self.world_size))
        if self.world_size > 1 and data.draw(st.integers(0, 3), label="asymmetric") == 0:
            ranks = [data.draw(st.sampled_from(ranks), label="only_rank")]
        self._save(tokens, ranks, seed)

    def _save(self, tokens: Sequence[int], ranks: list[int], seed: int) -> None:
        ct = self.chunk_tokens
        n = len(tokens) // ct
        sources = {r: self._source_cache(r, tokens, seed + r) for r in ranks}
        results: dict[int, Any] = {}

        async def go() -> None:
            async def one(r: int) -> None:
                cache, ids = sources[r]
                results[r] = await self.ranks[r].engine.save(tokens, cache, ids)

            async with anyio.create_task_group() as tg:
                for r in ranks:
                    tg.start_soon(one, r)

        faulty = self.faults_active
        self._call(go)
        type(self).stats.saves += 1
        log = self.fault_log
        lost = {(r, ti, oid) for r, ti, oid, k in log if k is FaultKind.LOST_WRITE}
        unprobed = {(r, ti) for r, ti, _, k in log if k is FaultKind.PROBE_ERROR}
        for r in ranks:
            if not faulty:
                self._check(
                    results[r].ok, f"save with no fault active reported errors {results[r].errors}"
                )
            for ti in range(len(self.ranks[r].tiers)):
                for c, g in self._needed(n):
                    prefix = tuple(tokens[: (c + 1) * ct])
                    obj = (r, ti, prefix, g)
                    oid = self._oid(r, prefix, g)
                    # written: a copy the tier lacks, or one the engine retired (replaced, when
                    # the save could ask the tier what it holds)
                    fresh = obj not in self.store
                    replaced = (r, ti, oid) in self.blind and (r, ti) not in unprobed
                    if fresh or replaced:
                        self.store[obj] = Status.LOST if (r, ti, oid) in lost else Status.INTACT
                        self.blind.discard((r, ti, oid))
        if n and tuple(tokens) not in self.prompts:
            self.prompts.append(tuple(tokens))
        self._settle()

    # Draws below never depend on the model's state: quarantine by concurrent restores makes
    # that state timing-dependent, and Hypothesis needs the same draws on every replay.
    @staticmethod
    def _pick(data: st.DataObject, items: Sequence[T], label: str) -> T | None:
        i = data.draw(st.integers(0, 2**16 - 1), label=label)
        return items[i % len(items)] if items else None

    @rule(data=st.data(), whole_prefix=st.booleans())
    def evict(self, data: st.DataObject, whole_prefix: bool) -> None:
        """Delete stored objects from a tier: one object, or every object of a prefix there."""
        self._begin()
        objs = list(self.store)
        victim = self._pick(data, objs, "victim")
        if victim is None:
            return
        chosen = [victim]
        if whole_prefix:
            chosen = [o for o in objs if o[:2] == victim[:2] and o[2] == victim[2][: len(o[2])]]

        async def go() -> None:
            for r, ti, prefix, g in chosen:
                await self.ranks[r].tiers[ti].delete(self._key(r, prefix), g)

        self._call(go)
        for o in chosen:
            del self.store[o]
        type(self).stats.evictions += len(chosen)
        self._reconcile()

    @rule(data=st.data(), mode=st.sampled_from(_CORRUPTIONS))
    def corrupt(self, data: st.DataObject, mode: str) -> None:
        """Damage one intact stored object for real: a header or payload bit flip, a truncation,
        or (file tiers) another object's file planted under its name."""
        self._begin()
        intact = [o for o, s in self.store.items() if s is Status.INTACT]
        obj = self._pick(data, intact, "object")
        # magic, version, flags, namespace, key, group, index, length, sums, header padding
        header_offset = data.draw(st.sampled_from(_HEADER_OFFSETS), label="header_offset")
        where = data.draw(st.integers(0, 2**20), label="payload_offset")
        cut = data.draw(st.integers(0, 5), label="truncate_to")
        donor_pick = data.draw(st.integers(0, 2**16 - 1), label="donor")
        if obj is None:
            return
        r, ti, prefix, g = obj
        tier = self.ranks[r].tiers[ti].inner
        key = self._key(r, prefix)
        plen = self.layout.group_chunk_bytes(g)
        done = False
        if mode == "foreign":
            donors = [
                o for o, s in self.store.items() if o[1] == ti and s is Status.INTACT and o != obj
            ]
            src = (
                self.ranks[donors[donor_pick % len(donors)][0]].tiers[ti].inner if donors else None
            )
            if isinstance(tier, FileTier) and isinstance(src, FileTier):
                d = donors[donor_pick % len(donors)]
                shutil.copyfile(
                    src.object_path(self._key(d[0], d[2]), d[3]), tier.object_path(key, g)
                )
                done = True
            else:
                mode = "payload"
        if mode == "header":
            done = corrupt_stored(tier, key, g, header_offset)
        elif mode == "payload":
            k = where % plen
            k = k + 1 if k == 17 and plen > 18 else k  # FaultKind.CORRUPT flips byte 17: keep apart
            done = corrupt_stored(tier, key, g, HEADER_SIZE + k)
        elif mode == "truncate":
            sizes = (
                0,
                1,
                HEADER_SIZE - 1,
                HEADER_SIZE,
                HEADER_SIZE + plen // 2,
                HEADER_SIZE + plen - 1,
            )
            done = truncate_stored(tier, key, g, sizes[cut % len(sizes)])
        if done:
            self.store[obj] = Status.BAD
            type(self).stats.corruptions += 1

    @rule(data=st.data(), active=st.booleans())
    def set_faults(self, data: st.DataObject, active: bool) -> None:
        """Activate a seeded fault plan (possibly limited to some ranks), or deactivate it."""
        self._begin()
        if not active or not self.fault_kinds:
            self.plan = FaultPlan()
            self._set_plan(self.plan)
            return
        self.plan = data.draw(self._plans(), label="plan")
        self._set_plan(self.plan)

    @rule(data=st.data(), restore_after=st.booleans())
    def reopen(self, data: st.DataObject, restore_after: bool) -> None:
        """Close every engine (and tier) and build new ones over the same directories; maybe
        restore right after."""
        self._begin()
        self._reopen()
        if restore_after:
            tokens = self._draw_tokens(data)
            policy = data.draw(st.sampled_from(tuple(Policy)), label="policy")
            self._restores([(tokens, policy, 0)])

    def _reopen(self) -> None:
        self._call(self._close_all)
        for rk in self.ranks:
            for ti, t in enumerate(rk.tiers):
                self._check(t.inner.closed, f"engine.aclose() left tier {t.name!r} open")
                if not t.durable:  # a volatile tier starts empty
                    for o in [o for o in self.store if o[0] == rk.rank and o[1] == ti]:
                        del self.store[o]
        self.blind.clear()
        self._open_all()
        type(self).stats.reopens += 1
        self._reconcile(reopened=True)

    # ------------------------------------------------------------------ rules: restore
    @rule(data=st.data(), then_restore=st.booleans())
    def lookup(self, data: st.DataObject, then_restore: bool) -> None:
        """Probe on every rank: the agreed prefix is what the model expects and no data moves;
        a restore right after probes the same prefix."""
        self._begin()
        tokens = self._draw_tokens(data)
        reads_before = [[t.statistics().bytes_read for t in rk.tiers] for rk in self.ranks]
        probes: dict[int, Any] = {}

        async def go() -> None:
            async def one(rk: _Rank) -> None:
                probes[rk.rank] = await rk.engine.lookup(tokens)

            async with anyio.create_task_group() as tg:
                for rk in self.ranks:
                    tg.start_soon(one, rk)

        faulty = self.faults_active
        snapshot, breakers = (dict(self.store), set(self.blind)), self._breakers()
        self._call(go)
        self._note_breakers(breakers)
        with self._as_of(*snapshot):
            lo = self._best(tokens, self._visible_surely)
            hi = self._best(tokens, self._visible_maybe)
        agreed = {p.prefix_chunks for p in probes.values()}
        self._check(len(agreed) == 1, f"ranks agreed on different prefixes {agreed}")
        reads_after = [[t.statistics().bytes_read for t in rk.tiers] for rk in self.ranks]
        self._check(reads_before == reads_after, "lookup read payload bytes")
        if not faulty:
            p = agreed.pop()
            self._check(
                lo <= p <= hi,
                f"lookup found {p} chunks; the model says between {lo} and {hi} are stored",
            )
        self._settle()
        if then_restore:
            policy = data.draw(st.sampled_from(tuple(Policy)), label="policy")
            steady = not self.faults_active and not self.unavailable
            (res,) = self._restores([(tokens, policy, 1)])
            self._check(
                not steady
                or bool(self.unavailable)
                or res.probed_tokens == probes[0].prefix_tokens,
                f"lookup found {probes[0].prefix_tokens} tokens, the restore right after probed "
                f"{res.probed_tokens}",
            )

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """Restore a token stream on every rank (concurrently), with either policy."""
        self._begin()
        tokens = self._draw_tokens(data)
        policy = data.draw(st.sampled_from(tuple(Policy)), label="policy")
        seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
        with self._scoped_faults(data):
            self._restores([(tokens, policy, seed)])

    @contextlib.contextmanager
    def _scoped_faults(self, data: st.DataObject) -> Iterator[None]:
        """Maybe run the step under a fault plan of its own (then the previous plan again)."""
        if not self.fault_kinds or not data.draw(st.booleans(), label="inject_faults"):
            yield
            return
        previous = self.plan
        self.plan = data.draw(self._plans(), label="plan")
        self._set_plan(self.plan)
        try:
            yield
        finally:
            self.plan = previous
            self._set_plan(previous)

    def _plans(self) -> st.SearchStrategy[FaultPlan]:
        return fault_plans(
            self.layout.group_names,
            world_size=self.world_size,
            kinds=self.fault_kinds,
            max_chunks=self.max_chunks,
        )

    @precondition(lambda self: self.world_size == 1)
    @rule(data=st.data(), n=st.integers(2, 4))
    def restore_concurrently(self, data: st.DataObject, n: int) -> None:
        """Several restores at once sharing the engine's W slots."""
        self._begin()
        jobs = []
        for i in range(n):
            tokens = self._draw_tokens(data, f"tokens{i}")
            policy = data.draw(st.sampled_from(tuple(Policy)), label=f"policy{i}")
            jobs.append((tokens, policy, data.draw(st.integers(0, 2**31 - 1), label=f"seed{i}")))
        with self._scoped_faults(data):
            self._restores(jobs)

    def _restores(self, jobs: list[tuple[list[int], Policy, int]]) -> list[RestoreResult]:
        """Run ``jobs`` (tokens, policy, seed) at once on every rank; check; rank 0's results."""
        faulty = self.faults_active
        deadline = self.fault_deadline_s if faulty else None
        # expectations come from the model as it was before the restores
        snapshot, breakers = (dict(self.store), set(self.blind)), self._breakers()
        dests = {
            (j, r): self._dest_cache(tokens, seed + 7919 * r)
            for j, (tokens, _, seed) in enumerate(jobs)
            for r in range(self.world_size)
        }
        results: dict[tuple[int, int], RestoreResult | BaseException] = {}
        elapsed: dict[tuple[int, int], float] = {}

        async def go() -> None:
            async def one(j: int, r: int) -> None:
                tokens, policy, _ = jobs[j]
                cache, ids, _ = dests[(j, r)]
                t0 = time.perf_counter()
                try:
                    results[(j, r)] = await self.ranks[r].engine.restore(
                        tokens, cache, ids, policy=policy, deadline_s=deadline
                    )
                except Exception as exc:
                    results[(j, r)] = exc
                elapsed[(j, r)] = time.perf_counter() - t0

            async with anyio.create_task_group() as tg:
                for j in range(len(jobs)):
                    for r in range(self.world_size):
                        tg.start_soon(one, j, r)

        self._call(go)
        self._note_breakers(breakers)
        with self._as_of(*snapshot):
            expect = [
                (self._best(tokens, self._visible_surely), self._best(tokens, self._visible_maybe))
                for tokens, _, _ in jobs
            ]
            intact_snapshot = {
                (j, p): self._all_ranks(tokens, p, self._intact)
                for j, (tokens, _, _) in enumerate(jobs)
                for p in range(len(tokens) // self.chunk_tokens + 1)
            }
        first: list[RestoreResult] = []
        for j, (tokens, policy, _) in enumerate(jobs):
            per_rank = []
            for r in range(self.world_size):
                res = results[(j, r)]
                if isinstance(res, BaseException):
                    raise self._violation(
                        f"restore raised {type(res).__name__}: {res!r} instead of ending "
                        "Committed or Invalidated"
                    ) from res
                limit = (deadline or 0.0) + self.deadline_slack_s
                self._check(
                    deadline is None or elapsed[(j, r)] <= limit,
                    f"restore took {elapsed[(j, r)]:.2f}s past its deadline of {deadline}s",
                )
                cache, ids, before = dests[(j, r)]
                self._check_result(r, tokens, policy, res, cache, ids, before)
                per_rank.append(res)
            self._check_agreement(per_rank)
            res0 = per_rank[0]
            p = res0.probed_tokens // self.chunk_tokens
            if not faulty:
                lo, hi = expect[j]
                self._check(
                    lo <= p <= hi,
                    f"restore probed {p} chunks; the model says between {lo} and {hi} are stored",
                )
                if intact_snapshot[(j, p)]:
                    self._check(
                        all(x.state is RequestState.COMMITTED for x in per_rank)
                        and all(x.committed_tokens == res0.probed_tokens for x in per_rank),
                        f"every object of the probed {p}-chunk prefix is intact in some tier and "
                        f"no fault is active, yet the restore ended {res0.state} with "
                        f"{res0.committed_tokens} tokens ({res0.reason}; {list(res0.errors)[:3]})",
                    )
                    want = sum(self.layout.group_chunk_bytes(g) for _, g in self._needed(p))
                    self._check(
                        all(x.bytes_read == want for x in per_rank),
                        f"a clean restore read {res0.bytes_read} bytes, the prefix holds {want}",
                    )
            first.append(res0)
        self._settle()
        return first

    def _check_agreement(self, per_rank: list[RestoreResult]) -> None:
        states = {(x.state, x.committed_tokens, x.probed_tokens) for x in per_rank}
        self._check(
            len(states) == 1,
            f"ranks ended differently: {[(str(x.state), x.committed_tokens) for x in per_rank]}",
        )

    def _check_result(
        self,
        rank: int,
        tokens: Sequence[int],
        policy: Policy,
        res: RestoreResult,
        cache: PagedKVCache,
        ids: torch.Tensor,
        before: dict[str, torch.Tensor],
    ) -> None:
        assert self.case is not None
        stats = type(self).stats
        stats.restores += 1
        ct, bpc, bt = self.chunk_tokens, self.case.blocks_per_chunk, self.case.block_tokens
        n = len(tokens) // ct
        self._check(res.state.terminal, f"restore returned in non-terminal state {res.state}")
        if res.state is RequestState.COMMITTED:
            stats.committed += 1
            stats.committed_nonempty += res.committed_tokens > 0
            stats.truncated += 0 < res.committed_tokens < res.probed_tokens
        else:
            stats.invalidated += 1
        committed, probed = res.committed_tokens, res.probed_tokens
        self._check(
            committed % ct == 0 and probed % ct == 0 and 0 <= committed <= probed <= n * ct,
            f"committed {committed} / probed {probed} tokens are not chunk-aligned within {n * ct}",
        )
        if res.state is RequestState.INVALIDATED:
            self._check(committed == 0, f"Invalidated yet committed {committed} tokens")
        if policy is Policy.ALL_OR_NOTHING:
            self._check(
                committed in (0, probed),
                f"all_or_nothing committed {committed} of {probed} probed tokens",
            )
        self._check(
            res.rws_peak_bytes <= self.window * self.layout.slot_bytes,
            f"restore RWS {res.rws_peak_bytes} > W x slot_bytes",
        )
        p = committed // ct
        # every committed block holds exactly the saved bytes
        for g in self.layout.groups:
            got = cache.tensor(g.name)
            for c in _needed_chunks(g, p, ct):
                blocks = ids[c * bpc : (c + 1) * bpc]
                want = self.content(rank, tuple(tokens[: (c + 1) * ct]), g.name)
                self._check(
                    torch.equal(got[:, blocks], want.view(g.num_layers, bpc, bt, g.token_bytes)),
                    f"committed chunk {c} of group {g.name!r} on rank {rank} differs from the "
                    f"saved bytes ({res.state}, {committed} tokens)",
                )
        # blocks the restore wrote outside the committed prefix are reported invalid
        committed_blocks = {int(b) for b in ids[: p * bpc].tolist()}
        invalid = set(res.invalid_block_ids)
        request_blocks = {int(b) for b in ids[: n * bpc].tolist()}
        self._check(
            invalid <= request_blocks,
            f"invalid_block_ids {sorted(invalid - request_blocks)} are not the request's blocks",
        )
        self._check(
            not (invalid & committed_blocks),
            "invalid_block_ids include blocks of the committed prefix",
        )
        changed: set[int] = set()
        for g in self.layout.groups:
            diff = (cache.tensor(g.name) != before[g.name]).flatten(2).any(dim=2).any(dim=0)
            changed.update(int(b) for b in torch.nonzero(diff).flatten().tolist())
        unreported = changed - committed_blocks - invalid
        self._check(
            not unreported,
            f"restore wrote blocks {sorted(unreported)} that are neither committed nor reported "
            f"in invalid_block_ids ({res.state}, {committed} tokens)",
        )

    @rule(data=st.data(), after=st.sampled_from((0.0, 0.001, 0.005, 0.02, 0.05)))
    def restore_then_cancel(self, data: st.DataObject, after: float) -> None:
        """Cancel restores midway (every read is slowed down meanwhile)."""
        self._begin()
        tokens = self._draw_tokens(data)
        policy = data.draw(st.sampled_from(tuple(Policy)), label="policy")
        seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
        slow = FaultPlan(
            seed=self.plan.seed,
            faults=(*self.plan.faults, Fault(FaultKind.DELAY, delay_s=0.01)),
            ranks=self.plan.ranks,
        )
        deadline = self.fault_deadline_s if self.faults_active else None
        self._set_plan(slow)
        dests = {r: self._dest_cache(tokens, seed + r) for r in range(self.world_size)}
        results: dict[int, RestoreResult | BaseException] = {}
        counts = [self._counts(rk) for rk in self.ranks]

        async def go() -> bool:
            async def one(r: int) -> None:
                cache, ids, _ = dests[r]
                try:
                    results[r] = await self.ranks[r].engine.restore(
                        tokens, cache, ids, policy=policy, deadline_s=deadline
                    )
                except Exception as exc:
                    results[r] = exc

            with anyio.move_on_after(after) as scope:
                async with anyio.create_task_group() as tg:
                    for r in range(self.world_size):
                        tg.start_soon(one, r)
            return scope.cancelled_caught

        try:
            cancelled = self._call(go)
        finally:
            self._set_plan(self.plan)
        stats = type(self).stats
        if cancelled:
            stats.cancelled += 1
        for r, res in results.items():
            if isinstance(res, BaseException):
                raise self._violation(f"restore raised {res!r} instead of ending") from res
            cache, ids, before = dests[r]
            self._check_result(r, tokens, policy, res, cache, ids, before)
        for rk, (restores, _, _) in zip(self.ranks, counts):
            now = self._counts(rk)
            self._check(
                now[0] == restores + 1 and now[0] == now[1] + now[2],
                f"after cancellation rank {rk.rank} counts {now} (restores, committed, "
                "invalidated): a cancelled restore did not terminate",
            )
        done = [r for r in results.values() if isinstance(r, RestoreResult)]
        if not cancelled and len(done) == self.world_size:
            self._check_agreement(done)
        elif cancelled and any(r.committed_tokens for r in done) and len(done) < self.world_size:
            # a rank cancelled after its vote: the others may commit (the caller cancelled the
            # request on that rank, so it is not reused there); counted, not a violation
            stats.split_by_cancel += 1
        self._settle()
        if cancelled and self.world_size > 1:
            # a collective cancelled on one rank leaves the group's rounds out of step, as with
            # a real process group: start a new group (and engines)
            self._reopen()

    @staticmethod
    def _counts(rk: _Rank) -> tuple[int, int, int]:
        s = rk.engine.statistics()
        return s.restores, s.committed, s.invalidated

    # ------------------------------------------------------------------ invariants
    @invariant()
    def staging_bounded_and_idle(self) -> None:
        for rk in self.ranks:
            s = rk.engine.statistics()
            st_ = s.staging
            self._check(
                st_.peak_in_use <= self.window,
                f"rank {rk.rank}: staging peak {st_.peak_in_use} slots > W={self.window}",
            )
            self._check(
                st_.in_use == 0 and st_.waiting == 0 and st_.acquired == st_.released,
                f"rank {rk.rank}: idle engine holds {st_.in_use} slots ({st_.waiting} waiting, "
                f"{st_.acquired} acquired, {st_.released} released)",
            )
            self._check(
                s.restores == s.committed + s.invalidated,
                f"rank {rk.rank}: {s.restores} restores but {s.committed} committed + "
                f"{s.invalidated} invalidated (a restore did not terminate)",
            )


class MultiRankRestoreMachine(RestoreMachine):
    """The same machine with two in-process tensor-parallel ranks and rank-asymmetric faults."""

    world_size: ClassVar[int] = 2


__all__ = (
    "CampaignStats",
    "InvariantViolation",
    "MultiRankRestoreMachine",
    "RecordingFaultyTier",
    "RestoreMachine",
    "Status",
    "TierFactory",
    "default_tier_factory",
)
