"""A fleet end to end: three ``vllm serve`` instances over one bsr pool, behind bsr's router.

Each instance runs BsrConnector over its own HostTier (medium ``CPU``: two objects) above one
FileTier root all three share (medium ``STORAGE``: the pool), and publishes vLLM's KV events
(vLLM's own, medium ``GPU``, and bsr's) to the router's socket under its name. The router
(:mod:`bsr.router`, in this process) indexes them by content (the instances' hash seeds differ)
and routes. float32 weights, so restored and recomputed tokens agree exactly. One fleet serves
every test here (engine starts are the cost); the tests run in order on it:

* a conversation whose turns land on three different instances: each returning turn restores
  the earlier turns from the pool (vLLM reports them cached), and its tokens equal a recompute
  of the same prompt on the same instance (loads and saves off, vLLM's cache reset);
* through the router, the next turn goes where the prefix is (the instance whose GPU and host
  memory hold it), and once that instance's copies are gone (its prefix cache reset, its host
  tier evicted: the events reach the router) it no longer prefers it (a tie broken by load);
* two tenants (``cache_salt``) never share: not in the pool, not in the router's view.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_engines import write_llama
from vllm_servers import eventually, post, prom, serve, stop, wait_healthy

pytest.importorskip("vllm")
pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1500)

from bsr.router import EventSubscriber, Router, RouterServer, block_digests  # noqa: E402

BLOCK, CHUNK = 32, 64
#: one object (2 layers x 64 tokens x 1 KiB of float32 K/V) with its header; the host tier
#: holds two
HOST_BYTES = 2 * (4096 + 2 * CHUNK * 1024)
NAMES = ("a", "b", "c")


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 37) % 490 for i in range(n)]


@dataclass
class Fleet:
    ports: dict[str, int]
    router: Router
    http: RouterServer
    model: Path

    def complete(
        self, name: str | None, tokens: list[int], **extra: Any
    ) -> tuple[list[int], int, str]:
        """Greedy completion on ``name`` (None: through the router): its tokens, the prompt
        tokens vLLM reports cached, and the instance that served it."""
        body = {
            "model": str(self.model), "prompt": tokens, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra,
        }  # fmt: skip
        if name is not None:
            out, via = post(self.ports[name], "/v1/completions", body), name
        else:
            req = urllib.request.Request(
                self.http.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                out, via = json.loads(r.read()), r.headers["x-bsr-instance"]
        choice = out["choices"][0]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return list(choice["token_ids"]), int(details.get("cached_tokens") or 0), via

    def saves(self, name: str) -> float:
        return prom(self.ports[name], "vllm:bsr_saves_total")

    def reset(self, name: str) -> None:
        port = self.ports[name]
        eventually(lambda: post(port, "/reset_prefix_cache", {}).get("success"), "a reset")

    def reference(self, name: str, tokens: list[int], **extra: Any) -> list[int]:
        """The same prompt recomputed on ``name``: its cache reset, no bsr load or save."""
        self.reset(name)
        opts = {"kv_transfer_params": {"bsr": {"load": False, "store": False}}}
        got, cached, _ = self.complete(name, tokens, **opts, **extra)
        assert cached == 0
        return got

    def match(self, name: str, tokens: list[int], salt: str | None = None) -> dict[str, int]:
        with self.router._lock:
            m = self.router.index.match(name, block_digests(tokens, BLOCK, cache_salt=salt))
        return m.by_medium


def kv_config(name: str, store: Path) -> dict[str, Any]:
    return {
        "kv_connector": "BsrConnector",
        "kv_connector_module_path": "bsr.vllm",
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


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from bsr.testing._ports import unheld_ports, wait_listening

    root = tmp_path_factory.mktemp("fleet-router")
    model, store = root / "model", root / "pool"
    write_llama(model)
    ports = dict(zip(NAMES, unheld_ports(len(NAMES)), strict=True))
    router = Router(
        {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}, BLOCK, shared_media=["STORAGE"]
    )
    events = EventSubscriber(router, "tcp://127.0.0.1:0").start()
    http = RouterServer(("127.0.0.1", 0), router)
    import threading

    threading.Thread(target=http.serve_forever, daemon=True).start()
    saved_env = dict(os.environ)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    procs = {}
    try:
        for name, port in ports.items():
            cfg = {
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": events.endpoint, "topic": name,
            }  # fmt: skip
            extra = ["--kv-events-config", json.dumps(cfg), "--dtype", "float32"]
            procs[name] = serve(model, port, root / f"{name}.log", kv_config(name, store), extra)
        for name, port in ports.items():
            wait_listening(procs[name], port, time.monotonic() + 900, "vllm serve", poll_s=0.5)
            wait_healthy(port, procs[name], root / f"{name}.log", time.monotonic() + 900)
        yield Fleet(ports, router, http, model)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for proc in procs.values():
            stop(proc)
        http.shutdown()
        http.server_close()
        events.close()


def settled(fn: Any, want: Any, timeout: float = 120) -> Any:
    """``fn()`` once it equals ``want``, or its last value after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (got := fn()) != want and time.monotonic() < end:
        time.sleep(0.2)
    return got


def turn(fleet: Fleet, name: str, tokens: list[int], **extra: Any) -> tuple[list[int], int]:
    """One turn on ``name``, its save awaited: the output tokens and the cached count."""
    before = fleet.saves(name)
    out, cached, _ = fleet.complete(name, tokens, **extra)
    eventually(lambda: fleet.saves(name) > before, f"{name}'s save")
    return out, cached


def test_a_conversation_across_three_instances_restores_from_the_pool(fleet: Fleet) -> None:
    history = prompt(1, 3 * CHUNK + 8)
    stored = 0  # the tokens of whole chunks the pool holds of this conversation
    for i, name in enumerate(NAMES):  # turn i on instance i: it never saw the earlier turns
        out, cached = turn(fleet, name, history)
        assert cached >= stored and (i == 0 or cached > 0), f"turn {i} on {name}: {cached}"
        assert out == fleet.reference(name, history), f"turn {i} on {name}"
        stored = len(history) // CHUNK * CHUNK
        history = history + out + prompt(10 + i, CHUNK)
    hits = [prom(fleet.ports[n], "vllm:prompt_tokens_cached_by_source_total", source="disk")
            for n in NAMES]  # fmt: skip
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > 0  # b and c read the pool
    CONVERSATION[:] = history


#: the conversation's prompt after the test above (the next tests continue it)
CONVERSATION: list[int] = []


def test_the_router_sends_a_turn_where_its_prefix_is_until_it_is_gone(fleet: Fleet) -> None:
    if not CONVERSATION:
        pytest.skip("needs the conversation test's turns")
    nxt = CONVERSATION + prompt(20, 40)
    # c served the last turn (its GPU and host tier hold it), b the one before, a the first
    eventually(lambda: fleet.match("c", nxt).get("GPU", 0) >= 8, "c's GPU events")
    held = fleet.match("c", nxt)["GPU"]  # the blocks of the last turn's prompt
    _, cached, via = fleet.complete(None, nxt)
    assert via == "c" and cached >= held * BLOCK
    assert fleet.router.snapshot()["reasons"] == {"prefix": 1}
    # c's copies go: its prefix cache reset (AllBlocksCleared), its host tier filled by others
    fleet.reset("c")
    for seed in range(3):
        turn(fleet, "c", prompt(30 + seed, 2 * CHUNK + 1))
    fleet.reset("c")
    eventually(lambda: set(fleet.match("c", nxt)) == {"STORAGE"}, "c's removals at the router")
    b, a = fleet.match("b", nxt), fleet.match("a", nxt)
    assert b.get("GPU", 0) > a.get("GPU", 0) > 0  # b's GPU holds turn 1, a's turn 0
    _, cached, via = fleet.complete(None, nxt)
    assert via == "b" and cached >= b["GPU"] * BLOCK
    assert fleet.router.snapshot()["reasons"] == {"prefix": 2}


def test_tenants_never_share_across_the_fleet(fleet: Fleet) -> None:
    tokens = prompt(40, 2 * CHUNK + 8)
    turn(fleet, "a", tokens, cache_salt="tenant-1")
    fleet.reset("a")
    want = {"a": {"CPU": 4}, "b": {"STORAGE": 4}, "c": {"STORAGE": 4}}  # a: its host tier
    got = settled(lambda: {n: fleet.match(n, tokens, "tenant-1") for n in NAMES}, want)
    assert got == want  # a's prefix cache reset: no longer on a's GPU
    for name in NAMES:  # the router names tenant-1's blocks apart from anyone else's
        assert fleet.match(name, tokens, "tenant-2") == {}
        assert fleet.match(name, tokens) == {}
    _, cached, _ = fleet.complete("b", tokens, cache_salt="tenant-2")
    assert cached == 0  # another tenant: nothing of tenant-1's in the pool is its
    _, cached, _ = fleet.complete("c", tokens, cache_salt="tenant-1")
    assert cached >= 2 * CHUNK  # the same tenant on another instance: from the pool
