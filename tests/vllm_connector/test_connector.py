"""BsrConnector on vLLM's real CPU engine: same greedy tokens as no connector, whatever the store.

Each engine runs in its own process (``run_engine.py``): the shared baseline and store runs
(``conftest.py``), a restore run in a fresh process (asynchronous loads, the default), a
synchronous one, then runs over copies of the store that were damaged, evicted behind the running
engine's back, replaced by FIFOs or missing. Needs vLLM (``make test`` runs this file in
``.venv-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm_engines import (
    BATCH_A,
    BATCH_B,
    CHUNK_BYTES,
    EXPECTED_A,
    EXPECTED_B,
    STORED_OBJECTS,
    Engines,
    batch_metric,
    cached_of,
    connector,
    store_objects,
    tokens_of,
    write_llama,
)
from vllm_engines import run as run_spec

# a dozen engine starts in module fixtures (their time counts toward the first test's timeout)
pytestmark = pytest.mark.timeout(3600)

A0 = BATCH_A[0]  # 200 tokens: three stored chunks
LOADED = "vllm:bsr_loaded_tokens"
BYTES = "vllm:bsr_loaded_bytes"


@pytest.fixture(scope="module")
def runs(engines: Engines) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # the default (async) mode; then restore past vLLM's own prefix-cache hit: chunk-aligned
    # (A0[:65] leaves 64 tokens in vLLM's cache) and not (A0[:97] leaves 96)
    out["restore"] = engines.run(
        "restore",
        connector=connector(engines.copy("restore-store")),
        batches=[BATCH_A, BATCH_B, [A0[:65]], [A0], [A0[:97]], [A0]],
        reset_prefix_cache_before=[2, 4],
        log_stats=True,
    )
    out["sync"] = engines.run(
        "sync",
        connector=connector(engines.copy("sync-store"), load="sync"),
        batches=[BATCH_A, BATCH_B],
        before_batch={"1": [{"kind": "damage", "path": str(engines.tmp / "sync-store")}]},
        log_stats=True,
    )
    for name, action in (("damaged", "damage"), ("evicted", "evict"), ("fifo", "fifo")):
        store = engines.copy(name)
        out[name] = engines.run(
            name,
            connector=connector(store, save=False),
            after_start=[{"kind": action, "path": str(store)}],
            batches=[BATCH_A] if name == "fifo" else [BATCH_A, BATCH_B],
            log_stats=True,
        )
    (engines.tmp / "not-a-dir").write_text("")
    out["missing"] = engines.run(
        "missing", connector=connector(engines.tmp / "not-a-dir" / "store"), batches=[BATCH_A]
    )
    # the control: other weights under the same model_id get the first weights' KV, intact
    write_llama(engines.tmp / "other", seed=1)
    out["other_baseline"] = run_spec(engines.tmp, "other_baseline", "other", batches=[BATCH_A])
    out["mislabeled"] = run_spec(
        engines.tmp,
        "mislabeled",
        "other",
        connector=connector(engines.copy("mislabeled"), save=False),
        batches=[BATCH_A],
    )
    # the namespace binds what changes the computation: the same weights with another
    # rms_norm_eps under the same model_id, and another tenant of the same model, both miss
    write_llama(engines.tmp / "eps", rms_norm_eps=1e-3)
    out["other_config"] = run_spec(
        engines.tmp,
        "other_config",
        "eps",
        connector=connector(engines.copy("other-config"), save=False),
        batches=[BATCH_A],
    )
    tenant = connector(engines.copy("tenant"), save=False)
    tenant["bsr"]["tenant"] = "another-tenant"
    out["tenant"] = engines.run("tenant", connector=tenant, batches=[BATCH_A])
    return out


def test_a_model_config_that_computes_differently_misses(runs: dict[str, Any]) -> None:
    """Same weights and model_id, another rms_norm_eps: its KV would differ, so nothing loads."""
    assert cached_of(runs["other_config"]) == [[0, 0, 0, 0]]


def test_the_tenant_salts_the_namespace(runs: dict[str, Any]) -> None:
    """The ``"bsr"`` dict's tenant reaches the namespace (it was dropped before)."""
    assert cached_of(runs["tenant"]) == [[0, 0, 0, 0]]
    assert tokens_of(runs["tenant"]) == [
        [r["tokens"] for r in runs["restore"]["batches"][0]["rows"]]
    ]


def test_restored_kv_is_what_vllm_attends_to(runs: dict[str, Any]) -> None:
    """The control: without it, "same tokens" would not show that bad KV was kept out.

    KV restored from a store of other weights (an operator error: one ``model_id`` for two
    weight sets; the bytes verify) changes the greedy tokens, so the tests' prompts do depend on
    the restored KV and the model is sensitive to it.
    """
    assert cached_of(runs["mislabeled"])[0] == EXPECTED_A
    assert tokens_of(runs["mislabeled"]) != tokens_of(runs["other_baseline"])


def test_store_run_outputs_equal_no_connector(engines: Engines) -> None:
    assert tokens_of(engines.stored) == tokens_of(engines.baseline)
    # every full chunk of every request was stored: shared chunks once
    assert len(store_objects(engines.store)) == STORED_OBJECTS
    assert cached_of(engines.baseline)[0] == [0, 0, 0, 0]


def test_async_restore_in_fresh_process_reuses_every_full_chunk(
    engines: Engines, runs: dict[str, Any]
) -> None:
    r = runs["restore"]
    assert tokens_of(r)[:2] == tokens_of(engines.baseline)
    cached_a, cached_b = cached_of(r)[:2]
    assert cached_a == EXPECTED_A  # long, chunk-multiple, shorter than a chunk, partial chunk
    assert all(c >= EXPECTED_B for c in cached_b)
    assert batch_metric(r, 0, LOADED) == sum(EXPECTED_A)
    assert batch_metric(r, 0, "vllm:bsr_hit_tokens") == sum(EXPECTED_A)
    assert batch_metric(r, 0, BYTES, tier="file") == sum(EXPECTED_A) // 64 * CHUNK_BYTES
    assert batch_metric(r, 0, "vllm:bsr_failed_loads", reason="corrupt") == 0


def test_requests_sharing_a_prefix_load_it_once(runs: dict[str, Any]) -> None:
    """Twelve requests arrive together with one stored 128-token prefix: one restore loads it,
    the others wait for it (deferred, as vLLM's OffloadingConnector does) and find it in vLLM's
    prefix cache; no two restores fetch, let alone write, the same chunks."""
    r = runs["restore"]
    assert all(c >= EXPECTED_B for c in cached_of(r)[1])
    assert batch_metric(r, 1, LOADED) == EXPECTED_B
    assert batch_metric(r, 1, BYTES, tier="file") == EXPECTED_B // 64 * CHUNK_BYTES
    assert batch_metric(r, 1, "vllm:bsr_loads") == 1


@pytest.mark.parametrize(("batch", "local"), [(3, 64), (5, 96)], ids=["aligned", "straddling"])
def test_restore_reads_only_past_vllms_own_hit(
    engines: Engines, runs: dict[str, Any], batch: int, local: int
) -> None:
    """vLLM's prefix cache holds the first ``local`` tokens of A0: bsr reads the chunks past
    them only (a chunk straddling the hit is read whole and installed from its first block past
    it) and the tokens are those of no connector."""
    r = runs["restore"]
    assert tokens_of(r)[batch] == [engines.baseline_tokens(A0)]
    assert cached_of(r)[batch] == [192]
    assert batch_metric(r, batch, LOADED) == 192 - local
    chunks_read = 3 - local // 64
    assert batch_metric(r, batch, BYTES, tier="file") == chunks_read * CHUNK_BYTES


def test_sync_loads_still_work_and_fall_back(engines: Engines, runs: dict[str, Any]) -> None:
    r = runs["sync"]
    assert tokens_of(r) == tokens_of(engines.baseline)
    assert cached_of(r)[0] == EXPECTED_A
    assert batch_metric(r, 0, LOADED) == sum(EXPECTED_A)
    # batch 1 ran over a damaged store: every load failed verification and was recomputed
    assert batch_metric(r, 1, LOADED) == 0
    assert batch_metric(r, 1, "vllm:bsr_failed_loads", reason="corrupt") >= 1


def test_damaged_store_recomputes_same_outputs(engines: Engines, runs: dict[str, Any]) -> None:
    r = runs["damaged"]
    assert r["actions"][0] == STORED_OBJECTS
    assert tokens_of(r) == tokens_of(engines.baseline)
    assert batch_metric(r, 0, LOADED) == 0
    assert batch_metric(r, 0, "vllm:bsr_failed_loads", reason="corrupt") >= 1
    quarantined = list((engines.tmp / "damaged" / "quarantine").glob("*"))
    assert quarantined, "bsr should have caught and quarantined the damaged objects"


def test_objects_evicted_between_lookup_and_load(engines: Engines, runs: dict[str, Any]) -> None:
    r = runs["evicted"]
    assert r["actions"][0] == STORED_OBJECTS
    assert tokens_of(r) == tokens_of(engines.baseline)
    assert batch_metric(r, 0, LOADED) == 0


def test_objects_replaced_by_fifos_never_block_a_load(
    engines: Engines, runs: dict[str, Any]
) -> None:
    """A FIFO would block a plain open until a writer appears: loads still end, tokens same."""
    r = runs["fifo"]
    assert r["actions"][0] == STORED_OBJECTS
    assert tokens_of(r) == tokens_of(engines.baseline)[:1]


def test_missing_store_serves_without_bsr(engines: Engines, runs: dict[str, Any]) -> None:
    """A store that cannot open disables bsr (logged); vLLM serves as without a connector."""
    r = runs["missing"]
    assert tokens_of(r) == tokens_of(engines.baseline)[:1]
    assert cached_of(r) == [[0, 0, 0, 0]]
    assert "bsr.vllm.disabled" in (engines.tmp / "missing.log").read_text()


def test_a_bad_connector_option_stops_vllm_at_startup(engines: Engines) -> None:
    """Found as a hostile user: ``lookup_timeout_s=-1`` was accepted and killed vLLM's engine
    core on the first request. It is refused at startup, naming the key."""
    with pytest.raises(AssertionError, match="bad_option run failed") as info:
        engines.run(
            "bad_option",
            connector=connector(engines.tmp / "unused", lookup_timeout_s=-1),
            batches=[BATCH_A[:1]],
        )
    assert "bsr_connector.lookup_timeout_s" in str(info.value)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tensor parallelism 2 on the CPU build: two worker processes, bsr agreeing over gloo."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallelism 2 needs two CPU cores")
    tmp = tmp_path_factory.mktemp("vllm-tp2")
    write_llama(tmp / "model")

    def run(name: str, **spec: Any) -> dict[str, Any]:
        return run_spec(tmp, name, batches=[BATCH_A], tensor_parallel_size=2, **spec)

    store: Path = tmp / "store"
    # the store run computes every token itself (its store is empty): it is the reference (a
    # run without a connector gives the same tokens: test_store_run_outputs_equal_no_connector,
    # at TP 1; a third TP engine here would cost ~1 min of this suite for nothing more)
    out: dict[str, Any] = {}
    out["store"] = run(
        "store", connector=connector(store), await_objects=[str(store), 2 * (3 + 2 + 0 + 1)]
    )
    out["objects"] = {rank.name: len(store_objects(rank)) for rank in store.iterdir()}
    out["restore"] = run("restore", connector=connector(store), log_stats=True)
    return out


def test_tensor_parallel_2_store_and_restore(tp_runs: dict[str, Any]) -> None:
    assert cached_of(tp_runs["store"]) == [[0, 0, 0, 0]]  # the store run computed it all
    assert tokens_of(tp_runs["restore"]) == tokens_of(tp_runs["store"])
    assert cached_of(tp_runs["restore"]) == [EXPECTED_A]
    # each rank stores its own shard under its own namespace, in its own FileTier root
    assert tp_runs["objects"] == {"rank-0-of-2": 6, "rank-1-of-2": 6}
    # request counts from rank 0, bytes from both ranks (each reads its own shard)
    assert batch_metric(tp_runs["restore"], 0, LOADED) == sum(EXPECTED_A)
    shard = CHUNK_BYTES // 2
    assert batch_metric(tp_runs["restore"], 0, BYTES, tier="file") == 2 * 5 * shard
