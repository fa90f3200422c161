"""Probing: the longest reusable prefix across tiers and groups, then agreed across ranks.

Where it runs: the engine's event loop; tier calls are metadata only (``contains_many``).

How it works: the tokens are converted and keyed once (in a worker thread when the prompt is long,
so the event loop is never held for long). Every tier whose breaker admits it is asked which
(chunk, group) objects it holds, all of them at once (a tier that hangs holds up no other; one
still answering when the probe's time is up holds nothing); quarantined objects count as
absent. The plan that comes out is
``holders[chunk][group] -> tier names, fastest first``, the one shape that both the public
:class:`~bsr.Probe` and the transfer pipeline read. This rank's longest usable prefix is then
handed to the coordinator's agreement (:func:`~bsr.engine._coordinator.agree_prefix`: the MIN
of every rank's, re-proposed shorter until every rank can use it; sliding-window groups may need
other chunks for a shorter prefix). The prober probes; the coordinator agrees.

A rank whose probe ran past its deadline proposes :data:`~bsr.engine._coordinator.LATE` (below
every prefix), so the MIN tells every rank, in the same round, that some rank is out of time:
all of them end the request Invalidated, none commits the empty prefix while another gives up
(the deadline is agreed like every other failure).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import xxhash

from ..core._keys import (
    OFFLOAD_TOKENS,
    ChunkKey,
    Extras,
    KeyedTokens,
    ObjectKey,
    TokensLike,
    extras_digest,
    prepare_tokens,
    token_count,
)
from ..core._layout import StateLayout
from ..core._plan import longest_prefix, prefix_usable
from ..core._results import Probe
from ..tiers._base import Tier
from ._coordinator import LATE, Coordinator, agree_prefix
from ._decisions import Quarantine
from ._health import TierHealth

Holders = list[dict[str, tuple[str, ...]]]


@dataclass(frozen=True)
class ProbeOutcome:
    """A probe and whether a deadline ended it: on this rank, or on another one."""

    probe: Probe
    #: this rank's deadline fired during its probe
    timed_out: bool = False
    #: another rank's probe ran past its deadline (this one did not)
    other_late: bool = False

    @property
    def late(self) -> bool:
        return self.timed_out or self.other_late


def digest(namespace_fp: bytes, keyed: KeyedTokens) -> bytes:
    """A digest of (namespace, tokens, extras): a probe made for other tokens or other extra
    keys is refused by restore."""
    h = xxhash.xxh3_128(namespace_fp)
    h.update(keyed.tokens.tobytes() if not keyed.tokens.flags.c_contiguous else keyed.tokens.data)
    if keyed.extras:
        h.update(b"extras" + extras_digest(keyed.extras))
    return h.digest()


def _holders(groups: Sequence[str], n: int, answers: Sequence[tuple[str, list[bool]]]) -> Holders:
    """``holders[chunk][group]``: the names of the tiers whose answer holds each object (in
    tier order); ``answers[t][1][chunk * len(groups) + g]`` is tier ``t``'s answer."""
    per = len(groups)
    if len(answers) == 1:  # one tier answered (the usual case): shared tuples, no lists
        name, present = answers[0]
        some, none = (name,), ()
        return [
            {g: some if present[c * per + j] else none for j, g in enumerate(groups)}
            for c in range(n)
        ]
    out: Holders = []
    for c in range(n):
        base = c * per
        out.append(
            {
                g: tuple(name for name, present in answers if present[base + j])
                for j, g in enumerate(groups)
            }
        )
    return out


class Prober:
    """Finds the reusable prefix for one engine (and has the coordinator agree on it).

    Args:
        layout: the state layout.
        tiers: the engine's tiers, fastest first.
        namespace_fp: the engine's namespace fingerprint.
        health: circuit breakers (a tier whose breaker is open holds nothing for a probe).
        quarantine: objects this engine no longer uses.
        coordinator: cross-rank agreement (:func:`~bsr.engine._coordinator.agree_prefix`).
        log: the engine's logger.
        origin: the engine's identity, recorded in every probe it makes.
    """

    def __init__(
        self,
        layout: StateLayout,
        tiers: Sequence[Tier],
        namespace_fp: bytes,
        health: TierHealth,
        quarantine: Quarantine,
        coordinator: Coordinator,
        log: Any,
        origin: bytes = b"",
    ) -> None:
        self.origin = origin
        self.layout = layout
        self.tiers = list(tiers)
        self.namespace_fp = namespace_fp
        self.health = health
        self.quarantine = quarantine
        self.coordinator = coordinator
        self.log = log

    async def keyed(self, tokens: TokensLike, extras: Extras | None = None) -> KeyedTokens:
        """Convert and key ``tokens`` with ``extras`` (off the event loop when the prompt is
        long)."""
        work = functools.partial(
            prepare_tokens, self.namespace_fp, tokens, self.layout.chunk_tokens, extras=extras
        )
        if token_count(tokens) > OFFLOAD_TOKENS:
            # pure work: abandoning it on cancellation (a deadline) is safe
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        return work()

    def empty(self, n: int) -> Holders:
        return [{g.name: () for g in self.layout.groups} for _ in range(n)]

    async def holders(
        self,
        keys: Sequence[ChunkKey],
        deadline_at: float = math.inf,
        unanswered: list[str] | None = None,
        skip: Collection[str] = (),
    ) -> Holders:
        """Which tiers hold each (chunk, group) of ``keys``, by tier name, fastest first.

        The tiers are asked at once (a tier whose breaker is open is not asked), so a tier
        that hangs holds up no other; memory-speed ones (``inline_reads``) answer first, one
        after another, and a single other tier is awaited alone (a task group per probe costs
        more CPU than a host tier's answer). A tier still answering at ``deadline_at``
        (``time.perf_counter()`` time) is cut off: it holds nothing for this probe and the
        cut-off counts against its breaker, like any other timeout. The names of the tiers
        that did not answer (cut off, failed, breaker open) go to ``unanswered``, in tier order.
        The tiers named in ``skip`` are not asked (nor their breakers): they hold nothing, and
        count as not answering.
        """
        groups = [g.name for g in self.layout.groups]
        objs = [ObjectKey(k, g) for k in keys for g in groups]
        asked = [t for t in self.tiers if t.name not in skip and self.health.admit(t.name)]
        got: dict[str, list[bool]] = {}  # tier name -> present per object, once it answered
        settled: set[str] = set()  # the tiers whose breaker was told how the call went
        inline = [t.inline_reads for t in asked]  # a wrapper's is a property: read it once
        rest = [t for t, fast in zip(asked, inline) if not fast]
        try:
            for tier in (t for t, fast in zip(asked, inline) if fast):
                await self._ask(tier, objs, deadline_at, got, settled)
            if len(rest) == 1:
                await self._ask(rest[0], objs, deadline_at, got, settled)
            elif rest:
                async with anyio.create_task_group() as tg:
                    for tier in rest:
                        tg.start_soon(self._ask, tier, objs, deadline_at, got, settled)
        finally:
            for tier in asked:  # admitted, but the probe ended before the call did
                if tier.name not in settled:
                    self.health.release(tier.name)
        if unanswered is not None:
            unanswered.extend(t.name for t in self.tiers if t.name not in got)
        answers = [(t.name, got[t.name]) for t in self.tiers if t.name in got]
        return _holders(groups, len(keys), answers)

    async def _ask(
        self,
        tier: Tier,
        objs: list[ObjectKey],
        deadline_at: float,
        got: dict[str, list[bool]],
        settled: set[str],
    ) -> None:
        """One admitted tier's answer into ``got`` (none when it failed or was cut off); its
        breaker told once (``settled``), unless the probe itself ends first."""
        name = tier.name
        budget = deadline_at - time.perf_counter()
        if budget <= 0:  # never asked: says nothing about the tier
            settled.add(name)
            self.health.release(name)
            return
        try:
            with anyio.move_on_after(budget) as scope:
                present = await tier.contains_many(objs)
        except Exception as exc:  # a tier that cannot answer holds nothing for this probe
            settled.add(name)
            self.health.failure(name)
            self.log.warning("bsr.probe.tier_failed", tier=name, error=str(exc))
            return
        settled.add(name)
        if scope.cancelled_caught:
            self.health.failure(name)
            self.log.warning("bsr.probe.tier_timeout", tier=name, s=round(budget, 6))
            return
        self.health.success(name)
        answer = list(present)
        quarantine = self.quarantine
        if len(quarantine):  # nearly always empty: skip the object ids then
            for i, o in enumerate(objs):
                if answer[i] and (name, o.object_id) in quarantine:
                    answer[i] = False
        got[name] = answer

    async def probe(
        self,
        tokens: TokensLike,
        *,
        deadline_s: float | None,
        partial: bool = False,
        agree: bool = True,
        extras: Extras | None = None,
        share: float = 1.0,
        skip: Collection[str] = (),
    ) -> ProbeOutcome:
        """Probe ``tokens``; return the probe and whether a deadline ended it on any rank.

        Key derivation and tier queries run under ``deadline_s`` (a tier cut off by it holds
        nothing, see :meth:`holders`). When the deadline fired this rank proposes :data:`LATE`
        in the agreement, and the probe's prefix is empty on every rank; with ``partial`` it
        proposes instead what the tiers that answered in time hold. The agreement always runs
        (every rank must take part in it) unless ``agree`` is False: then the probe is this
        rank's alone, and it runs no collective.

        ``share`` (in (0, 1]): the tiers are waited for at most this share of the time left
        when they are asked; a tier cut off then holds nothing, and the probe goes on (not
        late) with what the others hold, leaving the rest of the deadline to the caller.
        ``skip``: tiers not asked (see :meth:`holders`).
        """
        t0 = time.perf_counter()
        deadline_at = math.inf if deadline_s is None else t0 + deadline_s
        keyed: KeyedTokens | None = None
        holders: Holders = []
        unanswered: list[str] = []
        with anyio.move_on_after(math.inf if deadline_s is None else deadline_s):
            keyed = await self.keyed(tokens, extras)
        if keyed is not None:
            now = time.perf_counter()
            cut_at = deadline_at if share >= 1 else now + share * max(0.0, deadline_at - now)
            holders = await self.holders(keyed.keys, cut_at, unanswered, skip)
            await anyio.lowlevel.checkpoint()
        else:  # the deadline fired while keying: no tier was asked
            unanswered = [t.name for t in self.tiers]
        timed_out = keyed is None or time.perf_counter() >= deadline_at
        if keyed is None or (timed_out and not partial):
            n = 0 if keyed is None else len(keyed.keys)
            holders = self.empty(n)

        def have(c: int, g: str) -> bool:
            return c < len(holders) and bool(holders[c][g])

        local = LATE if timed_out and not partial else self._local_prefix(holders, have)
        agreed = local
        if agree:
            # longest_prefix returned ``local`` because every object it needs is held: only a
            # shorter agreed prefix needs checking (the MIN of one rank is its own local)
            agreed = await agree_prefix(
                self.coordinator, local, lambda p: p == local or prefix_usable(self.layout, p, have)
            )
        probe = self._record(tokens, keyed, holders, max(local, 0), max(agreed, 0), t0)
        if unanswered:
            probe = replace(probe, unanswered=tuple(unanswered))
        return ProbeOutcome(probe, timed_out, other_late=agreed == LATE and not timed_out)

    def narrowed(self, probe: Probe, keyed: KeyedTokens) -> Probe:
        """``probe`` (one rank's, agreed by no other) cut to ``keyed``: a prefix of the tokens
        it was made for, keyed with the same extras (the caller checked that their keys are
        ``probe``'s first ones). What the tiers answered is reused, none is asked again; the
        usable prefix is found again within the shorter tokens (a sliding window's chunks
        move with the prefix's end). No lease (the caller takes one)."""
        n = len(keyed.keys)
        holders = list(probe.holders[:n])

        def have(c: int, g: str) -> bool:
            return bool(holders[c][g])

        local = min(self._local_prefix(holders, have), probe.local_chunks)
        out = self._record([], keyed, holders, local, local, time.perf_counter())
        return replace(out, duration_s=probe.duration_s, unanswered=probe.unanswered)

    def from_keys(self, keys: Sequence[ChunkKey], holders: Holders, num_tokens: int) -> Probe:
        """This rank's probe of chunks already keyed (``keys``; :meth:`holders` found
        ``holders``) for ``num_tokens`` tokens: no agreement, no digest (it cannot be handed to
        a restore)."""

        def have(c: int, g: str) -> bool:
            return bool(holders[c][g])

        local = self._local_prefix(holders, have)
        return replace(
            self._record([], None, holders, local, local, time.perf_counter()),
            num_tokens=num_tokens, keys=tuple(keys),
        )  # fmt: skip

    def _local_prefix(self, holders: Holders, have: Callable[[int, str], bool]) -> int:
        """This rank's longest usable prefix (:func:`~bsr.core._plan.longest_prefix`). Without
        a sliding-window group every group needs every chunk, so it ends at the first chunk a
        group has no holder for: found here in one pass over the chunks, not one call per
        object (a 524,288-token probe has thousands)."""
        if any(g.window_tokens is not None for g in self.layout.groups):
            return longest_prefix(self.layout, len(holders), have)
        return next((c for c, h in enumerate(holders) if not all(h.values())), len(holders))

    def _record(
        self,
        tokens: TokensLike,
        keyed: KeyedTokens | None,
        holders: Holders,
        local: int,
        agreed: int,
        t0: float,
    ) -> Probe:
        by_tier: dict[str, int] = {}
        for g in self.layout.groups:
            size = g.chunk_bytes(self.layout.chunk_tokens)
            counts: dict[str, int] = {}
            for c in self.layout.needed_chunks(g.name, agreed):
                name = holders[c][g.name][0]
                counts[name] = counts.get(name, 0) + 1
            for name, k in counts.items():
                by_tier[name] = by_tier.get(name, 0) + k * size
        return Probe(
            num_tokens=token_count(tokens) if keyed is None else len(keyed.tokens),
            chunk_tokens=self.layout.chunk_tokens,
            keys=() if keyed is None else keyed.keys,
            holders=tuple(holders),
            local_chunks=local,
            prefix_chunks=agreed,
            bytes_by_tier=by_tier,
            duration_s=time.perf_counter() - t0,
            digest=b"" if keyed is None else digest(self.namespace_fp, keyed),
            origin=self.origin,
        )
