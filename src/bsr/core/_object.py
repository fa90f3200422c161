"""The self-describing object format.

An object is the stored bytes of one (chunk key, group) on one rank::

    [ header: HEADER_SIZE (4096) bytes ][ payload: payload_len bytes ][ zero padding to 4 KiB ]

Header fields (little endian), then zero padding to 4096 bytes:

    magic          8s   b"BSR\\x00OBJ\\x01"
    version        u16  FORMAT_VERSION
    flags          u16  reserved, 0
    namespace      16s  namespace fingerprint (model, rank, salt, layout, format version)
    key            32s  chained chunk key digest
    group          16s  digest of the state group name
    chunk_index    u64  position of the chunk in its prefix (informative, verified)
    payload_len    u64  bytes of payload
    payload_sum    u64  xxh3-64 of the payload
    header_sum     u64  xxh3-64 of the 4096 header bytes with this field zeroed

The header is a whole 4 KiB page so that the payload starts aligned (O_DIRECT, GPU DMA). Every
read verifies every field; a mismatch raises a typed :class:`~bsr.ObjectError` and the bytes are
never returned as valid.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

from .._errors import CorruptObjectError, ForeignObjectError, TruncatedObjectError
from ._keys import FORMAT_VERSION, ObjectKey
from ._layout import align_up

MAGIC = b"BSR\x00OBJ\x01"
HEADER_SIZE = 4096
_FIELDS = struct.Struct("<8sHH16s32s16sQQQQ")
_SUM_OFFSET = _FIELDS.size - 8
#: byte offset of payload_len in the header (for cheap structural checks)
PAYLOAD_LEN_OFFSET = 8 + 2 + 2 + 16 + 32 + 16 + 8


def payload_checksum(payload: Any) -> int:
    """xxh3-64 of a bytes-like payload (releases the GIL on large inputs)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def object_size(payload_len: int) -> int:
    """Stored size of an object with a payload of ``payload_len`` bytes (4 KiB multiple)."""
    return HEADER_SIZE + align_up(payload_len)


def encode_header(okey: ObjectKey, payload_len: int, payload_sum: int) -> bytes:
    """The 4096-byte header of ``okey`` with a payload of ``payload_len`` bytes."""
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        okey.chunk.namespace,
        okey.chunk.digest,
        okey.group_digest,
        okey.chunk.index,
        payload_len,
        payload_sum,
        0,
    )
    header = bytearray(HEADER_SIZE)
    header[: len(fields)] = fields
    hsum = xxhash.xxh3_64_intdigest(bytes(header))
    header[_SUM_OFFSET : _SUM_OFFSET + 8] = hsum.to_bytes(8, "little")
    return bytes(header)


_ZERO_SUM = bytes(8)


def _ctx(okey: ObjectKey, where: str) -> dict[str, Any]:
    """Structured fields of an object error (built only when one is raised)."""
    return {"key": okey.chunk.hex[:16], "group": okey.group, "where": where or None}


def decode_header(header: Any, okey: ObjectKey, *, where: str = "") -> tuple[int, int]:
    """Verify a header against the expected object; return ``(payload_len, payload_sum)``.

    Raises:
        TruncatedObjectError: fewer than HEADER_SIZE bytes.
        CorruptObjectError: bad magic or header checksum.
        ForeignObjectError: an intact header of another version, namespace, key, group or index.
    """
    mv = memoryview(header).cast("B")
    if len(mv) < HEADER_SIZE:
        raise TruncatedObjectError(
            f"object header is {len(mv)} bytes, expected {HEADER_SIZE}", **_ctx(okey, where)
        )
    mv = mv[:HEADER_SIZE]
    (magic, version, flags, ns, key, group, index, plen, psum, hsum) = _FIELDS.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptObjectError("not a bsr object (bad magic)", **_ctx(okey, where))
    # the header checksum covers the header with its own field zeroed; hash it in three pieces
    # (the same digest as one pass) instead of copying 4 KiB twice
    h = xxhash.xxh3_64()
    h.update(mv[:_SUM_OFFSET])
    h.update(_ZERO_SUM)
    h.update(mv[_SUM_OFFSET + 8 :])
    if h.intdigest() != hsum:
        raise CorruptObjectError("object header checksum mismatch", **_ctx(okey, where))
    if version != FORMAT_VERSION or flags != 0:
        raise ForeignObjectError(
            f"object format version {version} (flags {flags}), this bsr reads {FORMAT_VERSION}",
            **_ctx(okey, where),
        )
    if ns != okey.chunk.namespace:
        raise ForeignObjectError(
            "object belongs to another namespace or layout", **_ctx(okey, where)
        )
    if key != okey.chunk.digest or index != okey.chunk.index:
        raise ForeignObjectError("object holds another chunk key", **_ctx(okey, where))
    if group != okey.group_digest:
        raise ForeignObjectError("object holds another state group", **_ctx(okey, where))
    return int(plen), int(psum)


def verify_payload(
    payload: Any, payload_len: int, payload_sum: int, okey: ObjectKey, *, where: str = ""
) -> None:
    """Check the payload's length and checksum against its header."""
    mv = memoryview(payload).cast("B")
    if len(mv) != payload_len:
        raise TruncatedObjectError(
            f"payload is {len(mv)} bytes, header says {payload_len}", **_ctx(okey, where)
        )
    if payload_checksum(mv) != payload_sum:
        raise CorruptObjectError("payload checksum mismatch", **_ctx(okey, where))


def encode_object(okey: ObjectKey, payload: Any) -> bytes:
    """Header + payload + zero padding, as stored."""
    mv = memoryview(payload).cast("B")
    header = encode_header(okey, len(mv), payload_checksum(mv))
    pad = align_up(len(mv)) - len(mv)
    return b"".join((header, mv, b"\x00" * pad))


def decode_object(blob: Any, okey: ObjectKey, *, where: str = "") -> memoryview:
    """Verify a whole stored object; return a view of its payload."""
    mv = memoryview(blob).cast("B")
    plen, psum = decode_header(mv, okey, where=where)
    if len(mv) < HEADER_SIZE + plen:
        raise TruncatedObjectError(
            f"object is {len(mv)} bytes, header says {HEADER_SIZE + plen}",
            key=okey.chunk.hex[:16],
            group=okey.group,
        )
    payload = mv[HEADER_SIZE : HEADER_SIZE + plen]
    verify_payload(payload, plen, psum, okey, where=where)
    return payload
