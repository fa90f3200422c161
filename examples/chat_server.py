"""A multi-turn chat server loop on bsr, with a KV pool too small for its conversations.

Run it: ``python examples/chat_server.py`` (CPU, no download: a random small Llama).

Six conversations take turns round-robin. Their KV lives in one paged cache whose blocks cannot
hold all six, so when a turn needs blocks the least recently used idle conversation is saved
through bsr (host DRAM, then a file tier) and its blocks are freed; on its next turn it is
restored through bsr's bounded window and only the rest of its history is prefilled. The
generated tokens are compared with a run whose pool never evicts; the script exits 1 if they
differ.

The lines between ``glue: begin`` and ``glue: end`` are what a server writes on top of bsr
(the rest builds a model and fake user messages, and checks the result).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from typing import Any

import anyio
import torch

import bsr
from bsr import hf
from bsr.kit import ConversationCache

CONVERSATIONS, TURNS, USER_TOKENS, NEW_TOKENS, VOCAB = 6, 4, 13, 6, 256


def make_model() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def user_message(conv: int, turn: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * conv + turn)
    return torch.randint(0, VOCAB, (USER_TOKENS,), generator=gen).tolist()


# ----------------------------------------------------------------------------- glue: begin
def forward(model: Any, tokens: list[int], past: Any) -> tuple[torch.Tensor, Any]:
    """One forward pass with a cache (transformers 5 calls the argument ``cache``)."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True, **{kw: past})
    return out.logits[0, -1], getattr(out, "cache", None) or out.past_key_values


async def chat_turn(
    convs: ConversationCache, model: Any, conv_id: int, history: list[int]
) -> list[int]:
    """Admit (resident, restored by bsr, or nothing), prefill the rest, decode, write back."""
    adm = await convs.admit(conv_id, history, reserve_tokens=NEW_TOKENS)
    past = hf.read_kv_from_cache(convs.cache, adm.block_ids, adm.cached_tokens, model.config)
    logits, past = forward(model, history[adm.cached_tokens :], past)
    new: list[int] = []
    while True:
        new.append(int(logits.argmax()))
        if len(new) == NEW_TOKENS:
            break
        logits, past = forward(model, new[-1:], past)
    valid = len(history) + len(new) - 1  # the last token was sampled, never fed to the model
    hf.write_kv_to_cache(past, convs.cache, adm.block_ids, valid, start=adm.cached_tokens)
    convs.commit(conv_id, history + new, valid)
    return new


async def serve(model: Any, num_blocks: int, store: str) -> tuple[list[list[int]], Any]:
    layout = hf.layout_for_config(model.config, chunk_tokens=16)
    config = bsr.EngineConfig.from_dict({
        "model_id": "tiny-llama@random0", "window": 2, "io_depth": 2,
        "tiers": [{"kind": "host", "capacity_bytes": "256KiB"},
                  {"kind": "file", "path": store, "capacity_bytes": "64MiB"}],
    })  # fmt: skip
    engine = bsr.RestoreEngine.from_config(config, layout=layout)
    cache = bsr.PagedKVCache(layout, num_blocks=num_blocks, block_tokens=4)
    histories: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    replies: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    async with engine:
        convs = ConversationCache(engine, cache)
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                histories[c] += user_message(c, turn)
                reply = await chat_turn(convs, model, c, histories[c])
                histories[c] += reply
                replies[c] += reply
        return replies, convs.statistics()


# ----------------------------------------------------------------------------- glue: end
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48, help="KV blocks (4 tokens each)")
    args = parser.parse_args(argv)
    model = make_model()
    full = TURNS * (USER_TOKENS + NEW_TOKENS)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        got, stats = anyio.run(serve, model, args.blocks, a)
        big = CONVERSATIONS * (full // 4 + 2)  # room for every conversation: never evicts
        want, ref_stats = anyio.run(serve, model, big, b)
    print(f"pool of {args.blocks} blocks for {CONVERSATIONS} conversations of {full} tokens:")
    print(
        f"  {stats.evictions} evictions (saved {stats.saved_tokens} tokens through bsr), "
        f"{stats.restored} restores ({stats.restored_tokens} tokens), "
        f"{stats.resident_hits} resident turns, {stats.prefilled_tokens} tokens prefilled"
    )
    print(
        f"never-evicting run: {ref_stats.evictions} evictions, "
        f"{ref_stats.prefilled_tokens} tokens prefilled"
    )
    same = got == want
    print(f"generated tokens identical to the never-evicting run: {same}")
    return 0 if same and ref_stats.evictions == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
