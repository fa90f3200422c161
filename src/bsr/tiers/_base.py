"""The abstract tier: a place that retains objects.

Where it runs: on the serving process's event loop (any anyio backend). Blocking work (file I/O,
store RPCs, large memcpy) must run in worker threads; every method is a coroutine.

A tier implements a small core (``contains_many``, ``read_into``, ``write``, ``delete``,
``statistics``) and inherits working defaults for the rest. ``read_into`` writes the payload into a
caller-provided buffer (a staging slot region) and verifies the object's header and checksum
before returning; it never returns unverified bytes as valid. Capability flags are class
attributes, as in zarr's stores.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import torch

from .._errors import ClosedError, ConfigError
from .._log import logger
from ..core._keys import ChunkKey, ObjectKey


@dataclass(frozen=True)
class TierStatistics:
    """A snapshot of a tier's counters."""

    name: str
    objects: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    errors: int
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    quarantined: int
    peak_bytes: int


class _Counters:
    __slots__ = (
        "bytes_read",
        "bytes_written",
        "errors",
        "evictions",
        "hits",
        "misses",
        "peak_bytes",
        "quarantined",
        "reads",
        "writes",
    )

    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.errors = 0
        self.reads = self.writes = self.bytes_read = self.bytes_written = 0
        self.quarantined = self.peak_bytes = 0


def as_byte_view(dst: Any) -> memoryview:
    """A writable flat byte view of a CPU buffer (uint8 tensor, numpy array, bytearray...)."""
    if isinstance(dst, torch.Tensor):
        if dst.device.type != "cpu":
            raise ConfigError(
                "this tier reads into host buffers; pass a CPU tensor", device=str(dst.device)
            )
        if not dst.is_contiguous():
            raise ConfigError("read_into needs a contiguous destination tensor")
        dst = dst.view(torch.uint8).reshape(-1).numpy()
    mv = memoryview(dst)
    if mv.readonly:
        raise ConfigError("read_into needs a writable destination buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def as_payload_view(payload: Any) -> memoryview:
    """A flat byte view of a payload to store (bytes-likes as they are, else as_byte_view)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        mv = memoryview(payload)
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    return as_byte_view(payload)


class Tier(abc.ABC):
    """Abstract async tier. Use as ``async with tier:`` or call :meth:`aclose`.

    Subclasses implement the abstract methods; the batch helpers have working defaults that a
    subclass may override with a faster native batch call.
    """

    #: objects survive a process restart
    durable: ClassVar[bool] = False
    #: ``contains_many`` reads no payload bytes
    metadata_only_probe: ClassVar[bool] = True
    #: suggested read concurrency for this tier
    default_io_depth: ClassVar[int] = 4

    def __init__(self, name: str) -> None:
        self.name = name
        self._closed = False
        self._counters = _Counters()
        self._log = logger.bind(tier=name)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Prepare the tier (default: nothing). Called by ``async with`` and by the engine."""

    async def aclose(self) -> None:
        """Release resources. Later calls raise :class:`~bsr.ClosedError`."""
        self._closed = True

    async def __aenter__(self) -> Tier:
        await self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"tier {self.name!r} is closed; open a new one", tier=self.name)

    # ------------------------------------------------------------------ abstract core
    @abc.abstractmethod
    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        """For each object, whether this tier holds it completely. Metadata only."""

    @abc.abstractmethod
    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        """Read and verify the payload of ``(key, group)`` into ``dst``; return its length.

        Raises:
            ObjectNotFoundError: the tier does not hold it.
            ObjectError: it failed verification (nothing valid was returned).
            TierError: I/O failure or timeout.
        """

    @abc.abstractmethod
    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        """Store ``payload`` for ``(key, group)``. Returns False if already stored (kept as is).

        The object becomes visible to ``contains_many`` only once completely written.
        """

    @abc.abstractmethod
    async def delete(self, key: ChunkKey, group: str) -> bool:
        """Remove the object; return whether it existed."""

    @abc.abstractmethod
    def _usage(self) -> tuple[int, int, int]:
        """(objects, bytes, capacity_bytes)."""

    # ------------------------------------------------------------------ defaults
    async def contains(self, key: ChunkKey, group: str) -> bool:
        return (await self.contains_many([ObjectKey(key, group)]))[0]

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        """Take a failing object out of service so later probes treat it as a miss.

        Default: delete it. Durable tiers may move it aside for inspection instead.
        """
        self._counters.quarantined += 1
        self._log.warning("bsr.tier.quarantine", key=key.hex[:16], group=group, reason=reason)
        try:
            await self.delete(key, group)
        except Exception as exc:  # a tier that cannot delete must still not fail the caller
            self._log.warning(
                "bsr.tier.quarantine_failed", key=key.hex[:16], group=group, error=repr(exc)
            )

    def statistics(self) -> TierStatistics:
        objects, nbytes, capacity = self._usage()
        c = self._counters
        c.peak_bytes = max(c.peak_bytes, nbytes)
        return TierStatistics(
            name=self.name,
            objects=objects,
            bytes=nbytes,
            capacity_bytes=capacity,
            hits=c.hits,
            misses=c.misses,
            evictions=c.evictions,
            errors=c.errors,
            reads=c.reads,
            writes=c.writes,
            bytes_read=c.bytes_read,
            bytes_written=c.bytes_written,
            quarantined=c.quarantined,
            peak_bytes=c.peak_bytes,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class TierWrapper(Tier):
    """A tier that adds behaviour around another tier (latency, faults, logging...).

    Every method delegates to ``inner``; a wrapper overrides only what it changes. The wrapper
    takes the inner tier's name by default, so results and ``bytes_by_tier`` read the same as
    without it.
    """

    def __init__(self, inner: Tier, *, name: str | None = None) -> None:
        super().__init__(name or inner.name)
        self.inner = inner
        self.durable = inner.durable  # type: ignore[misc]

    async def open(self) -> None:
        await self.inner.open()

    async def aclose(self) -> None:
        await self.inner.aclose()
        await super().aclose()

    def _usage(self) -> tuple[int, int, int]:
        s = self.inner.statistics()
        return s.objects, s.bytes, s.capacity_bytes

    def statistics(self) -> TierStatistics:
        return self.inner.statistics()

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        return await self.inner.contains_many(objects)

    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        return await self.inner.read_into(key, group, dst)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        return await self.inner.write(key, group, payload)

    async def delete(self, key: ChunkKey, group: str) -> bool:
        return await self.inner.delete(key, group)

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        await self.inner.quarantine(key, group, reason)
