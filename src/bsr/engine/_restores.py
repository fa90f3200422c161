"""The restore path of one engine: lookups, and each restore from admission to its end.

Where it runs: the serving process's event loop, inside ``RestoreEngine.lookup`` and
``RestoreEngine.restore`` (which keep the public signatures and documentation).

How it works: :class:`Restores` is one per engine. A lookup probes (no data moves), adds the
load decision under policy ``"cost"`` and leases what it found; a restore is admitted (its
arguments checked and its request record opened, no I/O), waits for a warm copying its objects,
runs as a :class:`~bsr.engine._job.RestoreJob` and ends counted, logged and reported to the
engine's listeners; a cancelled or failed one ends invalidated first. The engine's counters
(``restores``, ``committed``, ``invalidated``) are the dict it shares with this object.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import anyio

from .._check import Check, non_negative_int, optional_positive_seconds
from .._errors import BlockTableError, ConfigError
from ..core._keys import Extras, ObjectKey, TokensLike, check_extras, token_count
from ..core._lifecycle import Reason, RequestLifecycle
from ..core._options import Policy, Strategy, choice
from ..core._plan import needed_objects
from ..core._results import Probe, RestoreResult
from ..tiers._base import Tier, TierLease
from ..transfer._cache import PagedKVCache
from ..transfer._run import OnInstalled
from ..transfer._tables import BlockTables
from ._job import RestoreJob, RestoreParts
from ._leases import LeaseBook, ProbeLease
from ._request import RestoreRequest
from ._warm import Warmer


class Restores:
    """Lookups and restores of one engine (see the module docstring)."""

    def __init__(
        self,
        parts: RestoreParts,
        tiers: list[Tier],
        warmer: Warmer,
        leases: LeaseBook,
        *,
        rank: int,
        policy: Policy,
        deadline_s: float | None,
        counts: dict[str, int],
        log: Any,
        notify: Callable[[Any], None],
    ) -> None:
        self.parts, self.layout, self.tiers = parts, parts.layout, tiers
        self.warmer, self.leases, self.rank = warmer, leases, rank
        self.policy, self.deadline_s = policy, deadline_s
        self.counts, self.log, self.notify = counts, log, notify
        self._ids = itertools.count()

    # ------------------------------------------------------------------ lookup
    async def lookup(
        self,
        tokens: TokensLike,
        extras: Extras | None,
        lease_ttl_s: float | None,
        deadline_s: float | None,
        local: bool,
        start_tokens: int,
        prefill_tokens_per_s: float | None,
        skip_tiers: Collection[str] = (),
    ) -> Probe:
        """``RestoreEngine.lookup``."""
        self.parts.staging()  # an open engine
        self.leases.reclaim()
        extras = check_extras(extras)
        skip = self.skip_names(skip_tiers)
        ttl = optional_positive_seconds(lease_ttl_s, "lease_ttl_s", key="lease_ttl_s")
        deadline = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        if Check.flag(local, "local") and ttl is not None:
            raise ConfigError(
                "a local lookup takes no lease (its probe is one rank's); drop lease_ttl_s or "
                "local=True"
            )
        prober = self.parts.prober
        out = await prober.probe(
            tokens, deadline_s=deadline, partial=True, agree=not local, extras=extras, skip=skip
        )
        probe = out.probe
        if self.policy is Policy.COST:
            probe = replace(probe, decision=self.parts.cost.decide(
                self.layout, probe, start_tokens=start_tokens, prefill_rate=prefill_tokens_per_s,
            ))  # fmt: skip
        if ttl is not None and probe.prefix_chunks:
            probe = replace(probe, lease=await self._lease(probe, ttl))
        self.log.debug(
            "bsr.probe", tokens=probe.num_tokens, prefix_tokens=probe.prefix_tokens,
            local_chunks=probe.local_chunks, bytes_by_tier=probe.bytes_by_tier,
        )  # fmt: skip
        self.notify(probe)
        return probe

    async def narrow(
        self, probe: Probe, tokens: TokensLike, extras: Extras | None, lease_ttl_s: float | None
    ) -> Probe:
        """``RestoreEngine.narrow``."""
        self.parts.staging()  # an open engine
        self.leases.reclaim()
        self.check_probe_origin(probe)
        extras = check_extras(extras)
        ttl = optional_positive_seconds(lease_ttl_s, "lease_ttl_s", key="lease_ttl_s")
        if self.parts.coordinator.world_size > 1:
            raise ConfigError(
                "narrow cuts one rank's probe; with several ranks each one's prefix was agreed "
                "with the others: look the shorter tokens up again on every rank"
            )
        keyed = await self.parts.prober.keyed(tokens, extras)
        if keyed.keys != probe.keys[: len(keyed.keys)]:  # longer tokens: a longer tuple
            raise ConfigError(
                "narrow takes a prefix of the tokens the probe was made for, with the same "
                "extras; look these tokens up instead"
            )
        out = self.parts.prober.narrowed(probe, keyed)
        if ttl is not None and out.prefix_chunks:
            out = replace(out, lease=await self._lease(out, ttl))
        return out

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
        return self.leases.add(leases, ttl_s)

    def skip_names(self, skip_tiers: Collection[str]) -> frozenset[str]:
        """``skip_tiers`` checked: names of this engine's tiers (else a ConfigError)."""
        if isinstance(skip_tiers, str | bytes) or not isinstance(skip_tiers, Collection):
            raise ConfigError(
                f"skip_tiers must be a collection of tier names, got {skip_tiers!r}; pass "
                'e.g. ("pool",), not a bare string'
            )
        names = [t.name for t in self.tiers]
        unknown = sorted(repr(n) for n in skip_tiers if n not in names)
        if unknown:
            raise ConfigError(
                f"skip_tiers names {', '.join(unknown)}, not among this engine's tiers {names}",
                unknown=unknown,
            )
        return frozenset(skip_tiers)

    # ------------------------------------------------------------------ restore
    def check_probe_origin(self, probe: Probe) -> None:
        if not isinstance(probe, Probe):
            raise ConfigError(f"probe must be a bsr.Probe from lookup(), got {type(probe)}")
        if probe.origin != self.parts.prober.origin:
            # refused before anything moves; the probe (and its lease) stays its engine's
            raise ConfigError(
                "probe was made by another RestoreEngine (it names that engine's tiers and "
                "holds that engine's leases); pass it to the engine whose lookup() made it, or "
                "pass no probe to probe again"
            )

    def admit(
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
        skip_tiers: Collection[str] = (),
    ) -> RestoreRequest:
        """Check the arguments and open the request's record (no I/O).

        Runs on the event loop, before the first checkpoint, so it must stay cheap (the block
        table check is a NumPy sort); its time counts against the deadline, which runs from
        ``started`` (when ``restore`` was called).
        """
        self.parts.staging()  # an open engine
        self.leases.reclaim()
        check_cache(cache, self.layout)
        ext = check_extras(extras)
        skip = self.skip_names(skip_tiers)
        first_block, valid_chunks = self._start(start_tokens, cache)
        n_full = self.layout.num_chunks(token_count(tokens))
        tables = cache.block_tables(block_ids, n_full * self.layout.chunk_tokens)
        _check_serves(tables, n_full, first_block, self.layout.chunk_tokens)
        deadline = optional_positive_seconds(deadline_s, "deadline_s", key="deadline_s")
        deadline = self.deadline_s if deadline is None else deadline
        rid = request_id or f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        life = RequestLifecycle(rid, rank=self.rank)
        life.facts.layout = self.layout
        asked = self.policy if policy is None else choice(Policy, policy, "policy")
        # policy "cost" decides how much to load, then commits that all-or-nothing
        life.facts.policy = Policy.ALL_OR_NOTHING if asked is Policy.COST else asked
        self.counts["restores"] += 1
        return RestoreRequest(
            rid=rid, life=life, log=self.log.bind(request_id=rid), tokens=tokens, extras=ext,
            cache=cache, cost=asked is Policy.COST,
            tables=tables, policy=life.facts.policy,
            strategy=choice(Strategy, strategy, "strategy"),
            deadline_at=None if deadline is None else started + deadline, t0=started,
            first_block=first_block, valid_chunks=valid_chunks, on_installed=on_installed,
            skip_tiers=skip,
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

    async def run(self, req: RestoreRequest, probe: Probe | None) -> RestoreResult:
        """Run an admitted restore (after any warm copying its objects), then note it for
        promotion."""
        try:  # a warm copying these objects now: wait for it rather than read them twice
            probe = await self.warmer.join(req.tokens, req.extras, probe, req.deadline_at)
        except BaseException as exc:
            if probe is not None:
                probe.release()  # the job that would have released its leases never ran
            self._abort(req, exc)
            raise
        job = RestoreJob(self.parts, req, probe)
        try:
            restored = await job.run()
        except BaseException as exc:
            self._abort(req, exc)
            raise
        finally:
            await job.release()
        result = self._finish(req, job.result(restored))
        if result.committed and restored.window is not None:
            self.warmer.after_restore(
                restored.window.probe.keys[: result.committed_tokens // self.layout.chunk_tokens],
                result.committed_tokens, result.bytes_by_tier,
            )  # fmt: skip
        return result

    def _abort(self, req: RestoreRequest, exc: BaseException) -> None:
        """Cancellation or a bug: never leave the request non-terminal."""
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        if not req.life.terminal:
            req.life.invalidate(Reason.CANCELLED if cancelled else Reason.INTERNAL_ERROR)
        self.counts["invalidated"] += 1
        req.log.warning("bsr.restore.aborted", reason=str(req.life.reason), error=repr(exc))

    def _finish(self, req: RestoreRequest, result: RestoreResult) -> RestoreResult:
        self.counts["committed" if result.committed else "invalidated"] += 1
        self.parts.cost.observe_restore(result)
        req.log.info(
            "bsr.restore.done", state=str(result.state), reason=str(result.reason),
            committed_tokens=result.committed_tokens, probed_tokens=result.probed_tokens,
            bytes_by_tier=result.bytes_by_tier, rws_peak_bytes=result.rws_peak_bytes,
            total_s=round(result.timings.total_s, 6), strategy=str(result.strategy.value),
        )  # fmt: skip
        self.notify(result)
        return result


def check_cache(cache: PagedKVCache, layout: Any) -> None:
    """A restore's or a save's cache: a PagedKVCache of ``layout``."""
    if not isinstance(cache, PagedKVCache):
        raise ConfigError(f"cache must be a bsr.PagedKVCache, got {type(cache).__name__}")
    cache.check_layout(layout)


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
