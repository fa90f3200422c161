"""The namespace binds the model config (issue 19 item 7): same weights, same model_id, another
``rms_norm_eps`` -> a miss, nothing restored; the same config (another model object) -> a hit.

Real transformers models (a small random Llama, no download). ``twin(model, **changes)`` builds a
second model with exactly the same weights and a config differing only in ``changes``. The
control shows the hazard the binding removes: with a namespace of ``model_id`` alone, the
changed model restores the other config's K/V and commits, and its tokens' logits then differ
from its own never-evicted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import bsr
from adapters.hcache_kit import build, decode_from, forward, max_diff, next_cache, prompt, shuffled
from bsr import hcache, hf
from support.engines import make_engine

transformers = pytest.importorskip("transformers")

CHUNK, BLOCK, NUM_BLOCKS = 32, 8, 64
PREFIX = 4 * CHUNK
PROMPT = PREFIX + 7
MODEL_ID = "tiny-llama@rev1"


def twin(model: Any, **changes: Any) -> Any:
    """The same weights under a config that differs only in ``changes``."""
    cfg = type(model.config).from_dict({**model.config.to_dict(), **changes})
    cfg._attn_implementation = "eager"
    out = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    out.load_state_dict(model.state_dict())
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    a = build("llama", layers=3, kv_heads=2, seed=0)
    assert a.config.rms_norm_eps == 1e-6
    return {"a": a, "same": twin(a), "eps": twin(a, rms_norm_eps=1e-5)}


def test_digest_covers_what_computes_and_nothing_else(models: dict[str, Any]) -> None:
    a, same, eps = models["a"], models["same"], models["eps"]
    d = bsr.model_config_digest(a.config.to_dict())
    assert len(d) == 32 and d == hf.config_digest(a) == hf.config_digest(a.config)
    assert hf.config_digest(same) == d
    assert hf.config_digest(eps) != d
    # the changed config changes the computation: the guard is not about nothing
    toks = prompt(PROMPT)
    with torch.no_grad():
        assert not torch.equal(a(input_ids=toks).logits, eps(input_ids=toks).logits)
        assert torch.equal(a(input_ids=toks).logits, same(input_ids=toks).logits)
    base = a.config.to_dict()
    # names, versions, dtype, kernel and output flags do not change what is computed
    for key, value in [
        ("_name_or_path", "/elsewhere/tiny"),
        ("transformers_version", "0.0.1"),
        ("architectures", ["LlamaForCausalLM"]),
        ("dtype", "bfloat16"),
        ("output_hidden_states", True),
        ("eos_token_id", 7),
    ]:
        assert bsr.model_config_digest({**base, key: value}) == d, key
    # anything else does, nested values included; key order does not
    for key, value in [
        ("rope_parameters", {**base["rope_parameters"], "rope_theta": 500000.0}),
        ("hidden_act", "gelu"),
        ("max_position_embeddings", 4096),
        ("some_future_knob", 1),
    ]:
        assert bsr.model_config_digest({**base, key: value}) != d, key
    assert bsr.model_config_digest(dict(reversed(list(base.items())))) == d
    with pytest.raises(bsr.ConfigError, match=r"config\['x'\]: a object is not a JSON value"):
        bsr.model_config_digest({**base, "x": object()})
    with pytest.raises(bsr.ConfigError, match="mapping"):
        bsr.model_config_digest(42)
    with pytest.raises(bsr.ConfigError, match="config_digest must be a str"):
        bsr.Namespace(MODEL_ID, config_digest=b"ab")  # type: ignore[arg-type]
    # the digest enters the namespace's fingerprint (unset: the fingerprint of old)
    layout = hf.layout_for_config(a.config, chunk_tokens=CHUNK)
    plain = bsr.Namespace(MODEL_ID)
    assert hf.namespace(a, MODEL_ID).fingerprint(layout) != plain.fingerprint(layout)
    assert hf.namespace(a, MODEL_ID) == hf.namespace(same, MODEL_ID)
    assert hf.namespace(eps, MODEL_ID, tp_rank=1, tp_size=2).tp_rank == 1


# --------------------------------------------------------------------------- plain KV (bsr.hf)
def _serve(model: Any, cache: bsr.PagedKVCache, ids: torch.Tensor) -> None:
    with torch.no_grad():
        past = next_cache(forward(model, prompt(PROMPT), None))
    hf.write_kv_to_cache(past, cache, ids, PROMPT, config=model.config)


def _engine(layout: bsr.StateLayout, root: Path, ns: bsr.Namespace) -> bsr.RestoreEngine:
    return make_engine(layout, [bsr.FileTier(root, 1 << 26)], window=2, io_depth=2, namespace=ns)


async def _kv_round_trip(
    saver: Any, restorer: Any, root: Path, ns_of: Any
) -> tuple[bsr.RestoreResult, bsr.PagedKVCache, torch.Tensor]:
    layout = hf.layout_for_config(saver.config, chunk_tokens=CHUNK)
    assert (
        layout.fingerprint == hf.layout_for_config(restorer.config, chunk_tokens=CHUNK).fingerprint
    )
    n_blocks = -(-PROMPT // BLOCK)
    src_ids, dst_ids = shuffled(NUM_BLOCKS, n_blocks, 1), shuffled(NUM_BLOCKS, n_blocks, 2)
    src = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    _serve(saver, src, src_ids)
    dst = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)

    async with _engine(layout, root, ns_of(saver)) as eng:
        assert (await eng.save(prompt(PROMPT)[0], src, src_ids)).ok
    async with _engine(layout, root, ns_of(restorer)) as eng:
        return await eng.restore(prompt(PROMPT)[0], dst, dst_ids), dst, dst_ids


@pytest.mark.anyio
async def test_kv_saved_under_another_config_is_a_miss(
    models: dict[str, Any], tmp_path: Path
) -> None:
    r, dst, _ = await _kv_round_trip(
        models["a"], models["eps"], tmp_path, lambda m: hf.namespace(m, MODEL_ID)
    )
    assert r.state is bsr.RequestState.COMMITTED and r.reason is bsr.Reason.EMPTY_PREFIX
    assert r.committed_tokens == 0 and r.probed_tokens == 0 and r.bytes_by_tier == {}
    assert not dst.tensor("kv").any()  # nothing restored


@pytest.mark.anyio
async def test_kv_saved_under_the_same_config_is_a_hit(
    models: dict[str, Any], tmp_path: Path
) -> None:
    same = models["same"]
    r, dst, dst_ids = await _kv_round_trip(
        models["a"], same, tmp_path, lambda m: hf.namespace(m, MODEL_ID)
    )
    assert r.committed and r.committed_tokens == PREFIX
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, PREFIX, same.config)
    toks = prompt(PROMPT)
    got = decode_from(same, toks, PREFIX, rebuilt)
    # the never-evicted run of the model that saved, with the same prefill split
    with torch.no_grad():
        past = next_cache(forward(models["a"], toks[:, :PREFIX], None))
    want = decode_from(models["a"], toks, PREFIX, past)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.anyio
async def test_control_model_id_alone_serves_the_other_configs_kv(
    models: dict[str, Any], tmp_path: Path
) -> None:
    """What the binding prevents: without it the changed model commits the other config's K/V,
    and its next-token logits differ from its own never-evicted run."""
    eps = models["eps"]
    r, dst, dst_ids = await _kv_round_trip(
        models["a"], eps, tmp_path, lambda m: bsr.Namespace(MODEL_ID)
    )
    assert r.committed and r.committed_tokens == PREFIX
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, PREFIX, eps.config)
    toks = prompt(PROMPT)
    with torch.no_grad():
        own = next_cache(forward(eps, toks[:, :PREFIX], None))  # its own state, same split
    assert (
        max_diff(decode_from(eps, toks, PREFIX, rebuilt), decode_from(eps, toks, PREFIX, own)) > 0
    )


# --------------------------------------------------------------------------- HCache
PLAN = ["hidden", "hidden", "kv"]


def _hc(model: Any) -> hcache.HCache:
    plan = hcache.fixed_plan(model.config, PLAN, group_layers=1)
    return hcache.HCache(model, plan, chunk_tokens=CHUNK)


async def _hc_save(hc: hcache.HCache, root: Path) -> None:
    n_blocks = -(-PROMPT // BLOCK)
    src_ids = shuffled(NUM_BLOCKS, n_blocks, 1)
    kv = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
    store = hc.hidden_store(NUM_BLOCKS, BLOCK)
    with torch.no_grad(), hc.capture(store, src_ids):
        past = next_cache(forward(hc.model, prompt(PROMPT), None))
    hf.write_kv_to_cache(past, kv, src_ids, PROMPT, config=hc.model.config)

    async with _engine(hc.layout, root, hc.namespace(MODEL_ID)) as eng:
        assert (await hc.save(eng, prompt(PROMPT)[0, :PREFIX], kv, store, src_ids)).ok


async def _hc_restore(
    hc: hcache.HCache, root: Path, ns: bsr.Namespace
) -> tuple[hcache.HCacheRestore, bsr.PagedKVCache, torch.Tensor]:
    dst_ids = shuffled(NUM_BLOCKS, -(-PROMPT // BLOCK), 2)
    dst = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)

    async with _engine(hc.layout, root, ns) as eng:
        return await hc.restore(eng, prompt(PROMPT)[0], dst, dst_ids), dst, dst_ids


@pytest.mark.anyio
async def test_hcache_state_of_another_config_is_a_miss_or_refused(
    models: dict[str, Any], tmp_path: Path
) -> None:
    await _hc_save(_hc(models["a"]), tmp_path)
    hc_eps = _hc(models["eps"])
    res, dst, _ = await _hc_restore(hc_eps, tmp_path, hc_eps.namespace(MODEL_ID))
    assert res.committed_tokens == 0 and res.engine is not None
    assert res.engine.probed_tokens == 0 and res.engine.bytes_by_tier == {}
    assert not dst.tensor("kv").any()
    # an engine bound to another config (or to none) is refused before anything moves
    for ns in (_hc(models["a"]).namespace(MODEL_ID), bsr.Namespace(MODEL_ID)):
        with pytest.raises(bsr.ConfigError, match="config digest"):
            await _hc_restore(hc_eps, tmp_path, ns)


@pytest.mark.anyio
async def test_hcache_state_of_the_same_config_is_a_hit(
    models: dict[str, Any], tmp_path: Path
) -> None:
    await _hc_save(_hc(models["a"]), tmp_path)
    same = models["same"]
    hc = _hc(same)
    res, dst, dst_ids = await _hc_restore(hc, tmp_path, hc.namespace(MODEL_ID))
    assert res.committed_tokens == PREFIX and res.reason is None
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, PREFIX, same.config)
    toks = prompt(PROMPT)
    got = decode_from(same, toks, PREFIX, rebuilt)
    want = decode_from(models["a"], toks, 0, None)
    assert max_diff(got, want) <= 1e-5  # hidden states are rebuilt into K/V by a GEMM
