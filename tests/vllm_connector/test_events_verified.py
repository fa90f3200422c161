"""A damaged object is never announced: a save that finds an object already held (a request
with ``load: false`` after a restart, another server's object on a shared root) reads it back
verified before a ``BlockStored`` names it.

Two levels: the worker's event path (``WorkerFleet`` over a real engine and FileTier, a server
restart as a new engine and journal over the same root), and ``vllm serve`` with vLLM's KV
event publisher (a journal bounded to one object, so the prompt's first chunk is withdrawn
before it is damaged, and the ``load: false`` request's save finds it held and unannounced).
Before: the post-save audit asked only whether the file exists, so the damaged chunk was
announced (the next load got 0 of its tokens, and only then came ``BlockRemoved``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from anyio.from_thread import start_blocking_portal

import bsr

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1500)

from bsr.vllm._events import SaveEvents  # noqa: E402
from bsr.vllm._fleet import WorkerFleet  # noqa: E402
from bsr.vllm._metadata import SaveJob  # noqa: E402
from bsr.vllm._stats import BsrConnectorStats  # noqa: E402
from vllm_engines import write_llama  # noqa: E402
from vllm_servers import eventually, post, prom, serve, stop, wait_healthy  # noqa: E402
from vllm_settings import connector_settings  # noqa: E402

CHUNK, BLOCK = 32, 8
LAYOUT = bsr.StateLayout(chunk_tokens=CHUNK, groups=(bsr.StateGroup("kv", 2, 256),))
PROMPT = [1] * CHUNK + [2] * CHUNK + [3] * CHUNK


def hashes(tokens: list[int], block: int) -> tuple[bytes, ...]:
    return tuple(
        hashlib.sha256(str(tokens[: (b + 1) * block]).encode()).digest()
        for b in range(len(tokens) // block)
    )


class Server:
    """One server's engine and event path over the FileTier root ``root`` (a restart is a new
    one over the same root)."""

    def __init__(self, root: Path, portal: Any) -> None:
        self.portal = portal
        self.file = bsr.FileTier(root, capacity_bytes=1 << 24)
        self.engine = bsr.RestoreEngine(
            LAYOUT, [self.file], window=2, io_depth=1, namespace=bsr.Namespace("verified")
        )
        self.cache = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
        kv = self.cache.tensor("kv")
        gen = np.random.default_rng(0)
        kv.copy_(torch.from_numpy(gen.integers(0, 256, tuple(kv.shape), dtype=np.uint8)))
        s = connector_settings(BLOCK, CHUNK, kv_events=True)
        portal.call(self.engine.open)
        self.fleet = WorkerFleet(
            s, self.engine, ("kv",), [("full_attention", None)], 0, BsrConnectorStats()
        )
        self.removals: list[bsr.ObjectRemoved] = []
        self.engine.on_removed(self.removals.append)

    async def _save(self) -> bsr.SaveResult:
        job = SaveJob(
            "r", tuple(PROMPT), (tuple(range(len(PROMPT) // BLOCK)),), (),
            SaveEvents(hashes(PROMPT, BLOCK)),
        )  # fmt: skip
        since = self.fleet.begin()
        assert since is not None
        try:
            result = await self.engine.save(PROMPT, self.cache, list(job.block_ids[0]))
            await self.fleet.after_save(job, result, since)
        finally:
            self.fleet.end(since)
        return result

    def save(self) -> tuple[bsr.SaveResult, list[int]]:
        """Save the prompt; the chunks announced stored (by index)."""
        result = self.portal.call(self._save)
        per = CHUNK // BLOCK
        last = hashes(PROMPT, BLOCK)
        out = [last.index(n.info.block_hashes[-1]) // per for n in self.fleet.notices()]
        return result, sorted(n for n in out)

    def close(self) -> None:
        self.fleet.close()
        self.portal.call(self.engine.aclose)


def test_a_held_object_is_verified_before_it_is_announced(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    with start_blocking_portal() as portal:
        first = Server(root, portal)
        result, announced = first.save()
        assert result.objects_written == {"file": 3} and announced == [0, 1, 2]
        okey = bsr.ObjectKey(first.engine.keys(PROMPT)[0], "kv")
        path = first.file.object_path(okey.chunk, "kv")
        first.close()
        with open(path, "r+b") as f:  # chunk 0's payload damaged in place, its size kept
            f.seek(bsr.ObjectCodec.HEADER_SIZE + 16)
            f.write(b"\x00\x47" * 64)
        again = Server(root, portal)  # a restart: a new journal; the scan keeps the file
        try:
            result, announced = again.save()  # a load: false request's save
            assert result.objects_skipped == {"file": 3}  # held: nothing written
            assert announced == [1, 2]  # verified; chunk 0 is not announced
            assert (okey.object_id, bsr.Removal.QUARANTINED) in {
                (r.object_id, r.cause) for r in again.removals
            }
            assert not path.exists()  # moved to quarantine/, never read again
            result, announced = again.save()  # a later save writes it afresh: announced
            assert result.objects_written == {"file": 1} and announced == [0]
        finally:
            again.close()


# ---------------------------------------------------------------------- through vllm serve

SERVE_CHUNK = 64
SERVE_PROMPT = [3 + (i * 37) % 490 for i in range(3 * SERVE_CHUNK + 8)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Path, Any]]:
    from bsr.testing._ports import unheld_ports, wait_listening
    from vllm_connector.test_fleet import Subscriber

    root = tmp_path_factory.mktemp("verified")
    model, store = root / "model", root / "store"
    write_llama(model)
    (sub_port,) = unheld_ports(1)
    sub = Subscriber(sub_port)
    thread = threading.Thread(target=sub.run, daemon=True)
    thread.start()
    kv = {
        "kv_connector": "BsrConnector",
        "kv_connector_module_path": "bsr.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {
                "tiers": [{"kind": "file", "path": str(store), "capacity_bytes": "1GiB"}],
                "chunk_tokens": SERVE_CHUNK,
                "model_id": "verified-llama",
            },
            # one announced object: a prompt's earlier chunks are withdrawn by its later ones
            "bsr_connector": {"kv_events_max_objects": 1, "kv_events_audit_s": 600.0},
        },
    }
    events = {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}", "topic": "kv",
    }  # fmt: skip
    log = root / "server.log"
    (port,) = unheld_ports(1)
    proc = serve(model, port, log, kv, ["--kv-events-config", json.dumps(events)])
    try:
        wait_listening(proc, port, time.monotonic() + 600, "vllm serve", poll_s=0.5)
        wait_healthy(port, proc, log, time.monotonic() + 600)
        yield port, model, store, sub
    finally:
        stop(proc)
        sub.stop.set()
        thread.join(10)


def test_a_damaged_object_a_load_false_save_finds_is_never_announced(
    served: tuple[int, Path, Path, Any],
) -> None:
    from vllm_connector.test_fleet import removed, stored, vllm_hashes

    port, model, store, sub = served

    def complete(params: dict[str, Any] | None) -> int:
        body: dict[str, Any] = {
            "model": str(model), "prompt": SERVE_PROMPT, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True,
        }  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        out = post(port, "/v1/completions", body)
        return int(
            ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        )

    saves = prom(port, "vllm:bsr_saves_total")
    complete(None)
    eventually(lambda: prom(port, "vllm:bsr_saves_total") > saves, "the save")
    eventually(lambda: len(stored(sub.snapshot(), "STORAGE")) >= 3, "the three chunks' events")
    hashes_ = vllm_hashes(sub.snapshot(), SERVE_PROMPT)
    chunk0 = set(hashes_[:2])
    assert len(hashes_) == 6
    # chunk 0 was announced, then withdrawn by the bound (one announced object)
    assert any(chunk0 <= set(e.block_hashes) for e in removed(sub.snapshot(), "STORAGE"))
    damaged = 0
    for path in sorted(store.glob("objects/*/*.bsr")):  # chunk 0 (its header says which)
        if _index(path) == 0:
            with open(path, "r+b") as f:
                f.seek(4096 + 16)
                f.write(b"\x00\x47" * 512)
            damaged += 1
    assert damaged == 1
    mark = len(sub.snapshot())
    saves = prom(port, "vllm:bsr_saves_total")
    complete({"bsr": {"load": False}})  # computed (vLLM's own cache), saved: every chunk held
    eventually(lambda: prom(port, "vllm:bsr_saves_total") > saves, "the load: false save")
    # chunk 1 (withdrawn, intact) is announced again once verified: the events have come
    chunk1 = set(hashes_[2:4])
    eventually(
        lambda: any(
            chunk1 <= set(e.block_hashes) for e in stored(sub.snapshot()[mark:], "STORAGE")
        ),
        "chunk 1 announced again after its verification",
    )
    after = sub.snapshot()[mark:]
    assert not any(chunk0 & set(e.block_hashes) for e in stored(after, "STORAGE")), after
    # the damaged object was quarantined by that verification (no load read it)
    assert not any(_index(p) == 0 for p in store.glob("objects/*/*.bsr"))
    assert os.listdir(store / "quarantine")


def _index(path: Path) -> int:
    """The chunk index an object's header names (after magic, version, flags, namespace, key
    and group digest)."""
    with open(path, "rb") as f:
        f.seek(8 + 2 + 2 + 16 + 32 + 16)
        return int.from_bytes(f.read(8), "little")
