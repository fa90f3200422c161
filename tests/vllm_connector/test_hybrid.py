"""A hybrid model through BsrConnector with vLLM's hybrid KV cache manager on (``SupportsHMA``).

A tiny Gemma3 (layers 0 and 2 attend to a 64-token window, 1 and 3 to everything) gets two KV
cache groups from vLLM's CPU build: a ``SlidingWindowSpec`` group and a full-attention one, whose
tensors share memory (one layer of each group over one buffer) and whose block tables differ
(the sliding group's blocks below its window are vLLM's null block). bsr keeps one state group
per vLLM group: the full group stores every chunk, the sliding group only the chunk its window
needs at each prefix end worth one (the prompt's lookup end, window checkpoints, generated
chunks; ``test_window_checkpoints.py``), and a load commits both groups or neither (vLLM accepts
only a failed request then).
"""

from __future__ import annotations

import shutil
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

#: bsr's state groups: vLLM's KV cache groups in vLLM's order (the sliding one comes first)
SLIDING, FULL = "kv0", "kv1"
CHUNK = 64  # two vLLM blocks of 32; the model's window is 64 tokens
BATCH = [toks(200, 11), toks(150, 12), toks(130, 13), toks(330, 14)]
# every full chunk of each prompt, leaving at least one token to compute
EXPECTED_CACHED = [192, 128, 128, 320]
FULL_CHUNKS = sum(c // CHUNK for c in EXPECTED_CACHED)  # 3 + 2 + 2 + 5
# the sliding group's window (63 tokens: vLLM keeps sliding_window - 1 below the next token)
# lies in the last chunk of each prefix: one chunk per prompt restored
SLIDING_CHUNKS = len(BATCH)
# stored: the window at each prompt's lookup end, and the window checkpoint (every 4 chunks by
# default) at 256 tokens of the 330-token prompt
SLIDING_STORED = SLIDING_CHUNKS + 1
# a group's chunk: 64 tokens x 2 layers x (K + V of 2 heads x 64 dims, bfloat16)
GROUP_CHUNK_BYTES = CHUNK * 2 * 2 * 2 * 64 * 2
LOADED = "vllm:bsr_loaded_tokens"
BYTES = "vllm:bsr_loaded_bytes"


def connector(path: Path, **opts: Any) -> dict[str, Any]:
    return file_store_connector(path, chunk=CHUNK, model_id="test-gemma3", **opts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    write_gemma3(tmp / "model")
    store = tmp / "store"
    common: dict[str, Any] = {"batches": [BATCH], "max_tokens": 8, "log_stats": True}
    out: dict[str, Any] = {"tmp": tmp}
    out["baseline"] = run(tmp, "baseline", **common)
    out["store"] = run(
        tmp,
        "store",
        connector=connector(store),
        await_objects=[str(store), FULL_CHUNKS + SLIDING_STORED],
        **common,
    )
    out["objects"] = len(store_objects(store))
    out["by_group"] = {g: len(group_objects(store, g)) for g in (SLIDING, FULL)}
    out["restore"] = run(tmp, "restore", connector=connector(store, save=False), **common)
    # the control: other weights under the same model_id get the first weights' KV, intact
    write_gemma3(tmp / "other", seed=1)
    out["other_baseline"] = run(tmp, "other_baseline", "other", **common)
    out["mislabeled"] = run(
        tmp, "mislabeled", "other", connector=connector(store, save=False), **common
    )
    for what in ("damage", "evict"):
        for group in (SLIDING, FULL):
            name = f"{what}-{group}"
            copy = tmp / name
            shutil.copytree(store, copy)
            out[name] = run(
                tmp,
                name,
                connector=connector(copy, save=False),
                after_start=[{"kind": what, "path": str(copy), "group": group}],
                **common,
            )
    return out


def test_store_run_saves_the_full_group_whole_and_the_window_of_the_sliding_one(
    runs: dict[str, Any],
) -> None:
    assert tokens_of(runs["store"]) == tokens_of(runs["baseline"])
    assert runs["by_group"] == {SLIDING: SLIDING_STORED, FULL: FULL_CHUNKS}
    assert runs["objects"] == FULL_CHUNKS + SLIDING_STORED


def test_restore_gives_the_tokens_of_no_connector(runs: dict[str, Any]) -> None:
    r = runs["restore"]
    assert cached_of(r) == [EXPECTED_CACHED]
    assert tokens_of(r) == tokens_of(runs["baseline"])
    assert batch_metric(r, 0, LOADED) == sum(EXPECTED_CACHED)


def test_restored_kv_is_what_vllm_attends_to(runs: dict[str, Any]) -> None:
    """The control: KV of other weights (one ``model_id`` for two weight sets; the bytes verify)
    restored into both groups changes the greedy tokens, so "same tokens" shows the right KV."""
    assert cached_of(runs["mislabeled"]) == [EXPECTED_CACHED]
    assert tokens_of(runs["mislabeled"]) != tokens_of(runs["other_baseline"])


def test_the_sliding_group_reads_its_window_only(runs: dict[str, Any]) -> None:
    """Bytes read: every chunk of the full group, one chunk per prompt of the sliding group
    (14 group chunks for 12 + 12 without the window)."""
    got = batch_metric(runs["restore"], 0, BYTES, tier="file")
    assert got == (FULL_CHUNKS + SLIDING_CHUNKS) * GROUP_CHUNK_BYTES


@pytest.mark.parametrize("what", ["damage", "evict"])
@pytest.mark.parametrize("which", [SLIDING, FULL])
def test_one_groups_objects_damaged_or_evicted_recompute(
    runs: dict[str, Any], what: str, which: str
) -> None:
    """Objects of one group only are damaged (or gone) behind the running engine's back: no
    load commits either group (nothing partial reaches vLLM), the requests fail as a whole and
    are recomputed, the engine stays up and the tokens are those of no connector."""
    r = runs[f"{what}-{which}"]
    expected = SLIDING_STORED if which == SLIDING else FULL_CHUNKS
    assert r["actions"] == [expected]
    assert tokens_of(r) == tokens_of(runs["baseline"])
    assert batch_metric(r, 0, LOADED) == 0
    if what == "damage":
        assert batch_metric(r, 0, "vllm:bsr_failed_loads", reason="corrupt") >= 1
