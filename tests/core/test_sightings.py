"""SightingCounter: never under the true count, exact without collisions, bounded, aging."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr


def digest(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200), st.sampled_from([4, 64, 1 << 12]))
def test_counts_never_fall_below_the_truth(seen: list[int], width: int) -> None:
    c = bsr.SightingCounter(width=width, depth=3, halve_after=10**9)
    truth: dict[int, int] = {}
    for i in seen:
        (after,) = c.add([digest(i)])
        truth[i] = truth.get(i, 0) + 1
        assert after >= truth[i]
    for i, n in truth.items():
        assert c.count(digest(i)) >= n
    if width >= 1 << 12:  # room enough that these few digests collide in no row
        assert all(c.count(digest(i)) == n for i, n in truth.items())
    assert c.statistics().memory_bytes == 3 * width * 4  # fixed, whatever was seen


def test_admitted_is_the_prefix_seen_often_enough() -> None:
    c = bsr.SightingCounter()
    a = [digest(i) for i in range(4)]  # a request of four chunks
    b = [*a[:2], digest(100), digest(101)]  # another sharing its first two
    assert c.admitted(a, 1) == 4  # threshold 1: everything, at once
    c = bsr.SightingCounter()
    assert c.admitted(a, 2) == 0  # seen once
    assert c.admitted(b, 2) == 2  # the shared part was seen twice
    assert c.admitted(a, 2) == 4
    assert c.admitted(a, 4) == 2  # its first two chunks now seen 4 times, the rest 3
    with pytest.raises(bsr.ConfigError):
        c.admitted(a, 0)


def test_counts_are_halved_as_they_age() -> None:
    c = bsr.SightingCounter(width=1 << 10, depth=2, halve_after=8)
    c.add([digest(1)] * 7)
    assert c.count(digest(1)) == 7
    c.add([digest(2)])  # the eighth sighting: everything halves
    assert c.count(digest(1)) == 3 and c.statistics().halvings == 1


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(bsr.ConfigError):
        bsr.SightingCounter(width=0)
    with pytest.raises(bsr.ConfigError):
        bsr.SightingCounter(depth=9)  # each row takes 8 bytes of one 64-byte digest
