"""Behind a router: bsr's KV events through vLLM's own publisher, and its hits by source.

One ``vllm serve`` (the OpenAI server of vLLM's CPU build) with ``--kv-events-config`` (vLLM's
ZMQ publisher, connecting to a subscriber this test binds on loopback) and BsrConnector over a
HostTier that holds one object and a FileTier (``fleet_connector.py``: the tiers can lose writes
on demand). The test reads every event batch the server publishes, vLLM's own (medium ``GPU``)
and bsr's (``CPU`` for the HostTier, ``STORAGE`` for the FileTier), and checks, in order:

* a stored prompt yields ``BlockStored`` events whose block hashes, parents and tokens are the
  ones vLLM's own events give for the same blocks (what a router indexes);
* a prompt whose chunks the store holds half in host memory, half on disk is counted under
  both sources in ``vllm:prompt_tokens_cached_by_source`` on ``/metrics``;
* a save whose writes are lost (acknowledged, stored nowhere) yields no ``BlockStored``;
* every eviction from the HostTier yields a ``BlockRemoved`` (the view holds one CPU chunk);
* a damaged object quarantined by the load that found it yields a ``BlockRemoved``;
* ``bsr store gc`` on the FileTier's root yields a ``BlockRemoved`` for every object it
  removed, within the audit interval (1 s here) and the next engine step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vllm_engines import write_llama
from vllm_servers import eventually, post, prom, serve, stop, wait_healthy

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1500)

BLOCK, CHUNK = 32, 64
#: one object of the model's KV (2 layers x 64 tokens x 512 bytes) with its header
HOST_BYTES = 4096 + 2 * CHUNK * 512
#: where an object's header keeps its chunk index (magic, version, flags, namespace, key,
#: group digest come first)
INDEX_OFFSET = 8 + 2 + 2 + 16 + 32 + 16


def prompt(seed: int, chunks: int, tail: int = 8) -> list[int]:
    return [3 + (seed * 7919 + i * 37) % 490 for i in range(chunks * CHUNK + tail)]


A, C, E, F, G = prompt(1, 3), prompt(2, 2), prompt(3, 2), prompt(4, 2), prompt(5, 0, 20)


@dataclass
class Subscriber:
    """vLLM's event batches on a SUB socket this test binds (the publisher connects)."""

    port: int
    events: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.bind(f"tcp://127.0.0.1:{self.port}")
        try:
            while not self.stop.is_set():
                if sock.poll(200):
                    _topic, _seq, payload = sock.recv_multipart()
                    batch = decode(payload)
                    with self.lock:
                        self.events.extend(batch.events)
        finally:
            sock.close(linger=0)
            ctx.term()

    def snapshot(self) -> list[Any]:
        with self.lock:
            return list(self.events)


def stored(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def removed(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockRemoved" and e.medium == medium]


def view(events: list[Any], medium: str) -> set[int]:
    """The block hashes a subscriber holds as stored in ``medium`` after every event."""
    held: set[int] = set()
    for e in events:
        if getattr(e, "medium", None) != medium:
            continue
        if type(e).__name__ == "BlockStored":
            held.update(e.block_hashes)
        elif type(e).__name__ == "BlockRemoved":
            held.difference_update(e.block_hashes)
    return held


def vllm_hashes(events: list[Any], tokens: list[int]) -> list[int]:
    """The block hashes vLLM's own events (medium GPU) give ``tokens``' full blocks."""
    by_content: dict[tuple[Any, tuple[int, ...]], int] = {}
    for e in stored(events, "GPU"):
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            by_content[(parent, tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK]))] = h
            parent = h
    out, parent = [], None
    for b in range(len(tokens) // BLOCK):
        h = by_content.get((parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK])))
        if h is None:
            break
        out.append(h)
        parent = h
    return out


@dataclass
class Server:
    port: int
    model: Path
    store: Path
    gate: Path
    sub: Subscriber

    def complete(self, tokens: list[int]) -> int:
        """Greedy completion; the prompt tokens vLLM reports cached."""
        out = post(
            self.port, "/v1/completions",
            {"model": str(self.model), "prompt": tokens, "max_tokens": 4, "temperature": 0.0,
             "ignore_eos": True},
        )  # fmt: skip
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def saves(self) -> float:
        return prom(self.port, "vllm:bsr_saves_total")

    def saved(self, before: float) -> None:
        eventually(lambda: self.saves() > before, "the save")

    def reset_vllm_cache(self) -> None:
        eventually(lambda: post(self.port, "/reset_prefix_cache", {}).get("success"), "a reset")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from bsr.testing._ports import unheld_ports

    root = tmp_path_factory.mktemp("fleet")
    model, store, gate = root / "model", root / "store", root / "gate"
    write_llama(model)
    gate.mkdir()
    (sub_port,) = unheld_ports(1)
    sub = Subscriber(sub_port)
    thread = threading.Thread(target=sub.run, daemon=True)
    thread.start()
    kv = {
        "kv_connector": "FleetConnector",
        "kv_connector_module_path": "fleet_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {
                "tiers": [
                    {"kind": "host", "capacity_bytes": HOST_BYTES},
                    {"kind": "file", "path": str(store), "capacity_bytes": "1GiB"},
                ],
                "chunk_tokens": CHUNK,
                "model_id": "fleet-llama",
            },
            "bsr_connector": {"kv_events_audit_s": 1.0},
        },
    }
    events = {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}", "topic": "kv",
    }  # fmt: skip
    saved_env = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    )
    os.environ["BSR_TEST_GATE"] = str(gate)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    log = root / "server.log"
    from bsr.testing._ports import wait_listening

    (port,) = unheld_ports(1)
    proc = serve(model, port, log, kv, ["--kv-events-config", json.dumps(events)])
    try:
        os.environ.clear()
        os.environ.update(saved_env)
        wait_listening(proc, port, time.monotonic() + 600, "vllm serve", poll_s=0.5)
        wait_healthy(port, proc, log, time.monotonic() + 600)
        yield Server(port, model, store, gate, sub)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        stop(proc)
        sub.stop.set()
        thread.join(10)
        if os.environ.get("BSR_KEEP_LOGS"):
            print(log.read_text()[-20000:])


def _stored_prompt(server: Server) -> None:
    """A stored prompt: BlockStored with vLLM's own hashes, once durable in each tier."""
    sub = server.sub
    before = server.saves()
    assert server.complete(A) == 0
    server.saved(before)
    eventually(lambda: len(stored(sub.snapshot(), "STORAGE")) >= 3, "A's STORAGE events")
    events = sub.snapshot()
    want = vllm_hashes(events, A)
    assert len(want) == 6  # vLLM's own events for A's six full blocks
    chunks = stored(events, "STORAGE")
    assert sorted(h for e in chunks for h in e.block_hashes) == sorted(want)
    for e in chunks:  # each a chunk: two blocks, their parent, their tokens, group 0
        i = want.index(e.block_hashes[0])
        assert e.block_hashes == want[i : i + 2] and i % 2 == 0
        assert e.parent_block_hash == (want[i - 1] if i else None)
        assert e.token_ids == A[i * BLOCK : (i + 2) * BLOCK] and e.block_size == BLOCK
        assert e.group_idx == 0 and e.locality == "LOCAL"
    eventually(lambda: len(view(sub.snapshot(), "CPU")) == 2, "one chunk in host memory")
    assert view(sub.snapshot(), "CPU") <= set(want)  # the host holds one object: one chunk


def _hits_by_source(server: Server) -> None:
    """Hits by source: C's two chunks, one in host memory, the other on disk only."""
    before = server.saves()
    server.complete(C)
    server.saved(before)
    server.reset_vllm_cache()  # so the next request's hit is bsr's, not vLLM's own
    host0 = prom(server.port, "vllm:prompt_tokens_cached_by_source_total", source="host")
    disk0 = prom(server.port, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    assert server.complete(C) == 2 * CHUNK
    host = eventually(
        lambda: (
            prom(server.port, "vllm:prompt_tokens_cached_by_source_total", source="host") - host0
        ),
        "host hits on /metrics",
    )
    disk = prom(server.port, "vllm:prompt_tokens_cached_by_source_total", source="disk") - disk0
    assert (host, disk) == (CHUNK, CHUNK)
    assert prom(server.port, "vllm:bsr_hit_tokens_by_tier_total", tier="host") >= CHUNK
    assert prom(server.port, "vllm:bsr_hit_tokens_by_tier_total", tier="file") >= CHUNK


def _lost_writes_and_evictions(server: Server) -> list[Any]:
    """A save whose writes are lost: no BlockStored for it; and every eviction from the
    one-object HostTier was announced. Returns the events seen by then."""
    sub = server.sub
    (server.gate / "lose-writes").touch()
    before = server.saves()
    server.complete(E)
    server.saved(before)
    (server.gate / "lose-writes").unlink()
    before = server.saves()
    server.complete(F)  # saved for real: its events come after any of E's would have
    server.saved(before)
    eventually(
        lambda: set(vllm_hashes(sub.snapshot(), F)) <= view(sub.snapshot(), "STORAGE"),
        "F's STORAGE events",
    )
    events = sub.snapshot()
    e_hashes = set(vllm_hashes(events, E))
    assert len(e_hashes) == 4
    assert not any(set(e.block_hashes) & e_hashes for e in stored(events, "CPU"))
    assert not any(set(e.block_hashes) & e_hashes for e in stored(events, "STORAGE"))

    cpu_in, cpu_out = stored(events, "CPU"), removed(events, "CPU")
    assert len(cpu_in) >= 4 and len(cpu_out) >= len(cpu_in) - 1
    assert len(view(events, "CPU")) == 2  # exactly the object the host holds
    eventually(  # the counts reach /metrics through the front end, after the events
        lambda: prom(server.port, "vllm:bsr_object_removals_total", cause="evicted") >= 3,
        "evicted removals on /metrics",
    )
    return events


def _damaged_object(server: Server, events: list[Any]) -> None:
    """A damaged object: the load that finds it quarantines it, and says so."""
    sub = server.sub
    a0 = vllm_hashes(events, A)[:2]
    assert set(a0) <= view(events, "STORAGE") and not set(a0) & view(events, "CPU")
    objects = sorted(server.store.glob("objects/*/*.bsr"))
    damaged = 0
    for path in objects:  # every chunk 0 (the header says which chunk an object holds)
        with open(path, "rb") as f:
            f.seek(INDEX_OFFSET)
            index = int.from_bytes(f.read(8), "little")
        if index == 0:
            with open(path, "r+b") as f:
                f.seek(4096 + 16)
                f.write(b"\x00\x47" * 512)
            damaged += 1
    assert damaged >= 3  # A, C, F each have a chunk 0 (E's were lost)
    before = len(sub.snapshot())
    server.reset_vllm_cache()
    server.complete(A)  # the load finds chunk 0 corrupt: quarantined, recomputed, saved again
    eventually(
        lambda: any(
            set(a0) <= set(e.block_hashes) for e in removed(sub.snapshot()[before:], "STORAGE")
        ),
        "BlockRemoved for the quarantined object",
    )
    eventually(  # the counts reach /metrics through the front end, after the events
        lambda: prom(server.port, "vllm:bsr_object_removals_total", cause="quarantined") >= 1,
        "quarantined removals on /metrics",
    )


def _gc_withdraws(server: Server) -> None:
    """bsr store gc in another process: every object it removed is withdrawn."""
    sub = server.sub
    done = subprocess.run(
        [sys.executable, "-m", "bsr", "store", "gc", str(server.store), "--max-bytes", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr

    def withdrawn() -> bool:
        server.complete(G)  # an engine step (shorter than a chunk: nothing is saved)
        return not view(sub.snapshot(), "STORAGE")

    eventually(withdrawn, "BlockRemoved for everything bsr store gc removed", timeout=60)
    eventually(  # the counts reach /metrics through the front end, after the events
        lambda: prom(server.port, "vllm:bsr_object_removals_total", cause="vanished") >= 1,
        "vanished removals on /metrics",
    )


def test_events_hit_sources_and_removals(server: Server) -> None:
    """The phases of the module docstring, in order, on one server."""
    _stored_prompt(server)
    _hits_by_source(server)
    events = _lost_writes_and_evictions(server)
    _damaged_object(server, events)
    _gc_withdraws(server)
    events = server.sub.snapshot()
    counts = {m: (len(stored(events, m)), len(removed(events, m))) for m in ("GPU", "CPU")}
    counts["STORAGE"] = (len(stored(events, "STORAGE")), len(removed(events, "STORAGE")))
    print("events (stored, removed) by medium:", counts)
