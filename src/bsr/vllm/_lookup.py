"""The lookup socket: vLLM's scheduler asks the worker's bsr engine what it holds, never waiting.

Where it runs: :class:`LookupServer` in vLLM's worker process on tensor-parallel rank 0 (one
thread); :class:`LookupClient` in vLLM's scheduler (the EngineCore process, a different process
from the worker on the CPU build).

How it works: the scheduler has no KV tensors and no engine, so it asks the worker over a Unix
socket. Requests and answers are pipelined and matched by a sequence number: a request is
``b"L"``, a little-endian uint64 sequence number, a uint32 token count, a uint32 byte count of
the extra keys, the tokens as int64, then the extra keys (:func:`encode_extras`: what besides the
tokens the request's KV depends on, :mod:`bsr.vllm._request_keys`), then the lookup's hints
(:class:`LookupHints`: the tokens vLLM already holds, the scheduler's measured prefill rate). The
answer is the sequence number, one int64, the prefix bsr offers in tokens (0 on any failure),
and :data:`TIER_SLOTS` int64s: of the offered tokens past vLLM's own, how many each of the
worker's tiers holds (tier ``i`` in slot ``i``; the last slot sums the tiers past it). The
client never waits for an answer: :meth:`LookupClient.submit` sends and returns,
:meth:`LookupClient.poll` takes whatever answers have arrived. The server is one thread over a
``selectors`` loop: it reads requests, hands each to a handler that must not block (the
connector starts the lookup on its event loop and answers from there through :meth:`reply`),
and writes the answers back.

Who may ask: the socket lives in a directory of its own (``mkdtemp``, mode 0700 whatever the
umask) with mode 0600, and a peer of another uid is refused (``SO_PEERCRED``). The worker
creates it and tells the scheduler its path through vLLM's handshake metadata, so every engine
instance has its own path; a path where another server already answers is refused with an error
(:class:`~bsr.ConfigError`), never silently taken over. At most ``max_connections`` peers are
served at once; a request must arrive whole within ``read_timeout_s`` and an idle connection is
closed after ``idle_timeout_s``; ``close()`` stops the thread and closes every connection.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bsr import BsrError, ConfigError, KeyExtra

from .._log import logger

_REQUEST = struct.Struct("<cQII")
#: tiers whose tokens an answer reports one by one (the last slot sums the rest)
TIER_SLOTS = 8
#: tiers an answer can name to skip (bits of a uint64: the engine's tier ``i`` is bit ``i``)
SKIP_TIERS_MAX = 64
_ANSWER = struct.Struct(f"<Qq{TIER_SLOTS}qQ")
_EXTRA = struct.Struct("<QQI")
_HINTS = struct.Struct("<Qd")
#: Largest prompt a lookup carries (tokens); longer prompts are probed on their first part.
MAX_LOOKUP_TOKENS = 1 << 22
#: Largest encoding of a lookup's extra keys (bytes)
MAX_EXTRAS_BYTES = 1 << 24
_RECV = 1 << 20


@dataclass(frozen=True)
class LookupHints:
    """What the scheduler knows besides the prompt: ``start_tokens`` vLLM already holds (its
    own prefix-cache hit, whole blocks) and its measured prefill rate in tokens/s (0: none yet),
    for the cost policy and the hit sources."""

    start_tokens: int = 0
    prefill_rate: float = 0.0


@dataclass(frozen=True)
class LookupAnswer:
    """The worker's answer: ``hit`` tokens offered from token 0, and of those past
    ``start_tokens`` the tokens each tier holds (``by_tier[i]``: the engine's tier ``i``);
    ``skip``: the engine's tiers (by index) the lookup had no answer from, which the load's
    probe does not ask (see ``LoadJob.skip_tiers``)."""

    hit: int
    by_tier: tuple[int, ...] = ()
    skip: tuple[int, ...] = ()


def skip_mask(skip: Sequence[int]) -> int:
    """``skip`` (tier indices, each below :data:`SKIP_TIERS_MAX`) as the answer's bit mask."""
    mask = 0
    for i in skip:
        if not 0 <= i < SKIP_TIERS_MAX:
            raise ValueError(f"tier index {i} cannot be named in a lookup answer")
        mask |= 1 << i
    return mask


def skipped(mask: int) -> tuple[int, ...]:
    """The tier indices of an answer's bit mask, in order."""
    return tuple(i for i in range(SKIP_TIERS_MAX) if mask >> i & 1)


#: ``handler(conn_id, seq, tokens, extras, hints)``: start the lookup; answer later with
#: ``server.reply``
Handler = Callable[[int, int, np.ndarray, tuple[KeyExtra, ...], LookupHints], None]


def encode_extras(extras: Sequence[KeyExtra]) -> bytes:
    """``extras`` as bytes: a uint32 count, then each as (uint64 start, uint64 end or 0 for
    "to the end", uint32 key length, key)."""
    parts = [len(extras).to_bytes(4, "little")]
    for e in extras:
        parts.append(_EXTRA.pack(e.start, 0 if e.end is None else e.end, len(e.key)) + e.key)
    return b"".join(parts)


def decode_extras(raw: bytes) -> tuple[KeyExtra, ...]:
    """The extras :func:`encode_extras` wrote (ValueError, or bsr.TokenError, if malformed)."""
    if not raw:
        return ()
    count, pos, out = int.from_bytes(raw[:4], "little"), 4, []
    for _ in range(count):
        start, end, n = _EXTRA.unpack_from(raw, pos)
        pos += _EXTRA.size
        key = raw[pos : pos + n]
        if len(key) != n:
            raise ValueError("truncated extra key")
        pos += n
        out.append(KeyExtra(key, start, end or None))
    if pos != len(raw):
        raise ValueError("trailing bytes after the extra keys")
    return tuple(out)


PREFIX = "bsr-vllm-"
SOCKET_NAME = "lookup.sock"
#: a socket directory this old whose socket nobody answers on is a dead engine's
STALE_AFTER_S = 60.0


def private_socket_path() -> str:
    """A fresh socket path in a new directory only this user can enter (short: AF_UNIX limit).

    Directories that dead engines of this user left behind (a worker killed before its
    ``close()``) are removed first.
    """
    remove_stale_dirs()
    root = tempfile.mkdtemp(prefix=PREFIX)
    os.chmod(root, 0o700)  # mkdtemp applies the umask to 0700: make sure
    return str(Path(root) / SOCKET_NAME)


def remove_stale_dirs(tmp: str | None = None, older_than_s: float = STALE_AFTER_S) -> int:
    """Remove this user's socket directories whose socket nobody answers on; returns how many.

    Only a directory named like ours, owned by this user, older than ``older_than_s`` and holding
    nothing but a dead socket (or nothing) is removed: a live engine's socket answers, and a
    starting one's directory is younger.
    """
    removed = 0
    now = time.time()
    for d in Path(tmp or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if now - st.st_mtime < older_than_s or any(p.name != SOCKET_NAME for p in d.iterdir()):
                continue
            sock = d / SOCKET_NAME
            if sock.exists() and (
                not stat.S_ISSOCK(os.lstat(sock).st_mode) or _answering(str(sock))
            ):
                continue
            sock.unlink(missing_ok=True)
            d.rmdir()
            removed += 1
        except OSError:
            continue  # raced with its owner or another sweep: leave it
    return removed


def _answering(path: str) -> bool:
    """Whether a server accepts connections at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return int(struct.unpack("3i", raw)[1])


@dataclass
class _Conn:
    sock: socket.socket
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    started: float | None = None  # when the first byte of an incomplete request arrived
    active: float = field(default_factory=time.monotonic)


class LookupServer:
    """Serves the scheduler's lookups (worker side, one thread).

    Args:
        path: the socket path (:func:`private_socket_path`).
        handler: called on the server thread with ``(conn_id, seq, tokens, extras, hints)`` for
            each request; it must return at once and answer later with :meth:`reply` (an
            exception answers 0).
        max_connections: peers served at once; more are closed on accept.
        read_timeout_s: a started request must arrive whole within this.
        idle_timeout_s: a connection with nothing to read or write is closed after this.

    Raises:
        ConfigError: another server answers at ``path``, or ``path`` is something else than a
            socket (nothing is removed then).
    """

    def __init__(
        self,
        path: str,
        handler: Handler,
        *,
        max_connections: int = 4,
        read_timeout_s: float = 5.0,
        idle_timeout_s: float = 300.0,
    ) -> None:
        self.path = path
        self._handler = handler
        self._max = max_connections
        self._read_timeout = read_timeout_s
        self._idle_timeout = idle_timeout_s
        self._claim(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._answers: queue.SimpleQueue[tuple[int, int, int, tuple[int, ...], int]] = (
            queue.SimpleQueue()
        )
        self._conns: dict[int, _Conn] = {}
        self._ids = iter(range(1, 1 << 62))
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, 0)
        self._sel.register(self._wake_r, selectors.EVENT_READ, -1)
        self._stop = threading.Event()
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="bsr-vllm-lookup", daemon=True)
        self._thread.start()
        atexit.register(self._remove_path)  # a process that exits without close() (SIGTERM)

    @staticmethod
    def _claim(path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(
                f"the lookup socket path {path} exists and is not a socket; remove it", path=path
            )
        if _answering(path):
            raise ConfigError(
                f"another server already answers lookups at {path} (a second vLLM engine with "
                "the same socket path?); each engine needs its own",
                path=path,
            )
        os.unlink(path)  # a socket nobody answers on: left over by a process that died

    # ------------------------------------------------------------------ public
    def reply(
        self, conn_id: int, seq: int, hit: int, by_tier: Sequence[int] = (),
        skip: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """Answer request ``seq`` of connection ``conn_id`` (any thread; dropped if closed):
        ``hit`` tokens, the tokens each tier holds of them and the tiers the load is not to
        ask (see :class:`LookupAnswer`)."""
        slots = [0] * TIER_SLOTS
        for i, n in enumerate(by_tier):
            slots[min(i, TIER_SLOTS - 1)] += int(n)
        self._answers.put((conn_id, seq, int(hit), tuple(slots), skip_mask(skip)))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    @property
    def connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        """Stop the thread, close every connection, remove the socket and its directory."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=10.0)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        for s in (self._sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        with contextlib.suppress(OSError):
            self._sel.close()
        self._remove_path()
        atexit.unregister(self._remove_path)

    def _remove_path(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))  # only if it is the private one, now empty

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(timeout=0.5)
            except OSError:
                return
            for key, mask in events:
                if key.data == 0:
                    self._accept()
                elif key.data == -1:
                    self._drain_wake()
                else:
                    self._serve(int(key.data), mask)
            self._expire()

    def _accept(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except OSError:
            return
        uid = _peer_uid(sock)
        if len(self._conns) >= self._max or (uid is not None and uid != os.getuid()):
            self.refused += 1
            logger.warning(
                "bsr.vllm.lookup_refused", peer_uid=uid, connections=len(self._conns),
                note="another user, or more connections than lookup_connections",
            )  # fmt: skip
            sock.close()
            return
        sock.setblocking(False)
        cid = next(self._ids)
        self._conns[cid] = _Conn(sock)
        self._sel.register(sock, selectors.EVENT_READ, cid)

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                cid, seq, hit, slots, mask = self._answers.get_nowait()
            except queue.Empty:
                return
            conn = self._conns.get(cid)
            if conn is not None:
                conn.wbuf += _ANSWER.pack(seq, hit, *slots, mask)
                self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, cid)

    def _serve(self, cid: int, mask: int) -> None:
        conn = self._conns.get(cid)
        if conn is None:
            return
        try:
            if mask & selectors.EVENT_READ:
                data = conn.sock.recv(_RECV)
                if not data:
                    raise ConnectionError("peer closed")
                conn.rbuf += data
                conn.active = time.monotonic()
                if conn.started is None:
                    conn.started = conn.active
                self._parse(cid, conn)
            if mask & selectors.EVENT_WRITE and conn.wbuf:
                sent = conn.sock.send(conn.wbuf)
                del conn.wbuf[:sent]
                conn.active = time.monotonic()
                if not conn.wbuf:
                    self._sel.modify(conn.sock, selectors.EVENT_READ, cid)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ConnectionError, ValueError) as exc:
            self._drop(cid, repr(exc))

    def _parse(self, cid: int, conn: _Conn) -> None:
        while len(conn.rbuf) >= _REQUEST.size:
            op, seq, n, m = _REQUEST.unpack_from(conn.rbuf)
            if op != b"L" or n > MAX_LOOKUP_TOKENS or m > MAX_EXTRAS_BYTES:
                raise ValueError(f"not a lookup request (op {op!r}, {n} tokens, {m} B extras)")
            mid = _REQUEST.size + 8 * n
            end = mid + m
            if len(conn.rbuf) < end + _HINTS.size:
                return
            tokens = np.frombuffer(bytes(conn.rbuf[_REQUEST.size : mid]), dtype="<i8")
            try:
                extras = decode_extras(bytes(conn.rbuf[mid:end]))
            except (ValueError, struct.error, BsrError) as exc:
                raise ValueError(f"malformed extra keys: {exc}") from None
            start, rate = _HINTS.unpack_from(conn.rbuf, end)
            hints = LookupHints(int(start), float(rate) if 0 < rate < float("inf") else 0.0)
            del conn.rbuf[: end + _HINTS.size]
            conn.started = time.monotonic() if conn.rbuf else None
            try:
                self._handler(cid, seq, tokens, extras, hints)
            except Exception as exc:  # a failed lookup is a miss, never a dead server
                logger.warning("bsr.vllm.lookup_failed", error=repr(exc))
                self.reply(cid, seq, 0)

    def _expire(self) -> None:
        now = time.monotonic()
        for cid, conn in list(self._conns.items()):
            if conn.started is not None and now - conn.started > self._read_timeout:
                self._drop(cid, "request incomplete after read_timeout_s")
            elif not conn.wbuf and now - conn.active > self._idle_timeout:
                self._drop(cid, "idle")

    def _drop(self, cid: int, why: str) -> None:
        conn = self._conns.pop(cid, None)
        if conn is None:
            return
        with contextlib.suppress(Exception):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        logger.debug("bsr.vllm.lookup_connection_closed", why=why)


class LookupClient:
    """The scheduler's end: :meth:`submit` sends a lookup, :meth:`poll` collects answers.

    Neither waits for the worker. A failure (no path yet, nobody listening, a closed
    connection) drops the connection; the lookups it carried get no answer, which the scheduler
    treats as a miss once they are ``lookup_timeout_s`` late. The next :meth:`submit` connects
    again.

    Args:
        path: the worker's socket path (set later with :attr:`path` when it comes from the
            handshake).
        send_timeout_s: the most one send may take (the server reads without ever waiting on
            a store, so only a dead or wedged worker makes a send slow).
    """

    def __init__(self, path: str | None = None, send_timeout_s: float = 1.0) -> None:
        self.path = path
        self.send_timeout_s = send_timeout_s
        self._conn: socket.socket | None = None
        self._rbuf = bytearray()
        self.failures = 0

    def submit(
        self,
        seq: int,
        tokens: Sequence[int] | np.ndarray,
        extras: Sequence[KeyExtra] = (),
        hints: LookupHints | None = None,
    ) -> bool:
        """Send lookup ``seq`` of ``tokens`` (keyed with ``extras``, with the scheduler's
        ``hints``); False if it could not be sent (a miss)."""
        arr = np.asarray(tokens, dtype="<i8")[:MAX_LOOKUP_TOKENS]
        raw = encode_extras(extras)
        if len(raw) > MAX_EXTRAS_BYTES:
            return False  # never sent: a miss
        h = hints or LookupHints()
        tail = _HINTS.pack(max(0, int(h.start_tokens)), float(h.prefill_rate))
        try:
            conn = self._connect()
            conn.settimeout(self.send_timeout_s)
            conn.sendall(_REQUEST.pack(b"L", seq, len(arr), len(raw)) + arr.tobytes() + raw + tail)
            return True
        except (OSError, ConnectionError) as exc:
            self._fail(exc)
            return False

    def poll(self) -> dict[int, int]:
        """Answers that have arrived: ``{seq: prefix tokens}`` (never waits)."""
        return {seq: a.hit for seq, a in self.poll_answers().items()}

    def poll_answers(self) -> dict[int, LookupAnswer]:
        """Answers that have arrived, whole (never waits)."""
        out: dict[int, LookupAnswer] = {}
        conn = self._conn
        if conn is None:
            return out
        error: BaseException | None = None
        try:
            conn.setblocking(False)
            while True:
                data = conn.recv(_RECV)
                if not data:
                    raise ConnectionError("the worker closed the lookup connection")
                self._rbuf += data
        except (BlockingIOError, InterruptedError):
            pass
        except (OSError, ConnectionError) as exc:
            error = exc
        n = len(self._rbuf) // _ANSWER.size
        for i in range(n):
            seq, hit, *slots, mask = _ANSWER.unpack_from(self._rbuf, i * _ANSWER.size)
            by_tier = tuple(max(0, int(x)) for x in slots)
            out[int(seq)] = LookupAnswer(max(0, int(hit)), by_tier, skipped(int(mask)))
        del self._rbuf[: n * _ANSWER.size]
        if error is not None:
            self._fail(error)
        return out

    def _connect(self) -> socket.socket:
        if self._conn is not None:
            return self._conn
        if self.path is None:
            raise ConnectionError("the worker has not told where its lookup socket is")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self.send_timeout_s)
        try:
            conn.connect(self.path)
        except OSError:
            conn.close()
            raise
        self._conn = conn
        self._rbuf.clear()
        return conn

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        logger.warning("bsr.vllm.lookup_unanswered", path=self.path, error=repr(exc))
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        self._rbuf.clear()
