"""RestoreEngine: probe, bounded windowed restore with all-or-nothing commit, and save.

Where it runs: the serving process's event loop (any anyio backend); one engine per rank.
The decision side (probe, plan, state machine, agreement) is synchronous or metadata-only; the
transfer side is a small pipeline the engine owns::

    dispatcher --(slot per chunk, FIFO from the W-slot pool)--> readers (io_depth reads in flight,
    fallback ladder, verify) --(bounded stream)--> installer (slot -> paged cache) -> release

Every slot a request takes is tracked in the request's ``held`` set and released exactly once,
by the installer after the copy completed, or by the request's ``finally`` on failure, deadline
and cancellation (invariant 4). Nothing is committed until every needed (chunk, group) is
installed on this rank and every rank votes yes (invariants 1 and 2).
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import torch

from .._errors import ClosedError, ConfigError, CoordinatorError
from .._log import logger
from ..core._keys import ChunkKey, Namespace, ObjectKey, TokensLike, as_token_array, chunk_keys
from ..core._layout import StateLayout
from ..core._lifecycle import Reason, RequestLifecycle, RequestState
from ..core._plan import longest_prefix, longest_prefix_upto, needed_objects, prefix_usable
from ..core._results import Policy, Probe, RestoreResult, SaveResult, Strategy, Timings, choice
from ..tiers._base import Tier, TierStatistics
from ..transfer._cache import PagedKVCache
from ..transfer._pipeline import RestoreRun, SlotSource, WholePlanBuffer, WindowPipeline
from ..transfer._save import save_chunks
from ..transfer._staging import StagingPool, StagingStatistics
from ._coordinator import Coordinator, LocalCoordinator
from ._health import BreakerState, TierHealth


@dataclass(frozen=True)
class EngineStatistics:
    """Snapshot of an engine: staging pool, tiers and request counters."""

    staging: StagingStatistics
    tiers: tuple[TierStatistics, ...]
    restores: int
    committed: int
    invalidated: int
    saves: int
    quarantined: int
    breakers: tuple[BreakerState, ...] = ()


class RestoreEngine:
    """Restores and saves one rank's reusable state through a bounded staging window.

    Args:
        layout: the model's state layout.
        tiers: tiers fastest first (e.g. ``[HostTier(...), FileTier(...)]``); restore falls back
            down this list, save writes through to all of them.
        window: W, staging slots (each ``layout.slot_bytes``); peak staging <= W x slot_bytes.
        io_depth: reads in flight per restore (1 <= io_depth <= W).
        namespace: model id, tp rank/size, salt; keys are disjoint across namespaces.
        coordinator: cross-rank agreement (default: single rank).
        policy: default commit policy (``"all_or_nothing"`` or ``"truncate"``).
        deadline_s: default per-restore deadline (None: no deadline).
        pin_staging: allocate pinned staging when CUDA is available.
        prefault_staging: touch the staging window at open (no page faults in the first
            restore; the window is resident from the start).
        breaker_threshold: consecutive I/O failures or timeouts after which a tier is skipped
            for ``breaker_cooldown_s`` (None: never skip a tier).
        breaker_cooldown_s: how long a tripped tier is skipped before it is tried again.
    """

    def __init__(
        self,
        layout: StateLayout,
        tiers: Sequence[Tier],
        *,
        window: int = 8,
        io_depth: int = 4,
        namespace: Namespace,
        coordinator: Coordinator | None = None,
        policy: Policy | str = Policy.ALL_OR_NOTHING,
        deadline_s: float | None = None,
        pin_staging: bool = True,
        prefault_staging: bool = True,
        breaker_threshold: int | None = 3,
        breaker_cooldown_s: float = 5.0,
    ) -> None:
        if not isinstance(layout, StateLayout):
            raise ConfigError(f"layout must be a StateLayout, got {type(layout).__name__}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"window (W) must be an int >= 1, got {window!r}; e.g. window=8")
        if (
            isinstance(io_depth, bool)
            or not isinstance(io_depth, int)
            or not 1 <= io_depth <= window
        ):
            raise ConfigError(
                f"io_depth must be an int in [1, window={window}], got {io_depth!r}; more reads "
                "in flight than slots cannot help, raise window or lower io_depth"
            )
        tiers = list(tiers)
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ConfigError("tiers must be a non-empty list of Tier objects, fastest first")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}; pass name=... to each tier")
        if not isinstance(namespace, Namespace):
            raise ConfigError("namespace must be a bsr.Namespace(model_id=...)")
        if deadline_s is not None and deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0 or None, got {deadline_s}")
        self.layout = layout
        self.tiers = tiers
        self.window = window
        self.io_depth = io_depth
        self.namespace = namespace
        self.namespace_fp = namespace.fingerprint(layout)
        self.coordinator: Coordinator = coordinator or LocalCoordinator()
        if (
            self.coordinator.world_size != namespace.tp_size
            or self.coordinator.rank != namespace.tp_rank
        ):
            raise ConfigError(
                f"coordinator is rank {self.coordinator.rank} of {self.coordinator.world_size} "
                f"but the namespace says tp_rank={namespace.tp_rank}, "
                f"tp_size={namespace.tp_size}; make them agree"
            )
        self.policy = choice(Policy, policy, "policy")
        self.deadline_s = deadline_s
        self.pin_staging = pin_staging
        self.prefault_staging = prefault_staging
        self.health = TierHealth(names, threshold=breaker_threshold, cooldown_s=breaker_cooldown_s)
        self._pool: StagingPool | None = None
        self._state = "new"
        self._quarantine: set[tuple[str, str]] = set()
        self._ids = itertools.count()
        self._counts = {"restores": 0, "committed": 0, "invalidated": 0, "saves": 0}
        self._log = logger.bind(rank=namespace.tp_rank, model=namespace.model_id)
        self._listeners: list[Callable[[Probe | RestoreResult | SaveResult], None]] = []
        # the transfer side; one per engine, so its CUDA side stream is made once
        self._window = WindowPipeline(
            self.layout,
            self.tiers,
            window=self.window,
            io_depth=self.io_depth,
            is_quarantined=lambda tier, oid: (tier, oid) in self._quarantine,
            quarantine=self._quarantine_object,
            log=self._log,
            health=self.health,
        )

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        layout: StateLayout,
        namespace: Namespace | None = None,
        coordinator: Coordinator | None = None,
    ) -> RestoreEngine:
        """Build an engine and its tiers from a :class:`~bsr.EngineConfig` (see there)."""
        from ._config import engine_from_config

        return engine_from_config(
            config, layout=layout, namespace=namespace, coordinator=coordinator
        )

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> RestoreEngine:
        await self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Open every tier and allocate the staging window (once)."""
        if self._state == "open":
            return
        if self._state == "closed":
            raise ClosedError("this RestoreEngine is closed; create a new one")
        for t in self.tiers:
            await t.open()
        self._pool = StagingPool(
            self.window,
            self.layout.slot_bytes,
            pin=self.pin_staging,
            prefault=self.prefault_staging,
        )
        self._state = "open"
        self._log.info(
            "bsr.engine.opened",
            window=self.window,
            io_depth=self.io_depth,
            slot_bytes=self.layout.slot_bytes,
            pinned=self._pool.pinned,
            tiers=[t.name for t in self.tiers],
        )

    async def aclose(self) -> None:
        """Close every tier. Later calls raise :class:`~bsr.ClosedError`."""
        if self._state == "closed":
            return
        self._state = "closed"
        for t in self.tiers:
            with anyio.CancelScope(shield=True):
                await t.aclose()
        self._log.info("bsr.engine.closed")

    def _check_open(self) -> StagingPool:
        if self._state != "open" or self._pool is None:
            raise ClosedError(
                "RestoreEngine is not open; use 'async with engine:' (or await engine.open())"
                if self._state == "new"
                else "RestoreEngine is closed; create a new one"
            )
        return self._pool

    @property
    def staging(self) -> StagingPool:
        return self._check_open()

    def statistics(self) -> EngineStatistics:
        pool = self._check_open()
        return EngineStatistics(
            staging=pool.statistics(),
            tiers=tuple(t.statistics() for t in self.tiers),
            restores=self._counts["restores"],
            committed=self._counts["committed"],
            invalidated=self._counts["invalidated"],
            saves=self._counts["saves"],
            quarantined=len(self._quarantine),
            breakers=tuple(self.health.state(t.name) for t in self.tiers),
        )

    def subscribe(
        self, listener: Callable[[Probe | RestoreResult | SaveResult], None]
    ) -> Callable[[], None]:
        """Call ``listener`` with every Probe (lookups), RestoreResult and SaveResult.

        Listeners run synchronously on the event loop right after the operation finished (keep
        them cheap: count, observe a histogram); an exception in one is logged and ignored.
        Returns a function that unsubscribes it. Used by :mod:`bsr.metrics`.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _notify(self, record: Probe | RestoreResult | SaveResult) -> None:
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # a metrics bug must never fail a restore
                self._log.warning("bsr.engine.listener_failed", error=repr(exc))

    def _check_cache(self, cache: PagedKVCache) -> None:
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"cache must be a bsr.PagedKVCache, got {type(cache).__name__}")
        cache.check_layout(self.layout)

    def keys(self, tokens: TokensLike) -> list[ChunkKey]:
        """Chained keys of every full chunk of ``tokens`` in this engine's namespace."""
        return chunk_keys(self.namespace_fp, tokens, self.layout.chunk_tokens)

    # ------------------------------------------------------------------ probe
    async def _holders(self, keys: Sequence[ChunkKey], n: int) -> list[dict[str, list[int]]]:
        objs = [ObjectKey(keys[c], g.name) for c in range(n) for g in self.layout.groups]
        holders: list[dict[str, list[int]]] = [
            {g.name: [] for g in self.layout.groups} for _ in range(n)
        ]
        for ti, tier in enumerate(self.tiers):
            if not self.health.available(tier.name):
                continue  # circuit breaker open: the tier holds nothing for this probe
            try:
                present = await tier.contains_many(objs)
            except Exception as exc:  # a tier that cannot answer holds nothing for this probe
                self.health.failure(tier.name)
                self._log.warning("bsr.probe.tier_failed", tier=tier.name, error=str(exc))
                continue
            self.health.success(tier.name)
            for i, (o, p) in enumerate(zip(objs, present)):
                if p and (tier.name, o.object_id) not in self._quarantine:
                    holders[i // len(self.layout.groups)][o.group].append(ti)
        return holders

    async def _agree_prefix(self, local: int, usable: Any) -> int:
        """Agree on the longest prefix usable on every rank.

        Each round: MIN of the ranks' candidates, then AND of "usable here". A rank that cannot
        use the agreed prefix (a sliding-window group may need other chunks for a shorter
        prefix) makes every rank propose its longest usable prefix below it; candidates strictly
        decrease, so this ends, at the latest at 0. Every rank runs the same number of rounds.
        """
        candidate = local
        while True:
            agreed = await self.coordinator.agree_min(candidate)
            ok = agreed == 0 or bool(usable(agreed))
            if await self.coordinator.agree_all(ok):
                return agreed
            candidate = longest_prefix_upto(usable, agreed - 1)

    async def _probe(
        self, tokens: TokensLike, *, deadline: float | None
    ) -> tuple[Probe, list[dict[str, list[int]]], bool]:
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        keys = self.keys(arr)
        n = len(keys)
        holders: list[dict[str, list[int]]] = [
            {g.name: [] for g in self.layout.groups} for _ in range(n)
        ]
        timed_out = False
        with anyio.move_on_after(deadline if deadline is not None else math.inf) as scope:
            holders = await self._holders(keys, n)
        if scope.cancelled_caught:
            timed_out = True
            holders = [{g.name: [] for g in self.layout.groups} for _ in range(n)]

        def have(c: int, g: str) -> bool:
            return c < n and bool(holders[c][g])

        local = longest_prefix(self.layout, n, have)
        agreed = await self._agree_prefix(local, lambda p: prefix_usable(self.layout, p, have))
        by_tier: dict[str, int] = {}
        for c, g in needed_objects(self.layout, agreed):
            name = self.tiers[holders[c][g][0]].name
            by_tier[name] = by_tier.get(name, 0) + self.layout.group_chunk_bytes(g)
        probe = Probe(
            num_tokens=len(arr),
            chunk_tokens=self.layout.chunk_tokens,
            keys=tuple(keys),
            holders=tuple(
                {g: tuple(self.tiers[i].name for i in ts) for g, ts in h.items()} for h in holders
            ),
            local_chunks=local,
            prefix_chunks=agreed,
            bytes_by_tier=by_tier,
            duration_s=time.perf_counter() - t0,
        )
        return probe, holders, timed_out

    async def lookup(self, tokens: TokensLike) -> Probe:
        """Find the reusable prefix of ``tokens`` across tiers, groups and ranks; moves no data.

        With several ranks every rank must call ``lookup`` (it runs the agreement collectives).
        """
        self._check_open()
        probe, _, _ = await self._probe(tokens, deadline=None)
        self._log.debug(
            "bsr.probe",
            tokens=probe.num_tokens,
            prefix_tokens=probe.prefix_tokens,
            local_chunks=probe.local_chunks,
            bytes_by_tier=probe.bytes_by_tier,
        )
        self._notify(probe)
        return probe

    # ------------------------------------------------------------------ restore
    async def restore(
        self,
        tokens: TokensLike,
        cache: PagedKVCache,
        block_ids: Any,
        *,
        policy: Policy | str | None = None,
        deadline_s: float | None = None,
        strategy: Strategy | str = Strategy.BOUNDED,
        request_id: str | None = None,
    ) -> RestoreResult:
        """Restore the longest reusable prefix of ``tokens`` into ``cache`` at ``block_ids``.

        Returns a result that is Committed (``committed_tokens`` tokens are valid in the cache) or
        Invalidated (nothing is valid; recompute). Never raises for storage failures; raises
        typed errors for bad arguments, and re-raises cancellation after releasing every slot.
        With several ranks every rank must call ``restore`` for the same tokens.
        """
        pool = self._check_open()
        self._check_cache(cache)
        arr = as_token_array(tokens)
        n_full = self.layout.num_chunks(len(arr))
        ids = cache.block_table(block_ids, n_full * self.layout.chunk_tokens)
        policy = self.policy if policy is None else choice(Policy, policy, "policy")
        strategy = choice(Strategy, strategy, "strategy")
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        if deadline_s is not None and deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0, got {deadline_s}")
        rid = request_id or f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        life = RequestLifecycle(rid, rank=self.namespace.tp_rank)
        log = self._log.bind(request_id=rid)
        self._counts["restores"] += 1
        t0 = time.perf_counter()
        deadline_at = None if deadline_s is None else t0 + deadline_s

        def remaining() -> float | None:
            return None if deadline_at is None else max(0.0, deadline_at - time.perf_counter())

        req: RestoreRun | None = None
        account: SlotSource | None = None
        pipeline = self._window
        t_probe = t_install = t_commit = 0.0
        committed_chunks = 0
        probed_chunks = 0
        try:
            # ---------------------------------------------------------- Probing
            try:
                probe, holders, probe_timed_out = await self._probe(arr, deadline=remaining())
            except CoordinatorError as exc:
                life.invalidate(Reason.COORDINATOR_FAILED)
                raise _Done(str(exc)) from None
            t_probe = time.perf_counter() - t0
            probed_chunks = probe.prefix_chunks
            life.facts.prefix_chunks = probe.prefix_chunks
            if probe_timed_out:
                life.invalidate(Reason.DEADLINE)
                raise _Done("probe deadline")
            if probe.prefix_chunks == 0:
                life.fire("probe_miss", Reason.EMPTY_PREFIX)
                raise _Done("empty")
            life.fire("probe_hit")
            # ---------------------------------------------------------- Windowing
            req = RestoreRun(rid, probe.prefix_chunks, self.layout, policy)
            req.deadline_at = deadline_at
            life.facts.target_chunks = req.target
            if strategy is Strategy.BOUNDED:
                account = pool.account()
            else:
                account = WholePlanBuffer(len(req.needed), self.layout.slot_bytes, self.pin_staging)
            t1 = time.perf_counter()
            timed_out = False
            with anyio.move_on_after(remaining() if deadline_at is not None else math.inf) as scope:
                await pipeline.run(req, account, probe.keys, holders, cache, ids, strategy)
            # the deadline fired, even if the window ended another way while shielded
            timed_out = scope.cancel_called
            t_install = time.perf_counter() - t1
            # ---------------------------------------------------------- agree + commit
            t2 = time.perf_counter()

            def installed_usable(p: int) -> bool:
                return prefix_usable(self.layout, p, lambda c, g: (c, g) in req.installed)

            # every device copy must have landed before this rank may vote yes; a failure here
            # is a "no" vote, never a skipped collective (the other ranks would wait for it)
            try:
                await pipeline.synchronize()
            except Exception as exc:
                req.errors.append(f"synchronize: {exc!r}")
                req.installed.clear()
            if timed_out:
                local_best = 0
            elif policy is Policy.TRUNCATE:
                local_best = longest_prefix(
                    self.layout, min(req.limit, req.target), lambda c, g: (c, g) in req.installed
                )
            else:
                local_best = req.target if installed_usable(req.target) else 0
            try:
                agreed = await self._agree_prefix(local_best, installed_usable)
                if agreed == req.target and installed_usable(agreed):
                    life.facts.every_chunk_installed = True
                    life.fire("chunks_installed")
                elif agreed > 0 and policy is Policy.TRUNCATE and installed_usable(agreed):
                    life.facts.every_chunk_installed = True
                    life.facts.truncated_chunks = agreed
                    life.fire("truncate")
                vote = life.state is RequestState.INSTALLED
                all_ok = await self.coordinator.agree_all(vote)
            except CoordinatorError as exc:
                req.errors.append(str(exc))
                life.invalidate(Reason.COORDINATOR_FAILED)
                raise _Done("coordinator") from None
            t_commit = time.perf_counter() - t2
            if life.state is RequestState.INSTALLED and all_ok:
                life.facts.all_ranks_installed = True
                committed_chunks = agreed
                life.fire("commit", Reason.COMPLETE if agreed == req.target else Reason.TRUNCATED)
            else:
                if timed_out:
                    reason = Reason.DEADLINE
                elif req.failure is not None:
                    reason = req.failure.reason
                elif life.state is RequestState.INSTALLED or installed_usable(req.target):
                    reason = Reason.RANK_FAILED
                else:
                    reason = Reason.READ_FAILED
                life.invalidate(reason)
        except _Done:
            pass
        except BaseException as exc:
            # cancellation or a bug: never leave the request non-terminal
            cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
            if not life.terminal:
                life.invalidate(Reason.CANCELLED if cancelled else Reason.INTERNAL_ERROR)
            self._counts["invalidated"] += 1
            log.warning("bsr.restore.aborted", reason=str(life.reason), error=repr(exc))
            raise
        finally:
            if req is not None and account is not None:
                with anyio.CancelScope(shield=True):
                    await pipeline.synchronize()
                for slot in list(req.held):
                    req.held.discard(slot)
                    account.release(slot)
        assert life.reason is not None
        if life.state is RequestState.COMMITTED:
            self._counts["committed"] += 1
        else:
            self._counts["invalidated"] += 1
            committed_chunks = 0
        invalid = self._invalid_blocks(req, committed_chunks, cache, ids)
        result = RestoreResult(
            request_id=rid,
            state=life.state,
            committed_tokens=committed_chunks * self.layout.chunk_tokens,
            probed_tokens=probed_chunks * self.layout.chunk_tokens,
            bytes_by_tier=dict(req.bytes_by_tier) if req else {},
            rws_peak_bytes=(0 if account is None else account.peak_bytes),
            timings=Timings(t_probe, t_install, t_commit, time.perf_counter() - t0),
            reason=life.reason,
            invalid_block_ids=invalid,
            trace=tuple(life.trace),
            strategy=strategy,
            policy=policy,
            fallbacks=req.fallbacks if req else 0,
            quarantined=req.quarantined if req else 0,
            errors=tuple(req.errors) if req else (),
        )
        log.info(
            "bsr.restore.done",
            state=str(result.state),
            reason=str(result.reason),
            committed_tokens=result.committed_tokens,
            probed_tokens=result.probed_tokens,
            bytes_by_tier=result.bytes_by_tier,
            rws_peak_bytes=result.rws_peak_bytes,
            total_s=round(result.timings.total_s, 6),
            strategy=str(strategy.value),
        )
        self._notify(result)
        return result

    def _invalid_blocks(
        self, req: RestoreRun | None, committed_chunks: int, cache: PagedKVCache, ids: torch.Tensor
    ) -> tuple[int, ...]:
        if req is None:
            return ()
        out: set[int] = set()
        for c in req.touched_chunks:
            if c >= committed_chunks:
                out.update(int(b) for b in cache.chunk_blocks(ids, c).tolist())
        return tuple(sorted(out))

    async def _quarantine_object(
        self, run: RestoreRun, tier: Tier, key: ChunkKey, group: str, why: str, physical: bool
    ) -> None:
        """Stop using an object: always in this engine, and in the tier when ``physical``.

        The tier call is bounded by the request's remaining deadline (a dead tier's delete
        must not hold a request past its deadline); if it does not finish, the engine-level
        quarantine still makes later probes miss the object.
        """
        oid = ObjectKey(key, group).object_id
        if (tier.name, oid) in self._quarantine:
            return
        self._quarantine.add((tier.name, oid))
        run.quarantined += 1
        if not physical:
            self._log.warning(
                "bsr.engine.quarantine", tier=tier.name, key=key.hex[:16], group=group, reason=why
            )
            return
        budget = math.inf if run.deadline_at is None else run.deadline_at - time.perf_counter()
        with anyio.CancelScope(shield=True), anyio.move_on_after(max(0.0, budget)):
            try:
                await tier.quarantine(key, group, why)
            except Exception as exc:
                self._log.warning("bsr.tier.quarantine_failed", tier=tier.name, error=repr(exc))

    # ------------------------------------------------------------------ save
    async def save(
        self,
        tokens: TokensLike,
        cache: PagedKVCache,
        block_ids: Any,
        *,
        tiers: Sequence[str] | None = None,
    ) -> SaveResult:
        """Store every full chunk of ``tokens`` held in ``cache`` at ``block_ids``.

        Writes through to every tier (or the named ``tiers``), skipping objects a tier already
        holds. Sliding-window groups store only the chunks their window needs at the end of the
        saved prefix. Staging comes from the same W-slot pool as restores. A tier's write error is
        counted in the result and logged; it does not stop the other tiers.
        """
        pool = self._check_open()
        self._check_cache(cache)
        arr = as_token_array(tokens)
        n = self.layout.num_chunks(len(arr))
        ids = cache.block_table(block_ids, n * self.layout.chunk_tokens)
        targets = self.tiers if tiers is None else [self._tier(name) for name in tiers]
        result = await save_chunks(
            layout=self.layout,
            tiers=targets,
            account=pool.account(),
            cache=cache,
            ids=ids,
            keys=self.keys(arr),
            io_depth=self.io_depth,
            log=self._log,
            # a fresh copy replaces a quarantined one: probes may see it again
            on_written=lambda tier, okey: self._quarantine.discard((tier.name, okey.object_id)),
            is_retired=lambda tier, okey: (tier.name, okey.object_id) in self._quarantine,
        )
        self._counts["saves"] += 1
        self._log.info(
            "bsr.save.done",
            tokens=result.saved_tokens,
            chunks=result.chunks,
            written=result.objects_written,
            skipped=result.objects_skipped,
            errors=result.errors,
            duration_s=round(result.duration_s, 6),
        )
        self._notify(result)
        return result

    def _tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")


class _Done(Exception):
    """Internal: the request reached a terminal state early."""
