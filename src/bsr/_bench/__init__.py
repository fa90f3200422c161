"""The ``bsr bench`` benchmark (the project's main job).

How it works: :mod:`.runner` saves states of growing size for each layout into a
:class:`~bsr.FileTier` and, for every size, measures the probe, a BSR (bounded-window) restore, a
whole-plan restore, a raw read of the very same object files and, for the recompute model's own
KV layout, a prefill of the same tokens; a W x io_depth sweep follows. :mod:`.report` writes one
JSON document (checked against ``schema.json``), PNG plots and tables. See ``bench/README.md``.

Modules: :mod:`.options` (flags), :mod:`.layouts` (built-in and custom layouts),
:mod:`.restore` (saved state and engine measurements), :mod:`.raw` (raw reads),
:mod:`.pagecache` (page-cache modes), :mod:`.memory` (peak RSS), :mod:`.recompute` (HF prefill),
:mod:`.remote` (``--remote mooncake``: a loopback Mooncake cluster per layout),
:mod:`.machine` (machine, commit, filesystem), :mod:`.stats` (distributions, ratios),
:mod:`.ui` (progress and live table).
"""

from __future__ import annotations

from .options import BenchOptions as BenchOptions
from .options import add_arguments as add_arguments
from .runner import build_parser as build_parser
from .runner import main as main
from .runner import run as run
from .runner import run_from_namespace as run_from_namespace
from .stats import BenchError as BenchError

__all__ = (
    "BenchError",
    "BenchOptions",
    "add_arguments",
    "build_parser",
    "main",
    "run",
    "run_from_namespace",
)
