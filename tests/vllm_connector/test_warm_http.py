"""The connector's warm endpoint (``bsr.vllm._warm_http``) over a real engine, no vLLM engine:
what a router may send, what it gets back, and what a bad or hostile request gets."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bsr

pytest.importorskip("vllm")
from bsr.vllm._adapters import AdapterBook
from bsr.vllm._bridge import LoopThread
from bsr.vllm._request_keys import salt_extras
from bsr.vllm._stats import BsrConnectorStats
from bsr.vllm._warm_http import (
    MAX_BODY_BYTES,
    WarmRequestError,
    WarmServer,
    WarmService,
    parse_warm,
)
from support.helpers import filled_cache

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 256),))
PROMPT = [3 + (i * 7) % 400 for i in range(16 * 5 + 3)]  # 5 full chunks
SALT = "tenant-a"


def request(address: str, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def post(address: str, body: dict[str, Any]) -> tuple[int, Any]:
    return request(address, "POST", "/bsr/warm", json.dumps(body).encode())


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[WarmService, bsr.RestoreEngine, LoopThread]]:
    """A FileTier holding PROMPT (salted with SALT) below an empty host tier, and the warm
    service of that engine on a free loopback port."""
    from bsr.testing._ports import unheld_ports

    ns = bsr.Namespace(model_id="warm-http")
    extras = bsr.KeyExtra.canonical(salt_extras(SALT))
    cache = filled_cache(LAYOUT, 16, 16, seed=1)
    loop = LoopThread()
    store = bsr.RestoreEngine(LAYOUT, [bsr.FileTier(tmp_path, 1 << 26)], namespace=ns)
    loop.call(store.open)
    loop.call(lambda: store.save(np.asarray(PROMPT), cache, list(range(6)), extras=extras))
    loop.call(store.aclose)
    engine = bsr.RestoreEngine(
        LAYOUT, [bsr.HostTier(1 << 26), bsr.FileTier(tmp_path, 1 << 26)], namespace=ns
    )
    loop.call(engine.open)
    (port,) = unheld_ports(1)
    svc = WarmService(
        engine, loop, AdapterBook(), BsrConnectorStats(), rank=0,
        address=f"127.0.0.1:{port}", timeout_s=10.0,
    )  # fmt: skip
    try:
        yield svc, engine, loop
    finally:
        svc.close()
        loop.call(engine.aclose)
        loop.close()


def test_a_warm_copies_the_salted_prefix_into_the_host_tier(service: Any) -> None:
    svc, engine, loop = service
    assert svc.server is not None
    unsalted = post(svc.server.address, {"prompt_token_ids": PROMPT})
    assert unsalted == (200, {**unsalted[1], "reason": "miss", "prefix_tokens": 0})
    status, answer = post(svc.server.address, {"prompt_token_ids": PROMPT, "cache_salt": SALT})
    assert status == 200, answer
    assert answer["reason"] == "warm" and answer["warm_tokens"] == 5 * 16
    assert answer["bytes_by_tier"] == {"file": 5 * LAYOUT.group_chunk_bytes("kv")}
    host = engine.tiers[0]
    assert host.usage().objects == 5
    # a restore now reads nothing from the file
    extras = bsr.KeyExtra.canonical(salt_extras(SALT))
    dst = bsr.PagedKVCache(LAYOUT, 16, 16)
    r = loop.call(lambda: engine.restore(np.asarray(PROMPT), dst, list(range(6)), extras=extras))
    assert r.committed and set(r.bytes_by_tier) == {"host"}
    stats = svc.stats.take().data
    assert stats["warms"] == {"miss": 1, "warm": 1}
    assert stats["warmed_bytes"] == {"file": 5 * LAYOUT.group_chunk_bytes("kv")}


def test_no_wait_answers_at_once_and_the_warm_still_lands(service: Any) -> None:
    svc, engine, _ = service
    body = {"prompt_token_ids": PROMPT, "cache_salt": SALT, "wait": False}
    assert post(svc.server.address, body) == (202, {"accepted": True})
    end = time.monotonic() + 60
    while engine.tiers[0].usage().objects < 5:
        assert time.monotonic() < end, "the warm never landed"
        time.sleep(0.01)


def test_an_adapter_not_loaded_here_is_a_conflict_not_a_guess(service: Any) -> None:
    svc, engine, _ = service
    status, answer = post(svc.server.address, {"prompt_token_ids": PROMPT, "lora_int_id": 7})
    assert status == 409 and "7" in answer["error"]
    assert engine.tiers[0].usage().objects == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"not json", "body"),
        (b"[1, 2]", "body"),
        (b'{"prompt_token_ids": []}', "prompt_token_ids"),
        (b'{"prompt_token_ids": [1, -2]}', "prompt_token_ids"),
        (b'{"prompt_token_ids": [1, true]}', "prompt_token_ids"),
        (b'{"prompt_token_ids": [1], "cache_salt": 5}', "cache_salt"),
        (b'{"prompt_token_ids": [1], "lora_int_id": "a"}', "lora_int_id"),
        (b'{"prompt_token_ids": [1], "deadline_s": 0}', "deadline_s"),
        (b'{"prompt_token_ids": [1], "deadline_s": 1e9}', "deadline_s"),
        (b'{"prompt_token_ids": [1], "wait": 1}', "wait"),
        (b'{"prompt_token_ids": [1], "tokens": [1]}', "tokens"),
    ],
)
def test_a_bad_body_is_a_400_naming_its_field(service: Any, body: bytes, field: str) -> None:
    svc, engine, _ = service
    with pytest.raises(WarmRequestError) as err:
        parse_warm(body)
    assert err.value.fields["key"] == field
    status, answer = request(svc.server.address, "POST", "/bsr/warm", body)
    assert (status, answer["field"]) == (400, field)
    assert engine.tiers[0].usage().objects == 0


def test_other_paths_methods_and_oversized_bodies_are_refused(service: Any) -> None:
    svc, _, _ = service
    address = svc.server.address
    assert request(address, "POST", "/bsr/other", b"{}")[0] == 404
    assert request(address, "GET", "/bsr/warm")[0] == 405
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:  # a body announced over the bound is refused before it is read
        conn.putrequest("POST", "/bsr/warm")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()


def test_a_port_in_use_is_a_config_error_naming_the_option(service: Any) -> None:
    svc, _, _ = service
    with pytest.raises(bsr.ConfigError) as err:
        WarmServer(svc.server.address, lambda r: (200, {}))
    assert err.value.fields["key"] == "bsr_connector.warm_address"


def test_idle_connections_past_the_bound_are_closed_not_given_threads() -> None:
    """A client that opens connections and sends nothing holds at most ``max_connections``
    threads; another connection is closed unanswered, and served again once one is let go."""
    from bsr.testing._ports import unheld_ports

    (port,) = unheld_ports(1)
    server = WarmServer(
        f"127.0.0.1:{port}", lambda r: (200, {"n": len(r.tokens)}), max_connections=2
    )
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        end = time.monotonic() + 30
        while server.refused == 0:  # until the server has taken both idle ones and refused one
            assert time.monotonic() < end, "the third connection was never refused"
            with pytest.raises((http.client.HTTPException, OSError)):
                post(server.address, {"prompt_token_ids": [1, 2]})
        idle.pop().close()  # its thread reads EOF and gives its place back
        while True:
            try:
                assert post(server.address, {"prompt_token_ids": [1, 2]}) == (200, {"n": 2})
                break
            except (http.client.HTTPException, OSError):
                assert time.monotonic() < end, "a freed place was never served again"
                time.sleep(0.01)
    finally:
        for s in idle:
            s.close()
        server.close()
