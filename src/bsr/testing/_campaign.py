"""Campaign bookkeeping of the restore state machines: the figures and the violations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


class InvariantViolation(AssertionError):
    """The engine did something the invariants forbid (the message says what)."""


@dataclass
class CampaignStats:
    """Figures of a campaign, accumulated over every example (shrinking replays included)."""

    examples: int = 0
    steps: int = 0
    saves: int = 0
    restores: int = 0
    committed: int = 0
    committed_nonempty: int = 0
    truncated: int = 0
    invalidated: int = 0
    cancelled: int = 0
    split_by_cancel: int = 0
    reopens: int = 0
    breaker_trips: int = 0
    corruptions: int = 0
    evictions: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    plan_fired: int = 0
    violations: int = 0
    violation_messages: list[str] = field(default_factory=list)
    rules: dict[str, int] = field(default_factory=dict)

    @property
    def faults_injected(self) -> int:
        return sum(self.faults.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "steps": self.steps,
            "saves": self.saves,
            "restores": self.restores,
            "committed": self.committed,
            "committed_nonempty": self.committed_nonempty,
            "truncated": self.truncated,
            "invalidated": self.invalidated,
            "cancelled": self.cancelled,
            "split_by_cancel": self.split_by_cancel,
            "reopens": self.reopens,
            "breaker_trips": self.breaker_trips,
            "corruptions": self.corruptions,
            "evictions": self.evictions,
            "faults_injected": self.faults_injected,
            "faults_by_kind": dict(sorted(self.faults.items())),
            "faults_fired_by_plans": self.plan_fired,
            "violations": self.violations,
            "violation_messages": sorted(set(self.violation_messages)),
            "steps_by_rule": dict(sorted(self.rules.items())),
        }


class Campaign:
    """Counts into the campaign's :class:`CampaignStats` and raises :class:`InvariantViolation`."""

    #: where the figures go
    stats: ClassVar[CampaignStats] = CampaignStats()

    def _violation(self, message: str) -> InvariantViolation:
        stats = type(self).stats
        stats.violations += 1
        stats.violation_messages.append(message.split("\n", 1)[0][:200])
        return InvariantViolation(message)

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            raise self._violation(message)
