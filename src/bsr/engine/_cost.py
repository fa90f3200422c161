"""Load or recompute, by cost: policy ``"cost"``, decided from a probe and measured rates.

Where it runs: the engine's event loop (:meth:`CostModel.decide` is pure arithmetic over a
probe; the ``observe_*`` methods take one lock, so a server may feed them from any thread).

How it works: a probe says, before any byte moves, which tier holds every (chunk, group) of
the reusable prefix. The engine measures each tier's read rate from its own restores: the
bytes read from the tier over the time the restore had at least one read from it in flight
(``RestoreResult.read_s_by_tier``, timed by the read gate; reads verified, ``io_depth`` of them
at once), and the server tells it how fast
its model prefills (:meth:`CostModel.observe_prefill`: tokens over seconds of prefill, or a
rate it measured itself). Loading the first ``k`` chunks of a probed prefix of ``P`` chunks
costs the reads of every object those ``k`` chunks need (a sliding-window group only its
window's chunks) at the measured rate of the tier each is read from; recomputing the rest
costs its tokens at the prefill rate. :meth:`CostModel.decide` takes the ``k`` with the least
total (the longest one on a tie, today's behaviour), so it never loads where recomputing is
faster by the measured rates and never recomputes where loading is: the whole prefix, a
shorter one (the cheap tiers' part when the tail lies in a slow tier), or nothing. Chunks the
caller already holds (``start_tokens``: a serving engine's own prefix-cache hit) cost nothing
either way. A tier or the prefill rate that has no measurement yet decides nothing: the
whole prefix is loaded (and measured). Prefill is modelled as linear in tokens, which makes
recomputing a long prefix look cheaper than it is (attention grows with the context), so the
policy leans towards recomputing long prefixes; rates are exponentially weighted means.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._check import non_negative_int
from .._errors import ConfigError
from ..core._results import LoadDecision

if TYPE_CHECKING:
    from ..core._layout import StateLayout
    from ..core._results import Probe, RestoreResult

#: weight of a new sample in the exponentially weighted rates
EWMA_ALPHA = 0.3


@dataclass(frozen=True)
class CostStatistics:
    """What the cost model measured so far."""

    #: tier -> bytes/s (only tiers with a measurement)
    read_rates: dict[str, float]
    #: tokens/s, None before the first prefill was observed
    prefill_rate: float | None
    #: samples taken
    read_samples: int
    prefill_samples: int


def _rate(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return v


class CostModel:
    """Measured read rates per tier and the server's prefill rate; decides load vs recompute.

    Args:
        alpha: weight of a new sample in the exponentially weighted rates (0 < alpha <= 1).
    """

    def __init__(self, *, alpha: float = EWMA_ALPHA) -> None:
        if not 0.0 < float(alpha) <= 1.0:
            raise ConfigError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self._lock = threading.Lock()
        self._read: dict[str, float] = {}
        self._prefill: float | None = None
        self._read_samples = 0
        self._prefill_samples = 0

    # ------------------------------------------------------------------ measurements
    def _mix(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """One measurement: ``nbytes`` read (and installed) from ``tier`` in ``seconds``."""
        nbytes = non_negative_int(nbytes, "nbytes")
        seconds = _rate(seconds, "seconds")
        if nbytes == 0 or seconds <= 0:
            return
        with self._lock:
            self._read[tier] = self._mix(self._read.get(tier), nbytes / seconds)
            self._read_samples += 1

    def observe_restore(self, result: RestoreResult) -> None:
        """Measure read rates from a restore's reads: each tier's bytes over the time it had at
        least one of them in flight (``result.read_s_by_tier``).

        A result without those times (made elsewhere) is measured by the restore's own time
        minus its probe, split across tiers in proportion to each tier's bytes over its current
        rate estimate (a tier not measured yet counts at the mean of the others, or all alike).
        """
        by_tier = {t: n for t, n in result.bytes_by_tier.items() if n > 0}
        if not by_tier:
            return
        timed = {t: result.read_s_by_tier.get(t, 0.0) for t in by_tier}
        if all(s > 0 for s in timed.values()):
            for t, n in by_tier.items():
                self.observe_read(t, n, timed[t])
            return
        if not result.committed:
            return
        seconds = result.timings.total_s - result.timings.probe_s
        if not seconds > 0:
            return
        with self._lock:
            known = [self._read[t] for t in by_tier if t in self._read]
        guess = sum(known) / len(known) if known else 1.0
        weights = {t: n / self._read_rate_or(t, guess) for t, n in by_tier.items()}
        total = sum(weights.values())
        for t, n in by_tier.items():
            self.observe_read(t, n, seconds * weights[t] / total)

    def _read_rate_or(self, tier: str, default: float) -> float:
        with self._lock:
            return self._read.get(tier, default)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One measurement of the server's prefill: ``tokens`` computed in ``seconds``."""
        tokens = non_negative_int(tokens, "tokens")
        seconds = _rate(seconds, "seconds")
        if tokens == 0 or seconds <= 0:
            return
        with self._lock:
            self._prefill = self._mix(self._prefill, tokens / seconds)
            self._prefill_samples += 1

    def read_rate(self, tier: str) -> float | None:
        with self._lock:
            return self._read.get(tier)

    @property
    def prefill_rate(self) -> float | None:
        with self._lock:
            return self._prefill

    def statistics(self) -> CostStatistics:
        with self._lock:
            return CostStatistics(
                dict(self._read), self._prefill, self._read_samples, self._prefill_samples
            )

    # ------------------------------------------------------------------ the decision
    def decide(
        self,
        layout: StateLayout,
        probe: Probe,
        *,
        start_tokens: int = 0,
        prefill_rate: float | None = None,
    ) -> LoadDecision:
        """How much of ``probe``'s agreed prefix to load (see the module docstring).

        Args:
            layout: the engine's layout.
            probe: the probe (its holders and agreed prefix).
            start_tokens: tokens the caller already holds from token 0 (its own prefix-cache
                hit): chunks entirely below them cost nothing either way.
            prefill_rate: tokens/s to use instead of the measured one (a server that measures
                its prefill elsewhere, e.g. vLLM's scheduler).
        """
        start_tokens = non_negative_int(start_tokens, "start_tokens")
        if prefill_rate is not None:
            prefill_rate = _rate(prefill_rate, "prefill_rate") or None
        p = probe.prefix_chunks
        c_tokens = layout.chunk_tokens
        s = min(start_tokens // c_tokens, p)
        rate_p = self.prefill_rate if prefill_rate is None else prefill_rate
        if p <= s:
            return LoadDecision("empty", p, p, s, prefill_rate=rate_p)
        # per group: the time to read each chunk's object from its first holder (inf: no
        # holder, or an unmeasured one; a prefix needing it is never chosen)
        by_tier: dict[str, int] = {}
        rates: dict[str, float | None] = {}
        for g in layout.groups:
            nbytes = layout.group_chunk_bytes(g.name)
            for c in layout.needed_chunks(g.name, p):
                if c >= s:
                    tier = probe.holders[c][g.name][0]
                    by_tier[tier] = by_tier.get(tier, 0) + nbytes
                    rates.setdefault(tier, self.read_rate(tier))
        if rate_p is None or any(r is None for r in rates.values()):
            return LoadDecision(
                "unmeasured", p, p, s, by_tier, rates, rate_p,
            )  # fmt: skip
        sums: dict[str, tuple[list[float], list[int]]] = {}
        for g in layout.groups:
            nbytes = layout.group_chunk_bytes(g.name)
            row: list[float] = []
            for c in range(p):
                names = probe.holders[c].get(g.name, ()) if c >= s else ()
                r = self.read_rate(names[0]) if names else None
                row.append(math.inf if c >= s and not r else nbytes / r if r else 0.0)
            sums[g.name] = _prefix_sums(row)
        recompute_from = [  # seconds to recompute chunks k..p-1 (tokens past start only)
            (p * c_tokens - max(k * c_tokens, start_tokens)) / rate_p for k in range(p + 1)
        ]

        def load_cost(k: int) -> float:
            total = 0.0
            for g in layout.groups:
                need = layout.needed_chunks(g.name, k)
                lo, hi = max(need.start, s), need.stop
                if hi > lo:
                    times, missing = sums[g.name]
                    if missing[hi] - missing[lo]:
                        return math.inf
                    total += times[hi] - times[lo]
            return total

        best_k, best = s, recompute_from[s]
        best_load = 0.0
        for k in range(s + 1, p + 1):
            load = load_cost(k)
            cost = load + recompute_from[k]
            if cost <= best:
                best_k, best, best_load = k, cost, load
        full_load = load_cost(p)
        choice = "load" if best_k == p else "recompute" if best_k == s else "partial"
        return LoadDecision(
            choice, best_k, p, s, by_tier, rates, rate_p, best_load, recompute_from[best_k],
            full_load, recompute_from[s],
        )  # fmt: skip


def _prefix_sums(row: Sequence[float]) -> tuple[list[float], list[int]]:
    """Prefix sums of the finite times, and prefix counts of the infinite ones."""
    times, missing = [0.0], [0]
    for x in row:
        inf = math.isinf(x)
        times.append(times[-1] + (0.0 if inf else x))
        missing.append(missing[-1] + inf)
    return times, missing
