"""bsr.vllm._bridge and _lookup: the loop thread and the scheduler's lookup socket (no vLLM).

The socket's hostile-user findings each have a test here: the mode followed the umask (another
uid could ask which prefixes are cached and pin them), a second server on the same path silently
took the first's lookups, one thread per connection with no read timeout and no limit (idle
peers held threads, still blocked after ``close()``), and a lookup the scheduler waited on.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.vllm._bridge import LoopThread
from bsr.vllm._lookup import (
    LookupAnswer,
    LookupClient,
    LookupHints,
    LookupServer,
    decode_extras,
    encode_extras,
    private_socket_path,
    remove_stale_dirs,
    skip_mask,
    skipped,
)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds (a generous bound: a busy machine is slow, never wrong)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def path() -> Iterator[str]:
    p = private_socket_path()
    yield p
    for leftover in (p, os.path.dirname(p)):
        if os.path.isdir(leftover):
            os.rmdir(leftover)
        elif os.path.exists(leftover):
            os.unlink(leftover)


def summing(server_ref: list[LookupServer]) -> Callable[..., None]:
    """A handler that answers from another thread, later (as the connector's loop does): the
    sum of the tokens plus, per extra key, its start and its key's length; per tier, the hints'
    start tokens and prefill rate, and the token count."""

    def handler(cid: int, seq: int, tokens: np.ndarray, extras: Any, hints: LookupHints) -> None:
        total = int(tokens.sum()) + sum(e.start + len(e.key) for e in extras)
        by_tier = [hints.start_tokens, int(hints.prefill_rate), len(tokens)]
        threading.Timer(0.01, lambda: server_ref[0].reply(cid, seq, total, by_tier)).start()

    return handler


def collect(client: LookupClient, n: int) -> dict[int, int]:
    got: dict[int, int] = {}
    wait_for(lambda: len(got.update(client.poll()) or got) >= n, f"{n} answers")
    return got


def test_loop_thread_runs_coroutines_off_the_caller_thread() -> None:
    loop = LoopThread()
    try:
        caller = threading.get_ident()

        async def where(x: int) -> tuple[int, int]:
            await anyio.lowlevel.checkpoint()
            return threading.get_ident(), x * 2

        ident, value = loop.call(where, 21)
        assert value == 42 and ident != caller
        fut = loop.submit(where, 5)
        assert fut.result(timeout=5)[1] == 10
    finally:
        loop.close()


def test_call_bounded_cancels_an_overrunning_call() -> None:
    loop = LoopThread()
    state = {"cancelled": False, "after": False}

    async def hang() -> int:
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            state["cancelled"] = True
            raise
        state["after"] = True  # never: the call was cancelled
        return 1

    async def quick() -> int:
        return 7

    try:
        assert loop.call_bounded(hang, timeout=0.3) is None
        assert state == {"cancelled": True, "after": False}  # cancelled before it returned
        assert loop.call_bounded(quick, timeout=5) == 7
    finally:
        loop.close()


def test_lookups_are_pipelined_and_matched_by_sequence_number(path: str) -> None:
    ref: list[LookupServer] = []
    ref.append(LookupServer(path, summing(ref)))
    client = LookupClient(path)
    try:
        assert client.submit(1, [1, 2, 3])
        assert client.submit(2, list(range(10_000)))  # one connection, several in flight
        assert client.submit(3, [5])
        # the extra keys travel with the tokens
        assert client.submit(4, [5], [bsr.KeyExtra(b"salt:a", 0, 1), bsr.KeyExtra(b"img", 7, 9)])
        assert collect(client, 4) == {
            1: 6, 2: sum(range(10_000)), 3: 5, 4: 5 + (0 + 6) + (7 + 3)
        }  # fmt: skip
        # the hints travel with the lookup, the per-tier tokens with the answer
        assert client.submit(5, [1, 2], (), LookupHints(start_tokens=64, prefill_rate=1234.5))
        got: dict[int, LookupAnswer] = {}
        wait_for(lambda: bool(got.update(client.poll_answers()) or got), "the answer")
        assert got[5] == LookupAnswer(3, (64, 1234, 2, 0, 0, 0, 0, 0))
        assert client.failures == 0
    finally:
        client.close()
        ref[0].close()


def test_an_answer_names_the_tiers_to_skip_by_bit() -> None:
    assert skip_mask(()) == 0 and skipped(0) == ()
    assert skip_mask((0, 5, 63)) == 1 | 1 << 5 | 1 << 63
    assert skipped(skip_mask((63, 0, 5))) == (0, 5, 63)
    for bad in (-1, 64):
        with pytest.raises(ValueError, match=f"tier index {bad}"):
            skip_mask((1, bad))


def test_the_client_never_waits_for_an_answer(path: str) -> None:
    """A lookup that hangs on the worker (a paused store) costs the scheduler nothing: submit
    returns at once and poll has nothing until the answer comes."""
    ref: list[LookupServer] = []
    started = threading.Event()
    pending: list[tuple[int, int]] = []

    def never(cid: int, seq: int, tokens: np.ndarray, extras: Any, hints: Any) -> None:
        pending.append((cid, seq))
        started.set()

    ref.append(LookupServer(path, never))
    client = LookupClient(path)
    try:
        assert client.submit(7, [1, 2])
        assert started.wait(30)
        assert client.poll() == {}  # nothing yet, and no wait
        cid, seq = pending[0]
        ref[0].reply(cid, seq, 64)
        assert collect(client, 1) == {7: 64}
    finally:
        client.close()
        ref[0].close()


def test_failures_are_misses_never_hangs(path: str) -> None:
    client = LookupClient(None)
    assert not client.submit(1, [1])  # no path yet (no handshake): a miss
    client.path = path
    assert not client.submit(2, [1, 2])  # nobody listening
    assert client.failures == 2

    def broken(cid: int, seq: int, tokens: np.ndarray, extras: Any, hints: Any) -> None:
        raise RuntimeError("store down")

    server = LookupServer(path, broken)
    try:
        assert client.submit(3, [1, 2])
        assert collect(client, 1) == {3: 0}  # the worker's lookup failed: a miss
    finally:
        server.close()
    wait_for(lambda: client.poll() == {} and client.failures == 3, "the closed connection")
    client.close()


def test_socket_is_owner_only_whatever_the_umask(path: str) -> None:
    old = os.umask(0)
    try:
        p = private_socket_path()
        server = LookupServer(p, lambda cid, seq, t, x, h: None)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(p)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        assert os.path.dirname(p) != os.path.dirname(path)  # a private directory per server
    finally:
        server.close()
    assert not os.path.exists(os.path.dirname(p))  # close() removes socket and directory


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_uid_cannot_reach_the_socket(path: str) -> None:
    server = LookupServer(path, lambda cid, seq, t, x, h: server.reply(cid, seq, 1))
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become nobody, try to connect
            os.close(r)
            code = b"?"
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                code = b"connected"
            except PermissionError:
                code = b"refused"
            except OSError as exc:
                code = repr(exc).encode()
            os.write(w, code)
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        assert os.read(r, 100) == b"refused"
        os.close(r)
    finally:
        server.close()


def test_a_second_server_on_the_same_path_is_refused(path: str) -> None:
    first = LookupServer(path, lambda cid, seq, t, x, h: first.reply(cid, seq, 11))
    try:
        with pytest.raises(bsr.ConfigError, match="another server already answers"):
            LookupServer(path, lambda cid, seq, t, x, h: None)
        client = LookupClient(path)
        assert client.submit(1, [1])
        assert collect(client, 1) == {1: 11}  # the first server still answers
        client.close()
    finally:
        first.close()


def test_a_stale_socket_is_replaced_and_a_foreign_file_is_left_alone(
    path: str, tmp_path: Path
) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a socket file nobody answers on (a dead process's)
    server = LookupServer(path, lambda cid, seq, t, x, h: server.reply(cid, seq, 5))
    client = LookupClient(path)
    try:
        assert client.submit(1, [1])
        assert collect(client, 1) == {1: 5}
    finally:
        client.close()
        server.close()
    other = tmp_path / "other.sock"
    other.write_text("not a socket")
    with pytest.raises(bsr.ConfigError, match="not a socket"):
        LookupServer(str(other), lambda cid, seq, t, x, h: None)
    assert other.read_text() == "not a socket"


def lookup_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("bsr-vllm-lookup"))


def test_connections_are_bounded_and_served_by_one_thread(path: str) -> None:
    before = lookup_threads()
    server = LookupServer(
        path, lambda cid, seq, t, x, h: server.reply(cid, seq, 3), max_connections=2
    )
    peers = []
    try:
        for _ in range(6):  # idle peers: they connect and send nothing
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            peers.append(s)
        wait_for(lambda: server.refused == 4, "4 refused peers")
        assert server.connections == 2
        assert lookup_threads() == before + 1  # one thread, whatever the peers
        for s in peers[2:]:  # the refused ones were closed
            s.settimeout(30)
            assert s.recv(1) == b""
    finally:
        for s in peers:
            s.close()
        server.close()
    assert lookup_threads() == before  # close() ends the thread


def test_an_incomplete_request_is_dropped_after_the_read_timeout(path: str) -> None:
    server = LookupServer(path, lambda cid, seq, t, x, h: None, read_timeout_s=0.2)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(struct.pack("<cQI", b"L", 1, 1000)[:7])  # half a header, then nothing
        wait_for(lambda: server.connections == 1, "the connection")
        wait_for(lambda: server.connections == 0, "the read timeout")
        s.settimeout(30)
        assert s.recv(1) == b""
    finally:
        s.close()
        server.close()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.builds(
            lambda key, start, length: bsr.KeyExtra(key, start, start + length if length else None),
            st.binary(min_size=1, max_size=40),
            st.integers(0, 2**40),
            st.integers(0, 2**20),
        ),
        max_size=6,
    )
)
def test_extra_keys_round_trip_through_the_wire_format(extras: list[bsr.KeyExtra]) -> None:
    assert decode_extras(encode_extras(extras)) == tuple(extras)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x01\x00\x00\x00",  # one extra announced, none there
        (1).to_bytes(4, "little") + struct.pack("<QQI", 0, 0, 9) + b"short",  # truncated key
        (1).to_bytes(4, "little") + struct.pack("<QQI", 5, 3, 1) + b"k",  # end before start
        (0).to_bytes(4, "little") + b"junk",  # trailing bytes
    ],
)
def test_a_lookup_with_malformed_extra_keys_is_dropped(path: str, raw: bytes) -> None:
    """A request whose extra keys do not decode is never looked up (it could be looked up
    without them): its connection is closed, and the server goes on serving others."""
    asked: list[int] = []
    server = LookupServer(path, lambda cid, seq, t, x, h: asked.append(seq))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        tokens = np.arange(4, dtype="<i8").tobytes()
        s.sendall(struct.pack("<cQII", b"L", 1, 4, len(raw)) + tokens + raw)
        s.settimeout(30)
        assert s.recv(1) == b""  # closed, no answer
        client = LookupClient(path)
        try:
            assert client.submit(2, [1, 2], [bsr.KeyExtra(b"ok")])
            wait_for(lambda: asked == [2], "the well-formed lookup")
        finally:
            client.close()
    finally:
        s.close()
        server.close()


def test_close_ends_the_thread_and_every_connection(path: str) -> None:
    before = lookup_threads()
    server = LookupServer(path, lambda cid, seq, t, x, h: None)
    client = LookupClient(path)
    assert client.submit(1, [1, 2, 3])  # a lookup that will never be answered
    wait_for(lambda: server.connections == 1, "the connection")
    server.close()
    assert lookup_threads() == before
    assert not os.path.exists(path)
    wait_for(lambda: client.poll() == {} and client.failures == 1, "the client to see EOF")


def test_garbage_closes_only_that_connection(path: str) -> None:
    server = LookupServer(path, lambda cid, seq, t, x, h: server.reply(cid, seq, 9))
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client = LookupClient(path)
    try:
        bad.connect(path)
        bad.sendall(b"X" * 64)
        bad.settimeout(30)
        assert bad.recv(1) == b""
        assert client.submit(4, [4])
        assert collect(client, 1) == {4: 9}
    finally:
        bad.close()
        client.close()
        server.close()


def test_dead_engines_socket_dirs_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    """A worker killed before ``close()`` (vLLM's server stopped with SIGTERM) leaves its
    directory behind; the next server start removes it, never a live or a starting one."""

    def socket_dir(name: str, *, live: bool, age_s: float) -> tuple[Path, LookupServer | None]:
        d = tmp_path / f"bsr-vllm-{name}"
        d.mkdir(mode=0o700)
        server = None
        if live:
            server = LookupServer(str(d / "lookup.sock"), lambda cid, seq, t, x, h: None)
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(d / "lookup.sock"))
            s.close()  # a socket file nobody answers on
        old = time.time() - age_s
        os.utime(d, (old, old))
        return d, server

    dead, _ = socket_dir("dead", live=False, age_s=600)
    young, _ = socket_dir("young", live=False, age_s=0)
    live, server = socket_dir("live", live=True, age_s=600)
    other = tmp_path / "bsr-vllm-other"
    other.mkdir()
    (other / "notes.txt").write_text("not ours to remove")
    os.utime(other, (time.time() - 600,) * 2)
    try:
        assert remove_stale_dirs(str(tmp_path)) == 1
        assert not dead.exists() and young.exists() and live.exists() and other.exists()
    finally:
        assert server is not None
        server.close()
