"""Pure planning: which (chunk, group) objects a prefix needs, and the longest usable prefix.

No I/O here; the engine asks these functions with a predicate ``have(chunk, group)`` that is
"some tier holds it" during probing and "installed" after the window drains.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

from ._layout import StateLayout

Have = Callable[[int, str], bool]


def needed_objects(layout: StateLayout, prefix_chunks: int) -> list[tuple[int, str]]:
    """Every (chunk, group) a prefix of ``prefix_chunks`` chunks needs, in chunk order
    (:meth:`StateLayout.needed_objects`)."""
    return layout.needed_objects(prefix_chunks)


def groups_by_chunk(layout: StateLayout, prefix_chunks: int) -> dict[int, tuple[str, ...]]:
    """For each chunk that a prefix needs, the groups needed from it."""
    out: dict[int, list[str]] = {}
    for c, g in needed_objects(layout, prefix_chunks):
        out.setdefault(c, []).append(g)
    return {c: tuple(gs) for c, gs in out.items()}


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


def longest_prefix_upto(usable: Callable[[int], bool], upper: int) -> int:
    """The largest ``p <= upper`` with ``usable(p)``, or 0."""
    for p in range(upper, 0, -1):
        if usable(p):
            return p
    return 0
