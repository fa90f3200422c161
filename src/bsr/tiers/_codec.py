"""ObjectCodec: the one encode / decode / verify of the self-describing object every tier uses.

Where it runs: anywhere (pure memory work); tiers call it in worker threads for large payloads.

How it works: a stored object is the 4096-byte header (:mod:`bsr.core._object`: magic, format
version, namespace, key, group, chunk index, payload length and checksum, header checksum)
followed by the payload, optionally zero-padded to a 4 KiB multiple (file tiers pad for
``O_DIRECT``; stores that keep exact lengths do not). A tier never interprets the bytes itself:
it hands what it stored, or what it read, to the codec, which either returns a verified payload
or raises a typed :class:`~bsr.ObjectError`. Nothing unverified ever reaches the caller's buffer
as valid: :meth:`ObjectCodec.decode_into` checks the header and the stored length before it
copies anything, and a too-small destination is a :class:`~bsr.ConfigError` (the
object itself is fine and is kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .._errors import ConfigError, CorruptObjectError, ObjectError, TruncatedObjectError
from ..core._keys import FORMAT_VERSION, ChunkKey, ObjectKey, group_digest
from ..core._layout import align_up
from ..core._object import (
    _FIELDS,
    _SUM_OFFSET,
    _ZERO_SUM,
    HEADER_SIZE,
    MAGIC,
    PAYLOAD_LEN_OFFSET,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from ._reads import Fetched
from ._views import as_byte_view, as_payload_view


class ObjectHeader(NamedTuple):
    """What a verified header says about its payload."""

    payload_len: int
    payload_sum: int


def _ctx(okey: ObjectKey, where: str) -> dict[str, Any]:
    return {"key": okey.chunk.hex[:16], "group": okey.group, "tier": where or None}


def intact_header(header: Any, stored: int, key: ChunkKey, group: str) -> tuple[int, int] | None:
    """``(payload_len, payload_sum)`` of the first HEADER_SIZE bytes of ``header`` (any buffer)
    when they are an intact header of ``(key, group)`` (magic, version, flags, namespace, key,
    group, index and the header checksum) and ``stored`` (the object's stored length; -1: not
    known) is what it says, padded or not; else None (the one-object checks then say why)."""
    if len(header) < HEADER_SIZE:
        return None
    (magic, version, flags, ns, digest, gd, index, plen, psum, hsum) = _FIELDS.unpack_from(header)
    h = xxhash.xxh3_64(header[:_SUM_OFFSET])
    h.update(_ZERO_SUM)
    h.update(header[_SUM_OFFSET + 8 : HEADER_SIZE])
    if (
        h.intdigest() == hsum
        and magic == MAGIC
        and version == FORMAT_VERSION
        and not flags
        and digest == key.digest
        and ns == key.namespace
        and index == key.index
        and gd == group_digest(group)
        and (stored < 0 or stored == HEADER_SIZE + plen or stored == HEADER_SIZE + align_up(plen))
    ):
        return plen, psum
    return None


class ObjectCodec:
    """Encode, decode and verify stored objects (static methods; no state).

    A remote tier needs only :meth:`encode` / :meth:`encode_into` to write and
    :meth:`decode_into` to read; a tier that reads the payload straight into the destination
    (a file tier) uses :meth:`decode_header`, :meth:`check_stored_size` and
    :meth:`verify_payload`.
    """

    #: bytes of the header before every payload (a whole 4 KiB page: the payload stays aligned)
    HEADER_SIZE = HEADER_SIZE

    @staticmethod
    def stored_size(payload_len: int, *, padded: bool = False) -> int:
        """Bytes an object with ``payload_len`` payload bytes takes (padded: 4 KiB multiple)."""
        return HEADER_SIZE + (align_up(payload_len) if padded else payload_len)

    @staticmethod
    def header(okey: ObjectKey, payload: Any) -> bytes:
        """The 4096-byte header of ``okey`` for ``payload`` (its checksum computed here)."""
        mv = as_payload_view(payload)
        return encode_header(okey, len(mv), payload_checksum(mv))

    @staticmethod
    def encode(okey: ObjectKey, payload: Any, *, padded: bool = False) -> bytes:
        """Header + payload (+ zero padding to 4 KiB when ``padded``): the bytes to store."""
        mv = as_payload_view(payload)
        pad = b"\x00" * (align_up(len(mv)) - len(mv)) if padded else b""
        return b"".join((encode_header(okey, len(mv), payload_checksum(mv)), mv, pad))

    @staticmethod
    def encode_into(okey: ObjectKey, payload: Any, out: Any) -> int:
        """Write header + payload into ``out`` (a buffer of at least ``stored_size`` bytes).

        The checksum is computed on the copy in ``out``, so what is stored is what was summed
        even if the caller's buffer changes meanwhile. Returns the bytes written.
        """
        mv = as_payload_view(payload)
        dst = np.frombuffer(as_byte_view(out), dtype=np.uint8)
        size = HEADER_SIZE + len(mv)
        if len(dst) < size:
            raise ConfigError(f"encode_into needs {size} bytes of room, the buffer has {len(dst)}")
        body = dst[HEADER_SIZE:size]
        np.copyto(body, np.frombuffer(mv, dtype=np.uint8))
        dst[:HEADER_SIZE] = np.frombuffer(
            encode_header(okey, len(mv), payload_checksum(body)), dtype=np.uint8
        )
        return size

    @staticmethod
    def decode_header(header: Any, okey: ObjectKey, *, where: str = "") -> ObjectHeader:
        """Verify a header against the object expected; return what it says.

        Raises:
            TruncatedObjectError: fewer than HEADER_SIZE bytes.
            CorruptObjectError: bad magic or header checksum.
            ForeignObjectError: an intact header of another version, namespace, key or group.
        """
        return ObjectHeader(*decode_header(header, okey, where=where))

    @staticmethod
    def check_stored_size(
        header: ObjectHeader, stored: int, okey: ObjectKey, *, where: str = ""
    ) -> None:
        """The stored length must be exactly header + payload, padded or not."""
        exact = HEADER_SIZE + header.payload_len
        if stored not in (exact, HEADER_SIZE + align_up(header.payload_len)):
            raise TruncatedObjectError(
                f"stored object is {stored} bytes, its header says {exact}", **_ctx(okey, where)
            )

    @staticmethod
    def verify_payload(
        payload: Any, header: ObjectHeader, okey: ObjectKey, *, where: str = ""
    ) -> None:
        """Check the payload's length and checksum against its header (an ObjectError if not)."""
        verify_payload(payload, header.payload_len, header.payload_sum, okey, where=where)

    @staticmethod
    def verified_payload(
        blob: Any, okey: ObjectKey, *, where: str = ""
    ) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Verify a whole stored object (header, stored length, payload checksum) where it lies;
        return a view of its payload (no copy). ``blob`` must not change while the view is used.
        """
        # the steps of decode_header / check_stored_size / verify_payload without their
        # wrappers: a host install calls this once per chunk
        if type(blob) is np.ndarray and blob.dtype == np.uint8 and blob.flags.c_contiguous:
            src = blob.reshape(-1)  # a tier's own buffer (HostTier): no new view of it
        else:
            src = np.frombuffer(as_payload_view(blob), dtype=np.uint8)
        plen, psum = decode_header(src[:HEADER_SIZE], okey, where=where)
        stored = len(src)
        if stored != HEADER_SIZE + plen and stored != HEADER_SIZE + align_up(plen):
            ObjectCodec.check_stored_size(ObjectHeader(plen, psum), stored, okey, where=where)
        body = src[HEADER_SIZE : HEADER_SIZE + plen]
        verify_payload(body, plen, psum, okey, where=where)
        return body

    @staticmethod
    def verified_bodies(
        blobs: Sequence[np.ndarray[Any, np.dtype[np.uint8]]],
        objects: Sequence[tuple[ChunkKey, str]],
        *,
        where: str = "",
    ) -> list[Any]:
        """:meth:`verified_payload` of a batch: for each stored object ``blobs[i]`` (a tier's
        own flat uint8 buffer, header + payload, padded or not) of ``objects[i]``, its payload
        (a view, no copy) when the header (every field and its checksum), the stored length and
        the payload checksum all check, else the typed :class:`~bsr.ObjectError` the one-object
        checks raise for it. One loop and no :class:`ObjectKey` per object: a host read of a
        batch of chunks verifies each of them here, every byte as before.
        """
        out: list[Any] = []
        append = out.append
        digest64: Any = xxhash.xxh3_64_intdigest  # takes any buffer (a NumPy view)
        for blob, (key, group) in zip(blobs, objects):
            stored = len(blob)
            fields = intact_header(blob, stored, key, group) if stored >= HEADER_SIZE else None
            if fields is not None:
                plen, psum = fields
                body = blob[HEADER_SIZE : HEADER_SIZE + plen]
                if digest64(body) == psum:
                    append(body)
                    continue
            try:  # the one-object checks name what failed
                ObjectCodec.verified_payload(blob, ObjectKey(key, group), where=where)
                raise CorruptObjectError(
                    "object failed verification", **_ctx(ObjectKey(key, group), where)
                )
            except ObjectError as exc:
                append(exc)
        return out

    @staticmethod
    def read_payload_len(
        header: Any, n: int, stored: int, key: ChunkKey, group: str, payload: Any
    ) -> int:
        """The happy path of a tier's read check, in one call: the payload length when a read
        of ``n`` bytes of a ``stored``-byte object left an intact header of ``(key, group)`` in
        ``header`` (every field and its checksum), the stored length matches it, ``payload``
        (what was read after the header) holds the whole payload and its checksum is right;
        else -1, and the caller runs the one-object checks (:meth:`decode_header`,
        :meth:`check_stored_size`, :meth:`verify_payload`), which raise the typed error that
        says what failed. A read verifies its object here: one call, not five, per object.
        """
        if n < HEADER_SIZE:
            return -1
        fields = intact_header(header, stored, key, group)
        if fields is None:
            return -1
        plen, psum = fields
        if plen > len(payload) or n < HEADER_SIZE + plen:
            return -1
        if xxhash.xxh3_64_intdigest(payload[:plen]) != psum:
            return -1
        return plen

    @staticmethod
    def copy_out(blob: Any, dst: Any) -> Fetched:
        """What a tier that keeps whole stored objects (a key-value store) returns from
        :meth:`~bsr.Tier.fetch_into`: ``blob``'s header (a copy) and as much of its payload as
        ``dst`` holds, copied into ``dst``, unchecked (the reader checks them)."""
        src = np.frombuffer(as_payload_view(blob), dtype=np.uint8)
        out = np.frombuffer(as_byte_view(dst), dtype=np.uint8)
        n = max(0, min(len(src) - HEADER_SIZE, len(out)))
        out[:n] = src[HEADER_SIZE : HEADER_SIZE + n]
        return Fetched(src[:HEADER_SIZE].tobytes(), n, len(src))

    @staticmethod
    def stated_length(header: Any) -> int:
        """The payload length ``header`` states, unverified (-1 when it is too short): for a
        tier's counters, never for a decision."""
        if header is None or len(header) < HEADER_SIZE:
            return -1
        return int.from_bytes(header[PAYLOAD_LEN_OFFSET : PAYLOAD_LEN_OFFSET + 8], "little")

    @staticmethod
    def check_read(
        header: Any, nbytes: int, key: ChunkKey, group: str, payload: Any, expected: int,
        stored: int = -1,
    ) -> int:  # fmt: skip
        """The check of a read the engine makes whatever tier moved the bytes: the payload
        length when ``header`` is an intact header of ``(key, group)`` (every field and its
        checksum) saying ``expected`` payload bytes, ``nbytes`` (what the tier moved into
        ``payload``, or the length of a lent ``payload``) covers them and their checksum is
        right; else -1, and :meth:`read_error` names what failed. One call per object.
        ``expected`` -1: any length (a caller without a layout); ``stored``: the object's
        stored length where the tier knows it (it must match the header's, padded or not).
        """
        if header is None:
            return -1
        fields = intact_header(header, stored, key, group)
        if fields is None:
            return -1
        plen, psum = fields
        if (expected >= 0 and plen != expected) or nbytes < plen or len(payload) < plen:
            return -1
        if xxhash.xxh3_64_intdigest(payload[:plen]) != psum:
            return -1
        return plen

    @staticmethod
    def read_error(
        header: Any, nbytes: int, key: ChunkKey, group: str, payload: Any, expected: int,
        stored: int = -1, *, where: str = "",
    ) -> ObjectError | ConfigError:  # fmt: skip
        """The typed error for a read :meth:`check_read` refused (what failed, named): an
        :class:`~bsr.ObjectError`, or a :class:`~bsr.ConfigError` when an intact object's
        payload is larger than the caller's ``payload`` buffer (the object is fine)."""
        okey = ObjectKey(key, group)
        try:
            if header is None:
                raise CorruptObjectError("the tier returned no header", **_ctx(okey, where))
            head = ObjectCodec.decode_header(header, okey, where=where)
            if stored >= 0:  # a forged length is the object's fault, not the destination's
                ObjectCodec.check_stored_size(head, stored, okey, where=where)
            if expected < 0 and head.payload_len > len(payload):
                return ConfigError(
                    f"destination holds {len(payload)} bytes, object payload is "
                    f"{head.payload_len}; pass a buffer of the chunk's size",
                    tier=where or None,
                )
            if expected >= 0 and head.payload_len != expected:
                raise CorruptObjectError(
                    f"payload is {head.payload_len} bytes, the layout says {expected}",
                    **_ctx(okey, where),
                )
            if nbytes < head.payload_len or len(payload) < head.payload_len:
                raise TruncatedObjectError(
                    f"short read: {min(nbytes, len(payload))} payload bytes, the header says "
                    f"{head.payload_len}",
                    **_ctx(okey, where),
                )
            ObjectCodec.verify_payload(payload[: head.payload_len], head, okey, where=where)
        except ObjectError as exc:
            return exc
        return CorruptObjectError("object failed verification", **_ctx(okey, where))

    @staticmethod
    def decode_into(blob: Any, okey: ObjectKey, dst: Any, *, where: str = "") -> int:
        """Verify a whole stored object and copy its payload into ``dst``; return its length.

        ``blob`` is what the store returned (header + payload, padded or not). The header and
        the stored length and then the payload checksum are checked before anything is
        copied, so ``dst`` never receives a byte of an object that fails verification (``blob``
        must be the tier's own buffer, which nothing else writes meanwhile). ``dst`` must hold
        the payload: a smaller one is a :class:`~bsr.ConfigError` (the object is fine).
        """
        src = np.frombuffer(as_payload_view(blob), dtype=np.uint8)
        head = ObjectCodec.decode_header(src[:HEADER_SIZE], okey, where=where)
        ObjectCodec.check_stored_size(head, len(src), okey, where=where)
        view = as_byte_view(dst)
        plen = head.payload_len
        if plen > len(view):
            raise ConfigError(
                f"destination holds {len(view)} bytes, object payload is {plen}; pass a buffer "
                "of the chunk's size",
                tier=where or None,
            )
        body = src[HEADER_SIZE : HEADER_SIZE + plen]
        ObjectCodec.verify_payload(body, head, okey, where=where)
        np.copyto(np.frombuffer(view, dtype=np.uint8, count=plen), body)
        return plen
