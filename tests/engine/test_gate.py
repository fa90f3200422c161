"""RestoreGate, the decision side of a read, against an independent model of its docstrings.

The gate refuses a quarantined object ("object quarantined") and a tier whose breaker is open
("circuit breaker open"); a corrupt read quarantines the object and queues its move out of the
tier (once); an I/O error retires the object in this engine only (no move); an I/O error, a
timeout or an unexpected error counts against the tier's breaker, while ok, miss and corrupt are
the tier answering (they close it). After the cooldown a breaker is half-open: one trial call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.core._plan import plan_restore
from bsr.engine._decisions import Quarantine, RestoreGate, TierQuarantine
from bsr.engine._health import TierHealth
from bsr.transfer._ladder import Outcome, ReadOutcome
from bsr.transfer._run import RestoreRun
from support.helpers import two_group_layout

TIERS = ("fast", "slow")
THRESHOLD, COOLDOWN = 2, 10.0
LAYOUT = two_group_layout()
KEYS = [bsr.ChunkKey(bytes([i]) * 16, i, b"ns") for i in range(3)]
ANSWERED = {Outcome.OK, Outcome.MISS, Outcome.CORRUPT}


@dataclass
class Model:
    """What the docstrings promise, kept by hand."""

    now: float = 0.0
    quarantined: set[tuple[str, int, str]] = field(default_factory=set)
    pending: list[tuple[str, int, str, str]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    open_until: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(TIERS))
    trial: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(TIERS, False))

    def admit(self, tier: str, obj: tuple[str, int, str]) -> str | None:
        if obj in self.quarantined:
            return "object quarantined"
        until = self.open_until[tier]
        if until is not None:
            if self.now < until or self.trial[tier]:
                return "circuit breaker open"
            self.trial[tier] = True  # half-open: this caller is the trial
        return None

    def report(self, tier: str, obj: tuple[str, int, str], outcome: Outcome, why: str) -> None:
        if outcome in ANSWERED:
            self.failures[tier], self.open_until[tier], self.trial[tier] = 0, None, False
        else:
            self.failures[tier] += 1
            was_trial, self.trial[tier] = self.trial[tier], False
            if was_trial or self.failures[tier] >= THRESHOLD:
                self.open_until[tier] = self.now + COOLDOWN
        if outcome in (Outcome.CORRUPT, Outcome.IO_ERROR) and obj not in self.quarantined:
            self.quarantined.add(obj)
            if outcome is Outcome.CORRUPT:
                self.pending.append((*obj, why))


step = st.one_of(
    st.tuples(
        st.just("read"),
        st.sampled_from(TIERS),
        st.integers(0, len(KEYS) - 1),
        st.sampled_from(["kv", "swa"]),
        st.sampled_from(list(Outcome)),
        st.sampled_from(["", "CorruptObjectError"]),
    ),
    st.tuples(st.just("withdraw"), st.sampled_from(TIERS)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, COOLDOWN])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40))
def test_the_gate_follows_the_model(steps: list[tuple[object, ...]]) -> None:
    model = Model()
    health = TierHealth(TIERS, threshold=THRESHOLD, cooldown_s=COOLDOWN, clock=lambda: model.now)
    run = RestoreRun(plan_restore(LAYOUT, len(KEYS)), bsr.Policy.TRUNCATE)
    gate = RestoreGate(run, health, Quarantine(), structlog.get_logger())
    for s in steps:
        if s[0] == "wait":
            model.now += float(s[1])  # type: ignore[arg-type]
        elif s[0] == "withdraw":
            tier = str(s[1])
            # only an admitted attempt may be withdrawn: withdraw the trial if one is out
            if model.trial[tier]:
                gate.withdraw(tier)
                model.trial[tier] = False
        else:
            _, tier, i, group, outcome, error_type = s
            assert isinstance(tier, str) and isinstance(i, int) and isinstance(group, str)
            assert isinstance(outcome, Outcome) and isinstance(error_type, str)
            obj = (tier, i, group)
            expected = model.admit(tier, obj)
            assert gate.admit(tier, KEYS[i], group) == expected
            if expected is not None:
                continue  # the ladder reports only what the gate let it try
            why = error_type or str(outcome)
            gate.report(ReadOutcome(tier, KEYS[i], group, i, outcome, error_type=error_type))
            model.report(tier, obj, outcome, why)
        assert run.quarantined == len(model.quarantined)
        for tier in TIERS:
            assert health.state(tier).consecutive_failures == model.failures[tier]
    moves = gate.take_pending()
    assert moves == [TierQuarantine(t, KEYS[i], g, why) for t, i, g, why in model.pending]
    assert gate.take_pending() == []  # taken once


def _fake_clock_gate() -> tuple[RestoreGate, list[float]]:
    now = [0.0]
    health = TierHealth(TIERS, threshold=THRESHOLD, cooldown_s=COOLDOWN, clock=lambda: now[0])
    run = RestoreRun(plan_restore(LAYOUT, len(KEYS)), bsr.Policy.TRUNCATE)
    return RestoreGate(run, health, Quarantine(), structlog.get_logger()), now


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["single", "batch"]),
            st.lists(st.sampled_from([Outcome.OK, Outcome.MISS]), max_size=4),
            st.integers(1, 3),
        ),
        max_size=12,
    )
)
@settings(max_examples=200, deadline=None)
def test_busy_time_spans_exactly_the_reads_in_flight(
    steps: list[tuple[str, list[Outcome], int]],
) -> None:
    """The cost model's read time per tier (``busy_by_tier``): each admitted attempt, and each
    admitted batch (its objects' failures reported through it, its ``end`` closing it), is one
    span; once every span ended the time stops growing. The
    model: the sum of the spans' lengths (they do not overlap here)."""
    gate, clock = _fake_clock_gate()
    tier = TIERS[0]
    expected = 0.0

    def at(t: float) -> None:
        clock[0] = t

    import bsr.engine._decisions as decisions

    real = decisions.time.perf_counter
    decisions.time.perf_counter = lambda: clock[0]  # type: ignore[assignment]
    try:
        for kind, outcomes, length in steps:
            start = clock[0]
            if kind == "single":
                assert gate.admit(tier, KEYS[0], "kv") is None
                at(start + length)
                outcome = outcomes[0] if outcomes else Outcome.OK
                gate.report(ReadOutcome(tier, KEYS[0], "kv", 0, outcome))
            else:
                batch = gate.admit_batch(tier, [(KEYS[0], "kv")])
                assert batch is not None
                for o in outcomes:  # the batch's failed objects, reported inside it
                    if o is not Outcome.OK:
                        batch.report(ReadOutcome(tier, KEYS[0], "kv", 0, o))
                at(start + length)
                batch.end(any(o is Outcome.OK for o in outcomes) or not outcomes)
            expected += length
            at(clock[0] + 5)  # idle: no read in flight
            busy = gate.busy_by_tier().get(tier, 0.0)
            assert busy == expected
            # the health effects of the failures above may open the breaker: reset for the next
            gate.health = TierHealth(TIERS, threshold=THRESHOLD, cooldown_s=COOLDOWN)
    finally:
        decisions.time.perf_counter = real  # type: ignore[assignment]
