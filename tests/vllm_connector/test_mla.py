"""An MLA model (tiny DeepSeek-V2) through BsrConnector on vLLM's CPU build.

vLLM's ``CPU_MLA`` backend keeps one latent vector per token and layer (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64 = 576 bfloat16 values, ``[num_blocks, 1, 16, 576]``), no K/V halves:
bsr's layout has one part per layer. A fresh engine restores what a first one stored and gives
the tokens of no connector, with the restored tokens reported as cached.
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
    run,
    store_objects,
    tokens_of,
    toks,
    write_deepseek_v2,
)

pytestmark = pytest.mark.timeout(1800)


def _amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


# vLLM's CPU_MLA backend forces 16-token blocks; on a CPU with AMX vLLM picks AMX_MLA, which
# takes only multiples of 32 (both divide CHUNK)
BLOCK = 32 if _amx() else 16
CHUNK = 64
BATCH = [toks(200, 21), toks(150, 22), toks(40, 23)]
EXPECTED_CACHED = [192, 128, 0]
# full chunks of prompt + 7 computed output tokens: 3 + 2 + 0
STORED_OBJECTS = 3 + 2 + 0
# one chunk: 64 tokens x 2 layers x 576 bfloat16 values
CHUNK_BYTES = CHUNK * 2 * 576 * 2


def connector(path: Path, **opts: Any) -> dict[str, Any]:
    return file_store_connector(path, chunk=CHUNK, model_id="test-deepseek-v2", **opts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-mla")
    write_deepseek_v2(tmp / "model")
    store = tmp / "store"
    common: dict[str, Any] = {
        "batches": [BATCH],
        "max_tokens": 8,
        "block_size": BLOCK,
        "log_stats": True,
    }
    out: dict[str, Any] = {"tmp": tmp}
    out["baseline"] = run(tmp, "baseline", **common)
    out["store"] = run(
        tmp,
        "store",
        connector=connector(store),
        await_objects=[str(store), STORED_OBJECTS],
        **common,
    )
    out["objects"] = len(store_objects(store))
    out["restore"] = run(tmp, "restore", connector=connector(store, save=False), **common)
    # the control: other weights under the same model_id get the first weights' KV, intact
    write_deepseek_v2(tmp / "other", seed=1)
    out["other_baseline"] = run(tmp, "other_baseline", "other", **common)
    out["mislabeled"] = run(
        tmp, "mislabeled", "other", connector=connector(store, save=False), **common
    )
    return out


def test_restored_latents_are_what_vllm_attends_to(runs: dict[str, Any]) -> None:
    """The control: KV restored from a store of other weights (one ``model_id`` for two weight
    sets; the bytes verify) changes the greedy tokens, so "same tokens" below does show that
    the restored latents are the right ones."""
    assert cached_of(runs["mislabeled"]) == [EXPECTED_CACHED]
    assert tokens_of(runs["mislabeled"]) != tokens_of(runs["other_baseline"])


def test_store_run_outputs_equal_no_connector(runs: dict[str, Any]) -> None:
    assert tokens_of(runs["store"]) == tokens_of(runs["baseline"])
    assert runs["objects"] == STORED_OBJECTS


def test_restore_gives_the_tokens_of_no_connector(runs: dict[str, Any]) -> None:
    r = runs["restore"]
    assert cached_of(r) == [EXPECTED_CACHED]
    assert tokens_of(r) == tokens_of(runs["baseline"])
    assert batch_metric(r, 0, "vllm:bsr_loaded_tokens") == sum(EXPECTED_CACHED)
    loaded = batch_metric(r, 0, "vllm:bsr_loaded_bytes", tier="file")
    assert loaded == sum(EXPECTED_CACHED) // CHUNK * CHUNK_BYTES
