"""RestoreEngine: probe, bounded windowed restore with all-or-nothing commit, and save.

Where it runs: the serving process's event loop (any anyio backend); one engine per rank.

How it works: the engine owns what lives as long as it does: the tiers, the W-slot staging pool,
the transfer pipeline, tier health, quarantine, probe leases and the measured costs. A restore is
admitted here (its arguments checked, its request record opened, no I/O) and then run as a
:class:`~bsr.engine._job.RestoreJob`, whose phases (probe, window, settle, agree; release in the
engine's ``finally``) each return what the next one takes; see :mod:`bsr.engine._job`. A save
goes straight to :func:`~bsr.transfer._save.save_chunks` through the same staging pool.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Self

import anyio

from .._check import Check, non_negative_int, optional_positive_seconds
from .._errors import (
    BlockTableError,
    BsrError,
    ClosedError,
    ConfigError,
    ObjectError,
    ObjectNotFoundError,
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
    token_count,
)
from ..core._layout import StateLayout
from ..core._lifecycle import Reason, RequestLifecycle
from ..core._options import Policy, Promote, Strategy, choice
from ..core._plan import checkpoint_ends, needed_objects
from ..core._results import Probe, RestoreResult, SaveResult
from ..tiers._base import Tier, TierLease, TierStatistics
from ..tiers._watch import Removal, RemovalFeed, RemovalListener
from ..transfer._cache import PagedKVCache
from ..transfer._pipeline import WindowPipeline
from ..transfer._run import OnInstalled
from ..transfer._save import save_chunks
from ..transfer._staging import StagingPool, StagingStatistics
from ..transfer._tables import BlockTables
from ._config import EngineConfig
from ._coordinator import Coordinator, LocalCoordinator
from ._cost import CostModel
from ._decisions import Quarantine, TierQuarantine
from ._from_config import configured
from ._health import BreakerState, TierHealth
from ._job import RestoreJob, RestoreParts
from ._leases import LeaseBook, ProbeLease
from ._options import EngineArguments, check_budget, check_tiers, takes_options
from ._probe import Prober
from ._request import RestoreRequest
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
        window, io_depth, memory_workers, policy, deadline_s, pin_staging, prefault_staging,
            breaker_threshold, breaker_cooldown_s, shield_timeout_s, staging_budget_bytes,
            window_checkpoint_chunks, promote, warm_budget_bytes, warm_concurrency: the knobs,
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
        self.coordinator: Coordinator = args.coordinator or LocalCoordinator()
        self._check_coordinator()
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
        self._ids = itertools.count()
        self._counts = {"restores": 0, "committed": 0, "invalidated": 0, "saves": 0}
        self._saves_skipped: dict[str, int] = {}
        self._log = logger.bind(rank=namespace.tp_rank, model=namespace.model_id)
        self._listeners: list[Callable[[Record], None]] = []
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
            self._window, self._open_pool, self._move_out, o.shield_timeout_s,
            o.pin_staging, o.staging_budget_bytes,
        )  # fmt: skip
        self._warmer = Warmer(
            layout, self.tiers, self._prober, self.health, self._quarantine, self._open_pool,
            self._move_out, io_depth=o.io_depth, window=o.window,
            budget_bytes=o.warm_budget_bytes, concurrency=o.warm_concurrency,
            promote=Promote(o.promote), shield_timeout_s=o.shield_timeout_s, log=self._log,
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

    def _check_coordinator(self) -> None:
        c, ns = self.coordinator, self.namespace
        if c.world_size != ns.tp_size or c.rank != ns.tp_rank:
            raise ConfigError(
                f"coordinator is rank {c.rank} of {c.world_size} but the namespace says "
                f"tp_rank={ns.tp_rank}, tp_size={ns.tp_size}; make them agree"
            )

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
        owed = self._quarantine.take_deferred()
        if owed:  # moves out of a tier that a cancel or a bound cut short, tried once more
            with anyio.CancelScope(shield=True):
                await self._move_out(owed, self.shield_timeout_s, self._log)
        for t in self.tiers:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.shield_timeout_s) as sc:
                try:
                    await t.aclose()
                except Exception as exc:
                    self._log.warning("bsr.tier.close_failed", tier=t.name, error=repr(exc))
            if sc.cancelled_caught:
                self._log.warning("bsr.tier.close_timeout", tier=t.name)
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
            saves_skipped=dict(self._saves_skipped),
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
        checks = [bool(verify)] * len(objects) if isinstance(verify, bool) else list(verify)
        if len(checks) != len(objects):
            raise ConfigError(
                f"verify has {len(checks)} flags for {len(objects)} objects; pass one flag, or "
                "one per object"
            )
        by_tier: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(objects):
            self._tier(name)  # an unknown tier name is the caller's error
            by_tier.setdefault(name, []).append(i)
        out: list[bool | None] = [None] * len(objects)
        with anyio.move_on_after(math.inf if deadline is None else deadline):
            for name, idx in by_tier.items():
                try:
                    held = await self._tier(name).recheck_many([objects[i][1] for i in idx])
                except (BsrError, OSError) as exc:
                    self._log.warning("bsr.engine.audit_failed", tier=name, error=repr(exc))
                    continue
                unread: list[int] = []
                for i, h in zip(idx, held):
                    oid = objects[i][1].object_id
                    out[i] = bool(h) and (name, oid) not in self._quarantine
                    if not h:
                        self._removals.emit(oid, Removal.VANISHED, tier=name)
                    elif out[i] and checks[i]:
                        out[i] = None  # not known good until read back
                        unread.append(i)
                if unread:
                    await self._verify_held(pool, name, [(i, objects[i][1]) for i in unread], out)
        return out

    async def _verify_held(
        self,
        pool: StagingPool,
        name: str,
        objects: list[tuple[int, ObjectKey]],
        out: list[bool | None],
    ) -> None:
        """:meth:`audit`'s read-back: each object through ``tier.read_into`` into one staging
        slot (the slot goes back in ``finally``); ``out[i]`` is True (it verified), False (gone,
        or corrupt and now quarantined) or stays None (the read failed otherwise)."""
        tier = self._tier(name)
        slot = await pool.acquire()
        try:
            for i, okey in objects:
                try:
                    nbytes = self.layout.group_chunk_bytes(okey.group)
                    await tier.read_into(okey.chunk, okey.group, slot.tensor[:nbytes])
                except ObjectNotFoundError:
                    out[i] = False
                    self._removals.emit(okey.object_id, Removal.VANISHED, tier=name)
                except ObjectError as exc:  # corrupt or truncated: never served, moved out
                    out[i] = False
                    self._log.warning(
                        "bsr.engine.audit_corrupt", tier=name, key=okey.chunk.hex[:16],
                        group=okey.group, error=repr(exc),
                    )  # fmt: skip
                    self._quarantine.add(name, okey.object_id)
                    why = type(exc).__name__
                    await self._move_out(
                        [TierQuarantine(name, okey.chunk, okey.group, why)],
                        self.shield_timeout_s,
                        self._log,
                    )
                except (BsrError, OSError) as exc:
                    self._log.warning("bsr.engine.audit_unread", tier=name, error=repr(exc))
                else:
                    out[i] = True
        finally:
            pool.release(slot)

    def _notify(self, record: Record) -> None:
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # a metrics bug must never fail a restore
                self._log.warning("bsr.engine.listener_failed", error=repr(exc))

    def _check_cache(self, cache: PagedKVCache) -> None:
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"cache must be a bsr.PagedKVCache, got {type(cache).__name__}")
        cache.check_layout(self.layout)

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

        Under policy ``"cost"`` the probe carries a :class:`~bsr.LoadDecision`
        (``probe.decision``): how much of the prefix is worth loading by the measured rates
        (:attr:`cost`), past ``start_tokens`` the caller already holds, at
        ``prefill_tokens_per_s`` if given (else the rate measured by :attr:`cost`). This
        rank's alone: a restore given the probe agrees on it with the other ranks.
        """
        self._open_pool()
        self._leases.reclaim()
        extras = check_extras(extras)
        ttl = optional_positive_seconds(lease_ttl_s, "lease_ttl_s", key="lease_ttl_s")
        deadline = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        if Check.flag(local, "local") and ttl is not None:
            raise ConfigError(
                "a local lookup takes no lease (its probe is one rank's); drop lease_ttl_s or "
                "local=True"
            )
        probe = (
            await self._prober.probe(
                tokens, deadline_s=deadline, partial=True, agree=not local, extras=extras
            )
        ).probe
        if self.policy is Policy.COST:
            probe = replace(probe, decision=self.cost.decide(
                self.layout, probe, start_tokens=start_tokens, prefill_rate=prefill_tokens_per_s,
            ))  # fmt: skip
        if ttl is not None and probe.prefix_chunks:
            probe = replace(probe, lease=await self._lease(probe, ttl))
        self._log.debug(
            "bsr.probe", tokens=probe.num_tokens, prefix_tokens=probe.prefix_tokens,
            local_chunks=probe.local_chunks, bytes_by_tier=probe.bytes_by_tier,
        )  # fmt: skip
        self._notify(probe)
        return probe

    async def _lease(self, probe: Probe, ttl_s: float) -> ProbeLease:
        by_tier: dict[str, list[ObjectKey]] = {}
        for c, g in needed_objects(self.layout, probe.prefix_chunks):
            for name in probe.holders[c][g]:
                by_tier.setdefault(name, []).append(ObjectKey(probe.keys[c], g))
        leases: list[TierLease] = []
        try:
            for tier in self.tiers:
                if tier.name in by_tier:
                    leases.append(await tier.lease(by_tier[tier.name], ttl_s))
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        return self._leases.add(leases, ttl_s)

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

        Raises:
            BlockTableError: malformed block tables (see ``PagedKVCache.block_tables``), or a
                ``NULL_BLOCK`` where the whole prefix's state goes.
            ConfigError: bad arguments, or a ``probe`` that another engine made (refused
                before anything moves; that probe and its lease are left to their engine) or
                that was made for other tokens.
        """
        started = time.perf_counter()  # the deadline counts from here, admission included
        if probe is not None:
            self._check_probe_origin(probe)
        req = self._admit(
            tokens, cache, block_ids, policy, deadline_s, strategy, request_id, started,
            start_tokens, extras, on_installed,
        )  # fmt: skip
        return await self._run(req, probe)

    async def _run(self, req: RestoreRequest, probe: Probe | None) -> RestoreResult:
        """Run an admitted restore (after any warm copying its objects), then note it for
        promotion."""
        try:  # a warm copying these objects now: wait for it rather than read them twice
            probe = await self._warmer.join(req.tokens, req.extras, probe, req.deadline_at)
        except BaseException as exc:
            if probe is not None:
                probe.release()  # the job that would have released its leases never ran
            self._abort(req, exc)
            raise
        job = RestoreJob(self._parts, req, probe)
        try:
            restored = await job.run()
        except BaseException as exc:
            self._abort(req, exc)
            raise
        finally:
            await job.release()
        result = self._finish(req, job.result(restored))
        if result.committed and restored.window is not None:
            self._warmer.after_restore(
                restored.window.probe.keys[: result.committed_tokens // self.layout.chunk_tokens],
                result.committed_tokens, result.bytes_by_tier,
            )  # fmt: skip
        return result

    def _check_probe_origin(self, probe: Probe) -> None:
        if not isinstance(probe, Probe):
            raise ConfigError(f"probe must be a bsr.Probe from lookup(), got {type(probe)}")
        if probe.origin != self._prober.origin:
            # refused before anything moves; the probe (and its lease) stays its engine's
            raise ConfigError(
                "probe was made by another RestoreEngine (it names that engine's tiers and "
                "holds that engine's leases); pass it to the engine whose lookup() made it, or "
                "pass no probe to probe again"
            )

    def _admit(
        self,
        tokens: TokensLike,
        cache: PagedKVCache,
        block_ids: Any,
        policy: Policy | str | None,
        deadline_s: float | None,
        strategy: Strategy | str,
        request_id: str | None,
        started: float,
        start_tokens: int = 0,
        extras: Extras | None = None,
        on_installed: OnInstalled | None = None,
    ) -> RestoreRequest:
        """Check the arguments and open the request's record (no I/O).

        Runs on the event loop, before the first checkpoint, so it must stay cheap (the block
        table check is a NumPy sort); its time counts against the deadline, which runs from
        ``started`` (when ``restore`` was called).
        """
        self._open_pool()
        self._leases.reclaim()
        self._check_cache(cache)
        ext = check_extras(extras)
        first_block, valid_chunks = self._start(start_tokens, cache)
        n_full = self.layout.num_chunks(token_count(tokens))
        tables = cache.block_tables(block_ids, n_full * self.layout.chunk_tokens)
        _check_serves(tables, n_full, first_block, self.layout.chunk_tokens)
        deadline = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        deadline = self.deadline_s if deadline is None else deadline
        rid = request_id or f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        life = RequestLifecycle(rid, rank=self.namespace.tp_rank)
        life.facts.layout = self.layout
        asked = self.policy if policy is None else choice(Policy, policy, "policy")
        # policy "cost" decides how much to load, then commits that all-or-nothing
        life.facts.policy = Policy.ALL_OR_NOTHING if asked is Policy.COST else asked
        self._counts["restores"] += 1
        return RestoreRequest(
            rid=rid, life=life, log=self._log.bind(request_id=rid), tokens=tokens, extras=ext,
            cache=cache, cost=asked is Policy.COST,
            tables=tables, policy=life.facts.policy,
            strategy=choice(Strategy, strategy, "strategy"),
            deadline_at=None if deadline is None else started + deadline, t0=started,
            first_block=first_block, valid_chunks=valid_chunks, on_installed=on_installed,
        )  # fmt: skip

    def _start(self, start_tokens: int, cache: PagedKVCache) -> tuple[int, int]:
        """``(first block to write, chunks already valid)`` for ``restore(start_tokens=...)``."""
        start = non_negative_int(start_tokens, "start_tokens")
        if start % cache.block_tokens:
            raise ConfigError(
                f"start_tokens={start} is not a multiple of the cache's block_tokens="
                f"{cache.block_tokens}; pass the tokens of whole blocks the cache already holds",
                start_tokens=start,
            )
        return start // cache.block_tokens, start // self.layout.chunk_tokens

    async def _move_out(self, moves: list[TierQuarantine], budget: float, log: Any) -> None:
        """Ask each tier to quarantine its objects within ``budget``; defer what is left."""
        left = list(moves)
        try:
            with anyio.move_on_after(budget):
                while left:
                    q = left[0]
                    try:
                        await self._tier(q.tier).quarantine(q.key, q.group, q.why)
                    except Exception as exc:
                        log.warning("bsr.tier.quarantine_failed", tier=q.tier, error=repr(exc))
                    left.pop(0)
        finally:
            if left:
                self._quarantine.defer(left)
                log.warning("bsr.tier.quarantine_deferred", objects=len(left))

    def _abort(self, req: RestoreRequest, exc: BaseException) -> None:
        """Cancellation or a bug: never leave the request non-terminal."""
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        if not req.life.terminal:
            req.life.invalidate(Reason.CANCELLED if cancelled else Reason.INTERNAL_ERROR)
        self._counts["invalidated"] += 1
        req.log.warning("bsr.restore.aborted", reason=str(req.life.reason), error=repr(exc))

    def _finish(self, req: RestoreRequest, result: RestoreResult) -> RestoreResult:
        self._counts["committed" if result.committed else "invalidated"] += 1
        self.cost.observe_restore(result)
        req.log.info(
            "bsr.restore.done", state=str(result.state), reason=str(result.reason),
            committed_tokens=result.committed_tokens, probed_tokens=result.probed_tokens,
            bytes_by_tier=result.bytes_by_tier, rws_peak_bytes=result.rws_peak_bytes,
            total_s=round(result.timings.total_s, 6), strategy=str(result.strategy.value),
        )  # fmt: skip
        self._notify(result)
        return result

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
        stop the other tiers. ``extras``: what besides the token ids changed the state
        (:class:`~bsr.KeyExtra`: a tenant's salt, an adapter, an image, prompt embeddings); a
        later ``restore`` finds it only with the same.
        """
        every = (
            self.window_checkpoint_chunks
            if Check.flag(window_checkpoints, "window_checkpoints")
            else None
        )
        pool = self._open_pool()
        self._leases.reclaim()
        self._check_cache(cache)
        keyed = await self._prober.keyed(tokens, check_extras(extras))
        tables = cache.block_tables(block_ids, len(keyed.keys) * self.layout.chunk_tokens)
        targets = self.tiers if tiers is None else [self._tier(name) for name in tiers]
        quarantine = self._quarantine
        result = await save_chunks(
            layout=self.layout, tiers=targets, account=pool.account(), cache=cache, tables=tables,
            keys=list(keyed.keys), io_depth=self.io_depth, log=self._log,
            # a fresh copy replaces a quarantined one: probes may see it again
            on_written=lambda tier, okey: quarantine.lift(tier.name, okey.object_id),
            is_retired=lambda tier, okey: quarantine.retired(tier.name, okey.object_id),
            checkpoint_chunks=every,
        )  # fmt: skip
        self._counts["saves"] += 1
        for reason in result.skipped:
            self._saves_skipped[reason] = self._saves_skipped.get(reason, 0) + 1
        self._log.info(
            "bsr.save.done", tokens=result.saved_tokens, chunks=result.chunks,
            written=result.objects_written, skipped=result.objects_skipped,
            busy_skipped=result.skipped, errors=result.errors,
            duration_s=round(result.duration_s, 6),
        )  # fmt: skip
        self._notify(result)
        return result

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

    def _tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")


def _check_serves(tables: BlockTables, n_full: int, first_block: int, chunk_tokens: int) -> None:
    """Refuse tables that hold no block where the whole token prefix's state would go."""
    bad = tables.unserved(n_full, first_block)
    if bad is not None:
        group, block = bad
        raise BlockTableError(
            f"the block table of group {group!r} holds NULL_BLOCK at index {block}, where a "
            f"restore of {n_full * chunk_tokens} tokens installs that group's state; give it a "
            "block there (a sliding-window group needs blocks for its window only), or restore "
            "fewer tokens",
            group=group,
            index=block,
        )
