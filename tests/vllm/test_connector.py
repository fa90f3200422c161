"""BsrConnector on vLLM's real CPU engine: same greedy tokens as no connector, whatever the store.

Each engine runs in its own process (``run_engine.py``): a baseline without connector, a store
run, a restore run in a fresh process, then runs over copies of the store that were damaged,
evicted behind the running engine's back, or made to hang. Needs vLLM (``make test`` runs this
file in ``.venv-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

# "vllm" alone would find this tests/vllm directory as a namespace package; ask for a submodule
pytest.importorskip("vllm.distributed.kv_transfer")
from vllm_engines import cached_of, file_store_connector, tokens_of, toks, write_llama
from vllm_engines import run as run_spec

# nine engine starts in one module fixture (its time counts toward the first test's timeout)
pytestmark = pytest.mark.timeout(3600)

CHUNK = 64  # two vLLM blocks of 32 (the CPU backend's smallest block size)


SHARED = toks(160, 99)
BATCH_A = [toks(200, 1), toks(128, 2), toks(40, 3), toks(100, 4)]
BATCH_B = [SHARED + toks(30, 100 + i) for i in range(12)]  # concurrent, one shared prefix
# what a restore run should restore: every full chunk, leaving one prompt token to compute
EXPECTED_A = [192, 64, 0, 64]
EXPECTED_B = 128  # the full chunks of the shared 160-token prefix
# full chunks of prompt + 7 computed output tokens: 3 + 2 + 0 + 1 for A, 2 shared + 12 for B
STORED_OBJECTS = 3 + 2 + 0 + 1 + 2 + 12


def connector(path: Path, **opts: Any) -> dict[str, Any]:
    # the same model_id for both weight sets: see the control
    return file_store_connector(path, chunk=CHUNK, model_id="test-llama", **opts)


def run(tmp: Path, name: str, model: str = "model", **spec: Any) -> dict[str, Any]:
    spec.setdefault("batches", [BATCH_A, BATCH_B])
    return run_spec(tmp, name, model, **spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm")
    write_llama(tmp / "model")
    store = tmp / "store"
    out: dict[str, Any] = {"tmp": tmp}
    out["baseline"] = run(tmp, "baseline")
    out["store"] = run(
        tmp, "store", connector=connector(store), await_objects=[str(store), STORED_OBJECTS]
    )
    out["objects"] = len(list((store / "objects").glob("**/*.bsr")))
    for name in ("restore", "damaged", "evicted", "fifo"):
        shutil.copytree(store, tmp / name)
    out["restore"] = run(tmp, "restore", connector=connector(tmp / "restore"))
    out["damaged"] = run(
        tmp,
        "damaged",
        connector=connector(tmp / "damaged", save=False),
        after_start=[{"kind": "damage", "path": str(tmp / "damaged")}],
    )
    out["evicted"] = run(
        tmp,
        "evicted",
        connector=connector(tmp / "evicted", save=False),
        after_start=[{"kind": "evict", "path": str(tmp / "evicted")}],
    )
    out["fifo"] = run(
        tmp,
        "fifo",
        connector=connector(tmp / "fifo", save=False, load_deadline_s=2.0),
        after_start=[{"kind": "fifo", "path": str(tmp / "fifo")}],
        batches=[BATCH_A],
    )
    (tmp / "not-a-dir").write_text("")
    out["missing"] = run(
        tmp, "missing", connector=connector(tmp / "not-a-dir" / "store"), batches=[BATCH_A]
    )
    # the control: other weights under the same model_id get the first weights' KV, intact
    write_llama(tmp / "other", seed=1)
    shutil.copytree(store, tmp / "mislabeled")
    out["other_baseline"] = run(tmp, "other_baseline", model="other", batches=[BATCH_A])
    out["mislabeled"] = run(
        tmp,
        "mislabeled",
        model="other",
        connector=connector(tmp / "mislabeled", save=False),
        batches=[BATCH_A],
    )
    return out


def test_restored_kv_is_what_vllm_attends_to(runs: dict[str, Any]) -> None:
    """The control: without it, "same tokens" would not show that bad KV was kept out.

    KV restored from a store of other weights (an operator error: one ``model_id`` for two
    weight sets; the bytes verify) changes the greedy tokens, so the tests' prompts do depend on
    the restored KV and the model is sensitive to it.
    """
    assert cached_of(runs["mislabeled"])[0] == EXPECTED_A
    assert tokens_of(runs["mislabeled"]) != tokens_of(runs["other_baseline"])


def test_store_run_outputs_equal_no_connector(runs: dict[str, Any]) -> None:
    assert tokens_of(runs["store"]) == tokens_of(runs["baseline"])
    # every full chunk of every request was stored: shared chunks once
    assert runs["objects"] == STORED_OBJECTS


def test_restore_run_in_fresh_process_reuses_every_full_chunk(runs: dict[str, Any]) -> None:
    assert tokens_of(runs["restore"]) == tokens_of(runs["baseline"])
    cached_a, cached_b = cached_of(runs["restore"])
    assert cached_a == EXPECTED_A  # long, chunk-multiple, shorter than a chunk, partial chunk
    assert all(c >= EXPECTED_B for c in cached_b)
    assert cached_of(runs["baseline"])[0] == [0, 0, 0, 0]


def test_damaged_store_recomputes_same_outputs(runs: dict[str, Any]) -> None:
    assert runs["damaged"]["actions"][0] == runs["objects"]
    assert tokens_of(runs["damaged"]) == tokens_of(runs["baseline"])
    quarantined = list((runs["tmp"] / "damaged" / "quarantine").glob("*"))
    assert quarantined, "bsr should have caught and quarantined the damaged objects"


def test_objects_evicted_between_lookup_and_load(runs: dict[str, Any]) -> None:
    assert runs["evicted"]["actions"][0] == runs["objects"]
    assert tokens_of(runs["evicted"]) == tokens_of(runs["baseline"])


def test_objects_replaced_by_fifos_never_block_a_load(runs: dict[str, Any]) -> None:
    """A FIFO blocks a plain open until a writer appears: loads still end, tokens unchanged."""
    assert runs["fifo"]["actions"][0] == runs["objects"]
    assert tokens_of(runs["fifo"]) == tokens_of(runs["baseline"])[:1]


def test_missing_store_serves_without_bsr(runs: dict[str, Any]) -> None:
    """A store that cannot open disables bsr (logged); vLLM serves as without a connector."""
    assert tokens_of(runs["missing"]) == tokens_of(runs["baseline"])[:1]
    assert cached_of(runs["missing"]) == [[0, 0, 0, 0]]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tensor parallelism 2 on the CPU build: two worker processes, bsr agreeing over gloo."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallelism 2 needs two CPU cores")
    tmp = tmp_path_factory.mktemp("vllm-tp2")
    write_llama(tmp / "model")
    out: dict[str, Any] = {}
    out["baseline"] = run(tmp, "baseline", batches=[BATCH_A], tensor_parallel_size=2)
    con = connector(tmp / "store")
    out["store"] = run(
        tmp,
        "store",
        connector=con,
        batches=[BATCH_A],
        tensor_parallel_size=2,
        await_objects=[str(tmp / "store"), 2 * (3 + 2 + 0 + 1)],
    )
    out["objects"] = {
        rank.name: len(list(rank.glob("objects/**/*.bsr"))) for rank in (tmp / "store").iterdir()
    }
    out["restore"] = run(tmp, "restore", connector=con, batches=[BATCH_A], tensor_parallel_size=2)
    return out


def test_tensor_parallel_2_store_and_restore(tp_runs: dict[str, Any]) -> None:
    assert tokens_of(tp_runs["store"]) == tokens_of(tp_runs["baseline"])
    assert tokens_of(tp_runs["restore"]) == tokens_of(tp_runs["baseline"])
    assert cached_of(tp_runs["restore"]) == [EXPECTED_A]
    # each rank stores its own shard under its own namespace, in its own FileTier root
    assert tp_runs["objects"] == {"rank-0-of-2": 6, "rank-1-of-2": 6}
