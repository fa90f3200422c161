"""HCache for a serving engine: capture while serving, save and restore a mixed plan.

Where it runs: the serving process; :meth:`HCache.save` and :meth:`HCache.restore` on the event
loop of a :class:`~bsr.RestoreEngine`, projections and recompute in worker threads.

How it works: a :class:`~bsr.hcache.LayerPlan` splits the model's layers into recompute
``[0, r)``, hidden-state ``[r, r + h)`` and KV ``[r + h, L)``. The serving K/V live in one
:class:`~bsr.PagedKVCache` with the :mod:`bsr.hf` layout (group ``"kv"``, every layer). Captured
hidden states of the hidden-state layers live in a second cache (:meth:`HCache.hidden_store`, the
same block table), filled by :class:`HiddenCapture` forward pre-hooks during prefill and decode
(no second forward) at each token's position.

The engine sees the plan's mixed layout (:meth:`LayerPlan.layout`): its ``"kv"`` group is a view
of the KV layers of the serving cache, its ``"hidden.j"`` groups are views of the hidden store
(save) or, on restore, of the first bytes of each hidden layer's own K/V blocks when they fit
(MHA: a hidden state is half a K/V row), so restored hidden states need no memory of their own;
they are projected in place, block by block, into full K/V rows. Reads go through the
engine's bounded window like any group; the engine's ``on_installed`` hook queues each chunk that
landed for one projector task (a worker thread), so chunk ``c`` is projected while later chunks
are read, and what is left when the engine returns is projected after. A restore is
all-or-nothing for the whole request: the engine commits every group or none, and a failed
projection or recompute invalidates the HCache restore (every block of the prefix reported
invalid; after a failed projection the hook raises, so the engine stops committing chunks).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from .. import (
    Namespace,
    PagedKVCache,
    RestoreResult,
    SaveResult,
    StateGroup,
    StateLayout,
    as_token_array,
    model_config_digest,
)
from .._errors import ConfigError, LayoutError, UnsupportedModelError
from ._arch import ModelAdapter, RopeTable, dtype_name
from ._plan import HIDDEN, KV, RECOMPUTE, LayerPlan
from ._state import KVLanding, rebuild_rows, token_rows
from ._verify import CheckReport, check_model, compare_rows

#: the hidden store's group
STORE_GROUP = "hidden"


@dataclass(frozen=True)
class HCacheRestore:
    """Outcome of :meth:`HCache.restore`.

    Attributes:
        committed_tokens: tokens whose K/V are valid in the serving cache for every layer.
        engine: the engine's result for the stored layers. Its block ids are those of the
            view it restored into: where hidden states land apart (:attr:`HCache.lands_apart`)
            the hidden-state groups' ids are the landing's, not the caller's.
        invalid_block_ids: blocks of the serving cache holding nothing valid (free them or
            prefill into them).
        reason: why nothing was committed, or ``None``.
        io_s: the engine restore.
        rebuild_s: projections of the hidden-state layers (most of it beside the reads).
        recompute_s: recompute of the first layers (runs beside the reads).
        total_s: wall time.
        after_io_s: wall time after the engine returned (the projection and recompute that
            could not overlap the reads).
    """

    committed_tokens: int
    engine: RestoreResult | None
    invalid_block_ids: tuple[int, ...]
    reason: str | None
    io_s: float
    rebuild_s: float
    recompute_s: float
    total_s: float
    after_io_s: float = 0.0

    @property
    def committed(self) -> bool:
        return self.committed_tokens > 0


class _StopForward(Exception):
    pass


class HCache:
    """HCache restore for one model and plan.

    Args:
        model: a ``transformers`` causal LM of a supported architecture.
        plan: the per-layer plan (:func:`~bsr.hcache.plan_layers` or
            :func:`~bsr.hcache.fixed_plan`).
        chunk_tokens: the engine layout's chunk size.
        check: run :func:`~bsr.hcache.check_model` now (hidden-state layers are refused for a
            model whose rebuilt K/V differ from its own).
        pipeline: project each restored chunk while later chunks are read (default); ``False``
            projects everything after the engine returns (the benchmark's side-by-side baseline).
        kv_block_layout: how a block of the serving cache holds its tokens' K/V: ``"rows"``
            (each token's ``[K | V]`` row, :mod:`bsr.hf`'s layout, the default) or ``"planes"``
            (the block's K rows, then its V rows: ``[2, block_tokens, kv_heads x head_dim]``,
            vLLM's per-layer layout). Only the rebuild reads it; KV layers are moved as bytes.
        grouped_rebuild: rebuild the layers of a hidden-state group together (one batched GEMM
            and one set of elementwise kernels per piece instead of one per layer; see
            :func:`~bsr.hcache.rebuild_rows`). Off by default: ``bsr bench --hcache`` reports
            both (``rebuild_vs_gemm``, ``rebuild_grouped_vs_gemm``) for a device to choose.

    Raises:
        UnsupportedModelError: the plan uses hidden-state layers and the model is refused.
    """

    def __init__(
        self,
        model: Any,
        plan: LayerPlan,
        *,
        chunk_tokens: int = 256,
        check: bool = True,
        pipeline: bool = True,
        kv_block_layout: str = "rows",
        grouped_rebuild: bool = False,
    ) -> None:
        if not isinstance(plan, LayerPlan):
            raise ConfigError("plan must be a bsr.hcache.LayerPlan (see plan_layers)")
        if kv_block_layout not in ("rows", "planes"):
            raise ConfigError(
                f"kv_block_layout must be 'rows' (bsr.hf) or 'planes' (vLLM), got "
                f"{kv_block_layout!r}"
            )
        self.planes = kv_block_layout == "planes"
        self.grouped = bool(grouped_rebuild)
        self.model = model
        self.plan = plan
        self.pipeline = bool(pipeline)
        self.adapter = ModelAdapter(model)
        if plan.shape.num_layers != self.adapter.shape.num_layers:
            raise LayoutError(
                f"the plan is for {plan.shape.num_layers} layers, the model has "
                f"{self.adapter.shape.num_layers}"
            )
        if plan.dtype != self.adapter.dtype:
            raise LayoutError(
                f"the plan stores {plan.dtype}, the model runs in {self.adapter.dtype}; make the "
                "plan with dtype=model dtype"
            )
        self.report: CheckReport | None = None
        self.refused: str | None = None
        if check and plan.layers(HIDDEN):
            self.report = check_model(model)
        self.layout = plan.layout(chunk_tokens)
        #: :func:`bsr.model_config_digest` of the model's config; the engine's namespace must
        #: carry it (:meth:`namespace`)
        self.config_digest = model_config_digest(model.config)

    def namespace(
        self, model_id: str, *, tp_rank: int = 0, tp_size: int = 1, salt: bytes = b""
    ) -> Namespace:
        """The namespace of the engine this HCache saves and restores through.

        ``model_id`` names the weights (model, revision, fine-tune); the namespace also binds
        the digest of the model config, so hidden states or K/V saved under one config are a
        miss for a model of another (another ``rms_norm_eps`` makes every later layer's hidden
        state differ), never a wrong rebuild.
        """
        return Namespace(
            model_id, tp_rank=tp_rank, tp_size=tp_size, salt=salt,
            config_digest=self.config_digest,
        )  # fmt: skip

    def _check_engine(self, engine: Any) -> None:
        ns = getattr(engine, "namespace", None)
        got = getattr(ns, "config_digest", None)
        if got != self.config_digest:
            raise ConfigError(
                f"the engine's namespace is bound to config digest {got!r}, this model's config "
                f"is {self.config_digest!r}; build the engine with "
                "namespace=hcache.namespace(model_id) so state saved under one config is never "
                "restored into a model of another",
                expected=self.config_digest,
                got=got,
            )

    # ------------------------------------------------------------- caches
    @property
    def kv_layout(self) -> StateLayout:
        """The serving cache's layout (:func:`bsr.hf.layout_for_config`, one ``"kv"`` group)."""
        s, name = self.adapter.shape, dtype_name(self.adapter.dtype)
        g = StateGroup(KV, s.num_layers, self.plan.kv_bytes, dtype=name)
        return StateLayout(chunk_tokens=self.layout.chunk_tokens, groups=(g,))

    def hidden_store(
        self, num_blocks: int, block_tokens: int = 16, device: str | torch.device | None = None
    ) -> PagedKVCache:
        """A cache for the captured hidden states of the plan's hidden-state layers."""
        n = max(1, len(self.plan.layers(HIDDEN)))
        g = StateGroup(STORE_GROUP, n, self.plan.hidden_bytes, dtype=dtype_name(self.plan.dtype))
        layout = StateLayout(chunk_tokens=self.layout.chunk_tokens, groups=(g,))
        return PagedKVCache(layout, num_blocks, block_tokens, device or self.adapter.device)

    def _check_kv(self, kv_cache: PagedKVCache) -> list[torch.Tensor]:
        """The serving cache's K/V, one tensor per layer (stacked or the engine's own)."""
        if not isinstance(kv_cache, PagedKVCache):
            raise ConfigError("kv_cache must be a bsr.PagedKVCache with the bsr.hf layout")
        try:
            g = kv_cache.layout.group(KV)
        except KeyError:
            raise LayoutError(
                "kv_cache has no 'kv' group; build it with HCache.kv_layout"
            ) from None
        if g.num_layers != self.adapter.shape.num_layers or g.token_bytes != self.plan.kv_bytes:
            raise LayoutError(
                f"kv_cache group 'kv' is {g.num_layers} layers x {g.token_bytes} B/token, the "
                f"model needs {self.adapter.shape.num_layers} x {self.plan.kv_bytes}; build it "
                "with HCache.kv_layout"
            )
        return list(kv_cache.layers(KV))

    def _view(self, kv_cache: PagedKVCache, hidden: dict[str, torch.Tensor]) -> PagedKVCache:
        kv = self._check_kv(kv_cache)
        views = {name: list(t.unbind(0)) for name, t in hidden.items()}
        if self.plan.layers(KV):
            views[KV] = [kv[i] for i in self.plan.layers(KV)]
        return PagedKVCache.from_layer_tensors(self.layout, views, kv_cache.block_tokens)

    def save_view(self, kv_cache: PagedKVCache, store: PagedKVCache) -> PagedKVCache:
        """The engine-layout cache to save from: KV layers of ``kv_cache``, hidden of ``store``.

        Raises:
            UnsupportedModelError: the capture self-check failed for this model.
        """
        if self.refused:
            raise UnsupportedModelError(self.refused)
        src = store.tensor(STORE_GROUP)
        if store.num_blocks != kv_cache.num_blocks or store.block_tokens != kv_cache.block_tokens:
            raise LayoutError(
                "the hidden store and kv_cache must share num_blocks and block_tokens"
            )
        hidden: dict[str, torch.Tensor] = {}
        j0 = 0
        for name, layers in self.plan.hidden_groups:
            hidden[name] = src[j0 : j0 + len(layers)]
            j0 += len(layers)
        return self._view(kv_cache, hidden)

    def restore_view(self, kv_cache: PagedKVCache, num_tokens: int | None = None) -> PagedKVCache:
        """The engine-layout cache to restore into; hidden states land inside the K/V blocks
        where they fit.

        For MHA (a hidden row is at most a K/V row) the hidden state of block ``b`` of layer
        ``i`` lands in the first ``block_tokens x hidden_bytes`` bytes of that very block of
        layer ``i``'s K/V: block-contiguous, so the engine installs them with wide copies, and
        only that block's rebuild overwrites it (after reading it).

        For GQA (a hidden row is larger than the K/V row) the hidden states land in a buffer of
        their own (:attr:`lands_apart`), made for this view: with ``num_tokens`` it holds that
        many tokens' blocks, to be filled in token order (the engine's table for the hidden
        groups ``0, 1, 2, ...``, as :meth:`restore` does for the stored prefix: memory for the
        hit, not for the whole cache, and rows the rebuild reads where they lie); without, one
        block per block of ``kv_cache``, at the request's own block ids.
        """
        self._check_kv(kv_cache)
        kv_layers = kv_cache.layers(KV)
        nb, bt = kv_cache.num_blocks, kv_cache.block_tokens
        hb, kb = self.plan.hidden_bytes, self.plan.kv_bytes
        views: dict[str, list[torch.Tensor]] = {KV: [kv_layers[i] for i in self.plan.layers(KV)]}
        if self.lands_apart:
            n = len(self.plan.layers(HIDDEN))
            blocks = nb if num_tokens is None else max(1, -(-int(num_tokens) // bt))
            # uninitialised: only blocks the engine installs are read, after their install
            dev = kv_layers[0].device
            landing = torch.empty((n, blocks, bt, hb), dtype=torch.uint8, device=dev)
            j0 = 0
            for name, layers in self.plan.hidden_groups:
                views[name] = list(landing[j0 : j0 + len(layers)].unbind(0))
                j0 += len(layers)
        else:
            for name, layers in self.plan.hidden_groups:
                views[name] = [kv_layers[i].view(nb, bt * kb)[:, : bt * hb] for i in layers]
        if not views[KV]:
            del views[KV]
        return PagedKVCache.from_layer_tensors(self.layout, views, bt)

    @property
    def lands_apart(self) -> bool:
        """Whether restored hidden states need a buffer of their own (GQA: a hidden row is
        larger than a K/V row) instead of landing inside their layer's K/V blocks (MHA)."""
        return bool(self.plan.layers(HIDDEN)) and self.plan.hidden_bytes > self.plan.kv_bytes

    # ------------------------------------------------------------- capture
    def capture(self, store: PagedKVCache, block_ids: Any, *, verify: bool = True) -> HiddenCapture:
        """Hooks that write the hidden-state layers' inputs into ``store`` while the model runs."""
        return HiddenCapture(self, store, block_ids, verify=verify)

    async def save(
        self,
        engine: Any,
        tokens: Any,
        kv_cache: PagedKVCache,
        store: PagedKVCache,
        block_ids: Any,
        *,
        extras: Any = None,
    ) -> SaveResult:
        """Save ``tokens``' state: KV layers from ``kv_cache``, hidden from ``store``.

        ``extras``: what besides the tokens the state depends on (:class:`~bsr.KeyExtra`: a
        tenant, an adapter), as ``engine.save`` takes it; pass the same to :meth:`restore`.

        Raises:
            ConfigError: the engine's namespace is not this model's (:meth:`namespace`).
        """
        self._check_engine(engine)
        view = self.save_view(kv_cache, store)
        result: SaveResult = await engine.save(tokens, view, block_ids, extras=extras)
        return result

    # ------------------------------------------------------------- restore
    def recompute(
        self, tokens: Any, kv_cache: PagedKVCache, block_ids: Any, num_tokens: int
    ) -> None:
        """Prefill layers ``[0, r)`` of the plan on ``tokens[:num_tokens]``; write their K/V."""
        from transformers import DynamicCache

        r = len(self.plan.layers(RECOMPUTE))
        if r == 0 or num_tokens == 0:
            return
        kv = self._check_kv(kv_cache)
        ids = kv_cache.block_table(block_ids, num_tokens)
        a = self.adapter
        s = a.shape
        inp = torch.as_tensor(tokens[:num_tokens], dtype=torch.int64).view(1, -1).to(a.device)
        past = DynamicCache(config=self.model.config)
        params = inspect.signature(self.model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"

        def stop(_m: Any, _a: Any) -> None:
            raise _StopForward

        handle = a.layers[r].register_forward_pre_hook(stop) if r < s.num_layers else None
        try:
            with torch.no_grad():
                self.model(input_ids=inp, use_cache=True, **{cache_kw: past})
        except _StopForward:
            pass
        finally:
            if handle is not None:
                handle.remove()
        blocks, rows = token_rows(kv_cache, ids, 0, num_tokens)
        typed = [kv[i].view(self.plan.dtype) for i in range(r)]
        land = KVLanding(a, typed, kv_cache.block_tokens, self.planes, typed[0].device)
        for i in range(r):
            layer: Any = past.layers[i]
            k, v = layer.keys[0], layer.values[0]  # [kv_heads, n, head_dim]
            data = torch.cat(
                (
                    k.transpose(0, 1).reshape(num_tokens, -1),
                    v.transpose(0, 1).reshape(num_tokens, -1),
                ),
                1,
            )
            land.tokens(i, blocks, rows, data)

    def rebuild(
        self,
        view: PagedKVCache,
        kv_cache: PagedKVCache,
        ids: torch.Tensor,
        n: int,
        *,
        start: int = 0,
        rope: RopeTable | None = None,
        src_ids: torch.Tensor | None = None,
    ) -> None:
        """Project every hidden-state group of ``view`` for tokens ``[start, n)`` into ``kv_cache``.

        Args:
            rope: RoPE of positions ``[0, >= n)``, computed once per restore (default: now).
            src_ids: the blocks of ``view``'s hidden-state groups holding the rows, when they
                are not ``ids`` (a :meth:`restore_view` made with ``num_tokens``: ``0, 1, ...``).
        """
        table = rope if rope is not None else self.adapter.rope(0, n)
        for name, layers in self.plan.hidden_groups:
            rebuild_rows(
                self.adapter, view, name, layers, kv_cache, ids, n, table,
                start=start, planes=self.planes, grouped=self.grouped, src_ids=src_ids,
            )  # fmt: skip

    async def restore(
        self, engine: Any, tokens: Any, kv_cache: PagedKVCache, block_ids: Any, **kw: Any
    ) -> HCacheRestore:
        """Restore the longest stored prefix of ``tokens`` into ``kv_cache``, every layer.

        Pipelined: recompute of the first layers runs in a worker thread beside the engine's
        reads, and each chunk's hidden-state groups are projected (one worker thread, chunks in
        the order they land) as soon as the engine reports that chunk installed
        (``on_installed``), while later chunks are still being read. What has not been
        projected when the engine returns (at least the last chunk to land) is projected
        after. Any failure leaves nothing reported reusable: a failed projection makes the
        hook raise for every later chunk (the engine stops committing) and the whole restore
        is reported invalidated.

        Keyword arguments go to ``engine.restore`` (``extras`` to its lookup too); its
        ``deadline_s``, else the engine's, bounds the lookup and the restore together, from
        the call: the lookup waits for the tiers at most the engine's ``probe_share`` of it (a
        tier still answering then is cut off), the engine's restore gets what is left. A
        caller's own ``on_installed`` is called after this one's, and a caller's ``probe`` is
        used instead of a fresh lookup.

        Raises:
            ConfigError: the engine's namespace is not this model's (:meth:`namespace`).
        """
        self._check_engine(engine)
        job = _RestoreJob(self, engine, tokens, kv_cache, block_ids, kw)
        return await job.run()


class _RestoreJob:
    """One :meth:`HCache.restore`: the engine restore with recompute and projection beside it.

    Each phase is a method; the state the phases share (what was projected or recomputed, how
    far each got, the first failure) is kept on the object.
    """

    def __init__(
        self,
        hc: HCache,
        engine: Any,
        tokens: Any,
        kv_cache: PagedKVCache,
        block_ids: Any,
        kw: dict[str, Any],
    ) -> None:
        self.hc, self.engine, self.tokens = hc, engine, tokens
        self.kv_cache, self.block_ids = kv_cache, block_ids
        self.user_hook = kw.pop("on_installed", None)
        self.probe = kw.pop("probe", None)
        self.own_probe = self.probe is None  # else a caller's, made for every token
        self.engine_tokens: Any = tokens  # what the engine restores (a landing: the prefix)
        self.kw = kw
        self.t0 = time.perf_counter()
        self.view: PagedKVCache | None = None  # made by run (_make_view)
        self.tables: Any = block_ids  # the engine's (a GQA landing's hidden groups: in order)
        self.src_ids: torch.Tensor | None = None
        self.r_layers = hc.plan.layers(RECOMPUTE)
        self.hidden_names = {name for name, _ in hc.plan.hidden_groups}
        self.ct = hc.layout.chunk_tokens
        self.prefix = 0
        self.rec_s = self.proj_s = 0.0
        self.rec_n = self.rec_tried = self.proj_tried = 0
        self.rec_err: BaseException | None = None
        self.proj_err: BaseException | None = None
        self.rope: list[RopeTable] = []  # computed once, by the first projection
        self.projected: dict[int, int] = {}  # chunk -> hi
        self.skip = False
        self.t_io = self.t0
        self.send, self.recv = anyio.create_memory_object_stream[int](math.inf)

    async def run(self) -> HCacheRestore:
        # one deadline (the restore's, else the engine's) for the lookup and the restore: a
        # tier still answering at the lookup's share of it is cut off, the others' hit is
        # restored in what is left
        budget = self.engine.split_deadline(self.kw.get("deadline_s"))
        if self.probe is None and (self.r_layers or self.hidden_names):
            self.probe = await self.engine.lookup(
                self.tokens, extras=self.kw.get("extras"), deadline_s=budget.lookup_s
            )
        self.prefix = int(self.probe.prefix_tokens) if self.probe is not None else 0
        if self._make_view():  # the landing's tokens: this restore's probe, cut to them
            assert self.probe is not None
            self.probe = await self.engine.narrow(
                self.probe, self.engine_tokens, extras=self.kw.get("extras")
            )
        self.kw["deadline_s"] = budget.restore_s()
        result = await self._engine_phase()
        n = result.committed_tokens
        reason = await self._finish_phase(result, n)
        after_s = time.perf_counter() - self.t_io
        return HCacheRestore(
            0 if reason is not None else n,
            result,
            self._invalid_blocks(result, n, reason),
            reason,
            result.timings.total_s,
            self.proj_s,
            self.rec_s,
            time.perf_counter() - self.t0,
            after_s,
        )

    def _make_view(self) -> bool:
        """The engine's view cache, tokens and tables; whether the engine restores a prefix of
        the tokens (its probe is then cut to them). A GQA landing holds the blocks of the stored
        prefix, filled in token order: the engine restores the prefix's tokens (the lookup
        above was this restore's own, for the prefix's length; with one rank its probe is cut
        to them, else the engine probes them again), so a miss or a short hit of a long prompt
        takes no landing the prompt's size. Given a caller's probe (made for every token) it
        holds the prompt's whole chunks."""
        hc = self.hc
        if not hc.lands_apart:
            self.view = hc.restore_view(self.kv_cache)
            return False
        tokens = as_token_array(self.tokens)  # once: the engine takes the array as it is
        cut = False
        if self.own_probe and int(self.kw.get("start_tokens", 0)) <= self.prefix:
            n = hc.layout.num_chunks(self.prefix) * self.ct
            tokens = tokens[:n]
            cut = n > 0 and self.probe is not None and self.engine.coordinator.world_size == 1
            if not cut:
                self.probe = None
        else:
            n = hc.layout.num_chunks(len(tokens)) * self.ct
        self.engine_tokens = tokens
        n = max(1, n)
        self.view = hc.restore_view(self.kv_cache, n)
        order = torch.arange(-(-n // self.kv_cache.block_tokens), dtype=torch.int64)
        self.src_ids = order
        self.tables = {name: order for name in self.hidden_names}
        if hc.plan.layers(KV):
            self.tables[KV] = self.block_ids
        return cut

    async def _engine_phase(self) -> RestoreResult:
        """The engine restore, with recompute and the projector running beside it."""
        result: RestoreResult | None = None
        async with anyio.create_task_group() as tg:
            if self.r_layers and self.prefix:
                tg.start_soon(self._recompute, self.prefix)
            if self.hidden_names and self.prefix:
                tg.start_soon(self._projector)
            try:
                result = await self.engine.restore(
                    self.engine_tokens, self.view, self.tables, probe=self.probe,
                    on_installed=self._on_installed, **self.kw,
                )  # fmt: skip
                self.skip = not result.committed_tokens  # nothing to project for
            finally:
                self.send.close()
            self.t_io = time.perf_counter()  # the engine returned (the projector may still run)
        assert result is not None
        return result

    async def _finish_phase(self, result: RestoreResult, n: int) -> str | None:
        """Recompute and project what the pipeline did not reach; the reason of a failure."""
        reason: str | None = None if n else (str(result.reason) if result.reason else "miss")
        if n and self.r_layers and self.rec_err is None and self.rec_n < n:
            await self._recompute(n)
        if n and self.rec_err is not None:
            reason = f"recompute failed: {self.rec_err!r}"
        if n and reason is None and self.hidden_names and self.proj_err is None:
            # chunks the pipeline did not reach (pipeline off, a probe shorter than the
            # commit), as runs of consecutive chunks: one call each
            missing = [c for c in range(-(-n // self.ct)) if c not in self.projected]
            for run in _runs(missing):
                if self.proj_err is None:
                    await self._project_run(run, max(n, self.prefix), n)
        if self.proj_err is not None:  # also why an engine restore invalidated by the hook failed
            reason = f"projection failed: {self.proj_err!r}"
        return reason

    def _invalid_blocks(self, result: RestoreResult, n: int, reason: str | None) -> tuple[int, ...]:
        """Blocks this restore may have written beyond what it reports valid: the engine's,
        the recomputed and projected ones (either may have run past a shorter commit)."""
        bt = self.kv_cache.block_tokens
        whole = self.prefix if reason is not None else 0  # invalidated: the whole prefix
        written = max(n, self.rec_tried, self.proj_tried, whole)
        wids = self.kv_cache.block_table(self.block_ids, written)[: -(-written // bt)].tolist()
        valid = 0 if reason is not None else -(-n // bt)
        engine = result.invalid_block_ids  # a landing's blocks are not the caller's: K/V only
        if self.src_ids is not None:
            engine = result.invalid_block_ids_by_group.get(KV, ())
        return tuple(sorted(set(engine) | set(wids[valid:])))

    async def _recompute(self, n: int) -> None:
        self.rec_tried = max(self.rec_tried, n)
        t = time.perf_counter()
        try:
            args = (self.tokens, self.kv_cache, self.block_ids, n)
            await anyio.to_thread.run_sync(self.hc.recompute, *args)
            self.rec_n = n
        except Exception as exc:  # reported as an invalidated restore
            self.rec_err = exc
        self.rec_s += time.perf_counter() - t

    def _project(self, lo: int, hi: int, top: int) -> None:
        """Worker thread: chunk tokens ``[lo, hi)``'s K/V from their hidden states."""
        if not self.rope:
            self.rope.append(self.hc.adapter.rope(0, top))
        ids = self.kv_cache.block_table(self.block_ids, hi)
        assert self.view is not None
        self.hc.rebuild(
            self.view, self.kv_cache, ids, hi, start=lo, rope=self.rope[0], src_ids=self.src_ids
        )

    async def _project_run(self, chunks: range, top: int, end: int | None = None) -> None:
        """Project consecutive ``chunks`` in one call (tokens up to ``end``, default their
        end); ``top``: the RoPE table's length."""
        ct = self.ct
        lo = chunks[0] * ct
        hi = (chunks[-1] + 1) * ct if end is None else min(end, (chunks[-1] + 1) * ct)
        self.proj_tried = max(self.proj_tried, hi)
        t = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(self._project, lo, hi, top)
            self.projected.update(dict.fromkeys(chunks, hi))
        except Exception as exc:  # reported as an invalidated restore
            self.proj_err = exc
        self.proj_s += time.perf_counter() - t

    async def _projector(self) -> None:
        """The projection is usually slower than the reads: take every chunk that landed
        meanwhile and project each run of consecutive chunks in one call (fewer, larger
        GEMMs), in chunk order."""
        async with self.recv:
            async for c in self.recv:
                ready = [c]
                while True:
                    try:
                        ready.append(self.recv.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                for run in _runs(sorted(ready)):
                    if self.proj_err is None and not self.skip:
                        await self._project_run(run, self.prefix)

    async def _on_installed(self, c: int, groups: tuple[str, ...]) -> None:
        if self.proj_err is not None:  # the request cannot commit: stop taking chunks
            raise RuntimeError(f"projection failed: {self.proj_err!r}")
        in_prefix = (c + 1) * self.ct <= self.prefix
        if self.hc.pipeline and self.hidden_names.intersection(groups) and in_prefix:
            self.send.send_nowait(c)
        if self.user_hook is not None:
            pending = self.user_hook(c, groups)
            if pending is not None:
                await pending


def _runs(chunks: list[int]) -> list[range]:
    """Sorted chunk indices as runs of consecutive ones: ``[0, 1, 3]`` -> ``[0:2, 3:4]``."""
    out: list[range] = []
    for c in chunks:
        if out and out[-1].stop == c:
            out[-1] = range(out[-1].start, c + 1)
        else:
            out.append(range(c, c + 1))
    return out


class HiddenCapture:
    """Forward pre-hooks that copy the plan's hidden-state layers' inputs into a store.

    Use as a context manager around prefill and decode forwards of one request (batch row 0).
    Each call writes the rows at the tokens' positions (``position_ids``, else a running count),
    so a decode step appends one row per layer and a new turn appends its tokens: no second
    forward pass and no rewrite of the history. On the first forward with ``verify=True`` the
    K/V rebuilt from the captured rows are compared with the model's own cache on a sample of
    tokens; a mismatch marks the :class:`HCache` refused (``save_view`` raises).

    Attributes:
        tokens: one past the last position written.
        report: the capture-time self-check, once it ran.
    """

    def __init__(
        self, hc: HCache, store: PagedKVCache, block_ids: Any, *, verify: bool = True
    ) -> None:
        self.hc = hc
        self.store = store
        self.set_block_ids(block_ids)
        self.layers: tuple[int, ...] = hc.plan.layers(HIDDEN)
        self.tokens = 0
        self.report: CheckReport | None = None
        self._verify = verify
        self._sample: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._typed = store.typed(STORE_GROUP)
        self._where_key: Any = None
        self._where_cached: tuple[Any, Any, torch.Tensor] | None = None

    def set_block_ids(self, block_ids: Any) -> None:
        """Replace the request's block table (it grows as the request does)."""
        self.ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)

    def __enter__(self) -> HiddenCapture:
        a = self.hc.adapter
        for j, layer in enumerate(self.layers):
            self._handles.append(
                a.layers[layer].register_forward_pre_hook(self._hook(j, layer), with_kwargs=True)
            )
        if self._verify and self.layers:
            self._handles.append(self.hc.model.register_forward_hook(self._after, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _where(self, h: torch.Tensor, kwargs: Any, first: bool) -> tuple[Any, Any, torch.Tensor]:
        """(blocks, rows, positions) of this forward's tokens, computed once per forward."""
        seq = h.shape[1]
        pos = kwargs.get("position_ids")
        key = (id(pos), seq) if pos is not None else None
        cached = self._where_cached
        if not first and key is not None and self._where_key == key and cached is not None:
            return cached
        bt = self.store.block_tokens
        if pos is not None:
            p = pos.reshape(-1)[-seq:].to("cpu", torch.int64)
        else:
            start = self.tokens if first else self.tokens - seq
            p = torch.arange(start, start + seq)
        top = int(p[-1]) + 1 if seq == 1 else int(p.max()) + 1
        if top > len(self.ids) * bt:
            raise ConfigError(
                f"position {top - 1} is past the block table ({len(self.ids)} blocks of "
                f"{bt}); call set_block_ids with the grown table before this forward"
            )
        if first:
            self.tokens = max(self.tokens, top)
        where: tuple[Any, Any, torch.Tensor]
        if seq == 1:  # a decode step: plain ints, one copy per layer
            t = top - 1
            where = (int(self.ids[t // bt]), t % bt, p)
        else:
            dev = self.store.device
            where = (self.ids[p // bt].to(dev), (p % bt).to(dev), p)
        self._where_key, self._where_cached = key, where
        return where

    def _hook(self, j: int, layer: int) -> Any:
        def hook(_m: Any, args: Any, kwargs: Any) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            blocks, rows, p = self._where(h, kwargs, j == 0)
            if isinstance(blocks, int):
                self._typed[j, blocks, rows].copy_(h[0, 0])
            else:
                self._typed[j][blocks, rows] = (
                    h[0].detach().to(self._typed.device, self._typed.dtype)
                )
            seq = h.shape[1]
            if self._verify and self.report is None and seq >= 2:
                pick = torch.linspace(0, seq - 1, min(seq, 8)).long()
                self._sample[layer] = (h[0, pick.to(h.device)].detach().clone(), p[pick])

        return hook

    def _after(self, _m: Any, _args: Any, _kwargs: Any, out: Any) -> None:
        if self.report is not None or not self._sample:
            return
        from ..hf import _model_layers

        past = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if past is None:
            return
        model_layers = _model_layers(past)
        hidden, kv = [], []
        pos = next(iter(self._sample.values()))[1]
        adapter = self.hc.adapter
        for layer in self.layers:
            h, _ = self._sample[layer]
            k, v, seen = model_layers[layer]
            first = seen - k.shape[-2]
            sel = (pos - first).to(k.device)
            hidden.append(h)
            kv.append((k[0][:, sel], v[0][:, sel]))
        report = compare_rows(adapter, hidden, pos.to(adapter.device), kv, self.layers)
        self.report = report
        self._sample.clear()
        if not report.ok:
            self.hc.refused = (
                f"capture self-check: hidden-state rebuild of this {report.model_type} model "
                f"differs from its own K/V (relative error {report.max_error:.3g} > "
                f"{report.tolerance:g} at layer {report.worst_layer}); hidden-state saving is "
                "refused, store K/V for it"
            )
