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

The machine is built in layers, one module each: ``_campaign`` (figures, violations),
``_cluster`` (engines, tiers, the portal), ``_model`` (the model), ``_checks`` (restores and
the invariants on their results) and this module (the rules).

Example::

    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    from bsr.testing import RestoreMachine

    Machine = RestoreMachine.configured(tier_factory=lambda d, rank: [MyTier(d / "store")])
    run_state_machine_as_test(Machine, settings=settings(max_examples=100, deadline=None))
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio
from anyio.from_thread import start_blocking_portal
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..core._object import HEADER_SIZE
from ..core._results import Policy, RestoreResult
from ..tiers._base import Tier
from ..tiers.file import FileTier
from ._campaign import CampaignStats, InvariantViolation
from ._checks import Restores
from ._cluster import RecordingFaultyTier, TierFactory, _Rank, default_tier_factory
from ._faults import Fault, FaultKind, FaultPlan, corrupt_stored, truncate_stored
from ._model import Status
from ._strategies import LayoutCase, derived_tokens, fault_plans, layouts, token_streams

T = TypeVar("T")

_CORRUPTIONS = ("header", "payload", "truncate", "foreign")
_HEADER_OFFSETS = (0, 7, 8, 10, 12, 27, 28, 59, 60, 76, 84, 92, 100, 107, 200, 4095)


class RestoreMachine(Restores, RuleBasedStateMachine):
    """Drives real engines (one per rank) through saves, damage, faults and restores.

    Class attributes configure a campaign (here and in its bases: ``world_size``, ``stats``,
    ``step_timeout_s``, ``breaker_threshold``, ``breaker_cooldown_s``, ``fault_deadline_s``,
    ``deadline_slack_s``); :meth:`configured` makes a configured subclass.
    """

    #: longest token stream, in chunks
    max_chunks: ClassVar[int] = 4
    #: fault kinds plans are drawn from
    fault_kinds: ClassVar[tuple[FaultKind, ...]] = tuple(FaultKind)

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
        self.portal = self._portal_cm.__enter__()
        self.root = Path(tempfile.mkdtemp(prefix="bsr-machine-"))
        self.ranks = []
        self.case = None
        self.window = 1
        self.io_depth = 1
        self.plan = FaultPlan()
        self.fault_log = []
        self.store = {}
        # copies the engine may ignore although the tier holds them: it retires a copy that
        # failed a read with an I/O error (for one breaker cooldown: it may read it again after,
        # so such a copy is maybe visible) and a save writes it again, until the engine reopens
        self.blind = set()
        # (rank, tier index) whose circuit breaker was open at some point of the step
        self.unavailable = set()
        self.prompts = []
        self._plans_used = {}
        self._keys = {}
        self._objs = {}
        self._content = {}
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

    # ------------------------------------------------------------------ engines

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

    # ------------------------------------------------------------------ model upkeep

    # ------------------------------------------------------------------ caches

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
