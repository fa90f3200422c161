"""The self-verifying object format: every header field and the payload are checked."""

from __future__ import annotations

import pytest

import bsr
from bsr.core._object import (
    _FIELDS,
    HEADER_SIZE,
    decode_object,
    encode_object,
    object_size,
)
from bsr.testing import make_keys, payload

KEY = bsr.ObjectKey(make_keys(2)[1], "kv")
BLOB = encode_object(KEY, payload(1, 3 * 4096 + 100))

# (name, offset, size) of every field of the header
_NAMES = [
    "magic",
    "version",
    "flags",
    "namespace",
    "key",
    "group",
    "chunk_index",
    "payload_len",
    "payload_sum",
    "header_sum",
]
_SIZES = [8, 2, 2, 16, 32, 16, 8, 8, 8, 8]
FIELDS = []
_off = 0
for _n, _s in zip(_NAMES, _SIZES):
    FIELDS.append((_n, _off, _s))
    _off += _s
assert _off == _FIELDS.size


def test_round_trip_and_padding() -> None:
    assert len(BLOB) == object_size(3 * 4096 + 100) == HEADER_SIZE + 4 * 4096
    assert bytes(decode_object(BLOB, KEY)) == payload(1, 3 * 4096 + 100).tobytes()


@pytest.mark.parametrize("name, offset, size", FIELDS)
@pytest.mark.parametrize("bit", [0, 5])
def test_a_flipped_bit_in_every_header_field_is_detected(
    name: str, offset: int, size: int, bit: int
) -> None:
    for byte in {offset, offset + size - 1}:
        damaged = bytearray(BLOB)
        damaged[byte] ^= 1 << bit
        with pytest.raises(bsr.ObjectError):
            decode_object(bytes(damaged), KEY)


def test_flipped_bits_in_padding_of_header_are_detected() -> None:
    damaged = bytearray(BLOB)
    damaged[HEADER_SIZE - 1] ^= 1
    with pytest.raises(bsr.CorruptObjectError):
        decode_object(bytes(damaged), KEY)


@pytest.mark.parametrize("where", [0, 1, 4096, 3 * 4096 + 99])
def test_a_flipped_payload_bit_is_detected(where: int) -> None:
    damaged = bytearray(BLOB)
    damaged[HEADER_SIZE + where] ^= 0x10
    with pytest.raises(bsr.CorruptObjectError, match="payload checksum"):
        decode_object(bytes(damaged), KEY)


@pytest.mark.parametrize("cut", [0, 100, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5000])
def test_truncation_is_detected(cut: int) -> None:
    with pytest.raises(bsr.TruncatedObjectError):
        decode_object(BLOB[:cut], KEY)


def test_foreign_objects_are_detected() -> None:
    other_ns = bsr.ObjectKey(make_keys(2, model="another-model")[1], "kv")
    with pytest.raises(bsr.ForeignObjectError):
        decode_object(encode_object(other_ns, b"x" * 4096), KEY)
    other_group = bsr.ObjectKey(KEY.chunk, "aux")
    with pytest.raises(bsr.ForeignObjectError, match="group"):
        decode_object(encode_object(other_group, b"x" * 4096), KEY)
    other_chunk = bsr.ObjectKey(make_keys(2)[0], "kv")
    with pytest.raises(bsr.ForeignObjectError, match="chunk key"):
        decode_object(encode_object(other_chunk, b"x" * 4096), KEY)
    with pytest.raises(bsr.CorruptObjectError, match="magic"):
        decode_object(b"\x00" * 2 * HEADER_SIZE, KEY)
