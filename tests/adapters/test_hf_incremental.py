"""Appending K/V and hidden states from a token offset (a multi-turn server's writes).

A random Llama serves two turns and three decode steps. After each forward only the new tokens
are written (``start=`` the tokens already written). The paged cache must then equal a single
write of the whole history (the independent reference), and rows before ``start`` must be left
exactly as they were.
"""

from __future__ import annotations

import pytest
import torch

import bsr
from adapters.hcache_kit import build, forward, next_cache, prompt, shuffled
from bsr import hcache, hf

pytest.importorskip("transformers")

CHUNK, BLOCK, NUM_BLOCKS = 32, 8, 32


def test_kv_appended_turn_by_turn_equals_one_whole_write() -> None:
    model = build("llama", kv_heads=2)
    layout = hf.layout_for_config(model.config, chunk_tokens=CHUNK)
    ids = shuffled(NUM_BLOCKS, 12, seed=1)
    turns = prompt(70)
    appended = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    past, written = None, 0
    with torch.no_grad():
        for lo, hi in ((0, 41), (41, 70)):  # two turns
            out = forward(model, turns[:, lo:hi], past)
            past = next_cache(out)
            hf.write_kv_to_cache(past, appended, ids, hi, config=model.config, start=written)
            written = hi
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):  # decode steps append one token each
            out = forward(model, tok, past)
            past = next_cache(out)
            hf.write_kv_to_cache(
                past, appended, ids, written + 1, config=model.config, start=written
            )
            written += 1
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
    whole = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    hf.write_kv_to_cache(past, whole, ids, written, config=model.config)
    assert written == 73
    assert torch.equal(appended.tensor("kv"), whole.tensor("kv"))


def test_start_leaves_earlier_rows_alone_and_is_checked() -> None:
    model = build("llama", kv_heads=2)
    layout = hf.layout_for_config(model.config, chunk_tokens=CHUNK)
    ids = shuffled(NUM_BLOCKS, 8, seed=2)
    with torch.no_grad():
        past = next_cache(forward(model, prompt(40), None))
    cache = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    cache.tensor("kv").fill_(0xAB)
    hf.write_kv_to_cache(past, cache, ids, 40, config=model.config, start=20)
    typed = cache.tensor("kv")
    early = typed[:, ids[:2]]  # tokens 0-15: untouched
    assert bool((early == 0xAB).all())
    assert not bool((typed[:, ids[3]] == 0xAB).all())  # tokens 24-31 written
    # token rows 16-19 (block 2, rows 0-3) untouched, 20-23 written
    assert bool((typed[:, ids[2], :4] == 0xAB).all()) and not bool(
        (typed[:, ids[2], 4:] == 0xAB).all()
    )
    for bad in (-1, 41, True):
        with pytest.raises(bsr.ConfigError, match="start"):
            hf.write_kv_to_cache(past, cache, ids, 40, config=model.config, start=bad)


def test_hidden_states_appended_from_an_offset() -> None:
    model = build("llama", kv_heads=4)
    layout = hcache.hidden_layout(model.config, chunk_tokens=CHUNK)
    ids = shuffled(NUM_BLOCKS, 8, seed=3)
    toks = prompt(50)
    L = model.config.num_hidden_layers
    with torch.no_grad():
        full = model(input_ids=toks, output_hidden_states=True).hidden_states[:L]
        first = model(input_ids=toks[:, :30], output_hidden_states=True, use_cache=True)
        second = forward(model, toks[:, 30:], next_cache(first), output_hidden_states=True)
    appended = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    hcache.write_hidden_to_cache(first.hidden_states[:L], appended, ids, 30)
    hcache.write_hidden_to_cache(second.hidden_states[:L], appended, ids, 50, start=30)
    whole = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    hcache.write_hidden_to_cache(full, whole, ids, 50)
    got, want = appended.typed("hidden"), whole.typed("hidden")
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    # offset=0: the tensors hold the whole history, only [40, 50) is written
    part = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    hcache.write_hidden_to_cache(full, part, ids, 50, start=40, offset=0)
    blocks, rows = ids[torch.arange(40, 50) // BLOCK], torch.arange(40, 50) % BLOCK
    assert torch.equal(part.typed("hidden")[:, blocks, rows], want[:, blocks, rows])
    assert int(part.tensor("hidden")[:, ids[:5]].count_nonzero()) == 0
    with pytest.raises(bsr.ConfigError, match="offset=30 is after start=20"):
        hcache.write_hidden_to_cache(second.hidden_states[:L], part, ids, 50, start=20, offset=30)
    with pytest.raises(bsr.ConfigError, match=r"need \[30, 60\)"):
        hcache.write_hidden_to_cache(second.hidden_states[:L], part, ids, 60, start=30)


def test_capture_hooks_append_turns_and_decode_steps_like_one_full_forward() -> None:
    """Hooks capture (no second forward) what output_hidden_states of one full pass gives."""
    model = build("llama", layers=4, kv_heads=4)
    plan = hcache.fixed_plan(model.config, ["hidden", "hidden", "hidden", "kv"])
    hc = hcache.HCache(model, plan, chunk_tokens=CHUNK)
    ids = shuffled(NUM_BLOCKS, 12, seed=4)
    store = hc.hidden_store(NUM_BLOCKS, BLOCK)
    toks = prompt(60)
    cap = hc.capture(store, ids[:6])  # 48 tokens' worth of blocks at first
    with torch.no_grad(), cap:
        past = next_cache(forward(model, toks[:, :40], None))  # turn 1
        cap.set_block_ids(ids)  # the request grew
        past = next_cache(forward(model, toks[:, 40:57], past))  # turn 2
        for t in range(57, 60):  # decode steps
            past = next_cache(forward(model, toks[:, t : t + 1], past))
    assert cap.tokens == 60 and cap.report is not None and cap.report.ok
    with torch.no_grad():
        want = model(input_ids=toks, output_hidden_states=True).hidden_states
    n = torch.arange(60)
    got = store.typed("hidden")[:, ids[n // BLOCK], n % BLOCK]
    for j, layer in enumerate(plan.layers("hidden")):
        assert torch.allclose(got[j], want[layer][0], atol=1e-5, rtol=0), j
    # a forward past the block table is refused before anything is written
    small = hc.capture(store, ids[:2])
    with pytest.raises(bsr.ConfigError, match="set_block_ids"), torch.no_grad(), small:
        forward(model, toks[:, :20], None)
