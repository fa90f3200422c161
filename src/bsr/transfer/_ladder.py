"""The tier ladder: read each object from the first tier that can supply it, and check it.

Where it runs: the restore pipeline, inside one of its worker-thread calls
(:meth:`TierLadder.read_many_blocking`, :meth:`TierLadder.read_one_blocking`) or on the event
loop (:meth:`TierLadder.read_one`, for tiers without blocking reads).

How it works: the probe lists, per (chunk, group), the tiers that hold the object, fastest
first. A batch whose objects one tier holds first goes to that tier's bulk read
(:meth:`~bsr.Tier.read_many_blocking`); anything else, and every object a tier could not serve,
walks down its holders one tier at a time. **Every result is checked here** before it counts:
the bytes a tier moved (into the destination, or lent in place) against the header stored with
them (:meth:`~bsr.ObjectCodec.check_read`: key, group, namespace, the layout's length, both
checksums). A tier's word is never taken for it, so a tier that returns the right length of
wrong bytes, or another key's object, has read a corrupt object like any other, and the object
goes on down its holders.

Before each attempt the decision side's :class:`ReadGate` says whether the tier may be tried (an
open circuit breaker or a quarantined object says no; a batch is admitted at once through a
:class:`BatchAdmission`); after it, a :class:`ReadOutcome` (ok, miss, corrupt, io_error, timeout,
error) is reported. The ladder decides nothing itself: quarantine and tier health are the
engine's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from xxhash import xxh3_64_intdigest

from .._errors import (
    BsrError,
    ObjectError,
    ObjectNotFoundError,
    ReadWithdrawnError,
    TierTimeoutError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..tiers._base import Tier
from ..tiers._codec import ObjectCodec
from ..tiers._codec import intact_header as intact_header
from ..tiers._reads import Borrowed, ReadItem

#: an async read's check runs on the event loop up to this payload size, else in a thread
INLINE_CHECK_BYTES = 256 << 10
HEADER_SIZE = ObjectCodec.HEADER_SIZE


class Outcome(str, enum.Enum):
    """What one read attempt of one (chunk, group) on one tier came to."""

    #: payload read and checked
    OK = "ok"
    #: the tier no longer holds it (evicted or lost since the probe)
    MISS = "miss"
    #: the bytes failed the check (checksum, header, length, foreign object)
    CORRUPT = "corrupt"
    #: an I/O error reading this object
    IO_ERROR = "io_error"
    #: the tier did not answer in time
    TIMEOUT = "timeout"
    #: the tier raised something unexpected (a bug in the tier)
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ReadOutcome:
    """One read attempt, as reported to the decision side."""

    tier: str
    key: ChunkKey
    group: str
    chunk: int
    outcome: Outcome
    nbytes: int = 0
    error: str = ""
    #: the exception class the read raised or the check found (e.g. ``CorruptObjectError``)
    error_type: str = ""

    @property
    def object_id(self) -> str:
        return ObjectKey(self.key, self.group).object_id


class BatchAdmission(Protocol):
    """A batch of reads the gate admitted on one tier at once (:meth:`ReadGate.admit_batch`):
    no admission and no success report per object."""

    def report(self, outcome: ReadOutcome) -> None:
        """One object's failed attempt (the batch goes on)."""

    def end(self, served: bool) -> None:
        """The batch ended (exactly once); ``served``: the tier served at least one of its
        reads (the tier answered: one success report for the batch)."""


class ReadGate(Protocol):
    """The decision side of a read; the engine implements it. Thread-safe."""

    def admit(self, tier: str, key: ChunkKey, group: str) -> str | None:
        """None if ``tier`` may be asked for the object now, else why it is skipped."""

    def admit_batch(
        self, tier: str, objects: Sequence[tuple[ChunkKey, str]]
    ) -> BatchAdmission | None:
        """Every object of a batch admitted on ``tier`` at once, or None (then each is
        admitted on its own)."""

    def report(self, outcome: ReadOutcome) -> None:
        """Record what an admitted attempt came to (exactly once per admitted attempt)."""

    def withdraw(self, tier: str) -> None:
        """An admitted attempt was cancelled before it came to anything."""


def classify(exc: BaseException) -> Outcome:
    """The outcome a read's exception stands for."""
    if isinstance(exc, ObjectError):
        return Outcome.CORRUPT
    if isinstance(exc, ObjectNotFoundError):
        return Outcome.MISS
    if isinstance(exc, TierTimeoutError):
        return Outcome.TIMEOUT
    if isinstance(exc, (BsrError, OSError)):
        return Outcome.IO_ERROR
    return Outcome.ERROR


@dataclass(slots=True)
class LadderResult:
    """The result of reading one (chunk, group) down the ladder."""

    tier: str | None = None
    nbytes: int = 0
    attempts: int = 0
    corrupt: bool = False
    errors: tuple[str, ...] = ()
    #: the payload lent in place (nothing was read into the destination then); whoever takes
    #: the result copies it and releases it
    borrowed: Borrowed | None = None
    #: the request ended while the read was in flight: no outcome for anyone
    withdrawn: bool = False

    @property
    def ok(self) -> bool:
        return self.tier is not None

    @property
    def fell_back(self) -> bool:
        """Served, but not by the first tier the probe listed (or after an error)."""
        return self.ok and (self.attempts > 1 or bool(self.errors))


#: ``end(item, result) -> bool`` of the ladder's bulk read (False: begin no more)
LadderEnd = Callable[[ReadItem, LadderResult], bool]


def checked(tier: Tier, item: ReadItem, got: int | Borrowed | BaseException) -> int | BaseException:
    """The payload length of a tier's result for ``item`` once it passed the check, else the
    error (a lent payload that fails is released here; a refused read counts as the tier's
    error)."""
    name = tier.name
    if isinstance(got, BaseException):
        return got
    if isinstance(got, Borrowed):  # lent: the payload runs to the object's end
        header = got.header if got.header is not None else item.header
        payload = got.payload
        n = len(payload)
        stored = HEADER_SIZE + n
    else:
        header, payload, n, stored = item.header, item.dst, got, item.stored
    fields = intact_header(header, stored, item.key, item.group) if header is not None else None
    if fields is not None:  # the usual read: checked here in one go (ObjectCodec.check_read)
        plen, psum = fields
        ok = plen == item.expected and n >= plen and len(payload) >= plen
        if ok and xxh3_64_intdigest(payload[:plen]) == psum:
            return plen
    if isinstance(got, Borrowed):
        got.release()
    tier.refused()
    return ObjectCodec.read_error(
        header, n, item.key, item.group, payload, item.expected, stored, where=name
    )


def _lent_intact(item: ReadItem, got: Borrowed) -> bool:
    """Whether a lent object passes the check (the usual case of :func:`checked`, in one go;
    one that does not is left to :func:`checked`, which names what failed)."""
    payload = got.payload
    header = got.header if got.header is not None else item.header
    fields = intact_header(header, HEADER_SIZE + len(payload), item.key, item.group)
    return (
        fields is not None
        and fields[0] == item.expected
        and len(payload) >= item.expected
        and xxh3_64_intdigest(payload[: item.expected]) == fields[1]
    )


def _failed(name: str, item: ReadItem, exc: BaseException) -> tuple[ReadOutcome, str]:
    outcome = classify(exc)
    text = f"{name}: {exc}" if outcome is not Outcome.ERROR else f"{name}: unexpected {exc!r}"
    report = ReadOutcome(
        name, item.key, item.group, item.chunk, outcome, 0, text, type(exc).__name__
    )
    return report, text


class TierLadder:
    """Reads objects down the tiers that hold them, checking and reporting every attempt.

    Args:
        tiers: the engine's tiers by name.
    """

    def __init__(self, tiers: Mapping[str, Tier]) -> None:
        self.tiers = dict(tiers)
        self._blocking = {n for n, t in self.tiers.items() if t.blocking_reads}
        self._inline = {n for n in self._blocking if self.tiers[n].inline_reads}
        self._bulk = {n for n in self._blocking if self.tiers[n].bulk_reads}

    def all_blocking(self, names: Sequence[str]) -> bool:
        """Whether every named tier has blocking reads."""
        return self._blocking.issuperset(names)

    def all_inline(self, names: Sequence[str]) -> bool:
        """Whether every named tier reads at memory speed (``inline_reads``)."""
        return self._inline.issuperset(names)

    def bulk(self, name: str) -> bool:
        """Whether the tier ``name`` moves batches its own way (``bulk_reads``)."""
        return name in self._bulk

    # ------------------------------------------------------------------ a batch
    def read_many_blocking(
        self,
        gate: ReadGate,
        name: str,
        begin: Callable[[], ReadItem | None],
        end: LadderEnd,
        ahead: int,
        *,
        objects: Sequence[tuple[ChunkKey, str]] = (),
        lend: bool = False,
    ) -> None:
        """Read a batch whose every item is first held by ``name`` through that tier's bulk
        read, in the calling (worker) thread; ``end(item, result)`` gets each item's checked
        result once (an item the tier could not serve has gone on down its holders by then).

        ``objects``: the batch's ``(key, group)`` for the gate to admit at once; without them,
        or when the gate will not, each item is admitted as it begins (one refused goes down
        its other holders at once). A result is ``end``'s only until ``end`` returns (the one
        of an object its first holder served is reused for the next such object).
        """
        admission = gate.admit_batch(name, objects) if objects else None
        served = False

        def admitted_begin() -> ReadItem | None:
            while (item := begin()) is not None:
                why = gate.admit(name, item.key, item.group)
                if why is None:
                    return item
                skipped = (f"{name}: skipped, {why}",)
                if not end(item, self.read_one_blocking(gate, item, item.holders[1:], lend=lend,
                                                         prior=skipped)):  # fmt: skip
                    return None
            return None

        tier = self.tiers[name]
        served_by_first = LadderResult(tier=name, attempts=1)  # handed to end, then reused

        def tier_end(item: ReadItem, got: int | Borrowed | BaseException) -> bool:
            nonlocal served
            if type(got) is Borrowed and _lent_intact(item, got):  # the usual case, in one go
                served = admission is not None or served
                if admission is None:
                    gate.report(ReadOutcome(name, item.key, item.group, item.chunk,
                                            Outcome.OK, item.expected))  # fmt: skip
                result = served_by_first
                result.nbytes, result.borrowed = item.expected, got
                return end(item, result)
            n = checked(tier, item, got)
            if not isinstance(n, BaseException):
                if admission is not None:
                    served = True
                else:
                    gate.report(ReadOutcome(name, item.key, item.group, item.chunk, Outcome.OK, n))
                result = served_by_first
                result.nbytes = n
                result.borrowed = got if isinstance(got, Borrowed) else None
                return end(item, result)
            if isinstance(n, ReadWithdrawnError):  # the request ended: nobody's outcome
                if admission is None:
                    gate.withdraw(name)
                return end(item, LadderResult(attempts=1, withdrawn=True, errors=(str(n),)))
            report, text = _failed(name, item, n)
            (gate if admission is None else admission).report(report)
            result = self.read_one_blocking(
                gate, item, item.holders[1:], lend=lend, prior=(text,),
                corrupt=report.outcome is Outcome.CORRUPT,
            )  # fmt: skip
            return end(item, result)

        tier_begin = begin if admission is not None else admitted_begin
        try:
            self.tiers[name].read_many_blocking(tier_begin, tier_end, ahead, lend=lend)
        finally:
            if admission is not None:
                admission.end(served)

    # ------------------------------------------------------------------ one object
    def _admitted(
        self, gate: ReadGate, item: ReadItem, holders: Sequence[str], result: LadderResult,
        errors: list[str],
    ) -> Iterator[str]:  # fmt: skip
        """The holders the gate lets this read try, in order (the skipped ones noted)."""
        for name in holders:
            why = gate.admit(name, item.key, item.group)
            if why is not None:
                errors.append(f"{name}: skipped, {why}")
                continue
            result.attempts += 1
            yield name

    def _settle(
        self, gate: ReadGate, name: str, item: ReadItem, got: int | Borrowed | BaseException,
        result: LadderResult, errors: list[str],
    ) -> bool:  # fmt: skip
        """Check and report one admitted attempt; whether it served the object (then
        ``result`` says so)."""
        n = checked(self.tiers[name], item, got)
        if isinstance(n, BaseException):
            report, text = _failed(name, item, n)
            errors.append(text)
            result.corrupt = result.corrupt or report.outcome is Outcome.CORRUPT
            gate.report(report)
            return False
        gate.report(ReadOutcome(name, item.key, item.group, item.chunk, Outcome.OK, n))
        result.tier, result.nbytes = name, n
        result.borrowed = got if isinstance(got, Borrowed) else None
        result.errors = tuple(errors)
        return True

    def read_one_blocking(
        self,
        gate: ReadGate,
        item: ReadItem,
        holders: Sequence[str],
        *,
        lend: bool = False,
        prior: Sequence[str] = (),
        corrupt: bool = False,
    ) -> LadderResult:
        """Read ``item`` from the first of ``holders`` that serves it, in the calling (worker)
        thread; with ``lend``, a tier may lend it in place (``result.borrowed``).

        ``prior``: what attempts before this call came to (counted as attempts and errors of
        the result); ``corrupt``: one of them found the object corrupt.
        """
        result = LadderResult(attempts=len(prior), corrupt=corrupt)
        errors = list(prior)
        for name in self._admitted(gate, item, holders, result, errors):
            tier = self.tiers[name]
            try:
                got = _one_blocking(tier, item, lend)
            except ReadWithdrawnError as exc:  # the request ended: the attempt came to nothing
                gate.withdraw(name)
                return LadderResult(attempts=result.attempts, withdrawn=True,
                                    errors=(*errors, f"{name}: {exc}"))  # fmt: skip
            except Exception as exc:
                got = exc
            if self._settle(gate, name, item, got, result, errors):
                return result
        result.errors = tuple(errors or ["no tier holds it"])
        return result

    async def read_one(
        self, gate: ReadGate, item: ReadItem, holders: Sequence[str]
    ) -> LadderResult:
        """:meth:`read_one_blocking` with each tier's async ``fetch_into`` (on the event loop;
        a large payload's check in a worker thread)."""
        result = LadderResult()
        errors: list[str] = []
        for name in self._admitted(gate, item, holders, result, errors):
            got: int | BaseException
            try:
                fetched = await self.tiers[name].fetch_into(item.key, item.group, item.dst)
                item.header, got, item.stored = fetched
            except ReadWithdrawnError as exc:
                gate.withdraw(name)
                return LadderResult(attempts=result.attempts, withdrawn=True,
                                    errors=(*errors, f"{name}: {exc}"))  # fmt: skip
            except Exception as exc:
                got = exc
            except BaseException:  # cancelled: the attempt came to nothing
                gate.withdraw(name)
                raise
            if item.expected > INLINE_CHECK_BYTES and not isinstance(got, BaseException):
                settle: Any = self._settle
                done = await anyio.to_thread.run_sync(settle, gate, name, item, got, result, errors)
            else:
                done = self._settle(gate, name, item, got, result, errors)
            if done:
                return result
        result.errors = tuple(errors or ["no tier holds it"])
        return result


def _one_blocking(tier: Tier, item: ReadItem, lend: bool) -> int | Borrowed | BaseException:
    """One object from one tier: lent in place where the tier lends (``lend``), else fetched
    into ``item.dst`` (its header then in ``item.header``)."""
    if not (lend and tier.bulk_reads):
        fetched = tier.fetch_into_blocking(item.key, item.group, item.dst)
        item.header, nbytes, item.stored = fetched
        return nbytes
    out: list[int | Borrowed | BaseException] = []
    pending = [item]

    def end(_: ReadItem, got: int | Borrowed | BaseException) -> bool:
        out.append(got)
        return False

    tier.read_many_blocking(lambda: pending.pop() if pending else None, end, 1, lend=True)
    if not out:  # a tier that broke the contract (never ended the item)
        return ObjectNotFoundError("the tier ended no read", tier=tier.name, group=item.group)
    return out[0]
