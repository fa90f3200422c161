"""The tests' one engine factory: every test that needs a :class:`bsr.RestoreEngine` over some
tiers (and is not testing the constructor itself) builds it here; the variants are parameters."""

from __future__ import annotations

from typing import Any

import bsr


def make_engine(
    layout: bsr.StateLayout,
    tiers: list[bsr.Tier],
    *,
    window: int = 2,
    io_depth: int = 2,
    model_id: str = "test-model",
    **kw: Any,
) -> bsr.RestoreEngine:
    """An engine with a small window over ``tiers``, in namespace ``model_id`` unless a
    ``namespace`` is given (extra options pass through to :class:`bsr.RestoreEngine`)."""
    kw.setdefault("namespace", bsr.Namespace(model_id))
    return bsr.RestoreEngine(layout, tiers, window=window, io_depth=io_depth, **kw)
