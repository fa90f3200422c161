"""Prometheus metrics for a RestoreEngine (optional extra: ``pip install bsr-kv[metrics]``).

Where it runs: the serving process, beside the engine. ``engine.statistics()`` stays the
dependency-free source of truth; this module only exports it and the engine's results.

How it works: :class:`PrometheusMetrics` does two things.

- It subscribes to the engine (``engine.subscribe``): every lookup's :class:`~bsr.Probe`, every
  :class:`~bsr.RestoreResult` and every :class:`~bsr.SaveResult` updates counters and
  histograms right away (restores by outcome and reason, bytes by tier, latencies, fallbacks,
  quarantines, per-request staging peak).
- It registers a collector that reads ``engine.statistics()`` at scrape time for what is a level,
  not an event: staging pool occupancy, tier occupancy and counters, breaker state per tier.
  A closed (or not yet opened) engine exports no level metrics.

Metric names (prefix ``bsr`` by default; one engine per registry and prefix):

======================================  =======================================================
``bsr_restores_total{outcome,reason}``  restores by ``committed``/``invalidated`` and reason
``bsr_restored_tokens_total``           tokens committed by restores
``bsr_restored_bytes_total{tier}``      payload bytes restores read from each tier
``bsr_restore_fallbacks_total``         reads served by a lower tier after a higher one failed
``bsr_restore_quarantined_total``       objects taken out of service during restores
``bsr_restore_duration_seconds``        histogram of restore wall time, label ``outcome``
``bsr_restore_rws_bytes``               histogram of each restore's peak staging (its RWS)
``bsr_lookups_total{result}``           lookups by ``hit``/``miss``
``bsr_probe_duration_seconds``          histogram of lookup wall time
``bsr_saves_total``                     saves
``bsr_saved_bytes_total{tier}``         payload bytes written per tier
``bsr_save_errors_total{tier}``         write errors per tier
``bsr_saves_skipped_total{reason}``     saves that skipped a busy tier (``root_locked``)
``bsr_save_duration_seconds``           histogram of save wall time
``bsr_staging_slots``                   W, and ``_in_use``, ``_peak`` (slots), ``_waiting``
``bsr_staging_in_use_bytes``            staging bytes in use now (and ``_peak_bytes``)
``bsr_tier_objects{tier}``              objects, ``bsr_tier_bytes``, ``bsr_tier_capacity_bytes``
``bsr_tier_hits_total{tier}``           and ``misses``, ``evictions``, ``errors``, ``quarantined``
``bsr_engine_quarantined_objects``      objects the engine refuses to read (until re-saved)
``bsr_breaker_open{tier}``              1 while the tier's breaker is open, else 0
``bsr_breaker_trips_total{tier}``       times the breaker opened
``bsr_load_decisions_total{choice}``    policy ``"cost"``: restores by what it chose to load
``bsr_tier_read_rate_bytes_per_second`` the read rate the cost model measured, label ``tier``
``bsr_prefill_rate_tokens_per_second``  the prefill rate the server reported to the cost model
======================================  =======================================================

Labels come from closed sets: outcomes, reasons and choices are bsr's own values, tiers are the
engine's; whatever a label's source, one event metric keeps at most :data:`MAX_LABEL_VALUES`
values of a label (later ones are counted under ``other``), so nothing a request or a plugin
produces can add series without bound.

Example::

    from prometheus_client import start_http_server
    metrics = bsr.metrics.PrometheusMetrics(engine)
    start_http_server(9400)  # scrape http://host:9400/metrics
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import Probe, RequestState, RestoreResult, SaveResult, WarmResult
from ._errors import ClosedError, ConfigError

if TYPE_CHECKING:
    from . import RestoreEngine

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    raise ModuleNotFoundError(
        "bsr.metrics needs prometheus_client; install the extra: pip install 'bsr-kv[metrics]'",
        name=exc.name,
    ) from exc

__all__ = ("LATENCY_BUCKETS", "MAX_LABEL_VALUES", "RWS_BUCKETS", "PrometheusMetrics")

#: values one label of one event metric takes at most (the last is ``other``)
MAX_LABEL_VALUES = 64

#: seconds; probes are sub-millisecond, restores of large states take seconds
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: bytes; powers of four from 64 KiB to 16 GiB
RWS_BUCKETS: tuple[float, ...] = tuple(float(1 << (16 + 2 * i)) for i in range(10))


_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _label(value: str) -> str:
    """A label value every scrape can encode: names are checked to be UTF-8 text when tiers are
    built, but one unencodable label (a lone surrogate) would make ``generate_latest`` fail for
    every metric of the registry, so anything that slipped through is escaped, never raised."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


#: (attribute, kind, metric name after the prefix, help, labels) of every event metric
_METRICS: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("restores", "counter", "restores", "Restores by outcome and reason", ("outcome", "reason")),
    ("restored_tokens", "counter", "restored_tokens", "Tokens committed by restores", ()),
    ("restored_bytes", "counter", "restored_bytes", "Payload bytes read by restores", ("tier",)),
    ("fallbacks", "counter", "restore_fallbacks", "Reads served by a lower tier", ()),
    ("quarantined", "counter", "restore_quarantined", "Objects quarantined by restores", ()),
    ("restore_seconds", "histogram", "restore_duration_seconds", "Restore wall time", ("outcome",)),
    ("restore_rws", "histogram", "restore_rws_bytes", "Peak staging bytes of each restore", ()),
    ("lookups", "counter", "lookups", "Lookups by result", ("result",)),
    ("probe_seconds", "histogram", "probe_duration_seconds", "Lookup wall time", ()),
    ("saves", "counter", "saves", "Saves", ()),
    ("saved_bytes", "counter", "saved_bytes", "Payload bytes written by saves", ("tier",)),
    ("save_errors", "counter", "save_errors", "Write errors during saves", ("tier",)),
    ("saves_skipped", "counter", "saves_skipped", "Saves that skipped a busy tier", ("reason",)),
    ("save_seconds", "histogram", "save_duration_seconds", "Save wall time", ()),
    ("load_decisions", "counter", "load_decisions", "Policy 'cost' decisions", ("choice",)),
    ("warms", "counter", "warms", "Warms and promotions by kind and reason", ("kind", "reason")),
    (
        "warmed_bytes", "counter", "warmed_bytes",
        "Payload bytes warms and promotions copied into the host tier, by source tier",
        ("kind", "tier"),
    ),
)  # fmt: skip


class PrometheusMetrics:
    """Export one engine's results and statistics to a Prometheus registry.

    Args:
        engine: the engine to observe (open or not yet open).
        registry: where to register (default: ``prometheus_client.REGISTRY``, what
            ``start_http_server`` serves). Use one registry or one prefix per engine.
        prefix: metric name prefix.
        latency_buckets: histogram buckets (seconds) for probe, restore and save times.
        rws_buckets: histogram buckets (bytes) for each restore's staging peak.

    Call :meth:`close` to unsubscribe and unregister every metric.
    """

    # event metrics, made by _declare from _METRICS
    restores: Any
    restored_tokens: Any
    restored_bytes: Any
    fallbacks: Any
    quarantined: Any
    restore_seconds: Any
    restore_rws: Any
    lookups: Any
    probe_seconds: Any
    saves: Any
    saved_bytes: Any
    save_errors: Any
    saves_skipped: Any
    save_seconds: Any
    load_decisions: Any
    warms: Any
    warmed_bytes: Any

    def __init__(
        self,
        engine: RestoreEngine,
        registry: prometheus_client.CollectorRegistry | None = None,
        prefix: str = "bsr",
        *,
        latency_buckets: Sequence[float] = LATENCY_BUCKETS,
        rws_buckets: Sequence[float] = RWS_BUCKETS,
    ) -> None:
        if not hasattr(engine, "subscribe") or not hasattr(engine, "statistics"):
            raise ConfigError(f"engine must be a bsr.RestoreEngine, got {type(engine).__name__}")
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise ConfigError(
                f"prefix must be ASCII letters, digits and '_' (not starting with a digit), "
                f"got {prefix!r}"
            )
        self.engine = engine
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.prefix = prefix
        self._metrics: list[Any] = []
        self._values: dict[tuple[str, int], set[str]] = {}  # (metric, label) -> values used
        try:
            self._declare(tuple(latency_buckets), tuple(rws_buckets))
            self._collector = _EngineCollector(engine, prefix)
            self._metrics.append(self._collector)
            self.registry.register(self._collector)
        except BaseException:
            self._unregister()
            raise
        self._unsubscribe: Callable[[], None] | None = engine.subscribe(self.observe)

    def _declare(self, lat: tuple[float, ...], rws: tuple[float, ...]) -> None:
        """Create (and register) every counter and histogram named in :data:`_METRICS`."""
        for attr, kind, name, doc, labels in _METRICS:
            extra: dict[str, Any] = {}
            if kind == "histogram":
                extra["buckets"] = rws if attr == "restore_rws" else lat
            cls = prometheus_client.Counter if kind == "counter" else prometheus_client.Histogram
            metric = cls(
                f"{self.prefix}_{name}", doc, list(labels), registry=self.registry, **extra
            )
            self._metrics.append(metric)
            setattr(self, attr, metric)

    # ------------------------------------------------------------------ events
    def _value(self, metric: str, value: str, position: int = 0) -> str:
        """``value`` as label ``position`` of ``metric``: encodable, and one of the first
        :data:`MAX_LABEL_VALUES` - 1 values it took (else ``other``)."""
        used = self._values.setdefault((metric, position), set())
        if value not in used:
            if len(used) >= MAX_LABEL_VALUES - 1:
                return "other"
            used.add(value)
        return _label(value)

    def observe(self, record: Probe | RestoreResult | SaveResult | WarmResult) -> None:
        """Count one engine record (called by the engine for every lookup, restore, save,
        warm and promotion)."""
        if isinstance(record, RestoreResult):
            outcome = "committed" if record.state is RequestState.COMMITTED else "invalidated"
            self.restores.labels(
                outcome, self._value("restores", str(record.reason.value), 1)
            ).inc()
            self.restored_tokens.inc(record.committed_tokens)
            for tier, n in record.bytes_by_tier.items():
                self.restored_bytes.labels(self._value("restored_bytes", tier)).inc(n)
            self.fallbacks.inc(record.fallbacks)
            self.quarantined.inc(record.quarantined)
            self.restore_seconds.labels(outcome).observe(record.timings.total_s)
            self.restore_rws.observe(record.rws_peak_bytes)
            if record.decision is not None:
                choice = self._value("load_decisions", str(record.decision.choice))
                self.load_decisions.labels(choice).inc()
        elif isinstance(record, Probe):
            self.lookups.labels("hit" if record.hit else "miss").inc()
            self.probe_seconds.observe(record.duration_s)
        elif isinstance(record, SaveResult):
            self.saves.inc()
            for tier, n in record.bytes_written.items():
                self.saved_bytes.labels(self._value("saved_bytes", tier)).inc(n)
            for tier, n in record.errors.items():
                self.save_errors.labels(self._value("save_errors", tier)).inc(n)
            for reason in record.skipped:
                self.saves_skipped.labels(self._value("saves_skipped", reason)).inc()
            self.save_seconds.observe(record.duration_s)
        elif isinstance(record, WarmResult):
            kind = "promotion" if record.kind == "promotion" else "warm"
            self.warms.labels(kind, self._value("warms", record.reason, 1)).inc()
            for tier, n in record.bytes_by_tier.items():
                self.warmed_bytes.labels(kind, self._value("warmed_bytes", tier, 1)).inc(n)

    def close(self) -> None:
        """Stop observing the engine and remove every metric from the registry."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._unregister()

    def _unregister(self) -> None:
        for m in self._metrics:
            try:
                self.registry.unregister(m)
            except KeyError:
                pass
        self._metrics.clear()


class _EngineCollector(Collector):
    """Level metrics read from ``engine.statistics()`` at scrape time."""

    def __init__(self, engine: RestoreEngine, prefix: str) -> None:
        self.engine = engine
        self.prefix = prefix

    def describe(self) -> list[Any]:
        return []  # dynamic: no name clash checks at register time beyond the event metrics

    def collect(self) -> Iterator[Any]:
        try:
            st = self.engine.statistics()
        except ClosedError:
            return
        p = self.prefix
        s = st.staging
        for name, doc, value in (
            ("staging_slots", "Staging slots (W)", s.slots),
            ("staging_slots_in_use", "Staging slots in use", s.in_use),
            ("staging_slots_peak", "Most staging slots ever in use at once", s.peak_in_use),
            ("staging_slots_waiting", "Requests waiting for a staging slot", s.waiting),
            ("staging_in_use_bytes", "Staging bytes in use", s.in_use_bytes),
            ("staging_peak_bytes", "Peak staging bytes in use at once", s.peak_bytes),
            ("staging_capacity_bytes", "Staging bytes allocated (W x slot)", s.capacity_bytes),
            ("engine_quarantined_objects", "Objects the engine refuses to read", st.quarantined),
        ):
            yield GaugeMetricFamily(f"{p}_{name}", doc, value=value)
        cost = self.engine.cost.statistics()
        rates = GaugeMetricFamily(
            f"{p}_tier_read_rate_bytes_per_second", "Read rate restores measured", labels=["tier"]
        )
        for tier, rate in sorted(cost.read_rates.items()):
            rates.add_metric([_label(tier)], rate)
        yield rates
        if cost.prefill_rate is not None:
            yield GaugeMetricFamily(
                f"{p}_prefill_rate_tokens_per_second", "Prefill rate the server reported",
                value=cost.prefill_rate,
            )  # fmt: skip
        gauges = {
            "objects": ("Objects stored in the tier", "objects"),
            "bytes": ("Bytes stored in the tier", "bytes"),
            "capacity_bytes": ("Tier capacity in bytes", "capacity_bytes"),
        }
        for name, (doc, attr) in gauges.items():
            g = GaugeMetricFamily(f"{p}_tier_{name}", doc, labels=["tier"])
            for t in st.tiers:
                g.add_metric([_label(t.name)], getattr(t, attr))
            yield g
        counters = {
            "hits": "Verified reads served by the tier",
            "misses": "Reads of objects the tier did not hold",
            "evictions": "Objects evicted for capacity",
            "errors": "Failed tier operations",
            "quarantined": "Objects the tier moved aside after failed verification",
        }
        for name, doc in counters.items():
            c = CounterMetricFamily(f"{p}_tier_{name}", doc, labels=["tier"])
            for t in st.tiers:
                c.add_metric([_label(t.name)], getattr(t, name))
            yield c
        bo = GaugeMetricFamily(f"{p}_breaker_open", "1 while the breaker is open", labels=["tier"])
        bt = CounterMetricFamily(f"{p}_breaker_trips", "Times the breaker opened", labels=["tier"])
        bf = GaugeMetricFamily(
            f"{p}_breaker_consecutive_failures", "Consecutive failures", labels=["tier"]
        )
        for b in st.breakers:
            label = [_label(b.tier)]
            bo.add_metric(label, 1.0 if b.open else 0.0)
            bt.add_metric(label, b.trips)
            bf.add_metric(label, b.consecutive_failures)
        yield from (bo, bt, bf)
