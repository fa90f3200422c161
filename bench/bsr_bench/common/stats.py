"""Distributions over repeats and finite ratios.

A benchmark point is never one number: every measured quantity is kept as all its samples plus
min / median / max (the pytest-benchmark and asv habit), and every ratio is checked finite.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bsr import BsrError


class BenchError(BsrError):
    """A benchmark run could not produce an honest figure (bad arguments, broken measurement)."""


@dataclass(frozen=True)
class Dist:
    """Samples of one quantity over repeats."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            raise BenchError("a distribution needs at least one sample")
        return cls(tuple(float(v) for v in values))

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return float(statistics.median(self.values))

    @property
    def max(self) -> float:
        return max(self.values)

    def map(self, fn: Any) -> Dist:
        """Apply ``fn`` to every sample (e.g. seconds -> bandwidth)."""
        return Dist(tuple(float(fn(v)) for v in self.values))

    def to_dict(self) -> dict[str, Any]:
        return {
            "min": self.min,
            "median": self.median,
            "max": self.max,
            "n": len(self.values),
            "values": list(self.values),
        }


def ratio(num: float, den: float, what: str) -> float:
    """``num / den``, refusing anything that is not a finite positive figure."""
    if not (math.isfinite(num) and math.isfinite(den)) or den <= 0 or num < 0:
        raise BenchError(f"ratio {what} is undefined: {num} / {den}")
    value = num / den
    if not math.isfinite(value):
        raise BenchError(f"ratio {what} is not finite: {num} / {den}")
    return value


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (what else ran on the machine, recorded beside the
    figures), or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
