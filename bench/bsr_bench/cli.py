"""The ``bsr bench`` command: every program's flags, and the choice of program.

How it works: one parser holds the flags of every program (the default run's, then the groups of
the paper-scale, vLLM and HCache programs), so ``bsr bench --help`` lists them all and the
programs read the shared ones (``--quick``, ``--json``, ``--path``, ...) alike.
:func:`run_from_namespace` picks the program from the flags, runs it, and turns a
:class:`~.common.stats.BenchError` into exit code 2 and a message; :func:`main`, the command
line, first sends bsr's log events of ``--log-level`` and above to stderr.
``bsr bench`` (bsr's CLI hands its arguments over), ``python -m bsr_bench`` and
``bench/bench.py`` all come here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from . import hcache, striped, vllm_cost, vllm_fleet, vllm_hybrid, vllm_ttft, vllm_warm
from .common.stats import BenchError
from .paper import options as paper_options
from .paper import ssd
from .restore import options as restore_options

Program = Callable[[argparse.Namespace], dict[str, Any]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``bsr bench`` flag."""
    restore_options.add_arguments(p)
    paper_options.add_arguments(p)  # --l1-ladder, --tp
    ssd.add_arguments(p)  # --ssd-concurrency
    striped.add_arguments(p)  # --striped
    vllm_ttft.add_arguments(p)  # --engine vllm
    vllm_hybrid.add_arguments(p)  # --engine vllm --vllm-model gemma3-tiny
    vllm_cost.add_arguments(p)  # --engine vllm --vllm-cost
    vllm_warm.add_arguments(p)  # --engine vllm --vllm-warm
    vllm_fleet.add_arguments(p)  # --engine vllm --vllm-fleet
    hcache.add_arguments(p)  # --hcache


def build_parser(prog: str = "bsr bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Save states of growing size, restore them with BSR (bounded window) and "
        "the whole-plan baseline, read the same files raw, prefill the same tokens, and write "
        "one JSON document plus plots (see bench/README.md). --l1-ladder, --tp, "
        "--ssd-concurrency, --striped, --hcache and --engine vllm run the other programs instead.",
    )
    add_arguments(parser)
    return parser


def program(ns: argparse.Namespace) -> tuple[str, Program]:
    """The program the flags ask for: (its flag, for messages; its entry point)."""
    if ns.hcache:  # HCache restore vs KV restore vs recompute
        return "--hcache", hcache.run_from_namespace
    if ns.engine == "vllm" and ns.vllm_cost:  # policy "cost" vs always-load vs recompute
        return "--engine vllm --vllm-cost", vllm_cost.run_from_namespace
    if ns.engine == "vllm" and ns.vllm_warm:  # a returning turn: warm hint, promotion
        return "--engine vllm --vllm-warm", vllm_warm.run_from_namespace
    if ns.engine == "vllm" and ns.vllm_fleet:  # a fleet: private caches, a pool, a router; P/D
        return "--engine vllm --vllm-fleet", vllm_fleet.run_from_namespace
    if ns.engine == "vllm" and ns.vllm_model == "gemma3-tiny":  # hybrid manager on vs off
        return "--engine vllm --vllm-model gemma3-tiny", vllm_hybrid.run_from_namespace
    if ns.engine == "vllm":  # TTFT inside vLLM's CPU engine
        return "--engine vllm", vllm_ttft.run_from_namespace
    if ns.ssd_concurrency:  # the paper's SSD concurrency row
        return "--ssd-concurrency", ssd.run_ssd
    if ns.striped:  # restore bandwidth over 1, 2, 4 roots of a StripedFileTier, fio beside it
        return "--striped", striped.run_from_namespace
    if ns.l1_ladder or ns.tp:  # paper scale
        from . import paper

        return ("--tp" if ns.tp else "--l1-ladder"), paper.run_from_namespace
    from .restore import program as default

    return "", default.run_from_namespace


def _configure_logging(level: str) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def run_from_namespace(ns: argparse.Namespace) -> int:
    """Run the program the parsed flags ask for; 0, or 2 with a message on a BenchError."""
    flag, entry = program(ns)
    try:
        entry(ns)
    except BenchError as exc:
        print(f"bsr bench{' ' + flag if flag else ''}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "bsr bench") -> int:
    """``bsr bench``, ``python -m bsr_bench`` and ``python bench/bench.py``."""
    ns = build_parser(prog).parse_args(argv)
    _configure_logging(ns.log_level)  # process-wide: the command line's business only
    return run_from_namespace(ns)
