"""AbandonableCalls: blocking calls in worker threads that a caller may stop waiting for.

Where it runs: the event loop (any anyio backend) hands each call to a worker thread.

How it works: a thread cannot be killed, so a blocking call that hangs (a read stuck in the
kernel on a dead mount, an RPC to a paused server) is *abandoned* when its caller is cancelled
(a deadline, an outer scope): :meth:`AbandonableCalls.run` returns at once, and the worker keeps
running until the call comes back on its own. Three things must then hold, and this class is the
one place that makes them hold (every tier and the transfer pipeline use it):

- resources the call touches (a buffer it writes into, a staging slot) are released exactly
  once, only when nothing writes into them any more: ``release`` runs right away when the call
  never started or already finished, else in the worker thread when the call returns;
- a call cancelled before a worker picked it up never runs;
- abandoned calls still running are counted (``stuck``); at ``max_stuck`` new calls fail fast
  with the error ``too_many(stuck)`` builds, instead of piling up threads behind a dead device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import anyio

from .._check import positive_int
from .._errors import TierIOError

T = TypeVar("T")


_HERE = threading.local()  # the call a worker thread is running now
_CANCEL = threading.local()  # the withdrawal check of the reads a worker thread runs now


@contextlib.contextmanager
def cancellation(check: Callable[[], bool]) -> Iterator[None]:
    """Reads of this thread inside the block that can withdraw their work (io_uring requests)
    poll ``check()`` while they wait; once it is true they withdraw it and end with
    :class:`~bsr.ReadWithdrawnError`, only after the kernel let go of every buffer (nothing is
    written after the read ended). The transfer pipeline wraps its batches in it (its request
    ended); :meth:`AbandonableCalls.run`'s callers use :meth:`AbandonableCalls.abandoned_here`.
    """
    prev = getattr(_CANCEL, "check", None)
    _CANCEL.check = check
    try:
        yield
    finally:
        _CANCEL.check = prev


def cancel_check() -> Callable[[], bool] | None:
    """The withdrawal check in force on this thread (:func:`cancellation`), or None."""
    check: Callable[[], bool] | None = getattr(_CANCEL, "check", None)
    return check


class _NotRun(Exception):
    """The call was abandoned before a worker picked it up (never raised out of run())."""


class _Call:
    __slots__ = ("abandoned", "done", "release", "started")

    def __init__(self, release: Callable[[], None] | None) -> None:
        self.started = self.done = self.abandoned = False
        self.release = release


def _too_many(stuck: int) -> Exception:
    return TierIOError(
        f"{stuck} abandoned blocking calls are still running (a hung device or server?); new "
        "calls fail fast until they return"
    )


class AbandonableCalls:
    """Run blocking calls in worker threads; abandon them (never wait) when cancelled.

    Args:
        limiter: worker threads these calls may use at once (default: anyio's shared limiter).
        max_stuck: abandoned calls still running after which :meth:`run` fails fast (None: no
            bound).
        too_many: builds the error raised then, given the number stuck (default: a
            :class:`~bsr.TierIOError`).
        on_abandon: called (on the event loop) each time a running call is abandoned, e.g. to
            count it.

    Example::

        calls = AbandonableCalls(limiter=anyio.CapacityLimiter(8), max_stuck=8)
        with anyio.fail_after(timeout_s):
            value = await calls.run(lambda: client.get(key))
    """

    def __init__(
        self,
        *,
        limiter: anyio.CapacityLimiter | None = None,
        max_stuck: int | None = None,
        too_many: Callable[[int], Exception] = _too_many,
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        self.limiter = limiter
        self.max_stuck = None if max_stuck is None else positive_int(max_stuck, "max_stuck")
        self._too_many = too_many
        self._on_abandon = on_abandon
        self._lock = threading.Lock()
        self._stuck = 0
        self._abandoned = 0

    @staticmethod
    def abandoned_here() -> bool:
        """In a worker thread running a call of :meth:`run`: whether its caller has abandoned
        it (a blocking step that can withdraw its work, such as an io_uring read, polls this).
        False outside such a call."""
        call = getattr(_HERE, "call", None)
        return bool(call is not None and call.abandoned)

    @property
    def stuck(self) -> int:
        """Abandoned calls whose worker has not returned yet."""
        return self._stuck

    @property
    def abandoned(self) -> int:
        """Calls abandoned while running, since creation (returned or not)."""
        return self._abandoned

    def check(self) -> None:
        """Raise ``too_many(stuck)`` if ``max_stuck`` abandoned calls are still running."""
        with self._lock:
            stuck = self._stuck
        if self.max_stuck is not None and stuck >= self.max_stuck:
            raise self._too_many(stuck)

    async def run(self, fn: Callable[[], T], *, release: Callable[[], None] | None = None) -> T:
        """``fn()`` in a worker thread; on cancellation return at once and abandon the worker.

        Args:
            fn: the blocking call.
            release: runs exactly once unless ``fn`` returns normally (it raised, was
                cancelled before it started, or was abandoned): at once when nothing runs any
                more, else in the worker thread when ``fn`` returns. Use it to free what ``fn``
                writes into.
        """
        try:
            self.check()
        except BaseException:
            if release is not None:
                release()
            raise
        call = _Call(release)

        def work() -> T:
            with self._lock:
                if call.abandoned:  # cancelled before this thread picked the call up
                    raise _NotRun
                call.started = True
            _HERE.call = call
            try:
                return fn()
            finally:
                _HERE.call = None
                late = None
                with self._lock:
                    call.done = True
                    if call.abandoned:
                        self._stuck -= 1
                        late = call.release
                if late is not None:
                    late()

        try:
            return await anyio.to_thread.run_sync(
                work, abandon_on_cancel=True, limiter=self.limiter
            )
        except BaseException:
            with self._lock:
                call.abandoned = True
                running = call.started and not call.done
                if running:  # the worker releases when it returns
                    self._stuck += 1
                    self._abandoned += 1
                now = None if running else call.release
            if now is not None:
                now()
            if running and self._on_abandon is not None:
                self._on_abandon()
            raise
