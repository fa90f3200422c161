"""core._commit: the commit rule as pure functions (vote, trigger, reasons).

Every function is tested directly; a Hypothesis property then runs the whole rule over several
ranks (each rank's vote, the MIN agreement with re-proposals, each rank's trigger, the AND) next
to a small independent model, and checks that no committed prefix ever contains a (chunk, group)
that some rank did not install.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr import Policy, Reason
from bsr.core._commit import (
    choose_trigger,
    commit_reason,
    installed_usable,
    invalidation_reason,
    local_vote,
)

CT = 16
#: "kv" needs every chunk of a prefix; "swa" (window 24 tokens) only its last two chunks
LAYOUT = bsr.StateLayout(
    chunk_tokens=CT,
    groups=(
        bsr.StateGroup("kv", num_layers=2, token_bytes=64),
        bsr.StateGroup("swa", num_layers=1, token_bytes=64, window_tokens=24),
    ),
)
AON, TRUNC = Policy.ALL_OR_NOTHING, Policy.TRUNCATE


def everything(n: int) -> set[tuple[int, str]]:
    return {(c, g) for c in range(n) for g in ("kv", "swa")}


def vote(policy: Policy, installed: set[tuple[int, str]], *, target: int = 4, **kw: object) -> int:
    kw.setdefault("limit", target)
    kw.setdefault("timed_out", False)
    return local_vote(LAYOUT, policy, target=target, installed=installed, **kw)  # type: ignore[arg-type]


# --- installed_usable ------------------------------------------------------------------------


def test_installed_usable_needs_every_full_group_chunk() -> None:
    assert installed_usable(LAYOUT, 4, everything(4))
    assert not installed_usable(LAYOUT, 4, everything(4) - {(0, "kv")})
    assert installed_usable(LAYOUT, 0, set())


def test_installed_usable_needs_only_the_window_of_a_sliding_group() -> None:
    # swa chunks 0 and 1 are outside a 4-chunk prefix's window
    assert installed_usable(LAYOUT, 4, everything(4) - {(0, "swa"), (1, "swa")})
    assert not installed_usable(LAYOUT, 4, everything(4) - {(2, "swa")})


# --- local_vote ------------------------------------------------------------------------------


def test_all_or_nothing_votes_the_whole_target_or_nothing() -> None:
    assert vote(AON, everything(4)) == 4
    assert vote(AON, everything(4) - {(3, "kv")}) == 0
    assert vote(AON, everything(4) - {(2, "swa")}) == 0
    assert vote(AON, everything(4) - {(0, "swa")}) == 4  # outside the window: not needed


def test_all_or_nothing_ignores_limit() -> None:
    # limit only bounds what truncate may vouch for; all-or-nothing looks at the whole target
    assert vote(AON, everything(4), limit=2) == 4


def test_truncate_votes_the_longest_installed_prefix() -> None:
    assert vote(TRUNC, everything(4)) == 4
    assert vote(TRUNC, everything(4) - {(3, "kv")}) == 3
    assert vote(TRUNC, everything(4) - {(0, "kv")}) == 0
    # swa chunk 2 missing: prefixes 3 and 4 need it, prefix 2 (window chunks 0, 1) does not
    assert vote(TRUNC, everything(4) - {(2, "swa")}) == 2


def test_truncate_vote_stops_at_limit() -> None:
    # chunks at or past limit were abandoned after a failure below them
    assert vote(TRUNC, everything(4), limit=2) == 2
    assert vote(TRUNC, everything(4), limit=0) == 0
    assert vote(TRUNC, everything(6), target=3, limit=6) == 3  # never past the target


def test_timed_out_votes_zero_whatever_landed() -> None:
    for policy in Policy:
        assert vote(policy, everything(4), timed_out=True) == 0


def test_empty_target_votes_zero() -> None:
    for policy in Policy:
        assert vote(policy, everything(4), target=0) == 0


# --- choose_trigger --------------------------------------------------------------------------


def trigger(policy: Policy, agreed: int, installed: set[tuple[int, str]], target: int = 4):  # type: ignore[no-untyped-def]
    return choose_trigger(LAYOUT, policy, target=target, agreed=agreed, installed=installed)


def test_whole_target_agreed_and_installed_fires_chunks_installed() -> None:
    for policy in Policy:
        assert trigger(policy, 4, everything(4)) == "chunks_installed"


def test_agreed_whole_target_not_installed_here_fires_nothing() -> None:
    # another rank's vote cannot make this rank's missing object installed
    for policy in Policy:
        assert trigger(policy, 4, everything(4) - {(1, "kv")}) is None


def test_shorter_agreed_prefix_truncates_only_under_truncate() -> None:
    assert trigger(TRUNC, 2, everything(4)) == "truncate"
    assert trigger(TRUNC, 2, everything(2)) == "truncate"  # chunks past the prefix do not matter
    assert trigger(AON, 2, everything(4)) is None


def test_truncate_to_a_prefix_not_installed_here_fires_nothing() -> None:
    assert trigger(TRUNC, 2, everything(4) - {(1, "swa")}) is None
    # a window hole outside the agreed prefix's window is fine
    assert trigger(TRUNC, 3, everything(4) - {(0, "swa")}) == "truncate"


def test_nothing_agreed_or_nothing_probed_fires_nothing() -> None:
    for policy in Policy:
        assert trigger(policy, 0, everything(4)) is None
        assert trigger(policy, 0, set(), target=0) is None


# --- reasons ---------------------------------------------------------------------------------


def test_commit_reason() -> None:
    assert commit_reason(agreed=4, target=4) is Reason.COMPLETE
    assert commit_reason(agreed=2, target=4) is Reason.TRUNCATED


@pytest.mark.parametrize(
    ("timed_out", "failure", "installed_here", "expected"),
    [
        (True, Reason.CORRUPT, True, Reason.DEADLINE),  # the deadline wins over everything
        (True, None, False, Reason.DEADLINE),
        (False, Reason.CORRUPT, True, Reason.CORRUPT),  # then this rank's own first failure
        (False, Reason.INSTALL_FAILED, False, Reason.INSTALL_FAILED),
        (False, None, True, Reason.RANK_FAILED),  # installed here, so another rank failed
        (False, None, False, Reason.READ_FAILED),
    ],
)
def test_invalidation_reason(
    timed_out: bool, failure: Reason | None, installed_here: bool, expected: Reason
) -> None:
    got = invalidation_reason(timed_out=timed_out, failure=failure, installed_here=installed_here)
    assert got is expected


# --- property: the rule over several ranks never commits an uninstalled object ----------------


def model_needs(windows: list[int | None], prefix: int) -> set[tuple[int, str]]:
    """What a prefix needs, from the definition: a windowed group needs the chunks that overlap
    its last ``w`` tokens before the prefix end; a full group needs every chunk."""
    out = set()
    for i, w in enumerate(windows):
        first_token = 0 if w is None else max(0, prefix * CT - w)
        out |= {(c, f"g{i}") for c in range(prefix) if (c + 1) * CT > first_token}
    return out


def model_vote(
    windows: list[int | None], policy: Policy, target: int, limit: int, have: set, timed_out: bool
) -> int:
    if timed_out:
        return 0
    if policy is not TRUNC:  # all_or_nothing, and cost (which commits its choice that way)
        return target if target > 0 and model_needs(windows, target) <= have else 0
    ok = [p for p in range(min(limit, target) + 1) if model_needs(windows, p) <= have]
    return max(ok)


def model_agree(windows: list[int | None], votes: list[int], haves: list[set]) -> int:
    """The engine's agreement: MIN of the proposals; while some rank cannot use the agreed
    prefix, every rank re-proposes the longest prefix it can use below it."""
    proposals = list(votes)
    while True:
        agreed = min(proposals)
        if agreed == 0 or all(model_needs(windows, agreed) <= h for h in haves):
            return agreed
        proposals = [max(p for p in range(agreed) if model_needs(windows, p) <= h) for h in haves]


@st.composite
def runs(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 4 * CT)), min_size=1, max_size=3))
    target = draw(st.integers(0, 6))
    policy = draw(st.sampled_from(list(Policy)))
    pairs = sorted(model_needs(windows, target))
    ranks = []
    for _ in range(draw(st.integers(1, 3))):
        # mostly-complete installed sets, so that commits are common and holes are sharp
        missing = draw(st.lists(st.sampled_from(pairs), max_size=3)) if pairs else []
        limit = draw(st.integers(0, target))
        ranks.append((set(pairs) - set(missing), limit, draw(st.booleans())))
    return windows, target, policy, ranks


@settings(max_examples=500, deadline=None)
@given(runs())
def test_vote_and_trigger_never_commit_an_uninstalled_object(case) -> None:  # type: ignore[no-untyped-def]
    windows, target, policy, ranks = case
    layout = bsr.StateLayout(
        chunk_tokens=CT,
        groups=tuple(
            bsr.StateGroup(f"g{i}", num_layers=1, token_bytes=64, window_tokens=w)
            for i, w in enumerate(windows)
        ),
    )
    haves = [have for have, _, _ in ranks]
    votes = []
    for have, limit, timed_out in ranks:
        v = local_vote(
            layout, policy, target=target, limit=limit, installed=have, timed_out=timed_out
        )
        assert v == model_vote(windows, policy, target, limit, have, timed_out)
        assert 0 <= v <= target
        assert model_needs(windows, v) <= have  # a rank never vouches for what it lacks
        votes.append(v)
    agreed = model_agree(windows, votes, haves)
    triggers = [
        choose_trigger(layout, policy, target=target, agreed=agreed, installed=h) for h in haves
    ]
    committed = all(t is not None for t in triggers)  # the AND across ranks
    if committed:
        assert agreed > 0
        for have in haves:
            assert model_needs(windows, agreed) <= have, "committed an uninstalled object"
        assert policy is TRUNC or agreed == target  # all-or-nothing: the whole prefix or none
    # choose_trigger is a check of its own: whatever prefix the agreement produced (even one a
    # buggy or hostile coordinator made up), it fires only for a prefix installed on this rank
    for have in haves:
        for p in range(target + 1):
            t = choose_trigger(layout, policy, target=target, agreed=p, installed=have)
            usable_here = p > 0 and model_needs(windows, p) <= have
            if p == target:
                assert t == ("chunks_installed" if usable_here else None)
            else:
                assert t == ("truncate" if usable_here and policy is TRUNC else None)
