"""The commit rule as pure functions: what a rank votes, which trigger it fires, and why it failed.

How it works: after the window drains, each rank knows which (chunk, group) objects it installed.
:func:`local_vote` turns that into the longest prefix the rank can vouch for; the ranks agree on
the MIN of their votes (and re-propose shorter prefixes until every rank can use the agreed one);
:func:`choose_trigger` names the lifecycle trigger the agreed prefix allows, and the lifecycle's
guards check the same facts again, independently, before the state changes. When the request
cannot commit, :func:`invalidation_reason` says why. Nothing here does I/O or touches anyio.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from ._layout import StateLayout
from ._lifecycle import Reason
from ._options import Policy
from ._plan import longest_prefix, prefix_in

Installed = Collection[tuple[int, str]]
#: ``serves(prefix_chunks)``: whether the caller's block tables hold a block wherever that prefix
#: needs one (a sliding-window group's table may have none outside its window); None: always
Serves = Callable[[int], bool] | None


def installed_usable(
    layout: StateLayout, prefix_chunks: int, installed: Installed, serves: Serves = None
) -> bool:
    """Whether every (chunk, group) a prefix of ``prefix_chunks`` chunks needs is installed
    (and, with ``serves``, the block tables hold every block the prefix needs)."""
    if serves is not None and prefix_chunks > 0 and not serves(prefix_chunks):
        return False
    return prefix_in(layout, prefix_chunks, installed)


def local_vote(
    layout: StateLayout,
    policy: Policy,
    *,
    target: int,
    limit: int,
    installed: Installed,
    timed_out: bool,
    serves: Serves = None,
) -> int:
    """The longest prefix (in chunks) this rank can vouch for after its window drained.

    Args:
        layout: the state layout.
        policy: all-or-nothing votes the whole target or nothing; truncate votes the longest
            fully installed prefix below the first failed chunk.
        target: the agreed probed prefix the window tried to install.
        limit: chunks at or past ``limit`` were abandoned (a chunk below failed).
        installed: the (chunk, group) objects installed and verified on this rank.
        timed_out: the deadline fired during the window: vote 0, whatever landed.
        serves: whether the block tables hold every block a prefix needs (None: always).
    """
    if timed_out or target <= 0:
        return 0
    if policy is Policy.TRUNCATE:

        def have(c: int, g: str) -> bool:
            return (c, g) in installed

        p = longest_prefix(layout, min(limit, target), have)
        while p and serves is not None and not serves(p):
            p = longest_prefix(layout, p - 1, have)
        return p
    return target if installed_usable(layout, target, installed, serves) else 0


def choose_trigger(
    layout: StateLayout,
    policy: Policy,
    *,
    target: int,
    agreed: int,
    installed: Installed,
    serves: Serves = None,
) -> str | None:
    """The Windowing -> Installed trigger the agreed prefix allows, or None (invalidate).

    ``chunks_installed`` when the whole target was agreed and is installed here; ``truncate``
    under the truncate policy when a shorter non-empty agreed prefix is installed here.
    """
    if target > 0 and agreed == target and installed_usable(layout, target, installed, serves):
        return "chunks_installed"
    if (
        policy is Policy.TRUNCATE
        and 0 < agreed < target
        and installed_usable(layout, agreed, installed, serves)
    ):
        return "truncate"
    return None


def commit_reason(*, agreed: int, target: int) -> Reason:
    """Why a committed request ended where it did."""
    return Reason.COMPLETE if agreed == target else Reason.TRUNCATED


def invalidation_reason(*, timed_out: bool, failure: Reason | None, installed_here: bool) -> Reason:
    """Why a request that reached the agreement could not commit.

    Args:
        timed_out: the deadline fired during the window.
        failure: the reason of the first chunk this rank failed to read or install, if any.
        installed_here: this rank installed its whole target (so another rank failed).
    """
    if timed_out:
        return Reason.DEADLINE
    if failure is not None:
        return failure
    if installed_here:
        return Reason.RANK_FAILED
    return Reason.READ_FAILED
