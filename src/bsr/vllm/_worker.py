"""The worker side of BsrConnector: bsr's engine over vLLM's KV tensors, loads and saves.

Where it runs: every vLLM worker process (one per tensor-parallel rank; a separate process from
the scheduler on the CPU build even with one worker). vLLM calls its hooks from the worker's
main thread; bsr's engine lives on the connector's own event-loop thread (:class:`LoopThread`).

How it works:

* ``register_kv_caches`` derives bsr's layout from vLLM's tensors and views them with no copy
  (:mod:`bsr.vllm._layout`), builds the engine from the ``"bsr"`` config and opens it; rank 0
  serves the scheduler's lookups on a private socket (:mod:`bsr.vllm._lookup`), whose path
  vLLM's handshake carries to the scheduler. A lookup runs on the loop under
  ``lookup_timeout_s`` (``RestoreEngine.lookup(deadline_s=...)``: a hung tier is cut off and its
  breaker counts it) and keeps its probe leased for the load that follows.
* Loads. Async mode: ``start_load_kv`` starts each load on the loop and returns; the load runs
  across engine steps through the shared W-slot window; ``get_transfer_results`` reports it
  received once its task has ended, and failed (``failed_recving``) unless it committed every
  promised token. Sync mode: ``start_load_kv`` waits for the step's loads and reports the blocks
  of a failed one through ``get_block_ids_with_load_errors``. Every load restores past vLLM's
  own prefix-cache hit only (``RestoreEngine.restore(start_tokens=...)``).
* Aborts. A request that finishes while its load runs is cancelled (with one rank; with several
  the load runs to its end, since the ranks' restores run collectives in one order); it is
  reported received only once its task has ended, when bsr's install gate is closed and no copy
  into its blocks can happen any more, so vLLM hands its blocks to another request only then.
* Saves. ``wait_for_save`` starts the saves the scheduler sent; ``get_transfer_results``
  reports each once done, and vLLM frees its blocks then. Window saves (a sliding group's window
  while its request runs, :mod:`bsr.vllm._windows`) start there too, after the step's forward
  wrote the window; each is reported done to the scheduler, which holds their blocks till then.
  A save is cut at ``save_timeout_s`` (a stuck store, a root locked by a stopped peer) and
  reported done once its task has ended (nothing reads the blocks then), counted in
  ``saves_skipped`` as ``timeout``; a save that skipped a busy tier is counted there under the
  tier's reason (``root_locked``).
* Adapters. A LoRA request's keys name vLLM's adapter id only; this process's
  :class:`~bsr.vllm._adapters.AdapterBook` (fed by hooks on vLLM's LoRA manager) replaces it by
  the digest of the weights vLLM loaded: a lookup or a load with the weights loaded now (not
  loaded: a miss, never a wait or a file read), a save with the weights that computed the
  request (bound when the worker first saw it; two sets of weights during its life: not saved,
  ``saves_skipped{reason="adapter_changed"}``).
* Outcomes (:class:`BsrWorkerMetadata`) and stats (:class:`BsrConnectorStats`) go back with
  every step; request counts from rank 0 only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from bsr import (
    NULL_BLOCK,
    BsrError,
    KeyExtra,
    PagedKVCache,
    Policy,
    Probe,
    RestoreEngine,
    RestoreResult,
    SaveResult,
    StateLayout,
    Tier,
    TorchDistributedCoordinator,
)

from .._log import logger
from ._adapters import AdapterBook, adapter_book, unbound_extras
from ._bridge import LoopThread
from ._fleet import WorkerFleet
from ._kv_events import group_specs
from ._layout import GroupSpec, derive, group_window, layer_order
from ._lookup import SKIP_TIERS_MAX, LookupHints, LookupServer, private_socket_path
from ._metadata import (
    NULL_BLOCK_ID,
    BsrConnectorMetadata,
    BsrHandshake,
    BsrWorkerMetadata,
    LoadJob,
    SaveJob,
    WindowJob,
)
from ._options import ConnectorSettings
from ._stats import BsrConnectorStats
from ._warm_http import WarmService

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from ._events import ChunkNotice

#: extra time a sync step waits past the load deadline before it cancels the load
SYNC_GRACE_S = 2.0
#: how long cancelling a load may take to unwind (bsr bounds its own cleanup well below this)
UNWIND_S = 30.0
#: finished request ids kept for saves that have not arrived yet, in engine steps
FINISHED_KEEP_STEPS = 64
#: what a save cut by ``save_timeout_s`` returns (its ``saves_skipped`` reason)
SAVE_TIMED_OUT = "timeout"
#: how much past ``lookup_timeout_s`` a lookup may run before the worker gives up on it: the
#: engine's own deadline (``lookup_timeout_s``) cuts a slow tier off first and answers with what
#: the others hold; this is the backstop behind it, within the scheduler's grace
#: (``_scheduler.LOOKUP_GRACE_S``)
LOOKUP_BACKSTOP_S = 0.5


@dataclass
class _Load:
    """One load's task on the loop; ``done`` is set once the task has ended (no more writes)."""

    job: LoadJob
    done: threading.Event = field(default_factory=threading.Event)
    scope: anyio.CancelScope | None = None
    cancelled: bool = False
    aborted: bool = False  # the request finished while this load ran
    unbound: bool = False  # its adapter is not loaded here (or changed): restored as a miss
    result: RestoreResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        r = self.result
        return r is not None and r.committed and r.committed_tokens >= self.job.end_tokens

    @property
    def reason(self) -> str:
        """Why it did not commit what was promised (a ``failed_loads`` label)."""
        r = self.result
        if self.unbound:
            return "adapter_not_loaded"
        if r is not None:
            # a probe at load time that found less (evicted meanwhile) commits a shorter prefix
            return "shorter_prefix" if r.committed else str(r.reason.value)
        return "cancelled" if self.cancelled else "error"


class BsrWorker:
    """The connector's worker side (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, kv_cache_config: KVCacheConfig | None) -> None:
        self.settings = settings
        self.opts = settings.options
        self._kv_cache_config = kv_cache_config
        self.tp_rank = 0
        self.engine: RestoreEngine | None = None
        self.cache: PagedKVCache | None = None
        self.groups: tuple[str, ...] = ()  # bsr's group per vLLM KV cache group, in vLLM's order
        self.loop: LoopThread | None = None
        self._server: LookupServer | None = None
        self._probes: dict[int, tuple[float, Probe]] = {}  # loop thread only
        self._tp_lock: anyio.Lock | None = None
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, concurrent.futures.Future[SaveResult | str | None]] = {}
        self._window_saves: dict[int, concurrent.futures.Future[list[SaveResult]]] = {}
        self._windows_done: dict[int, int] = {}  # window jobs to report (job -> 1)
        # fleet notices taken (and counted) for the next worker metadata: vLLM takes a step's
        # stats before its worker metadata, so they are taken with the stats
        self._notices: list[ChunkNotice] = []
        self._finished: dict[str, int] = {}  # request -> step it was reported finished
        self._step = 0
        self._load_errors: set[int] = set()
        self._outcomes: dict[str, bool] = {}
        self.stats = BsrConnectorStats()
        self.fleet: WorkerFleet | None = None  # events, per-tier answers, cost (_fleet.py)
        self._audit: concurrent.futures.Future[None] | None = None
        self.warming: WarmService | None = None  # the warm endpoint and promotions
        self._log = logger.bind(role="worker", model=settings.model_id)
        # the LoRA weights vLLM loads in this process, hooked before any adapter is loaded
        self.adapters: AdapterBook = adapter_book()

    # ================================================================== startup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """View vLLM's per-layer KV tensors (no copy), build and open the engine."""
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        if num_blocks <= 0:
            num_blocks = int(next(iter(kv_caches.values())).shape[0])
        specs = self._group_specs(kv_caches)
        self.groups = tuple(spec.name for spec in specs)
        layout, cache = derive(
            kv_caches,
            specs,
            num_blocks=num_blocks,
            block_tokens=self.settings.block_size,
            chunk_tokens=self.settings.chunk_tokens,
        )
        self.cache = cache
        coordinator = self._coordinator()
        engine = self.build_engine(layout, coordinator)
        self.loop = LoopThread()
        error: BaseException | None = None
        try:
            self.loop.call(engine.open)
        except Exception as exc:
            error = exc
        # every rank serves with bsr, or none does (the vote is a collective: always cast)
        if (
            coordinator is not None
            and not self.loop.call(coordinator.agree_all, error is None)
            and error is None
        ):
            error = RuntimeError("another tensor-parallel rank could not open its store")
        if error is not None:  # a store that cannot open: serve without bsr, say so
            self._log.error(
                "bsr.vllm.disabled",
                error=repr(error),
                note="the bsr engine did not open; every lookup misses and nothing is saved",
            )
            self.loop.call_bounded(engine.aclose, timeout=10.0)
        else:
            self.engine = engine
            self._tp_lock = self.loop.call(_new_lock)
            self.fleet = WorkerFleet(
                self.settings, engine, self.groups, group_specs(self._kv_cache_config),
                self.tp_rank, self.stats,
            )  # fmt: skip
            if self.fleet.journal is not None:
                self._audit = self.loop.submit(self.fleet.audit_forever)
            self.warming = WarmService(
                engine, self.loop, self.adapters, self.stats, rank=self.tp_rank,
                address=self.opts.warm_address, timeout_s=self.opts.warm_timeout_s,
            )  # fmt: skip
            if self.tp_rank == 0:  # the scheduler asks rank 0
                self._server = LookupServer(
                    private_socket_path(),
                    self._on_lookup,
                    max_connections=self.opts.lookup_connections,
                    read_timeout_s=self.opts.lookup_read_timeout_s,
                )
        self._log.info(
            "bsr.vllm.registered",
            layers=len(kv_caches),
            groups=[g.to_dict() for g in layout.groups],
            chunk_tokens=self.settings.chunk_tokens,
            num_blocks=num_blocks,
            load=self.opts.load,
            socket=None if self._server is None else self._server.path,
            tp=f"{self.tp_rank}/{self.settings.tp_size}",
            pid=os.getpid(),
        )

    def _group_specs(self, kv_caches: dict[str, torch.Tensor]) -> list[GroupSpec]:
        groups = list(getattr(self._kv_cache_config, "kv_cache_groups", ()) or ())
        if not groups:
            return [GroupSpec("kv", tuple(sorted(kv_caches, key=layer_order)))]
        out = []
        for i, g in enumerate(groups):
            names = tuple(sorted((n for n in g.layer_names if n in kv_caches), key=layer_order))
            window = group_window(g.kv_cache_spec)
            out.append(GroupSpec("kv" if len(groups) == 1 else f"kv{i}", names, window))
        return out

    def _coordinator(self) -> TorchDistributedCoordinator | None:
        """bsr's agreement over vLLM's tensor-parallel ranks (None with one rank).

        A gloo group of its own over the TP group's ranks: vLLM's own groups run vLLM's
        collectives on other threads, and two threads must never share a group.
        """
        if self.settings.tp_size == 1:
            return None
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        group = dist.new_group(ranks=list(get_tp_group().ranks), backend="gloo")
        coordinator = TorchDistributedCoordinator(group)
        self.tp_rank = coordinator.rank
        return coordinator

    def build_engine(
        self, layout: StateLayout, coordinator: TorchDistributedCoordinator | None
    ) -> RestoreEngine:
        """The rank's engine from the ``"bsr"`` config (not opened yet)."""
        s = self.settings
        config = dataclasses.replace(s.engine, model_id=s.model_id)
        # the config's tenant salt, and the model config the KV was computed with: a server
        # whose model computes differently (same model_id) misses instead of reading it
        namespace = dataclasses.replace(
            config.namespace(tp_rank=self.tp_rank, tp_size=s.tp_size),
            config_digest=s.config_digest,
        )
        if s.tp_size > 1:  # each rank's instance, as its tier's options say (own roots)
            tiers = tuple(t.for_rank(self.tp_rank, s.tp_size) for t in config.tiers)
            config = dataclasses.replace(config, tiers=tiers)
        built = self.wrap_tiers(config.build_tiers())
        return RestoreEngine.from_config(
            config, layout=layout, namespace=namespace, coordinator=coordinator, tiers=built
        )

    def wrap_tiers(self, tiers: list[Tier]) -> list[Tier]:
        """The tiers the rank's engine uses, given those the config built (not opened yet,
        fastest first). Override to put wrappers in front of them (a throttle, a fault injector,
        a metrics probe); every engine setting still comes from the config. Default: as built."""
        return tiers

    def handshake(self) -> BsrHandshake | None:
        if self._server is None:
            return None
        return BsrHandshake(self._server.path, () if self.fleet is None else self.fleet.tiers())

    # ================================================================== lookups
    def _on_lookup(
        self,
        conn_id: int,
        seq: int,
        tokens: np.ndarray,
        extras: tuple[KeyExtra, ...],
        hints: LookupHints | None = None,
    ) -> None:
        """Server thread: start the lookup on the loop and return at once."""
        assert self.loop is not None
        self.loop.submit(self._lookup_job, conn_id, seq, tokens, extras, hints or LookupHints())

    async def _lookup_job(
        self,
        conn_id: int,
        seq: int,
        tokens: np.ndarray,
        extras: tuple[KeyExtra, ...],
        hints: LookupHints,
    ) -> None:
        hit, by_tier = 0, [0]
        skip: tuple[int, ...] = ()
        try:
            bound = self.adapters.resolve(extras)
            if bound is None:  # its adapter is not loaded here: a miss, at once
                self.stats.count("adapter_misses")
                return
            with anyio.move_on_after(self.opts.lookup_timeout_s + LOOKUP_BACKSTOP_S) as scope:
                hit, probe = await self._lookup(seq, tokens, bound, hints)
                for name in probe.unanswered if probe is not None else ():
                    self.stats.count_key("lookup_unanswered", name)
                if probe is not None and hit:
                    skip = self._skip_of(probe)
                if probe is not None and self.fleet is not None:
                    by_tier = self.fleet.by_tier(probe, hit, hints.start_tokens)
            if scope.cancelled_caught:
                self.stats.count("lookups_timed_out")
                self._log.warning("bsr.vllm.lookup_cut", s=self.opts.lookup_timeout_s)
        except Exception as exc:  # a failed lookup is a miss
            self._log.warning("bsr.vllm.lookup_failed", error=repr(exc))
        finally:
            if self._server is not None:
                self._server.reply(conn_id, seq, hit, by_tier, skip)

    async def _lookup(
        self,
        seq: int,
        tokens: np.ndarray,
        extras: tuple[KeyExtra, ...] = (),
        hints: LookupHints | None = None,
    ) -> tuple[int, Probe | None]:
        """The prefix of ``tokens`` (keyed with ``extras``) to offer, and the probe that found
        it (of exactly that prefix, leased). Under policy "cost": the part worth loading past
        the hints' ``start_tokens`` at their prefill rate."""
        engine = self.engine
        if engine is None:
            return 0, None
        h = hints or LookupHints()
        timeout = self.opts.lookup_timeout_s
        how: dict[str, Any] = {
            "extras": extras, "start_tokens": h.start_tokens,
            "prefill_tokens_per_s": h.prefill_rate or None,
        }  # fmt: skip
        if self.settings.tp_size > 1:  # rank 0 alone: no collective, no lease (see restore)
            probe = await engine.lookup(tokens, deadline_s=timeout, local=True, **how)
            if len(self._skip_of(probe)) < len(probe.unanswered):
                # every rank's load probes again, skipping the tiers the answer names: one it
                # cannot name would hold each rank's probe until the load's deadline
                return 0, probe
            return self._offer(probe, h, seq), probe
        ttl = self.opts.lease_ttl_s
        probe = await engine.lookup(tokens, lease_ttl_s=ttl, deadline_s=timeout, **how)
        hit = self._offer(probe, h, seq)
        if 0 < hit < len(tokens):
            # a restore reuses a probe of exactly its own tokens: cut from this one, leased
            # before this one's lease goes (a second lookup would ask every tier again, one
            # this lookup cut off for being slow included)
            try:
                exact = await engine.narrow(probe, tokens[:hit], extras=extras, lease_ttl_s=ttl)
            finally:
                probe.release()
            probe = exact
            if exact.prefix_tokens != hit:  # a window the shorter prefix needs is not held
                exact.release()
                return exact.prefix_tokens, exact
        if hit == 0:
            probe.release()
            return 0, probe
        self._keep_probe(seq, probe)
        return hit, probe

    def _skip_of(self, probe: Probe) -> tuple[int, ...]:
        """The engine's tiers (by index) ``probe`` had no answer from, that an answer can name
        (the load's probe skips them: ``LoadJob.skip_tiers``)."""
        assert self.engine is not None
        names = [t.name for t in self.engine.tiers]
        found = (names.index(n) for n in probe.unanswered if n in names)
        return tuple(i for i in found if i < SKIP_TIERS_MAX)

    def _offer(self, probe: Probe, hints: LookupHints, seq: int) -> int:
        if self.fleet is None:
            return probe.prefix_tokens
        return self.fleet.offer(probe, hints.start_tokens, seq)

    def _keep_probe(self, seq: int, probe: Probe) -> None:
        now = time.monotonic()
        for old in [s for s, (t, _) in self._probes.items() if now - t > self.opts.lease_ttl_s]:
            self._probes.pop(old)[1].release()
        self._probes[seq] = (now, probe)

    async def _forget(self, seqs: list[int], everything: bool) -> None:
        for seq in list(self._probes) if everything else seqs:
            entry = self._probes.pop(seq, None)
            if entry is not None:
                entry[1].release()

    # ================================================================== loads
    def start_load(self, meta: BsrConnectorMetadata) -> None:
        """Start this step's loads (async mode) or run them to their end (sync mode)."""
        loop = self.loop
        if loop is not None and (meta.forget_lookups or meta.forget_all):
            loop.submit(self._forget, list(meta.forget_lookups), meta.forget_all)
        for rid, lora_id in meta.adapters.items():  # vLLM loaded this step's adapters already
            self.adapters.bind(rid, lora_id)
        if not meta.loads:
            return
        loads = [_Load(job) for job in meta.loads]
        for load in loads:
            if self.engine is None or loop is None or self.cache is None:
                load.error = "bsr is disabled"
                load.done.set()
            else:
                loop.submit(self._run_load, load)
        if self.opts.asynchronous:
            self._loads.update((load.job.req_id, load) for load in loads)
            return
        self._wait_sync(loads)
        for load in loads:
            ok = self._account(load)
            if not ok:  # every block bsr was to fill: vLLM recomputes from the first
                job, block = load.job, self.settings.block_size
                (table,) = job.block_ids  # sync loads: one KV cache group (checked at startup)
                self._load_errors.update(
                    table[job.start_tokens // block : -(-job.end_tokens // block)]
                )

    def _wait_sync(self, loads: list[_Load]) -> None:
        """Sync mode: the step waits for its loads (bounded; an overrun is cancelled)."""
        deadline = self.settings.engine.deadline_s or self.opts.load_deadline_s
        # at most a threading wait can take, however many loads (each deadline is bounded)
        budget = min(len(loads) * (deadline + SYNC_GRACE_S), threading.TIMEOUT_MAX / 2)
        bound = time.monotonic() + budget
        for load in loads:
            if not load.done.wait(max(0.0, bound - time.monotonic())):
                self._cancel(load)
        for load in loads:  # the step ends only once nothing can write into its blocks
            if not load.done.wait(UNWIND_S):
                self._log.error("bsr.vllm.load_did_not_unwind", request=load.job.req_id)

    async def _run_load(self, load: _Load) -> None:
        try:
            with anyio.CancelScope() as scope:
                load.scope = scope
                if load.cancelled:
                    scope.cancel()
                if self._tp_lock is not None and self.settings.tp_size > 1:
                    async with self._tp_lock:  # every rank: the same loads in the same order
                        load.result = await self._restore(load)
                else:
                    load.result = await self._restore(load)
        except Exception as exc:  # a load that cannot run is a failed load, never a crash
            load.error = repr(exc)
            self._log.warning("bsr.vllm.load_refused", request=load.job.req_id, error=repr(exc))
        finally:
            load.done.set()

    def tables(self, block_ids: tuple[tuple[int, ...], ...]) -> dict[str, list[int]]:
        """bsr's block tables by group from vLLM's (its null block 0 is ``NULL_BLOCK``)."""
        if len(block_ids) != len(self.groups):
            raise BsrError(
                f"vLLM sent {len(block_ids)} block tables for {len(self.groups)} KV cache groups"
            )
        return {
            g: [NULL_BLOCK if b == NULL_BLOCK_ID else b for b in table]
            for g, table in zip(self.groups, block_ids)
        }

    def unreachable(self, job: LoadJob) -> str | None:
        """A block of the load that vLLM will take as loaded but bsr would not write, if any.

        A restore writes every block of the chunks a group needs from ``start_tokens`` on; a
        sliding-window group's table must hold vLLM's null block below them (vLLM keeps as many
        blocks as bsr's window covers, see ``group_window``). Anything else would be cached by
        vLLM as loaded and never written, so such a load is refused (reported failed).
        """
        engine = self.engine
        assert engine is not None
        layout, block = engine.layout, self.settings.block_size
        n, first = len(job.tokens) // layout.chunk_tokens, job.start_tokens // block
        for g, table in zip(self.groups, job.block_ids):
            lo = layout.needed_chunks(g, n).start * layout.chunk_tokens // block
            real = [i for i in range(first, min(lo, len(table))) if table[i] != NULL_BLOCK_ID]
            if real:
                return f"group {g!r} has a block at index {real[0]} below its window"
        return None

    async def _restore(self, load: _Load) -> RestoreResult:
        job, engine, cache = load.job, self.engine, self.cache
        assert engine is not None and cache is not None
        entry = self._probes.pop(job.lookup_id, None) if job.lookup_id is not None else None
        why = self.unreachable(job)
        if why is not None:
            if entry is not None:
                entry[1].release()
            raise BsrError(f"load refused: {why}")
        deadline = self.settings.engine.deadline_s or self.opts.load_deadline_s
        extras = self.adapters.bind_and_resolve(job.req_id, job.extras)
        if extras is None:  # not loaded here (or since changed): a miss on this rank, while
            # the restore still runs its agreement with the other ranks
            load.unbound = True
            extras = unbound_extras(job.extras)
        # probing again (several ranks, or the lookup's probe is gone): not the tiers the
        # lookup had no answer from, which would hold the probe until the load's deadline
        tiers = engine.tiers
        skip = (
            () if entry is not None else [tiers[i].name for i in job.skip_tiers if i < len(tiers)]
        )
        return await engine.restore(
            np.asarray(job.tokens, dtype=np.int64),
            cache,
            self.tables(job.block_ids),
            # policy "cost" decided at the lookup what to load: load that, all of it
            policy=Policy.ALL_OR_NOTHING if engine.policy is Policy.COST else None,
            deadline_s=deadline,
            probe=None if entry is None else entry[1],
            request_id=job.req_id,
            start_tokens=job.start_tokens,
            extras=extras,
            skip_tiers=skip,
        )

    def _cancel(self, load: _Load) -> None:
        load.cancelled = True
        if self.loop is not None:
            self.loop.submit(_cancel_scope, load)

    def _account(self, load: _Load) -> bool:
        """Count an ended load; record its outcome for the scheduler. Returns whether it is ok."""
        ok = load.ok
        r = load.result
        if r is not None:
            for tier, n in r.bytes_by_tier.items():
                self.stats.count_key("loaded_bytes", tier, n)
            self.stats.peak("rws_peak_bytes", r.rws_peak_bytes)
        if self.tp_rank == 0:
            self.stats.count("loads")
            if ok:
                self.stats.count("loaded_tokens", load.job.end_tokens - load.job.start_tokens)
            else:
                self.stats.count_key("failed_loads", load.reason)
            if load.aborted:
                self.stats.count("cancelled_loads")
            self._outcomes[load.job.req_id] = ok
        log = self._log.info if ok else self._log.warning
        log(
            "bsr.vllm.loaded", request=load.job.req_id, ok=ok, reason=None if ok else load.reason,
            start_tokens=load.job.start_tokens, end_tokens=load.job.end_tokens,
            committed=None if r is None else r.committed_tokens,
            bytes_by_tier=None if r is None else r.bytes_by_tier, aborted=load.aborted,
            error=load.error,
        )  # fmt: skip
        return ok

    # ================================================================== saves
    def start_saves(self, saves: list[SaveJob]) -> None:
        """Start this step's saves on the loop; they hold their blocks until reported done."""
        for job in saves:
            if self.engine is None or self.loop is None or self.cache is None:
                done: concurrent.futures.Future[SaveResult | str | None] = (
                    concurrent.futures.Future()
                )
                done.set_result(None)
                self._saves[job.req_id] = done
            else:
                self._saves[job.req_id] = self.loop.submit(self._save_one, job)

    async def _save_one(self, job: SaveJob) -> SaveResult | str | None:
        engine, cache, fleet = self.engine, self.cache, self.fleet
        assert engine is not None and cache is not None
        bound = self.adapters.resolve_bound(job.req_id, job.extras)
        self.adapters.forget(job.req_id)
        if isinstance(bound, str):  # not computed with one known set of adapter weights
            self._log.info("bsr.vllm.save_skipped", request=job.req_id, reason=bound)
            return bound
        job = dataclasses.replace(job, extras=bound)
        since = None if fleet is None else fleet.begin()
        result: SaveResult | None = None
        try:
            with anyio.move_on_after(self.opts.save_timeout_s):
                result = await engine.save(
                    list(job.tokens), cache, self.tables(job.block_ids), extras=job.extras
                )
                if fleet is not None and since is not None:
                    # announce what the tiers now hold, within what is left of the save's
                    # bound (cut there: the save landed, nothing of it is announced)
                    await fleet.after_save(job, result, since)
        except BsrError as exc:
            self._log.warning("bsr.vllm.save_refused", request=job.req_id, error=str(exc))
            return None
        finally:
            if fleet is not None:
                fleet.end(since)
        if result is not None:
            return result
        # cut: the save's task has ended (its copies out of the blocks are done), so the
        # blocks may go back to vLLM; what it stored so far stays stored, and is not announced
        self._log.warning(
            "bsr.vllm.save_timed_out", request=job.req_id, timeout_s=self.opts.save_timeout_s
        )
        return SAVE_TIMED_OUT

    def start_window_saves(self, jobs: list[WindowJob]) -> None:
        """Start this step's window saves on the loop (after the step's forward wrote them)."""
        written = None
        if jobs and self.cache is not None and self.cache.device.type == "cuda":
            # the forward was launched, not necessarily run: its writes come before this event
            written = torch.cuda.Event()  # type: ignore[no-untyped-call]
            written.record()
        for job in jobs:
            if self.engine is None or self.loop is None or self.cache is None:
                self._windows_done[job.job_id] = 1  # nothing to read: the blocks may go
            else:
                self._window_saves[job.job_id] = self.loop.submit(self._save_windows, job, written)

    async def _save_windows(
        self, job: WindowJob, written: torch.cuda.Event | None = None
    ) -> list[SaveResult]:
        """Save each end's window alone (the job's other blocks are vLLM's null block), once
        the step's forward has written it; bounded by ``save_timeout_s`` like a request's save,
        since the scheduler holds the blocks until it is done."""
        engine, cache = self.engine, self.cache
        assert engine is not None and cache is not None
        out: list[SaveResult] = []
        block = self.settings.block_size
        bound = self.adapters.resolve_bound(job.req_id, job.extras)
        if isinstance(bound, str):  # not computed with one known set of adapter weights
            self._log.info("bsr.vllm.window_save_skipped", request=job.req_id, reason=bound)
            return out
        with anyio.move_on_after(self.opts.save_timeout_s):
            if written is not None:
                await anyio.to_thread.run_sync(written.synchronize, abandon_on_cancel=True)
            for end in job.ends:
                tables = self.tables(tuple(t[: end // block] for t in job.block_ids))
                try:
                    saved = await engine.save(list(job.tokens[:end]), cache, tables, extras=bound)
                    out.append(saved)
                except BsrError as exc:
                    log = self._log.warning
                    log("bsr.vllm.window_save_refused", request=job.req_id, error=str(exc))
        return out

    # ================================================================== every step
    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads received (and failed) and saves sent since the last step."""
        self._step += 1
        for rid in finished_req_ids:
            self._finished[rid] = self._step
            load = self._loads.get(rid)
            if load is not None and not load.done.is_set():
                load.aborted = True
                if self.settings.tp_size == 1:
                    self._cancel(load)
        out = KVConnectorTransferResults()
        for rid, load in list(self._loads.items()):
            if load.done.is_set():  # its task ended: bsr writes nothing more into its blocks
                del self._loads[rid]
                out.finished_recving.add(rid)
                if not self._account(load):
                    out.failed_recving.add(rid)
        for rid, fut in list(self._saves.items()):
            if fut.done() and rid in self._finished:
                del self._saves[rid]
                self._finished.pop(rid)
                self.adapters.forget(rid)
                out.finished_sending.add(rid)
                self._account_save(fut)
        for rid, step in list(self._finished.items()):
            if self._step - step > FINISHED_KEEP_STEPS and rid not in self._saves:
                del self._finished[rid]
                self.adapters.forget(rid)  # finished without a save
        for job, wfut in list(self._window_saves.items()):
            if wfut.done():  # nothing reads the window's blocks any more
                del self._window_saves[job]
                self._windows_done[job] = 1
                results = [] if wfut.cancelled() or wfut.exception() else wfut.result()
                for result in results:
                    self._account_written(result)
        return out

    def _account_save(self, fut: concurrent.futures.Future[SaveResult | str | None]) -> None:
        result = None if fut.cancelled() or fut.exception() else fut.result()
        if isinstance(result, str):  # cut by save_timeout_s
            if self.tp_rank == 0:
                self.stats.count_key("saves_skipped", result)
            return
        if result is None:
            return
        self._account_written(result)
        if self.tp_rank == 0:
            for reason in result.skipped:  # a tier was busy (a root locked by another process)
                self.stats.count_key("saves_skipped", reason)
            if not result.skipped:
                self.stats.count("saves")

    def _account_written(self, result: SaveResult) -> None:
        for tier, n in result.bytes_written.items():
            if n:
                self.stats.count_key("saved_bytes", tier, n)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _take_notices(self) -> None:
        if self.fleet is not None:
            self._notices.extend(self.fleet.notices())

    def worker_meta(self) -> BsrWorkerMetadata | None:
        self._take_notices()
        if not self._outcomes and not self._windows_done and not self._notices:
            return None
        meta = BsrWorkerMetadata(self._outcomes, self._windows_done, self._notices)
        self._outcomes, self._windows_done, self._notices = {}, {}, []
        return meta

    def take_stats(self) -> BsrConnectorStats | None:
        # vLLM takes a step's stats before its worker metadata: the notices that metadata will
        # carry are taken (and their removals counted) now, so the counts ship in the same step
        self._take_notices()
        return self.stats.take()

    # ================================================================== shutdown
    def shutdown(self) -> None:
        """Wait (bounded) for saves in flight, cancel loads, close the engine, socket, loop."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.warming is not None:
            self.warming.close()
            self.warming = None
        loop = self.loop
        if loop is None:
            return
        pending: list[concurrent.futures.Future[Any]] = [*self._saves.values()]
        pending.extend(self._window_saves.values())
        concurrent.futures.wait(pending, timeout=self.opts.shutdown_timeout_s)
        if self._audit is not None:
            self._audit.cancel()
        if self.fleet is not None:
            self.fleet.close()
        for load in self._loads.values():
            self._cancel(load)
        for load in self._loads.values():
            load.done.wait(UNWIND_S)
        if self.engine is not None:
            try:
                loop.call_bounded(self.engine.aclose, timeout=10.0)
            except Exception as exc:
                self._log.warning("bsr.vllm.close_failed", error=repr(exc))
        loop.close()
        self.loop = None


async def _new_lock() -> anyio.Lock:
    return anyio.Lock()


async def _cancel_scope(load: _Load) -> None:
    if load.scope is not None:
        load.scope.cancel()
