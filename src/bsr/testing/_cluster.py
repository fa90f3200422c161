"""The cluster harness of the restore state machines: one engine per rank over real tiers.

How it works: the engines run on an event loop in a worker thread (a blocking portal); the
synchronous Hypothesis rules call into it through :meth:`Cluster._call`, bounded by
``step_timeout_s``. Each tier is wrapped in a :class:`RecordingFaultyTier` whose plan the
machine swaps in and out, and which logs every fault it fires for the model.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio
import torch
from anyio.from_thread import BlockingPortal

from ..core._keys import Namespace, ObjectKey
from ..core._layout import StateLayout
from ..engine._coordinator import Coordinator, InProcessGroup
from ..engine._engine import RestoreEngine
from ..tiers._base import Tier
from ..tiers._host import HostTier
from ..tiers.file import FileTier
from ..transfer._cache import PagedKVCache
from ._campaign import Campaign
from ._faults import Fault, FaultKind, FaultPlan, FaultyTier
from ._strategies import LayoutCase

T = TypeVar("T")

#: ``(directory, rank) -> tiers``, fastest first, unopened. Called again with the same
#: directory when the machine reopens (durable tiers must then find their objects again).
TierFactory = Callable[[Path, int], Sequence[Tier]]


def default_tier_factory(directory: Path, rank: int) -> list[Tier]:
    """A HostTier above a FileTier under ``directory`` (capacities large enough to never evict)."""
    return [
        HostTier(1 << 30, name="host"),
        FileTier(directory / "l2", 1 << 30, name="file", reader="posix", fsync=False),
    ]


class RecordingFaultyTier(FaultyTier):
    """A FaultyTier that tells the machine which fault fired on which object."""

    def __init__(
        self,
        inner: Tier,
        plan: FaultPlan,
        *,
        rank: int,
        index: int,
        log: list[tuple[int, int, str, FaultKind]],
    ) -> None:
        super().__init__(inner, plan, rank=rank)
        self.index = index
        self.log = log

    def _faults(self, op: str, okey: ObjectKey) -> list[Fault]:
        fired = super()._faults(op, okey)
        for f in fired:
            self.log.append((self.rank, self.index, okey.object_id, f.kind))
        return fired

    @property
    def lost(self) -> set[str]:
        return self._lost


@dataclass
class _Rank:
    rank: int
    engine: RestoreEngine
    tiers: list[RecordingFaultyTier]


class Cluster(Campaign):
    """The engines of every rank, their tiers, and the portal the rules call them through."""

    #: ranks (1: one engine; 2+: InProcessGroup, restores of all ranks run concurrently)
    world_size: ClassVar[int] = 1
    #: wall-clock bound of one step's engine calls
    step_timeout_s: ClassVar[float] = 60.0
    #: the engines' circuit breakers (a short cooldown lets campaigns see them close again)
    breaker_threshold: ClassVar[int | None] = 3
    breaker_cooldown_s: ClassVar[float] = 0.2

    # set by RestoreMachine.__init__ and setup
    portal: BlockingPortal
    root: Path
    ranks: list[_Rank]
    case: LayoutCase | None
    window: int
    io_depth: int
    plan: FaultPlan
    fault_log: list[tuple[int, int, str, FaultKind]]
    _plans_used: dict[int, FaultPlan]

    def make_tiers(self, directory: Path, rank: int) -> Sequence[Tier]:
        """The unopened tiers of ``rank`` (fastest first); override or use :meth:`configured`."""
        return default_tier_factory(directory, rank)

    @property
    def layout(self) -> StateLayout:
        assert self.case is not None
        return self.case.layout

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def faults_active(self) -> bool:
        return bool(self.plan.faults)

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def guarded() -> T:
            with anyio.fail_after(self.step_timeout_s):
                return await fn(*args)

        try:
            return self.portal.call(guarded)
        except TimeoutError:
            raise self._violation(
                f"engine call {getattr(fn, '__name__', fn)} did not finish within "
                f"{self.step_timeout_s}s (a restore or save hung)"
            ) from None

    def _begin(self) -> None:
        stats = type(self).stats
        stats.steps += 1
        name = sys._getframe(1).f_code.co_name
        stats.rules[name] = stats.rules.get(name, 0) + 1
        self.fault_log.clear()

    def _open_all(self) -> None:
        group = InProcessGroup(self.world_size, timeout_s=10.0) if self.world_size > 1 else None
        ranks = []
        for r in range(self.world_size):
            inner = list(self.make_tiers(self.root / f"rank{r}", r))
            tiers = [
                RecordingFaultyTier(t, self.plan, rank=r, index=i, log=self.fault_log)
                for i, t in enumerate(inner)
            ]
            coordinator: Coordinator | None = group.coordinator(r) if group is not None else None
            engine = RestoreEngine(
                self.layout,
                tiers,
                window=self.window,
                io_depth=self.io_depth,
                namespace=Namespace("bsr-machine", tp_rank=r, tp_size=self.world_size),
                coordinator=coordinator,
                pin_staging=False,
                breaker_threshold=self.breaker_threshold,
                breaker_cooldown_s=self.breaker_cooldown_s,
            )
            ranks.append(_Rank(r, engine, tiers))
        self.ranks = ranks

        async def open_engines() -> None:
            for rk in ranks:
                await rk.engine.open()

        self._call(open_engines)

    async def _close_all(self) -> None:
        for rk in self.ranks:
            await rk.engine.aclose()

    def _set_plan(self, plan: FaultPlan) -> None:
        self._plans_used[id(plan)] = plan
        for rk in self.ranks:
            for t in rk.tiers:
                t.plan = plan

    def _breakers(self) -> list[tuple[int, int, bool, int]]:
        return [
            (rk.rank, ti, b.open, b.trips)
            for rk in self.ranks
            for ti, b in enumerate(rk.engine.statistics().breakers)
        ]

    def _dest_cache(
        self, tokens: Sequence[int], seed: int
    ) -> tuple[PagedKVCache, torch.Tensor, dict[str, torch.Tensor]]:
        assert self.case is not None
        bt = self.case.block_tokens
        nblocks = -(-len(tokens) // bt)
        gen = torch.Generator().manual_seed(seed)
        cache = PagedKVCache(self.layout, max(1, nblocks + 3), bt)
        before = {}
        for g in self.layout.groups:
            t = cache.tensor(g.name)
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            before[g.name] = t.clone()
        ids = torch.randperm(cache.num_blocks, generator=gen)[:nblocks]
        return cache, ids, before
