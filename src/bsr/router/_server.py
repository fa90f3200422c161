"""The reference router: KV events in over ZMQ, OpenAI requests proxied over HTTP.

Every instance runs vLLM with ``--kv-events-config`` publishing (``"publisher": "zmq"``) to the
router's endpoint, with the instance's name as its ``topic``; the router binds one SUB socket
there (each publisher connects). Requests (``/v1/completions``, ``/v1/chat/completions``) are
routed by a policy (:mod:`bsr.router._policy`) and proxied unchanged; the answer carries the
header ``x-bsr-instance``. ``GET /router/stats`` says what it decided and what it knows.

A missed event batch (a gap in an instance's sequence numbers) makes the router forget that
instance's holdings: it may then under-claim, never over-claim (what the instance announces
next is learnt again).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ._index import FleetIndex, block_digests
from ._policy import Choice, PrefixPolicy, RoundRobinPolicy

__all__ = ["EventSubscriber", "PDSplit", "Router", "RouterServer", "decode_batch"]

#: requests proxied at once (each a thread); one past it is answered 503 at once
MAX_CONNECTIONS = 64


def decode_batch(payload: bytes) -> tuple[float, list[Any]]:
    """One of vLLM's ``KVEventBatch`` payloads (msgpack, array-like: ``[ts, events, dp_rank]``;
    each event a map tagged ``"type"``) as ``(ts, events)``, the events as dicts."""
    import msgspec

    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a KV event batch: {e}") from e
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, ...]")
    return float(raw[0]), [e for e in raw[1] if isinstance(e, dict)]


@dataclass
class _Stats:
    decisions: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    prefix_blocks: dict[str, int] = field(default_factory=dict)
    batches: dict[str, int] = field(default_factory=dict)
    gaps: dict[str, int] = field(default_factory=dict)
    unknown_topics: int = 0
    bad_batches: int = 0
    errors: int = 0


class Router:
    """The routing state: instances, the index of what each holds, the policy and the load.

    Thread-safe: the event thread and the request threads share it under one lock.

    Args:
        instances: name -> base URL (``http://host:port``) of each instance, in tie-break order.
        block_size: the instances' KV block size (tokens); a request's blocks are named with it.
        policy: ``"prefix"`` (:class:`PrefixPolicy`) or ``"round_robin"``.
        shared_media: media every instance reads (the pool), e.g. ``("STORAGE",)``.
        tokenizer: optional callable ``text -> token ids`` (a text prompt is routed by load
            without one).
    """

    def __init__(
        self,
        instances: dict[str, str],
        block_size: int,
        *,
        policy: str = "prefix",
        shared_media: Sequence[str] = (),
        tokenizer: Any = None,
    ) -> None:
        if not instances:
            raise ValueError("a router needs at least one instance (name=http://host:port)")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        for name, url in instances.items():
            u = urllib.parse.urlsplit(url)
            if u.scheme != "http" or not u.hostname or not u.port:
                raise ValueError(f"instance {name}: {url!r} is not http://host:port")
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"policy {policy!r}: choose one of ['prefix', 'round_robin']")
        self.instances = dict(instances)
        self.block_size = block_size
        self.policy: PrefixPolicy | RoundRobinPolicy = (
            PrefixPolicy() if policy == "prefix" else RoundRobinPolicy()
        )
        self.index = FleetIndex(shared_media)
        for name in instances:
            self.index.add_instance(name)
        self.tokenizer = tokenizer
        self.load: dict[str, int] = dict.fromkeys(instances, 0)
        self.stats = _Stats()
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def on_batch(self, topic: str, seq: int, payload: bytes) -> None:
        """Apply one published batch of the instance named ``topic``."""
        with self._lock:
            if topic not in self.instances:
                self.stats.unknown_topics += 1
                return
            try:
                _ts, events = decode_batch(payload)
            except ValueError:
                self.stats.bad_batches += 1
                return
            last = self._seq.get(topic)
            if last is not None and seq != last + 1:
                self.stats.gaps[topic] = self.stats.gaps.get(topic, 0) + 1
                self.index.forget(topic)
            self._seq[topic] = seq
            self.index.apply(topic, events)
            self.stats.batches[topic] = self.stats.batches.get(topic, 0) + 1

    def count_bad_batch(self) -> None:
        """A frame set that is not a batch (the event thread; counted under the lock)."""
        with self._lock:
            self.stats.bad_batches += 1

    def count_error(self) -> None:
        """A request its instance did not answer (request threads; counted under the lock)."""
        with self._lock:
            self.stats.errors += 1

    def tokens_of(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, when the request gives them or the tokenizer can make them."""
        if path.endswith("/completions") and not path.endswith("/chat/completions"):
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
                p = p[0]
            if isinstance(p, list) and all(isinstance(t, int) for t in p):
                return [int(t) for t in p]
            if isinstance(p, str) and self.tokenizer is not None:
                return list(self.tokenizer(p))
            return None
        messages = body.get("messages")
        if messages is not None and hasattr(self.tokenizer, "apply_chat_template"):
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        return None

    def choose(self, path: str, body: dict[str, Any]) -> Choice:
        """Pick the instance for one request (and count it in flight: :meth:`done` ends it)."""
        tokens = self.tokens_of(path, body) or []
        salt = body.get("cache_salt")
        digests = block_digests(
            tokens, self.block_size, cache_salt=salt if isinstance(salt, str) else None
        )
        with self._lock:
            choice = self.policy.choose(self.index, list(self.instances), digests, self.load)
            self.load[choice.instance] += 1
            s = self.stats
            s.decisions[choice.instance] = s.decisions.get(choice.instance, 0) + 1
            s.reasons[choice.reason] = s.reasons.get(choice.reason, 0) + 1
            if choice.match is not None:
                s.prefix_blocks[choice.instance] = (
                    s.prefix_blocks.get(choice.instance, 0) + choice.match.blocks
                )
        return choice

    def done(self, instance: str) -> None:
        with self._lock:
            self.load[instance] -= 1

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /router/stats`` answers."""
        with self._lock:
            s = self.stats
            return {
                "policy": self.policy.name,
                "block_size": self.block_size,
                "instances": self.instances,
                "load": dict(self.load),
                "decisions": dict(s.decisions),
                "reasons": dict(s.reasons),
                "prefix_blocks": dict(s.prefix_blocks),
                "batches": dict(s.batches),
                "gaps": dict(s.gaps),
                "unknown_topics": s.unknown_topics,
                "bad_batches": s.bad_batches,
                "errors": s.errors,
                "skipped_orphans": self.index.skipped_orphans,
                "held": {
                    name: {m: self.index.held_count(name, m) for m in ("GPU", "CPU", "STORAGE")}
                    for name in self.instances
                },
            }


class EventSubscriber:
    """The router's SUB socket: bound at ``endpoint``, every instance's publisher connects.

    ``start()`` runs it on a daemon thread; ``close()`` stops it within ``poll_ms``.
    """

    def __init__(self, router: Router, endpoint: str, poll_ms: int = 100) -> None:
        import zmq

        self.router = router
        self.poll_ms = poll_ms
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bsr-router-events", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(self.poll_ms):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 3:
                    self.router.count_bad_batch()
                    continue
                topic, seq, payload = frames
                self.router.on_batch(
                    topic.decode("utf-8", "replace"), int.from_bytes(seq, "big"), payload
                )
        finally:
            self._sock.close(linger=0)
            self._ctx.term()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:  # never started: the socket is still ours to close
            self._sock.close(linger=0)
            self._ctx.term()


@dataclass
class PDSplit:
    """Prefill and decode on separate instances, through bsr's pool.

    Each request is sent first to the prefill instance (a ``kv_producer``: it computes the
    prompt and saves it) with ``max_tokens`` 1, then to the decode instance (a
    ``kv_consumer``: it loads the prompt from the pool and prefills only what it cannot load).
    Between the two the proxy asks the decode instance's warm endpoint (``warm_address`` of
    its connector, ``POST /bsr/warm``) for the prompt until the pool holds all of its whole
    chunks (the save has landed; the warm also copies them into the decode instance's host
    tier), at most ``await_s``: past it the decode side is sent the request anyway and
    recomputes what it cannot load (counted). Both instances see the same request (tokens,
    ``cache_salt``, ``kv_transfer_params``), so both derive the same bsr keys.

    Args:
        prefill: base URL of the prefill instance.
        decode: base URL of the decode instance.
        decode_warm: ``http://host:port`` of the decode instance's warm endpoint.
        chunk_tokens: bsr's chunk size on both (the save covers whole chunks).
        await_s: the longest wait for the prefill's save (seconds).
    """

    prefill: str
    decode: str
    decode_warm: str
    chunk_tokens: int
    await_s: float = 5.0
    poll_s: float = 0.05
    requests: int = 0
    await_timeouts: int = 0
    decode_prefilled_tokens: int = 0
    prompt_tokens: int = 0

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "await_timeouts": self.await_timeouts,
            "prompt_tokens": self.prompt_tokens,
            "decode_prefilled_tokens": self.decode_prefilled_tokens,
        }


class RouterServer(ThreadingHTTPServer):
    """The router's HTTP side: proxies each request to the instance :meth:`Router.choose`
    picks (or, with ``pd``, through a prefill and a decode instance: :class:`PDSplit`), at most
    :data:`MAX_CONNECTIONS` at once."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        router: Router,
        timeout_s: float = 600.0,
        pd: PDSplit | None = None,
    ) -> None:
        self.router = router
        self.timeout_s = timeout_s
        self.pd = pd
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: RouterServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, doc: Any) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/router/stats":
            snap = self.server.router.snapshot()
            if self.server.pd is not None:
                snap["pd"] = self.server.pd.stats()
            self._json(200, snap)
        elif self.path == "/health":
            self._json(200, {"ok": True})
        else:
            self._json(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if not self.server.slots.acquire(blocking=False):
            self._json(503, {"error": "the router is at its connection bound"})
            return
        try:
            self._proxy()
        finally:
            self.server.slots.release()

    def _proxy(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as e:
            self._json(400, {"error": f"bad JSON body: {e}"})
            return
        router = self.server.router
        if self.server.pd is not None:
            self._split(self.server.pd, body, raw)
            return
        choice = router.choose(self.path, body)
        try:
            self._forward(choice.instance, raw)
        except OSError as e:
            router.count_error()
            self._json(502, {"error": f"instance {choice.instance}: {e}"})
        finally:
            router.done(choice.instance)

    def _split(self, pd: PDSplit, body: dict[str, Any], raw: bytes) -> None:
        """Prefill on one instance, wait for its save, decode on the other."""
        tokens = self.server.router.tokens_of(self.path, body)
        first = {**body, "max_tokens": 1, "stream": False}
        first.pop("stream_options", None)
        try:
            status, _ = _post(pd.prefill, self.path, first, self.server.timeout_s)
        except OSError as e:
            self._json(502, {"error": f"prefill instance: {e}"})
            return
        if status != 200:
            self._json(502, {"error": f"prefill instance answered {status}"})
            return
        pd.requests += 1
        if tokens:
            pd.prompt_tokens += len(tokens)
            if not self._await_save(pd, body, tokens):
                pd.await_timeouts += 1
        try:
            self._forward_to(pd.decode, raw, "decode", on_body=self._count_prefill(pd, tokens))
        except OSError as e:
            self._json(502, {"error": f"decode instance: {e}"})

    def _await_save(self, pd: PDSplit, body: dict[str, Any], tokens: list[int]) -> bool:
        """Ask the decode side's warm endpoint until the pool holds every whole chunk of
        ``tokens`` (True), or ``await_s`` passes (False)."""
        want = len(tokens) // pd.chunk_tokens * pd.chunk_tokens
        if want == 0:
            return True
        ask: dict[str, Any] = {"prompt_token_ids": tokens}
        if isinstance(body.get("cache_salt"), str):
            ask["cache_salt"] = body["cache_salt"]
        end = time.monotonic() + pd.await_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            ask["deadline_s"] = max(0.01, min(left, 1.0))
            try:
                status, out = _post(pd.decode_warm, "/bsr/warm", ask, max(1.0, left))
            except OSError:
                status, out = 0, {}
            if status == 200 and int(out.get("prefix_tokens") or 0) >= want:
                return True
            time.sleep(min(pd.poll_s, max(0.0, end - time.monotonic())))

    @staticmethod
    def _count_prefill(pd: PDSplit, tokens: list[int] | None) -> Any:
        def count(data: bytes) -> None:
            try:
                usage = json.loads(data).get("usage") or {}
            except ValueError:
                return  # a stream: its usage is not counted
            details = usage.get("prompt_tokens_details") or {}
            n = int(usage.get("prompt_tokens") or (len(tokens) if tokens else 0))
            pd.decode_prefilled_tokens += n - int(details.get("cached_tokens") or 0)

        return count

    def _forward(self, instance: str, raw: bytes) -> None:
        self._forward_to(self.server.router.instances[instance], raw, instance)

    def _forward_to(self, base: str, raw: bytes, instance: str, on_body: Any = None) -> None:
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=self.server.timeout_s)
        try:
            conn.request("POST", self.path, body=raw, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
            self.send_header("x-bsr-instance", instance)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            seen = bytearray()
            for chunk in _chunks(resp):
                if on_body is not None and len(seen) < (1 << 20):
                    seen += chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            if on_body is not None and resp.status == 200:
                on_body(bytes(seen))  # counted before the answer ends: a client reading the
                # stats right after its answer sees its request in them
            self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()


def _post(base: str, path: str, body: Any, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; the status and the JSON answer (``{}`` when it is not JSON)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout_s)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
        try:
            out = json.loads(data)
        except ValueError:
            out = {}
        return resp.status, out if isinstance(out, dict) else {}
    finally:
        conn.close()


def _chunks(resp: http.client.HTTPResponse, size: int = 1 << 16) -> Iterator[bytes]:
    while True:
        chunk = resp.read1(size)
        if not chunk:
            return
        yield chunk
