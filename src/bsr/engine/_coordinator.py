"""Cross-rank agreement: the probed prefix (MIN) and the commit decision (AND).

Where it runs: each tensor-parallel rank's event loop. Every rank of a restore calls the same
collectives in the same order: ``agree_min`` one or more times during probing, then exactly one
``agree_all`` before commit, also when its own part failed (it then votes False), so that no
rank waits for a vote that never comes. A collective that fails or times out raises
:class:`~bsr.CoordinatorError`, which the engine turns into Invalidated.

- :class:`LocalCoordinator`: one rank, identity.
- :class:`InProcessGroup`: several ranks in one process (tests, single-process multi-GPU servers).
- :class:`TorchDistributedCoordinator`: ``torch.distributed`` (gloo on CPU, nccl on GPU); its
  blocking collectives run in a worker thread, serialized, off the event loop.

The agreements built on those two collectives live here too, over any :class:`Coordinator`
(the prober probes, the coordinator agrees): :func:`agree_prefix` (the longest prefix every
rank can use: the MIN of the ranks' proposals, re-proposed shorter until every rank can use it;
candidates strictly decrease, so it ends) and :func:`agree_on_time` (whether every rank's
probing ended in time). A rank whose probe ran past its deadline proposes :data:`LATE` (below
every prefix), so the MIN tells every rank, in the same round, that some rank is out of time.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import anyio
import torch

from .._errors import CoordinatorError
from ..core._plan import longest_prefix_upto

#: what a rank whose probe ran past its deadline proposes: below every prefix, so the MIN says
#: to every rank that some rank is out of time
LATE = -1


@runtime_checkable
class Coordinator(Protocol):
    """What the engine needs from a group of ranks."""

    rank: int
    world_size: int

    async def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over all ranks."""
        ...

    async def agree_all(self, value: bool) -> bool:
        """True only if every rank passes True."""
        ...


class LocalCoordinator:
    """A single rank: agreement is the identity."""

    rank = 0
    world_size = 1

    async def agree_min(self, value: int) -> int:
        await anyio.lowlevel.checkpoint()
        return value

    async def agree_all(self, value: bool) -> bool:
        await anyio.lowlevel.checkpoint()
        return value


class _Round:
    def __init__(self, world_size: int) -> None:
        self.values: dict[int, Any] = {}
        self.done = anyio.Event()
        self.result: Any = None
        self.consumed = 0


class InProcessGroup:
    """Ranks living in one process and one event loop; ``group.coordinator(rank)`` per rank.

    Rounds are matched by call order per rank (the n-th call of every rank meets the n-th call
    of the others), like a real collective. ``timeout_s`` bounds each wait; a round that times
    out on any rank fails on every rank (also on a rank that arrives later), so no rank can
    commit on a vote another rank gave up on (found by the spin model, spec/README.md).
    """

    def __init__(self, world_size: int, *, timeout_s: float = 30.0) -> None:
        if world_size < 1:
            raise CoordinatorError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._rounds: dict[int, _Round] = {}
        self._calls = [0] * world_size

    def coordinator(self, rank: int) -> InProcessCoordinator:
        if not 0 <= rank < self.world_size:
            raise CoordinatorError(f"rank must be in [0, {self.world_size}), got {rank}")
        return InProcessCoordinator(self, rank)

    async def _collective(self, rank: int, op: str, value: Any) -> Any:
        n = self._calls[rank]
        self._calls[rank] += 1
        rnd = self._rounds.setdefault(n, _Round(self.world_size))
        if not rnd.done.is_set():
            rnd.values[rank] = (op, value)
            if len(rnd.values) == self.world_size:
                ops = {o for o, _ in rnd.values.values()}
                if len(ops) != 1:
                    rnd.result = CoordinatorError(
                        f"ranks called different collectives in round {n}: {ops}"
                    )
                elif op == "min":
                    rnd.result = min(v for _, v in rnd.values.values())
                else:
                    rnd.result = all(v for _, v in rnd.values.values())
                rnd.done.set()
        try:
            with anyio.fail_after(self.timeout_s):
                await rnd.done.wait()
        except TimeoutError:
            if not rnd.done.is_set():
                # the round fails for EVERY rank, also one arriving later: no rank may commit
                # on a round another rank gave up on
                rnd.result = CoordinatorError(
                    f"round {n} ({op}) timed out after {self.timeout_s}s; a rank is stuck",
                    rank=rank,
                )
                rnd.done.set()
        finally:
            rnd.consumed += 1
            if rnd.consumed >= self.world_size:
                self._rounds.pop(n, None)
        if isinstance(rnd.result, Exception):
            raise rnd.result
        return rnd.result


class InProcessCoordinator:
    """One rank of an :class:`InProcessGroup`."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    async def agree_min(self, value: int) -> int:
        return int(await self.group._collective(self.rank, "min", int(value)))

    async def agree_all(self, value: bool) -> bool:
        return bool(await self.group._collective(self.rank, "all", bool(value)))


class TorchDistributedCoordinator:
    """Agreement over an initialized ``torch.distributed`` process group.

    Args:
        group: process group (default: the world).
        device: where the reduction tensor lives ("cpu" for gloo, "cuda" for nccl); default
            follows the backend.
        timeout_s: informative; the process group's own timeout bounds each collective. Set it
            with ``init_process_group(..., timeout=timedelta(seconds=...))``.
    """

    def __init__(
        self, group: Any = None, *, device: str | None = None, timeout_s: float = 60.0
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CoordinatorError(
                "torch.distributed is not initialized; call init_process_group first"
            )
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.timeout = timedelta(seconds=timeout_s)
        self._lock = anyio.Lock()

    def _all_reduce(self, value: int, op: Any) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, op=op, group=self._group)
        return int(t.item())

    async def _run(self, value: int, op: Any) -> int:
        async with self._lock:
            try:
                return await anyio.to_thread.run_sync(self._all_reduce, value, op)
            except Exception as exc:
                raise CoordinatorError(
                    f"torch.distributed all_reduce failed: {exc}", rank=self.rank
                ) from exc

    async def agree_min(self, value: int) -> int:
        return await self._run(int(value), self._dist.ReduceOp.MIN)

    async def agree_all(self, value: bool) -> bool:
        return bool(await self._run(1 if value else 0, self._dist.ReduceOp.MIN))


async def agree_prefix(coordinator: Coordinator, local: int, usable: Callable[[int], bool]) -> int:
    """Agree with every rank on the longest prefix all of them can use (runs collectives).

    ``local``: this rank's proposal (its longest usable prefix, or :data:`LATE`); ``usable(n)``:
    whether this rank can use prefix ``n`` (asked only for ``0 < n <= `` every proposal).
    :data:`LATE` from any rank comes back as :data:`LATE` on every rank (after one round).
    """
    candidate = local
    while True:
        agreed = await coordinator.agree_min(candidate)
        if agreed < 0:  # every rank got the same MIN, so every rank stops here
            return LATE
        ok = agreed == 0 or bool(usable(agreed))
        if await coordinator.agree_all(ok):
            return agreed
        candidate = longest_prefix_upto(usable, agreed - 1)


async def agree_on_time(coordinator: Coordinator, timed_out: bool) -> bool:
    """Whether every rank's probing ended in time (one collective; a reused probe's)."""
    return await coordinator.agree_all(not timed_out)
