"""bsr's event logger: quiet by default, structlog when the application configured structlog.

Where it runs: everywhere in the package (``from bsr._log import logger``).

How it works: every event is ``logger.bind(field=...).info("bsr.<area>.<what>", field=...)``.
At each call the logger checks ``structlog.is_configured()``:

- the application configured structlog (any setup, including ``structlog.stdlib``
  integration): the event goes to ``structlog.get_logger("bsr")`` with the bound fields, and
  structlog renders it as configured;
- otherwise: the event goes to the standard ``logging`` logger ``"bsr"``, which has a
  :class:`logging.NullHandler`. An application that configured nothing sees nothing (not even
  warnings: the NullHandler keeps logging's last-resort stderr handler away); one that called
  ``logging.basicConfig()`` or attached a handler sees ``"bsr.restore.done state=... ..."``
  lines, with the event name and fields also on the record (``record.bsr_event``,
  ``record.bsr_fields``) for structured handlers.

The level check happens before anything is formatted, so a disabled debug event costs one
method call.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

LOGGER_NAME = "bsr"

_stdlib = logging.getLogger(LOGGER_NAME)
_stdlib.addHandler(logging.NullHandler())

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class BsrLogger:
    """A bindable event logger with structlog's call style (see the module docstring)."""

    __slots__ = ("_context",)

    def __init__(self, context: dict[str, Any] | None = None) -> None:
        self._context: dict[str, Any] = dict(context or {})

    def bind(self, **fields: Any) -> BsrLogger:
        """A logger that adds ``fields`` to every event it logs."""
        return BsrLogger({**self._context, **fields})

    def new(self, **fields: Any) -> BsrLogger:
        """A logger with only ``fields`` bound."""
        return BsrLogger(fields)

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            target = structlog.get_logger(LOGGER_NAME, **self._context)
            getattr(target, level)(event, **fields)
            return
        lvl = _LEVELS[level]
        if not _stdlib.isEnabledFor(lvl):
            return
        merged = {**self._context, **fields}
        text = " ".join([event, *(f"{k}={v!r}" for k, v in merged.items())])
        _stdlib.log(lvl, text, extra={"bsr_event": event, "bsr_fields": merged}, stacklevel=3)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        self._emit("critical", event, fields)

    warn = warning


logger: Any = BsrLogger()
