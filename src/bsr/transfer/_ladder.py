"""The tier ladder: read one (chunk, group) from the first tier that can supply it.

Where it runs: the restore pipeline, on the event loop (:meth:`TierLadder.read`) or inside one of
its worker-thread calls (:meth:`TierLadder.read_blocking`, for tiers with ``blocking_reads``).

How it works: the probe lists, per (chunk, group), the tiers that hold the object, fastest first.
The ladder walks that list. Before each attempt it asks the decision side's :class:`ReadGate`
whether the tier may be tried (an open circuit breaker or a quarantined object says no); after
each attempt it reports a :class:`ReadOutcome` (ok, miss, corrupt, io_error, timeout, error) to
the same gate. It decides nothing itself: quarantine and tier health are the engine's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import (
    BsrError,
    CorruptObjectError,
    ObjectError,
    ObjectNotFoundError,
    TierTimeoutError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..tiers._base import Borrowed, LentPayloads, Tier
from ..tiers.file import ReadWithdrawnError


class Outcome(str, enum.Enum):
    """What one read attempt of one (chunk, group) on one tier came to."""

    #: payload read and verified
    OK = "ok"
    #: the tier no longer holds it (evicted or lost since the probe)
    MISS = "miss"
    #: the bytes failed verification (checksum, header, length, foreign object)
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
    #: the exception class the tier raised (e.g. ``CorruptObjectError``), if any
    error_type: str = ""

    @property
    def object_id(self) -> str:
        return ObjectKey(self.key, self.group).object_id


class ReadGate(Protocol):
    """The decision side of a read; the engine implements it. Thread-safe."""

    def admit(self, tier: str, key: ChunkKey, group: str) -> str | None:
        """None if ``tier`` may be asked for the object now, else why it is skipped."""

    def report(self, outcome: ReadOutcome) -> None:
        """Record what an admitted attempt came to (exactly once per admitted attempt).

        A gate may also offer ``report_ok(tier)``, the same as reporting an ``OK`` outcome
        without building it (the ladder uses it when present: one call per object read).
        """

    def withdraw(self, tier: str) -> None:
        """An admitted attempt was cancelled before it came to anything."""


def _failed_text(name: str, exc: BaseException) -> tuple[Outcome, str]:
    outcome = classify(exc)
    text = f"{name}: {exc}" if outcome is not Outcome.ERROR else f"{name}: unexpected {exc!r}"
    return outcome, text


def _wrong_length(n: int, expected: int, tier: str, group: str) -> CorruptObjectError:
    """A payload of ``n`` bytes where the layout says ``expected``: the object's fault."""
    return CorruptObjectError(
        f"payload is {n} bytes, the layout says {expected}", tier=tier, group=group
    )


def classify(exc: BaseException) -> Outcome:
    """The outcome a tier's exception stands for."""
    if isinstance(exc, ObjectError):
        return Outcome.CORRUPT
    if isinstance(exc, ObjectNotFoundError):
        return Outcome.MISS
    if isinstance(exc, TierTimeoutError):
        return Outcome.TIMEOUT
    if isinstance(exc, (BsrError, OSError)):
        return Outcome.IO_ERROR
    return Outcome.ERROR


@dataclass
class LadderResult:
    """The result of reading one (chunk, group) down the ladder."""

    tier: str | None = None
    nbytes: int = 0
    attempts: int = 0
    corrupt: bool = False
    errors: tuple[str, ...] = ()
    #: the payload lent in place by a tier with ``borrow_reads`` (nothing was read into the
    #: region then); the caller copies it and releases it
    borrowed: Borrowed | None = None

    @property
    def ok(self) -> bool:
        return self.tier is not None

    @property
    def fell_back(self) -> bool:
        """Served, but not by the first tier the probe listed (or after an error)."""
        return self.ok and (self.attempts > 1 or bool(self.errors))


@dataclass(slots=True)
class StreamItem:
    """One object of a streamed batch (:meth:`TierLadder.stream_admitted_blocking`): what to
    read, where to, and the caller's ``token``."""

    key: ChunkKey
    chunk: int
    group: str
    holders: Sequence[str]
    region: Any
    expected: int
    token: Any = None


class TierLadder:
    """Reads objects down the tiers that hold them, reporting every attempt to a gate.

    Args:
        tiers: the engine's tiers by name.
    """

    def __init__(self, tiers: Mapping[str, Tier]) -> None:
        self.tiers = dict(tiers)
        self._blocking = {n for n, t in self.tiers.items() if getattr(t, "blocking_reads", False)}
        self._inline = {n for n in self._blocking if getattr(self.tiers[n], "inline_reads", False)}
        self._borrow = {n for n in self._blocking if getattr(self.tiers[n], "borrow_reads", False)}
        self._stream = {n for n in self._blocking if getattr(self.tiers[n], "stream_reads", False)}

    def all_blocking(self, names: Sequence[str]) -> bool:
        """Whether every named tier supports :meth:`~bsr.Tier.read_into_blocking`."""
        return self._blocking.issuperset(names)

    def all_inline(self, names: Sequence[str]) -> bool:
        """Whether every named tier reads at memory speed (``inline_reads``)."""
        return self._inline.issuperset(names)

    def streams(self, name: str) -> bool:
        """Whether the tier ``name`` keeps several reads in flight on one thread
        (``stream_reads``: :meth:`~bsr.FileTier.stream_into_blocking`)."""
        return name in self._stream

    def lends(self, name: str) -> bool:
        """Whether the tier ``name`` lends verified payloads in place (``borrow_reads``)."""
        return name in self._borrow

    def _expect(self, n: int, expected: int, tier: str, group: str) -> None:
        if n != expected:
            raise _wrong_length(n, expected, tier, group)

    def _finish(
        self,
        gate: ReadGate,
        result: LadderResult,
        errors: list[str],
        name: str,
        key: ChunkKey,
        group: str,
        chunk: int,
        exc: BaseException | None,
        n: int,
    ) -> bool:
        """Report one attempt; return whether it succeeded."""
        if exc is None:
            report_ok = getattr(gate, "report_ok", None)
            if report_ok is not None:
                report_ok(name)
            else:
                gate.report(ReadOutcome(name, key, group, chunk, Outcome.OK, n))
            result.tier, result.nbytes = name, n
            result.errors = tuple(errors)
            return True
        outcome, text = _failed_text(name, exc)
        errors.append(text)
        result.corrupt = result.corrupt or outcome is Outcome.CORRUPT
        gate.report(ReadOutcome(name, key, group, chunk, outcome, 0, text, type(exc).__name__))
        return False

    def _admitted(
        self,
        gate: ReadGate,
        key: ChunkKey,
        group: str,
        holders: Sequence[str],
        result: LadderResult,
        errors: list[str],
    ) -> Iterator[str]:
        """The holders the gate lets this read try, in order (the skipped ones noted)."""
        for name in holders:
            why = gate.admit(name, key, group)
            if why is not None:
                errors.append(f"{name}: skipped, {why}")
                continue
            result.attempts += 1
            yield name

    @staticmethod
    def _exhausted(result: LadderResult, errors: list[str]) -> LadderResult:
        result.errors = tuple(errors or ["no tier holds it"])
        return result

    def borrow_many_blocking(
        self,
        gate: ReadGate,
        name: str,
        objects: Sequence[tuple[ChunkKey, int, str]],
        expected: Mapping[str, int],
        *,
        admitted: bool = False,
    ) -> tuple[LentPayloads, dict[int, tuple[str, Outcome]]] | None:
        """Borrow every ``(key, chunk, group)`` of ``objects`` from the lending tier ``name`` in
        one call (the first holder of each), in the calling (worker) thread.

        Only when the gate admits the whole batch at once (``admit_batch``: nothing to decide
        per object); None otherwise, and the caller reads object by object. Returns the lent
        payloads and, by index, the attempts that failed (a miss, a corrupt object, a payload of
        the wrong length: the error text and the outcome), each already reported to the gate
        like any attempt; the caller continues those down the ladder (:meth:`read_blocking` with
        ``prior``, a corrupt attempt marking the result corrupt) and releases the payloads once
        copied.

        ``admitted``: the caller's batch was admitted on ``name`` already (:meth:`admit_batch`)
        and reports its success once (:meth:`batch_ok`): no admission and no success report
        here, only the failed attempts'.
        """
        pairs = [(key, group) for key, _, group in objects]
        if not admitted:
            admit_batch = getattr(gate, "admit_batch", None)
            if admit_batch is None or not admit_batch(name, pairs):
                return None
        lent = self.tiers[name].borrow_many_blocking(pairs)
        failed: dict[int, tuple[str, Outcome]] = {}
        ok = False
        for i, got in enumerate(lent.items):
            key, chunk, group = objects[i]
            exc: BaseException | None = None
            if isinstance(got, BaseException):
                exc = got
            elif len(got) != expected[group]:
                exc = _wrong_length(len(got), expected[group], name, group)
            if exc is None:
                ok = True
                continue
            outcome, text = _failed_text(name, exc)
            failed[i] = (text, outcome)
            gate.report(ReadOutcome(name, key, group, chunk, outcome, 0, text, type(exc).__name__))
        if admitted:
            pass  # the caller's batch reports once
        elif ok:
            report_ok = getattr(gate, "report_ok", None)
            if report_ok is not None:
                report_ok(name)
            else:  # the batch's successes, as one OK outcome: the tier answered
                key, chunk, group = objects[0]
                gate.report(ReadOutcome(name, key, group, chunk, Outcome.OK))
        else:  # every object failed (each reported): the batch itself ends here
            end_batch = getattr(gate, "end_batch", None)
            if end_batch is not None:
                end_batch(name)
        return lent, failed

    def admit_batch(
        self, gate: ReadGate, objects: Sequence[tuple[ChunkKey, str, Sequence[str]]]
    ) -> str | None:
        """The one tier that is the first holder of every ``(key, group, holders)`` of a batch,
        if it reads blocking and the gate admits the whole batch at once (``admit_batch``:
        nothing to decide per object); else None (the ladder admits object by object)."""
        admit_batch = getattr(gate, "admit_batch", None)
        if admit_batch is None or not objects:
            return None
        first = objects[0][2]
        name = first[0] if first else None
        if name is None or name not in self._blocking:
            return None
        for _, _, holders in objects:
            if not holders or holders[0] != name:
                return None
        return name if admit_batch(name, [(k, g) for k, g, _ in objects]) else None

    def read_admitted_blocking(
        self,
        gate: ReadGate,
        name: str,
        key: ChunkKey,
        chunk: int,
        group: str,
        holders: Sequence[str],
        region: Any,
        expected: int,
    ) -> LadderResult:
        """:meth:`read_blocking` of an object whose batch the gate admitted on ``name``
        (:meth:`admit_batch`; ``holders[0]`` is ``name``): the first attempt needs no admission
        and, when it succeeds, no report (the batch reports once, :meth:`batch_ok`); when it
        fails it is reported like any attempt and the read goes on down the ladder."""
        n = 0
        try:
            n = self.tiers[name].read_into_blocking(key, group, region)
            if n == expected:
                return LadderResult(tier=name, nbytes=n, attempts=1)
            self._expect(n, expected, name, group)
        except Exception as exc:
            return self._first_failed(gate, name, key, chunk, group, holders, region, expected, exc)
        raise AssertionError("unreachable: a wrong length raised above")  # pragma: no cover

    def _first_failed(
        self,
        gate: ReadGate,
        name: str,
        key: ChunkKey,
        chunk: int,
        group: str,
        holders: Sequence[str],
        region: Any,
        expected: int,
        exc: Exception,
    ) -> LadderResult:
        """An admitted first attempt on ``name`` (``holders[0]``) failed with ``exc``: nothing
        when the request ended (:class:`ReadWithdrawnError`), else reported and read on down
        the ladder into ``region``."""
        if isinstance(exc, ReadWithdrawnError):  # the request ended: came to nothing
            return self._exhausted(LadderResult(attempts=1), [f"{name}: {exc}"])
        outcome, text = _failed_text(name, exc)
        gate.report(ReadOutcome(name, key, group, chunk, outcome, 0, text, type(exc).__name__))
        result = self.read_blocking(
            gate, key, chunk, group, holders[1:], region, expected, prior=(text,)
        )
        result.corrupt = result.corrupt or outcome is Outcome.CORRUPT
        return result

    def stream_admitted_blocking(
        self,
        gate: ReadGate,
        name: str,
        begin: Callable[[], StreamItem | None],
        end: Callable[[StreamItem, LadderResult], bool],
        ahead: int,
    ) -> None:
        """:meth:`read_admitted_blocking` of a batch's objects on ``name`` (a tier with
        ``stream_reads``), up to ``ahead`` reads in flight on the calling (worker) thread.

        ``begin()`` gives the next object (None: none now, asked again after each ``end``);
        ``end(item, result)`` gets each object's result as its read completes, after what
        :meth:`read_admitted_blocking` does with a failed first attempt (reported, then read
        on down the ladder into ``item.region``); it returns whether to begin more.
        """

        def tier_begin() -> tuple[Any, ChunkKey, str, Any] | None:
            item = begin()
            return None if item is None else (item, item.key, item.group, item.region)

        def tier_end(item: StreamItem, got: int | Exception) -> bool:
            if got == item.expected:
                return end(item, LadderResult(tier=name, nbytes=item.expected, attempts=1))
            if isinstance(got, Exception):
                exc = got
            else:
                exc = _wrong_length(got, item.expected, name, item.group)
            return end(item, self._first_failed(
                gate, name, item.key, item.chunk, item.group, item.holders, item.region,
                item.expected, exc,
            ))  # fmt: skip

        self.tiers[name].stream_into_blocking(tier_begin, tier_end, ahead)  # type: ignore[attr-defined]

    @staticmethod
    def batch_ok(gate: ReadGate, name: str, *, served: bool = True) -> None:
        """The end of a batch admitted on ``name``: one success report when the tier served any
        of its reads (``served``), else the batch just ends (each failure was reported)."""
        if not served:
            end_batch = getattr(gate, "end_batch", None)
            if end_batch is not None:
                end_batch(name)
            return
        report_ok = getattr(gate, "report_ok", None)
        if report_ok is not None:
            report_ok(name)

    def read_blocking(
        self,
        gate: ReadGate,
        key: ChunkKey,
        chunk: int,
        group: str,
        holders: Sequence[str],
        region: Any,
        expected: int,
        borrow: bool = False,
        prior: Sequence[str] = (),
    ) -> LadderResult:
        """Read ``(key, group)`` into ``region`` in the calling (worker) thread; with
        ``borrow``, a tier that lends payloads in place lends it instead (``result.borrowed``).

        ``prior``: what attempts before this call came to (a batch borrow that failed for this
        object), counted as attempts and errors of the result; ``holders`` are the ones left.
        """
        result, errors = LadderResult(attempts=len(prior)), list(prior)
        for name in self._admitted(gate, key, group, holders, result, errors):
            exc: BaseException | None = None
            n = 0
            try:
                if borrow and name in self._borrow:
                    lent = self.tiers[name].borrow_blocking(key, group)
                    n = len(lent.payload)
                    if n != expected:
                        lent.release()
                    else:
                        result.borrowed = lent
                else:
                    n = self.tiers[name].read_into_blocking(key, group, region)
                self._expect(n, expected, name, group)
            except ReadWithdrawnError as e:  # the request ended: the attempt came to nothing
                gate.withdraw(name)
                return self._exhausted(result, [*errors, f"{name}: {e}"])
            except Exception as e:
                exc = e
            if self._finish(gate, result, errors, name, key, group, chunk, exc, n):
                return result
        return self._exhausted(result, errors)

    async def read(
        self,
        gate: ReadGate,
        key: ChunkKey,
        chunk: int,
        group: str,
        holders: Sequence[str],
        region: Any,
        expected: int,
    ) -> LadderResult:
        """Read ``(key, group)`` into ``region`` with each tier's async ``read_into``."""
        result, errors = LadderResult(), list[str]()
        for name in self._admitted(gate, key, group, holders, result, errors):
            exc: BaseException | None = None
            n = 0
            try:
                n = await self.tiers[name].read_into(key, group, region)
                self._expect(n, expected, name, group)
            except ReadWithdrawnError as e:
                gate.withdraw(name)
                return self._exhausted(result, [*errors, f"{name}: {e}"])
            except Exception as e:
                exc = e
            except BaseException:  # cancelled: the attempt came to nothing
                gate.withdraw(name)
                raise
            if self._finish(gate, result, errors, name, key, group, chunk, exc, n):
                return result
        return self._exhausted(result, errors)
