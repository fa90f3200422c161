"""The request state machine, loaded from the spec table.

How it works: ``spec/request_lifecycle.json`` (shipped inside the package as
``bsr/_spec/request_lifecycle.json``) is the only place where states, triggers, guards and
invalidation reasons are written down. It is loaded once per process into a
``transitions.Machine`` (synchronous, so it runs under any anyio backend), which checks the
table (unknown states, a guard on a missing method) and compiles it into its events: per
trigger and source state, the destination and the guard. :class:`RequestLifecycle` fires
through those compiled events, exactly as the Machine's own ``trigger`` would (the trigger must
be defined from the current state, the first transition whose guards hold is taken), without
building a Machine per request: that construction and the Machine's generic dispatch were a
quarter of a small restore's CPU time. The engine records facts (``prefix_chunks``,
``installed``...) and fires triggers; guards read those facts. A trigger not in the table raises
:class:`~bsr.IllegalTransitionError`, a failing guard raises :class:`~bsr.GuardRejectedError`;
both leave the state unchanged. Nothing else changes a request's state. Every transition emits
a ``bsr.request.transition`` event.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from transitions import Machine

from .._errors import GuardRejectedError, IllegalTransitionError
from .._log import logger
from ._layout import StateLayout
from ._options import Policy
from ._plan import prefix_in


class RequestState(str, enum.Enum):
    """States of a restore request (see spec/request_lifecycle.json)."""

    PROBING = "Probing"
    WINDOWING = "Windowing"
    INSTALLED = "Installed"
    COMMITTED = "Committed"
    INVALIDATED = "Invalidated"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.COMMITTED, RequestState.INVALIDATED)

    def __str__(self) -> str:
        return self.value


class Reason(str, enum.Enum):
    """Why a request ended where it did (see spec/request_lifecycle.json)."""

    EMPTY_PREFIX = "empty_prefix"
    COMPLETE = "complete"
    TRUNCATED = "truncated"
    READ_FAILED = "read_failed"
    CORRUPT = "corrupt"
    INSTALL_FAILED = "install_failed"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    RANK_FAILED = "rank_failed"
    COORDINATOR_FAILED = "coordinator_failed"
    ENGINE_CLOSED = "engine_closed"
    INTERNAL_ERROR = "internal_error"
    STAGING_BUDGET = "staging_budget"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


@lru_cache(maxsize=1)
def load_spec() -> dict[str, Any]:
    """The lifecycle table as shipped with the package."""
    text = resources.files("bsr").joinpath("_spec/request_lifecycle.json").read_text("utf-8")
    spec: dict[str, Any] = json.loads(text)
    return spec


@dataclass(frozen=True)
class TransitionRecord:
    """One step of a request's trace."""

    trigger: str
    source: str
    dest: str
    reason: str | None
    at: float


@dataclass
class RequestFacts:
    """What the guards look at: records of the run, never verdicts set before firing.

    The engine records what happened (the agreed probe prefix, the window's target, the set of
    installed (chunk, group) objects, the prefix the ranks agreed on, the ranks' AND vote); each
    guard evaluates its condition from these records when a trigger fires, so a trigger whose
    condition does not hold is rejected and the state stays unchanged.
    """

    layout: StateLayout | None = None
    policy: Policy = Policy.ALL_OR_NOTHING
    prefix_chunks: int = 0
    target_chunks: int = 0
    installed: Collection[tuple[int, str]] = field(default_factory=frozenset)
    agreed_chunks: int = 0
    all_ranks_voted_yes: bool = False
    #: whether the caller's block tables hold every block a prefix needs (None: always)
    serves: Callable[[int], bool] | None = None

    def installed_through(self, prefix_chunks: int) -> bool:
        """Whether every object a prefix of ``prefix_chunks`` chunks needs is installed, into
        blocks the block tables hold."""
        if self.layout is None or prefix_chunks <= 0:
            return False
        if self.serves is not None and not self.serves(prefix_chunks):
            return False
        return prefix_in(self.layout, prefix_chunks, self.installed)


class _Model:
    """The object ``transitions`` drives; guards are its methods, evaluated from the facts."""

    state: str

    def __init__(self, facts: RequestFacts) -> None:
        self.facts = facts

    def prefix_nonempty(self) -> bool:
        return self.facts.prefix_chunks > 0

    def prefix_empty(self) -> bool:
        return self.facts.prefix_chunks == 0

    def every_chunk_installed(self) -> bool:
        f = self.facts
        return (
            f.target_chunks > 0
            and f.agreed_chunks == f.target_chunks
            and f.installed_through(f.target_chunks)
        )

    def truncated_prefix_installed(self) -> bool:
        f = self.facts
        return (
            f.policy is Policy.TRUNCATE
            and 0 < f.agreed_chunks < f.target_chunks
            and f.installed_through(f.agreed_chunks)
        )

    def all_ranks_installed(self) -> bool:
        f = self.facts
        return f.all_ranks_voted_yes and f.installed_through(f.agreed_chunks)


def _machine_kwargs() -> dict[str, Any]:
    spec = load_spec()
    transitions = []
    for t in spec["transitions"]:
        entry: dict[str, Any] = {"trigger": t["trigger"], "source": t["source"], "dest": t["dest"]}
        if t.get("guard"):
            entry["conditions"] = [t["guard"]]
        transitions.append(entry)
    return {
        "states": [s["name"] for s in spec["states"]],
        "transitions": transitions,
        "initial": spec["initial"],
        "auto_transitions": False,
        "ignore_invalid_triggers": False,
        "send_event": False,
        "queued": False,
    }


#: per source state, per trigger: the compiled transitions ``(dest, ((guard, expected), ...))``
CompiledTable = dict[str, dict[str, tuple[tuple[str, tuple[tuple[str, bool], ...]], ...]]]


@lru_cache(maxsize=1)
def compiled_table() -> tuple[str, CompiledTable]:
    """The spec table loaded into one ``transitions.Machine`` (once per process), and the
    Machine's own compiled events: ``(initial state, {source: {trigger: transitions}})``."""
    machine = Machine(model=None, **_machine_kwargs())
    table: CompiledTable = {s: {} for s in machine.states}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            table[source][trigger] = tuple(
                (str(t.dest), tuple((str(c.func), bool(c.target)) for c in t.conditions))
                for t in transitions
            )
    guards = {f for by in table.values() for ts in by.values() for _, cs in ts for f, _ in cs}
    for guard in guards:
        if not callable(getattr(_Model, guard, None)):
            raise IllegalTransitionError(f"the lifecycle table names an unknown guard {guard!r}")
    return str(machine.initial), table


class RequestLifecycle:
    """The authority on one request's state.

    Args:
        request_id: used in events and traces.
        rank: tensor-parallel rank, for events.
    """

    def __init__(self, request_id: str, *, rank: int = 0) -> None:
        self.request_id = request_id
        self.rank = rank
        self.facts = RequestFacts()
        self._model = _Model(self.facts)
        initial, self._table = compiled_table()
        self._model.state = initial
        self.trace: list[TransitionRecord] = []
        self.reason: Reason | None = None
        self._log = logger.bind(request_id=request_id, rank=rank)

    @property
    def state(self) -> RequestState:
        return RequestState(self._model.state)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def allowed(self) -> list[str]:
        """Triggers defined from the current state (guards not evaluated)."""
        return sorted(self._table[self._model.state])

    def _take(self, transitions: tuple[tuple[str, tuple[tuple[str, bool], ...]], ...]) -> bool:
        """The Machine's trigger semantics: the first transition whose guards all hold is
        taken (the state changes); False when none (the state stays)."""
        model = self._model
        for dest, guards in transitions:
            if all(bool(getattr(model, g)()) is want for g, want in guards):
                model.state = dest
                return True
        return False

    def fire(self, trigger: str, reason: Reason | None = None) -> RequestState:
        """Fire ``trigger``; raise (state unchanged) when the table does not allow it."""
        source = self._model.state
        transitions = self._table[source].get(trigger)
        if transitions is None:
            raise IllegalTransitionError(
                f"trigger {trigger!r} is not allowed in state {source}; allowed: {self.allowed()}",
                state=source,
                trigger=trigger,
                request_id=self.request_id,
            )
        ok = self._take(transitions)
        if not ok:
            raise GuardRejectedError(
                f"guard of {trigger!r} does not hold in state {source} (facts: {self.facts})",
                state=source,
                trigger=trigger,
                request_id=self.request_id,
            )
        dest = self._model.state
        if reason is not None:
            self.reason = reason
        self.trace.append(
            TransitionRecord(
                trigger, source, dest, str(reason) if reason else None, time.monotonic()
            )
        )
        self._log.debug(
            "bsr.request.transition",
            trigger=trigger,
            from_state=source,
            to_state=dest,
            reason=str(reason) if reason else None,
        )
        return RequestState(dest)

    def invalidate(self, reason: Reason) -> RequestState:
        """Move to Invalidated from any non-terminal state (no-op if already Invalidated)."""
        if self.state is RequestState.INVALIDATED:
            return self.state
        return self.fire("invalidate", reason)


@dataclass(frozen=True)
class _Edge:
    source: str
    trigger: str
    dest: str
    guard: str | None


def table_edges() -> list[_Edge]:
    """Every (source, trigger, dest, guard) of the table, sources expanded."""
    edges = []
    for t in load_spec()["transitions"]:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for s in sources:
            edges.append(_Edge(s, t["trigger"], t["dest"], t.get("guard")))
    return edges


def mermaid() -> str:
    """A mermaid state diagram generated from the table (spec/request_lifecycle.mmd)."""
    spec = load_spec()
    lines = [
        "%% generated from spec/request_lifecycle.json by `bsr spec diagram`; do not edit",
        "stateDiagram-v2",
        f"    [*] --> {spec['initial']}",
    ]
    for e in table_edges():
        label = e.trigger + (f" [{e.guard}]" if e.guard else "")
        lines.append(f"    {e.source} --> {e.dest}: {label}")
    for s in spec["states"]:
        if s["terminal"]:
            lines.append(f"    {s['name']} --> [*]")
    return "\n".join(lines) + "\n"
