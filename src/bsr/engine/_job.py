"""One restore as a job: its phases, each handing the next what it found.

Where it runs: the serving process's event loop; one :class:`RestoreJob` per
:meth:`RestoreEngine.restore <bsr.RestoreEngine.restore>` call, which opens the request (no I/O),
runs the job, and in its ``finally`` lets the job give back what it holds.

How it works: a restore is a sequence of named phases, each a method below returning a value::

    probe   (Probing)     -> Probed     keys + metadata-only tier queries under the deadline, then
                                        agreement (and, under policy "cost", the load decision)
    open                  -> Window     the core's plan of the agreed prefix, handed to the
                                        transfer side's run; its read gate and its slots
    window  (Windowing)   -> Streamed   the transfer pipeline streams the planned chunks through
                                        the W slots; whether the deadline fired
    settle                              device copies landed (else this rank votes no); corrupt
                                        objects moved out of their tiers (bounded)
    agree   (Installed)   -> Commit     the local Vote -> MIN/AND across ranks -> commit or
                                        invalidate; the committed chunks
    release  (finally)                  every slot still held goes back (or is parked), leases
                                        are released

The lifecycle (:class:`~bsr.core._lifecycle.RequestLifecycle`, the request's one piece of shared
state besides its deadline and phase timings) is fired by the phases; its guards read the facts
the phases record (the run's live installed set among them). The decision side lives here and in
:mod:`bsr.engine._decisions`: the transfer side reports an outcome per read attempt and the job's
gate decides quarantine and tier health. The commit rule is the pure functions of
:mod:`bsr.core._commit`; the lifecycle's guards check the same facts again, computed from the
run. Nothing is committed until every needed (chunk, group) is installed on this rank and every
rank votes yes (invariants 1 and 2).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import anyio

from .._errors import ConfigError, CoordinatorError
from ..core._commit import (
    choose_trigger,
    commit_reason,
    installed_usable,
    invalidation_reason,
    local_vote,
)
from ..core._layout import StateLayout
from ..core._lifecycle import Reason, RequestState
from ..core._options import Policy, Strategy
from ..core._plan import plan_restore
from ..core._results import LoadDecision, Probe, RestoreResult, Timings
from ..transfer._pipeline import WindowPipeline
from ..transfer._run import ChunkFailure, RestoreRun
from ..transfer._staging import SlotSource, StagingPool, WholePlanBuffer
from ._coordinator import Coordinator, agree_on_time, agree_prefix
from ._cost import CostModel
from ._decisions import Quarantine, RestoreGate, TierQuarantine
from ._health import TierHealth
from ._probe import ProbeOutcome, Prober, digest
from ._request import RestoreRequest

#: after a deadline or cancellation, how long a restore waits for its worker threads to return
#: before it abandons them (their slots stay parked until they do)
ABANDON_GRACE_S = 0.25


@dataclass(frozen=True)
class RestoreParts:
    """What a restore job uses of its engine: one per engine, shared by its jobs.

    Attributes:
        layout: the state layout.
        prober: probing (its prefix agreed across ranks by the coordinator).
        coordinator: cross-rank agreement.
        health: the tiers' circuit breakers.
        quarantine: objects the engine no longer uses.
        cost: measured rates (policy "cost" decides from them).
        pipeline: the transfer side (one per engine: its CUDA side stream is made once).
        staging: the open engine's W-slot pool (else :class:`~bsr.ClosedError`).
        move_out: ``move_out(moves, budget_s, log)``: ask the tiers to quarantine objects within
            the budget, deferring what is left.
        shield_timeout_s: the bound on the calls bsr makes for its own sake.
        pin_staging: a whole-plan buffer is pinned (when CUDA is available).
        staging_budget_bytes: the most host staging one whole-plan restore may take (None: any).
        probe_share: the share of the time left its probe may wait for the tiers' answers.
    """

    layout: StateLayout
    prober: Prober
    coordinator: Coordinator
    health: TierHealth
    quarantine: Quarantine
    cost: CostModel
    pipeline: WindowPipeline
    staging: Callable[[], StagingPool]
    move_out: Callable[[list[TierQuarantine], float, Any], Awaitable[None]]
    shield_timeout_s: float
    pin_staging: bool
    staging_budget_bytes: int | None
    probe_share: float


@dataclass(frozen=True)
class Probed:
    """What probing found.

    Attributes:
        probe: the agreed probe (its prefix cut to what is worth loading under policy "cost");
            None when the agreement failed before there was one.
        decision: what policy "cost" decided (None under the other policies).
    """

    probe: Probe | None = None
    decision: LoadDecision | None = None


@dataclass(frozen=True)
class Window:
    """What the window runs on.

    Attributes:
        probe: the agreed probe: the holders the ladder walks.
        run: the transfer record of the plan (handed in made), which the commit rule reads.
        gate: the run's read gate (quarantine and tier health decisions).
        slots: where the run's slots come from; None when it failed before taking any (a prefix
            the block tables cannot serve, or a whole plan over the staging budget).
    """

    probe: Probe
    run: RestoreRun
    gate: RestoreGate
    slots: SlotSource | None = None


@dataclass(frozen=True)
class Streamed:
    """How the window ended: ``timed_out``: the deadline fired (even if the window ended another
    way while shielded), so this rank votes 0 whatever landed."""

    timed_out: bool = False


@dataclass(frozen=True)
class Vote:
    """This rank's vote: the longest prefix, in chunks, it can vouch for after its window
    (:func:`~bsr.core._commit.local_vote`), and whether its deadline fired."""

    chunks: int
    timed_out: bool


@dataclass(frozen=True)
class Commit:
    """What the agreement committed: ``chunks`` valid in the cache (0 unless Committed)."""

    chunks: int = 0


@dataclass(frozen=True)
class Restored:
    """What a job's phases returned, from which its result is made (after the release)."""

    probed: Probed
    window: Window | None = None
    commit: Commit = Commit()


class RestoreJob:
    """One restore: its phases (see the module docstring) and what it holds until released.

    Args:
        parts: what it uses of its engine.
        req: the admitted request (arguments, lifecycle, deadline, timings).
        given: a lookup's probe to reuse (its leases are released with the job), or None.
    """

    def __init__(self, parts: RestoreParts, req: RestoreRequest, given: Probe | None) -> None:
        self.parts = parts
        self.req = req
        self.given = given
        #: the window opened, held until :meth:`release` (also when a phase raised)
        self._held: Window | None = None

    async def run(self) -> Restored:
        """The phases, each taking what the one before returned."""
        probed = await self._probe_phase()
        if self.req.life.state is not RequestState.WINDOWING:
            return Restored(probed)
        window = self._held = self._open_window(probed)
        streamed = await self._window_phase(window)
        await self._settle_phase(window)
        commit = await self._agree_phase(window, streamed)
        return Restored(probed, window, commit)

    # ------------------------------------------------------------------ probe
    async def _probe_phase(self) -> Probed:
        """Probing: find (or reuse) the agreed prefix, then Windowing or a terminal state."""
        req, life, given = self.req, self.req.life, self.given
        t = time.perf_counter()
        try:
            if given is None:
                out = await self.parts.prober.probe(
                    req.tokens, deadline_s=req.remaining(), extras=req.extras,
                    share=self.parts.probe_share, skip=req.skip_tiers,
                )  # fmt: skip
            else:
                out = await self._reuse_probe(given)
        except CoordinatorError:
            life.invalidate(Reason.COORDINATOR_FAILED)
            return Probed()
        finally:
            req.timed("probe", t)
        probe = out.probe
        life.facts.prefix_chunks = probe.prefix_chunks
        if out.late:  # every rank knows: none commits while another ran out of time
            life.invalidate(Reason.DEADLINE if out.timed_out else Reason.RANK_FAILED)
            return Probed(probe)
        if probe.prefix_chunks == 0:
            life.fire("probe_miss", Reason.EMPTY_PREFIX)
            return Probed(probe)
        if not req.cost:
            life.fire("probe_hit")
            return Probed(probe)
        try:
            decided = await self._decide(probe)
        except CoordinatorError:
            life.invalidate(Reason.COORDINATOR_FAILED)
            return Probed(probe)
        assert decided.probe is not None
        if decided.probe.prefix_chunks > 0:
            life.fire("probe_hit")
        else:
            life.fire("probe_miss", Reason.RECOMPUTE)
        return decided

    async def _decide(self, probe: Probe) -> Probed:
        """Policy "cost": cut the agreed prefix to what is worth loading (agreed across ranks:
        the shortest)."""
        req, layout, coordinator = self.req, self.parts.layout, self.parts.coordinator
        decision = self.given.decision if self.given is not None else None
        if decision is None or decision.probed_chunks != probe.prefix_chunks:
            start = req.first_block * req.cache.block_tokens
            decision = self.parts.cost.decide(layout, probe, start_tokens=start)
        k = decision.load_chunks
        if coordinator.world_size > 1:  # every rank with a hit runs this collective
            # a rank's probe (the whole prefix, to measure again) holds for every rank: its -1
            # is the least; else the least any rank would load
            agreed = await coordinator.agree_min(-1 if decision.choice == "probe" else k)
            k = probe.prefix_chunks if agreed < 0 else agreed
            if agreed < 0 and decision.choice != "probe":
                decision = replace(decision, choice="probe")
        if k != decision.load_chunks:
            decision = replace(decision, load_chunks=k)
        req.life.facts.prefix_chunks = k
        req.log.info("bsr.restore.decided", **decision.to_dict())
        return Probed(replace(probe, prefix_chunks=k), decision)

    async def _reuse_probe(self, probe: Probe) -> ProbeOutcome:
        """Check a lookup's probe against the tokens; every rank then agrees it was in time."""
        req, prober = self.req, self.parts.prober
        with anyio.move_on_after(req.remaining()) as scope:
            keyed = await prober.keyed(req.tokens, req.extras)
        if not scope.cancelled_caught and (
            probe.chunk_tokens != self.parts.layout.chunk_tokens
            or probe.digest != digest(prober.namespace_fp, keyed)
        ):
            raise ConfigError(
                "probe was made for other tokens, other extras or by an engine of another "
                "namespace; pass the Probe that lookup() returned for these tokens and extras "
                "(or no probe)"
            )
        timed_out = scope.cancelled_caught
        in_time = await agree_on_time(self.parts.coordinator, timed_out)
        if not in_time:
            return ProbeOutcome(replace(probe, prefix_chunks=0), timed_out, not timed_out)
        return ProbeOutcome(probe)

    # ------------------------------------------------------------------ window
    def _open_window(self, probed: Probed) -> Window:
        """The plan of the agreed prefix, its run, gate and slots (no I/O); a run that cannot
        go ahead is failed here, before it takes a slot."""
        req, life, parts = self.req, self.req.life, self.parts
        probe = probed.probe
        assert probe is not None
        plan = plan_restore(
            parts.layout, probe.prefix_chunks, valid_chunks=req.valid_chunks,
            first_block=req.first_block,
        )  # fmt: skip
        run = RestoreRun(plan, req.policy)
        life.facts.target_chunks = run.target
        life.facts.installed = run.installed  # the live record the guards evaluate
        life.facts.serves = req.serves if req.tables.has_placeholders else None
        gate = RestoreGate(run, parts.health, parts.quarantine, req.log)
        if req.policy is Policy.ALL_OR_NOTHING and not req.serves(run.target):
            # a shorter prefix than the tables were made for, whose window lies in blocks the
            # tables do not hold: nothing can commit, so nothing is read
            group, block = req.tables.unserved(run.target, req.first_block) or ("", 0)
            why = f"block table of group {group!r} has no block at index {block}"
            run.fail(ChunkFailure(block // req.tables.bpc, group, Reason.INSTALL_FAILED, [why]))
            return Window(probe, run, gate)
        if req.strategy is Strategy.BOUNDED:
            return Window(probe, run, gate, parts.staging().account())
        slot_bytes = parts.layout.slot_bytes
        need = len(run.needed.keys() - run.skipped) * slot_bytes
        budget = parts.staging_budget_bytes
        if budget is not None and need > budget:
            why = f"plan needs {need} bytes of staging, budget {budget}"
            run.fail(ChunkFailure(0, parts.layout.groups[0].name, Reason.STAGING_BUDGET, [why]))
            return Window(probe, run, gate)
        slots = WholePlanBuffer(need // slot_bytes, slot_bytes, parts.pin_staging)
        return Window(probe, run, gate, slots)

    async def _window_phase(self, window: Window) -> Streamed:
        """Windowing: stream the planned chunks into the cache through the slots."""
        req = self.req
        if window.slots is None:
            return Streamed()  # the run failed before it took a slot: nothing to stream
        t = time.perf_counter()
        with anyio.move_on_after(req.remaining()) as scope:
            await self.parts.pipeline.run(
                window.run, window.slots, window.probe, req.cache, req.tables, req.strategy,
                window.gate, req.on_installed,
            )  # fmt: skip
        req.timed("window", t)
        # the deadline fired, even if the window ended another way while shielded
        return Streamed(timed_out=scope.cancel_called)

    # ------------------------------------------------------------------ settle
    async def _settle_phase(self, window: Window) -> None:
        """Device copies landed (else this rank votes no: its installed set is emptied);
        corrupt objects leave their tiers."""
        run, req = window.run, self.req
        t = time.perf_counter()
        # a failure here is a "no" vote, never a skipped collective (the other ranks wait for it)
        with anyio.move_on_after(self.parts.shield_timeout_s) as scope:
            try:
                await self.parts.pipeline.synchronize()
            except Exception as exc:
                run.errors.append(f"synchronize: {exc!r}")
                run.installed.clear()
        if scope.cancelled_caught:
            run.errors.append("synchronize: device copies did not finish in time")
            run.installed.clear()
        await self._quarantine_in_tiers(window.gate)
        req.timed("settle", t)

    async def _quarantine_in_tiers(self, gate: RestoreGate) -> None:
        """Move the corrupt objects this restore found out of their tiers, bounded.

        Not shielded: the engine's own quarantine already keeps these objects out of every
        probe and read, so a caller's cancel (or its deadline) ends the request at once; what
        was cut short is retried when the engine closes (see :class:`Quarantine`).
        """
        pending = gate.take_pending()
        if pending:
            budget = min(self.req.remaining(), self.parts.shield_timeout_s)
            await self.parts.move_out(pending, budget, self.req.log)

    # ------------------------------------------------------------------ agree
    def _vote(self, run: RestoreRun, streamed: Streamed) -> Vote:
        """The longest prefix this rank can vouch for (the commit rule's local vote)."""
        chunks = local_vote(
            self.parts.layout, self.req.policy, target=run.target, limit=run.limit,
            installed=run.installed, timed_out=streamed.timed_out,
            serves=self.req.life.facts.serves,
        )  # fmt: skip
        return Vote(chunks, streamed.timed_out)

    async def _agree_phase(self, window: Window, streamed: Streamed) -> Commit:
        """Installed -> Committed, or Invalidated: the commit rule, agreed across ranks."""
        req, life, run, layout = self.req, self.req.life, window.run, self.parts.layout
        t = time.perf_counter()
        vote = self._vote(run, streamed)
        serves = life.facts.serves
        try:
            agreed = await agree_prefix(
                self.parts.coordinator,
                vote.chunks,
                lambda p: installed_usable(layout, p, run.installed, serves),
            )
            life.facts.agreed_chunks = agreed
            trigger = choose_trigger(
                layout, req.policy, target=run.target, agreed=agreed, installed=run.installed,
                serves=serves,
            )  # fmt: skip
            if trigger is not None:
                life.fire(trigger)
            yes = await self.parts.coordinator.agree_all(life.state is RequestState.INSTALLED)
        except CoordinatorError as exc:
            run.errors.append(str(exc))
            life.invalidate(Reason.COORDINATOR_FAILED)
            return Commit()
        finally:
            req.timed("commit", t)
        life.facts.all_ranks_voted_yes = yes
        if life.state is RequestState.INSTALLED and yes:
            life.fire("commit", commit_reason(agreed=agreed, target=run.target))
            return Commit(agreed)
        installed_here = life.state is RequestState.INSTALLED or installed_usable(
            layout, run.target, run.installed, serves
        )
        failure = run.failure.reason if run.failure is not None else None
        life.invalidate(
            invalidation_reason(
                timed_out=vote.timed_out, failure=failure, installed_here=installed_here
            )
        )
        return Commit()

    # ------------------------------------------------------------------ release
    async def release(self) -> None:
        """Every slot still held goes back (or is parked); the given probe's leases are
        released. Runs in the caller's ``finally``, whatever the phases did."""
        window, pipeline, shield_s = self._held, self.parts.pipeline, self.parts.shield_timeout_s
        if window is not None:  # the window ended early: its tier moves are owed
            self.parts.quarantine.defer(window.gate.take_pending())
        try:
            if window is not None and window.slots is not None:
                if pipeline.cuda_stream is not None:
                    # the one shield a caller's cancel waits for: a device copy may still be
                    # reading these slots, which must not be reused before it lands
                    with anyio.CancelScope(shield=True):
                        with anyio.move_on_after(shield_s):
                            await pipeline.synchronize()
                await pipeline.drain(window.run, min(ABANDON_GRACE_S, shield_s))
                pipeline.release_all(window.run, window.slots)
        finally:
            if self.given is not None:
                self.given.release()

    # ------------------------------------------------------------------ result
    def result(self, restored: Restored) -> RestoreResult:
        """The public outcome of the request (it must be terminal)."""
        req, life, window = self.req, self.req.life, restored.window
        assert life.reason is not None and life.terminal
        committed = restored.commit.chunks if life.state is RequestState.COMMITTED else 0
        probe, run = restored.probed.probe, window.run if window is not None else None
        invalid = _invalid_blocks(req, run, committed)
        chunk_tokens = self.parts.layout.chunk_tokens
        return RestoreResult(
            request_id=req.rid,
            state=life.state,
            committed_tokens=committed * chunk_tokens,
            probed_tokens=(probe.prefix_chunks if probe else 0) * chunk_tokens,
            bytes_by_tier=dict(run.bytes_by_tier) if run else {},
            rws_peak_bytes=0 if window is None or window.slots is None else window.slots.peak_bytes,
            timings=Timings(
                req.phase_s.get("probe", 0.0),
                req.phase_s.get("window", 0.0),
                req.phase_s.get("commit", 0.0),
                time.perf_counter() - req.t0,
                req.phase_s.get("settle", 0.0),
            ),
            reason=life.reason,
            invalid_block_ids=tuple(sorted({b for bs in invalid.values() for b in bs})),
            invalid_block_ids_by_group=invalid,
            trace=tuple(life.trace),
            strategy=req.strategy,
            policy=Policy.COST if req.cost else req.policy,
            fallbacks=run.fallbacks if run else 0,
            quarantined=run.quarantined if run else 0,
            errors=tuple(run.errors) if run else (),
            decision=restored.probed.decision,
            read_s_by_tier={} if window is None else window.gate.busy_by_tier(),
            unanswered=probe.unanswered if probe is not None else (),
        )


def _invalid_blocks(
    req: RestoreRequest, run: RestoreRun | None, committed: int
) -> dict[str, tuple[int, ...]]:
    """Per group, the blocks ``run`` wrote that hold no valid state (all of them unless
    Committed, those of the chunks past the ``committed`` ones)."""
    if run is None:
        return {}
    out: dict[str, set[int]] = {}
    for c in run.touched_chunks:
        if c >= committed:
            for g in run.needed.get(c, ()):
                written = req.tables.written_blocks(g, c, req.first_block)
                out.setdefault(g, set()).update(written)
    return {g: tuple(sorted(bs)) for g, bs in out.items() if bs}
