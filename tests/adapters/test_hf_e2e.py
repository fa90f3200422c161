"""End to end with a real transformers model: evict the KV cache, restore it through bsr, decode.

A small random Llama (GQA) prefills a prompt of five 32-token chunks plus a partial chunk. Its
KV cache is written into a paged cache (8-token blocks at shuffled block ids), saved through a
:class:`bsr.RestoreEngine` (window W=2, smaller than the five chunks) into a HostTier and a
FileTier, restored into a fresh paged cache at other shuffled block ids, rebuilt into a
``DynamicCache`` for the committed prefix; the model then prefills the partial chunk and decodes.
Every next-token logit vector must be bit-identical (``torch.equal``) to the never-evicted run's
(one full prefill of the prompt, then greedy decoding).

Negative controls show the comparison can fail: a corrupt object with no fallback tier
invalidates the restore (zero reuse), and corrupting or permuting restored cache bytes changes
the logits. A hybrid model (Qwen2 with full and sliding-window layers) runs the same round trip
through two state groups (``kv`` and ``swa_kv``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import bsr
from bsr import hf
from bsr.testing import corrupt_stored
from support.engines import make_engine

transformers = pytest.importorskip("transformers")

CHUNK = 32
BLOCK = 8
PROMPT_TOKENS = 5 * CHUNK + 13  # five full chunks and a partial one
PREFIX = 5 * CHUNK  # what bsr stores and restores
PROMPT_BLOCKS = -(-PROMPT_TOKENS // BLOCK)
DECODE_STEPS = 4
NUM_BLOCKS = 64
VOCAB = 512
WINDOW = 2  # staging slots: fewer than the chunks restored, so slots are reused
COMMITTED = bsr.RequestState.COMMITTED
INVALIDATED = bsr.RequestState.INVALIDATED


# --------------------------------------------------------------------------- model plumbing
def _forward(model: Any, ids: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
    """One forward with a cache; transformers 5.x names the argument ``cache``, 4.x
    ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **{kw: past})
    new_past = getattr(out, "cache", None)
    if new_past is None:
        new_past = out.past_key_values
    return out.logits[:, -1].clone(), new_past


def decode(
    model: Any, last: torch.Tensor, past: Any, steps: int = DECODE_STEPS
) -> list[torch.Tensor]:
    """Greedy decoding from ``last`` logits: the logits after each decoded token."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            last, past = _forward(model, last.argmax(-1, keepdim=True), past)
            out.append(last)
    return out


def continue_decoding(
    model: Any, prompt: torch.Tensor, start: int, past: Any
) -> list[torch.Tensor]:
    """Prefill ``prompt[start:]`` on top of ``past`` (None: a fresh cache), then decode.

    Returns the next-token logits after the prompt and after each decoded token.
    """
    with torch.no_grad():
        last, past = _forward(model, prompt[:, start:], past)
    return [last, *decode(model, last, past)]


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) == DECODE_STEPS + 1
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {step}: max |diff| {(g - w).abs().max().item()}"


def assert_matches_never_evicted(
    model: Any, prompt: torch.Tensor, start: int, got: list[torch.Tensor], full: list[torch.Tensor]
) -> None:
    """``got`` (continued from a restored ``start``-token prefix) must equal, bit for bit:

    1. the never-evicted run with the same prefill split (prefill ``prompt[:start]``, then the
       rest on the same cache): same kernels on same shapes, so only bsr can make them differ;
    2. the never-evicted run with one full prefill (``full``). On CPU the GEMMs here give the
       same bits whatever the number of query rows, so 1 and 2 agree; if only 2 fails on some
       platform, its kernels are not row-count invariant, which is no bsr defect.
    """
    with torch.no_grad():
        _, past = _forward(model, prompt[:, :start], None)
    assert_same_logits(got, continue_decoding(model, prompt, start, past))
    assert_same_logits(got, full)


def max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def shuffled(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n]


def make_prompt(seed: int = 7) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed)
    )


#: every engine here: the test's window, in the tiny model's namespace
ENGINE: dict[str, Any] = {"window": WINDOW, "model_id": "tiny-llama"}


def tiers_at(root: Path) -> list[bsr.Tier]:
    """A fresh (empty) host tier over the file tier at ``root``."""
    return [bsr.HostTier(1 << 26), bsr.FileTier(root, 1 << 28, reader="posix")]


async def save_all(
    engine: bsr.RestoreEngine, prompt: torch.Tensor, src: bsr.PagedKVCache, ids: torch.Tensor
) -> bsr.SaveResult:
    result = await engine.save(prompt[0], src, ids)
    assert result.ok, result
    assert result.saved_tokens == PREFIX
    return result


# --------------------------------------------------------------------------- fixtures
@dataclass
class Llama:
    model: Any
    prompt: torch.Tensor
    layout: bsr.StateLayout
    src: bsr.PagedKVCache  # the serving engine's paged cache holding the whole prompt
    src_ids: torch.Tensor
    reference: list[torch.Tensor]  # the never-evicted run


@pytest.fixture(scope="module")
def llama() -> Llama:
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.config._attn_implementation == "eager"
    assert model.dtype == torch.float32
    prompt = make_prompt()
    layout = hf.layout_for_config(model.config, chunk_tokens=CHUNK)
    src_ids = shuffled(PROMPT_BLOCKS, seed=1)
    src = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    # the never-evicted run: one full prefill (its KV goes to the paged cache), then decoding
    with torch.no_grad():
        last, past = _forward(model, prompt, None)
    hf.write_kv_to_cache(past, src, src_ids, PROMPT_TOKENS)
    reference = [last, *decode(model, last, past)]
    return Llama(model, prompt, layout, src, src_ids, reference)


def restored_logits(
    s: Llama, dst: bsr.PagedKVCache, dst_ids: torch.Tensor, tokens: int
) -> list[torch.Tensor]:
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, tokens, s.model.config)
    assert rebuilt.get_seq_length() == tokens
    return continue_decoding(s.model, s.prompt, tokens, rebuilt)


def prefix_blocks_equal(
    s: Llama, dst: bsr.PagedKVCache, dst_ids: torch.Tensor, tokens: int
) -> bool:
    n = tokens // BLOCK
    a = s.src.tensor("kv")[:, s.src_ids[:n]]
    b = dst.tensor("kv")[:, dst_ids[:n]]
    return torch.equal(a, b)


# --------------------------------------------------------------------------- the round trip
@pytest.mark.parametrize("source", ["host", "file"])
@pytest.mark.anyio
async def test_restored_prefix_decodes_bit_identically(
    llama: Llama, tmp_path: Path, source: str
) -> None:
    """Evict, restore into a fresh cache at other blocks, continue: the logits are identical."""
    s = llama
    dst_ids = shuffled(PROMPT_BLOCKS, seed=2)
    assert not torch.equal(dst_ids, s.src_ids)
    dst = bsr.PagedKVCache(s.layout, NUM_BLOCKS, BLOCK)

    async def main() -> bsr.RestoreResult:
        async with make_engine(s.layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            saved = await save_all(engine, s.prompt, s.src, s.src_ids)
            assert saved.objects_written == {"host": 5, "file": 5}
            if source == "host":
                return await engine.restore(s.prompt[0], dst, dst_ids)
        # "file": the process restarted; host DRAM is gone, only the file tier remains
        async with make_engine(s.layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            probe = await engine.lookup(s.prompt[0])
            assert probe.prefix_tokens == PREFIX
            return await engine.restore(s.prompt[0], dst, dst_ids)

    result = await main()
    assert result.state is COMMITTED, result
    assert result.reason is bsr.Reason.COMPLETE
    assert result.committed_tokens == PREFIX
    assert result.bytes_by_tier == {source: 5 * s.layout.chunk_bytes}
    assert 0 < result.rws_peak_bytes <= WINDOW * s.layout.slot_bytes
    assert prefix_blocks_equal(s, dst, dst_ids, PREFIX)
    got = restored_logits(s, dst, dst_ids, result.committed_tokens)
    assert_matches_never_evicted(s.model, s.prompt, PREFIX, got, s.reference)


@pytest.mark.anyio
async def test_corrupt_object_without_fallback_invalidates_then_retry_commits_shorter(
    llama: Llama, tmp_path: Path
) -> None:
    """Host tier gone + one corrupt file object: zero reuse; the retry commits the valid prefix."""
    s = llama
    dst_ids = shuffled(PROMPT_BLOCKS, seed=3)
    dst = bsr.PagedKVCache(s.layout, NUM_BLOCKS, BLOCK)

    async def main() -> tuple[bsr.RestoreResult, bsr.RestoreResult]:
        async with make_engine(s.layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            await save_all(engine, s.prompt, s.src, s.src_ids)
            key = engine.keys(s.prompt[0])[2]
            file_tier = engine.tiers[1]
            assert corrupt_stored(file_tier, key, "kv")
        async with make_engine(
            s.layout, tiers_at(tmp_path / "l2"), **ENGINE
        ) as engine:  # host dropped
            first = await engine.restore(s.prompt[0], dst, dst_ids)
            # the corrupt object is quarantined: a retry probes the two chunks before it
            second = await engine.restore(s.prompt[0], dst, dst_ids)
        return first, second

    first, second = await main()
    assert first.state is INVALIDATED, first
    assert first.committed_tokens == 0
    assert first.probed_tokens == PREFIX
    assert first.reason is bsr.Reason.CORRUPT
    assert first.quarantined == 1
    assert set(first.invalid_block_ids) <= {int(b) for b in dst_ids}
    assert second.state is COMMITTED, second
    assert second.committed_tokens == 2 * CHUNK
    got = restored_logits(s, dst, dst_ids, second.committed_tokens)
    assert_matches_never_evicted(s.model, s.prompt, 2 * CHUNK, got, s.reference)


@pytest.mark.anyio
async def test_truncate_policy_commits_prefix_before_corrupt_chunk(
    llama: Llama, tmp_path: Path
) -> None:
    s = llama
    dst_ids = shuffled(PROMPT_BLOCKS, seed=4)
    dst = bsr.PagedKVCache(s.layout, NUM_BLOCKS, BLOCK)

    async def main() -> bsr.RestoreResult:
        async with make_engine(s.layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            await save_all(engine, s.prompt, s.src, s.src_ids)
            assert corrupt_stored(engine.tiers[1], engine.keys(s.prompt[0])[3], "kv")
        async with make_engine(s.layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            return await engine.restore(s.prompt[0], dst, dst_ids, policy="truncate")

    result = await main()
    assert result.state is COMMITTED, result
    assert result.reason is bsr.Reason.TRUNCATED
    assert result.committed_tokens == 3 * CHUNK
    got = restored_logits(s, dst, dst_ids, result.committed_tokens)
    assert_matches_never_evicted(s.model, s.prompt, 3 * CHUNK, got, s.reference)


@pytest.mark.parametrize("damage", ["value", "stale_block", "block_order"])
@pytest.mark.anyio
async def test_damaged_restored_cache_changes_logits(
    llama: Llama, tmp_path: Path, damage: str
) -> None:
    """The comparison is sensitive to damage in the restored cache.

    ``value``: one K element of one token in layer 0 changed. ``stale_block``: one block-table
    entry points at a block holding nothing. ``block_order``: two blocks of the prefix swapped;
    K carries its rotary position, so attention over the prefix is a permutation-invariant sum
    and only the rounding changes (about 3e-7 here): a tolerance would miss a scrambled block
    table, which is why the round-trip tests demand bit equality.
    """
    s = llama
    dst_ids = shuffled(PROMPT_BLOCKS, seed=5)
    dst = bsr.PagedKVCache(s.layout, NUM_BLOCKS, BLOCK)

    async def main() -> bsr.RestoreResult:
        async with make_engine(s.layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            await save_all(engine, s.prompt, s.src, s.src_ids)
            return await engine.restore(s.prompt[0], dst, dst_ids)

    result = await main()
    assert result.state is COMMITTED
    assert_same_logits(restored_logits(s, dst, dst_ids, PREFIX), s.reference)  # undamaged
    read_ids = dst_ids.clone()
    if damage == "value":
        token = 37  # layer 0, K of head 0, element 0
        dst.typed("kv")[0, dst_ids[token // BLOCK], token % BLOCK, 0] += 0.5
    elif damage == "stale_block":
        unused = sorted(set(range(NUM_BLOCKS)) - {int(b) for b in dst_ids})[0]
        read_ids[4] = unused
    else:
        read_ids[[4, 9]] = read_ids[[9, 4]]
    got = restored_logits(s, dst, read_ids, PREFIX)
    diff = max_diff(got, s.reference)
    assert diff > 0
    if damage != "block_order":
        assert diff > 1e-4


# --------------------------------------------------------------------------- adapter details
def test_layout_for_llama_gqa(llama: Llama) -> None:
    layout = hf.layout_for_config(llama.model.config, chunk_tokens=CHUNK)
    # 2 KV heads x head_dim 32 x (K, V) x 4 bytes
    assert layout.groups == (bsr.StateGroup("kv", num_layers=4, token_bytes=512, dtype="float32"),)
    bf16 = hf.layout_for_config(llama.model.config, dtype=torch.bfloat16)
    assert bf16.chunk_tokens == 256
    assert bf16.groups == (bsr.StateGroup("kv", num_layers=4, token_bytes=256, dtype="bfloat16"),)


def test_layout_for_sliding_configs() -> None:
    mistral = transformers.MistralConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=64,
    )
    (g,) = hf.layout_for_config(mistral, dtype="float16").groups
    assert (g.name, g.num_layers, g.token_bytes, g.window_tokens) == ("swa_kv", 3, 2 * 16 * 2, 64)
    gemma3 = transformers.Gemma3TextConfig(
        hidden_size=64,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=128,
    )
    kv, swa = hf.layout_for_config(gemma3, dtype="bfloat16").groups
    assert (kv.name, kv.num_layers, kv.window_tokens) == ("kv", 2, None)  # layers 5 and 11
    assert (swa.name, swa.num_layers, swa.window_tokens) == ("swa_kv", 10, 128)
    assert kv.token_bytes == swa.token_bytes == 2 * 2 * 32 * 2
    qwen_full = transformers.Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, use_sliding_window=False
    )
    assert hf.layout_for_config(qwen_full).group_names == ("kv",)


@pytest.mark.parametrize(
    "extra",
    [
        {"layer_types": ["full_attention", "chunked_attention"]},
        {"layer_types": ["full_attention", "linear_attention"]},
        {"kv_lora_rank": 512},
    ],
)
def test_unsupported_configs_raise(extra: dict[str, Any]) -> None:
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, hidden_size=64, **extra)
    with pytest.raises(bsr.LayoutError):
        hf.layout_for_config(cfg)


def test_write_rejects_mismatched_cache(llama: Llama) -> None:
    with torch.no_grad():
        _, past = _forward(llama.model, llama.prompt[:, :40], None)
    bf16 = bsr.PagedKVCache(
        hf.layout_for_config(llama.model.config, chunk_tokens=CHUNK, dtype="bfloat16"), 8, BLOCK
    )
    with pytest.raises(bsr.LayoutError):
        hf.write_kv_to_cache(past, bf16, range(5), 40)
    cache = bsr.PagedKVCache(llama.layout, 8, BLOCK)
    with pytest.raises(bsr.ConfigError):
        hf.write_kv_to_cache(past, cache, range(8), 41)  # the model saw only 40 tokens
    with pytest.raises(bsr.BlockTableError):
        hf.write_kv_to_cache(past, cache, range(4), 40)


def test_write_read_round_trip_partial_block(llama: Llama) -> None:
    """45 tokens (not block aligned): DynamicCache and legacy tuples write the same bytes; the
    rebuilt cache holds exactly the model's K/V; rows past the tokens stay untouched."""
    n = 45
    with torch.no_grad():
        _, past = _forward(llama.model, llama.prompt[:, :n], None)
    ids = shuffled(6, seed=9)
    a = bsr.PagedKVCache(llama.layout, NUM_BLOCKS, BLOCK)
    b = bsr.PagedKVCache(llama.layout, NUM_BLOCKS, BLOCK)
    hf.write_kv_to_cache(past, a, ids, n)
    legacy = tuple((layer.keys, layer.values) for layer in past.layers)
    hf.write_kv_to_cache(legacy, b, ids, n, config=llama.model.config)
    assert torch.equal(a.tensor("kv"), b.tensor("kv"))
    # the documented layout: token t of layer l at block ids[t // BLOCK], row t % BLOCK, as
    # [K head 0, K head 1, V head 0, V head 1] of head_dim floats each
    typed = a.typed("kv")
    for layer, t in [(0, 0), (1, 9), (3, 44)]:
        row = typed[layer, ids[t // BLOCK], t % BLOCK].view(2, 2, 32)
        assert torch.equal(row[0], past.layers[layer].keys[0, :, t])
        assert torch.equal(row[1], past.layers[layer].values[0, :, t])
    assert not a.tensor("kv")[:, ids[-1], n % BLOCK :].any()
    rebuilt = hf.read_kv_from_cache(a, ids, n, llama.model.config)
    for src, got in zip(past.layers, rebuilt.layers):
        assert torch.equal(src.keys, got.keys) and torch.equal(src.values, got.values)
    empty = hf.read_kv_from_cache(a, ids, 0, llama.model.config)
    assert empty.get_seq_length() == 0


# --------------------------------------------------------------------------- hybrid model
def _hybrid_qwen2(window: int, layer_types: list[str]) -> Any:
    """A small Qwen2 config mixing sliding-window and full-attention layers."""
    return transformers.Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=layer_types,
        attn_implementation="eager",
    )


@pytest.mark.anyio
async def test_hybrid_sliding_model_round_trip(tmp_path: Path) -> None:
    """Qwen2 with interleaved sliding-window and full layers: groups "kv" and "swa_kv".

    Layer 0 is a sliding layer, as in Gemma 2/3 and Mistral: transformers takes the position of
    the next token from layer 0's token count, so a rebuilt sliding layer must report all
    ``PREFIX`` tokens, not just the ``window - 1`` it holds.
    """
    torch.manual_seed(99)
    window = 40
    layer_types = ["sliding_attention", "full_attention"] * 2
    config = _hybrid_qwen2(window, layer_types)
    assert config.layer_types == layer_types
    model = transformers.Qwen2ForCausalLM(config).eval()
    prompt = make_prompt(seed=11)
    layout = hf.layout_for_config(config, chunk_tokens=CHUNK)
    assert layout.group_names == ("kv", "swa_kv")
    assert layout.group("swa_kv").window_tokens == window
    src_ids = shuffled(PROMPT_BLOCKS, seed=12)
    src = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)

    # a sliding layer keeps only its last window-1 tokens: after the full prompt the ones the
    # 160-token prefix needs are gone, and the adapter refuses instead of writing zeros
    with torch.no_grad():
        _, full_past = _forward(model, prompt, None)
    with pytest.raises(bsr.ConfigError, match="window"):
        hf.write_kv_to_cache(full_past, src, src_ids, PREFIX, config=config)

    # the never-evicted run, written at the prefix end: prefill the prefix, write, continue
    with torch.no_grad():
        _, past = _forward(model, prompt[:, :PREFIX], None)
    hf.write_kv_to_cache(past, src, src_ids, PREFIX, config=config)
    split_reference = continue_decoding(model, prompt, PREFIX, past)
    full_reference = continue_decoding(model, prompt, 0, None)

    dst_ids = shuffled(PROMPT_BLOCKS, seed=13)
    dst = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)

    async def main() -> tuple[bsr.SaveResult, bsr.RestoreResult]:
        async with make_engine(layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
            saved = await save_all(engine, prompt, src, src_ids)
        async with make_engine(
            layout, tiers_at(tmp_path / "l2"), **ENGINE
        ) as engine:  # from the file tier
            return saved, await engine.restore(prompt[0], dst, dst_ids)

    saved, result = await main()
    # kv: all 5 chunks; swa_kv: the 2 chunks covering the last 40 tokens of the prefix
    assert list(layout.needed_chunks("swa_kv", 5)) == [3, 4]
    assert saved.objects_written == {"host": 7, "file": 7}
    assert result.state is COMMITTED, result
    assert result.committed_tokens == PREFIX
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, PREFIX, config)
    assert rebuilt.get_seq_length() == PREFIX
    full_layers = [1, 3]
    for i in full_layers:
        assert torch.equal(past.layers[i].keys[:, :, :PREFIX], rebuilt.layers[i].keys)
    for i in (0, 2):  # sliding: the last window - 1 tokens before the prefix end
        assert rebuilt.layers[i].keys.shape[-2] == window - 1
    got = continue_decoding(model, prompt, PREFIX, rebuilt)
    assert_same_logits(got, split_reference)
    assert_same_logits(got, full_reference)  # see assert_matches_never_evicted


def _window_table(ids: torch.Tensor, first_real_block: int) -> torch.Tensor:
    """``ids`` with ``NULL_BLOCK`` before ``first_real_block``, as a serving engine that frees a
    sliding group's blocks outside its window would hand them over."""
    out = ids.clone()
    out[:first_real_block] = bsr.NULL_BLOCK
    return out


@pytest.mark.anyio
async def test_hybrid_sliding_model_with_a_table_per_group(tmp_path: Path) -> None:
    """Per-group tables: the sliding group holds blocks for its window's chunks only (NULL_BLOCK
    elsewhere), save and restore go through them, and the rebuilt cache decodes as the
    never-evicted run; a table with NULL_BLOCK where tokens are read or written is refused."""
    torch.manual_seed(99)
    window = 40
    config = _hybrid_qwen2(window, ["sliding_attention", "full_attention"] * 2)
    model = transformers.Qwen2ForCausalLM(config).eval()
    prompt = make_prompt(seed=21)
    layout = hf.layout_for_config(config, chunk_tokens=CHUNK)
    # the sliding group needs chunks 3 and 4 of the 5-chunk prefix: blocks from chunk 3 on
    first = 3 * CHUNK // BLOCK
    assert list(layout.needed_chunks("swa_kv", PREFIX // CHUNK)) == [3, 4]
    src_ids = shuffled(PROMPT_BLOCKS, seed=22)
    src_tables = {"kv": src_ids, "swa_kv": _window_table(src_ids, first)}
    src = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    with torch.no_grad():
        _, past = _forward(model, prompt[:, :PREFIX], None)
    hf.write_kv_to_cache(past, src, src_tables, PREFIX, config=config)

    # a NULL_BLOCK where the sliding layers' last window - 1 tokens go is refused, naming it
    late = _window_table(src_ids, PREFIX // BLOCK - 1)
    with pytest.raises(bsr.BlockTableError, match="swa_kv") as err:
        hf.write_kv_to_cache(past, src, {"kv": src_ids, "swa_kv": late}, PREFIX, config=config)
    assert err.value.group == "swa_kv"
    with pytest.raises(bsr.BlockTableError, match="swa_kv"):
        hf.read_kv_from_cache(src, {"kv": src_ids, "swa_kv": late}, PREFIX, config)
    reference = continue_decoding(model, prompt, PREFIX, past)  # moves `past` on

    dst_ids = shuffled(PROMPT_BLOCKS, seed=23)
    dst_tables = {"kv": dst_ids, "swa_kv": _window_table(dst_ids, first)}
    dst = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    async with make_engine(layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
        saved = await engine.save(prompt[0, :PREFIX], src, src_tables)
    # kv: all 5 chunks; swa_kv: its 2 window chunks, read from real blocks only
    assert saved.objects_written == {"host": 7, "file": 7}, saved
    async with make_engine(layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
        result = await engine.restore(prompt[0], dst, dst_tables)
    assert result.state is COMMITTED, result
    assert result.committed_tokens == PREFIX
    rebuilt = hf.read_kv_from_cache(dst, dst_tables, PREFIX, config)
    assert rebuilt.get_seq_length() == PREFIX
    got = continue_decoding(model, prompt, PREFIX, rebuilt)
    assert_same_logits(got, reference)


@pytest.mark.anyio
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "end_only"])
async def test_a_shared_prefix_of_a_sliding_model_restores_its_last_checkpoint(
    tmp_path: Path, checkpoints: bool
) -> None:
    """Window checkpoints through ``bsr.hf``: a server that prefills a hybrid Qwen2 (window 32,
    one chunk) up to each of ``engine.checkpoint_tokens(n)`` and writes the cache there (a
    ``DynamicCache`` keeps a sliding layer's last window only) saves A with
    ``window_checkpoints=True``; a prompt B that shares A's first 5 chunks restores 4 (the last
    checkpoint; every 2 chunks), every group, and decodes exactly as B's never-evicted run.
    Without checkpoints (the end's window only) B misses."""
    torch.manual_seed(99)
    config = _hybrid_qwen2(CHUNK, ["sliding_attention", "full_attention"] * 2)
    model = transformers.Qwen2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(31)
    a = torch.randint(0, VOCAB, (1, 7 * CHUNK), generator=gen)
    b = torch.cat((a[:, : 5 * CHUNK + 10], torch.randint(0, VOCAB, (1, 50), generator=gen)), 1)
    layout = hf.layout_for_config(config, chunk_tokens=CHUNK)
    src_ids = shuffled(7 * CHUNK // BLOCK, seed=33)
    src = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    async with make_engine(
        layout, tiers_at(tmp_path / "l2"), window_checkpoint_chunks=2, **ENGINE
    ) as engine:
        stops = [*engine.checkpoint_tokens(a.shape[1]), a.shape[1]]
        assert stops == [2 * CHUNK, 4 * CHUNK, 6 * CHUNK, 7 * CHUNK]
        past, done = None, 0
        with torch.no_grad():
            for stop in stops:  # prefill to each checkpoint, write what the window holds
                _, past = _forward(model, a[:, done:stop], past)
                hf.write_kv_to_cache(past, src, src_ids, stop, config=config, start=done)
                done = stop
        saved = await engine.save(a[0], src, src_ids, window_checkpoints=checkpoints)
    assert saved.saved_tokens == 7 * CHUNK
    # kv: 7 chunks; swa_kv: chunk 6 (the end's window) and, with checkpoints, chunks 1, 3, 5
    assert saved.objects_written["file"] == 7 + (4 if checkpoints else 1)

    dst_ids = shuffled(-(-b.shape[1] // BLOCK), seed=34)
    dst = bsr.PagedKVCache(layout, NUM_BLOCKS, BLOCK)
    async with make_engine(layout, tiers_at(tmp_path / "l2"), **ENGINE) as engine:
        result = await engine.restore(b[0], dst, dst_ids)
    if not checkpoints:
        assert result.committed_tokens == 0
        return
    assert result.state is COMMITTED, result
    assert result.committed_tokens == 4 * CHUNK
    group_bytes = layout.group_chunk_bytes
    assert result.bytes_read == 4 * group_bytes("kv") + group_bytes("swa_kv")
    rebuilt = hf.read_kv_from_cache(dst, dst_ids, 4 * CHUNK, config)
    got = continue_decoding(model, b, 4 * CHUNK, rebuilt)
    # B's never-evicted run with A's prefill split over the shared part (the restored K/V was
    # computed that way: a prefill on top of a cache rounds apart from one in one go)
    past, done = None, 0
    with torch.no_grad():
        for stop in (2 * CHUNK, 4 * CHUNK):
            _, past = _forward(model, b[:, done:stop], past)
            done = stop
    assert_same_logits(got, continue_decoding(model, b, 4 * CHUNK, past))
    assert max_diff(got, continue_decoding(model, b, 0, None)) < 1e-4
