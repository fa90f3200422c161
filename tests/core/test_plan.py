"""core._plan: which (chunk, group) objects a prefix needs, and the longest usable prefix.

Each function is tested directly on hand-checked cases, then against a brute-force model that
derives the needed chunks from the definition of a sliding window (a chunk is needed when it
overlaps the last ``window_tokens`` tokens before the prefix end), not from the layout's formula.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.core._plan import (
    checkpoint_ends,
    groups_by_chunk,
    longest_prefix,
    longest_prefix_upto,
    needed_objects,
    plan_save,
    prefix_in,
    prefix_usable,
)

CT = 16  # chunk_tokens of every layout here

#: "kv" needs every chunk; "swa" (window 24 tokens = 1.5 chunks) needs the last two chunks
LAYOUT = bsr.StateLayout(
    chunk_tokens=CT,
    groups=(
        bsr.StateGroup("kv", num_layers=2, token_bytes=64),
        bsr.StateGroup("swa", num_layers=1, token_bytes=64, window_tokens=24),
    ),
)


def have_all_but(*missing: tuple[int, str]):  # type: ignore[no-untyped-def]
    gone = set(missing)
    return lambda c, g: (c, g) not in gone


def test_needed_objects_full_and_windowed_groups_in_chunk_order() -> None:
    assert needed_objects(LAYOUT, 0) == []
    assert needed_objects(LAYOUT, 1) == [(0, "kv"), (0, "swa")]
    # swa needs only chunks 2 and 3 for a 4-chunk prefix; groups keep layout order in a chunk
    assert needed_objects(LAYOUT, 4) == [
        (0, "kv"),
        (1, "kv"),
        (2, "kv"),
        (2, "swa"),
        (3, "kv"),
        (3, "swa"),
    ]


def test_needed_objects_matches_the_public_layout_method() -> None:
    for p in range(8):
        assert needed_objects(LAYOUT, p) == LAYOUT.needed_objects(p)


def test_window_of_exactly_one_chunk_needs_only_the_last_chunk() -> None:
    layout = bsr.StateLayout(
        chunk_tokens=CT,
        groups=(bsr.StateGroup("swa", num_layers=1, token_bytes=64, window_tokens=CT),),
    )
    assert needed_objects(layout, 5) == [(4, "swa")]


def test_groups_by_chunk() -> None:
    assert groups_by_chunk(LAYOUT, 0) == {}
    assert groups_by_chunk(LAYOUT, 3) == {0: ("kv",), 1: ("kv", "swa"), 2: ("kv", "swa")}


def test_prefix_usable() -> None:
    assert prefix_usable(LAYOUT, 0, lambda c, g: False)  # nothing needed
    assert prefix_usable(LAYOUT, 4, have_all_but())
    assert not prefix_usable(LAYOUT, 4, have_all_but((1, "kv")))
    # swa chunk 0 is outside the window of a 4-chunk prefix: not needed
    assert prefix_usable(LAYOUT, 4, have_all_but((0, "swa")))
    assert not prefix_usable(LAYOUT, 4, have_all_but((2, "swa")))


def test_longest_prefix_stops_at_the_first_full_attention_gap() -> None:
    assert longest_prefix(LAYOUT, 6, have_all_but()) == 6
    assert longest_prefix(LAYOUT, 6, have_all_but((3, "kv"))) == 3
    assert longest_prefix(LAYOUT, 6, have_all_but((0, "kv"))) == 0
    assert longest_prefix(LAYOUT, 0, have_all_but()) == 0


def test_longest_prefix_never_exceeds_its_upper_bound() -> None:
    assert longest_prefix(LAYOUT, 2, have_all_but()) == 2


def test_longest_prefix_skips_back_over_a_window_gap() -> None:
    # swa chunk 4 missing: prefixes 5 and 6 need it (window = chunks p-2, p-1); 4 does not
    assert longest_prefix(LAYOUT, 6, have_all_but((4, "swa"))) == 4
    # swa chunk 1 missing: prefixes 2 and 3 need it, but 6 does not, so 6 wins
    assert longest_prefix(LAYOUT, 6, have_all_but((1, "swa"))) == 6
    assert longest_prefix(LAYOUT, 3, have_all_but((1, "swa"))) == 1


def test_longest_prefix_upto() -> None:
    assert longest_prefix_upto(lambda p: p <= 3, 10) == 3
    assert longest_prefix_upto(lambda p: p in (2, 7), 6) == 2
    assert longest_prefix_upto(lambda p: True, 0) == 0
    assert longest_prefix_upto(lambda p: False, 5) == 0


# --- property: the plan functions agree with a brute-force model ---------------------------


def model_needed(windows: list[int | None], prefix: int) -> set[tuple[int, str]]:
    """(chunk, group) pairs a prefix needs, from the definition of a window."""
    out = set()
    for i, w in enumerate(windows):
        for c in range(prefix):
            start = prefix * CT - (w if w is not None else prefix * CT)
            if (c + 1) * CT > start:  # the chunk overlaps the tokens the group needs
                out.add((c, f"g{i}"))
    return out


@st.composite
def layouts_and_sets(draw: st.DrawFn) -> tuple[list[int | None], int, set[tuple[int, str]]]:
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 5 * CT)), min_size=1, max_size=3))
    n = draw(st.integers(0, 8))
    pairs = [(c, f"g{i}") for c in range(n) for i in range(len(windows))]
    have = set(draw(st.lists(st.sampled_from(pairs), unique=True))) if pairs else set()
    return windows, n, have


def build(windows: list[int | None]) -> bsr.StateLayout:
    return bsr.StateLayout(
        chunk_tokens=CT,
        groups=tuple(
            bsr.StateGroup(f"g{i}", num_layers=1, token_bytes=64, window_tokens=w)
            for i, w in enumerate(windows)
        ),
    )


@settings(max_examples=300, deadline=None)
@given(layouts_and_sets())
def test_plan_matches_brute_force_model(
    case: tuple[list[int | None], int, set[tuple[int, str]]],
) -> None:
    windows, n, have = case
    layout = build(windows)
    pred = lambda c, g: (c, g) in have  # noqa: E731
    for p in range(n + 1):
        assert set(needed_objects(layout, p)) == model_needed(windows, p)
        assert len(needed_objects(layout, p)) == len(model_needed(windows, p))  # no duplicates
        assert prefix_usable(layout, p, pred) == (model_needed(windows, p) <= have)
        # the set form the commit and the lifecycle use, for a set and for another collection
        assert prefix_in(layout, p, have) == (model_needed(windows, p) <= have)
        assert prefix_in(layout, p, sorted(have)) == (model_needed(windows, p) <= have)
    best = max(p for p in range(n + 1) if model_needed(windows, p) <= have)
    assert longest_prefix(layout, n, pred) == best
    assert longest_prefix_upto(lambda p: prefix_usable(layout, p, pred), n) == best


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_public_needed_objects_refuses_bad_prefix(bad: object) -> None:
    with pytest.raises(bsr.LayoutError, match="prefix_chunks must be an int >= 0"):
        LAYOUT.needed_objects(bad)  # type: ignore[arg-type]


# --- what a save stores: window checkpoints ------------------------------------------------


def test_stored_objects_keep_each_window_at_the_checkpoints_and_the_end() -> None:
    # "swa" needs the last two chunks; checkpoints every 3 chunks below a 8-chunk prefix: 3, 6
    got = LAYOUT.stored_objects(8, checkpoint_chunks=3)
    assert [c for c, g in got if g == "swa"] == [1, 2, 4, 5, 6, 7]
    assert [c for c, g in got if g == "kv"] == list(range(8))
    assert LAYOUT.stored_objects(8) == LAYOUT.needed_objects(8)  # no checkpoints: the end only
    assert checkpoint_ends(8, 3) == range(3, 8, 3) and not checkpoint_ends(8, None)
    assert not checkpoint_ends(6, 6)  # the end itself is not a checkpoint below it


def test_plan_save_of_a_table_whose_window_moved_on() -> None:
    """A serving engine freed the sliding group's blocks below its window: the full group
    stores every chunk, the window group the end's window; nothing whole is left below."""
    whole = lambda c, g: g == "kv" or c >= 4  # noqa: E731
    plan = plan_save(LAYOUT, 6, whole, checkpoint_chunks=2)
    assert plan.full_chunks == 6 and plan.restorable_chunks == 6
    assert [c for c, g in plan.objects if g == "swa"] == [4, 5]
    # the end's window is gone too: the full group still stores its chunks, nothing restores
    plan = plan_save(LAYOUT, 6, lambda c, g: g == "kv", checkpoint_chunks=2)
    assert plan.full_chunks == 6 and plan.restorable_chunks == 0
    assert all(g == "kv" for _, g in plan.objects)


def test_plan_save_of_a_window_alone() -> None:
    """Only one window lies in real blocks (the vLLM connector saves a window that way while the
    request runs): it is stored alone; no prefix restores from it alone."""
    plan = plan_save(LAYOUT, 5, lambda c, g: g == "swa" and c in (3, 4), checkpoint_chunks=2)
    assert plan.objects == ((3, "swa"), (4, "swa")) and plan.full_chunks == 0
    assert plan.restorable_chunks == 0


def model_window(w: int, end: int) -> set[int]:
    """Chunks of a ``w``-token window before ``end`` chunks, from the definition."""
    return {c for c in range(end) if (c + 1) * CT > end * CT - w}


@st.composite
def save_cases(
    draw: st.DrawFn,
) -> tuple[list[int | None], int, set[tuple[int, str]], int | None]:
    windows, n, whole = draw(layouts_and_sets())
    every = draw(st.one_of(st.none(), st.integers(1, 4)))
    if draw(st.booleans()):  # often: every full chunk whole, windows freed below some point
        cut = draw(st.integers(0, n))
        whole = {(c, f"g{i}") for i, w in enumerate(windows) for c in range(n)
                 if w is None or c >= cut}  # fmt: skip
    return windows, n, whole, every


@settings(max_examples=400, deadline=None)
@given(save_cases())
def test_plan_save_matches_brute_force_model(
    case: tuple[list[int | None], int, set[tuple[int, str]], int | None],
) -> None:
    windows, n, whole, every = case
    layout = build(windows)
    plan = plan_save(layout, n, lambda c, g: (c, g) in whole, checkpoint_chunks=every)
    full = [f"g{i}" for i, w in enumerate(windows) if w is None]
    m = max(p for p in range(n + 1) if all((c, g) in whole for g in full for c in range(p)))
    fit = max(p for p in range(n + 1) if model_needed(windows, p) <= whole)
    ends = {n, fit} | ({e for e in range(1, n) if e % every == 0} if every else set())
    chosen = {(c, g) for g in full for c in range(m)}
    for i, w in enumerate(windows):
        for e in ends if w is not None else ():
            win = {(c, f"g{i}") for c in model_window(w, e)}
            if win <= whole:
                chosen |= win
    assert set(plan.objects) == chosen
    assert set(plan.objects) <= whole  # never an object with a block missing
    order = [(c, int(g[1:])) for c, g in plan.objects]
    assert order == sorted(order)  # chunk order, layout order inside a chunk
    assert plan.full_chunks == m
    assert plan.restorable_chunks == max(
        p for p in range(n + 1) if model_needed(windows, p) <= chosen
    )
    assert plan.restorable_chunks >= fit  # never less than before checkpoints
    everything = {(c, f"g{i}") for i in range(len(windows)) for c in range(n)}
    if everything <= whole:  # every block real: what the layout says a save stores
        assert set(plan.objects) == set(layout.stored_objects(n, checkpoint_chunks=every))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(1, 5 * CT)), min_size=1, max_size=3),
    st.integers(1, 12),
    st.integers(1, 5),
    st.data(),
)
def test_a_shared_prefix_restores_to_its_last_checkpoint(
    windows: list[int | None], n: int, every: int, data: st.DataObject
) -> None:
    """The checkpoint rule: a prompt stored whole (every block real) with checkpoints every
    ``every`` chunks; a later prompt shares its first ``j`` chunks (the chained keys of the
    chunks past ``j`` differ, so those objects are not its own). The probe finds at least the
    last checkpoint at or below ``j`` (``j`` itself when ``j`` is the stored end), every group
    alike, and exactly the brute-force longest prefix."""
    layout = build(windows)
    j = data.draw(st.integers(0, n))
    stored = set(plan_save(layout, n, lambda c, g: True, checkpoint_chunks=every).objects)
    shared = {(c, g) for c, g in stored if c < j}
    got = longest_prefix(layout, j, lambda c, g: (c, g) in shared)
    rule = j if j == n else j // every * every
    assert got >= rule
    assert got == max(p for p in range(j + 1) if model_needed(windows, p) <= shared)
    if all(w is None for w in windows):
        assert got == j  # nothing windowed: every shared chunk restores
