"""Pure planning: which (chunk, group) objects a prefix needs, which a save stores, and the
longest usable prefix.

No I/O here; the engine asks these functions with a predicate ``have(chunk, group)`` that is
"some tier holds it" during probing and "installed" after the window drains, and a save asks
:func:`plan_save` with ``whole(chunk, group)``: "every block of that chunk of that group holds its
state" (no ``NULL_BLOCK`` in it).

What a save stores (:func:`plan_save`): a group without a window stores each chunk of the longest
prefix whose chunks are all whole; a sliding-window group stores its window (the chunks
:meth:`~bsr.StateLayout.needed_chunks` names) at a few *prefix ends*, each whole window or none:
the end of the saved tokens, the longest prefix whose every group lies in whole chunks (what a
save stored before window checkpoints), and, with window checkpoints every ``k`` chunks, every
``k``-th chunk boundary below the end. A later request that shares only the first ``j`` chunks of
the saved tokens then restores up to the last checkpoint at or below ``j``; the probe
(:func:`longest_prefix`) needs no rule for that: it finds the longest prefix whose every needed
object some tier holds, whichever save stored it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from ._layout import StateLayout, checkpoint_ends

Have = Callable[[int, str], bool]

__all__ = (
    "Have",
    "RestorePlan",
    "SavePlan",
    "checkpoint_ends",
    "groups_by_chunk",
    "longest_prefix",
    "longest_prefix_upto",
    "needed_objects",
    "plan_restore",
    "plan_save",
    "prefix_in",
    "prefix_usable",
)


def needed_objects(layout: StateLayout, prefix_chunks: int) -> list[tuple[int, str]]:
    """Every (chunk, group) a prefix of ``prefix_chunks`` chunks needs, in chunk order
    (:meth:`StateLayout.needed_objects`)."""
    return layout.needed_objects(prefix_chunks)


def groups_by_chunk(layout: StateLayout, prefix_chunks: int) -> dict[int, tuple[str, ...]]:
    """For each chunk that a prefix needs, the groups needed from it (built at C speed when
    every group needs every chunk of the prefix: no sliding window reaches back less far)."""
    names = layout.group_names
    if all(layout.needed_chunks(g, prefix_chunks) == range(prefix_chunks) for g in names):
        return dict.fromkeys(range(prefix_chunks), names)
    out: dict[int, list[str]] = {}
    for c, g in needed_objects(layout, prefix_chunks):
        out.setdefault(c, []).append(g)
    return {c: tuple(gs) for c, gs in out.items()}


@dataclass(frozen=True)
class RestorePlan:
    """What one restore's window moves (:func:`plan_restore`); handed to the transfer side's
    ``RestoreRun``, which reads it and records what happened.

    Attributes:
        target: the agreed prefix, in chunks, the window installs.
        needed: for each chunk the prefix needs, the groups needed from it (chunk order).
        skipped: the chunks that already hold valid state in the cache (the caller says so:
            ``restore(start_tokens=...)``): neither read nor installed, they count as installed.
        first_block: blocks of the tables before this index are never written (a chunk
            straddling it is read whole and installed from that block on).
    """

    target: int
    needed: Mapping[int, tuple[str, ...]]
    skipped: frozenset[int] = frozenset()
    first_block: int = 0

    @property
    def to_read(self) -> list[int]:
        """The chunks the window reads, ascending (every needed chunk not skipped)."""
        return sorted(c for c in self.needed if c not in self.skipped)


def plan_restore(
    layout: StateLayout, target: int, *, valid_chunks: int = 0, first_block: int = 0
) -> RestorePlan:
    """The plan of a restore of the first ``target`` chunks, into tables whose blocks before
    ``first_block`` are the caller's, who holds valid state for the first ``valid_chunks``."""
    needed = groups_by_chunk(layout, target)
    skipped = frozenset(c for c in needed if c < valid_chunks)
    return RestorePlan(target, needed, skipped, first_block)


def prefix_usable(layout: StateLayout, prefix_chunks: int, have: Have) -> bool:
    """Whether every object the prefix needs is available."""
    return all(have(c, g) for c, g in needed_objects(layout, prefix_chunks))


# a restore asks about its own one or two prefix lengths several times; a few entries serve
# the restores in flight, and each entry is O(prefix) (thousands of pairs at paper scale)
@functools.lru_cache(maxsize=16)
def _needed_set(layout: StateLayout, prefix_chunks: int) -> frozenset[tuple[int, str]]:
    return frozenset(layout.needed_objects(prefix_chunks))


def prefix_in(
    layout: StateLayout, prefix_chunks: int, objects: Collection[tuple[int, str]]
) -> bool:
    """Whether ``objects`` holds every (chunk, group) the prefix needs: :func:`prefix_usable`
    with ``have = in objects``, as one set comparison (a restore asks this several times)."""
    need = _needed_set(layout, prefix_chunks)
    if isinstance(objects, (set, frozenset)):
        return need <= objects
    return all(o in objects for o in need)


def longest_prefix(layout: StateLayout, upper_chunks: int, have: Have) -> int:
    """The longest prefix ``p <= upper_chunks`` whose needed objects are all available.

    Full-attention groups make availability monotone up to the first gap; sliding-window groups
    only need a suffix window, so candidates are checked from the longest down.
    """
    full = [g.name for g in layout.groups if g.window_tokens is None]
    windowed = [g for g in layout.groups if g.window_tokens is not None]
    limit = 0
    while limit < upper_chunks and all(have(limit, g) for g in full):
        limit += 1
    for p in range(limit, 0, -1):
        if all(have(c, g.name) for g in windowed for c in layout.needed_chunks(g.name, p)):
            return p
    return 0


@dataclass(frozen=True)
class SavePlan:
    """What one save stores (:func:`plan_save`).

    Attributes:
        objects: every ``(chunk, group)`` to store, in chunk order (layout order inside a chunk).
        full_chunks: the chunks every group without a window stores (a prefix).
        restorable_chunks: the longest prefix a restore can read from ``objects`` alone.
    """

    objects: tuple[tuple[int, str], ...]
    full_chunks: int
    restorable_chunks: int


def plan_save(
    layout: StateLayout, upper: int, whole: Have, checkpoint_chunks: int | None = None
) -> SavePlan:
    """What a save of ``upper`` chunks stores, given which chunks lie ``whole`` in real blocks.

    See the module docstring: the groups without a window store the longest prefix of whole
    chunks; each windowed group stores, at each prefix end (``upper``, the longest prefix whose
    every needed object is whole, and the window checkpoints below ``upper``), its window if
    every chunk of it is whole.
    """
    full = [g.name for g in layout.groups if g.window_tokens is None]
    windowed = [g.name for g in layout.groups if g.window_tokens is not None]
    m = 0
    while m < upper and all(whole(m, g) for g in full):
        m += 1
    ends = {upper, longest_prefix(layout, upper, whole)}
    ends.update(checkpoint_ends(upper, checkpoint_chunks))
    chosen: set[tuple[int, str]] = {(c, g) for g in full for c in range(m)}
    for g in windowed:
        for e in ends:
            window = layout.needed_chunks(g, e)
            if all(whole(c, g) for c in window):
                chosen.update((c, g) for c in window)
    order = {g: i for i, g in enumerate(layout.group_names)}
    objects = tuple(sorted(chosen, key=lambda o: (o[0], order[o[1]])))
    restorable = longest_prefix(layout, upper, lambda c, g: (c, g) in chosen)
    return SavePlan(objects, m, restorable)


def longest_prefix_upto(usable: Callable[[int], bool], upper: int) -> int:
    """The largest ``p <= upper`` with ``usable(p)``, or 0."""
    for p in range(upper, 0, -1):
        if usable(p):
            return p
    return 0
