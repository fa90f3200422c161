"""hcache.plan_layers: the per-layer split against an independent brute-force model.

The cost model is re-derived here from the docstring's formulas (bytes / bandwidth for stored
layers, tokens x layers x seconds for projection and recompute; sequential or overlapped) and
every split is enumerated; the planner must find the minimum, never lose to a pure plan, and pick
the split the rates call for: KV on a CPU-like machine (projection slower than the read it
replaces), hidden states (plus recomputed first layers) on a GPU-like one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from adapters.hcache_kit import build
from bsr import hcache

transformers = pytest.importorskip("transformers")


def config(kv_heads: int, layers: int = 8, hidden: int = 1024) -> object:
    return transformers.LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=16,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
    )


CPU = hcache.Rates(
    read_bytes_per_s=2e9, project_s_per_token_layer=2e-5, recompute_s_per_token_layer=3e-4
)
GPU = hcache.Rates(
    read_bytes_per_s=6e9, project_s_per_token_layer=2e-7, recompute_s_per_token_layer=3e-6
)


def brute(cfg: object, n: int, rates: hcache.Rates, overlap: bool, g: int = 4) -> float:
    """The fastest split under the documented timing model, by enumeration."""
    L, hid = cfg.num_hidden_layers, cfg.hidden_size  # type: ignore[attr-defined]
    kvd = cfg.num_key_value_heads * (hid // cfg.num_attention_heads)  # type: ignore[attr-defined]
    hb, kb = 4 * hid, 8 * kvd
    best = float("inf")
    for r in range(L):
        for h in range(L - r + 1):
            io = n * (h * hb + (L - r - h) * kb) / rates.read_bytes_per_s
            proj = n * h * rates.project_s_per_token_layer
            rec = n * r * rates.recompute_s_per_token_layer
            if rates.shared:
                t = io + rec + proj
            elif overlap:
                t = max(io, rec + proj + n * min(g, h) * hb / rates.read_bytes_per_s)
            else:
                t = max(io, rec) + proj
            best = min(best, t)
    return best


@settings(max_examples=60, deadline=None)
@given(
    kv_heads=st.sampled_from([16, 8, 4, 1]),
    layers=st.integers(1, 12),
    n=st.integers(1, 16384),
    read=st.floats(1e8, 1e11),
    proj=st.floats(1e-9, 1e-4),
    rec=st.floats(1e-9, 1e-3),
    overlap=st.booleans(),
    shared=st.booleans(),
)
def test_the_plan_is_the_brute_force_minimum(
    kv_heads: int,
    layers: int,
    n: int,
    read: float,
    proj: float,
    rec: float,
    overlap: bool,
    shared: bool,
) -> None:
    cfg = config(kv_heads, layers)
    rates = hcache.Rates(read, proj, rec, shared=shared)
    plan = hcache.plan_layers(cfg, n, rates, overlap=overlap)
    want = brute(cfg, n, rates, overlap)
    assert plan.cost.total_s == pytest.approx(want, rel=1e-9)
    for pure in ("all kv", "all hidden"):
        assert plan.cost.total_s <= plan.pure[pure].total_s * (1 + 1e-9)
    assert len(plan.methods) == layers
    order = {"recompute": 0, "hidden": 1, "kv": 2}
    assert [order[m] for m in plan.methods] == sorted(order[m] for m in plan.methods)


def test_cpu_like_rates_keep_kv_and_gpu_like_rates_use_hidden_states() -> None:
    mha = config(16)
    cpu = hcache.plan_layers(mha, 4096, CPU, overlap=False)  # HCache(pipeline=False)
    assert cpu.methods == ("kv",) * 8  # projection 10x slower than the read it replaces
    assert hcache.plan_layers(mha, 4096, GPU).overlap  # the default models the pipelined HCache
    gpu = hcache.plan_layers(mha, 4096, GPU, overlap=True)
    assert gpu.layers("hidden") and gpu.cost.total_s < gpu.pure["all kv"].total_s
    assert gpu.cost.bytes < gpu.pure["all kv"].bytes
    # the overlapped model on CPU rates: a few hidden layers hide under the KV reads
    split = hcache.plan_layers(mha, 4096, CPU, overlap=True)
    assert 0 < len(split.layers("hidden")) < 8 and split.cost.total_s < split.pure["all kv"].total_s


def test_gqa_never_stores_hidden_states_larger_than_its_kv() -> None:
    gqa = config(4)  # K+V = 512 values per token and layer, hidden = 1024
    for rates in (CPU, GPU):
        for overlap in (False, True):
            assert not hcache.plan_layers(gqa, 4096, rates, overlap=overlap).layers("hidden")


def test_plan_prints_and_builds_the_mixed_layout() -> None:
    plan = hcache.fixed_plan(
        config(16), ["recompute"] + ["hidden"] * 5 + ["kv"] * 2, group_layers=2
    )
    layout = plan.layout(chunk_tokens=64)
    assert [(g.name, g.num_layers, g.token_bytes) for g in layout.groups] == [
        ("kv", 2, 8 * 1024),
        ("hidden.0", 2, 4 * 1024),
        ("hidden.1", 2, 4 * 1024),
        ("hidden.2", 1, 4 * 1024),
    ]
    text = str(hcache.plan_layers(config(16), 1024, CPU, overlap=False))
    assert "kv 0-7" in text and "all hidden" in text and "GB/s" in text
    with pytest.raises(bsr.ConfigError, match="recompute"):
        hcache.fixed_plan(config(16, layers=2), ["recompute", "recompute"]).layout()
    with pytest.raises(bsr.ConfigError, match="first"):
        hcache.fixed_plan(config(16, layers=2), ["kv", "hidden"])
    with pytest.raises(bsr.ConfigError, match="Rates"):
        hcache.plan_layers(config(16), 10, "fast")  # type: ignore[arg-type]
    with pytest.raises(bsr.ConfigError, match="read_bytes_per_s"):
        hcache.Rates(0.0, 1e-6, 1e-6)


def test_calibration_measures_once_and_is_cached(tmp_path: Path) -> None:
    model = build("llama", layers=2)
    rates = hcache.calibrate(model, tokens=64, read_bytes_per_s=1e9)
    assert rates.source == "measured" and rates.read_bytes_per_s == 1e9 and rates.shared  # CPU
    assert rates.project_s_per_token_layer > 0 and rates.recompute_s_per_token_layer > 0
    assert hcache.calibrate(model, tokens=64, read_bytes_per_s=1e9) is rates  # cached
    assert hcache.calibrate(model, tokens=64, read_bytes_per_s=1e9, refresh=True) is not rates
    read = hcache.calibrate(
        model,
        tokens=64,
        read_mib=2,
        tier_factory=lambda p: bsr.HostTier(capacity_bytes=8 << 20),
        tier_name="host",
    )
    assert read.read_bytes_per_s > 1e6  # a real restore through the engine moved the bytes


def test_shared_cores_never_recompute_what_is_cheaper_to_read() -> None:
    """On a CPU-only machine recompute competes with the reads for the cores: no free overlap."""
    mha = config(16)
    # recompute per layer (1e-5 s/token) is cheaper than one KV layer's read (8 KiB at 0.4 GB/s)
    rates = hcache.Rates(
        read_bytes_per_s=4e8, project_s_per_token_layer=1e-3, recompute_s_per_token_layer=1e-5
    )
    independent = hcache.plan_layers(mha, 2048, rates)
    assert independent.layers("recompute")  # hidden under the reads when they overlap
    shared = hcache.plan_layers(mha, 2048, hcache.Rates(4e8, 1e-3, 1e-5, shared=True))
    c = shared.cost
    assert c.total_s == pytest.approx(c.io_s + c.recompute_s + c.project_s)
    # recompute only where it beats the read it replaces, layer for layer
    assert shared.layers("recompute") == tuple(range(8))[: len(shared.layers("recompute"))]
    slow = hcache.plan_layers(mha, 2048, hcache.Rates(4e8, 1e-3, 1e-4, shared=True))
    assert slow.methods == ("kv",) * 8 and "share the cores" in str(slow)
