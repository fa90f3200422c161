"""BsrHiCacheStorage: bsr as SGLang's HiCache storage backend (L3).

Where it runs: SGLang's scheduler process, one backend per rank; SGLang's prefetch, backup and
query threads call it. One anyio event loop on a thread of its own (a blocking portal) owns the
:class:`bsr.RestoreEngine`; every call waits for its result there.

How it works: a page is one bsr object (:mod:`bsr.sglang._pages`). ``batch_exists`` probes each
page's object with ``RestoreEngine.lookup`` (metadata only, quarantined objects never count), each
bounded by ``bsr_backend.lookup_timeout_s`` (a tier still answering then is cut off and counts
against its circuit breaker: a hung store holds SGLang's prefetch thread a bounded time, then not at
all while its breaker is open), and counts the leading pages found. ``batch_get_v1`` restores page
after page into the host pool's own pages through bsr's W-slot staging window, each object verified;
the first page that does not commit ends the run, and no later page is read or reported. A page's
restore skips the tiers its own lookup did not hear from (they would hold the restore's probe as
they held the lookup) and is bounded by ``bsr_backend.get_deadline_s`` unless the engine config
sets ``deadline_s``; a page's save is cut at ``bsr_backend.save_timeout_s``.
``batch_set_v1`` saves each page from the host pool. The generic (non-``interface_v1``) calls
``get`` / ``set`` go through a one-page scratch cache. The v2 calls serve the KV pool alone; any
other pool (SWA, Mamba, indexer) is refused with ``NotImplementedError`` (bsr cannot commit two
pools' pages together through SGLang's per-pool calls).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from bsr import (
    BsrError,
    Check,
    ConfigError,
    EngineConfig,
    EngineStatistics,
    Options,
    PagedKVCache,
    RestoreEngine,
    Tier,
    option,
)

from .._log import logger
from ._pages import HostPages, PageKeys, host_pages, shard_identity

#: the key of bsr's engine config inside SGLang's ``--hicache-storage-backend-extra-config``
CONFIG_KEY = "bsr"
#: the key of the backend's own options (:class:`BackendOptions`) beside it
OPTIONS_KEY = "bsr_backend"
#: page keys whose lookup's unanswered tiers are kept for their restore (the oldest go first)
MAX_REMEMBERED_KEYS = 4096


@dataclass(frozen=True)
class BackendOptions(Options):
    """``extra_config["bsr_backend"]``: how the backend serves SGLang (all optional).

    Attributes:
        lookup_timeout_s: the most one page's lookup in ``batch_exists`` may take: a tier still
            answering then is cut off (the page counts as held only if another tier answered
            that it holds it; the cut counts against the slow tier's circuit breaker, which
            skips it once open). Seconds > 0.
        get_deadline_s: the most one page's restore (``batch_get_v1``, ``get``) may take when
            the engine config (``bsr``) sets no ``deadline_s``: its probe waits for the tiers
            at most the engine's ``probe_share`` of it, a tier still answering then is cut off
            (counted against its breaker) and the page is restored from the others. Seconds
            > 0.
        save_timeout_s: the most one page's save (``batch_set_v1``, ``set``) may take: a save
            still running then (a tier that hangs) is cut, the page reported not stored, and
            the rest of that ``batch_set_v1`` is not tried. What it stored before the cut stays
            stored (each object is complete or absent). Seconds > 0.
    """

    options_prefix = f"{OPTIONS_KEY}."
    options_name = f"extra_config[{OPTIONS_KEY!r}]"

    lookup_timeout_s: float = option(Check.seconds, 2.0)
    get_deadline_s: float = option(Check.seconds, 10.0)
    save_timeout_s: float = option(Check.seconds, 10.0)


@dataclass
class BsrStorageStats:
    """What ``get_stats`` returns: SGLang's ``StorageMetrics`` fields (page counts and GB/s of
    each prefetch and backup since the last call) and bsr's own figures (``bsr``: the engine's
    :class:`bsr.EngineStatistics`; None before the host pool is bound)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    bsr: EngineStatistics | None = None


def engine_config(storage_config: Any) -> EngineConfig:
    """The bsr engine config in ``storage_config.extra_config["bsr"]`` (its ``model_id``
    defaults to SGLang's model name).

    Raises:
        ConfigError: no ``"bsr"`` table, or a bad one (the message names the key).
    """
    extra = getattr(storage_config, "extra_config", None) or {}
    data = extra.get(CONFIG_KEY)
    if not isinstance(data, dict):
        raise ConfigError(
            f"--hicache-storage-backend-extra-config needs a {CONFIG_KEY!r} object with bsr's "
            'engine config, e.g. {"bsr": {"window": 8, "tiers": [{"kind": "file", "path": '
            '"/mnt/nvme/bsr", "capacity_bytes": "500GiB"}]}}',
            key=CONFIG_KEY,
        )
    data = dict(data)
    if data.get("model_id") is None:
        if not storage_config.model_name:
            raise ConfigError(
                "bsr.model_id: SGLang passed no model name; set model_id in the bsr config",
                key="model_id",
            )
        data["model_id"] = str(storage_config.model_name)
    return EngineConfig.from_dict(data)


class BsrHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache storage backed by a bsr engine and its tiers.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config["bsr"]`` is the
            engine config (:class:`bsr.EngineConfig` dict form: tiers, ``window``, ...).
        kwargs: what SGLang's dynamic loader passes beside it (unused).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.config = engine_config(storage_config)
        extra = getattr(storage_config, "extra_config", None) or {}
        data = extra.get(OPTIONS_KEY)
        self.options = BackendOptions() if data is None else BackendOptions.from_dict(data)
        self.pages: HostPages | None = None
        self.keys: PageKeys | None = None
        self.engine: RestoreEngine | None = None
        self._scratch: PagedKVCache | None = None
        self._scratch_lock = threading.Lock()
        self._stats = BsrStorageStats()
        self._stats_lock = threading.Lock()
        self._portal_cm: Any = None
        self._portal: Any = None
        self.registered_pools: dict[str, Any] = {}
        #: page key -> the tiers its last lookup did not hear from (its restore skips them);
        #: the engine's loop thread alone reads and writes it
        self._unanswered: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    # ------------------------------------------------------------------ binding
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool: build bsr's layout over its pages, then open the engine."""
        if self.engine is not None:
            raise ConfigError("bsr.sglang: a host pool is already bound to this backend")
        self.mem_pool_host = mem_pool_host
        pages = host_pages(mem_pool_host, is_mla=bool(self.storage_config.is_mla_model))
        self.pages = pages
        self.keys = PageKeys(
            shard_identity(self.storage_config, pages.pool_layout), pages.page_size
        )
        self._scratch = PagedKVCache(pages.layout, num_blocks=1, block_tokens=pages.page_size)
        tiers = self.wrap_tiers(self.config.build_tiers())
        engine = RestoreEngine.from_config(self.config, layout=pages.layout, tiers=tiers)
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._portal.call(engine.open)
        except BaseException:
            self._close_portal()
            raise
        self.engine = engine

    def wrap_tiers(self, tiers: list[Tier]) -> list[Tier]:
        """The tiers the engine uses, given those the config built (not opened yet, fastest
        first). Override to put wrappers in front of them (a throttle, a fault injector, a
        metrics probe); every engine setting still comes from the config. Default: as built."""
        return tiers

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.registered_pools[str(host_pool_name)] = host_pool

    def _bound(self) -> tuple[RestoreEngine, HostPages, PageKeys]:
        if self.engine is None or self.pages is None or self.keys is None:
            raise ConfigError(
                "bsr.sglang: no host pool is bound; SGLang calls register_mem_pool_host first"
            )
        return self.engine, self.pages, self.keys

    def close(self) -> None:
        """Close the engine (its tiers) and the event loop thread."""
        engine, self.engine = self.engine, None
        if engine is not None and self._portal is not None:
            self._portal.call(engine.aclose)
        self._close_portal()

    def _close_portal(self) -> None:
        cm, self._portal_cm, self._portal = self._portal_cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    # ------------------------------------------------------------------ pages
    async def _probe(self, key: str) -> bool:
        engine, _, keys = self._bound()
        probe = await engine.lookup(
            keys.tokens, extras=keys.extras(key), local=True,
            deadline_s=self.options.lookup_timeout_s,
        )  # fmt: skip
        unanswered = self._unanswered
        unanswered.pop(key, None)
        if probe.unanswered:
            unanswered[key] = probe.unanswered
            while len(unanswered) > MAX_REMEMBERED_KEYS:  # keys looked up but never fetched
                unanswered.popitem(last=False)
        return probe.prefix_chunks >= 1

    async def _exists_run(self, page_keys: list[str]) -> int:
        for i, key in enumerate(page_keys):
            if not await self._probe(key):
                return i
        return len(page_keys)

    async def _restore(self, key: str, cache: PagedKVCache, block: int) -> bool:
        engine, pages, keys = self._bound()
        skip = self._unanswered.pop(key, ())
        deadline = self.options.get_deadline_s if engine.deadline_s is None else None
        try:
            result = await engine.restore(
                keys.tokens, cache, [block], extras=keys.extras(key), skip_tiers=skip,
                deadline_s=deadline,
            )  # fmt: skip
        except BsrError:
            return False
        return bool(result.committed) and result.committed_tokens == pages.page_size

    async def _save(self, key: str, cache: PagedKVCache, block: int) -> bool | None:
        """Whether the page was stored; None when ``save_timeout_s`` cut its save (ended: no
        copy out of the page is left running; what it stored stays stored)."""
        engine, pages, keys = self._bound()
        try:
            with anyio.move_on_after(self.options.save_timeout_s) as scope:
                result = await engine.save(keys.tokens, cache, [block], extras=keys.extras(key))
        except BsrError:
            return False
        if scope.cancelled_caught:
            logger.warning("bsr.sglang.save_timed_out", timeout_s=self.options.save_timeout_s)
            return None
        return result.saved_tokens == pages.page_size and not any(result.errors.values())

    async def _get_run(self, page_keys: list[str], blocks: list[int]) -> list[bool]:
        _, pages, _ = self._bound()
        out = [False] * len(page_keys)
        for i, (key, block) in enumerate(zip(page_keys, blocks)):
            if not await self._restore(key, pages.cache, block):
                break  # the run ends here: no later page is read or reported
            out[i] = True
        return out

    async def _set_each(self, page_keys: list[str], blocks: list[int]) -> list[bool]:
        _, pages, _ = self._bound()
        out = [False] * len(page_keys)
        for i, (key, block) in enumerate(zip(page_keys, blocks)):
            ok = await self._save(key, pages.cache, block)
            if ok is None:  # cut: a tier hangs, and would hold each later page as long
                break
            out[i] = ok
        return out

    def _blocks(self, page_keys: list[str], host_indices: torch.Tensor) -> list[int]:
        """The pool page of each key (``host_indices`` holds ``page_size`` indices per key)."""
        _, pages, _ = self._bound()
        ps = pages.page_size
        if host_indices.numel() != len(page_keys) * ps:
            raise ConfigError(
                f"host_indices holds {host_indices.numel()} indices for {len(page_keys)} pages "
                f"of {ps} tokens; SGLang passes page_size indices per key"
            )
        starts = host_indices.reshape(-1)[::ps].tolist() if ps else []
        if any(int(s) % ps for s in starts):
            raise ConfigError(f"host indices {starts} do not start pages of {ps} tokens")
        return [int(s) // ps for s in starts]

    def _call(self, fn: Any, *args: Any) -> Any:
        self._bound()
        return self._portal.call(fn, *args)

    def _note(self, kind: str, pages: int, started: float) -> None:
        _, host, _ = self._bound()
        gbps = pages * host.page_bytes / max(time.perf_counter() - started, 1e-9) / 1e9
        with self._stats_lock:
            getattr(self._stats, f"{kind}_pgs").append(pages)
            getattr(self._stats, f"{kind}_bandwidth").append(gbps)

    # ------------------------------------------------------------------ v1 (zero copy)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The number of leading ``keys`` whose objects a tier holds (quarantined ones never
        count); metadata only."""
        return int(self._call(self._exists_run, list(keys)))

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Restore each page into the host pool at ``host_indices``, verified; ``True`` for the
        leading pages restored, ``False`` from the first page that was not on."""
        started = time.perf_counter()
        out: list[bool] = self._call(self._get_run, list(keys), self._blocks(keys, host_indices))
        self._note("prefetch", sum(out), started)
        return out

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Save each page of the host pool at ``host_indices``; ``True`` per page stored."""
        started = time.perf_counter()
        out: list[bool] = self._call(self._set_each, list(keys), self._blocks(keys, host_indices))
        self._note("backup", sum(out), started)
        return out

    # ------------------------------------------------------------------ generic (a copy)
    async def _get_flat(self, key: str, target: torch.Tensor) -> bool:
        assert self._scratch is not None
        if not await self._restore(key, self._scratch, 0):
            return False
        target.view(-1).view(torch.uint8).copy_(self._scratch.tensor("kv").reshape(-1))
        return True

    async def _set_flat(self, key: str, value: torch.Tensor) -> bool:
        assert self._scratch is not None
        self._scratch.tensor("kv").reshape(-1).copy_(value.reshape(-1).view(torch.uint8))
        return bool(await self._save(key, self._scratch, 0))

    def _flat_bytes(self, t: Any, what: str) -> torch.Tensor:
        _, pages, _ = self._bound()
        if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() != pages.page_bytes:
            raise ConfigError(f"{what} must be a flat page tensor of {pages.page_bytes} bytes")
        return t.contiguous() if what == "value" else t

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Restore one page into ``target_location`` (a flat data page); None when absent."""
        target = self._flat_bytes(target_location, "target_location")
        if not target.is_contiguous():
            raise ConfigError("target_location must be contiguous")
        with self._scratch_lock:
            ok = self._call(self._get_flat, key, target)
        return target if ok else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """``get`` of each page up to the first absent one (later pages: None)."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, (key, target) in enumerate(zip(keys, target_locations or [])):
            out[i] = self.get(key, target)
            if out[i] is None:
                break
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Save one flat data page ``value``."""
        value = self._flat_bytes(value, "value")
        with self._scratch_lock:
            return bool(self._call(self._set_flat, key, value))

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Save each page; False from the first page that was not stored."""
        return all(self.set(k, v) for k, v in zip(keys, values or []))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ v2 (KV pool only)
    def _kv_only(self, names: list[Any], call: str) -> None:
        other = [str(n) for n in names if str(n) != str(PoolName.KV)]
        if other:
            raise NotImplementedError(
                f"bsr.sglang {call}: pools {other} are not supported, only {PoolName.KV.value!r}; "
                "bsr cannot commit another pool's pages together with the KV pages through "
                "SGLang's per-pool calls (run this model without a hybrid pool in L3)"
            )

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV pool's leading run (``batch_exists``); other pools: NotImplementedError."""
        self._kv_only([t.name for t in pool_transfers or []], "batch_exists_v2")
        hits = self.batch_exists(keys, extra_info)
        counts = {PoolName.KV: hits} if hits else {}
        return PoolTransferResult(hits, counts, list(range(1, hits + 1)))

    def _v2(self, transfers: list[PoolTransfer], call: str) -> dict[str, list[bool]]:
        self._kv_only([t.name for t in transfers], call)
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys, idx = list(t.keys or []), t.host_indices
            if idx is None:
                raise ConfigError(f"bsr.sglang {call}: a PoolTransfer without host_indices")
            run = self.batch_get_v1 if call == "batch_get_v2" else self.batch_set_v1
            out[str(t.name)] = run(keys, idx)
        return out

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, "batch_get_v2")

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, "batch_set_v2")

    # ------------------------------------------------------------------ the rest
    def clear(self) -> bool:
        """bsr keeps what it stored on a cache flush (its tiers evict by capacity): False."""
        return False

    def get_stats(self) -> BsrStorageStats:
        """Page counts and bandwidths since the last call, and the engine's statistics."""
        with self._stats_lock:
            stats, self._stats = self._stats, BsrStorageStats()
        if self.engine is not None:
            stats.bsr = self.engine.statistics()
        return stats
