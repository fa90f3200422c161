"""Every architecture's HCache verdict: restored exactly, or refused with a typed error.

For each supported architecture a tiny random model serves a prompt with capture hooks on, its
hidden states (every layer) are saved through a RestoreEngine, restored into a fresh serving
cache at other blocks and projected into K/V; decoding from there must give the never-evicted
run's logits (fp32, within 1e-5) and greedy tokens. Refused architectures must raise
UnsupportedModelError naming the missing piece, from the config check and from HCache itself.
Negative controls show the self-check and the decode comparison can fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import bsr
from adapters.hcache_kit import build, decode_from, max_diff, prompt, same_tokens, shuffled
from bsr import hcache, hf

pytest.importorskip("transformers")

CHUNK, BLOCK, NUM_BLOCKS = 32, 8, 48
PREFIX = 3 * CHUNK
PROMPT = PREFIX + 9


async def serve_and_restore(
    model: Any, methods: list[str], root: Path
) -> tuple[Any, hcache.HCacheRestore]:
    """Prefill with capture, save the plan's state, restore it elsewhere; return (cache, result)."""
    plan = hcache.fixed_plan(model.config, methods)
    hc = hcache.HCache(model, plan, chunk_tokens=CHUNK)
    toks = prompt(PROMPT)
    n_blocks = -(-PROMPT // BLOCK)
    src_ids, dst_ids = shuffled(NUM_BLOCKS, n_blocks, 1), shuffled(NUM_BLOCKS, n_blocks, 2)
    kv = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
    store = hc.hidden_store(NUM_BLOCKS, BLOCK)
    with torch.no_grad(), hc.capture(store, src_ids) as cap:
        out = model(input_ids=toks, use_cache=True)
    assert cap.tokens == PROMPT and (cap.report is None or cap.report.ok)
    past = getattr(out, "cache", None) or out.past_key_values
    hf.write_kv_to_cache(past, kv, src_ids, PROMPT, config=model.config)
    dst = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)

    engine = bsr.RestoreEngine(
        hc.layout,
        [bsr.FileTier(root, 1 << 26)],
        window=2,
        io_depth=2,
        namespace=hc.namespace("hcache-arch"),
    )
    async with engine:
        await hc.save(engine, toks[0, :PREFIX], kv, store, src_ids)
        res = await hc.restore(engine, toks[0], dst, dst_ids)
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, res.committed_tokens, model.config)
    return rebuilt, res


SUPPORTED = ["llama", "mistral", "qwen2", "gemma", "qwen3", "phi3", "phi3_partial", "olmo2"]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", SUPPORTED)
async def test_supported_architecture_decodes_like_the_never_evicted_run(
    kind: str, tmp_path: Path
) -> None:
    model = build(kind, kv_heads=4 if kind != "qwen2" else 2)
    report = hcache.check_model(model)
    assert report.ok and report.max_error <= report.tolerance
    rebuilt, res = await serve_and_restore(model, ["hidden"] * 3, tmp_path)
    assert res.committed_tokens == PREFIX and res.reason is None
    toks = prompt(PROMPT)
    want = decode_from(model, toks, 0, None)
    got = decode_from(model, toks, PREFIX, rebuilt)
    assert max_diff(got, want) <= 1e-5 and same_tokens(got, want)


@pytest.mark.parametrize(
    ("kind", "missing"),
    [
        ("mistral_sliding", "sliding_window=64"),
        ("deepseek_v3", "MLA"),
        ("gemma2", "sliding-window layers"),
    ],
)
def test_refused_architecture_names_the_missing_piece(kind: str, missing: str) -> None:
    model = build(kind)
    with pytest.raises(hcache.UnsupportedModelError, match=missing):
        hcache.check_config(model.config)
    with pytest.raises(hcache.UnsupportedModelError, match=missing):
        hcache.check_model(model)
    with pytest.raises(bsr.ConfigError, match=missing):  # UnsupportedModelError is a ConfigError
        hcache.hidden_layout(model.config)


def test_unknown_architecture_and_dynamic_rope_are_refused() -> None:
    import transformers as T

    cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4)
    with pytest.raises(hcache.UnsupportedModelError, match="not in the supported table"):
        hcache.check_config(cfg)
    cfg = T.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(hcache.UnsupportedModelError, match="dynamic"):
        hcache.check_config(cfg)


def test_self_check_catches_a_rebuild_that_skips_the_key_norm() -> None:
    """The bug this replaces: Qwen3 accepted without its k_norm decoded wrongly, silently."""
    model = build("qwen3")
    adapter = hcache.ModelAdapter(model)
    for p in adapter._proj:
        p.key_norm = None  # the old rebuild: K straight from k_proj
    from bsr.hcache._verify import compare_rows
    from bsr.hf import _model_layers

    toks = prompt(16)
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, a, kw, i=i: captured.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
            with_kwargs=True,
        )
        for i, layer in enumerate(adapter.layers)
    ]
    with torch.no_grad():
        out = model(input_ids=toks, use_cache=True)
    for h in hooks:
        h.remove()
    past = getattr(out, "cache", None) or out.past_key_values
    kv = [(k[0], v[0]) for k, v, _ in _model_layers(past)]
    report = compare_rows(adapter, [captured[i] for i in range(3)], torch.arange(16), kv)
    assert not report.ok and report.max_error > 100 * report.tolerance


def test_capture_time_check_refuses_saving_on_mismatch() -> None:
    model = build("qwen3")
    plan = hcache.fixed_plan(model.config, ["hidden"] * 3)
    hc = hcache.HCache(model, plan, chunk_tokens=CHUNK)
    for p in hc.adapter._proj:
        p.key_norm = None  # a rebuild that no longer matches this model
    ids = torch.arange(8)
    store = hc.hidden_store(NUM_BLOCKS, BLOCK)
    kv = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
    with torch.no_grad(), hc.capture(store, ids) as cap:
        model(input_ids=prompt(40), use_cache=True)
    assert cap.report is not None and not cap.report.ok
    with pytest.raises(hcache.UnsupportedModelError, match="capture self-check"):
        hc.save_view(kv, store)


@pytest.mark.anyio
async def test_damaged_hidden_state_is_visible_in_the_logits(tmp_path: Path) -> None:
    """Negative control: the decode comparison above can fail."""
    model = build("llama")
    rebuilt, res = await serve_and_restore(model, ["hidden"] * 3, tmp_path)
    assert res.committed_tokens == PREFIX
    toks = prompt(PROMPT)
    want = decode_from(model, toks, 0, None)
    rebuilt.layers[1].keys[0, 0, 5] += 1.0
    got = decode_from(model, toks, PREFIX, rebuilt)
    assert max_diff(got, want) > 1e-4


@pytest.mark.parametrize("kind", SUPPORTED)
def test_bf16_models_pass_the_self_check_on_their_paths(kind: str) -> None:
    """bf16 (what a GPU serves) takes the folded one-GEMM path wherever fp32 does; key norms and
    partial rotary (Qwen3, OLMo2, partial Phi3) the module-by-module one; the self-check holds."""
    model = build(kind, kv_heads=2).to(torch.bfloat16)
    report = hcache.check_model(model)
    assert report.ok and report.tolerance == 3e-2
    adapter = hcache.ModelAdapter(model)
    assert adapter.fast(0, adapter.rope(0, 8)) == (kind not in ("qwen3", "olmo2", "phi3_partial"))
