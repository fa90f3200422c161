"""The paper-scale benches: ``bsr bench --l1-ladder`` and ``bsr bench --tp N``.

Where it runs: the bench process; ``--tp`` also starts one process per rank
(:mod:`.tp_worker`), and ``--l1-ladder --lmcache`` one in ``.venv-lmcache``
(:mod:`.lmcache_worker`).

Modules: :mod:`.options` (the flags of both), :mod:`.ladder` (the L1 ladder),
:mod:`.ladder_report` (its table, Markdown and plot), :mod:`.lmcache` (LMCache's side of the
ladder), :mod:`.tp` (the tensor-parallel run), :mod:`.scale` (chunk-by-chunk states and
destinations larger than memory, shared by both).
"""

from __future__ import annotations

import argparse
from typing import Any


def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """Run ``--tp N`` if given, else ``--l1-ladder``; return the document."""
    if ns.tp:
        from .tp import resolve_tp, run_tp

        return run_tp(resolve_tp(ns))
    from .ladder import run_ladder
    from .options import resolve_ladder

    return run_ladder(resolve_ladder(ns))
