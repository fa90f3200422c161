"""Every stored prefix of a hybrid model comes back: window saves and window checkpoints.

The tiny Gemma3 of ``test_hybrid.py`` (layers 0 and 2 attend to a 64-token window, 1 and 3 to
everything; vLLM's hybrid KV cache manager on, two KV cache groups), chunk 64 (two vLLM blocks of
32), window checkpoints every 4 chunks. vLLM frees a request's sliding-window blocks below its
window as it runs, so a sliding group's window at a prefix end is saved while the request still
holds it (``bsr.vllm._windows``): at every 4th chunk boundary, at the end of the prompt's full
chunks (what a lookup of the same prompt asks for), and at each boundary the generated tokens
reach.

Three engines: no connector (the tokens to match); a store engine, vLLM's prefix cache off so
that every hit is bsr's, which runs six prompts sharing 448- and 320-token prefixes one at a
time, a conversation A on a 600-token system prompt, and a three-turn conversation, each turn
extending the previous prompt and its generated tokens; and a fresh engine over that store
(vLLM's prefix cache on: bsr loads past its hits) that runs the six prompts again and a new
request B on A's system prompt. What the store run stores and hits is checked against a model
written from the rule above (each window is one chunk here: 63 tokens), not from bsr's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm_engines import (
    batch_metric,
    cached_of,
    file_store_connector,
    group_objects,
    run,
    store_objects,
    tokens_of,
    toks,
    write_gemma3,
)

pytestmark = pytest.mark.timeout(2400)

SLIDING, FULL = "kv0", "kv1"  # bsr's groups, in vLLM's group order
CHUNK = 64
EVERY = 4  # window checkpoints every 4 chunks (256 tokens)
MAX_TOKENS = 8
S448, T320, SYSTEM = toks(448, 300), toks(320, 301), toks(600, 302)
SIX = [
    S448 + toks(517, 1),  # 965 tokens
    S448 + toks(100, 2),  # 548: ran 43 tokens past its last chunk, window freed at its end
    S448 + toks(250, 3),  # 698: its output crosses a chunk past its lookup end (640 -> 704)
    T320 + toks(13, 4),  # 333
    T320 + toks(400, 5),  # 720
    toks(500, 6),  # 500: ran 59 tokens past its last chunk
]
A = SYSTEM + toks(150, 7)
B = SYSTEM + toks(90, 8)
TURNS = [toks(316, 9), toks(100, 10), toks(70, 11)]  # turn 1's output crosses chunk 320
# the store engine's batches, one prompt each; the conversation's turns continue the previous
# turn's prompt and generated tokens (run_engine.continued)
STORED = [
    *([p] for p in SIX),
    [A],
    [TURNS[0]],
    [{"after": [7, 0], "then": TURNS[1]}],
    [{"after": [8, 0], "then": TURNS[2]}],
]
TURN_BATCHES = (7, 8, 9)
# a group's chunk: 64 tokens x 2 layers x (K + V of 2 heads x 64 dims, bfloat16)
GROUP_CHUNK_BYTES = CHUNK * 2 * 2 * 2 * 64 * 2


def usable(n: int) -> int:
    """What a lookup asks for: every full chunk of the prompt but the one with its last token."""
    return (n - 1) // CHUNK * CHUNK


def connector(path: Path, **opts: Any) -> dict[str, Any]:
    conn = file_store_connector(path, chunk=CHUNK, model_id="test-gemma3", **opts)
    conn["bsr"]["window_checkpoint_chunks"] = EVERY
    return conn


# ------------------------------------------------------------------ the model of the store
Obj = tuple[tuple[int, ...], str]  # (the tokens up to the chunk's end, group)


def model_hit(prompt: list[int], objects: set[Obj]) -> int:
    """The longest prefix a lookup finds: every full chunk, and the one-chunk window at its end."""
    for p in range(usable(len(prompt)) // CHUNK, 0, -1):
        full = all((tuple(prompt[: (c + 1) * CHUNK]), FULL) in objects for c in range(p))
        if full and (tuple(prompt[: p * CHUNK]), SLIDING) in objects:
            return p * CHUNK
    return 0


def model_saves(prompt: list[int], output: list[int], hit: int) -> set[Obj]:
    """What a request stores: each full chunk it computed (vLLM computes all but the last
    generated token), and the sliding window at each chunk boundary past its hit that is a
    checkpoint, its prompt's lookup end or past it."""
    tokens = prompt + output
    computed = len(tokens) - 1
    out = {(tuple(tokens[: (c + 1) * CHUNK]), FULL) for c in range(computed // CHUNK)}
    for end in range(CHUNK, computed + 1, CHUNK):
        if end > hit and (end >= usable(len(prompt)) or end // CHUNK % EVERY == 0):
            out.add((tuple(tokens[:end]), SLIDING))
    return out


def model(baseline: dict[str, Any]) -> dict[str, Any]:
    """The store run's hits, and the objects stored before each batch, from the baseline's
    tokens (the store run must generate the same)."""
    prompts: list[list[int]] = []
    hits, before, objects = [], [], set[Obj]()
    for i, (p,) in enumerate(STORED):
        if isinstance(p, dict):
            b = p["after"][0]
            p = prompts[b] + baseline["batches"][b]["rows"][0]["tokens"] + p["then"]
        prompts.append(p)
        before.append(len(objects))
        hits.append(model_hit(p, objects))
        objects |= model_saves(p, baseline["batches"][i]["rows"][0]["tokens"], hits[-1])
    return {"prompts": prompts, "hits": hits, "before": before, "objects": objects}


# ------------------------------------------------------------------ the engines
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-windows")
    write_gemma3(tmp / "model")
    store = tmp / "store"
    common: dict[str, Any] = {"max_tokens": MAX_TOKENS, "log_stats": True}
    out: dict[str, Any] = {"tmp": tmp, "store": store}
    out["baseline"] = run(tmp, "baseline", batches=[*STORED, [B]], prefix_caching=False, **common)
    out["model"] = m = model(out["baseline"])
    waits = {
        str(i): [{"kind": "wait_objects", "path": str(store), "count": n}]
        for i, n in enumerate(m["before"])
        if n
    }
    out["store_run"] = run(
        tmp,
        "store",
        connector=connector(store),
        batches=STORED,
        before_batch=waits,
        await_objects=[str(store), len(m["objects"])],
        prefix_caching=False,
        **common,
    )
    out["by_group"] = {g: len(group_objects(store, g)) for g in (SLIDING, FULL)}
    out["objects"] = len(store_objects(store))
    out["restore"] = run(
        tmp,
        "restore",
        connector=connector(store, save=False),
        batches=[*([p] for p in SIX), [B]],
        **common,
    )
    return out


def test_the_store_holds_what_the_rule_says(runs: dict[str, Any]) -> None:
    """Every full chunk computed, and the sliding windows at the checkpoints, the prompts'
    lookup ends and the generated chunks: no more, no fewer (the run waited for each count)."""
    objects = runs["model"]["objects"]
    assert runs["by_group"] == {
        FULL: sum(1 for _, g in objects if g == FULL),
        SLIDING: sum(1 for _, g in objects if g == SLIDING),
    }
    assert runs["objects"] == len(objects)


def test_every_prompt_restores_its_whole_stored_prefix_in_a_fresh_engine(
    runs: dict[str, Any],
) -> None:
    """The six prompts again, in a fresh engine: each restores every full chunk it asks for
    (3,584 tokens of 3,584; before window saves 1,984: the three that ran past their last chunk
    boundary or whose output crossed one missed), with the tokens of no connector."""
    r = runs["restore"]
    cached = [c for (c,) in cached_of(r)]
    assert cached[:6] == [usable(len(p)) for p in SIX] == [960, 512, 640, 320, 704, 448]
    assert tokens_of(r)[:6] == tokens_of(runs["baseline"])[:6]


def test_a_shared_system_prompt_restores_to_its_last_checkpoint(runs: dict[str, Any]) -> None:
    """B shares A's 600-token system prompt (9 full chunks): it restores the 8 chunks up to the
    last checkpoint, every group (the full group's 8 chunks and the sliding group's window at
    512 read), with the tokens of no connector."""
    r = runs["restore"]
    assert cached_of(r)[6] == [512]
    assert tokens_of(r)[6] == tokens_of(runs["baseline"])[10]
    assert batch_metric(r, 6, "vllm:bsr_loaded_bytes", tier="file") == (8 + 1) * GROUP_CHUNK_BYTES


def test_store_run_hits_what_the_model_says(runs: dict[str, Any]) -> None:
    """Within the store run: a prompt sharing the 448-token prefix of an earlier one restores
    its checkpoint at 256 tokens; one sharing the 320-token prefix of a 333-token prompt
    restores all 320 (that prompt's lookup end); every token equals the run without a
    connector."""
    r = runs["store_run"]
    hits = runs["model"]["hits"]
    assert [c for (c,) in cached_of(r)] == hits
    assert hits[:6] == [0, 256, 256, 0, 320, 0]
    assert tokens_of(r) == tokens_of(runs["baseline"])[: len(STORED)]


def test_each_turn_restores_the_previous_turn(runs: dict[str, Any]) -> None:
    """Turn 2 extends turn 1's prompt (316 tokens) and its 8 generated tokens: it restores the
    320 tokens of their full chunks (the window at 320 was saved when the generated tokens
    reached it: neither a checkpoint nor turn 1's lookup end); turn 3 restores turn 2's 384."""
    r = runs["store_run"]
    prompts = runs["model"]["prompts"]
    got = [cached_of(r)[b][0] for b in TURN_BATCHES]
    previous = [0] + [
        (len(prompts[b]) + MAX_TOKENS - 1) // CHUNK * CHUNK for b in TURN_BATCHES[:-1]
    ]
    assert got == previous == [0, 320, 384]
    assert [tokens_of(r)[b] for b in TURN_BATCHES] == [
        tokens_of(runs["baseline"])[b] for b in TURN_BATCHES
    ]
