"""BsrConnector: bsr as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Where it runs: vLLM creates one instance with role SCHEDULER in its EngineCore process and one
with role WORKER in each worker process (a separate process on the CPU build, even with one
worker). Load it with::

    KVTransferConfig(kv_connector="BsrConnector", kv_connector_module_path="bsr.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"bsr": {"tiers": [...], "model_id": ...}})

How it works:

* Scheduler side. ``get_num_new_matched_tokens`` asks the worker's engine for a metadata-only
  probe (:class:`~bsr.vllm._bridge.LookupClient`, bounded by ``lookup_timeout_s``) and answers
  the full-chunk prefix beyond vLLM's own prefix-cache hit, leaving at least one prompt token
  to compute. The worker keeps that probe with a lease (``lease_ttl_s``: what it found is not
  evicted before the load) and the load reuses it instead of probing again.
  ``update_state_after_alloc`` records the load; ``build_connector_meta`` sends the step's
  loads (tokens, block table) and saves to the workers. ``request_finished`` schedules a save
  of the request's computed full chunks and keeps its blocks until the worker reports the save
  done (``get_finished``), so a save never reads a reused block; at most ``max_pending_saves``
  saves are outstanding, more are skipped (a save is best effort). With tensor parallelism the
  scheduler asks rank 0 for a local, metadata-only probe; the restore's agreement across ranks
  (bsr's coordinator over a gloo group of vLLM's TP ranks) then decides.
* Worker side. ``register_kv_caches`` derives bsr's layout from vLLM's tensors and views them
  with no copy (:mod:`bsr.vllm._layout`), builds the engine from the one config parser
  (``bsr.EngineConfig``) and opens it on the connector's own event-loop thread. ``start_load_kv``
  restores every load of the step concurrently through the bounded window and waits (loads are
  synchronous: the step's forward reads them). bsr commits all-or-nothing: a load that does not
  commit its whole promised prefix (a damaged, evicted, hung or missing store; the deadline)
  reports every block past the committed prefix through ``get_block_ids_with_load_errors``, and
  vLLM recomputes from the first of them (``kv_load_failure_policy="recompute"``) or fails the
  request (``"fail"``, vLLM's default). Unverified bytes are never reported as loaded.
  ``wait_for_save`` starts the step's saves on the loop (off the critical path);
  ``get_finished`` reports them once done.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from bsr import (
    BsrError,
    ConfigError,
    EngineConfig,
    FileTierConfig,
    Namespace,
    ObjectKey,
    PagedKVCache,
    Probe,
    RestoreEngine,
    StateLayout,
    TorchDistributedCoordinator,
)

from .._log import logger
from ._bridge import LookupClient, LookupServer, LoopThread, socket_path
from ._layout import GroupSpec, derive, group_window, layer_order

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: Connector options (``kv_connector_extra_config["bsr_connector"]``) and their defaults.
CONNECTOR_DEFAULTS: dict[str, Any] = {
    "lookup_timeout_s": 2.0,  # the scheduler's wait for one probe
    "lease_ttl_s": 30.0,  # how long a probe pins what it found for the load that follows
    "load_deadline_s": 10.0,  # per restore, when the bsr config sets no deadline_s
    "max_pending_saves": 64,  # saves outstanding at once; more are skipped
    "save": True,  # store requests' KV after they finish
    "shutdown_timeout_s": 30.0,  # how long shutdown waits for saves in flight
}
#: Chunk size when the bsr config sets none: the smallest multiple of the block size >= this.
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class LoadJob:
    """Restore the first ``load_tokens`` of ``tokens`` (the probed prompt) into the blocks."""

    req_id: str
    tokens: tuple[int, ...]
    load_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SaveJob:
    """Store the full chunks of ``tokens`` held in the request's blocks."""

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class BsrConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers for one step."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def _engine_config(data: Any) -> EngineConfig:
    """The one parser of the ``"bsr"`` dict: :meth:`bsr.EngineConfig.from_dict`."""
    return EngineConfig.from_dict(data)


def _options(extra: dict[str, Any]) -> dict[str, Any]:
    given = extra.get("bsr_connector", {}) or {}
    if not isinstance(given, dict):
        raise ConfigError("kv_connector_extra_config['bsr_connector'] must be a dict")
    unknown = sorted(set(given) - set(CONNECTOR_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"unknown bsr_connector options {unknown}; known: {sorted(CONNECTOR_DEFAULTS)}"
        )
    return {**CONNECTOR_DEFAULTS, **given}


async def _local_prefix(engine: RestoreEngine, tokens: np.ndarray) -> int:
    """Tokens of the longest prefix this rank's tiers hold (metadata only, no agreement).

    With several ranks the scheduler asks rank 0 alone; the restore's agreement across ranks
    then decides, and blocks past what every rank holds are reported failed (recomputed).
    """
    layout = engine.layout
    keys = engine.keys(tokens)
    objs = [ObjectKey(k, g.name) for k in keys for g in layout.groups]
    present = [False] * len(objs)
    for tier in engine.tiers:
        found = await tier.contains_many(objs)
        present = [a or bool(b) for a, b in zip(present, found)]
    width = len(layout.groups)

    def usable(p: int) -> bool:
        return all(
            present[c * width + i]
            for i, g in enumerate(layout.groups)
            for c in layout.needed_chunks(g.name, p)
        )

    best = next((p for p in range(len(keys), 0, -1) if usable(p)), 0)
    return best * layout.chunk_tokens


def _digest(tokens: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


class BsrConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """bsr's verified, all-or-nothing restore behind vLLM's v1 KV connector API.

    Args:
        vllm_config: vLLM's config; ``kv_transfer_config.kv_connector_extra_config["bsr"]`` is
            the engine config (the schema of :meth:`bsr.EngineConfig.from_dict`), and the
            optional ``["bsr_connector"]`` dict sets :data:`CONNECTOR_DEFAULTS`.
        role: SCHEDULER or WORKER.
        kv_cache_config: vLLM's KV cache config (groups, number of blocks).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        if "bsr" not in extra:
            raise ConfigError(
                "BsrConnector needs kv_connector_extra_config={'bsr': {...}}, e.g. "
                "{'bsr': {'tiers': [{'kind': 'file', 'path': '/nvme/bsr', "
                "'capacity_bytes': '100GiB'}]}}"
            )
        self._config = _engine_config(extra["bsr"])  # validated in both roles, early
        self._opts = _options(extra)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._chunk = _chunk_tokens(self._config.chunk_tokens, self._block_size)
        self._tp_size = _check_parallelism(vllm_config, kv_cache_config)
        self._tp_rank = 0
        self._engine_id = str(ktc.engine_id)
        self._model_id = self._config.model_id or self._default_model_id(vllm_config)
        self._log = logger.bind(role=role.name.lower(), model=self._model_id)
        if ktc.kv_load_failure_policy != "recompute":
            self._log.warning(
                "bsr.vllm.failure_policy",
                policy=ktc.kv_load_failure_policy,
                note="a failed load fails the request; set kv_load_failure_policy='recompute' "
                "to recompute it instead",
            )
        # scheduler side
        self._client: LookupClient | None = None
        self._hits: dict[str, tuple[int, int]] = {}  # request -> (probed tokens, hit)
        self._loads: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, Request] = {}
        self._pending_saves: list[SaveJob] = []
        self._saving: set[str] = set()
        # worker side
        self._loop: LoopThread | None = None
        self._engine: RestoreEngine | None = None
        self._cache: PagedKVCache | None = None
        self._server: LookupServer | None = None
        self._load_errors: set[int] = set()
        self._save_futures: dict[str, concurrent.futures.Future[Any]] = {}
        self._finished_seen: set[str] = set()
        self._probes: dict[bytes, tuple[float, Probe]] = {}  # leased lookups awaiting a load
        self._probes_lock = threading.Lock()
        self.stats: dict[str, int] = {
            "lookups": 0,
            "hit_tokens": 0,
            "loads": 0,
            "loaded_tokens": 0,
            "failed_loads": 0,
            "saves": 0,
            "saves_skipped": 0,
        }
        if role == KVConnectorRole.SCHEDULER:
            self._client = LookupClient(
                socket_path(self._engine_id), float(self._opts["lookup_timeout_s"])
            )

    @staticmethod
    def _default_model_id(vllm_config: VllmConfig) -> str:
        mc = vllm_config.model_config
        return f"{mc.model}@{mc.revision or ''}:{mc.dtype}:{vllm_config.cache_config.cache_dtype}"

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that bsr can restore (full chunks; synchronous load)."""
        prompt = list(request.prompt_token_ids or ())
        # at least one prompt token must be computed by vLLM: probe at most len - 1 tokens
        usable = (max(0, len(prompt) - 1) // self._chunk) * self._chunk
        if usable <= num_computed_tokens or self._client is None:
            return 0, False
        self.stats["lookups"] += 1
        hit = min(self._client.lookup(prompt[:usable]), usable)
        hit = (hit // self._chunk) * self._chunk
        self._hits[request.request_id] = (usable, hit)
        if hit <= num_computed_tokens:
            return 0, False
        return hit - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._loads[request.request_id] = self._hits.get(request.request_id, (0, 0))
            self._requests[request.request_id] = request
            self.stats["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = BsrConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            probed, n = self._loads.pop(new.req_id, (0, 0))
            if n > 0:
                prompt = tuple(new.prompt_token_ids or ())
                meta.loads.append(LoadJob(new.req_id, prompt[:probed], n, tuple(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in cached.resumed_req_ids or req_id not in self._loads:
                continue
            probed, n = self._loads.pop(req_id)
            block_ids = cached.new_block_ids[i]
            request = self._requests.get(req_id)
            if n > 0 and block_ids is not None and request is not None:
                tokens = tuple(request.all_token_ids[:probed])
                meta.loads.append(LoadJob(req_id, tokens, n, tuple(block_ids[0])))
        for req_id in list(self._requests):
            if req_id not in self._loads:
                self._requests.pop(req_id, None)
        meta.saves, self._pending_saves = self._pending_saves, []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Schedule a save of the request's computed full chunks; hold its blocks until done."""
        rid = request.request_id
        self._hits.pop(rid, None)
        self._loads.pop(rid, None)
        self._requests.pop(rid, None)
        if not self._opts["save"]:
            return False, None
        computed = min(int(request.num_computed_tokens), len(request.all_token_ids))
        n = (computed // self._chunk) * self._chunk
        if n == 0:
            return False, None
        if len(self._saving) >= int(self._opts["max_pending_saves"]):
            self.stats["saves_skipped"] += 1
            return False, None
        blocks = tuple(block_ids[: n // self._block_size])
        self._pending_saves.append(SaveJob(rid, tuple(request.all_token_ids[:n]), blocks))
        self._saving.add(rid)
        self.stats["saves"] += 1
        return True, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            self._saving.discard(rid)

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """View vLLM's per-layer KV tensors (no copy), build and open the engine."""
        specs = self._group_specs(kv_caches)
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        if num_blocks <= 0:
            num_blocks = int(next(iter(kv_caches.values())).shape[0])
        layout, cache = derive(
            kv_caches,
            specs,
            num_blocks=num_blocks,
            block_tokens=self._block_size,
            chunk_tokens=self._chunk,
        )
        self._cache = cache
        coordinator = self._coordinator()
        engine = self._build_engine(layout, coordinator)
        self._loop = LoopThread()
        error: BaseException | None = None
        try:
            self._loop.call(engine.open)
        except Exception as exc:
            error = exc
        # every rank serves with bsr, or none does (the vote is a collective: always cast)
        if (
            coordinator is not None
            and not self._loop.call(coordinator.agree_all, error is None)
            and error is None
        ):
            error = RuntimeError("another tensor-parallel rank could not open its store")
        if error is not None:  # a store that cannot open: serve without bsr, say so
            self._log.error(
                "bsr.vllm.disabled",
                error=repr(error),
                note="the bsr engine did not open; every lookup misses and nothing is saved",
            )
            self._loop.call_bounded(engine.aclose, timeout=10.0)
        else:
            self._engine = engine
        if self._tp_rank == 0:  # the scheduler asks rank 0
            self._server = LookupServer(socket_path(self._engine_id), self._lookup_for_scheduler)
        self._log.info(
            "bsr.vllm.registered",
            layers=len(kv_caches),
            groups=[g.to_dict() for g in layout.groups],
            chunk_tokens=self._chunk,
            num_blocks=num_blocks,
            socket=None if self._server is None else self._server.path,
            tp=f"{self._tp_rank}/{self._tp_size}",
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
        if self._tp_size == 1:
            return None
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        group = dist.new_group(ranks=list(get_tp_group().ranks), backend="gloo")
        coordinator = TorchDistributedCoordinator(group)
        self._tp_rank = coordinator.rank
        return coordinator

    def _build_engine(
        self, layout: StateLayout, coordinator: TorchDistributedCoordinator | None
    ) -> RestoreEngine:
        namespace = Namespace(self._model_id, tp_rank=self._tp_rank, tp_size=self._tp_size)
        config = self._config
        if self._tp_size > 1:  # one process per FileTier root: each rank gets its own
            sub = f"rank-{self._tp_rank}-of-{self._tp_size}"
            tiers = tuple(
                dataclasses.replace(t, path=str(Path(t.path) / sub))
                if isinstance(t, FileTierConfig)
                else t
                for t in config.tiers
            )
            config = dataclasses.replace(config, tiers=tiers)
        return RestoreEngine.from_config(
            config, layout=layout, namespace=namespace, coordinator=coordinator
        )

    def _lookup_for_scheduler(self, tokens: np.ndarray) -> int:
        """The scheduler's probe, run on the loop thread and bounded by ``lookup_timeout_s``."""
        engine, loop = self._engine, self._loop
        if engine is None or loop is None:
            return 0
        timeout = float(self._opts["lookup_timeout_s"])
        if self._tp_size > 1:  # lookup() would run collectives that only rank 0 joins
            hit = loop.call_bounded(_local_prefix, engine, tokens, timeout=timeout)
            return 0 if hit is None else int(hit)
        ttl = float(self._opts["lease_ttl_s"])

        async def probe() -> Probe:
            return await engine.lookup(tokens, lease_ttl_s=ttl)

        p = loop.call_bounded(probe, timeout=timeout)
        if p is None:
            return 0
        if p.prefix_tokens:  # kept (leased) for the load that follows, keyed by the tokens
            now = time.monotonic()
            with self._probes_lock:
                old = self._probes.pop(_digest(tokens), None)
                for key in [k for k, (t, _) in self._probes.items() if now - t > ttl]:
                    self._probes.pop(key)[1].release()
                self._probes[_digest(tokens)] = (now, p)
            if old is not None:
                old[1].release()
        return int(p.prefix_tokens)

    def _take_probe(self, tokens: tuple[int, ...]) -> Probe | None:
        with self._probes_lock:
            entry = self._probes.pop(_digest(np.asarray(tokens, dtype="<i8")), None)
        return None if entry is None else entry[1]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Restore every load of this step (concurrently, through the bounded window)."""
        meta = self._connector_metadata
        if not isinstance(meta, BsrConnectorMetadata) or not meta.loads:
            return
        engine, loop, cache = self._engine, self._loop, self._cache
        if engine is None or loop is None or cache is None:
            for job in meta.loads:
                self._load_errors.update(job.block_ids[: len(job.tokens) // self._block_size])
            return
        deadline = self._config.deadline_s or float(self._opts["load_deadline_s"])
        t0 = time.perf_counter()
        # bsr ends each restore by its deadline; the bound here also covers a tier worker
        # thread that cannot return (then every load of the step counts as failed)
        probes = [self._take_probe(job.tokens) for job in meta.loads]
        results = loop.call_bounded(
            self._restore_all,
            engine,
            cache,
            meta.loads,
            probes,
            deadline,
            timeout=deadline + 2.0,
        )
        if results is None:
            results = [0] * len(meta.loads)
        for job, committed in zip(meta.loads, results):
            self.stats["loads"] += 1
            self.stats["loaded_tokens"] += min(committed, job.load_tokens)
            if committed < job.load_tokens:
                self.stats["failed_loads"] += 1
                first = committed // self._block_size
                self._load_errors.update(job.block_ids[first : job.load_tokens // self._block_size])
        self._log.debug(
            "bsr.vllm.loaded",
            requests=len(meta.loads),
            committed=results,
            seconds=round(time.perf_counter() - t0, 6),
        )

    @staticmethod
    async def _restore_all(
        engine: RestoreEngine,
        cache: PagedKVCache,
        jobs: list[LoadJob],
        probes: list[Probe | None],
        deadline_s: float,
    ) -> list[int]:
        import anyio

        out = [0] * len(jobs)

        async def one(i: int, job: LoadJob) -> None:
            try:
                r = await engine.restore(
                    list(job.tokens),
                    cache,
                    list(job.block_ids),
                    deadline_s=deadline_s,
                    probe=probes[i],
                    request_id=job.req_id,
                )
                out[i] = r.committed_tokens
            except BsrError as exc:
                logger.warning("bsr.vllm.load_refused", request=job.req_id, error=str(exc))
                if probes[i] is not None:
                    probes[i].release()  # type: ignore[union-attr]

        if engine.namespace.tp_size > 1:  # every rank runs the same collectives in one order
            for i, job in enumerate(jobs):
                await one(i, job)
            return out
        async with anyio.create_task_group() as tg:
            for i, job in enumerate(jobs):
                tg.start_soon(one, i, job)
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves read whole blocks after the request (wait_for_save)

    def wait_for_save(self) -> None:
        """Start this step's saves on the loop; they hold their blocks until reported done."""
        meta = self._connector_metadata
        if not isinstance(meta, BsrConnectorMetadata) or not meta.saves:
            return
        engine, loop, cache = self._engine, self._loop, self._cache
        for job in meta.saves:
            if engine is None or loop is None or cache is None:
                done: concurrent.futures.Future[Any] = concurrent.futures.Future()
                done.set_result(None)
                self._save_futures[job.req_id] = done
                continue
            self._save_futures[job.req_id] = loop.submit(self._save_one, engine, cache, job)

    @staticmethod
    async def _save_one(engine: RestoreEngine, cache: PagedKVCache, job: SaveJob) -> None:
        try:
            await engine.save(list(job.tokens), cache, list(job.block_ids))
        except BsrError as exc:
            logger.warning("bsr.vllm.save_refused", request=job.req_id, error=str(exc))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_seen |= set(finished_req_ids)
        done = {
            rid
            for rid, fut in self._save_futures.items()
            if fut.done() and rid in self._finished_seen
        }
        for rid in done:
            self._save_futures.pop(rid)
            self._finished_seen.discard(rid)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Wait (bounded) for saves in flight, close the engine, the server and the loop."""
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._loop is None:
            return
        concurrent.futures.wait(
            list(self._save_futures.values()), timeout=float(self._opts["shutdown_timeout_s"])
        )
        if self._engine is not None:
            try:
                self._loop.call_bounded(self._engine.aclose, timeout=10.0)
            except Exception as exc:
                self._log.warning("bsr.vllm.close_failed", error=repr(exc))
        self._loop.close()
        self._loop = None


def _chunk_tokens(configured: int | None, block_size: int) -> int:
    """bsr's chunk size: the configured one (a multiple of vLLM's block size) or the default
    rounded up to whole blocks."""
    chunk = configured
    if chunk is None:
        chunk = -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
    if chunk % block_size:
        raise ConfigError(
            f"chunk_tokens={chunk} is not a multiple of vLLM's block_size="
            f"{block_size}; use a multiple of {block_size}",
            key="chunk_tokens",
        )
    return int(chunk)


def _check_parallelism(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """Refuse what the connector does not support; return the tensor-parallel size."""
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    if pp != 1 or dp != 1:
        raise ConfigError(
            "BsrConnector supports tensor parallelism only (pipeline_parallel_size=1, "
            f"data_parallel_size=1), got pp={pp}, dp={dp}"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) > 1:
        raise ConfigError(
            "BsrConnector supports one KV cache group (vLLM reports block-level load "
            f"failures for one group only), got {len(groups)}"
        )
    return int(vllm_config.parallel_config.tensor_parallel_size)
