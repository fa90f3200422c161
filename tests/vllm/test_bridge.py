"""bsr.vllm._bridge: the loop thread and the scheduler-to-worker lookup socket (no vLLM needed)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from bsr.vllm._bridge import LookupClient, LookupServer, LoopThread, socket_path


@pytest.fixture
def path() -> Iterator[str]:
    yield socket_path(f"test-{uuid.uuid4()}")


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


def test_lookup_round_trip(path: str) -> None:
    seen: list[np.ndarray] = []

    def lookup(tokens: np.ndarray) -> int:
        seen.append(tokens.copy())
        return int(tokens.sum())

    server = LookupServer(path, lookup)
    client = LookupClient(path, timeout_s=5.0)
    try:
        assert client.lookup([1, 2, 3]) == 6
        assert client.lookup(list(range(10_000))) == sum(range(10_000))  # one connection, reused
        assert seen[0].tolist() == [1, 2, 3] and len(seen[1]) == 10_000
        assert client.failures == 0
    finally:
        client.close()
        server.close()


def test_failures_are_misses_never_hangs(path: str) -> None:
    client = LookupClient(path, timeout_s=0.5)
    assert client.lookup([1, 2]) == 0  # nobody listening yet
    assert client.failures == 1

    def broken(tokens: np.ndarray) -> int:
        raise RuntimeError("store down")

    server = LookupServer(path, broken)
    try:
        assert client.lookup([1, 2]) == 0  # the worker's probe failed: a miss
    finally:
        server.close()

    def slow(tokens: np.ndarray) -> int:
        time.sleep(2.0)
        return 64

    server = LookupServer(path, slow)
    try:
        t0 = time.monotonic()
        assert client.lookup([1, 2]) == 0
        assert time.monotonic() - t0 < 1.5  # bounded by timeout_s
    finally:
        server.close()
        client.close()


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
        t0 = time.monotonic()
        assert loop.call_bounded(hang, timeout=0.3) is None
        assert time.monotonic() - t0 < 5
        assert state == {"cancelled": True, "after": False}  # cancelled before it returned
        assert loop.call_bounded(quick, timeout=5) == 7
    finally:
        loop.close()
