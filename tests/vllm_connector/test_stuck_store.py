"""A stuck store never holds vLLM's KV pool: saves are bounded, on vLLM's real CPU engine.

vLLM keeps a finished request's blocks until the connector reports its save done. Here the
store is a real FileTier whose root's lock another process (this test) holds while twelve
200-token requests run through a pool of 48 blocks, so at most six fit at once and the others
need the blocks of finished ones. Before: each save waited for the lock as long as it was held
(the issue: 6 of 12 requests finished in 45 s; here the watchdog, which ends the hold after
90 s, fires). Now each save skips the locked root within the tier's ``lock_timeout_s`` (counted
``root_locked``), or, where the tier would wait longer, is cut by the connector's
``save_timeout_s`` (counted ``timeout``); all twelve finish with the lock held. The control
takes no lock: every save lands.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from anyio.from_thread import start_blocking_portal

import bsr
from vllm_engines import metric, run, store_objects, toks, write_llama

pytestmark = pytest.mark.timeout(1800)

BLOCK = 32
#: one block of the test Llama: 32 tokens x K and V x 2 heads x 64 dims x bfloat16 x 2 layers
BLOCK_BYTES = BLOCK * 2 * 2 * 64 * 2 * 2
POOL_BLOCKS = 48
CHUNK = 64
PROMPTS = [toks(200, 700 + i) for i in range(12)]  # 7 blocks each: at most 6 run at once
IDS = [f"r{i}" for i in range(len(PROMPTS))]
#: the longest the test holds the lock: past it the requests' run is recorded as stalled
WATCHDOG_S = 90


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stuck-store")
    write_llama(path / "model")
    return path


def _claim(root: Path) -> None:
    """Make ``root`` a FileTier root (marker, ledger), as a server that ran before would."""
    with start_blocking_portal() as portal:
        tier = bsr.FileTier(root, 1 << 30)
        portal.call(tier.open)
        portal.call(tier.aclose)


def _holder(root: Path, gate: Path, lock: bool, took: list[float]) -> threading.Thread:
    """Once the engine is up (``started``), take the root's lock (or not: the control) and say
    so (``locked``); hold it while ``hold`` exists (the engine's watchdog removes it). ``took``
    gets how long the requests ran from then (``ran``)."""

    def hold() -> None:
        deadline = time.monotonic() + 600
        while not (gate / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        fd = os.open(root / ".bsr-ledger", os.O_RDWR)
        try:
            if lock:
                fcntl.flock(fd, fcntl.LOCK_EX)
            (gate / "hold").touch()
            (gate / "locked").touch()
            t0 = time.monotonic()
            while (gate / "hold").exists() and time.monotonic() < deadline:
                if (gate / "ran").exists() and not took:
                    took.append(time.monotonic() - t0)
                time.sleep(0.05)
        finally:
            os.close(fd)  # releases the lock

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    return t


def _script(gate: Path) -> list[dict[str, Any]]:
    adds = [{"op": "add", "id": rid, "prompt": p} for rid, p in zip(IDS, PROMPTS)]
    flush = [
        op
        for i in range(4)
        for op in (
            {"op": "sleep", "s": 2},
            {"op": "add", "id": f"flush{i}", "prompt": toks(20, 790 + i)},
            {"op": "run", "until": [f"flush{i}"]},
        )
    ]
    return [
        {"op": "touch", "path": str(gate / "started")},
        {"op": "wait_file", "path": str(gate / "locked"), "timeout": 300},
        *adds,
        {"op": "run", "until": IDS, "watchdog": WATCHDOG_S, "release": str(gate / "hold"),
         "name": "requests"},
        {"op": "touch", "path": str(gate / "ran")},
        {"op": "note", "name": "held_to_the_end", "exists": str(gate / "hold")},
        # the last saves settle (each ends within its bound, a few seconds at most); requests
        # shorter than a chunk (nothing to save) step the engine so their outcomes are counted
        *flush,
        {"op": "metrics", "name": "end"},
        {"op": "rm", "path": str(gate / "hold")},
    ]  # fmt: skip


def _run(tmp: Path, name: str, *, lock: bool, tier: dict[str, Any], **opts: Any) -> dict[str, Any]:
    """One engine over a fresh store at ``<tmp>/<name>-store``; the script's outcome."""
    root, gate = tmp / f"{name}-store", tmp / f"{name}-gate"
    gate.mkdir()
    _claim(root)
    connector = {
        "bsr": {
            "tiers": [{"kind": "file", "path": str(root), "capacity_bytes": 1 << 30, **tier}],
            "chunk_tokens": CHUNK,
            "window": 4,
            "io_depth": 2,
            "model_id": "test-llama",
        },
        "bsr_connector": {"lookup_timeout_s": 5.0, **opts},
    }
    took: list[float] = []
    holder = _holder(root, gate, lock, took)
    try:
        result = run(
            tmp, name, connector=connector, script=_script(gate), log_stats=True,
            block_size=BLOCK, kv_cache_bytes=POOL_BLOCKS * BLOCK_BYTES, max_model_len=1024,
        )  # fmt: skip
    finally:
        (gate / "hold").unlink(missing_ok=True)
        holder.join(30)
    out: dict[str, Any] = result["script"]
    out["objects"] = len(store_objects(root))
    out["requests_s"] = took[0] if took else None
    print(f"{name}: 12 requests ran {out['requests_s']} s from the lock's taking")
    return out


def _all_finished(out: dict[str, Any]) -> None:
    assert not out["notes"]["watchdog:requests"], "the requests stalled while the lock was held"
    rows = out["rows"]
    assert all(rows[rid]["finished"] and len(rows[rid]["tokens"]) == 8 for rid in IDS), rows


def test_a_root_locked_by_another_process_skips_the_saves_and_serves_on(tmp: Path) -> None:
    """The FileTier skips the locked root after its lock_timeout_s (2 s by default): every
    request finishes with the lock still held, every save is counted skipped (root_locked),
    none stored."""
    out = _run(tmp, "locked", lock=True, tier={})
    _all_finished(out)
    assert out["notes"]["held_to_the_end"]
    end = out["metrics"]["end"]
    assert metric(end, "vllm:bsr_saves_skipped", reason="root_locked") == len(IDS), end
    assert metric(end, "vllm:bsr_saves") == 0 and out["objects"] == 0


def test_a_save_longer_than_save_timeout_s_is_cut_and_its_blocks_come_back(tmp: Path) -> None:
    """A tier that would wait for the lock far longer (lock_timeout_s 600) stands for any store
    whose writes hang: the connector cuts each save at save_timeout_s, reports it done, and
    counts it (timeout); every request finishes with the lock still held."""
    out = _run(tmp, "cut", lock=True, tier={"lock_timeout_s": 600}, save_timeout_s=1.0)
    _all_finished(out)
    assert out["notes"]["held_to_the_end"]
    end = out["metrics"]["end"]
    assert metric(end, "vllm:bsr_saves_skipped", reason="timeout") == len(IDS), end
    assert metric(end, "vllm:bsr_saves") == 0 and out["objects"] == 0


def test_control_without_the_lock_every_save_lands(tmp: Path) -> None:
    out = _run(tmp, "control", lock=False, tier={})
    _all_finished(out)
    end = out["metrics"]["end"]
    assert metric(end, "vllm:bsr_saves") == len(IDS), end
    assert metric(end, "vllm:bsr_saves_skipped", reason="root_locked") == 0
    assert metric(end, "vllm:bsr_saves_skipped", reason="timeout") == 0
    assert out["objects"] == len(IDS) * ((200 + 7) // CHUNK)  # full chunks of prompt + output
