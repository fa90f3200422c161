"""The bulk read on the tier seam: what a tier is handed, and what it hands back.

Where it runs: :meth:`Tier.read_many_blocking <bsr.Tier.read_many_blocking>` runs in one of the
transfer pipeline's worker threads (or on the event loop for a small batch of memory-speed
reads); ``begin`` and ``end`` are the pipeline's, called from that same thread.

How it works, in the shape of zarr's ``Store.get_many`` turned pull-based: the caller's
``begin()`` gives the next :class:`ReadItem` (a key, a group, a destination it owns, the payload
length its layout expects) or None when none can begin now; the tier moves the stored bytes and
calls ``end(item, result)`` exactly once per item begun, in the order its reads complete, with:

* an ``int``: that many payload bytes are in ``item.dst``, the object's stored 4 KiB header in
  ``item.header``;
* a :class:`Borrowed` (only when the caller allowed lending): the stored payload lent where the
  tier keeps it, pinned until :meth:`Borrowed.release`, the header in ``item.header``;
* an exception: a miss (:class:`~bsr.ObjectNotFoundError`), an I/O error, a damaged object
  the tier noticed, or :class:`~bsr.ReadWithdrawnError` once the calling request ended.

A tier **moves bytes; it does not vouch for them.** The caller checks every result against the
header (:meth:`~bsr.ObjectCodec.check_read`: key, group, namespace, length, both checksums)
before a byte is installed; a tier may check too (its own single-object reads do), but nothing
it returns is trusted because it says so. ``item.header`` and a lent payload stay valid until
``end`` returns (a lent payload until its release); ``item.dst`` is written only between the
item's ``begin`` and its ``end``, and the call returns only once no destination it was given
can still be written (a read the kernel still owns keeps the call waiting: the caller parks
the memory of a call it abandons, never reuses it).

The default (:func:`read_one_by_one`) reads item by item with the tier's
:meth:`~bsr.Tier.fetch_into_blocking`; a tier that moves a batch its own way overrides
:meth:`~bsr.Tier.read_many_blocking` (FileTier keeps ``ahead`` io_uring reads in flight,
HostTier lends a batch pinned under one lock) and declares ``bulk_reads``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ..core._keys import ChunkKey
    from ._base import Tier


class ReadItem:
    """One object of a bulk read (:meth:`~bsr.Tier.read_many_blocking`).

    Attributes:
        key: the chunk key.
        group: the state group.
        dst: where the payload goes: a writable flat host buffer (a NumPy array or memoryview)
            of at least ``expected`` bytes, owned by the caller; written only between this
            item's ``begin`` and its ``end``.
        expected: the payload length the caller's layout expects.
        chunk: the chunk's index in the caller's prefix (for its reports; a tier ignores it).
        holders: the tiers holding the object, fastest first (the caller's; a tier ignores it).
        token: the caller's own.
        header: set by the tier before ``end``: the object's stored header (at least
            ``ObjectCodec.HEADER_SIZE`` bytes, any buffer), valid until ``end`` returns.
        stored: set by the tier where it knows it: the object's stored length (header,
            payload, padding), which must match the header's (-1: not known).
    """

    __slots__ = (
        "chunk", "dst", "expected", "group", "header", "holders", "key", "stored", "token",
    )  # fmt: skip

    def __init__(
        self,
        key: ChunkKey,
        group: str,
        dst: Any,
        expected: int,
        *,
        chunk: int = 0,
        holders: tuple[str, ...] = (),
        token: Any = None,
    ) -> None:
        self.key = key
        self.group = group
        self.dst = dst
        self.expected = expected
        self.chunk = chunk
        self.holders = holders
        self.token = token
        self.header: Any = None
        self.stored = -1

    def __repr__(self) -> str:
        return f"ReadItem(chunk={self.chunk}, group={self.group!r}, key={self.key.hex[:12]})"


class Borrowed:
    """A stored payload lent by a tier in place (a bulk read with lending allowed).

    ``payload`` is a flat uint8 NumPy view of the tier's own bytes from the payload's first byte
    on (it may run past the payload's length: the header says how long it is); ``header`` is
    the object's stored header. Read them, never write them, and :meth:`release` (idempotent)
    as soon as the bytes were copied (a device copy: once it completed); until then the tier
    keeps the object pinned, neither evicted nor its memory reused.
    """

    __slots__ = ("_arg", "_many", "_release", "header", "payload")

    def __init__(
        self,
        payload: Any,
        release: Callable[[], None] | None,
        header: Any = None,
        *,
        many: Callable[[list[Any]], None] | None = None,
        arg: Any = None,
    ) -> None:
        self.payload = payload
        self.header = header
        self._release = release
        #: a tier that lets go of several lent objects in one call (HostTier: one lock for a
        #: batch of unpins) lends with ``many`` (``many([arg, ...])``) instead of ``release``
        self._many = many
        self._arg = arg

    def release(self) -> None:
        release, self._release = self._release, None
        many, self._many = self._many, None
        if release is not None:
            release()
        elif many is not None:
            many([self._arg])

    @property
    def released(self) -> bool:
        return self._release is None and self._many is None

    @staticmethod
    def release_all(lent: Iterable[Borrowed]) -> None:
        """:meth:`release` of each of ``lent`` (idempotent), those of a tier that lets go in
        bulk in one call per tier."""
        bulk: dict[Any, list[Any]] = {}
        for b in lent:
            many = b._many
            if many is not None:
                b._many = None
                args = bulk.get(many)
                if args is None:
                    bulk[many] = [b._arg]
                else:
                    args.append(b._arg)
            else:
                b.release()
        for many, args in bulk.items():
            many(args)


class Fetched(NamedTuple):
    """What :meth:`~bsr.Tier.fetch_into` moved: the object's stored ``header`` (a buffer of at
    least ``ObjectCodec.HEADER_SIZE`` bytes the caller may keep), ``nbytes`` of payload in the
    destination, and the object's ``stored`` length (header, payload and any padding; -1 when
    the tier cannot tell), which tells a truncated object from a destination too small.
    Unverified: :meth:`~bsr.ObjectCodec.check_read` is the check."""

    header: Any
    nbytes: int
    stored: int = -1


#: ``begin() -> ReadItem | None`` of a bulk read
Begin = Callable[[], "ReadItem | None"]
#: ``end(item, result) -> bool`` of a bulk read (False: begin no more)
End = Callable[["ReadItem", "int | Borrowed | BaseException"], bool]


def read_one_by_one(tier: Tier, begin: Begin, end: End) -> None:
    """The default bulk read: each item with ``tier.fetch_into_blocking``, in order."""
    while (item := begin()) is not None:
        result: int | BaseException
        try:
            fetched = tier.fetch_into_blocking(item.key, item.group, item.dst)
        except Exception as exc:
            result = exc
        else:
            item.header, result, item.stored = fetched
        if not end(item, result):
            return
