"""Policy "cost": the load-or-recompute decision against a brute-force model, the rates it is
made from, and restores through a real engine whose tiers are measured as they are used."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
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


# --------------------------------------------------------------------------- looking again
class Clock:
    """An injected clock: seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def model_estimate(
    samples: list[tuple[float, float]], alpha: float, half_life: float | None
) -> float:
    """The estimate after ``samples`` ((time, rate), in time order), from the closed form of
    its weights: sample ``i`` keeps ``a_i * prod_{j > i} w_j`` of the estimate, where ``w_j`` is
    the weight the estimate had against sample ``j`` (``(1 - alpha)``, halved every half-life
    since the sample before) and ``a_i = 1 - w_i`` (the first sample: all of it)."""
    w = [0.0] + [
        (1 - alpha) * (1.0 if half_life is None else 0.5 ** ((t - samples[j][0]) / half_life))
        for j, (t, _) in enumerate(samples[1:])
    ]
    weights = [(1 - w[i]) * math.prod(w[i + 1 :]) for i in range(len(samples))]
    assert math.isclose(sum(weights), 1.0, rel_tol=1e-9)
    return sum(wi * rate for wi, (_, rate) in zip(weights, samples, strict=True))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1000), st.floats(1.0, 1e9)), min_size=1, max_size=12),
    st.sampled_from([0.1, 0.3, 1.0]),
    st.sampled_from([None, 1.0, 60.0]),
)
def test_estimates_decay_by_samples_and_by_time_as_their_weights_say(
    steps: list[tuple[float, float]], alpha: float, half_life: float | None
) -> None:
    clock = Clock()
    model = bsr.CostModel(alpha=alpha, half_life_s=half_life, clock=clock)
    samples = []
    for dt, rate in steps:
        clock.now += dt
        model.observe_read("t", int(rate), 1.0)
        model.observe_prefill(int(rate), 1.0)
        samples.append((clock.now, float(int(rate))))
    want = model_estimate(samples, alpha, half_life)
    assert model.read_rate("t") == pytest.approx(want, rel=1e-9)
    assert model.prefill_rate == pytest.approx(want, rel=1e-9)


@st.composite
def decision_runs(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    return draw(st.sampled_from([0, 1, 2, 3, 16])), draw(st.lists(cases(), max_size=40))


@settings(max_examples=150, deadline=None)
@given(decision_runs())
def test_every_nth_decision_that_loads_less_than_the_prefix_is_a_probe(run) -> None:  # type: ignore[no-untyped-def]
    """Against a brute-force model: the cheapest prefix (the longest on a tie), except that
    the ``probe_every``-th decision (counted over the model's life) that would load less than
    the whole probed prefix, all of it loadable, loads it all."""
    probe_every, decisions = run
    model = bsr.CostModel(alpha=1.0, probe_every=probe_every, half_life_s=None)
    avoided = probes = 0
    for layout, holders, rates, prefill, start in decisions:
        for t, r in rates.items():  # alpha 1: each sample is the estimate
            model.observe_read(t, int(r), 1.0)
        model.observe_prefill(int(prefill), 1.0)
        d = model.decide(layout, probe_of(layout, holders), start_tokens=start)
        p, s = len(holders), min(start // 32, len(holders))
        if p <= s:
            assert d.choice == "empty"
            continue
        costs = {
            k: model_cost(layout, holders, rates, int(prefill), start, k) for k in range(s, p + 1)
        }
        best = min(costs.values())
        k = max(k for k, c in costs.items() if math.isclose(c, best, rel_tol=1e-9, abs_tol=1e-12))
        if k < p and math.isfinite(costs[p]):
            avoided += 1
            if probe_every and avoided % probe_every == 0:
                probes += 1
                assert d.choice == "probe" and d.load_chunks == p and d.loads, d
                assert d.load_s == d.full_load_s and d.recompute_s == 0.0
                continue
        assert d.choice == ("load" if k == p else "recompute" if k == s else "partial"), d
        assert d.load_chunks == k
    stats = model.statistics()
    assert (stats.avoided, stats.probes) == (avoided, probes)


def slow_and_fast(model: bsr.CostModel) -> tuple[bsr.StateLayout, bsr.Probe]:
    """A four-chunk prefix in tier "t"; recomputing it takes 1 s (1,024 tokens/s)."""
    layout = bsr.StateLayout(chunk_tokens=256, groups=(bsr.StateGroup("kv", 2, 256),))
    model.observe_prefill(1024, 1.0)
    return layout, probe_of(layout, [{"kv": ("t",)}] * 4)


def test_a_tier_that_stays_slow_is_probed_once_in_probe_every_decisions() -> None:
    """The probing share is bounded and exact: 62 of 1,000 decisions (1 in 16) load the slow
    tier, each measuring it slow again; the other 938 recompute. Never with probe_every=0."""
    for every, want in ((16, 1000 // 16), (0, 0)):
        model = bsr.CostModel(probe_every=every)
        layout, probe = slow_and_fast(model)
        nbytes = 4 * layout.group_chunk_bytes("kv")
        model.observe_read("t", nbytes, 10.0)  # loading takes 10 s: recompute
        probed = []
        for i in range(1000):
            d = model.decide(layout, probe)
            if d.loads:
                assert d.choice == "probe" and d.load_chunks == 4
                probed.append(i + 1)
                model.observe_read("t", nbytes, 10.0)  # the probe's restore: still slow
            else:
                assert d.choice == "recompute"
        assert probed == list(range(every, 1001, every) if every else [])
        assert len(probed) == want and model.statistics().probes == want


@pytest.mark.parametrize(
    ("fast_s", "pause_s", "within"),
    [
        (0.1, 0.0, 16),  # 10x faster than recomputing: one probe's sample is enough
        # a close race: 2x faster than recomputing; after one probe the estimate says loading
        # takes 1.49 s (0.7 of the slow sample left), after two 0.94 s
        (0.5, 0.0, 32),
        (0.5, 600.0, 16),  # the same race ten half-lives later: the slow sample weighs 0.07%
    ],
)
def test_a_tier_fast_again_is_loaded_again_within_n_decisions(
    fast_s: float, pause_s: float, within: int
) -> None:
    clock = Clock()
    model = bsr.CostModel(clock=clock)
    layout, probe = slow_and_fast(model)
    nbytes = 4 * layout.group_chunk_bytes("kv")
    model.observe_read("t", nbytes, 10.0)  # one slow restore: loading looks 10x too slow
    clock.now += pause_s
    first_load = None
    for i in range(1, 100):
        d = model.decide(layout, probe)
        if d.loads:
            model.observe_read("t", nbytes, fast_s)  # the tier is fast again
            if d.choice == "load":
                first_load = first_load or i
        else:
            assert d.choice == "recompute"
        if first_load is not None:
            assert d.choice == "load", (i, d)  # and stays chosen
    assert first_load == within + 1  # the probe at `within`, loads from the next one on


# --------------------------------------------------------------------------- a slow spell, e2e
SPELL_S = 0.5  # the spell's latency per read: loading 4 chunks takes at least this long
PREFILL = 5000.0  # tokens/s: recomputing the 1,024 tokens takes 0.2 s


@asynccontextmanager
async def spell_engine(
    tmp_path: Path,
) -> AsyncIterator[tuple[bsr.RestoreEngine, LatencyTier, list[int], bsr.StateLayout]]:
    """An open engine (policy "cost") over a file tier slowed by SPELL_S per read, holding a
    4-chunk prefix; its prefill rate is given (PREFILL), its read rate is measured."""
    chunk = 256
    layout = bsr.StateLayout(chunk_tokens=chunk, groups=(bsr.StateGroup("kv", 2, 256),))
    tier = LatencyTier(bsr.FileTier(tmp_path / "l2", 1 << 24), read_latency_s=SPELL_S, name="t")
    toks = tokens_for(4 * chunk)
    async with make_engine(layout, [tier], io_depth=2, policy="cost") as eng:
        await eng.save(toks, filled_cache(layout, 64, 32, seed=1), shuffled_blocks(64, 32, seed=2))
        eng.cost.observe_prefill(int(PREFILL), 1.0)
        yield eng, tier, toks, layout


@pytest.mark.anyio
async def test_a_tier_fast_again_after_a_slow_spell_is_loaded_again(tmp_path: Path) -> None:
    """A cold start: the tier's first read is slow (0.5 s per read: the 4 chunks look slower
    to load than the 0.2 s of recomputing them), then it is fast again (a file read, ~1 ms).
    Before, the next 40 requests all recomputed (the tier was never read again). Now the 16th
    decision probes it (loads the whole prefix, measured fast) and from the 17th every request
    loads: N = probe_every = 16. Requests go the server's way: a lookup decides, the restore
    given that probe carries the decision out. The margins are wide both ways (the spell's
    reads cannot be faster than their sleep; a fast load would have to take over 60 ms to
    lose)."""
    every = 16  # the default probe_every
    async with spell_engine(tmp_path) as (eng, tier, toks, layout):

        async def request() -> bsr.RestoreResult:
            probe = await eng.lookup(toks)
            dst = bsr.PagedKVCache(layout, 64, 32)
            return await eng.restore(toks, dst, shuffled_blocks(64, 32, seed=3), probe=probe)

        cold = await request()
        assert cold.decision is not None and cold.decision.choice == "unmeasured"
        assert cold.committed_tokens == len(toks)  # loaded, measured slow
        tier.read_latency_s = 0.0  # the spell is over
        choices = []
        for _ in range(40):
            r = await request()
            assert r.decision is not None
            choices.append(r.decision.choice)
            assert r.committed_tokens == (len(toks) if r.decision.loads else 0)
        assert choices == ["recompute"] * (every - 1) + ["probe"] + ["load"] * (40 - every), choices
        assert eng.cost.probe_every == every and eng.cost.statistics().probes == 1


@pytest.mark.anyio
async def test_a_tier_that_stays_slow_is_read_once_in_probe_every_requests(
    tmp_path: Path,
) -> None:
    """The same tier, slow throughout: of 32 requests after the cold start, exactly the 16th
    and the 32nd read it (and measure it slow again); the other 30 recompute and read nothing."""
    every = 16  # the default probe_every
    async with spell_engine(tmp_path) as (eng, _tier, toks, layout):
        read = []
        for i in range(1 + 2 * every):
            dst = bsr.PagedKVCache(layout, 64, 32)
            r = await eng.restore(toks, dst, shuffled_blocks(64, 32, seed=3))
            assert r.decision is not None
            if r.bytes_by_tier:
                read.append((i, r.decision.choice))
        assert read == [(0, "unmeasured"), (every, "probe"), (2 * every, "probe")]
        stats = eng.cost.statistics()
        assert (stats.avoided, stats.probes) == (2 * every, 2)
        # measured, and still slow: loading looks no faster than a read's sleep
        assert 4 * layout.group_chunk_bytes("kv") / stats.read_rates["t"] >= SPELL_S


@pytest.mark.anyio
async def test_a_probe_on_one_rank_is_carried_out_by_every_rank() -> None:
    """Two ranks agree on how much to load (the least). Their probe counters are one decision
    apart (rank 1 decided once more, at a local lookup), so each probes at a request where the
    other recomputes: had the least won, neither probe would ever load. A rank's probe holds
    for every rank: both read their tier at rank 1's 16th decision and at rank 0's."""
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(4 * 16)
    group = bsr.InProcessGroup(2, timeout_s=5)
    engines = [
        make_engine(
            layout, [bsr.HostTier(1 << 24)], policy="cost", coordinator=group.coordinator(r),
            namespace=bsr.Namespace("m", tp_rank=r, tp_size=2),
        )
        for r in range(2)
    ]  # fmt: skip
    async with engines[0], engines[1]:
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(engines[r].save, toks, filled_cache(layout, 8, 16, seed=r), range(4))
        for eng in engines:  # judged slow: 1 byte/s, recomputing takes 64 ms
            eng.cost.alpha = 1.0  # (each sample replaces the estimate: the test's own stays)
            eng.cost.observe_read("host", 1, 1.0)
            eng.cost.observe_prefill(1000, 1.0)
        lone = await engines[1].lookup(toks, local=True)  # rank 1's counter: one ahead
        assert lone.decision is not None and lone.decision.choice == "recompute"
        loaded: list[list[int]] = [[], []]

        async def one(r: int, i: int) -> None:
            res = await engines[r].restore(toks, bsr.PagedKVCache(layout, 8, 16), range(4))
            if res.bytes_by_tier:
                assert res.committed_tokens == len(toks) and res.decision is not None
                assert res.decision.choice == "probe"
                loaded[r].append(i)
                engines[r].cost.observe_read("host", 1, 1.0)  # and judged slow again

        for i in range(1, 17):
            async with anyio.create_task_group() as tg:
                for r in range(2):
                    tg.start_soon(one, r, i)
        assert loaded == [[15, 16], [15, 16]]
        assert [e.cost.statistics().probes for e in engines] == [1, 1]
