"""The worker side's duties towards a fleet's router: KV event notices, the lookup's per-tier
answer, and load-or-recompute at lookup under policy ``"cost"``.

Where it runs: every vLLM worker process, on the connector's event-loop thread (the removal
listener also on tier worker threads: the journal is thread-safe). One instance per worker,
made once the engine is open (:meth:`bsr.vllm._worker.BsrWorker.register_kv_caches`).

How it works:

* **Events** (vLLM's KV events on): the engine's removals feed the :class:`EventJournal`; after
  each save the saved objects are audited in every tier (``RestoreEngine.audit``; those the
  save skipped as already held and not yet announced are read back and verified, a damaged one
  quarantined) and what is held is announced (:meth:`WorkerFleet.after_save`); every
  ``kv_events_audit_s`` every announced object is audited again
  (:meth:`WorkerFleet.audit_forever`), which reports what vanished. The notices go to the
  scheduler with the step's worker metadata.
* **Per-tier answer**: of the tokens a lookup offers past vLLM's own hit, how many each tier
  holds (a chunk counts under the slowest tier any of its groups is read from), so the
  scheduler reports vLLM's hits by source (``get_external_cache_hit_sources``).
* **Cost**: under policy ``"cost"`` the lookup's probe carries the engine's
  :class:`~bsr.LoadDecision` (made with vLLM's own hit and the scheduler's measured prefill
  rate); the worker offers only the chunks worth loading, and logs the decision with its
  inputs (``bsr.vllm.decided``).
"""

from __future__ import annotations

import math
from typing import Any

import anyio

from bsr import BsrError, ObjectKey, Probe, RestoreEngine, SaveResult

from .._log import logger
from ._events import ChunkInfo, ChunkNotice, EventJournal, chunk_infos, tier_kind
from ._metadata import SaveJob
from ._options import ConnectorSettings
from ._stats import BsrConnectorStats

#: objects one audit call rechecks at once
AUDIT_BATCH = 4096


class WorkerFleet:
    """See the module docstring.

    Args:
        settings: the connector's settings.
        engine: the rank's open engine.
        groups: bsr's state group per vLLM KV cache group, in vLLM's order.
        specs: each KV cache group's spec kind and sliding window (vLLM's event fields).
        rank: this worker's tensor-parallel rank.
        stats: the worker's stats (decisions and removals are counted on rank 0).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        engine: RestoreEngine,
        groups: tuple[str, ...],
        specs: list[tuple[str | None, int | None]],
        rank: int,
        stats: BsrConnectorStats,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.groups = groups
        self.specs = specs
        self.rank = rank
        self.stats = stats
        self.kinds = {t.name: tier_kind(t) for t in engine.tiers}
        self.tier_index = {t.name: i for i, t in enumerate(engine.tiers)}
        self.journal: EventJournal | None = None
        self._unsubscribe = None
        self._log = logger.bind(role="worker", model=settings.model_id)
        if settings.kv_events:
            self.journal = EventJournal(
                self.kinds, rank=rank, max_objects=settings.options.kv_events_max_objects
            )
            self._unsubscribe = engine.on_removed(self.journal.removed)

    def tiers(self) -> tuple[tuple[str, str], ...]:
        """``(name, hit source)`` of each tier, fastest first (sent in the handshake)."""
        return tuple((t.name, self.kinds[t.name].source) for t in self.engine.tiers)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # ------------------------------------------------------------------ events
    def begin(self) -> int | None:
        """Before a save: number the removals that may race it (None: events are off)."""
        return None if self.journal is None else self.journal.begin()

    def end(self, since: int | None) -> None:
        if self.journal is not None and since is not None:
            self.journal.end(since)

    async def after_save(self, job: SaveJob, result: SaveResult | None, since: int) -> None:
        """Announce the saved objects each tier holds now (its storage says so)."""
        journal, events = self.journal, job.events
        if journal is None or events is None or result is None or result.chunks == 0:
            return
        layout, block = self.engine.layout, self.settings.block_size
        keys = self.engine.keys(list(job.tokens[: result.saved_tokens]), extras=job.extras)
        infos: dict[tuple[int, str], ChunkInfo] = {}
        for c, g in layout.needed_objects(result.chunks):
            idx = self.groups.index(g)
            kind, window = self.specs[idx] if idx < len(self.specs) else (None, None)
            info = chunk_infos(
                events, job.tokens, chunk_tokens=layout.chunk_tokens, block_size=block,
                chunk=c, group_idx=idx, spec_kind=kind, sliding_window=window,
            )  # fmt: skip
            if info is not None:
                infos[(c, g)] = info
        objects = [
            (t.name, ObjectKey(keys[c], g), info)
            for (c, g), info in infos.items()
            for t in self.engine.tiers
        ]
        # an object the save found already held in a tier (it did not write it) is read back
        # and verified there before it is announced, unless it is announced there already
        skipped = {name for name, n in result.objects_skipped.items() if n}
        verify = [
            name in skipped and not journal.is_announced(name, okey.object_id)
            for name, okey, _ in objects
        ]
        try:
            held = await self.engine.audit(
                [(name, okey) for name, okey, _ in objects], verify=verify
            )
        except BsrError as exc:
            self._log.warning("bsr.vllm.events_audit_failed", error=repr(exc))
            return
        for (name, okey, info), h in zip(objects, held):
            if h:
                journal.stored(name, okey, info, since)

    async def audit_forever(self) -> None:
        """Recheck every announced object every ``kv_events_audit_s`` (until cancelled)."""
        if self.journal is None:
            return
        every = self.settings.options.kv_events_audit_s
        while True:
            await anyio.sleep(every)
            await self.audit_once()

    async def audit_once(self) -> None:
        """Recheck every announced object once (what vanished is reported and withdrawn)."""
        if self.journal is None:
            return
        announced = self.journal.announced()
        for i in range(0, len(announced), AUDIT_BATCH):
            try:
                await self.engine.audit(announced[i : i + AUDIT_BATCH])
            except BsrError as exc:
                self._log.warning("bsr.vllm.events_audit_failed", error=repr(exc))

    def notices(self) -> list[ChunkNotice]:
        """The notices since the last step (counted on rank 0)."""
        if self.journal is None:
            return []
        out = self.journal.take()
        if self.rank == 0:
            for n in out:
                if not n.stored:
                    self.stats.count_key("object_removals", n.cause or "removed")
        return out

    # ------------------------------------------------------------------ lookups
    def offer(self, probe: Probe, start_tokens: int, seq: int) -> int:
        """The tokens to offer for ``probe``: its prefix, or under policy ``"cost"`` the part
        worth loading (counted, and logged with its inputs)."""
        decision = probe.decision
        if decision is None:
            return probe.prefix_tokens
        chunk = self.engine.layout.chunk_tokens
        if decision.choice != "empty" and self.rank == 0:
            self.stats.count_key("load_decisions", decision.choice)
            end = decision.load_chunks * chunk
            loaded = max(0, end - start_tokens)
            rest = max(0, decision.probed_chunks * chunk - max(start_tokens, end))
            if loaded:
                self.stats.count_key("cost_tokens", "load", loaded)
            if rest:
                self.stats.count_key("cost_tokens", "recompute", rest)
        self._log.info("bsr.vllm.decided", lookup=seq, **_plain(decision.to_dict()))
        return decision.load_chunks * chunk

    def by_tier(self, probe: Probe, hit: int, start_tokens: int) -> list[int]:
        """Of ``hit`` tokens offered past ``start_tokens``, the tokens each tier holds (a chunk
        under the slowest tier one of its groups is read from)."""
        layout = self.engine.layout
        chunk = layout.chunk_tokens
        out = [0] * len(self.engine.tiers)
        n = min(hit // chunk, probe.prefix_chunks)
        if n == 0:
            return out
        slowest: dict[int, int] = {}
        for c, g in layout.needed_objects(n):
            names = probe.holders[c].get(g, ())
            if names:
                slowest[c] = max(slowest.get(c, 0), self.tier_index.get(names[0], 0))
        for c, idx in slowest.items():
            tokens = (c + 1) * chunk - max(c * chunk, start_tokens)
            if tokens > 0:
                out[idx] += tokens
        return out


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """Log fields without infinities (JSON renderers refuse them)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
