"""Hypothesis strategies for bsr: small layouts, token streams with shared prefixes, fault plans.

Everything here is sized for property tests and state-machine campaigns: layouts have 1-3 state
groups with a few layers and a few bytes per token, chunks of 16 or 32 tokens, so one object is a
few KiB and a campaign can save and restore hundreds of prefixes per second.

Importing this module needs Hypothesis (``pip install bsr-kv[test]``); ``import bsr.testing`` does
not, it loads this module on first use of one of its names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from ..core._layout import StateGroup, StateLayout
from ._faults import Fault, FaultKind, FaultPlan

#: chunk sizes the strategies draw from (small, so that objects are small)
CHUNK_TOKENS = (16, 32)
_DTYPES = (("uint8", 1), ("bfloat16", 2), ("float32", 4))


@dataclass(frozen=True)
class LayoutCase:
    """A drawn layout and the block size of the paged caches built for it."""

    layout: StateLayout
    block_tokens: int

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.chunk_tokens // self.block_tokens


@st.composite
def state_groups(
    draw: st.DrawFn, name: str, chunk_tokens: int, *, windowed: bool | None = None
) -> StateGroup:
    """One small :class:`~bsr.StateGroup` named ``name``.

    Args:
        name: the group name.
        chunk_tokens: the layout's chunk size (window sizes are drawn around it).
        windowed: force a sliding window (True), none (False), or draw (None).
    """
    dtype, itemsize = draw(st.sampled_from(_DTYPES))
    token_bytes = itemsize * draw(st.integers(1, 16))
    num_layers = draw(st.integers(1, 3))
    has_window = draw(st.booleans()) if windowed is None else windowed
    window = None
    if has_window:
        window = draw(
            st.sampled_from(
                (
                    1,
                    chunk_tokens // 2,
                    chunk_tokens,
                    chunk_tokens + 1,
                    2 * chunk_tokens,
                    3 * chunk_tokens,
                )
            )
        )
    return StateGroup(name, num_layers, token_bytes, window_tokens=window, dtype=dtype)


@st.composite
def layouts(
    draw: st.DrawFn,
    *,
    min_groups: int = 1,
    max_groups: int = 3,
    chunk_tokens: Sequence[int] = CHUNK_TOKENS,
    windows: bool = True,
) -> LayoutCase:
    """A :class:`LayoutCase`: a small layout (some groups windowed) and a block size dividing it.

    Args:
        min_groups: the fewest state groups (1 by default).
        max_groups: the most state groups (3 by default).
        chunk_tokens: chunk sizes to draw from.
        windows: allow sliding-window groups.
    """
    ct = draw(st.sampled_from(tuple(chunk_tokens)))
    n = draw(st.integers(min_groups, max_groups))
    names = ("kv", "swa", "idx", "mla", "hid")[:n]
    groups = tuple(
        draw(state_groups(name, ct, windowed=None if windows else False)) for name in names
    )
    block_tokens = draw(st.sampled_from([b for b in (1, 2, 4, 8, 16, 32) if ct % b == 0]))
    return LayoutCase(StateLayout(chunk_tokens=ct, groups=groups), block_tokens)


def _tokens(n: int, vocab: int) -> st.SearchStrategy[list[int]]:
    # mostly a small vocabulary (so prefixes collide and repeat), sometimes large ids
    return st.lists(
        st.one_of(st.integers(0, vocab - 1), st.integers(0, 2**40)), min_size=n, max_size=n
    )


@st.composite
def derived_tokens(
    draw: st.DrawFn,
    chunk_tokens: int,
    bases: Sequence[Sequence[int]] = (),
    *,
    max_chunks: int = 4,
    vocab: int = 32,
) -> list[int]:
    """A token stream of at most ``max_chunks`` chunks (plus a partial tail), usually related to
    one of ``bases``: the very same stream (the simplest choice, so shrinking keeps hits), a
    chunk-aligned prefix of it, a longer stream continuing it, one diverging at any token, or
    (also when there are no bases) a fresh stream.
    """
    limit = max_chunks * chunk_tokens
    mode = draw(st.sampled_from(_MODES)) if bases else "fresh"
    prefix: list[int] = []
    if mode != "fresh":
        base = list(draw(st.sampled_from(list(bases))))[:limit]
        if mode == "same":
            return base
        if mode == "prefix":
            aligned = [c * chunk_tokens for c in range(len(base) // chunk_tokens, -1, -1)]
            prefix = base[: draw(st.sampled_from(aligned))]
            tail = draw(st.integers(0, chunk_tokens - 1))
            return prefix + draw(_tokens(tail, vocab))
        # extend: continue the base; diverge: leave it at any token
        prefix = base if mode == "extend" else base[: draw(st.integers(0, len(base)))]
    room = limit + chunk_tokens - 1 - len(prefix)
    extra = draw(st.integers(0, max(0, room)))
    return prefix + draw(_tokens(extra, vocab))


_MODES = ("same", "prefix", "extend", "diverge", "fresh")


@st.composite
def token_streams(
    draw: st.DrawFn,
    chunk_tokens: int,
    *,
    min_streams: int = 1,
    max_streams: int = 4,
    max_chunks: int = 4,
    vocab: int = 32,
) -> list[list[int]]:
    """Several token streams, later ones often sharing prefixes with earlier ones."""
    n = draw(st.integers(min_streams, max_streams))
    out: list[list[int]] = []
    for _ in range(n):
        out.append(draw(derived_tokens(chunk_tokens, out, max_chunks=max_chunks, vocab=vocab)))
    return out


@st.composite
def faults(
    draw: st.DrawFn,
    groups: Sequence[str],
    *,
    kinds: Sequence[FaultKind] = tuple(FaultKind),
    max_chunks: int = 4,
    max_delay_s: float = 0.005,
) -> Fault:
    """One :class:`~bsr.testing.Fault` rule of one of ``kinds``.

    HANG rules fire at most twice (each costs a restore its deadline); DELAY rules sleep at
    most ``max_delay_s``.
    """
    kind = draw(st.sampled_from(tuple(kinds)))
    probability = draw(st.sampled_from((0.1, 0.3, 0.6, 1.0)))
    group = draw(st.one_of(st.none(), st.sampled_from(tuple(groups))))
    chunks = draw(st.one_of(st.none(), st.frozensets(st.integers(0, max_chunks - 1), min_size=1)))
    max_times = draw(st.one_of(st.none(), st.integers(1, 3)))
    if kind is FaultKind.HANG:
        max_times = draw(st.integers(1, 2))
        probability = min(probability, 0.6)
    delay = draw(st.floats(0.0005, max_delay_s)) if kind is FaultKind.DELAY else 0.01
    return Fault(kind, probability, group, chunks, max_times, delay)


@st.composite
def fault_plans(
    draw: st.DrawFn,
    groups: Sequence[str],
    *,
    world_size: int = 1,
    kinds: Sequence[FaultKind] = tuple(FaultKind),
    min_rules: int = 1,
    max_rules: int = 4,
    max_chunks: int = 4,
    asymmetric: bool | None = None,
) -> FaultPlan:
    """A seeded :class:`~bsr.testing.FaultPlan` of ``min_rules``-``max_rules`` rules.

    Args:
        groups: the layout's group names (rules may target one).
        world_size: ranks; with more than one the plan may be limited to some of them.
        kinds: the fault kinds to draw from (every kind by default).
        asymmetric: limit the plan to a proper subset of the ranks (True), to none (False),
            or draw (None).
    """
    rules = draw(
        st.lists(
            faults(groups, kinds=kinds, max_chunks=max_chunks),
            min_size=min_rules,
            max_size=max_rules,
        )
    )
    seed = draw(st.integers(0, 2**32 - 1))
    ranks: frozenset[int] | None = None
    limit = draw(st.booleans()) if asymmetric is None else asymmetric
    if limit and world_size > 1:
        ranks = draw(
            st.frozensets(st.integers(0, world_size - 1), min_size=1, max_size=world_size - 1)
        )
    return FaultPlan(seed=seed, faults=tuple(rules), ranks=ranks)


__all__ = (
    "CHUNK_TOKENS",
    "LayoutCase",
    "derived_tokens",
    "fault_plans",
    "faults",
    "layouts",
    "state_groups",
    "token_streams",
)
