"""The scheduler side of BsrConnector: what to load and what to save, never waiting on a store.

Where it runs: vLLM's EngineCore process, inside the scheduler's one loop (every method here is
called from it); one instance per engine. It has no KV tensors and no bsr engine.

How it works:

* **Keys.** A request is keyed by its token ids and by what else its KV depends on (its
  ``cache_salt``, LoRA adapter, multimodal items, prompt embeddings: :mod:`bsr.vllm._request_keys`),
  computed once when the scheduler first sees it, with no file system call (an adapter is a
  marker the workers bind to the weights they loaded: :mod:`bsr.vllm._adapters`; the step that
  first schedules a LoRA request tells them to bind it); a request bsr cannot key, or whose
  per-request options (``kv_transfer_params["bsr"]``) are bad or say so, is neither loaded nor
  saved.
* **Lookups.** ``get_num_new_matched_tokens`` sends the request's prompt (its full chunks,
  leaving at least one prompt token for vLLM to compute) and its extra keys to the worker's bsr
  engine over the lookup socket (:mod:`bsr.vllm._lookup`) and answers ``None`` ("ask again
  later", which vLLM allows) until the answer is in. A store that hangs therefore costs the
  scheduler nothing: the worker cuts the lookup off after ``lookup_timeout_s`` (the tier's
  breaker counts it) and answers 0; an answer that never comes is taken as a miss once it is
  that late plus a grace.
* **Promises.** The answer is the reusable prefix from token 0; vLLM's own prefix-cache hit
  (``num_computed_tokens``, whole blocks) is subtracted, so bsr loads only past it. In async
  mode (the default) the answer is ``(n, True)``: vLLM parks the request in
  ``WAITING_FOR_REMOTE_KVS`` with blocks allocated and keeps running the others. A request whose
  chunks another request is already loading is deferred (``None``) until that load is in vLLM's
  prefix cache, as vLLM's OffloadingConnector does, so two loads never fetch the same chunks.
* **Loads.** ``update_state_after_alloc`` turns the promise into a :class:`LoadJob` with the
  request's blocks; ``build_connector_meta`` sends it to the workers. The workers report each
  load's outcome (:class:`BsrWorkerMetadata`); a request whose load failed is never offered a
  load again (vLLM recomputes it).
* **Saves.** ``request_finished`` schedules a save of the computed full chunks and holds the
  blocks until the workers report it done (at most ``max_pending_saves`` at once). Only KV that
  was computed or verified-installed is ever saved: a request with a load whose outcome is not
  known yet or failed, or that shares blocks with such a load, is not saved (vLLM may finish an
  aborted request before it processes that step's failed-load report).
* **Failed sync loads.** vLLM caches a sync load's blocks when it allocates them, before bsr writes
  them. If the load fails, vLLM recomputes them in place only for a request still running when it
  handles the failure; a request aborted or preempted before that leaves them in vLLM's prefix cache
  as they are, and vLLM hands them to the next request with that prefix. The same goes for the
  blocks the load's step computed over them (the rest of the request's table: vLLM caches them in
  the same step), and for those a step scheduled before the load's report gives the request
  (``build_connector_meta`` sees their ids). So the blocks of a failed sync load and of its step
  stay *poisoned* until vLLM gives them out afresh (past some request's own hit) or their request
  recomputed them in place, and a request that vLLM admits on a poisoned block, or on a block of a
  sync load whose outcome is not known yet that then fails, is *tainted*: never saved.
  (``spec/connector.pml`` models this; spin found both cases.)
* **Window saves.** A sliding-window group's window at prefix ends a request reaches while it
  runs (window checkpoints, the prompt's lookup end, each generated chunk) is saved before vLLM
  lets those blocks go (:mod:`bsr.vllm._windows`), under the same rule as saves.
* **Fleet** (:mod:`bsr.vllm._events`, :mod:`bsr.vllm._fleet`): every lookup carries vLLM's own
  hit and the prefill rate measured here (each engine step's scheduled tokens over the time
  from its schedule to its output, steps of at least a chunk), for policy ``"cost"``; its
  answer says which tier holds the offered tokens (``get_external_cache_hit_sources``). A save
  carries the request's vLLM block hashes; the workers' KV event notices are relayed to vLLM's
  publisher (``take_events``). With ``admit_after_sightings`` > 1 a finished request saves
  only the leading chunks that many requests were seen with (a bounded sighting counter).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bsr import CostModel, SightingCounter, chunk_keys

from .._log import logger
from ._events import ChunkNotice, EventRelay
from ._kv_events import save_events
from ._lookup import LookupClient, LookupHints
from ._metadata import (
    NULL_BLOCK_ID,
    BsrConnectorMetadata,
    BsrWorkerMetadata,
    LoadJob,
    SaveJob,
    WindowJob,
)
from ._options import ConnectorSettings
from ._request_keys import RequestKeys, option_label, request_keys
from ._stats import BsrConnectorStats
from ._windows import WindowSaver

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: how much later than ``lookup_timeout_s`` an answer may come before the scheduler gives up
LOOKUP_GRACE_S = 1.0
#: seeds the chunk digests that tell the scheduler's loads in flight apart (never stored)
INFLIGHT_NAMESPACE = b"bsr-vllm-inflight"
#: seeds the digests the sighting counter counts (never stored)
SIGHTING_NAMESPACE = b"bsr-vllm-sightings"
#: steps scheduled and not yet seen finished that the prefill clock keeps
STEP_CLOCK_DEPTH = 4


def prompt_tokens(request: Any) -> list[int]:
    """The prompt's token ids as vLLM computes them (a prompt-embedding position holds 0)."""
    return list(request.all_token_ids[: int(request.num_prompt_tokens)])


@dataclass
class _Req:
    """What the scheduler side knows about one request."""

    lookup_id: int | None = None  # the lookup in flight or answered
    sent_at: float = 0.0
    probed: int = 0  # tokens looked up
    hit: int | None = None  # the answer: tokens bsr holds from token 0 (None: not yet)
    used: bool = False  # a load took the answer (its lease); a later load looks up again
    start: int = 0  # vLLM's own hit when the promise was made
    end: int = 0  # the promise: tokens valid after the load
    loading: bool = False  # a load was sent and its outcome is not known
    failed: bool = False  # a load failed: never load again (vLLM recomputes)
    unverified: bool = False  # this request's KV includes a load not verified: never save
    tainted: bool = False  # admitted on a block holding no verified KV: never save
    waits_on: set[str] = field(default_factory=set)  # sync loads whose blocks it was handed
    readmitted: bool = False  # admitted again after its load failed (preempted meanwhile)
    digests: tuple[bytes, ...] = ()  # chained digests of the prompt's full chunks
    prompt: list[int] = field(default_factory=list)  # the prompt's token ids
    by_tier: tuple[int, ...] = ()  # the answer: tokens past vLLM's hit each tier holds
    skip: tuple[int, ...] = ()  # the answer: tiers (by index) the load is not to ask


class BsrScheduler:
    """The connector's scheduler side (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.opts = settings.options
        self.chunk = settings.chunk_tokens
        self.block = settings.block_size
        self.client = LookupClient()
        self._log = logger.bind(role="scheduler", model=settings.model_id)
        self._reqs: dict[str, _Req] = {}
        self._by_lookup: dict[int, str] = {}
        self._unanswered: set[int] = set()  # lookups sent, no answer yet (poll only then)
        self._seq = itertools.count(1)
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        self._forget: list[int] = []
        self._forget_all = False
        self._saving: set[str] = set()
        self._inflight: dict[bytes, str] = {}  # chunk digest -> request loading it (async)
        # blocks a load not known good writes (sync: and its step computes over them)
        self._unverified_blocks: dict[str, frozenset[int]] = {}
        self._poisoned: dict[int, str] = {}  # block -> request whose sync load failed to fill it
        self._admission_hit: dict[str, int] = {}  # vLLM's own hit at the request's admission
        self._keys: dict[str, RequestKeys] = {}  # what each request is keyed by, until it ends
        self.stats = BsrConnectorStats()
        self.tiers: tuple[tuple[str, str], ...] = ()  # the worker's (tier, hit source)
        self.relay = EventRelay(settings.tp_size)  # KV event notices -> vLLM's publisher
        # notices taken from the relay (and counted) for the next take_events: vLLM takes a
        # step's stats before its events, so they are taken with the stats
        self._events: list[ChunkNotice] = []
        self._steps: deque[tuple[float, int]] = deque()  # (scheduled at, tokens) per step
        self.prefill = CostModel()  # the prefill rate measured here (policy "cost")
        self.sightings = SightingCounter() if settings.options.admit_after_sightings > 1 else None
        self.windows = WindowSaver(settings, self.stats)
        self.blocks_of: Any = None  # vLLM's block ids of a request (bound with its manager)

    # ------------------------------------------------------------------ handshake
    def set_lookup_socket(self, path: str | None, tiers: tuple[tuple[str, str], ...] = ()) -> None:
        self.client.close()
        self.client.path = path
        self.tiers = tuple(tiers)
        self._log.info("bsr.vllm.lookup_socket", path=path, tiers=self.tiers)

    # ------------------------------------------------------------------ lookups
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's own hit that bsr can load, ``None`` while the answer is out."""
        self._admission_hit[request.request_id] = num_computed_tokens
        if not self.settings.loads or self.client.path is None:
            return 0, False
        keys = self.keys_of(request)
        if not keys.loads:
            return 0, False
        usable = (max(0, int(request.num_prompt_tokens) - 1) // self.chunk) * self.chunk
        cap = keys.options.max_load_tokens
        if cap is not None:  # whole chunks, at most that many past vLLM's own hit
            usable = min(usable, (num_computed_tokens + cap) // self.chunk * self.chunk)
        rid = request.request_id
        st = self._reqs.get(rid)
        if usable <= num_computed_tokens or (st is not None and st.failed):
            return 0, False
        if st is None:
            st = self._reqs[rid] = _Req()
        if not st.prompt:
            st.prompt = prompt_tokens(request)
        prompt = st.prompt
        self._collect()
        answered = st.hit is not None and not st.used and st.probed == usable
        hints = LookupHints(num_computed_tokens, self.prefill.prefill_rate or 0.0)
        if not answered and not self._await_answer(rid, st, prompt, usable, keys, hints):
            return None, False
        hit = int(st.hit or 0)
        if hit <= num_computed_tokens:
            return 0, False
        if self.opts.asynchronous and self._loading_elsewhere(rid, st, keys, num_computed_tokens):
            self.stats.count("deferred")
            return None, False
        st.start, st.end = num_computed_tokens, hit
        return hit - num_computed_tokens, self.opts.asynchronous

    def keys_of(self, request: Request) -> RequestKeys:
        """What ``request`` is keyed by (computed once; counted when bsr cannot use it)."""
        rid = request.request_id
        keys = self._keys.get(rid)
        if keys is None:
            keys = self._keys[rid] = request_keys(request, self.chunk)
            if keys.unkeyable is not None:
                self.stats.count_key("unkeyable_requests", keys.unkeyable)
                self._log.info("bsr.vllm.unkeyable", request=rid, reason=keys.unkeyable)
            if keys.error is not None:
                # a known field or "unknown": never a series per client-chosen name
                self.stats.count_key("rejected_options", option_label(keys.error))
                self._log.warning("bsr.vllm.bad_request_option", request=rid, error=str(keys.error))
        return keys

    def _await_answer(
        self,
        rid: str,
        st: _Req,
        prompt: Any,
        usable: int,
        keys: RequestKeys,
        hints: LookupHints | None = None,
    ) -> bool:
        """Send the lookup if needed; True once ``st.hit`` holds a usable answer."""
        fresh = st.lookup_id is None or st.used or st.probed != usable
        if fresh:
            self._drop_lookup(st)
            seq = next(self._seq)
            st.lookup_id, st.sent_at, st.probed = seq, time.monotonic(), usable
            st.hit, st.used = None, False
            self._by_lookup[seq] = rid
            self._unanswered.add(seq)
            self.stats.count("lookups")
            if not self.client.submit(seq, prompt[:usable], keys.extras, hints):
                self._by_lookup.pop(seq, None)
                self._unanswered.discard(seq)
                # no worker to ask (yet): a miss, asked again next time
                st.lookup_id, st.hit, st.used = None, 0, True
                return True
            return False
        if st.hit is not None:
            return True
        if time.monotonic() - st.sent_at > self.opts.lookup_timeout_s + LOOKUP_GRACE_S:
            self.stats.count("lookups_timed_out")
            self._log.warning("bsr.vllm.lookup_late", request=rid, s=self.opts.lookup_timeout_s)
            self._drop_lookup(st)
            st.hit, st.used = 0, True  # a miss now; a later ask looks up again
            return True
        return False

    def _collect(self) -> None:
        """Take every answer that has arrived (never waits)."""
        if not self._unanswered:
            return
        for seq, answer in self.client.poll_answers().items():
            self._unanswered.discard(seq)
            rid = self._by_lookup.get(seq)
            st = self._reqs.get(rid) if rid is not None else None
            if st is None or st.lookup_id != seq:
                self._by_lookup.pop(seq, None)
                self._forget.append(seq)  # nobody will load it: its lease may go
                continue
            st.hit = min(answer.hit, st.probed) // self.chunk * self.chunk
            st.by_tier, st.skip = answer.by_tier, answer.skip

    def _drop_lookup(self, st: _Req) -> None:
        if st.lookup_id is not None:
            self._by_lookup.pop(st.lookup_id, None)
            self._unanswered.discard(st.lookup_id)  # a late answer is ignored (and forgotten)
            if not st.used:
                self._forget.append(st.lookup_id)
        st.lookup_id = None

    def _digests(self, st: _Req, keys: RequestKeys) -> tuple[bytes, ...]:
        """Chained digests of the prompt's full chunks (each names the whole prefix so far,
        with the request's extra keys: another tenant's load of the same tokens is not this
        request's)."""
        n = st.probed // self.chunk
        if len(st.digests) < n:
            found = chunk_keys(
                INFLIGHT_NAMESPACE, st.prompt[: n * self.chunk], self.chunk, extras=keys.extras
            )
            st.digests = tuple(k.digest for k in found)
        return st.digests[:n]

    def _loading_elsewhere(self, rid: str, st: _Req, keys: RequestKeys, computed: int) -> bool:
        if not self._inflight:
            return False
        digests = self._digests(st, keys)
        first, last = computed // self.chunk, int(st.hit or 0) // self.chunk
        return any(self._inflight.get(d, rid) != rid for d in digests[first:last])

    # ------------------------------------------------------------------ loads
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        keys = self.keys_of(request)
        if keys.stores and self.settings.saves:  # an opted-out or unkeyable one is never stored
            self.windows.track(request, keys.extras)
        table = blocks.get_block_ids()[0]  # sync mode (_admit): one KV cache group
        local_hit = self._admission_hit.pop(rid, None)
        if local_hit is not None and not self.opts.asynchronous:
            self._admit(rid, table, local_hit)
        st = self._reqs.get(rid)
        if num_external_tokens <= 0 or st is None or st.hit is None:
            return
        end = st.start + num_external_tokens
        prompt = st.prompt
        n_blocks = -(-end // self.block)
        # one table per KV cache group (a sliding-window group's blocks below its window are
        # vLLM's null block 0)
        tables = tuple(tuple(t[:n_blocks]) for t in blocks.get_block_ids())
        # the worker leased a probe of exactly prompt[:hit]; any other end probes again
        lookup = st.lookup_id if end == st.hit else None
        job = LoadJob(
            request.request_id, tuple(prompt[:end]), st.start, tables, lookup, keys.extras,
            st.skip,
        )  # fmt: skip
        self._loads.append(job)
        st.used, st.loading, st.unverified, st.end = True, True, True, end
        # the blocks bsr writes (vLLM's own hit before them holds its computed KV); a sync
        # load's step also computes the rest of the table over them, and vLLM caches all of it
        # at once: if the load fails, every one of them holds wrong KV (sync loads have one KV
        # cache group: several are refused at startup)
        first = st.start // self.block
        if self.opts.asynchronous:
            written = real_blocks(tuple(t[first:] for t in tables))
        else:
            written = frozenset(table[first:])
        self._unverified_blocks[rid] = written
        if self.opts.asynchronous:
            for d in self._digests(st, keys)[st.start // self.chunk : end // self.chunk]:
                self._inflight.setdefault(d, request.request_id)
        self.stats.count("hit_tokens", num_external_tokens)
        for (name, _), n in self._split(st, num_external_tokens).items():
            self.stats.count_key("hit_tokens_by_tier", name, n)

    def _split(self, st: _Req, total: int) -> dict[tuple[str, str], int]:
        """``total`` promised tokens by ``(tier, hit source)``, in proportion to what the
        lookup's answer said each tier holds (the remainder to the slowest tier)."""
        weights = {self.tiers[i]: n for i, n in enumerate(st.by_tier[: len(self.tiers)]) if n > 0}
        whole = sum(weights.values())
        if total <= 0 or not whole:
            return {}
        out = {t: total * n // whole for t, n in weights.items()}
        slowest = max(weights, key=self.tiers.index)
        out[slowest] += total - sum(out.values())
        return {t: n for t, n in out.items() if n > 0}

    def hit_sources(self, request: Request, total: int) -> dict[str, int]:
        """``total`` external hit tokens of ``request`` by vLLM's hit source (``host``,
        ``disk``, ``external_unspecified``), from its lookup's answer (empty: unknown)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return {}
        out: dict[str, int] = {}
        for (_, source), n in self._split(st, total).items():
            out[source] = out.get(source, 0) + n
        return out

    def _admit(self, rid: str, table: list[int], local_hit: int) -> None:
        """Sync mode: the blocks vLLM admits a request with (see "Failed sync loads").

        Blocks past vLLM's own hit are fresh: whatever a failed load left in them is gone. A hit
        block that a failed sync load wrote taints the request; one that a sync load not known
        good yet writes makes it wait on that load's outcome.
        """
        if not self._poisoned and not self._unverified_blocks and rid not in self._reqs:
            return
        first_fresh = local_hit // self.block
        for b in table[first_fresh:]:
            self._poisoned.pop(b, None)
        hit_blocks = set(table[:first_fresh])
        st = self._reqs.get(rid)
        if any(b in self._poisoned for b in hit_blocks):
            st = self._reqs.setdefault(rid, _Req())
            st.tainted = True
        for other, written in self._unverified_blocks.items():
            if other != rid and not hit_blocks.isdisjoint(written):
                st = self._reqs.setdefault(rid, _Req())
                st.waits_on.add(other)
        if st is not None and st.failed:
            st.readmitted = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BsrConnectorMetadata:
        self._steps.append(
            (time.perf_counter(), int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)))
        )
        while len(self._steps) > STEP_CLOCK_DEPTH:
            self._steps.popleft()
        meta = BsrConnectorMetadata(
            loads=self._loads, saves=self._saves, forget_lookups=self._forget,
            forget_all=self._forget_all,
        )  # fmt: skip
        self._loads, self._saves, self._forget, self._forget_all = [], [], [], False
        meta.windows = self._plan_windows(scheduler_output)
        # the workers bind each LoRA request to the weights they loaded for its first step
        meta.adapters = {
            r.req_id: int(r.lora_request.lora_int_id)
            for r in scheduler_output.scheduled_new_reqs
            if getattr(r, "lora_request", None) is not None
        }
        if self._unverified_blocks and not self.opts.asynchronous:
            # async scheduling runs a step ahead of a sync load's report: a request whose load
            # is not known good computes over it in this step too (a long prompt's next prefill
            # chunk), into blocks vLLM caches now
            cached = scheduler_output.scheduled_cached_reqs
            for rid, new in zip(cached.req_ids, cached.new_block_ids, strict=False):
                pending = self._unverified_blocks.get(rid)
                if pending is not None and new:
                    self._unverified_blocks[rid] = pending | frozenset(new[0])
        # a request scheduled now after its async load: its blocks are in vLLM's prefix cache,
        # so others sharing its chunks find them there (no longer "loading elsewhere")
        if self._inflight:
            scheduled = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            scheduled.update(scheduler_output.scheduled_cached_reqs.req_ids)
            for rid in scheduled:
                st = self._reqs.get(rid)
                if st is not None and not st.loading:
                    self._release_inflight(rid)
        return meta

    def _plan_windows(self, scheduler_output: SchedulerOutput) -> list[WindowJob]:
        """This step's window saves (:mod:`bsr.vllm._windows`), under the rule of saves."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)

        def blocks_of(rid: str) -> Any:
            if state is not None:
                return state.get_block_ids(rid)
            return None if self.blocks_of is None else self.blocks_of(rid)

        def may_save(rid: str, blocks: frozenset[int]) -> bool:
            st = self._reqs.get(rid)
            if st is not None and (st.unverified or st.tainted or st.waits_on or st.loading):
                return False
            return not any(blocks & p for p in self._unverified_blocks.values()) and not any(
                b in self._poisoned for b in blocks
            )

        return self.windows.plan(scheduler_output, blocks_of, may_save)

    def _release_inflight(self, rid: str) -> None:
        for d in [d for d, owner in self._inflight.items() if owner == rid]:
            del self._inflight[d]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self._saving.discard(rid)
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, BsrWorkerMetadata):
            for rid, ok in meta.loads.items():
                self._outcome(rid, ok)
            if meta.events:
                self.relay.add(meta.events)
            self.windows.done(meta.windows)

    def _outcome(self, rid: str, ok: bool) -> None:
        written = self._unverified_blocks.pop(rid, frozenset())
        if not self.opts.asynchronous:
            if not ok:  # vLLM's prefix cache may hand them out as they are
                self._poisoned.update(dict.fromkeys(written, rid))
            for other in self._reqs.values():
                if rid in other.waits_on:
                    other.waits_on.discard(rid)
                    other.tainted = other.tainted or not ok
        st = self._reqs.get(rid)
        if st is None:
            self._release_inflight(rid)
            return
        # vLLM has handled this step's failed loads (failed_recving, invalid blocks) before it
        # hands the output to the connector: from here on, the request's computed tokens are
        # what vLLM computed or bsr verified-installed (a failed load's blocks are recomputed)
        st.loading, st.unverified = False, False
        if not ok:
            st.failed = True  # never offered a load again
            self._release_inflight(rid)

    # ------------------------------------------------------------------ saves
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        """Schedule a save of the request's computed full chunks; hold its blocks until done.

        ``block_ids``: the request's blocks per KV cache group (vLLM's
        ``request_finished_all_groups``).
        """
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._admission_hit.pop(rid, None)
        keys = self.keys_of(request)
        del self._keys[rid]
        params = (
            None
            if keys.error is None
            else {"bsr": {"error": keys.error.message, **keys.error.fields}}
        )
        self.windows.forget(rid)
        computed = min(int(request.num_computed_tokens), len(request.all_token_ids))
        if st is not None:
            self._drop_lookup(st)
            if not st.loading:
                self._release_inflight(rid)
            if self._poisoned and not st.readmitted:
                # its own failed sync load's blocks that vLLM had it compute again in place
                for b in (b for t in block_ids for b in t[: computed // self.block]):
                    if self._poisoned.get(b) == rid:
                        del self._poisoned[b]
        if not self.settings.saves:
            return False, params
        if not keys.stores:  # it opted out, or bsr cannot key it: never stored
            why = "unkeyable" if keys.unkeyable else "rejected_options" if keys.error else "opt_out"
            self.stats.count_key("saves_skipped", why)
            return False, params
        if st is not None and (st.unverified or st.tainted or st.waits_on):
            # its load is still running (async: vLLM itself holds the blocks until the workers
            # report the load received, which they do once bsr can no longer write into
            # them), its outcome is not known yet, or it failed; or vLLM admitted it on the
            # blocks of a failed sync load: never save that KV
            self.stats.count_key("saves_skipped", "unverified")
            return False, params
        n = (computed // self.chunk) * self.chunk
        if n == 0:
            return False, params
        tables = tuple(tuple(t[: n // self.block]) for t in block_ids)
        blocks = real_blocks(tables)
        if any(blocks & pending for pending in self._unverified_blocks.values()) or any(
            b in self._poisoned for b in blocks
        ):
            # shares blocks with a load whose outcome is not known yet (sync loads fill
            # blocks that vLLM caches at once): they may never have been written; or with a
            # failed sync load's
            self.stats.count_key("saves_skipped", "unverified")
            return False, params
        if len(self._saving) >= self.opts.max_pending_saves:
            self.stats.count_key("saves_skipped", "busy")
            return False, params
        n = self._admitted(request, n, keys)
        if n == 0:
            self.stats.count_key("saves_skipped", "not_admitted")
            return False, params
        tables = tuple(tuple(t[: n // self.block]) for t in block_ids)
        events = save_events(request, n, self.block) if self.settings.kv_events else None
        self._saves.append(
            SaveJob(rid, tuple(request.all_token_ids[:n]), tables, keys.extras, events)
        )
        self._saving.add(rid)
        return True, params

    def _admitted(self, request: Request, n: int, keys: RequestKeys) -> int:
        """Tokens of the first ``n`` worth saving: the leading chunks seen with at least
        ``admit_after_sightings`` requests (this one counted), all of them by default."""
        if self.sightings is None:
            return n
        found = chunk_keys(
            SIGHTING_NAMESPACE, list(request.all_token_ids[:n]), self.chunk, extras=keys.extras
        )
        threshold = self.opts.admit_after_sightings
        return self.sightings.admitted([k.digest for k in found], threshold) * self.chunk

    # ------------------------------------------------------------------ the rest
    def reset_cache(self) -> bool:
        """Forget every lookup answer (the workers drop their leases); True."""
        for st in self._reqs.values():
            if not st.loading:
                self._drop_lookup(st)
                st.hit, st.used = None, False
        self._forget_all = True
        self._log.info("bsr.vllm.reset_cache")
        return True

    def _take_relay(self) -> None:
        for n in self.relay.take():
            self.stats.count_key("kv_events", "stored" if n.stored else "removed")
            self._events.append(n)

    def take_events(self) -> list[ChunkNotice]:
        """The KV event notices to publish since the last call (counted)."""
        self._take_relay()
        out, self._events = self._events, []
        return out

    def take_stats(self) -> BsrConnectorStats | None:
        # vLLM takes a step's stats before its events: the events it is about to publish are
        # taken (and counted) now, so the counts ship in the same step
        self._take_relay()
        # vLLM asks once per engine step, after the step's output: time that step
        if self._steps:
            scheduled_at, tokens = self._steps.popleft()
            if tokens >= self.chunk:  # a step that prefills (decode-only steps say little)
                self.prefill.observe_prefill(tokens, time.perf_counter() - scheduled_at)
        return self.stats.take()

    def shutdown(self) -> None:
        self.client.close()


def real_blocks(tables: tuple[tuple[int, ...], ...]) -> frozenset[int]:
    """Every block of every group's table but vLLM's null block 0 (block ids are unique across
    groups: vLLM's groups share one block pool)."""
    return frozenset(b for t in tables for b in t if b != NULL_BLOCK_ID)
