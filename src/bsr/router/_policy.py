"""Which instance gets a request: by the prefix each holds (KV events), or round-robin."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._index import FleetIndex, Match

__all__ = ["Choice", "Policy", "PrefixPolicy", "RoundRobinPolicy"]


@dataclass(frozen=True)
class Choice:
    """A routing decision: the instance, its match (``None`` for round-robin) and why."""

    instance: str
    match: Match | None
    reason: str


class Policy:
    """How a router picks an instance: :meth:`choose` checks there is one to pick, :meth:`pick`
    (a subclass's) picks it."""

    name = ""

    def choose(
        self,
        index: FleetIndex,
        instances: Sequence[str],
        digests: Sequence[bytes],
        load: Mapping[str, int],
    ) -> Choice:
        """The instance for a request whose full blocks are named ``digests``."""
        if not instances:
            raise ValueError("no instances to route to")
        return self.pick(index, instances, digests, load)

    def pick(
        self,
        index: FleetIndex,
        instances: Sequence[str],
        digests: Sequence[bytes],
        load: Mapping[str, int],
    ) -> Choice:
        raise NotImplementedError


class PrefixPolicy(Policy):
    """The instance that serves the request's prefix at the lowest cost (the longest prefix in
    its fastest media, :meth:`FleetIndex.match`), ties broken by the fewest requests in flight,
    then by the order the instances were given."""

    name = "prefix"

    def pick(
        self,
        index: FleetIndex,
        instances: Sequence[str],
        digests: Sequence[bytes],
        load: Mapping[str, int],
    ) -> Choice:
        matches = [index.match(name, digests) for name in instances]
        order = {name: i for i, name in enumerate(instances)}
        best = min(matches, key=lambda m: (m.cost, load.get(m.instance, 0), order[m.instance]))
        tied = [m for m in matches if m.cost == best.cost]
        if best.blocks == 0:
            reason = "load"  # nobody holds any of it
        elif len(tied) > 1:
            reason = "prefix+load"
        else:
            reason = "prefix"
        return Choice(best.instance, best, reason)


class RoundRobinPolicy(Policy):
    """Each instance in turn, whatever it holds (the comparison a fleet's bench makes)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(
        self,
        index: FleetIndex,
        instances: Sequence[str],
        digests: Sequence[bytes],
        load: Mapping[str, int],
    ) -> Choice:
        name = instances[next(self._turn) % len(instances)]
        return Choice(name, index.match(name, digests), "round_robin")
