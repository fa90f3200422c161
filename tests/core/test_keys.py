"""Chunk keys: deterministic, chained, namespace-separated; token normalisation."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.core._keys import OFFLOAD_TOKENS, as_token_array, chunk_keys, prepare_tokens, token_count

LAYOUT = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64),))
TOKENS = list(range(10, 30))


def fp(**kw: object) -> bytes:
    return bsr.Namespace(**{"model_id": "m", **kw}).fingerprint(LAYOUT)  # type: ignore[arg-type]


def digests(ns: bytes, tokens: object = TOKENS, layout: bsr.StateLayout = LAYOUT) -> list[bytes]:
    return [k.digest for k in chunk_keys(ns, tokens, layout.chunk_tokens)]  # type: ignore[arg-type]


def test_only_full_chunks_get_keys() -> None:
    assert len(digests(fp())) == 5
    assert len(digests(fp(), TOKENS[:7])) == 1
    assert digests(fp(), TOKENS[:3]) == []


def test_keys_are_chained_over_the_whole_prefix() -> None:
    a = digests(fp())
    changed = list(TOKENS)
    changed[1] += 1  # a token in chunk 0 changes every later key
    b = digests(fp(), changed)
    assert all(x != y for x, y in zip(a, b))
    changed2 = list(TOKENS)
    changed2[9] += 1  # chunk 2: keys 0 and 1 stay
    c = digests(fp(), changed2)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:]))


def test_same_chunk_at_another_position_has_another_key() -> None:
    toks = [7, 7, 7, 7] * 3
    d = digests(fp(), toks)
    assert len(set(d)) == 3


@pytest.mark.parametrize(
    "change",
    [
        {"salt": b"tenant-b"},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"model_id": "other"},
        {"config_digest": "0" * 32},
    ],
)
def test_namespace_changes_give_disjoint_keys(change: dict[str, object]) -> None:
    assert not set(digests(fp())) & set(digests(fp(**change)))


def test_layout_change_gives_disjoint_keys() -> None:
    other = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64, dtype="float16"),))
    ns_other = bsr.Namespace("m").fingerprint(other)
    assert not set(digests(fp())) & set(digests(ns_other, layout=other))
    window = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64, window_tokens=8),))
    assert LAYOUT.fingerprint != window.fingerprint


def test_token_types_agree() -> None:
    ref = digests(fp())
    assert digests(fp(), np.asarray(TOKENS, dtype=np.int32)) == ref
    assert digests(fp(), np.asarray(TOKENS, dtype=np.uint16)) == ref
    assert digests(fp(), torch.tensor(TOKENS)) == ref
    assert digests(fp(), torch.tensor([TOKENS], dtype=torch.int32)) == ref
    assert digests(fp(), tuple(TOKENS)) == ref


_SCRIPT = """
import bsr
from bsr.core._keys import chunk_keys
layout = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64),))
ns = bsr.Namespace("m", salt=b"s").fingerprint(layout)
print(",".join(k.hex for k in chunk_keys(ns, list(range(10, 30)), 4)))
"""


def test_keys_are_deterministic_across_processes() -> None:
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    here = ",".join(
        k.hex for k in chunk_keys(bsr.Namespace("m", salt=b"s").fingerprint(LAYOUT), TOKENS, 4)
    )
    assert outs == {here}


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (torch.tensor([1.0, 2.0]), "integer tensor"),
        (np.array([1.5, 2.5]), "integer array"),
        ("hello", "tokenize"),
        ([1, 2, -3], ">= 0"),
        ([1, 2.0], "must be ints"),
        ([True, False], "must be ints"),
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (42, "sequence of ints"),
    ],
)
def test_bad_tokens_raise_typed_errors(bad: object, fragment: str) -> None:
    with pytest.raises(bsr.TokenError, match=fragment):
        chunk_keys(fp(), bad, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"model_id": ""}, "model_id"),
        ({"model_id": "m", "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"model_id": "m", "tp_size": 0}, "tp_size"),
        ({"model_id": "m", "salt": "str"}, "bytes"),
        ({"model_id": "m", "config_digest": 5}, "config_digest must be a str"),
        ({"model_id": "m", "config_digest": "\ud800"}, "config_digest"),
    ],
)
def test_bad_namespace(kw: dict[str, object], fragment: str) -> None:
    with pytest.raises(bsr.ConfigError, match=fragment):
        bsr.Namespace(**kw)  # type: ignore[arg-type]


def test_config_digests_give_disjoint_namespaces() -> None:
    """Two config digests never share a key; no digest is the fingerprint of before (stores
    written without one are still found)."""
    assert fp(config_digest="a" * 32) != fp(config_digest="b" * 32)
    assert fp(config_digest="") == fp()
    assert not set(digests(fp(config_digest="a" * 32))) & set(digests(fp(config_digest="b" * 32)))


# ---------------------------------------------------------------------- array-speed keys
# An independent reference of the key chain (the definition in the module docstring), written
# the slow obvious way: one hashlib object over the whole prefix, token by token packed with
# struct, its digest taken after each chunk.


def reference_keys(ns: bytes, tokens: list[int], chunk_tokens: int) -> list[bytes]:
    import hashlib
    import struct

    out: list[bytes] = []
    h = hashlib.sha256(b"bsr-chunk-v4" + ns + struct.pack("<I", chunk_tokens))
    for i in range(len(tokens) // chunk_tokens):
        chunk = tokens[i * chunk_tokens : (i + 1) * chunk_tokens]
        fmt = "<I" if all(t < 2**32 for t in chunk) else "<Q"
        h.update(bytes([struct.calcsize(fmt)]))
        for t in chunk:
            h.update(struct.pack(fmt, t))
        out.append(h.copy().digest())
    return out


token_lists = st.lists(
    st.one_of(
        st.integers(0, 2**32 - 1), st.integers(2**32 - 2, 2**32 + 2), st.integers(0, 2**63 - 1)
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    tokens=token_lists,
    chunk=st.integers(1, 9),
    ns=st.binary(min_size=16, max_size=16),
    form=st.sampled_from(["list", "tuple", "numpy", "torch", "numpy-2d", "strided", "generator"]),
)
def test_keys_match_the_reference_chain_for_every_input_form(
    tokens: list[int], chunk: int, ns: bytes, form: str
) -> None:
    given_tokens: object = {
        "list": lambda: tokens,
        "tuple": lambda: tuple(tokens),
        "numpy": lambda: np.asarray(tokens, dtype=np.int64),
        "torch": lambda: torch.tensor(tokens, dtype=torch.int64),
        "numpy-2d": lambda: np.asarray([tokens], dtype=np.uint64),
        "strided": lambda: np.repeat(np.asarray(tokens, dtype=np.int64), 2)[::2],
        "generator": lambda: (t for t in tokens),
    }[form]()
    keys = chunk_keys(ns, given_tokens, chunk)  # type: ignore[arg-type]
    assert [k.digest for k in keys] == reference_keys(ns, tokens, chunk)
    assert [k.index for k in keys] == list(range(len(tokens) // chunk))
    assert all(k.namespace == ns for k in keys)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, cap=st.integers(-2, 12))
def test_max_chunks_is_a_prefix_of_the_chain(tokens: list[int], cap: int) -> None:
    full = chunk_keys(b"n" * 16, tokens, 3)
    assert chunk_keys(b"n" * 16, tokens, 3, max_chunks=cap) == full[: max(0, cap)]


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, ns=st.binary(min_size=16, max_size=16), n=st.integers(0, 90))
def test_prepare_tokens_converts_once_and_carries_the_keys(
    tokens: list[int], ns: bytes, n: int
) -> None:
    kt = prepare_tokens(ns, tokens, 4)
    assert kt.tokens.dtype == np.dtype("<i8") and kt.tokens.tolist() == tokens
    assert [k.digest for k in kt.keys] == reference_keys(ns, tokens, 4)
    assert kt.keys_for(n) == tuple(chunk_keys(ns, tokens[:n], 4))
    assert as_token_array(kt.tokens) is kt.tokens  # converting again is a no-op


def test_token_count_needs_no_conversion() -> None:
    assert token_count(list(range(70))) == 70
    assert token_count(np.zeros((1, 33), dtype=np.int32)) == 33
    assert token_count(torch.zeros(1, 12, dtype=torch.long)) == 12
    assert token_count(42) == 0  # type: ignore[arg-type]
    assert OFFLOAD_TOKENS > 0


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ([5, 7, True, 9], "found bool True"),  # a bool among ints, at a 0/1 position
        ([5, 7, False], "found bool False"),
        ([5, np.float64(1.0)], "found float64"),
        ([5, np.bool_(True)], "found bool"),
        ([5, "6"], "found str"),
        ([5, None], "found NoneType"),
        ([2**63], "does not fit in int64"),
        (np.array([2**63], dtype=np.uint64), "does not fit in int64"),
        ([3, -1], ">= 0"),
    ],
)
def test_fast_path_refuses_what_the_slow_walk_refused(bad: object, fragment: str) -> None:
    with pytest.raises(bsr.TokenError, match=fragment):
        as_token_array(bad)  # type: ignore[arg-type]


def test_zero_and_one_tokens_are_not_mistaken_for_bools() -> None:
    toks = [0, 1, 1, 0, 5, 1, 0, 2]
    assert as_token_array(toks).tolist() == toks
    assert [k.digest for k in chunk_keys(b"z" * 16, toks, 4)] == reference_keys(b"z" * 16, toks, 4)


def test_object_ids_are_unchanged() -> None:
    key = chunk_keys(fp(), TOKENS, 4)[2]
    # object_id / group_digest are cached now; the values are the definition's
    import hashlib

    oid = hashlib.blake2b(key.digest, digest_size=20, person=b"bsr-object")
    oid.update(b"kv")
    okey = bsr.ObjectKey(key, "kv")
    assert okey.object_id == oid.hexdigest() == bsr.ObjectKey(key, "kv").object_id
    assert okey.group_digest == hashlib.blake2b(b"kv", digest_size=16, person=b"bsr-group").digest()


# ---------------------------------------------------------------------- names that are not text
SURROGATE = "model-\udcff"


def test_lone_surrogate_in_model_id_is_a_config_error() -> None:
    with pytest.raises(bsr.ConfigError, match=r"Namespace.model_id .*cannot be encoded as UTF-8"):
        bsr.Namespace(SURROGATE)


def test_lone_surrogate_in_a_string_salt_is_a_config_error() -> None:
    with pytest.raises(bsr.ConfigError, match=r"Namespace.salt .*lone surrogate"):
        bsr.Namespace("m", salt="tenant-\ud800")  # type: ignore[arg-type]


def test_lone_surrogate_in_an_object_key_group_is_a_layout_error() -> None:
    key = chunk_keys(fp(), TOKENS, 4)[0]
    with pytest.raises(bsr.LayoutError, match="state group name"):
        _ = bsr.ObjectKey(key, "kv\udc80").object_id


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tenant": "acme-\udcff"}, "tenant 'acme-"),
        ({"model_id": "m-\ud800"}, "model_id 'm-"),
    ],
)
def test_lone_surrogate_in_an_engine_config_is_a_config_error(
    fields: dict[str, str], fragment: str
) -> None:
    data = {"model_id": "m", "tiers": [{"kind": "host", "capacity_bytes": 1 << 20}], **fields}
    with pytest.raises(bsr.ConfigError, match=f"{fragment}.*cannot be encoded as UTF-8"):
        bsr.EngineConfig.from_dict(data).namespace()


def test_a_wide_token_changes_only_its_own_chunk_and_later_keys() -> None:
    """A token >= 2**32 makes its chunk hash 8-byte tokens; the chunks before it keep the keys
    of the same prefix alone (the prefix property), and the 4- and 8-byte encodings of equal
    values never meet."""
    ns = b"w" * 16
    narrow = list(range(12))
    wide = [*narrow[:8], 2**32 + 5, *narrow[9:]]
    a, b = chunk_keys(ns, narrow, 4), chunk_keys(ns, wide, 4)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert chunk_keys(ns, wide[:8], 4) == b[:2]
    # the value 5 as a 4-byte token and 2**32 + 5 (8 bytes) differ in the chunk's key
    assert chunk_keys(ns, [5, 0, 0, 0], 4) != chunk_keys(ns, [2**32 + 5, 0, 0, 0], 4)


def _chunk_encoding(chunk: list[int]) -> bytes:
    """A chunk's width byte and tokens, as the module docstring defines them (struct, token by
    token)."""
    import struct

    fmt = "<I" if all(t < 2**32 for t in chunk) else "<Q"
    return bytes([struct.calcsize(fmt)]) + b"".join(struct.pack(fmt, t) for t in chunk)


def _format3_keys(ns: bytes, tokens: list[int], chunk_tokens: int) -> list[bytes]:
    """Format 3's chain (no extras), from its definition: separate hashes, each over the
    previous key, the width byte and the chunk's tokens."""
    import hashlib
    import struct

    out: list[bytes] = []
    prev = hashlib.sha256(b"bsr-chunk-v2" + ns + struct.pack("<I", chunk_tokens)).digest()
    for i in range(len(tokens) // chunk_tokens):
        chunk = tokens[i * chunk_tokens : (i + 1) * chunk_tokens]
        prev = hashlib.sha256(prev + _chunk_encoding(chunk)).digest()
        out.append(prev)
    return out


def test_key_chain_is_version_4_and_differs_from_the_earlier_chains() -> None:
    """The first chain (BLAKE2b over int64 tokens, format version 1), and the SHA-256 chain of
    formats 2 and 3 (a hash per chunk over the previous key) give other keys for the same
    tokens, whether under this namespace or under the namespace those formats made (their
    version hashed in): old stores miss, never misread."""
    import hashlib

    from bsr.core._keys import FORMAT_VERSION

    assert FORMAT_VERSION == 4
    ns = fp()
    prev, old = ns, []
    for i in range(len(TOKENS) // 4):
        h = hashlib.blake2b(prev, digest_size=32, person=b"bsr-chunk")
        h.update(np.asarray(TOKENS[i * 4 : (i + 1) * 4], dtype="<i8").tobytes())
        prev = h.digest()
        old.append(prev)
    new = digests(ns)
    assert new == reference_keys(ns, TOKENS, 4)
    assert len(new) == len(old) and not set(new) & set(old)
    # format 3's chain over the same namespace fingerprint
    assert len(_format3_keys(ns, TOKENS, 4)) == 5
    assert not set(new) & set(_format3_keys(ns, TOKENS, 4))
    # the namespace fingerprint as formats 2 and 3 made it (the same fields, their version)
    h = hashlib.blake2b(digest_size=16, person=b"bsr-namespace")
    h.update(len(b"m").to_bytes(4, "little") + b"m")
    h.update((0).to_bytes(4, "little") + (1).to_bytes(4, "little"))
    h.update((0).to_bytes(4, "little"))
    h.update(LAYOUT.fingerprint)
    v4 = h.copy()
    v4.update((4).to_bytes(4, "little"))
    assert v4.digest() == ns  # the references below are this namespace's, but for the version
    for version in (2, 3):
        v = h.copy()
        v.update(version.to_bytes(4, "little"))
        assert v.digest() != ns
        assert not set(new) & set(_format3_keys(v.digest(), TOKENS, 4))  # what that store holds
        assert not set(new) & set(digests(v.digest()))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**33), min_size=2, max_size=40),
    chunk=st.integers(1, 8),
    ns=st.binary(min_size=16, max_size=16),
)
def test_a_key_alone_does_not_give_the_keys_of_continuations(
    tokens: list[int], chunk: int, ns: bytes
) -> None:
    """Format 3 let anyone who knew key ``i`` compute key ``i+1`` of any continuation without
    the prefix's tokens (SHA-256 over the key, the width byte and the next chunk). A key of the
    streaming chain is the digest of the whole prefix: hashing on from it gives no key."""
    import hashlib

    keys = digests(ns, tokens, bsr.StateLayout(chunk, LAYOUT.groups))
    assert keys == reference_keys(ns, tokens, chunk)
    for i in range(len(keys) - 1):
        enc = _chunk_encoding(tokens[(i + 1) * chunk : (i + 2) * chunk])
        assert hashlib.sha256(keys[i] + enc).digest() != keys[i + 1]  # format 3's step
        assert hashlib.sha256(keys[i] + enc).digest() not in keys
    # and format 3's step does give format 3's next key (the test above can fail)
    old = _format3_keys(ns, tokens, chunk)
    for i in range(len(old) - 1):
        enc = _chunk_encoding(tokens[(i + 1) * chunk : (i + 2) * chunk])
        assert hashlib.sha256(old[i] + enc).digest() == old[i + 1]


def test_the_narrow_chain_does_not_trust_a_bound_beyond_its_chunks() -> None:
    """The largest token of the whole array decides the 4-byte fast path only when it is below
    2**32; a wide token past the last full chunk leaves every chunk 4-byte, one inside makes its
    chunk 8-byte. The chain's own pass agrees with the bound handed in."""
    from bsr.core._keys import chunk_digests

    ns = b"b" * 16
    tail = [*range(12), 2**40]  # the wide token is in no full chunk
    assert digests(ns, tail) == reference_keys(ns, tail, 4) == digests(ns, tail[:12])
    inside = [*range(5), 2**40, *range(6, 13)]
    assert digests(ns, inside) == reference_keys(ns, inside, 4)
    for toks in (tail, inside, list(range(12))):
        arr = as_token_array(toks)
        assert chunk_digests(ns, arr, 4, 3) == reference_keys(ns, toks, 4)
        assert chunk_digests(ns, arr, 4, 3, bound=int(arr.max())) == reference_keys(ns, toks, 4)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([3, -1, 2], dtype=np.int64),
        np.array([3, -7, 2], dtype=np.int32),
        np.array([-(2**63), 5], dtype=np.int64),
        torch.tensor([4, 5, -2]),
    ],
)
def test_a_negative_token_in_an_array_names_the_smallest(bad: object) -> None:
    smallest = int(np.asarray(bad).min())
    with pytest.raises(bsr.TokenError, match=f"must be >= 0, found {smallest};"):
        as_token_array(bad)  # type: ignore[arg-type]
    with pytest.raises(bsr.TokenError, match=f"found {smallest};"):
        prepare_tokens(b"n" * 16, bad, 1)  # type: ignore[arg-type]


def test_chunk_size_is_bound_into_the_chain() -> None:
    ns = b"c" * 16
    assert (
        chunk_keys(ns, list(range(8)), 8)[0].digest != chunk_keys(ns, list(range(8)), 4)[1].digest
    )


# ---------------------------------------------------------------------- extra keys
# The reference for extras: the module docstring's definition written the slow way, position
# by position (which extras cover which token of the chunk), then packed with struct.


def reference_keys_with_extras(
    ns: bytes, tokens: list[int], chunk_tokens: int, extras: list[bsr.KeyExtra]
) -> list[bytes]:
    import hashlib
    import struct

    out: list[bytes] = []
    h = hashlib.sha256(b"bsr-chunk-v4" + ns + struct.pack("<I", chunk_tokens))
    for i in range(len(tokens) // chunk_tokens):
        lo, hi = i * chunk_tokens, (i + 1) * chunk_tokens
        chunk = tokens[lo:hi]
        fmt = "<I" if all(t < 2**32 for t in chunk) else "<Q"
        h.update(bytes([struct.calcsize(fmt)]))
        for t in chunk:
            h.update(struct.pack(fmt, t))
        items = []
        for e in extras:
            covered = [p for p in range(lo, hi) if e.start <= p and (e.end is None or p < e.end)]
            if covered:
                items.append((covered[0] - lo, covered[-1] + 1 - lo, e.key))
        if items:
            h.update(b"x" + struct.pack("<I", len(items)))
            for s, t, key in sorted(items):
                h.update(struct.pack("<III", s, t, len(key)) + key)
        out.append(h.copy().digest())
    return out


extra_lists = st.lists(
    st.builds(
        lambda key, start, length: bsr.KeyExtra(
            key, start, None if length == 0 else start + length
        ),
        st.binary(min_size=1, max_size=6),
        st.integers(0, 40),
        st.integers(0, 12),
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**33), max_size=40),
    chunk=st.integers(1, 9),
    extras=extra_lists,
    ns=st.binary(min_size=16, max_size=16),
)
def test_keys_with_extras_match_the_reference(
    tokens: list[int], chunk: int, extras: list[bsr.KeyExtra], ns: bytes
) -> None:
    keys = chunk_keys(ns, tokens, chunk, extras=extras)
    assert [k.digest for k in keys] == reference_keys_with_extras(ns, tokens, chunk, extras)
    # the order they are given in does not matter
    assert chunk_keys(ns, tokens, chunk, extras=list(reversed(extras))) == keys
    kt = prepare_tokens(ns, tokens, chunk, extras=extras)
    assert kt.keys == tuple(keys) and set(kt.extras) == set(extras)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=8, max_size=40),
    extras=extra_lists,
    key=st.binary(min_size=1, max_size=4),
    start=st.integers(0, 39),
    length=st.integers(1, 10),
)
def test_an_extra_changes_exactly_the_keys_from_its_first_chunk_on(
    tokens: list[int], extras: list[bsr.KeyExtra], key: bytes, start: int, length: int
) -> None:
    """Binding one more value to [start, start+length) leaves every chunk before the range's
    first chunk as it was (a prefix is still shared) and changes every key from there on (the
    chain): what changes a chunk's state can never be served from a store of the other."""
    ns, chunk = b"e" * 16, 4
    added = bsr.KeyExtra(b"\xff" + key, start, start + length)  # never equal to one in extras
    before = chunk_keys(ns, tokens, chunk, extras=extras)
    after = chunk_keys(ns, tokens, chunk, extras=[*extras, added])
    first = start // chunk
    assert before[:first] == after[:first]
    assert all(b != a for b, a in zip(before[first:], after[first:]))


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), max_size=40), more=st.lists(st.integers(0, 50)))
def test_a_whole_request_extra_keeps_the_prefix_property(
    tokens: list[int], more: list[int]
) -> None:
    """An adapter (an extra over the whole request, ``end=None``) gives a prompt and its longer
    continuation (the next turn) the same keys for the shared chunks, and none shared with the
    same tokens under another adapter or none."""
    ns, chunk = b"p" * 16, 4
    a, b = bsr.KeyExtra(b"lora:a"), bsr.KeyExtra(b"lora:b")
    short = chunk_keys(ns, tokens, chunk, extras=[a])
    long = chunk_keys(ns, tokens + more, chunk, extras=[a])
    assert long[: len(short)] == short
    other = chunk_keys(ns, tokens, chunk, extras=[b])
    plain = chunk_keys(ns, tokens, chunk)
    assert not {k.digest for k in short} & ({k.digest for k in other} | {k.digest for k in plain})


def test_a_salt_on_the_first_token_separates_every_chunk() -> None:
    ns = b"s" * 16
    alice = chunk_keys(ns, TOKENS, 4, extras=[bsr.KeyExtra(b"salt:alice", 0, 1)])
    bob = chunk_keys(ns, TOKENS, 4, extras=[bsr.KeyExtra(b"salt:bob", 0, 1)])
    plain = chunk_keys(ns, TOKENS, 4)
    assert len(alice) == 5 and not {k.digest for k in alice} & {k.digest for k in bob}
    assert not {k.digest for k in alice} & {k.digest for k in plain}
    assert chunk_keys(ns, TOKENS, 4, extras=[bsr.KeyExtra(b"salt:alice", 0, 1)]) == alice


def test_the_same_image_at_another_offset_in_its_chunk_has_another_key() -> None:
    ns = b"i" * 16
    at1 = chunk_keys(ns, TOKENS, 8, extras=[bsr.KeyExtra(b"img:x", 1, 5)])
    at2 = chunk_keys(ns, TOKENS, 8, extras=[bsr.KeyExtra(b"img:x", 2, 6)])
    assert at1[0] != at2[0]


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: bsr.KeyExtra("salt"), "encode it first"),  # type: ignore[arg-type]
        (lambda: bsr.KeyExtra(b""), "non-empty bytes"),
        (lambda: bsr.KeyExtra(7), "non-empty bytes"),  # type: ignore[arg-type]
        (lambda: bsr.KeyExtra(b"k", -1), r"start must be an int in \[0"),
        (lambda: bsr.KeyExtra(b"k", 1.5), r"start must be an int"),  # type: ignore[arg-type]
        (lambda: bsr.KeyExtra(b"k", 4, 4), "end must be None"),
        (lambda: bsr.KeyExtra(b"k", 4, 2), "end must be None"),
        (lambda: bsr.KeyExtra(b"k", True), "start must be an int"),
        (lambda: bsr.KeyExtra(b"k" * 5000), "at most 4096"),
        (lambda: chunk_keys(b"n" * 16, TOKENS, 4, extras=[b"salt"]), "bsr.KeyExtra objects"),  # type: ignore[list-item]
    ],
)
def test_bad_extras_raise_typed_errors(make: object, fragment: str) -> None:
    with pytest.raises(bsr.TokenError, match=fragment):
        make()  # type: ignore[operator]


# ---------------------------------------------------------------------- hostile tensor kinds
# Found as a hostile user: meta, sparse and quantized tensors escaped chunk_keys / lookup /
# save as NotImplementedError, RuntimeError or TypeError, and an np.matrix of shape [1, n] was
# keyed as 0 chunks (its reshape(-1) is still [1, n]). Each is now a TokenError saying what to
# pass instead, from every entry that converts tokens.


def _fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.arange(16)


_ROW = torch.arange(16)
HOSTILE_TOKENS = {
    "meta": lambda: torch.arange(16, device="meta"),
    "meta-2d": lambda: torch.zeros(1, 16, dtype=torch.long, device="meta"),
    "sparse-coo": lambda: _ROW.to_sparse(),
    "sparse-csr": lambda: _ROW.reshape(1, 16).to_sparse_csr(),
    "sparse-csc": lambda: _ROW.reshape(1, 16).to_sparse_csc(),
    "sparse-bsr": lambda: _ROW.reshape(1, 16).to_sparse_bsr((1, 4)),
    "sparse-bsc": lambda: _ROW.reshape(1, 16).to_sparse_bsc((1, 4)),
    "quantized-qint8": lambda: torch.quantize_per_tensor(_ROW.float(), 1.0, 0, torch.qint8),
    "quantized-quint8": lambda: torch.quantize_per_tensor(_ROW.float(), 1.0, 0, torch.quint8),
    "quantized-qint32": lambda: torch.quantize_per_tensor(_ROW.float(), 1.0, 0, torch.qint32),
    "quantized-per-channel": lambda: torch.quantize_per_channel(
        _ROW.float().reshape(1, 16), torch.tensor([1.0]), torch.tensor([0]), 0, torch.quint8
    ),
    "nested": lambda: torch.nested.nested_tensor([_ROW, _ROW]),
    "nested-jagged": lambda: torch.nested.nested_tensor([_ROW, _ROW[:8]], layout=torch.jagged),
    "bits8": lambda: torch.zeros(16, dtype=torch.bits8),
    "fake": _fake_tensor,
    "np-matrix-row": lambda: np.matrix(np.arange(16)),
    "np-matrix-column": lambda: np.matrix(np.arange(16)).T,
    "np-masked": lambda: np.ma.masked_array(np.arange(16), mask=[0, 1] * 8),
    "np-masked-nothing": lambda: np.ma.masked_array(np.arange(16)),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR beta, quantization
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
@pytest.mark.parametrize("kind", sorted(HOSTILE_TOKENS))
def test_hostile_tensor_kinds_are_token_errors(kind: str) -> None:
    tokens = HOSTILE_TOKENS[kind]()
    for convert in (
        lambda: chunk_keys(fp(), tokens, 4),
        lambda: prepare_tokens(fp(), tokens, 4),
        lambda: as_token_array(tokens),
    ):
        with pytest.raises(bsr.TokenError) as info:
            convert()
        assert "pass" in str(info.value)  # it says what to pass instead


_NP_INT_DTYPES = [
    np.dtype(f"{order}{kind}{size}") for kind in "iu" for size in (1, 2, 4, 8) for order in "<>"
]
_TORCH_INT_DTYPES = [
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
]  # fmt: skip


def _fits(dtype: object) -> int:
    """The largest token a dtype holds (and bsr accepts: at most int64's largest)."""
    if isinstance(dtype, np.dtype):
        return int(min(np.iinfo(dtype).max, 2**63 - 1))
    return int(min(torch.iinfo(dtype).max, 2**63 - 1))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    chunk=st.integers(1, 6),
    dtype=st.sampled_from(_NP_INT_DTYPES + _TORCH_INT_DTYPES),
    shape=st.sampled_from(["1-D", "[1, n]", "strided", "memmap"]),
)
def test_every_integer_dtype_keys_as_the_reference_chain(
    data: st.DataObject,
    chunk: int,
    dtype: object,
    shape: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The refusals changed nothing for ordinary tokens: 1-D or [1, n] arrays and tensors of
    every integer dtype (NumPy's in both byte orders), strided views and memory maps key as
    the independent reference chain of the same ints."""
    tokens = data.draw(st.lists(st.integers(0, _fits(dtype)), max_size=40))
    if isinstance(dtype, np.dtype):
        arr = np.asarray(tokens, dtype=dtype)
        if shape == "memmap":
            path = tmp_path_factory.mktemp("mm") / "t.bin"
            mm = np.memmap(path, dtype=dtype, mode="w+", shape=(max(1, len(tokens)),))
            mm[: len(tokens)] = arr
            given_tokens: object = mm[: len(tokens)]
        elif shape == "strided":
            given_tokens = np.repeat(arr, 2)[::2]
        else:
            given_tokens = arr.reshape(1, -1) if shape == "[1, n]" else arr
    else:
        t = torch.tensor(tokens, dtype=torch.int64).to(dtype)  # type: ignore[call-overload]
        if shape == "strided":
            given_tokens = t.repeat_interleave(2)[::2]
        else:
            given_tokens = t.reshape(1, -1) if shape == "[1, n]" else t
    ns = b"k" * 16
    assert [k.digest for k in chunk_keys(ns, given_tokens, chunk)] == reference_keys(  # type: ignore[arg-type]
        ns, tokens, chunk
    )
    assert prepare_tokens(ns, given_tokens, chunk).tokens.tolist() == tokens  # type: ignore[arg-type]
