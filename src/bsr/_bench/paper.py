"""Dispatch of the paper-scale benches: ``bsr bench --l1-ladder`` and ``bsr bench --tp N``.

Where it runs: the bench process, called from :func:`.runner.run_from_namespace` when one of
those flags is given (they replace the default bench run).
"""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

from .stats import BenchError


def run_paper_from_namespace(ns: argparse.Namespace) -> int:
    """Run the asked paper-scale bench; 2 with a message on a :class:`BenchError`."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, ns.log_level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    what = "--tp" if ns.tp else "--l1-ladder"
    try:
        if ns.tp:
            from .tp import resolve_tp, run_tp

            run_tp(resolve_tp(ns))
        else:
            from .ladder import resolve_ladder, run_ladder

            run_ladder(resolve_ladder(ns))
    except BenchError as exc:
        print(f"bsr bench {what}: error: {exc}", file=sys.stderr)
        return 2
    return 0
