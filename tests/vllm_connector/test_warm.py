"""Warm and promote inside vLLM: a router's ``POST /bsr/warm`` before a request makes its load
come from the host tier; with ``promote`` a prefix loaded from the FileTier is read from the
host tier next time. One engine over a host tier above a copy of the shared store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_engines import BATCH_A, CHUNK_BYTES, Engines, batch_metric, connector, tokens_of

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

WARMED = BATCH_A[0]  # 200 tokens: 3 full chunks, the restore leaves one token to compute
PROMOTED = BATCH_A[3]  # 100 tokens: 1 full chunk
OTHER_SALT = "tenant-b"


def tiers_connector(store: Path, port: int, **bsr: Any) -> dict[str, Any]:
    """The shared store's FileTier below a host tier, the warm endpoint on ``port``; no saves
    (a save writes a finished request to every tier lacking it, the host tier too: only warms
    and promotions fill it here)."""
    conn = connector(store, warm_address=f"127.0.0.1:{port}", save=False)
    conn["bsr"]["tiers"] = [
        {"kind": "host", "capacity_bytes": 64 << 20},
        *conn["bsr"]["tiers"],
    ]
    conn["bsr"].update(bsr)
    return conn


def warm(port: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "warm", "address": f"127.0.0.1:{port}", "body": body}


@pytest.fixture(scope="module")
def warm_run(engines: Engines) -> dict[str, Any]:
    from bsr.testing._ports import unheld_ports

    (port,) = unheld_ports(1)
    store = engines.copy("warm-store")
    before = {
        "0": [
            warm(port, {"prompt_token_ids": WARMED}),
            warm(port, {"prompt_token_ids": WARMED}),  # again: nothing left to copy
            # another tenant's keys (a cache_salt) find nothing of the shared store
            warm(port, {"prompt_token_ids": WARMED, "cache_salt": OTHER_SALT}),
            warm(port, {"prompt_token_ids": "not a list"}),
        ],
    }
    return engines.run(
        "warm",
        connector=tiers_connector(store, port, promote="always"),
        # 0: warmed, then asked; 1: not warmed, read from the file (then promoted);
        # 2: the same prompt once vLLM forgot its own cache: from the host tier
        batches=[[WARMED], [PROMOTED], [PROMOTED]],
        before_batch=before,
        reset_prefix_cache_before=[2],
        log_stats=True,
    )


def test_a_warm_hint_makes_the_load_come_from_the_host_tier(
    warm_run: dict[str, Any], engines: Engines
) -> None:
    (status, first), (again_status, again), (salt_status, salted), (bad, error) = warm_run[
        "actions"
    ]
    assert (status, again_status, salt_status) == (200, 200, 200)
    assert first["reason"] == "warm" and first["target"] == "host"
    assert first["prefix_tokens"] == first["warm_tokens"] == 192
    assert first["objects_copied"] == 3 and first["bytes_by_tier"] == {"file": 3 * CHUNK_BYTES}
    assert again["objects_copied"] == 0 and again["objects_present"] == 3
    assert salted["reason"] == "miss" and salted["prefix_tokens"] == 0
    assert bad == 400 and error["field"] == "prompt_token_ids"
    # the request then loaded its whole prefix from the host tier, none of it from the file
    rows = warm_run["batches"][0]["rows"]
    assert rows[0]["cached"] == 192
    assert tokens_of(warm_run)[0][0] == engines.baseline_tokens(WARMED)
    assert batch_metric(warm_run, 0, "vllm:bsr_loaded_bytes", tier="host") == 3 * CHUNK_BYTES
    assert batch_metric(warm_run, 0, "vllm:bsr_loaded_bytes", tier="file") == 0
    # and vLLM counts the hit under the host tier's source (what a router reads)
    by_source = "vllm:prompt_tokens_cached_by_source"
    assert batch_metric(warm_run, 0, by_source, source="host") == 192
    assert batch_metric(warm_run, 0, by_source, source="disk") == 0
    assert batch_metric(warm_run, 0, "vllm:bsr_warms", reason="warm") == 2
    assert batch_metric(warm_run, 0, "vllm:bsr_warms", reason="miss") == 1
    assert batch_metric(warm_run, 0, "vllm:bsr_warmed_bytes", tier="file") == 3 * CHUNK_BYTES


def test_promotion_reads_a_returning_prefix_from_the_host_tier(
    warm_run: dict[str, Any], engines: Engines
) -> None:
    expected = engines.baseline_tokens(PROMOTED)
    assert tokens_of(warm_run)[1][0] == expected == tokens_of(warm_run)[2][0]
    assert [b["rows"][0]["cached"] for b in warm_run["batches"][1:]] == [64, 64]
    # first from the file, promoted after the load, then from the host tier
    assert batch_metric(warm_run, 1, "vllm:bsr_loaded_bytes", tier="file") == CHUNK_BYTES
    assert batch_metric(warm_run, 2, "vllm:bsr_loaded_bytes", tier="host") == CHUNK_BYTES
    assert batch_metric(warm_run, 2, "vllm:bsr_loaded_bytes", tier="file") == 0
    by_source = "vllm:prompt_tokens_cached_by_source"
    assert batch_metric(warm_run, 1, by_source, source="disk") == 64
    assert batch_metric(warm_run, 2, by_source, source="host") == 64
    promoted = sum(batch_metric(warm_run, i, "vllm:bsr_promotions", reason="warm") for i in (1, 2))
    assert promoted == 1
