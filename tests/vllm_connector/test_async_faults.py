"""Asynchronous loads under faults, on vLLM's real CPU engine: aborts while loading, a failing
load, a hung store. The tiers are the real FileTier behind a gate the test opens and closes
(``gated_connector.py``); each engine is driven one step at a time (``run_engine.py`` scripts).

The hostile-user findings each have a test here that failed on the connector before the split:
an abort during a failing load poisoned the store (a fresh engine restored never-written KV and
answered other tokens), and a hung store froze the whole server (each new request's lookup held
vLLM's one scheduling loop, running requests included).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm_engines import (
    BATCH_A,
    BATCH_B,
    EXPECTED_A,
    Engines,
    cached_of,
    connector,
    metric,
    store_objects,
    tokens_of,
    toks,
)

pytestmark = pytest.mark.timeout(3600)

A0, A1, A3 = BATCH_A[0], BATCH_A[1], BATCH_A[3]  # 3, 1 and 1 stored usable chunks
B0 = BATCH_B[0]  # 2 stored usable chunks (the shared prefix)
GATED = {"connector_class": "GatedConnector", "connector_module": "gated_connector"}
DECODER_TOKENS = 40  # decoders' prompts are shorter than a chunk: they never ask bsr


def gated(
    engines: Engines, name: str, script: Callable[[Path], list[dict[str, Any]]], **opts: Any
) -> tuple[dict[str, Any], Path, Path]:
    """Run ``script(gate)`` on an engine whose tiers are gated by ``<tmp>/<name>-gate``."""
    gate = engines.tmp / f"{name}-gate"
    gate.mkdir()
    store = engines.copy(f"{name}-store")
    result = engines.run(
        name,
        connector=connector(store, **opts),
        script=script(gate),
        env={"BSR_TEST_GATE": str(gate)},
        log_stats=True,
        **GATED,
    )
    return result, gate, store


def abort_script(g: Path) -> list[dict[str, Any]]:
    return [
        # 1. a request aborted while its load is held in a read: its blocks come back only
        #    once bsr can no longer write into them (poisoned then, checked after the read)
        {"op": "touch", "path": str(g / "hang-read")},
        {"op": "add", "id": "a1", "prompt": A0},
        {"op": "wait_file", "path": str(g / "read-waiting")},
        {"op": "abort", "ids": ["a1"]},
        {"op": "wait_file", "path": str(g / "poisoned")},
        {"op": "rm", "path": str(g / "hang-read")},
        {"op": "wait_file", "path": str(g / "poison.json")},
        # 2. a load that fails (its first chunk is corrupt): reported failed, recomputed
        {"op": "touch", "path": str(g / "corrupt-first")},
        {"op": "add", "id": "a2", "prompt": A0},
        {"op": "run", "until": ["a2"]},
        {"op": "rm", "path": str(g / "corrupt-first")},
        # 3. the engine still serves restores
        {"op": "add", "id": "a3", "prompt": A3},
        {"op": "run", "until": ["a3"]},
        {"op": "metrics", "name": "end"},
    ]


def stall_script(g: Path) -> list[dict[str, Any]]:
    def decoders(first: int) -> list[dict[str, Any]]:
        ids = [f"d{first + i}" for i in range(4)]
        adds = [
            {"op": "add", "id": rid, "prompt": toks(DECODER_TOKENS, 500 + first + i),
             "max_tokens": 40}
            for i, rid in enumerate(ids)
        ]  # fmt: skip
        return [*adds, {"op": "run", "until": ids, "min_tokens": 2}]

    def held_while_decoding(first: int, what: str) -> list[dict[str, Any]]:
        ids = [f"d{first + i}" for i in range(4)]
        return [
            {"op": "run", "until": ids, "watchdog": 120, "release": str(g / f"hang-{what}"),
             "name": what},
            {"op": "note", "name": f"{what}_still_hung", "exists": str(g / f"hang-{what}")},
            {"op": "rm", "path": str(g / f"hang-{what}")},
        ]  # fmt: skip

    return [
        # a store that hangs on lookups: three new requests arrive while four decode
        *decoders(1),
        {"op": "touch", "path": str(g / "hang-lookup")},
        *[{"op": "add", "id": f"h{i}", "prompt": p} for i, p in enumerate([A0, A1, A3], 1)],
        {"op": "wait_file", "path": str(g / "contains-waiting")},
        *held_while_decoding(1, "lookup"),
        {"op": "run", "until": ["h1", "h2", "h3"]},
        # a store that hangs on reads: a request's load is held while four others decode
        *decoders(5),
        {"op": "touch", "path": str(g / "hang-read")},
        {"op": "add", "id": "h4", "prompt": B0},
        {"op": "wait_file", "path": str(g / "read-waiting")},
        *held_while_decoding(5, "read"),
        {"op": "run", "until": ["h4"]},
    ]


def poison_script(g: Path) -> list[dict[str, Any]]:
    """The finding's order: the abort reaches vLLM while the (synchronous) load is held, so
    vLLM finishes the request before it processes the failed-load report of that step."""
    return [
        {"op": "touch", "path": str(g / "corrupt-first")},
        {"op": "touch", "path": str(g / "hang-read")},
        {"op": "add", "id": "p1", "prompt": A0},
        {"op": "wait_file", "path": str(g / "read-waiting")},
        {"op": "abort", "ids": ["p1"]},
        {"op": "sleep", "s": 1.5},  # the abort is queued in the engine core before the release
        {"op": "rm", "path": str(g / "hang-read")},
        {"op": "add", "id": "p2", "prompt": toks(DECODER_TOKENS, 77)},
        {"op": "run", "until": ["p2"]},
    ]


@pytest.fixture(scope="module")
def faults(engines: Engines) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["abort"] = gated(engines, "abort", abort_script)
    # lookups may hang for long here: the scheduler must not wait for them anyway
    out["stall"] = gated(engines, "stall", stall_script, lookup_timeout_s=600.0)
    out["poison"] = gated(engines, "poison", poison_script, load="sync")
    _, _, poisoned_store = out["poison"]
    out["after_poison"] = engines.run(
        "after_poison", connector=connector(poisoned_store, save=False), batches=[[A0]]
    )
    return out


def rows(result: dict[str, Any]) -> dict[str, Any]:
    return dict(result["script"]["rows"])


def test_no_write_into_the_blocks_of_an_aborted_load(faults: dict[str, Any]) -> None:
    """The load of a1 is held in a read when a1 is aborted. The worker cancels it and reports it
    received only once its task ended; the test poisons those blocks then, releases the held
    read and checks, once bsr's staging is idle, that every block still holds the poison.
    (Reporting at abort time without waiting for the task makes the late read land in them:
    ``intact`` 0 of 6.)"""
    result, gate, _ = faults["abort"]
    poison = json.loads((gate / "poison.json").read_text())
    assert poison == {"blocks": 6, "intact": 6}  # A0's 192 tokens = 6 blocks of 32
    assert rows(result)["a1"]["tokens"] == []
    assert metric(result["script"]["metrics"]["end"], "vllm:bsr_cancelled_loads") == 1


def test_a_failed_async_load_is_recomputed_and_heals_the_store(
    engines: Engines, faults: dict[str, Any]
) -> None:
    result, _, store = faults["abort"]
    r = rows(result)
    assert r["a2"]["tokens"] == engines.baseline_tokens(A0)
    snap = result["script"]["metrics"]["end"]
    assert metric(snap, "vllm:bsr_failed_loads", reason="corrupt") == 1
    assert metric(snap, "vllm:bsr_failed_loads", reason="cancelled") == 1  # a1's
    assert metric(snap, "vllm:bsr_loaded_tokens") == EXPECTED_A[3]  # a3's only
    assert list((store / "quarantine").glob("*")), "the corrupt chunk is quarantined"
    # a2 recomputed everything vLLM was told: that KV is computed, so it is saved again
    assert len(store_objects(store)) == len(store_objects(engines.store))
    assert r["a3"]["tokens"] == engines.baseline_tokens(A3)
    assert r["a3"]["cached"] == EXPECTED_A[3]


def test_a_hung_store_never_stalls_other_requests(engines: Engines, faults: dict[str, Any]) -> None:
    """Four requests decode while new ones wait on a store that hangs on lookups (then on
    reads): the four finish while the store is still hung, and the held requests complete with
    the tokens of no connector once it answers. (Before the split each new request's lookup
    held vLLM's scheduling loop for up to ``lookup_timeout_s``: the decoders stalled until the
    watchdog released the store.)"""
    result, _, _ = faults["stall"]
    notes = result["script"]["notes"]
    assert notes["watchdog:lookup"] is False and notes["lookup_still_hung"] is True
    assert notes["watchdog:read"] is False and notes["read_still_hung"] is True
    r = rows(result)
    for i in range(1, 9):
        assert len(r[f"d{i}"]["tokens"]) == 40 and r[f"d{i}"]["finished"]
    for rid, prompt, cached in (("h1", A0, 192), ("h2", A1, 64), ("h3", A3, 64), ("h4", B0, 128)):
        assert r[rid]["tokens"] == engines.baseline_tokens(prompt), rid
        assert r[rid]["cached"] == cached, rid


def test_an_abort_during_a_failing_load_never_poisons_the_store(
    engines: Engines, faults: dict[str, Any]
) -> None:
    """Synchronous load of A0 whose first chunk is corrupt, held in a read while the request is
    aborted: vLLM finishes the request before it processes the step's failed-load report. Only
    computed or verified KV may be saved, so nothing of A0 is; a fresh engine then misses A0's
    first chunk and recomputes. (Before: the never-written blocks were saved with valid
    checksums and the fresh engine restored 192 tokens and answered other tokens.)"""
    result, _, store = faults["poison"]
    assert rows(result)["p1"]["tokens"] == []
    fresh = faults["after_poison"]
    assert tokens_of(fresh) == [[engines.baseline_tokens(A0)]]
    assert cached_of(fresh) == [[0]]
    assert list((store / "quarantine").glob("*"))
