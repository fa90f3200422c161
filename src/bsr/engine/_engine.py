"""RestoreEngine: probe, bounded windowed restore with all-or-nothing commit, and save.

Where it runs: the serving process's event loop (any anyio backend); one engine per rank.

How it works: the engine owns what lives as long as it does: the tiers, the W-slot staging pool,
the transfer pipeline, tier health, quarantine, probe leases and the measured costs. Its knobs
are the fields of :class:`~bsr.engine._options.EngineOptions` (its constructor's parameters, see
:mod:`bsr.engine._options`), and ``from_config``'s checks live in :mod:`bsr.engine._from_config`.
The engine is the public face of its parts: lookups and restores (:mod:`bsr.engine._restores`:
a restore is admitted, its arguments checked and its request record opened with no I/O, and
then run as a :class:`~bsr.engine._job.RestoreJob`, whose phases (probe, window, settle, agree;
release in its ``finally``) each return what the next one takes; see :mod:`bsr.engine._job`),
saves (:mod:`bsr.engine._saves`: straight to :func:`~bsr.transfer._save.save_chunks` through the
same staging pool), warms (:mod:`bsr.engine._warm`), and audits, quarantine moves and closing
the tiers (:mod:`bsr.engine._upkeep`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio

from .._check import non_negative_int, optional_positive_seconds
from .._errors import (
    ClosedError,
    ConfigError,
)
from .._log import logger
from .._resource import AsyncResource
from ..core._keys import (
    ChunkKey,
    Extras,
    Namespace,
    ObjectKey,
    TokensLike,
    check_extras,
    chunk_keys,
)
from ..core._layout import StateLayout
from ..core._options import Policy, Promote, Strategy
from ..core._plan import checkpoint_ends, needed_objects
from ..core._results import Probe, RestoreResult, SaveResult
from ..tiers._base import Tier, TierStatistics
from ..tiers._watch import Removal, RemovalFeed, RemovalListener
from ..transfer._cache import PagedKVCache
from ..transfer._pipeline import WindowPipeline
from ..transfer._run import OnInstalled
from ..transfer._staging import StagingPool, StagingStatistics
from ._budget import DeadlineSplit
from ._config import EngineConfig
from ._coordinator import Coordinator
from ._cost import CostModel
from ._decisions import Quarantine
from ._from_config import configured
from ._health import BreakerState, TierHealth
from ._job import RestoreParts
from ._leases import LeaseBook
from ._options import (
    EngineArguments,
    check_budget,
    check_coordinator,
    check_tiers,
    takes_options,
)
from ._probe import Prober
from ._restores import Restores
from ._saves import Saves
from ._upkeep import Upkeep
from ._warm import Warmer, WarmResult, WarmStatistics

Record = Probe | RestoreResult | SaveResult | WarmResult


@dataclass(frozen=True)
class EngineStatistics:
    """Snapshot of an engine.

    Attributes:
        staging: the shared W-slot pool.
        tiers: each tier's counters, fastest first.
        restores, committed, invalidated, saves: request counters.
        quarantined: objects this engine no longer uses (corrupt or unreadable).
        breakers: each tier's circuit breaker.
        abandoned_workers: worker threads left running after their request ended (a read stuck
            in the kernel); their slots are parked until they return.
        leases: probe leases currently held (those past their TTL are reclaimed first).
        saves_skipped: saves that skipped a tier because it stayed busy, by reason
            (``"root_locked"``: a FileTier root whose lock another process held; see
            ``SaveResult.skipped``).
        warm: warms and promotions (:class:`~bsr.WarmStatistics`).
    """

    staging: StagingStatistics
    tiers: tuple[TierStatistics, ...]
    restores: int
    committed: int
    invalidated: int
    saves: int
    quarantined: int
    breakers: tuple[BreakerState, ...] = ()
    abandoned_workers: int = 0
    leases: int = 0
    saves_skipped: dict[str, int] = field(default_factory=dict)
    warm: WarmStatistics = field(default_factory=WarmStatistics)


class RestoreEngine(AsyncResource):
    """Restores and saves one rank's reusable state through a bounded staging window.

    Args:
        layout: the model's state layout.
        tiers: tiers fastest first (e.g. ``[HostTier(...), FileTier(...)]``); restore falls back
            down this list, save writes through to all of them.
        namespace: model id, tp rank/size, salt; keys are disjoint across namespaces.
        coordinator: cross-rank agreement (default: single rank).
        options: the knobs as one :class:`~bsr.EngineOptions` (or an ``EngineConfig``); a knob
            also given by name overrides its value there.
        window, io_depth, memory_workers, policy, deadline_s, probe_share, pin_staging,
            prefault_staging, breaker_threshold, breaker_cooldown_s, shield_timeout_s,
            staging_budget_bytes, window_checkpoint_chunks, promote, warm_budget_bytes,
            warm_concurrency: the knobs,
            each documented (and checked, with the same message as in a config) by
            :class:`~bsr.EngineOptions`, whose fields are exactly these parameters. The window
            must fit in ``staging_budget_bytes`` when one is set.

    Attributes:
        options: the knobs this engine was built with (:class:`~bsr.EngineOptions`); the
            engine also has each as an attribute (``engine.window``; ``engine.policy`` and
            :class:`~bsr.Policy`).
    """

    #: the task running promotions inside ``async with engine`` (None outside it)
    _background: anyio.abc.TaskGroup | None = None

    @takes_options(EngineArguments)
    def __init__(self, args: EngineArguments) -> None:
        if not isinstance(args.layout, StateLayout):
            raise ConfigError(f"layout must be a StateLayout, got {type(args.layout).__name__}")
        if not isinstance(args.namespace, Namespace):
            raise ConfigError("namespace must be a bsr.Namespace(model_id=...)")
        self.layout = layout = args.layout
        self.options = o = args.engine_options()
        check_budget(o, layout.slot_bytes)
        self.window, self.io_depth, self.memory_workers = o.window, o.io_depth, o.memory_workers
        self.policy, self.deadline_s = Policy(o.policy), o.deadline_s
        self.pin_staging, self.prefault_staging = o.pin_staging, o.prefault_staging
        self.shield_timeout_s = o.shield_timeout_s
        self.staging_budget_bytes = o.staging_budget_bytes
        self.window_checkpoint_chunks = o.window_checkpoint_chunks
        self.tiers = check_tiers(args.tiers)
        self.namespace = namespace = args.namespace
        self.namespace_fp = namespace.fingerprint(layout)
        self.coordinator: Coordinator = check_coordinator(args.coordinator, namespace)
        self.health = TierHealth(
            [t.name for t in self.tiers], threshold=o.breaker_threshold,
            cooldown_s=o.breaker_cooldown_s,
        )  # fmt: skip
        self._pool: StagingPool | None = None  # set by open(): new -> open -> closed
        #: what this engine itself takes out of its tiers' service (quarantine, audits)
        self._removals = RemovalFeed("engine")
        self._quarantine = Quarantine(on_add=self._quarantined)
        #: measured read rates and prefill rate; decides policy "cost"
        self.cost = CostModel()
        self._leases = LeaseBook()
        self._counts = {"restores": 0, "committed": 0, "invalidated": 0, "saves": 0}
        self._log = logger.bind(rank=namespace.tp_rank, model=namespace.model_id)
        self._listeners: list[Callable[[Record], None]] = []
        self._upkeep = Upkeep(
            layout, self.tiers, self._quarantine, self._removals, o.shield_timeout_s, self._log
        )
        self._prober = Prober(
            layout, self.tiers, self.namespace_fp, self.health, self._quarantine,
            self.coordinator, self._log, origin=uuid.uuid4().bytes,
        )  # fmt: skip
        # the transfer side; one per engine, so its CUDA side stream is made once
        self._window = WindowPipeline(
            layout, self.tiers, window=o.window, io_depth=o.io_depth,
            memory_workers=o.memory_workers,
        )  # fmt: skip
        #: what each restore job uses of this engine
        self._parts = RestoreParts(
            layout, self._prober, self.coordinator, self.health, self._quarantine, self.cost,
            self._window, self._open_pool, self._upkeep.move_out, o.shield_timeout_s,
            o.pin_staging, o.staging_budget_bytes, o.probe_share,
        )  # fmt: skip
        self._warmer = Warmer(
            layout, self.tiers, self._prober, self.health, self._quarantine, self._open_pool,
            self._upkeep.move_out, io_depth=o.io_depth, window=o.window,
            budget_bytes=o.warm_budget_bytes, concurrency=o.warm_concurrency,
            promote=Promote(o.promote), shield_timeout_s=o.shield_timeout_s, log=self._log,
            notify=self._notify,
        )  # fmt: skip
        self._saves = Saves(
            layout, self.tiers, self._prober, self._quarantine, tier=self._upkeep.tier,
            io_depth=o.io_depth, checkpoint_chunks=o.window_checkpoint_chunks,
            counts=self._counts, log=self._log, notify=self._notify,
        )  # fmt: skip
        self._restores = Restores(
            self._parts, self.tiers, self._warmer, self._leases, rank=namespace.tp_rank,
            policy=self.policy, deadline_s=o.deadline_s, counts=self._counts, log=self._log,
            notify=self._notify,
        )  # fmt: skip

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        layout: StateLayout,
        namespace: Namespace | None = None,
        coordinator: Coordinator | None = None,
        tiers: Sequence[Tier] | None = None,
    ) -> RestoreEngine:
        """Build an engine and its tiers from a :class:`~bsr.EngineConfig`.

        Args:
            config: the engine config (its knobs are the engine's options).
            layout: the model's state layout.
            namespace: the namespace; default built from ``config.model_id`` and
                ``config.tenant``, with the coordinator's rank and world size.
            coordinator: cross-rank agreement (default: single rank).
            tiers: tiers to use in place of ``config.build_tiers()``, fastest first: typically
                those, wrapped (a throttle, a fault injector, a probe); every other setting
                still comes from ``config``.

        Raises:
            ConfigError: the layout's chunk size differs from ``config.chunk_tokens``, the
                window does not fit in the host's memory, no namespace can be made, or the
                namespace disagrees with the config's ``model_id`` or ``tenant`` (its salt).
        """
        tiers, namespace = configured(config, layout, namespace, coordinator, tiers)
        return cls(layout, tiers, namespace=namespace, coordinator=coordinator, options=config)

    # ------------------------------------------------------------------ lifecycle
    # ``async with engine`` opens and closes it (AsyncResource)
    def _closed_error(self) -> ClosedError:
        if self._pool is None and not self.closed:
            return ClosedError(
                "RestoreEngine is not open; use 'async with engine:' (or await engine.open())"
            )
        return ClosedError("RestoreEngine is closed; create a new one")

    async def open(self) -> None:
        """Open every tier and allocate the staging window (once)."""
        await super().open()  # refused once closed
        if self._pool is not None:
            return
        for t in self.tiers:
            await t.open()
        self._pool = StagingPool(
            self.window, self.layout.slot_bytes, pin=self.pin_staging,
            prefault=self.prefault_staging,
        )  # fmt: skip
        self._log.info(
            "bsr.engine.opened", window=self.window, io_depth=self.io_depth,
            slot_bytes=self.layout.slot_bytes, pinned=self._pool.pinned,
            tiers=[t.name for t in self.tiers],
        )  # fmt: skip

    async def __aenter__(self) -> Self:
        """Open the engine and start its background task (promotions, see :meth:`warm`), which
        runs until the ``async with`` block ends."""
        await self.open()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._background = tg
        tg.start_soon(self.run_background)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg, self._background = self._background, None
        try:
            if tg is not None:  # the background task never raises: it only has to stop
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Release leases, finish owed quarantine moves and close every tier (each bounded by
        ``shield_timeout_s``). Promotions not yet run are dropped.

        Later calls raise :class:`~bsr.ClosedError`.
        """
        if self.closed:
            return
        await super().aclose()
        if self._background is not None:  # closed inside its async with: stop promoting now
            self._background.cancel_scope.cancel()
        self._warmer.drop_pending()
        self._leases.release_all()
        await self._upkeep.close()
        self._log.info("bsr.engine.closed")

    def _open_pool(self) -> StagingPool:
        """The staging pool of an open engine (else :class:`~bsr.ClosedError`)."""
        if self.closed or self._pool is None:
            raise self._closed_error()
        return self._pool

    @property
    def staging(self) -> StagingPool:
        return self._open_pool()

    def statistics(self) -> EngineStatistics:
        pool = self._open_pool()
        self._leases.reclaim()
        return EngineStatistics(
            staging=pool.statistics(),
            tiers=tuple(t.statistics() for t in self.tiers),
            **self._counts,
            quarantined=len(self._quarantine),
            breakers=tuple(self.health.state(t.name) for t in self.tiers),
            abandoned_workers=self._window.abandoned_workers,
            leases=len(self._leases),
            saves_skipped=dict(self._saves.skipped),
            warm=self._warmer.statistics(),
        )

    def subscribe(self, listener: Callable[[Record], None]) -> Callable[[], None]:
        """Call ``listener`` with every Probe (lookups), RestoreResult and SaveResult.

        Listeners run synchronously on the event loop right after the operation finished (keep
        them cheap: count, observe a histogram); an exception in one is logged and ignored.
        Returns a function that unsubscribes it. Used by :mod:`bsr.metrics`.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def on_removed(self, listener: RemovalListener) -> Callable[[], None]:
        """Call ``listener(ObjectRemoved)`` whenever an object stops being served by a tier.

        Every tier's own removals (:meth:`Tier.on_removed`: HostTier and FileTier report each
        eviction, delete and quarantine as it happens), each object this engine quarantines
        (it is never read again from that tier, whatever the tier still holds), and what
        :meth:`audit` finds gone. Called on the event loop or a worker thread, at least once
        per removal: keep it cheap, thread-safe and idempotent. Returns an unsubscribe function.
        """
        undo = [t.on_removed(listener) for t in self.tiers]
        undo.append(self._removals.add(listener))

        def unsubscribe() -> None:
            for u in undo:
                u()

        return unsubscribe

    def _quarantined(self, tier: str, object_id: str) -> None:
        self._removals.emit(object_id, Removal.QUARANTINED, tier=tier)

    async def audit(
        self,
        objects: Sequence[tuple[str, ObjectKey]],
        *,
        deadline_s: float | None = None,
        verify: bool | Sequence[bool] = False,
    ) -> list[bool | None]:
        """Whether each ``(tier name, object)`` can still be served from that tier.

        Asks the tier's storage itself (:meth:`Tier.recheck_many`: metadata only), so it finds
        objects removed behind this engine's back (``bsr store gc`` or another server sharing a
        FileTier root, a remote store's own eviction), and reports each one found gone to the
        :meth:`on_removed` listeners (``Removal.VANISHED``). An object this engine quarantined
        is not servable. ``None``: the tier did not answer (an error, or ``deadline_s``
        passed); nothing is reported for it.

        ``verify`` (one flag, or one per object): also read each such object that the tier
        holds back through the tier's own verified read (:meth:`Tier.read_into`: header,
        length and checksums) into one staging slot, one object at a time. A corrupt or
        truncated one is quarantined as a restore would (``Removal.QUARANTINED``) and is not
        servable; one that failed to read is ``None``. It costs a read per object: ask it for
        objects this engine did not just write itself (a save that found them already held).
        """
        pool = self._open_pool()
        deadline = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        return await self._upkeep.audit(pool, objects, deadline, verify)

    def _notify(self, record: Record) -> None:
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # a metrics bug must never fail a restore
                self._log.warning("bsr.engine.listener_failed", error=repr(exc))

    def keys(self, tokens: TokensLike, *, extras: Extras | None = None) -> list[ChunkKey]:
        """Chained keys of every full chunk of ``tokens`` (with ``extras``, see
        :class:`~bsr.KeyExtra`) in this engine's namespace."""
        return chunk_keys(self.namespace_fp, tokens, self.layout.chunk_tokens, extras=extras)

    def objects(self, probe: Probe) -> list[tuple[str, ObjectKey]]:
        """``(tier name, object)`` of every object a restore of ``probe`` reads first."""
        return [
            (probe.holders[c][g][0], ObjectKey(probe.keys[c], g))
            for c, g in needed_objects(self.layout, probe.prefix_chunks)
        ]

    # ------------------------------------------------------------------ lookup
    def split_deadline(self, deadline_s: float | None = None) -> DeadlineSplit:
        """One deadline, from now, for a lookup and the restore after it (a server's
        admission): ``lookup(tokens, deadline_s=split.lookup_s)``, then ``restore(...,
        probe=probe, deadline_s=split.restore_s())``. The lookup waits for the tiers at most
        ``probe_share`` of it (as a restore's own probe does), the restore gets what is left,
        so the two end within ``deadline_s`` (None: the engine's ``deadline_s``; neither is
        bounded when that is None too). ``bsr.kit.admit`` and ``HCache.restore`` use it.

        Raises:
            ConfigError: ``deadline_s`` is not None or a number of seconds > 0.
        """
        given = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        total = self.deadline_s if given is None else given
        return DeadlineSplit(total, self.options.probe_share, time.perf_counter())

    async def lookup(
        self,
        tokens: TokensLike,
        *,
        extras: Extras | None = None,
        lease_ttl_s: float | None = None,
        deadline_s: float | None = None,
        local: bool = False,
        start_tokens: int = 0,
        prefill_tokens_per_s: float | None = None,
        skip_tiers: Collection[str] = (),
    ) -> Probe:
        """Find the reusable prefix of ``tokens`` across tiers, groups and ranks; moves no data.

        With ``lease_ttl_s`` the objects found are pinned against eviction (HostTier, FileTier)
        until a restore given this probe ends, :meth:`Probe.release` is called, or the TTL
        passes; a lease nobody releases is reclaimed by the engine itself once its TTL passed
        (its tier pins released, nothing left behind), so a server may rely on the TTL. The
        probe is good for this engine only. With several ranks every rank must call ``lookup``
        (it runs collectives). ``deadline_s``: a tier still answering then is cut off (it holds
        nothing for this probe and the cut-off counts against its circuit breaker); the probe
        holds what the other tiers answered. ``local``: this rank's prefix alone, with no
        agreement (no collective, so one rank may call it by itself) and no lease; pass such a
        probe to ``restore`` only with one rank. ``extras``: what besides the token ids changes
        the state (:class:`~bsr.KeyExtra`: a tenant's salt, an adapter, an image, prompt
        embeddings); the same extras must be given to ``save`` and ``restore``.
        ``skip_tiers``: names of tiers not to ask (say, ones another rank's lookup found slow
        or down): they hold nothing for this probe and are listed in its ``unanswered``.

        Under policy ``"cost"`` the probe carries a :class:`~bsr.LoadDecision`
        (``probe.decision``): how much of the prefix is worth loading by the measured rates
        (:attr:`cost`), past ``start_tokens`` the caller already holds, at
        ``prefill_tokens_per_s`` if given (else the rate measured by :attr:`cost`). This
        rank's alone: a restore given the probe agrees on it with the other ranks.
        """
        return await self._restores.lookup(
            tokens, extras, lease_ttl_s, deadline_s, local, start_tokens, prefill_tokens_per_s,
            skip_tiers,
        )  # fmt: skip

    async def narrow(
        self,
        probe: Probe,
        tokens: TokensLike,
        *,
        extras: Extras | None = None,
        lease_ttl_s: float | None = None,
    ) -> Probe:
        """The probe of ``tokens``, a prefix of the tokens ``probe`` was made for (same
        ``extras``), from what ``probe`` found: no tier is asked again. For a server that looks
        a prompt up, then restores only part of its prefix (what it offers to load): the
        restore needs a probe of exactly its own tokens, and a second lookup would ask every
        tier again, a slow one included.

        The usable prefix is found again within ``tokens`` from ``probe``'s holders (a sliding
        window's chunks move with the prefix's end); with ``lease_ttl_s`` its objects are
        leased anew (take it before releasing ``probe``'s lease, which stays ``probe``'s).
        One rank's probe only: with several ranks each rank's prefix was agreed with the
        others (look the shorter tokens up again on every rank).

        Raises:
            ConfigError: ``tokens`` (with ``extras``) are not a prefix of ``probe``'s, the probe
                is another engine's, or the engine has several ranks.
        """
        return await self._restores.narrow(probe, tokens, extras, lease_ttl_s)

    # ------------------------------------------------------------------ warm
    async def warm(
        self, tokens: TokensLike, *, extras: Extras | None = None, deadline_s: float | None = None
    ) -> WarmResult:
        """Copy the stored prefix of ``tokens`` into the host tier before a restore asks for it.

        A router's hint that a request for ``tokens`` is about to arrive: the objects of this
        rank's stored prefix that the first tier (a host tier, above at least one other) lacks
        are read from their first healthy holder below it through the engine's staging window,
        checked like every restore read, and written to it; a restore of the prefix then reads
        nothing from a lower tier. A restore that arrives while the warm still copies its
        objects waits for them (within its deadline) instead of reading them twice.

        Never raises for storage failures (a corrupt copy is quarantined and the next holder
        tried; what cannot be read ends the warm there). Cancelling it, or ``deadline_s``
        ending it, leaves whole, verified objects in the host tier or nothing. Idempotent: a
        prefix already there copies nothing. Bounded: at most ``warm_concurrency`` warms and
        promotions run at once (another returns at once with reason ``"busy"``); the bytes
        they write into the host tier while in flight stay within ``warm_budget_bytes`` (a
        longer prefix is warmed up to its leading part that fits, reason ``"budget"``); one
        keeps at most ``min(io_depth, window // 2)`` reads in flight, so restores always find
        half the window. No agreement with other ranks: each rank warms its own objects (call
        it on every rank).

        ``extras``: as given to the ``save`` that stored the prefix (:class:`~bsr.KeyExtra`).
        """
        self._open_pool()
        self._leases.reclaim()
        ext = check_extras(extras)
        deadline = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        return await self._warmer.warm(tokens, ext, deadline)

    async def run_background(self) -> None:
        """Run the engine's background work until cancelled: the promotions restores queue
        (option ``promote``), as they are queued. ``async with engine`` runs it for you; a
        server that opens the engine with :meth:`open` runs it as a task on the engine's loop
        (the vLLM connector does)."""
        self._open_pool()
        await self._warmer.serve()

    async def run_promotions(self) -> list[WarmResult]:
        """Run the promotions queued by restores (option ``promote``) now, one after another.

        Inside ``async with engine`` the engine's background task runs them as they are
        queued; an engine opened with :meth:`open` alone runs them only when this is called
        (e.g. submitted to the engine's loop after each finished restore). Returns what each
        did."""
        self._open_pool()
        return await self._warmer.run_promotions()

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
        probe: Probe | None = None,
        on_installed: OnInstalled | None = None,
        start_tokens: int = 0,
        extras: Extras | None = None,
        skip_tiers: Collection[str] = (),
    ) -> RestoreResult:
        """Restore the longest reusable prefix of ``tokens`` into ``cache`` at ``block_ids``.

        Returns a result that is Committed (``committed_tokens`` tokens are valid in the cache) or
        Invalidated (nothing is valid; recompute). Never raises for storage failures; raises
        typed errors for bad arguments, and re-raises cancellation after releasing every slot.
        ``probe``: a :meth:`lookup` result for the same tokens, reused instead of probing again
        (its leases are released when the restore ends). ``on_installed(chunk, groups)``: called
        on the event loop (awaited if it returns an awaitable) as soon as each chunk is in the
        cache, before the commit, so a caller can overlap its own work (e.g. rebuilding K/V from
        hidden states) with the reads of later chunks; if it raises, the request cannot commit.
        With several ranks every rank must call ``restore`` for the same tokens, all with a
        probe or all without.

        ``block_ids``: the request's block table, one for every state group, or a mapping group
        name -> table (every group of the layout) when the groups' blocks differ, e.g. groups
        whose tensors share memory (vLLM's hybrid KV cache manager: their tables must hold
        different blocks) or a sliding-window group that has blocks for its window only. An
        entry may be ``bsr.NULL_BLOCK`` (-1, no block): bsr neither reads from nor writes to it.
        The tables must hold a block wherever the whole token prefix's state goes (every
        token of a full-attention group, the last ``window_tokens`` tokens of a windowed one),
        else ``BlockTableError``; a shorter probed prefix whose window lies in ``NULL_BLOCK``
        entries cannot commit (``install_failed``).

        ``start_tokens`` (a multiple of the cache's ``block_tokens``): the caller already holds
        valid state for the first ``start_tokens`` tokens in these blocks (e.g. a serving
        engine's own prefix-cache hit). Those tokens are still keyed and probed (the chained keys
        cover the whole prefix), but the chunks entirely below ``start_tokens`` are neither read
        nor installed, and no block before ``start_tokens // block_tokens`` is written (a chunk
        straddling it is read whole and installed from that block on). The commit covers the
        whole prefix, counting those chunks as installed, so it is only as valid as the
        caller's claim; ``bytes_by_tier`` counts only what was read.

        ``extras``: what besides the token ids changed the state (:class:`~bsr.KeyExtra`), as
        given to the ``save`` that stored it (and to ``lookup``, with a ``probe``).

        ``skip_tiers``: names of tiers the restore's probe does not ask: they hold nothing for
        it (``unanswered`` lists them), so it reads what the other tiers hold and waits for none
        of these. For a tier another rank found slow or down: with several ranks, pass every
        rank the same names (the vLLM connector sends each rank's load those rank 0's lookup
        had no answer from). Not with a ``probe``, which was made already: pass them to its
        ``lookup``.

        Raises:
            BlockTableError: malformed block tables (see ``PagedKVCache.block_tables``), or a
                ``NULL_BLOCK`` where the whole prefix's state goes.
            ConfigError: bad arguments, or a ``probe`` that another engine made (refused
                before anything moves; that probe and its lease are left to their engine) or
                that was made for other tokens, or a ``probe`` with ``skip_tiers``.
        """
        started = time.perf_counter()  # the deadline counts from here, admission included
        if probe is not None:
            self._restores.check_probe_origin(probe)
            if skip_tiers:
                raise ConfigError(
                    "a restore given a probe asks no tier, so it has none to skip: pass "
                    "skip_tiers to the lookup that made the probe, or no probe"
                )
        req = self._restores.admit(
            tokens, cache, block_ids, policy, deadline_s, strategy, request_id, started,
            start_tokens, extras, on_installed, skip_tiers,
        )  # fmt: skip
        return await self._restores.run(req, probe)

    # ------------------------------------------------------------------ save
    async def save(
        self,
        tokens: TokensLike,
        cache: PagedKVCache,
        block_ids: Any,
        *,
        tiers: Sequence[str] | None = None,
        extras: Extras | None = None,
        window_checkpoints: bool = False,
    ) -> SaveResult:
        """Store every full chunk of ``tokens`` held in ``cache`` at ``block_ids``.

        Writes through to every tier (or the named ``tiers``), skipping objects a tier already
        holds. ``block_ids``: one table for every group, or a mapping group -> table (see
        :meth:`restore`); only chunks lying wholly in real blocks are read (an object holds its
        whole chunk). A group without a window stores its longest such prefix. A sliding-window
        group stores the chunks of its window at the end of the tokens (and at the longest
        prefix whose every group lies in real blocks, when the end's window does not);
        with ``window_checkpoints`` also at every ``window_checkpoint_chunks``-th chunk
        boundary below the end (where its table holds real blocks), so that a later prompt
        sharing only a shorter prefix restores up to the last checkpoint at or below it. Ask
        for checkpoints only when the sliding group's real blocks hold its state for their
        tokens there: e.g. ``bsr.hf.write_kv_to_cache`` writes a sliding layer's last window
        only, so write the cache at each of :meth:`checkpoint_tokens` first (or give the
        group ``NULL_BLOCK`` where nothing was written). ``saved_tokens``: the longest prefix
        a restore can read from what this save stored. Staging comes from the same W-slot pool
        as restores. A tier's write error is counted in the result and logged; it does not
        stop the other tiers. A tier whose circuit breaker is open (``breaker_threshold``
        failed or cut-off calls, for ``breaker_cooldown_s``) is neither asked nor written: it
        holds nothing for probes until the breaker closes, and one that hangs would hold the
        save; ``SaveResult.skipped["breaker_open"]`` counts the objects it was not given.
        ``extras``: what besides the token ids changed the state (:class:`~bsr.KeyExtra`: a
        tenant's salt, an adapter, an image, prompt embeddings); a later ``restore`` finds it
        only with the same.
        """
        pool = self._open_pool()
        self._leases.reclaim()
        return await self._saves.save(
            pool, tokens, cache, block_ids, tiers, extras, window_checkpoints
        )

    def checkpoint_tokens(self, num_tokens: int) -> tuple[int, ...]:
        """The prefix lengths, in tokens, below ``num_tokens`` at which a save with
        ``window_checkpoints`` stores each sliding-window group's window (every
        ``window_checkpoint_chunks``-th chunk boundary; none without a window group or with
        checkpoints off). A server whose model keeps only a sliding layer's last window (a
        transformers ``DynamicCache``) writes its paged cache at each of them while it
        prefills, and at the end."""
        n = non_negative_int(num_tokens, "num_tokens")
        if all(g.window_tokens is None for g in self.layout.groups):
            return ()
        ct, every = self.layout.chunk_tokens, self.window_checkpoint_chunks
        return tuple(c * ct for c in checkpoint_ends(self.layout.num_chunks(n), every))
