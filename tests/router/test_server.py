"""The router's sockets: events over a real ZMQ PUB -> SUB link in vLLM's wire format (msgpack
batches ``[ts, events, dp_rank]``, frames ``topic, seq, payload``), requests over real HTTP to
instances that answer with what they were sent (vLLM's side of a fleet is in
tests/vllm_connector/test_fleet_router.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bsr.router import EventSubscriber, Router, RouterServer, decode_batch

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

B = 4
PROMPT = list(range(100, 116))  # four blocks


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        name = self.server.name  # type: ignore[attr-defined]
        out = json.dumps({"name": name, "body": json.loads(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def serve(server: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return t


def eventually(fn: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"never: {what}")


class Fleet:
    def __init__(self, policy: str, names: tuple[str, ...] = ("a", "b", "c")) -> None:
        self.echoes = []
        urls = {}
        for name in names:
            s = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
            s.name = name  # type: ignore[attr-defined]
            serve(s)
            self.echoes.append(s)
            urls[name] = f"http://127.0.0.1:{s.server_address[1]}"
        self.router = Router(urls, B, policy=policy, shared_media=["STORAGE"])
        self.events = EventSubscriber(self.router, "tcp://127.0.0.1:0").start()
        self.http = RouterServer(("127.0.0.1", 0), self.router)
        serve(self.http)
        self.ctx = zmq.Context()
        self.pubs: dict[str, Any] = {}
        self.seq: dict[str, int] = {}

    def publish(self, topic: str, events: list[dict[str, Any]], seq: int | None = None) -> None:
        """One batch from ``topic``'s publisher; waits until the router has applied it."""
        pub = self.pubs.get(topic)
        if pub is None:
            pub = self.pubs[topic] = self.ctx.socket(zmq.PUB)
            pub.connect(self.events.endpoint)
        n = self.seq.get(topic, -1) + 1 if seq is None else seq
        self.seq[topic] = n
        payload = msgspec.msgpack.encode([time.time(), events, None])
        stats = self.router.stats

        def applied() -> bool:  # PUB drops what it sends before the link is up: send again
            before = stats.batches.get(topic, 0) + stats.unknown_topics + stats.bad_batches
            pub.send_multipart([topic.encode(), n.to_bytes(8, "big"), payload])
            return bool(
                eventually(
                    lambda: (
                        stats.batches.get(topic, 0) + stats.unknown_topics + stats.bad_batches
                        > before
                    ),
                    "the batch applied",
                    timeout=0.5,
                )
            )

        eventually(lambda: _quiet(applied), f"{topic} batch {n}")

    def post(self, body: Any, path: str = "/v1/completions") -> tuple[int, dict[str, Any], str]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.http.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read()), r.headers.get("x-bsr-instance", "")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), ""

    def close(self) -> None:
        for p in self.pubs.values():
            p.close(linger=0)
        self.ctx.term()
        self.events.close()
        self.http.shutdown()
        self.http.server_close()
        for s in self.echoes:
            s.shutdown()
            s.server_close()


def _quiet(fn: Callable[[], bool]) -> bool:
    try:
        return fn()
    except AssertionError:
        return False


def stored(topic: str, blocks: int, medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [f"{topic}{i}".encode() for i in range(blocks)],
        "parent_block_hash": None,
        "token_ids": PROMPT[: blocks * B],
        "block_size": B,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


@pytest.fixture
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(getattr(request, "param", "prefix"))
    yield f
    f.close()


def test_a_request_goes_where_its_prefix_is_and_comes_back_unchanged(fleet: Fleet) -> None:
    fleet.publish("b", [stored("b", 2)])
    fleet.publish("c", [stored("c", 3)])
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    status, out, via = fleet.post(body)
    assert (status, via, out) == (200, "c", {"name": "c", "body": body})
    fleet.publish("c", [{"type": "BlockRemoved", "block_hashes": [b"c1"], "medium": "GPU"}])
    assert fleet.post(body)[2] == "b"  # c now holds one block, b two
    assert fleet.router.snapshot()["decisions"] == {"c": 1, "b": 1}
    # in flight until its handler ends (just after the answer's last byte)
    eventually(lambda: fleet.router.snapshot()["load"] == {"a": 0, "b": 0, "c": 0}, "no load")


def test_the_pool_serves_every_instance_and_load_breaks_the_tie(fleet: Fleet) -> None:
    fleet.publish("a", [stored("a", 4, "STORAGE")])
    body = {"prompt": [PROMPT]}
    fleet.router.load["a"] = 1  # a request in flight on a
    assert fleet.post(body)[2] == "b"
    fleet.router.load["a"] = 0
    assert fleet.router.snapshot()["reasons"] == {"prefix+load": 1}


def test_a_missed_batch_forgets_the_instance(fleet: Fleet) -> None:
    fleet.publish("c", [stored("c", 3)])
    fleet.publish("c", [], seq=5)  # 1..4 never arrived: what c holds is unknown now
    assert fleet.post({"prompt": PROMPT})[2] == "a"
    assert fleet.router.snapshot()["gaps"] == {"c": 1}


def test_unknown_topics_and_bad_batches_are_counted_not_applied(fleet: Fleet) -> None:
    fleet.publish("zz", [stored("zz", 4)])
    assert fleet.router.stats.unknown_topics >= 1
    fleet.router.on_batch("a", 0, b"\xc1 not msgpack")
    fleet.router.on_batch("a", 0, msgspec.msgpack.encode({"ts": 1}))
    assert fleet.router.stats.bad_batches == 2
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(msgspec.msgpack.encode([1.0]))


def test_bad_bodies_get_400_and_a_dead_instance_502(fleet: Fleet) -> None:
    status, out, _ = fleet.post(b"{not json")
    assert status == 400 and "bad JSON body" in out["error"]
    assert fleet.post(b"[1, 2]")[0] == 400
    dead = fleet.echoes[0]
    dead.shutdown()
    dead.server_close()
    status, out, _ = fleet.post({"prompt": PROMPT})  # nothing held: a, the first, by load
    assert status == 502 and out["error"].startswith("instance a:")
    assert fleet.router.stats.errors == 1
    eventually(lambda: fleet.router.snapshot()["load"]["a"] == 0, "a's load back to 0")


@pytest.mark.parametrize("fleet", ["round_robin"], indirect=True)
def test_round_robin_ignores_the_events(fleet: Fleet) -> None:
    fleet.publish("c", [stored("c", 4)])
    assert [fleet.post({"prompt": PROMPT})[2] for _ in range(4)] == list("abca")


def test_bad_router_arguments_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="at least one instance"):
        Router({}, 16)
    with pytest.raises(ValueError, match="is not http://host:port"):
        Router({"a": "localhost:80"}, 16)
    with pytest.raises(ValueError, match="policy 'lru'"):
        Router({"a": "http://127.0.0.1:1"}, 16, policy="lru")


def test_the_command_proxies_and_stops_on_sigterm(tmp_path: Any) -> None:
    """``bsr router`` as a user runs it: listening where told, proxying to the instances, and
    ending with 0 on SIGTERM; a bad instance is a usage error (2) naming the flag's form."""
    import signal
    import subprocess
    import sys

    from bsr.testing._ports import unheld_ports

    echo = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    echo.name = "only"  # type: ignore[attr-defined]
    serve(echo)
    (port,) = unheld_ports(1)
    cmd = [sys.executable, "-m", "bsr", "router", "--listen", f"127.0.0.1:{port}",
           "--events", "tcp://127.0.0.1:0", "--block-size", str(B),
           "--instance", f"only=http://127.0.0.1:{echo.server_address[1]}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith(f"bsr.router: http://127.0.0.1:{port}"), line
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": PROMPT}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["x-bsr-instance"] == "only"
            assert json.loads(r.read())["body"] == {"prompt": PROMPT}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        echo.shutdown()
        echo.server_close()
    bad = subprocess.run(
        [sys.executable, "-m", "bsr", "router", "--block-size", "4", "--instance", "nourl"],
        capture_output=True,
    )
    assert bad.returncode == 2 and b"expected NAME=http://host:port" in bad.stderr
