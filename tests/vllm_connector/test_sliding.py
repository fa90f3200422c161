"""A sliding-window model (tiny Gemma3) through BsrConnector: no layer is treated as windowed
unless vLLM keeps it windowed.

With vLLM's hybrid KV cache manager off (what vLLM did for this connector before it declared
``SupportsHMA``, and does with ``--disable-hybrid-kv-cache-manager``; ``test_hybrid.py`` runs
it on) the model's layers form ONE KV cache group whose spec is a ``FullAttentionSpec`` that
carries the model's ``sliding_window``: every layer keeps full-length KV and vLLM's prefix cache
treats every block as holding every layer. bsr must then store and restore every chunk of every
layer; treating the group as windowed stored the last chunks only and restored them as if they
were the whole prefix (the full-attention layers' earlier KV was never written), and the output
diverged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm_engines import (
    cached_of,
    file_store_connector,
    run,
    store_objects,
    tokens_of,
    toks,
    write_gemma3,
)

pytestmark = pytest.mark.timeout(1800)

CHUNK = 64  # two vLLM blocks of 32; the model's window is 64 tokens too
BATCH = [toks(200, 11), toks(150, 12), toks(130, 13)]
# every full chunk of each prompt, leaving at least one token to compute
EXPECTED_CACHED = [192, 128, 128]
# one group (all 4 layers), full chunks of prompt + 7 computed output tokens: 3 + 2 + 2
STORED_OBJECTS = 3 + 2 + 2


def connector(path: Path, **opts: Any) -> dict[str, Any]:
    return file_store_connector(path, chunk=CHUNK, model_id="test-gemma3", **opts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-sliding")
    write_gemma3(tmp / "model")
    store = tmp / "store"
    common: dict[str, Any] = {"batches": [BATCH], "max_tokens": 8}
    out: dict[str, Any] = {"tmp": tmp}
    out["baseline"] = run(tmp, "baseline", **common)
    out["baseline_one_group"] = run(tmp, "baseline_one_group", disable_hybrid=True, **common)
    one_group = {**common, "disable_hybrid": True}
    out["store"] = run(
        tmp,
        "store",
        connector=connector(store),
        await_objects=[str(store), STORED_OBJECTS],
        **one_group,
    )
    out["objects"] = len(store_objects(store))
    out["restore"] = run(tmp, "restore", connector=connector(store, save=False), **one_group)
    return out


def test_without_connector_one_group_and_hybrid_agree(runs: dict[str, Any]) -> None:
    """The reference is sound: vLLM's two managers give this model the same tokens."""
    assert tokens_of(runs["baseline_one_group"]) == tokens_of(runs["baseline"])


def test_every_chunk_of_every_layer_is_stored(runs: dict[str, Any]) -> None:
    assert tokens_of(runs["store"]) == tokens_of(runs["baseline"])
    assert runs["objects"] == STORED_OBJECTS


def test_restore_gives_the_tokens_of_no_connector(runs: dict[str, Any]) -> None:
    assert cached_of(runs["restore"]) == [EXPECTED_CACHED]
    assert tokens_of(runs["restore"]) == tokens_of(runs["baseline"])
