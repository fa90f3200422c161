"""Load or recompute, by cost: policy ``"cost"``, decided from a probe and measured rates.

Where it runs: the engine's event loop (:meth:`CostModel.decide` is arithmetic over a probe and
one counter; it and the ``observe_*`` methods take one lock, so a server may feed them from any
thread).

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
policy leans towards recomputing long prefixes.

Looking again. A tier judged slow is not read, so its rate would never be measured again: one
slow restore (a cold start, a busy spell) would keep a tier out for good. Two things undo that.

- Estimates decay, by samples and by time: a rate is an exponentially weighted mean whose old
  value's weight, ``1 - alpha``, also halves every ``half_life_s`` without a sample (a new
  sample weighs ``1 - (1 - alpha) * 2**(-age / half_life_s)``, :meth:`CostModel.old_weight`),
  so a sample after a quiet spell outweighs what was measured before it.
- A tier judged slow is probed: every ``probe_every``-th decision that would load less than the
  whole probed prefix with every rate measured (choice ``"partial"`` or ``"recompute"``) loads
  it all instead (choice ``"probe"``), which reads, and so measures, every tier the decision
  avoided. The share is a count, not a draw: of ``n`` such decisions exactly
  ``n // probe_every`` are probes (1 in 16 by default: 6.25%), so a tier that stays slow costs
  at most that share of the extra time its loads take over the cheapest choice.

A tier fast again is therefore loaded again within ``probe_every`` such decisions whenever
loading at ``alpha`` times its new rate still beats recomputing (a probe's sample weighs at
least ``alpha``; by default a tier more than 1 / 0.3 = 3.3 times faster than it needs to be);
a closer race takes ``j`` probes where ``1 - (1 - alpha)**j`` of the new rate is enough (fewer
when time has passed). ``probe_every=0`` never probes. Where several ranks agree on what to
load (a restore that decides, under a coordinator), one rank's probe holds for every rank (the
least would otherwise cut it): the share is at most ``world_size / probe_every`` of requests,
``1 / probe_every`` while the ranks' counters are in step (the same requests, the same rates).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._check import non_negative_int, optional_positive_float
from .._errors import ConfigError
from ..core._results import LoadDecision

if TYPE_CHECKING:
    from ..core._layout import StateLayout
    from ..core._results import Probe, RestoreResult

#: weight of a new sample in the exponentially weighted rates (at least: more after a pause)
EWMA_ALPHA = 0.3
#: one decision in this many that loads less than the whole probed prefix loads it all
PROBE_EVERY = 16
#: seconds without a sample in which an estimate's weight against the next sample halves
HALF_LIFE_S = 60.0


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
    #: decisions that loaded less than the whole probed prefix, all rates measured
    avoided: int = 0
    #: of those, the ones that loaded it all to measure again (every ``probe_every``-th)
    probes: int = 0


def _rate(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return v


class CostModel:
    """Measured read rates per tier and the server's prefill rate; decides load vs recompute,
    and now and then loads what it judged slow, to measure it again (see the module docstring).

    Args:
        alpha: weight of a new sample in the exponentially weighted rates (0 < alpha <= 1).
        probe_every: every this many decisions that load less than the whole probed prefix,
            one loads it all (0: never).
        half_life_s: seconds without a sample in which an estimate's weight against the next
            sample halves (None: it does not decay by time, only by samples).
        clock: seconds, monotonic (tests inject one).
    """

    def __init__(
        self,
        *,
        alpha: float = EWMA_ALPHA,
        probe_every: int = PROBE_EVERY,
        half_life_s: float | None = HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < float(alpha) <= 1.0:
            raise ConfigError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.probe_every = non_negative_int(probe_every, "probe_every")
        self.half_life_s = optional_positive_float(half_life_s, "half_life_s")
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {type(clock).__name__}")
        self._clock = clock
        self._lock = threading.Lock()
        # estimate -> (value, clock of its last sample)
        self._read: dict[str, tuple[float, float]] = {}
        self._prefill: tuple[float, float] | None = None
        self._read_samples = 0
        self._prefill_samples = 0
        self._avoided = 0
        self._probes = 0

    # ------------------------------------------------------------------ measurements
    def old_weight(self, age_s: float) -> float:
        """The weight of an estimate ``age_s`` seconds old against a new sample."""
        w = 1.0 - self.alpha
        if self.half_life_s is not None:
            w *= 0.5 ** (max(0.0, age_s) / self.half_life_s)
        return w

    def _mix(self, old: tuple[float, float] | None, sample: float) -> tuple[float, float]:
        now = self._clock()
        if old is None:
            return sample, now
        w = self.old_weight(now - old[1])
        return w * old[0] + (1.0 - w) * sample, now

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
            known = [self._read[t][0] for t in by_tier if t in self._read]
        guess = sum(known) / len(known) if known else 1.0
        weights = {t: n / self._read_rate_or(t, guess) for t, n in by_tier.items()}
        total = sum(weights.values())
        for t, n in by_tier.items():
            self.observe_read(t, n, seconds * weights[t] / total)

    def _read_rate_or(self, tier: str, default: float) -> float:
        rate = self.read_rate(tier)
        return default if rate is None else rate

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
            got = self._read.get(tier)
        return None if got is None else got[0]

    @property
    def prefill_rate(self) -> float | None:
        with self._lock:
            got = self._prefill
        return None if got is None else got[0]

    def statistics(self) -> CostStatistics:
        with self._lock:
            return CostStatistics(
                {t: r for t, (r, _) in self._read.items()},
                None if self._prefill is None else self._prefill[0],
                self._read_samples,
                self._prefill_samples,
                self._avoided,
                self._probes,
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
        """How much of ``probe``'s agreed prefix to load (see the module docstring): the
        cheapest by the measured rates, or all of it when this is the ``probe_every``-th
        decision that would load less (choice ``"probe"``).

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
        by_tier, rates = self._first_holders(layout, probe, p, s)
        if rate_p is None or any(r is None for r in rates.values()):
            return LoadDecision(
                "unmeasured", p, p, s, by_tier, rates, rate_p,
            )  # fmt: skip
        load_cost = self._load_costs(layout, probe, p, s)
        recompute_from = [  # seconds to recompute chunks k..p-1 (tokens past start only)
            (p * c_tokens - max(k * c_tokens, start_tokens)) / rate_p for k in range(p + 1)
        ]
        best_k, best = s, recompute_from[s]
        best_load = 0.0
        for k in range(s + 1, p + 1):
            load = load_cost(k)
            cost = load + recompute_from[k]
            if cost <= best:
                best_k, best, best_load = k, cost, load
        full_load = load_cost(p)
        if best_k < p and math.isfinite(full_load) and self._probe_now():
            return LoadDecision(
                "probe", p, p, s, by_tier, rates, rate_p, full_load, recompute_from[p],
                full_load, recompute_from[s],
            )  # fmt: skip
        choice = "load" if best_k == p else "recompute" if best_k == s else "partial"
        return LoadDecision(
            choice, best_k, p, s, by_tier, rates, rate_p, best_load, recompute_from[best_k],
            full_load, recompute_from[s],
        )  # fmt: skip

    def _first_holders(
        self, layout: StateLayout, probe: Probe, p: int, s: int
    ) -> tuple[dict[str, int], dict[str, float | None]]:
        """The bytes each first holder would serve of chunks ``s..p-1`` and its read rate."""
        by_tier: dict[str, int] = {}
        rates: dict[str, float | None] = {}
        for g in layout.groups:
            nbytes = layout.group_chunk_bytes(g.name)
            for c in layout.needed_chunks(g.name, p):
                if c >= s:
                    tier = probe.holders[c][g.name][0]
                    by_tier[tier] = by_tier.get(tier, 0) + nbytes
                    rates.setdefault(tier, self.read_rate(tier))
        return by_tier, rates

    def _load_costs(
        self, layout: StateLayout, probe: Probe, p: int, s: int
    ) -> Callable[[int], float]:
        """``load_cost(k)``: seconds to read chunks ``s..k-1`` of every group needing them from
        their first holders (inf: one without a holder, or an unmeasured one: never chosen)."""
        sums: dict[str, tuple[list[float], list[int]]] = {}
        for g in layout.groups:
            nbytes = layout.group_chunk_bytes(g.name)
            row: list[float] = []
            for c in range(p):
                names = probe.holders[c].get(g.name, ()) if c >= s else ()
                r = self.read_rate(names[0]) if names else None
                row.append(math.inf if c >= s and not r else nbytes / r if r else 0.0)
            sums[g.name] = _prefix_sums(row)

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

        return load_cost

    def _probe_now(self) -> bool:
        """Count a decision that loads less than the whole prefix; whether it is the one in
        ``probe_every`` that loads it all."""
        with self._lock:
            self._avoided += 1
            probe = self.probe_every > 0 and self._avoided % self.probe_every == 0
            self._probes += probe
        return probe


def _prefix_sums(row: Sequence[float]) -> tuple[list[float], list[int]]:
    """Prefix sums of the finite times, and prefix counts of the infinite ones."""
    times, missing = [0.0], [0]
    for x in row:
        inf = math.isinf(x)
        times.append(times[-1] + (0.0 if inf else x))
        missing.append(missing[-1] + inf)
    return times, missing
