"""agree_prefix (the coordinator's agreement): every rank ends on the same prefix, the longest
that every rank can use.

Independent model: the answer is ``max{n <= min(local) : n == 0 or every rank can use n}``, or
LATE on every rank when any rank proposes LATE. The ranks run in one event loop over an
InProcessGroup (real collectives, matched by call order).
"""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.engine._coordinator import LATE, agree_prefix

MAX = 8


def model(locals_: list[int], usable: list[frozenset[int]]) -> int:
    if LATE in locals_:
        return LATE
    upper = min(locals_)
    return max(n for n in range(upper + 1) if n == 0 or all(n in u for u in usable))


rank_st = st.tuples(st.integers(LATE, MAX), st.frozensets(st.integers(1, MAX)))


@pytest.mark.anyio
@settings(max_examples=150, deadline=None)
@given(st.lists(rank_st, min_size=1, max_size=4))
async def test_every_rank_agrees_on_the_longest_prefix_all_can_use(
    ranks: list[tuple[int, frozenset[int]]],
) -> None:
    group = bsr.InProcessGroup(len(ranks), timeout_s=30.0)
    asked: list[list[int]] = [[] for _ in ranks]
    got: dict[int, int] = {}

    async def rank(r: int) -> None:
        local, usable = ranks[r]
        coordinator = group.coordinator(r)

        def can_use(n: int) -> bool:
            asked[r].append(n)
            return n in usable

        got[r] = await agree_prefix(coordinator, local, can_use)

    async with anyio.create_task_group() as tg:
        for r in range(len(ranks)):
            tg.start_soon(rank, r)
    expected = model([loc for loc, _ in ranks], [u for _, u in ranks])
    assert got == dict.fromkeys(range(len(ranks)), expected)
    # a rank is only ever asked about a prefix no longer than what every rank proposed
    if expected != LATE:
        upper = min(loc for loc, _ in ranks)
        assert all(0 < n <= upper for a in asked for n in a)
