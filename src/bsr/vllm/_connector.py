"""BsrConnector: bsr as a vLLM v1 KV connector (``KVConnectorBase_V1``), a thin facade.

Where it runs: vLLM creates one instance with role SCHEDULER in its EngineCore process and one
with role WORKER in each worker process. The facade reads and checks the settings in both roles
(:mod:`bsr.vllm._options`), then hands every hook to its side: :class:`~bsr.vllm._scheduler.
BsrScheduler` (lookups, promises, saves to schedule) or :class:`~bsr.vllm._worker.BsrWorker`
(bsr's engine, loads, saves), like vLLM's own OffloadingConnector. Load it with::

    KVTransferConfig(kv_connector="BsrConnector", kv_connector_module_path="bsr.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"bsr": {"tiers": [...], "model_id": ...},
                                                "bsr_connector": {"load": "async"}})

The metadata the sides exchange is in :mod:`bsr.vllm._metadata`, the stats vLLM logs and
exports to Prometheus in :mod:`bsr.vllm._stats`; docs/vllm.md has the modes and guarantees.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from .._log import logger
from ._metadata import BsrConnectorMetadata, BsrHandshake
from ._options import settings
from ._scheduler import BsrScheduler
from ._stats import BsrConnectorStats, BsrPromMetrics
from ._worker import BsrWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class BsrConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """bsr's verified, all-or-nothing restore behind vLLM's v1 KV connector API.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): with several KV cache groups
    (sliding-window and full-attention layers apart) each group is a bsr state group with its
    own block tables, and a load commits every group or none.

    Args:
        vllm_config: vLLM's config; ``kv_transfer_config.kv_connector_extra_config["bsr"]`` is
            the engine config (the schema of :meth:`bsr.EngineConfig.from_dict`), and the
            optional ``["bsr_connector"]`` dict the :class:`~bsr.vllm._options.ConnectorOptions`.
        role: SCHEDULER or WORKER.
        kv_cache_config: vLLM's KV cache config (groups, number of blocks).
    """

    #: the worker side's class (a subclass may extend how the engine is built)
    worker_cls: type[BsrWorker] = BsrWorker

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _route_bsr_logs()
        s = settings(vllm_config, kv_cache_config)  # validated in both roles, early
        self.settings = s
        self.scheduler: BsrScheduler | None = None
        self.worker: BsrWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = BsrScheduler(s)
            if s.failure_policy != "recompute":
                logger.warning(
                    "bsr.vllm.failure_policy", policy=s.failure_policy,
                    note="a failed load fails the request; set kv_load_failure_policy="
                    "'recompute' to recompute it instead",
                )  # fmt: skip
        else:
            self.worker = self.worker_cls(s, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss, never lost KV

    def _sched(self) -> BsrScheduler:
        assert self.scheduler is not None, "a scheduler-side hook called on a worker"
        return self.scheduler

    def _work(self) -> BsrWorker:
        assert self.worker is not None, "a worker-side hook called on the scheduler"
        return self.worker

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = self._sched().request_finished(request, block_ids)
        return bool(delay), params

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.scheduler is not None:  # window saves hold references on blocks
            self.scheduler.windows.pool = gpu_block_pool
            manager = getattr(self, "_kv_cache_manager", None)
            if manager is not None:
                self.scheduler.blocks_of = manager.get_block_ids

    def has_pending_push_work(self) -> bool:
        # window saves hold blocks until the workers report them: keep vLLM stepping till then
        return self.scheduler is not None and self.scheduler.windows.pending

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        hs = metadata.get(0)
        self._sched().set_lookup_socket(hs.lookup_socket if isinstance(hs, BsrHandshake) else None)

    def reset_cache(self) -> bool | None:
        return self._sched().reset_cache()

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, BsrConnectorMetadata):
            self._work().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads are complete in start_load_kv; async ones are not in this step

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves read whole blocks after the request (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, BsrConnectorMetadata) and meta.saves:
            self._work().start_saves(meta.saves)
        if isinstance(meta, BsrConnectorMetadata) and meta.windows:
            self._work().start_window_saves(meta.windows)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self.worker is None else self.worker.worker_meta()

    # ================================================================== both sides
    def get_kv_connector_stats(self) -> BsrConnectorStats | None:
        side = self.scheduler or self.worker
        return None if side is None else side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> BsrConnectorStats:
        return BsrConnectorStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> BsrPromMetrics:
        return BsrPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


def _route_bsr_logs() -> None:
    """bsr's warnings and errors go to vLLM's log handlers (a store that cannot open, a load
    refused...), unless the application set up bsr's logging itself (structlog, or a handler or
    level on the ``"bsr"`` logger, e.g. through vLLM's ``VLLM_LOGGING_CONFIG_PATH``)."""
    bsr_log = logging.getLogger("bsr")
    configured = any(not isinstance(h, logging.NullHandler) for h in bsr_log.handlers)
    if configured or structlog.is_configured():
        return
    handlers = logging.getLogger("vllm").handlers
    if not handlers:
        return
    for h in handlers:
        bsr_log.addHandler(h)
    if bsr_log.level == logging.NOTSET:
        bsr_log.setLevel(logging.WARNING)
    bsr_log.propagate = False
