"""The self-verifying object format: every header field and the payload are checked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ---------------------------------------------------------------------- a read's one-call check
def _one_object_checks(
    header: bytes, n: int, stored: int, okey: bsr.ObjectKey, payload: bytes
) -> int:
    """What a tier's read check decides, step by step (the reference for ``read_payload_len``):
    the payload length, or -1 where one of the one-object checks raises."""
    from bsr.tiers._codec import ObjectCodec

    try:
        if n < HEADER_SIZE:
            return -1
        head = ObjectCodec.decode_header(header, okey)
        ObjectCodec.check_stored_size(head, stored, okey)
        plen = head.payload_len
        if plen > len(payload) or n < HEADER_SIZE + plen:
            return -1
        ObjectCodec.verify_payload(payload[:plen], head, okey)
    except bsr.ObjectError:
        return -1
    return plen


#: (what is done to the object or the read, how far) as the property test draws it
_READ_DAMAGE = ("none", "flip", "short_read", "stored", "room", "other_key", "other_group")


@settings(max_examples=300, deadline=None)
@given(
    plen=st.sampled_from([1, 100, 4096, 3 * 4096 + 100, 5 * 4096]),
    damage=st.sampled_from(_READ_DAMAGE),
    at=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=7),
)
def test_a_reads_one_call_check_agrees_with_the_one_object_checks(
    plen: int, damage: str, at: int, bit: int
) -> None:
    """``ObjectCodec.read_payload_len`` (the check a FileTier read runs) says intact exactly
    where every one-object check passes, and then gives the payload length: over every header
    field, payload bytes, short reads, stored lengths, destinations too small and objects of
    another key or group."""
    from bsr.tiers._codec import ObjectCodec

    okey = KEY
    blob = bytearray(encode_object(okey, payload(plen, plen)))
    n = len(blob)
    stored = len(blob)
    room = len(blob) - HEADER_SIZE
    if damage == "flip":
        blob[at % len(blob)] ^= 1 << bit
    elif damage == "short_read":
        n = at % len(blob)
    elif damage == "stored":
        stored = HEADER_SIZE + plen + (at % 8192) - 4096
    elif damage == "room":
        room = at % (len(blob) - HEADER_SIZE + 1)
    elif damage == "other_key":
        okey = bsr.ObjectKey(make_keys(3)[2], "kv")
    elif damage == "other_group":
        okey = bsr.ObjectKey(KEY.chunk, "aux")
    header, body = bytes(blob[:HEADER_SIZE]), bytes(blob[HEADER_SIZE : HEADER_SIZE + room])
    want = _one_object_checks(header, n, stored, okey, body)
    got = ObjectCodec.read_payload_len(header, n, stored, okey.chunk, okey.group, body)
    assert got == want
    if damage == "none":
        assert got == plen
