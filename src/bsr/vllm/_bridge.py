"""LoopThread: vLLM's synchronous hooks into bsr's event loop.

Where it runs: vLLM's worker process (one per connector worker side).

How it works: an anyio blocking portal, one event loop on one background thread that owns the
:class:`~bsr.RestoreEngine`; vLLM's synchronous hooks ``call`` into it (wait for the result),
``call_bounded`` (wait at most a timeout, then cancel) or ``submit`` (get a
``concurrent.futures.Future``, never wait).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from .._log import logger

T = TypeVar("T")


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
        """Start ``fn(*args)`` on the loop; returns at once with a future of its result.

        Cancelling the future marks it done at once, before the task has unwound: a caller that
        must know when the task ended (e.g. that it can no longer write somewhere) signals that
        from inside the task.
        """
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
