"""HCache-style restoration: store hidden states, rebuild K/V with the model's projections.

A random MHA Llama (hidden states are half the K+V bytes) prefills a prompt; every layer's input
hidden state is saved through a RestoreEngine, restored through the bounded window into a fresh
paged cache, and K/V are rebuilt with ``bsr.hcache.rebuild_kv``. Decoding from the rebuilt cache
must match the never-evicted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import bsr
from adapters.hcache_kit import decode_from
from bsr import hcache, hf

transformers = pytest.importorskip("transformers")

CHUNK = 32
BLOCK = 8
PREFIX = 4 * CHUNK
PROMPT = PREFIX + 11
NUM_BLOCKS = 48


def llama(kv_heads: int) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_planner_picks_the_smaller_state() -> None:
    mha = hcache.compare_state_bytes(llama(4).config)
    assert mha.method == "hidden" and mha.hidden_to_kv == 0.5
    gqa = hcache.compare_state_bytes(llama(1).config)  # 1 KV head: K+V is half the hidden state
    assert gqa.method == "kv" and gqa.hidden_to_kv == 2.0
    llama3_8b = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32
    )
    s = hcache.compare_state_bytes(llama3_8b, dtype=torch.bfloat16)
    assert (s.hidden_bytes, s.kv_bytes) == (8192, 4096) and not s.prefer_hidden


@pytest.mark.anyio
async def test_hidden_state_restore_decodes_like_the_never_evicted_run(tmp_path: Path) -> None:
    model = llama(4)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    layout = hcache.hidden_layout(model.config, chunk_tokens=CHUNK)
    kv_layout = hf.layout_for_config(model.config, chunk_tokens=CHUNK)
    assert layout.chunk_bytes * 2 == kv_layout.chunk_bytes  # half the bytes to move
    with torch.no_grad():
        out = model(input_ids=prompt, output_hidden_states=True)
    reference = decode_from(model, prompt, 0, None)
    src = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    src_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))[
        : -(-PROMPT // BLOCK)
    ]
    hcache.write_hidden_to_cache(
        out.hidden_states[: model.config.num_hidden_layers], src, src_ids, PREFIX
    )
    dst_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(2))[
        : -(-PROMPT // BLOCK)
    ]
    dst = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)

    async def main() -> bsr.RestoreResult:
        engine = bsr.RestoreEngine(
            layout,
            [bsr.FileTier(tmp_path, 1 << 26)],
            window=2,
            io_depth=2,
            namespace=bsr.Namespace("hcache-test"),
        )
        async with engine:
            await engine.save(prompt[0, :PREFIX], src, src_ids)
            return await engine.restore(prompt[0], dst, dst_ids)

    result = await main()
    assert result.committed_tokens == PREFIX
    assert result.bytes_by_tier == {"file": 4 * layout.chunk_bytes}
    assert result.rws_peak_bytes == 2 * layout.slot_bytes
    rebuilt = hcache.rebuild_kv(model, dst, dst_ids, PREFIX)
    got = decode_from(model, prompt, PREFIX, rebuilt)
    for a, b in zip(got, reference):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))

    # sensitivity: a damaged hidden state changes the logits well beyond the tolerance
    dst.typed(hcache.HIDDEN_GROUP)[1][dst_ids[3], 2] += 1.0
    damaged = decode_from(model, prompt, PREFIX, hcache.rebuild_kv(model, dst, dst_ids, PREFIX))
    assert max((a - b).abs().max().item() for a, b in zip(damaged, reference)) > 1e-4


def test_rejects_unsupported_models_and_mismatches() -> None:
    cfg = transformers.MistralConfig(
        sliding_window=64,
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with pytest.raises(hcache.UnsupportedModelError, match="sliding_window"):
        hcache.hidden_layout(cfg)
    model = llama(4)
    layout = hcache.hidden_layout(model.config, chunk_tokens=CHUNK, dtype=torch.float16)
    cache = bsr.PagedKVCache(layout, 8, BLOCK)
    hs = [torch.zeros(1, CHUNK, 64) for _ in range(3)]  # float32: wrong dtype
    with pytest.raises(bsr.LayoutError, match="hidden_layout"):
        hcache.write_hidden_to_cache(hs, cache, list(range(4)), CHUNK)
    with pytest.raises(bsr.ConfigError, match="output_hidden_states"):
        hcache.write_hidden_to_cache(hs[:1], cache, list(range(4)), CHUNK)
