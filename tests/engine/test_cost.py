"""Policy "cost": the load-or-recompute decision against a brute-force model, the rates it is
made from, and restores through a real engine whose tiers are measured as they are used."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.testing import LatencyTier
from support.engines import make_engine
from support.helpers import filled_cache, shuffled_blocks, tokens_for, two_group_layout

TIERS = ("host", "file", "remote")


def probe_of(layout: bsr.StateLayout, holders: list[dict[str, tuple[str, ...]]]) -> bsr.Probe:
    p = len(holders)
    return bsr.Probe(
        num_tokens=p * layout.chunk_tokens, chunk_tokens=layout.chunk_tokens, keys=(),
        holders=tuple(holders), local_chunks=p, prefix_chunks=p, bytes_by_tier={},
        duration_s=0.0,
    )  # fmt: skip


def model_cost(
    layout: bsr.StateLayout,
    holders: list[dict[str, tuple[str, ...]]],
    rates: dict[str, float],
    prefill: float,
    start: int,
    k: int,
) -> float:
    """Seconds to load the first ``k`` chunks past ``start`` and recompute the rest: every
    object a prefix of ``k`` chunks needs, read from its first holder, one by one."""
    c_tokens = layout.chunk_tokens
    s = start // c_tokens
    load = 0.0
    for g in layout.groups:
        for c in layout.needed_chunks(g.name, k):
            if c < s:
                continue
            names = holders[c].get(g.name, ())
            if not names:
                return math.inf
            load += layout.group_chunk_bytes(g.name) / rates[names[0]]
    p = len(holders)
    return load + (p * c_tokens - max(k * c_tokens, start)) / prefill


@st.composite
def cases(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    window = draw(st.sampled_from([None, 16, 40, 100]))
    layout = bsr.StateLayout(
        chunk_tokens=32,
        groups=(
            bsr.StateGroup("kv", num_layers=2, token_bytes=256),
            *(() if window is None else (bsr.StateGroup("swa", 1, 128, window_tokens=window),)),
        ),
    )
    p = draw(st.integers(1, 8))
    holders = []
    for c in range(p):
        row: dict[str, tuple[str, ...]] = {}
        for g in layout.groups:
            needed_at_end = c in layout.needed_chunks(g.name, p)
            # the full prefix's objects are held; a window group's older chunks may be too
            if needed_at_end or draw(st.booleans()):
                row[g.name] = tuple(draw(st.permutations(TIERS))[: draw(st.integers(1, 3))])
        holders.append(row)
    rates = {t: draw(st.floats(1e3, 1e10)) for t in TIERS}
    prefill = draw(st.floats(1.0, 1e7))
    start = draw(st.integers(0, p * 32 + 40)) // 8 * 8
    return layout, holders, rates, prefill, start


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_decision_is_the_cheapest_prefix_by_the_measured_rates(case) -> None:  # type: ignore[no-untyped-def]
    layout, holders, rates, prefill, start = case
    model = bsr.CostModel()
    for t, r in rates.items():
        model.observe_read(t, int(r), 1.0)
    model.observe_prefill(int(prefill), 1.0)
    d = model.decide(layout, probe_of(layout, holders), start_tokens=start)
    p, s = len(holders), min(start // 32, len(holders))
    if p <= s:
        assert d.choice == "empty" and not d.loads
        return
    costs = {k: model_cost(layout, holders, rates, int(prefill), start, k) for k in range(s, p + 1)}
    best = min(costs.values())
    assert math.isclose(costs[d.load_chunks], best, rel_tol=1e-9, abs_tol=1e-12)
    # never slower than always-recompute or always-load, by these rates
    assert costs[d.load_chunks] <= costs[s] * (1 + 1e-9) + 1e-12
    assert costs[d.load_chunks] <= costs[p] * (1 + 1e-9) + 1e-12
    # ties go to the longer prefix (today's behaviour)
    assert not any(
        k > d.load_chunks and math.isclose(c, best, rel_tol=1e-9, abs_tol=1e-12)
        for k, c in costs.items()
    )
    want = "load" if d.load_chunks == p else "recompute" if d.load_chunks == s else "partial"
    assert d.choice == want
    assert d.prefill_rate == pytest.approx(int(prefill))
    assert d.full_recompute_s == pytest.approx(costs[s])


def test_an_unmeasured_rate_decides_nothing() -> None:
    layout = two_group_layout()
    holders = [{"kv": ("host",), "swa": ("host",)}] * 3
    model = bsr.CostModel()
    d = model.decide(layout, probe_of(layout, holders))
    assert d.choice == "unmeasured" and d.load_chunks == 3  # today's behaviour: load it all
    model.observe_prefill(1000, 1.0)
    assert model.decide(layout, probe_of(layout, holders)).choice == "unmeasured"
    model.observe_read("host", 10**9, 1.0)
    d = model.decide(layout, probe_of(layout, holders))
    assert d.choice == "load" and d.read_rates == {"host": 1e9} and d.prefill_rate == 1000
    # a rate given by the caller (vLLM's scheduler measures its own prefill)
    assert model.decide(layout, probe_of(layout, holders), prefill_rate=1e12).choice == "recompute"


def test_a_tie_loads_the_longer_prefix() -> None:
    """Loading a chunk takes exactly as long as recomputing it: load (today's behaviour)."""
    layout = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))
    model = bsr.CostModel()
    model.observe_read("host", layout.group_chunk_bytes("kv"), 1.0)  # a chunk a second
    model.observe_prefill(32, 1.0)  # a chunk's tokens a second
    d = model.decide(layout, probe_of(layout, [{"kv": ("host",)}] * 3))
    assert d.choice == "load" and d.load_chunks == 3
    assert d.load_s == d.full_recompute_s == 3.0


def test_rates_are_weighted_means_and_a_mixed_restore_splits_its_time() -> None:
    model = bsr.CostModel(alpha=0.5)
    model.observe_read("a", 100, 1.0)
    model.observe_read("a", 300, 1.0)
    assert model.read_rate("a") == pytest.approx(200.0)
    with pytest.raises(bsr.ConfigError):
        model.observe_prefill(10, float("nan"))
    with pytest.raises(bsr.ConfigError):
        bsr.CostModel(alpha=0)
    model.observe_read("b", 100, 1.0)  # b is twice as slow as a
    result = bsr.RestoreResult(
        request_id="r", state=bsr.RequestState.COMMITTED, committed_tokens=64, probed_tokens=64,
        bytes_by_tier={"a": 400, "b": 100}, rws_peak_bytes=0,
        timings=bsr.Timings(probe_s=0.5, install_s=2.0, commit_s=0.0, total_s=3.5),
        reason=bsr.Reason.COMPLETE, invalid_block_ids=(), trace=(),
        strategy=bsr.Strategy.BOUNDED, policy=bsr.Policy.COST,
    )  # fmt: skip
    model.observe_restore(result)
    # 3 s of reading: a's 400 B at 200 B/s take 2 s of it, b's 100 B at 100 B/s 1 s
    assert model.read_rate("a") == pytest.approx(200.0)
    assert model.read_rate("b") == pytest.approx(100.0)
    stats = model.statistics()
    assert stats.read_samples == 5 and stats.read_rates.keys() == {"a", "b"}


# --------------------------------------------------------------------------- a real engine
@pytest.mark.anyio
async def test_a_slowed_tier_is_recomputed_a_fast_one_loaded_the_cheap_part_loaded(
    tmp_path: Path,
) -> None:
    """A tier's first restore loads (no measurement yet) and measures it; from then on a tier
    that takes five seconds per object is recomputed (nothing read from it), a host tier is
    loaded, and a prefix whose first chunks are in host memory and the rest in the slow tier
    loads its host part only. The prefill rate is given, 2 ms per token (a small model on a
    CPU), not measured: the choices are the policy's, the rates its inputs. The margins are
    wide (a host read of a chunk takes milliseconds, the slow one five seconds, the prefill of
    256 tokens half a second), so a busy machine does not change the choices. (Measuring the
    prefill with a few matmuls here made it as fast as the host reads: a tie, and a flaky
    choice.)"""
    chunk = 256
    layout = bsr.StateLayout(chunk_tokens=chunk, groups=(bsr.StateGroup("kv", 2, 256),))
    n = 4 * chunk
    src = filled_cache(layout, 64, 32, seed=1)
    ids = shuffled_blocks(64, n // 32, seed=2)
    toks = tokens_for(n)
    host = bsr.HostTier(1 << 24)
    slow = LatencyTier(bsr.FileTier(tmp_path / "l2", 1 << 24), read_latency_s=5.0, name="slow")
    eng = make_engine(layout, [host, slow], io_depth=2, policy="cost")
    chunk_bytes = layout.group_chunk_bytes("kv")
    async with eng:
        eng.cost.observe_prefill(1000, 2.0)  # 2 ms per token
        await eng.save(toks[: 2 * chunk], src, ids, tiers=["host", "slow"])  # chunks 0-1: both
        await eng.save(toks, src, ids, tiers=["slow"])  # chunks 2-3: the slow tier only

        async def restore(tokens: list[int]) -> bsr.RestoreResult:
            dst = bsr.PagedKVCache(layout, 64, 32)
            return await eng.restore(tokens, dst, shuffled_blocks(64, len(tokens) // 32, seed=3))

        first = await restore(toks[: 2 * chunk])  # host only, not measured yet: loads
        assert first.decision is not None and first.decision.choice == "unmeasured"
        assert first.committed_tokens == 2 * chunk and first.policy is bsr.Policy.COST

        fast = await restore(toks[: 2 * chunk])
        d = fast.decision
        assert d is not None and d.choice == "load", d
        assert fast.committed_tokens == 2 * chunk
        assert fast.bytes_by_tier == {"host": 2 * chunk_bytes}
        assert d.load_s is not None and d.full_recompute_s is not None
        assert d.load_s < d.full_recompute_s

        whole = await restore(toks)  # the slow tier not measured yet: loads, measures it
        assert whole.decision is not None and whole.decision.choice == "unmeasured"
        assert whole.committed_tokens == n and whole.bytes_by_tier["slow"] == 2 * chunk_bytes

        partial = await restore(toks)
        d = partial.decision
        assert d is not None and d.choice == "partial" and d.load_chunks == 2, d
        assert partial.committed_tokens == 2 * chunk
        assert partial.bytes_by_tier == {"host": 2 * chunk_bytes}  # nothing from the slow tier
        assert d.bytes_by_tier == {"host": 2 * chunk_bytes, "slow": 2 * chunk_bytes}
        assert d.read_rates.keys() == {"host", "slow"}

        await host.delete(eng.keys(toks)[0], "kv")  # chunk 0 now only in the slow tier
        recompute = await restore(toks)
        d = recompute.decision
        assert d is not None and d.choice == "recompute" and d.load_chunks == 0, d
        assert recompute.committed_tokens == 0 and recompute.bytes_by_tier == {}
        assert recompute.reason is bsr.Reason.RECOMPUTE and recompute.committed
        assert [t.trigger for t in recompute.trace] == ["probe_miss"]


@pytest.mark.anyio
async def test_a_lookup_under_policy_cost_carries_its_decision() -> None:
    layout = two_group_layout()
    n = 3 * layout.chunk_tokens
    src = filled_cache(layout, 64, 8, seed=1)
    ids = shuffled_blocks(64, n // 8, seed=2)
    toks = tokens_for(n)
    async with make_engine(layout, [bsr.HostTier(1 << 24)], policy="cost") as eng:
        await eng.save(toks, src, ids)
        probe = await eng.lookup(toks, start_tokens=32)
        assert probe.decision is not None and probe.decision.choice == "unmeasured"
        assert probe.decision.start_chunks == 1 and probe.decision.probed_chunks == 3
        eng.cost.observe_read("host", 1, 1.0)  # 1 byte/s: nothing is worth loading
        probe = await eng.lookup(toks, prefill_tokens_per_s=1000.0)
        assert probe.decision is not None and probe.decision.choice == "recompute"
        r = await eng.restore(toks, bsr.PagedKVCache(layout, 64, 8), ids, probe=probe)
        assert r.reason is bsr.Reason.RECOMPUTE and r.bytes_by_tier == {}
        assert r.decision == probe.decision
    async with make_engine(layout, [bsr.HostTier(1 << 24)]) as eng:  # other policies: none
        assert (await eng.lookup(toks)).decision is None
