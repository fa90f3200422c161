"""Sync bridges: vLLM's threads into bsr's event loop, and vLLM's scheduler to its worker.

Where it runs: :class:`LoopThread` in vLLM's worker process (one per connector);
:class:`LookupServer` beside it on tensor-parallel rank 0; :class:`LookupClient` in vLLM's
scheduler (the EngineCore process, a different process from the worker on the CPU build).

How it works: ``LoopThread`` is an anyio blocking portal, one event loop on one background
thread that owns the :class:`~bsr.RestoreEngine`; vLLM's synchronous hooks ``call`` into it (wait
for the result) or ``submit`` (get a ``concurrent.futures.Future``). The scheduler has no KV
tensors and no engine: it asks the worker's engine for a metadata-only probe over a Unix socket
whose path both sides derive from vLLM's ``engine_id``. One request is ``b"L"``, a little-endian
uint32 token count and the tokens as int64; the answer is one int64, the reusable prefix in
tokens (0 on any failure). Every wait on either side is bounded by a timeout, so a hung store
costs the scheduler at most ``timeout_s`` per lookup, never a hang.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import numpy as np

from .._log import logger

T = TypeVar("T")
_HEADER = struct.Struct("<cI")
_ANSWER = struct.Struct("<q")
#: Largest prompt a lookup carries (tokens); longer prompts are probed on their first part.
MAX_LOOKUP_TOKENS = 1 << 22


async def _noop() -> None:
    return None


class LoopThread:
    """One anyio event loop on a background thread, entered from synchronous code."""

    def __init__(self, backend: str = "asyncio") -> None:
        self._cm = anyio.from_thread.start_blocking_portal(backend)
        self._portal = self._cm.__enter__()
        self._closed = False

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on the loop and wait for its result."""
        return self._portal.call(fn, *args)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` on the loop; returns at once with a future of its result."""
        return self._portal.start_task_soon(fn, *args)

    def call_bounded(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T | None:
        """``await fn(*args)`` on the loop, waiting at most ``timeout`` s (then ``None``).

        A call that overruns is cancelled, and the loop then runs one no-op before this returns,
        so the cancellation has reached the task: nothing it does on the loop after its next
        await can happen (bsr installs into the cache on the loop, each after an await).
        """
        fut = self.submit(fn, *args)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self.call(_noop)
            logger.warning("bsr.vllm.call_overran", call=getattr(fn, "__name__", "?"), s=timeout)
            return None

    def close(self) -> None:
        """Stop the loop (pending tasks are cancelled)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._cm.__exit__(None, None, None)


def socket_path(engine_id: str, rank: int = 0) -> str:
    """Where rank ``rank`` of vLLM engine ``engine_id`` serves lookups (short: AF_UNIX limit)."""
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return str(Path(tempfile.gettempdir()) / f"bsr-vllm-{digest}-{rank}.sock")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the lookup connection")
        buf += chunk
    return bytes(buf)


class LookupServer:
    """Answers the scheduler's lookups with ``lookup(tokens) -> prefix tokens`` (worker side).

    Args:
        path: the Unix socket path (:func:`socket_path`).
        lookup: called with an int64 numpy array; returns the reusable prefix in tokens. It runs
            on the server's threads and must bound its own wait (the connector's does).
    """

    def __init__(self, path: str, lookup: Callable[[np.ndarray], int]) -> None:
        self.path = path
        self._lookup = lookup
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="bsr-vllm-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="bsr-vllm-lookup-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._stop.is_set():
                try:
                    op, n = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                    if op != b"L" or n > MAX_LOOKUP_TOKENS:
                        return
                    tokens = np.frombuffer(_recv_exact(conn, 8 * n), dtype="<i8")
                except (OSError, ConnectionError, struct.error):
                    return
                try:
                    hit = int(self._lookup(tokens))
                except Exception as exc:  # a failed probe is a miss, never a scheduler crash
                    logger.warning("bsr.vllm.lookup_failed", error=repr(exc))
                    hit = 0
                try:
                    conn.sendall(_ANSWER.pack(hit))
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LookupClient:
    """The scheduler's end: ``lookup(tokens)`` asks the worker, bounded by ``timeout_s``.

    Any failure (no worker listening yet, a timeout, a closed connection) answers 0, a miss,
    and the connection is re-made on the next call.
    """

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self.failures = 0

    def lookup(self, tokens: Sequence[int]) -> int:
        arr = np.asarray(tokens, dtype="<i8")[:MAX_LOOKUP_TOKENS]
        with self._lock:
            try:
                if self._conn is None:
                    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    conn.settimeout(self.timeout_s)
                    conn.connect(self.path)
                    self._conn = conn
                self._conn.sendall(_HEADER.pack(b"L", len(arr)) + arr.tobytes())
                (hit,) = _ANSWER.unpack(_recv_exact(self._conn, _ANSWER.size))
                return max(0, int(hit))
            except (OSError, ConnectionError, struct.error) as exc:
                self.failures += 1
                logger.warning("bsr.vllm.lookup_unanswered", path=self.path, error=repr(exc))
                self.close()
                return 0

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
