"""bsr.metrics: scrape the Prometheus exposition text after real restores and compare."""

from __future__ import annotations

from pathlib import Path

import pytest

import bsr
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier
from support.engines import make_engine
from support.helpers import filled_cache, tokens_for, two_group_layout

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import bsr.metrics  # noqa: E402


def _samples(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = prometheus_client.generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.anyio
async def test_exposition_matches_results(tmp_path: Path) -> None:
    layout = two_group_layout()
    n = 4 * layout.chunk_tokens
    src = filled_cache(layout, 64, 8)
    ids = list(range(n // 8))
    # chunk 2 of the host copy gets a flipped byte: found on read, quarantined, read from file
    plan = FaultPlan(seed=0, faults=(Fault(FaultKind.CORRUPT, chunks=frozenset({2}), max_times=1),))
    host = FaultyTier(bsr.HostTier(1 << 24), plan)
    engine = make_engine(layout, [host, bsr.FileTier(tmp_path, 1 << 26)], window=2)
    registry = prometheus_client.CollectorRegistry()
    metrics = bsr.metrics.PrometheusMetrics(engine, registry=registry, prefix="t")
    before = _samples(registry)  # not open: no level metrics; no events counted yet
    assert not any(name.startswith("t_staging") for name, _ in before)
    assert before[("t_restored_tokens_total", ())] == 0
    results: list[bsr.RestoreResult] = []

    async with engine:
        saved = await engine.save(tokens_for(n), src, ids)
        assert saved.ok
        probe = await engine.lookup(tokens_for(n))
        assert probe.prefix_tokens == n
        await engine.lookup(tokens_for(n, seed=99))  # a miss
        for _ in range(2):
            dst = bsr.PagedKVCache(layout, 64, 8)
            results.append(await engine.restore(tokens_for(n), dst, ids))
        results.append(await engine.restore(tokens_for(n, seed=7), dst, ids))  # miss
        got = _samples(registry)
        stats = engine.statistics()
    first, second, miss = results
    assert first.committed and first.fallbacks >= 1 and first.quarantined >= 1, first
    assert second.committed and second.fallbacks == 0
    assert miss.reason is bsr.Reason.EMPTY_PREFIX
    assert got[("t_restores_total", (("outcome", "committed"), ("reason", "complete")))] == 2
    assert got[("t_restores_total", (("outcome", "committed"), ("reason", "empty_prefix")))] == 1
    assert got[("t_restored_tokens_total", ())] == 2 * n
    for tier in ("host", "file"):
        want = sum(r.bytes_by_tier.get(tier, 0) for r in results)
        assert got[("t_restored_bytes_total", (("tier", tier),))] == want
        assert got[("t_saved_bytes_total", (("tier", tier),))] == saved.bytes_written[tier]
    assert got[("t_restored_bytes_total", (("tier", "file"),))] > 0  # the fallback read
    assert got[("t_restore_fallbacks_total", ())] == first.fallbacks
    assert got[("t_restore_quarantined_total", ())] == first.quarantined
    assert got[("t_lookups_total", (("result", "hit"),))] == 1
    assert got[("t_lookups_total", (("result", "miss"),))] == 1
    assert got[("t_probe_duration_seconds_count", ())] == 2
    assert got[("t_restore_duration_seconds_count", (("outcome", "committed"),))] == 3
    total = sum(r.timings.total_s for r in results)
    assert got[("t_restore_duration_seconds_sum", (("outcome", "committed"),))] == pytest.approx(
        total
    )
    assert got[("t_restore_rws_bytes_sum", ())] == sum(r.rws_peak_bytes for r in results)
    assert got[("t_saves_total", ())] == 1
    # levels, read from engine.statistics() at scrape time
    assert got[("t_staging_slots", ())] == 2
    assert got[("t_staging_slots_in_use", ())] == 0
    assert got[("t_staging_peak_bytes", ())] == stats.staging.peak_bytes > 0
    assert got[("t_staging_peak_bytes", ())] <= 2 * layout.slot_bytes
    assert got[("t_engine_quarantined_objects", ())] == stats.quarantined
    for t in stats.tiers:
        assert got[("t_tier_objects", (("tier", t.name),))] == t.objects
        assert got[("t_tier_hits_total", (("tier", t.name),))] == t.hits
        assert got[("t_breaker_open", (("tier", t.name),))] == 0
    assert got[("t_tier_hits_total", (("tier", "file"),))] >= 1
    rates = engine.cost.statistics().read_rates  # what the restores measured, per tier
    assert rates.keys() == {"host", "file"}
    for tier, rate in rates.items():
        assert got[("t_tier_read_rate_bytes_per_second", (("tier", tier),))] == pytest.approx(rate)
    assert ("t_prefill_rate_tokens_per_second", ()) not in got  # nobody reported a prefill

    assert not any(k[0].startswith("t_staging") for k in _samples(registry))  # closed
    metrics.close()
    assert _samples(registry) == {}


@pytest.mark.anyio
async def test_cost_decisions_are_counted() -> None:
    layout = two_group_layout()
    n = 2 * layout.chunk_tokens
    src = filled_cache(layout, 64, 8)
    engine = make_engine(layout, [bsr.HostTier(1 << 24)], policy="cost")
    registry = prometheus_client.CollectorRegistry()
    bsr.metrics.PrometheusMetrics(engine, registry=registry, prefix="c")
    async with engine:
        await engine.save(tokens_for(n), src, list(range(n // 8)))
        first = await engine.restore(tokens_for(n), bsr.PagedKVCache(layout, 64, 8), list(range(8)))
        engine.cost.observe_prefill(10**9, 1.0)  # a prefill far faster than any read
        second = await engine.restore(
            tokens_for(n), bsr.PagedKVCache(layout, 64, 8), list(range(8))
        )
        got = _samples(registry)
    assert first.decision is not None and first.decision.choice == "unmeasured"
    assert second.decision is not None and second.decision.choice == "recompute"
    assert got[("c_load_decisions_total", (("choice", "unmeasured"),))] == 1
    assert got[("c_load_decisions_total", (("choice", "recompute"),))] == 1
    assert got[("c_restores_total", (("outcome", "committed"), ("reason", "recompute")))] == 1
    assert got[("c_prefill_rate_tokens_per_second", ())] == 10**9


@pytest.mark.anyio
async def test_breaker_state_is_exported() -> None:
    layout = two_group_layout()
    n = 2 * layout.chunk_tokens
    src = filled_cache(layout, 32, 8)
    ids = list(range(n // 8))
    plan = FaultPlan(seed=0, faults=(Fault(FaultKind.READ_ERROR),))
    engine = make_engine(
        layout,
        [FaultyTier(bsr.HostTier(1 << 24), plan), bsr.HostTier(1 << 24, name="backup")],
        breaker_threshold=1,
        breaker_cooldown_s=60,
    )
    registry = prometheus_client.CollectorRegistry()
    bsr.metrics.PrometheusMetrics(engine, registry=registry)

    async with engine:
        await engine.save(tokens_for(n), src, ids)
        r = await engine.restore(tokens_for(n), bsr.PagedKVCache(layout, 32, 8), ids)
        assert r.committed and r.bytes_by_tier.get("backup", 0) > 0, r
        got = _samples(registry)
        assert got[("bsr_breaker_open", (("tier", "host"),))] == 1
        assert got[("bsr_breaker_trips_total", (("tier", "host"),))] == 1
        assert got[("bsr_breaker_open", (("tier", "backup"),))] == 0


def test_bad_arguments() -> None:
    with pytest.raises(bsr.ConfigError, match="RestoreEngine"):
        bsr.metrics.PrometheusMetrics(object())  # type: ignore[arg-type]
    layout = two_group_layout()
    engine = make_engine(layout, [bsr.HostTier(1 << 20)])
    registry = prometheus_client.CollectorRegistry()
    with pytest.raises(bsr.ConfigError, match="prefix"):
        bsr.metrics.PrometheusMetrics(engine, registry=registry, prefix="a-b")
    bsr.metrics.PrometheusMetrics(engine, registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):  # same registry and prefix twice
        bsr.metrics.PrometheusMetrics(engine, registry=registry)
    bsr.metrics.PrometheusMetrics(engine, registry=registry, prefix="other")


def test_label_values_are_bounded_whatever_the_records_say() -> None:
    """A record whose labels are many distinct strings (a plugin tier's skip reasons, 500 tier
    names) adds at most MAX_LABEL_VALUES series to a metric; the rest count under ``other``,
    so the totals stay right and the exposition stays small."""
    layout = two_group_layout()
    engine = make_engine(layout, [bsr.HostTier(1 << 20)])
    registry = prometheus_client.CollectorRegistry()
    metrics = bsr.metrics.PrometheusMetrics(engine, registry=registry, prefix="t")
    n = 500
    record = bsr.SaveResult(
        saved_tokens=0, chunks=0, objects_written={}, objects_skipped={},
        bytes_written={f"tier-{i}-{'x' * 200}": 1 for i in range(n)}, errors={},
        rws_peak_bytes=0, duration_s=0.0, skipped={f"reason-{i}": 1 for i in range(n)},
    )  # fmt: skip
    metrics.observe(record)
    metrics.observe(record)
    got = _samples(registry)
    limit = getattr(bsr.metrics, "MAX_LABEL_VALUES", 64)  # (64: what the old code lacked)
    for name in ("t_saved_bytes_total", "t_saves_skipped_total"):
        series = {labels: v for (s, labels), v in got.items() if s == name}
        assert len(series) == limit, (name, len(series))
        assert sum(series.values()) == 2 * n  # every count kept
        label = "tier" if "bytes" in name else "reason"
        assert series[((label, "other"),)] == 2 * (n - (limit - 1))
    assert len(prometheus_client.generate_latest(registry)) < 64 * 1024
    metrics.close()
