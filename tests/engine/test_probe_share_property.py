"""A restore given a deadline, whatever its tiers hold and whichever of them hang on lookups,
commits exactly what an independent model of ``probe_share`` says, and nothing partial.

The model: the tiers are asked at once; a tier that hangs is cut off at the probe's share of the
deadline and holds nothing, and every other tier counts (a hung tier holds up no other, the one
below it included). Each tier holds a prefix of the chunks (a save of that many chunks into
it); the reusable prefix is the longest any counted tier holds, and the restore (all or
nothing) commits exactly it, every byte the saved one. Real HostTier and FileTiers, a real cut
(``HangingContains``), no timing in the assertions but the probe's share.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bsr
from support.engines import HangingContains, make_engine
from support.helpers import filled_cache, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
CHUNKS = 5
DEADLINE_S = 2.0
SHARE = 0.1  # the probe waits 0.2 s for a hung tier


def model(held: list[int], hangs: list[bool]) -> int:
    """The chunks a restore commits: the longest prefix a tier that does not hang holds."""
    return max((n for n, hang in zip(held, hangs) if not hang), default=0)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    held=st.lists(st.integers(0, CHUNKS), min_size=3, max_size=3),
    hangs=st.tuples(st.booleans(), st.booleans()),
)
# the hit lies below a hung tier: a probe that asked the tiers one after another gave it up
@example(held=[0, 2, 5], hangs=(True, False))
@pytest.mark.anyio
async def test_a_restore_commits_what_the_tiers_that_answered_hold(
    tmp_path_factory: pytest.TempPathFactory, held: list[int], hangs: tuple[bool, bool]
) -> None:
    root = tmp_path_factory.mktemp("tiers")
    host = bsr.HostTier(1 << 24)
    mid = HangingContains(bsr.FileTier(root / "mid", 1 << 26, name="mid"))
    low = HangingContains(bsr.FileTier(root / "low", 1 << 26, name="low"))
    tiers: list[bsr.Tier] = [host, mid, low]
    toks = tokens_for(CHUNKS * 16)
    src = filled_cache(LAYOUT, 8, 16)
    eng = make_engine(
        LAYOUT, tiers, window=2, io_depth=1, model_id="share", probe_share=SHARE,
        breaker_threshold=None,
    )  # fmt: skip
    async with eng:
        for tier, n in zip(tiers, held):
            if n:
                saved = await eng.save(toks[: n * 16], src, list(range(n)), tiers=[tier.name])
                assert saved.ok
        mid.hang, low.hang = hangs
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        with anyio.fail_after(30):  # a hang guard; the bound under test is the deadline
            r = await eng.restore(toks, dst, list(range(CHUNKS)), deadline_s=DEADLINE_S)
    expect = model(held, [False, *hangs])
    assert r.state is bsr.RequestState.COMMITTED, r
    assert r.committed_tokens == expect * 16, (held, hangs, r)
    # the hung tiers, and only they, are named as not heard from
    silent = tuple(t.name for t, hang in zip(tiers, [False, *hangs]) if hang)
    assert r.unanswered == silent
    if silent:  # it waited for the hung tiers its share, no more
        assert r.timings.probe_s >= 0.9 * SHARE * DEADLINE_S
    # every committed byte is the saved one; nothing past the prefix was written
    got, want = dst.tensor("kv"), src.tensor("kv")
    assert torch.equal(got[:, :expect], want[:, :expect])
    assert not got[:, expect:CHUNKS].any()
