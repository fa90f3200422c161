"""The warm endpoint: a router tells a vLLM instance which prefix it is about to send there.

Where it runs: every worker process of a vLLM instance whose connector options set
``warm_address`` (``"127.0.0.1:8601"``): tensor-parallel rank ``r`` listens on that port plus
``r`` (each rank warms its own objects, as each restores its own).

How it works: one ``ThreadingHTTPServer`` on a daemon thread answers ``POST /bsr/warm`` with a
JSON body (:func:`parse_warm`): ``prompt_token_ids`` (the token ids the request will carry),
optional ``cache_salt`` and ``lora_int_id`` (the request's, so the warm reads the keys its
request will look up), optional ``deadline_s`` and ``wait``. The handler (the worker's) runs
:meth:`bsr.RestoreEngine.warm` on the engine's event loop and answers 200 with the
:class:`~bsr.WarmResult` as JSON, or 202 at once with ``"wait": false``. A bad body is a 400
naming the field; a body larger than :data:`MAX_BODY_BYTES` is a 413, read no further; any
other path a 404, any other method a 405. The server reads nothing a client sends past those
bounds and never blocks the engine: the warm itself is bounded by the engine (its concurrency,
budget and the deadline), and at most :data:`MAX_CONNECTIONS` connections are served at once
(each a thread, dropped after 10 s without a whole request; another connection is closed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from bsr import Check, KeyExtra, WarmResult

from .._errors import ConfigError
from .._log import logger
from ._adapters import adapter_marker
from ._request_keys import salt_extras

#: the path routers POST to
WARM_PATH = "/bsr/warm"
#: the largest body read (a 1M-token prompt as JSON is about 8 MB)
MAX_BODY_BYTES = 1 << 24
#: the most tokens one warm carries (the lookup socket's bound)
MAX_WARM_TOKENS = 1 << 22
#: the longest deadline a warm may ask for (seconds)
MAX_DEADLINE_S = 600.0
#: connections served at once (each holds a thread); another is closed unanswered
MAX_CONNECTIONS = 16


class WarmRequestError(ConfigError):
    """A warm request's body is invalid (answered 400 with this message)."""


@dataclass(frozen=True)
class WarmRequest:
    """A parsed ``POST /bsr/warm`` body."""

    tokens: tuple[int, ...]
    cache_salt: str | None = None
    lora_int_id: int | None = None
    deadline_s: float | None = None
    wait: bool = True


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise WarmRequestError(f"{name}: must be {what}, got {type(value).__name__}", key=name)
    return value


def parse_warm(raw: bytes) -> WarmRequest:
    """Parse and check a warm body (:class:`WarmRequestError` names the bad field)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WarmRequestError(f"the body is not JSON: {exc}", key="body") from None
    if not isinstance(body, dict):
        raise WarmRequestError("the body must be a JSON object", key="body")
    known = {"prompt_token_ids", "cache_salt", "lora_int_id", "deadline_s", "wait"}
    unknown = sorted(str(k)[:64] for k in body if k not in known)
    if unknown:
        raise WarmRequestError(
            f"unknown field {unknown[0]!r}; the fields are {sorted(known)}", key=unknown[0]
        )
    tokens = body.get("prompt_token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise WarmRequestError(
            "prompt_token_ids: must be a non-empty list of token ids", key="prompt_token_ids"
        )
    if len(tokens) > MAX_WARM_TOKENS or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in tokens
    ):
        raise WarmRequestError(
            f"prompt_token_ids: must hold at most {MAX_WARM_TOKENS} ids, each an int >= 0",
            key="prompt_token_ids",
        )
    salt = _field(body, "cache_salt", (str,), "a string")
    lora = _field(body, "lora_int_id", (int,), "an int (vLLM's lora_int_id)")
    deadline = _field(body, "deadline_s", (int, float), "a number of seconds")
    if deadline is not None and not 0 < deadline <= MAX_DEADLINE_S:
        raise WarmRequestError(
            f"deadline_s: must be > 0 and at most {MAX_DEADLINE_S}, got {deadline!r}",
            key="deadline_s",
        )
    wait = _field(body, "wait", (bool,), "true or false")
    return WarmRequest(
        tuple(tokens), salt, lora, None if deadline is None else float(deadline),
        True if wait is None else wait,
    )  # fmt: skip


#: ``handle(request) -> (HTTP status, JSON answer)``; called on the server's threads
Handler = Callable[[WarmRequest], tuple[int, dict[str, Any]]]


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: a connection past them is
    closed at once (a client holding idle connections cannot make the server spawn threads
    without bound; each one it holds is dropped after the handler's timeout)."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class WarmServer:
    """``POST /bsr/warm`` on ``host:port`` (see the module docstring); :meth:`close` stops it.
    At most ``max_connections`` connections are served at once (another is closed unanswered).

    Raises:
        ConfigError: the address cannot be bound (in use, or not a local address).
    """

    def __init__(
        self,
        address: str,
        handle: Handler,
        *,
        rank: int = 0,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        host, port = Check.host_port(address, "bsr_connector.warm_address")
        port += rank
        handler = _handler_class(handle)
        server = type("_Server", (_BoundedServer,), {"max_connections": max_connections})
        try:
            self._httpd = server((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"bsr_connector.warm_address: cannot listen on {host}:{port} (rank {rank} uses "
                f"the port plus its rank): {exc}; pick a free port",
                key="bsr_connector.warm_address",
            ) from None
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="bsr-warm-http", daemon=True
        )
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections closed unanswered because ``max_connections`` were being served."""
        return int(self._httpd.refused)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def _handler_class(handle: Handler) -> type[BaseHTTPRequestHandler]:
    class _Warm(BaseHTTPRequestHandler):
        server_version = "bsr-warm"
        timeout = 10.0  # a client that stops sending mid-body is dropped

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("bsr.vllm.warm_http", line=format % args)

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(data)

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != WARM_PATH:
                return self._answer(404, {"error": f"not found; POST {WARM_PATH}"})
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._answer(411, {"error": "a Content-Length header is required"})
            if length > MAX_BODY_BYTES or length < 0:
                self.close_connection = True
                return self._answer(413, {"error": f"the body is over {MAX_BODY_BYTES} bytes"})
            try:
                request = parse_warm(self.rfile.read(length))
            except WarmRequestError as exc:
                return self._answer(400, {"error": str(exc), "field": exc.fields.get("key")})
            try:
                status, body = handle(request)
            except Exception as exc:  # the handler's bug is a 500, never a dead server
                logger.warning("bsr.vllm.warm_failed", error=repr(exc))
                status, body = 500, {"error": "the warm failed; see the server's log"}
            return self._answer(status, body)

        def _not_allowed(self) -> None:
            self._answer(405, {"error": f"use POST {WARM_PATH}"})

        do_GET = do_PUT = do_DELETE = do_PATCH = _not_allowed

    return _Warm


def result_json(result: WarmResult) -> dict[str, Any]:
    """A :class:`~bsr.WarmResult` as the endpoint's answer (every field but ``kind``: always
    ``"warm"`` here)."""
    out = dataclasses.asdict(result)
    del out["kind"]
    return out


class WarmService:
    """A worker's warms and promotions: the endpoint (when ``address`` is set), the engine's
    background task on its loop (it runs promotions as restores queue them, and idles when the
    engine's ``promote`` is ``"never"``), and their counters in the connector's stats.

    Args:
        engine: the rank's open engine.
        loop: the loop thread that owns it.
        adapters: the worker's adapter book (binds a warm's ``lora_int_id`` to the weights).
        stats: the worker's connector stats.
        rank: the tensor-parallel rank (the port offset; request counts on rank 0 only).
        address: ``host:port`` of rank 0's endpoint, or None for no endpoint.
        timeout_s: a warm's deadline when its request gives none.
    """

    def __init__(
        self,
        engine: Any,
        loop: Any,
        adapters: Any,
        stats: Any,
        *,
        rank: int,
        address: str | None,
        timeout_s: float,
    ) -> None:
        self.engine, self.loop, self.adapters, self.stats = engine, loop, adapters, stats
        self.rank, self.timeout_s = rank, timeout_s
        self._unsubscribe = engine.subscribe(self._on_record)
        self._background = loop.submit(engine.run_background)
        self.server: WarmServer | None = None
        if address is not None:
            try:
                self.server = WarmServer(address, self.handle, rank=rank)
            except BaseException:
                self.close()
                raise

    def handle(self, request: WarmRequest) -> tuple[int, dict[str, Any]]:
        """Run one warm on the engine's loop (the endpoint's handler)."""
        extras = list(salt_extras(request.cache_salt))
        if request.lora_int_id is not None:
            extras.append(adapter_marker(_Lora(request.lora_int_id)))
        resolved = self.adapters.resolve(KeyExtra.canonical(extras))
        if resolved is None:
            return 409, {"error": f"LoRA adapter {request.lora_int_id} is not loaded here"}
        deadline = request.deadline_s or self.timeout_s
        tokens = np.asarray(request.tokens, dtype=np.int64)
        fut = self.loop.submit(self._warm, tokens, resolved, deadline)
        if not request.wait:
            return 202, {"accepted": True}
        try:
            result = fut.result(timeout=deadline + 5.0)
        except TimeoutError:  # the engine's deadline ends it well before: say so, never hang
            fut.cancel()
            return 504, {"error": f"the warm did not end within {deadline + 5.0} s"}
        return 200, result_json(result)

    async def _warm(self, tokens: Any, extras: Any, deadline_s: float) -> Any:
        return await self.engine.warm(tokens, extras=extras, deadline_s=deadline_s)

    def _on_record(self, record: Any) -> None:
        if not isinstance(record, WarmResult):
            return
        if self.rank == 0:  # request counts from rank 0, bytes from every rank
            name = "promotions" if record.kind == "promotion" else "warms"
            self.stats.count_key(name, record.reason)
        for tier, n in record.bytes_by_tier.items():
            self.stats.count_key("warmed_bytes", tier, n)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._background.cancel()
        self._unsubscribe()


@dataclass(frozen=True)
class _Lora:
    """What :func:`~bsr.vllm._adapters.adapter_marker` reads of a ``LoRARequest``."""

    lora_int_id: int
