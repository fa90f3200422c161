"""The open/close life of bsr's resources (engines, tiers), written once.

How it works: a resource is new, then open, then closed, and never open again. ``async with``
opens it and closes it (after anyio's ``AsyncResource``, which writes ``__aenter__`` and
``__aexit__`` once; here ``__aenter__`` also opens). ``aclose`` may be called any number of times
(a subclass runs its release only the first time: it returns when :attr:`closed` is already
set, before calling ``super().aclose()``); anything used after close raises the typed
:class:`~bsr.ClosedError` from :meth:`_check_open`, whose message a subclass words through
:meth:`_closed_error`.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

from ._errors import ClosedError


class AsyncResource:
    """Something opened once and closed once, on the event loop (any anyio backend)."""

    #: set by :meth:`aclose`; a subclass reads it through :attr:`closed`
    _closed: bool = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _closed_error(self) -> ClosedError:
        """The error for a use after close (a subclass says what to do instead)."""
        return ClosedError(f"this {type(self).__name__} is closed; create a new one")

    def _check_open(self) -> None:
        """Raise :class:`~bsr.ClosedError` if the resource is closed."""
        if self.closed:
            raise self._closed_error()

    async def open(self) -> None:
        """Prepare the resource (default: nothing). Refused once it is closed."""
        self._check_open()

    async def aclose(self) -> None:
        """Release it. Idempotent; later uses raise :class:`~bsr.ClosedError`."""
        self._closed = True

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
