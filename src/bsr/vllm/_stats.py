"""bsr's numbers inside vLLM: the stats class vLLM aggregates, and its Prometheus metrics.

Where it runs: :class:`BsrConnectorStats` is filled on both sides of the connector (the
scheduler counts lookups and saves it schedules or skips, the workers count loads, bytes and
saves done), sent to vLLM's logger with every engine step that has something to say, summed
across workers and the scheduler by :meth:`~BsrConnectorStats.aggregate`, printed in vLLM's
periodic "KV Transfer metrics" log line, and observed by :class:`BsrPromMetrics` in the process
that serves ``/metrics`` (the OpenAI server's front end).

How it works: the data is a flat dict of counters (``int``) plus per-tier and per-reason dicts
of counters and one peak; everything in it travels between processes as plain values. Request
counts (loads, failures, saves) come from tensor-parallel rank 0 only, bytes from every rank.

Labels come from closed sets: a keyed counter whose labels a client could choose has its set
here (:data:`CLOSED_LABELS`: ``rejected_options{field}`` is a known option or ``unknown``), and
every keyed counter keeps at most :data:`MAX_LABELS` series in one ``/metrics`` (what comes
after counts under ``other``), so no request adds a series of its own.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ._request_keys import OPTION_FIELDS

#: plain counters, summed
COUNTERS = (
    "lookups",  # lookups the scheduler sent to the worker
    "lookups_timed_out",  # answers too late: the worker's backstop fired, or the scheduler gave up
    "deferred",  # times a request was asked to wait for another request's load of its chunks
    "hit_tokens",  # tokens promised to vLLM beyond its own prefix-cache hit
    "loads",  # loads that ended
    "loaded_tokens",  # tokens those loads committed beyond vLLM's own hit
    "cancelled_loads",  # loads of requests that finished (aborted) while loading
    "saves",  # saves that ended
    "window_saves",  # sliding windows saved while their request ran (prefix ends)
    "adapter_misses",  # lookups answered 0 at once: the request's LoRA adapter is not loaded
)
#: dicts of counters (tier or reason -> count), summed key by key
KEYED = (
    "loaded_bytes",  # tier -> bytes read by loads
    "failed_loads",  # reason -> loads that did not commit what was promised
    "saved_bytes",  # tier -> bytes written by saves
    "saves_skipped",  # reason -> finished requests not saved (or not in full: "timeout",
    # "root_locked"; the scheduler's "busy" and "unverified")
    "unkeyable_requests",  # reason -> requests bsr could not key (neither loaded nor saved)
    "rejected_options",  # field -> requests whose kv_transfer_params["bsr"] was bad
    "hit_tokens_by_tier",  # tier -> promised tokens each tier holds (the lookup's probe)
    "lookup_unanswered",  # tier -> lookups it did not answer in time (cut off, failed, breaker)
    "load_decisions",  # choice -> policy "cost" decisions (load, partial, recompute, ...)
    "cost_tokens",  # load / recompute -> tokens policy "cost" chose to load or to recompute
    "kv_events",  # stored / removed -> KV events published (chunks x tiers)
    "object_removals",  # cause -> objects that left an announced tier (rank 0)
    "windows_skipped",  # reason -> sliding windows worth saving that were not
    "warms",  # reason -> warms the endpoint ran (rank 0)
    "promotions",  # reason -> promotions of restored hits into the host tier (rank 0)
    "warmed_bytes",  # tier -> bytes warms and promotions read from it into the host tier
)
#: the labels a keyed counter may carry where a client's request chooses them (anything else is
#: counted under the last one)
CLOSED_LABELS: dict[str, tuple[str, ...]] = {
    "rejected_options": (*OPTION_FIELDS, "unknown"),
}
#: series one keyed counter keeps at most (its tiers, reasons, causes are far fewer)
MAX_LABELS = 64
#: where a keyed counter counts what comes past :data:`MAX_LABELS`
OTHER = "other"

#: peaks, aggregated by max
PEAKS = ("rws_peak_bytes",)  # the largest restoration working set of one load (staging bytes)


def closed_label(counter: str, label: str, seen: Any) -> str:
    """``label`` as ``counter`` may carry it: one of its closed set (else the set's last), and
    one of the first :data:`MAX_LABELS` - 1 labels ``seen`` (else :data:`OTHER`)."""
    allowed = CLOSED_LABELS.get(counter)
    if allowed is not None and label not in allowed:
        return allowed[-1]
    if label not in seen and len(seen) >= MAX_LABELS - 1:  # the last one is OTHER
        return OTHER
    return label


def empty() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, **{k: {} for k in KEYED}, **{k: 0 for k in PEAKS}}


class BsrConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """bsr's counters for one interval (see the module docstring); vLLM builds it from the
    plain dict with :meth:`BsrConnector.build_kv_connector_stats`."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=empty())
        if data:
            self._add(data)

    def _add(self, data: dict[str, Any]) -> None:
        for k in COUNTERS:
            self.data[k] += int(data.get(k, 0) or 0)
        for k in KEYED:
            into = self.data[k]
            for name, n in (data.get(k) or {}).items():
                label = closed_label(k, str(name), into)
                into[label] = into.get(label, 0) + int(n)
        for k in PEAKS:
            self.data[k] = max(self.data[k], int(data.get(k, 0) or 0))

    def count(self, name: str, n: int = 1) -> None:
        self.data[name] += n

    def count_key(self, name: str, key: str, n: int = 1) -> None:
        into = self.data[name]
        label = closed_label(name, key, into)
        into[label] = into.get(label, 0) + n

    def peak(self, name: str, value: int) -> None:
        self.data[name] = max(self.data[name], value)

    def reset(self) -> None:
        self.data = empty()

    def take(self) -> BsrConnectorStats | None:
        """This interval's stats (None if nothing happened); starts a new interval."""
        if self.is_empty():
            return None
        out = BsrConnectorStats(self.data)
        self.reset()
        return out

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KVConnectorStats) and other.data:
            self._add(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in COUNTERS + PEAKS}
        for k in KEYED:
            for name, n in sorted(self.data[k].items()):
                out[f"{k}.{name}"] = n
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS + KEYED + PEAKS)


#: Prometheus metric of each counter (``_total`` is added by the client library)
METRICS = {
    "lookups": ("vllm:bsr_lookups", "Lookups the scheduler sent to bsr."),
    "lookups_timed_out": (
        "vllm:bsr_lookup_timeouts",
        "bsr lookups whose answer came too late, on the worker or to the scheduler "
        "(counted as misses).",
    ),
    "deferred": (
        "vllm:bsr_deferred_lookups",
        "Times a request waited for another request's bsr load of the same chunks.",
    ),
    "hit_tokens": ("vllm:bsr_hit_tokens", "Tokens bsr promised beyond vLLM's prefix cache."),
    "loads": ("vllm:bsr_loads", "bsr loads that ended."),
    "loaded_tokens": ("vllm:bsr_loaded_tokens", "Tokens bsr loads committed into vLLM's cache."),
    "cancelled_loads": ("vllm:bsr_cancelled_loads", "bsr loads of requests that finished first."),
    "saves": ("vllm:bsr_saves", "bsr saves of finished requests that ended."),
    "window_saves": (
        "vllm:bsr_window_saves",
        "Sliding windows bsr saved while their request ran (window checkpoints, ends).",
    ),
    "adapter_misses": (
        "vllm:bsr_adapter_misses",
        "bsr lookups that missed at once: the request's LoRA adapter was not loaded in the worker.",
    ),
}
KEYED_METRICS = {
    "loaded_bytes": ("vllm:bsr_loaded_bytes", "Bytes bsr loads read, by tier.", "tier"),
    "failed_loads": (
        "vllm:bsr_failed_loads",
        "bsr loads that did not commit every promised token, by reason.",
        "reason",
    ),
    "saved_bytes": ("vllm:bsr_saved_bytes", "Bytes bsr saves wrote, by tier.", "tier"),
    "saves_skipped": ("vllm:bsr_saves_skipped", "Finished requests bsr did not save.", "reason"),
    "unkeyable_requests": (
        "vllm:bsr_unkeyable_requests",
        "Requests bsr could not key (neither loaded nor saved), by reason.",
        "reason",
    ),
    "rejected_options": (
        "vllm:bsr_rejected_options",
        "Requests whose kv_transfer_params['bsr'] was invalid (served without bsr), by field.",
        "field",
    ),
    "hit_tokens_by_tier": (
        "vllm:bsr_hit_tokens_by_tier",
        "Tokens bsr promised beyond vLLM's prefix cache, by the tier that holds them.",
        "tier",
    ),
    "lookup_unanswered": (
        "vllm:bsr_lookup_unanswered",
        "bsr lookups a tier did not answer within lookup_timeout_s (cut off, failed, or its "
        "circuit breaker open): it held nothing for them, by tier.",
        "tier",
    ),
    "load_decisions": (
        "vllm:bsr_load_decisions",
        "Load-or-recompute decisions of bsr's policy 'cost', by choice.",
        "choice",
    ),
    "cost_tokens": (
        "vllm:bsr_cost_tokens",
        "Probed tokens bsr's policy 'cost' chose to load or to recompute.",
        "choice",
    ),
    "kv_events": (
        "vllm:bsr_kv_events",
        "KV events bsr published (one per chunk and tier), by event.",
        "event",
    ),
    "object_removals": (
        "vllm:bsr_object_removals",
        "Announced bsr objects that left a tier, by cause.",
        "cause",
    ),
    "windows_skipped": (
        "vllm:bsr_windows_skipped",
        "Sliding windows worth saving that bsr did not save, by reason.",
        "reason",
    ),
    "warms": ("vllm:bsr_warms", "Warms routers asked for (POST /bsr/warm), by reason.", "reason"),
    "promotions": (
        "vllm:bsr_promotions",
        "Restored hits bsr copied into its host tier after the load, by reason.",
        "reason",
    ),
    "warmed_bytes": (
        "vllm:bsr_warmed_bytes",
        "Bytes warms and promotions read into bsr's host tier, by the tier read.",
        "tier",
    ),
}


class BsrPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Registers bsr's counters (``vllm:bsr_*``) and a peak gauge, per vLLM engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in METRICS.items()
        }
        self._keyed = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
            for key, (name, doc, label) in KEYED_METRICS.items()
        }
        self._rws = self._gauge_cls(
            name="vllm:bsr_rws_peak_bytes",
            documentation="Largest staging (restoration working set) of one bsr load so far.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._peak: dict[int, int] = {}
        self._labels: dict[tuple[int, str], set[str]] = {}  # series made per engine and counter

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = BsrConnectorStats(transfer_stats_data).data
        labels = self.per_engine_labelvalues[engine_idx]
        for key, counter in self._counters.items():
            if stats[key]:
                counter.labels(*labels).inc(stats[key])
        for key, counter in self._keyed.items():
            made = self._labels.setdefault((engine_idx, key), set())
            for name, n in stats[key].items():
                if n:
                    label = closed_label(key, name, made)
                    made.add(label)
                    counter.labels(*labels, label).inc(n)
        peak = max(self._peak.get(engine_idx, 0), stats["rws_peak_bytes"])
        if peak:
            self._peak[engine_idx] = peak
            self._rws.labels(*labels).set(peak)
