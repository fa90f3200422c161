"""Command-line options of the default ``bsr bench`` run and their defaults.

Defaults finish in about two minutes on a 2-core CPU machine without a GPU; ``--quick`` is a
smoke run of a few seconds (small sizes, W=2, one repeat, the tiny recompute model).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..common.layouts import BUILTIN
from ..common.stats import BenchError
from .recompute import PRESETS
from .remote import REMOTE_CHOICES, check_available

DEFAULT_SIZES = (2048, 4096, 8192)
DEFAULT_LAYOUTS = ("llama3-8b", "dsv4-flash", "kv-512k")
DEFAULT_WINDOWS = (1, 2, 4, 8)
DEFAULT_IO_DEPTHS = (1, 2, 4)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x.replace("_", "")) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class BenchOptions:
    """Resolved options of one run (recorded in the JSON under ``args``)."""

    sizes: tuple[int, ...]
    layouts: tuple[str, ...]
    window: int
    io_depth: int
    windows: tuple[int, ...]
    io_depths: tuple[int, ...]
    sweep_tokens: int | None
    sweep: bool
    path: str | None
    keep: bool
    cache: str
    repeats: int
    model_size: str
    recompute: bool
    device: str
    quick: bool
    json: str
    plots: str
    no_plots: bool
    seed: int
    log_level: str
    remote: str = "none"
    fio: bool = True
    overhead: bool = True
    concurrency: bool = True
    cpu: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the default run (the other programs read some of them too)."""
    _add_series_arguments(p)
    _add_sweep_arguments(p)
    _add_storage_arguments(p)
    _add_recompute_arguments(p)
    _add_output_arguments(p)
    _add_run_arguments(p)
    _add_section_arguments(p)


def _add_series_arguments(p: argparse.ArgumentParser) -> None:
    """The size series: sizes, layouts, W and io_depth."""
    p.add_argument(
        "--sizes",
        type=_ints,
        default=None,
        help="state sizes in tokens, comma-separated (default 2048,4096,8192; "
        "multiples of the chunk size, at least W chunks to see a flat RWS)",
    )
    p.add_argument(
        "--layout",
        action="append",
        default=None,
        metavar="NAME|JSON",
        help=f"layout to restore, repeatable: one of {', '.join(sorted(BUILTIN))}, "
        "an inline JSON spec or a .json file (default llama3-8b and dsv4-flash)",
    )
    p.add_argument(
        "--window",
        "-W",
        type=int,
        default=None,
        help="W staging slots for the size series (default 8)",
    )
    p.add_argument(
        "--io-depth", type=int, default=None, help="reads in flight for the size series (default 4)"
    )


def _add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The W x io_depth sweep."""
    p.add_argument(
        "--windows", type=_ints, default=None, help="W values of the sweep (default 1,2,4,8)"
    )
    p.add_argument(
        "--io-depths",
        type=_ints,
        default=None,
        help="io_depth values of the sweep; pairs with io_depth > W are skipped (default 1,2,4)",
    )
    p.add_argument(
        "--sweep-tokens",
        type=int,
        default=None,
        help="size of the W x io_depth sweep, one of --sizes (default: the smallest "
        "size with at least max(W) chunks)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the W x io_depth sweep")


def _add_storage_arguments(p: argparse.ArgumentParser) -> None:
    """Where the state is stored, the page-cache mode and the repeats."""
    p.add_argument(
        "--path",
        default=None,
        help="directory to store the state in, e.g. an NVMe mount (default: a new "
        "temporary directory); a fresh subdirectory is made and removed after",
    )
    p.add_argument("--keep", action="store_true", help="keep the stored files after the run")
    p.add_argument(
        "--cache",
        choices=("auto", "direct", "cold", "warm"),
        default="auto",
        help="page-cache mode of every measurement (see bench/README.md)",
    )
    p.add_argument("--repeats", type=int, default=None, help="repeats per point (default 3)")


def _add_recompute_arguments(p: argparse.ArgumentParser) -> None:
    """The recompute baseline and the device."""
    p.add_argument(
        "--model-size",
        default=None,
        help=f"recompute model: one of {', '.join(PRESETS)} or a JSON object of "
        "LlamaConfig fields (default tiny)",
    )
    p.add_argument("--no-recompute", action="store_true", help="skip the recompute baseline")
    p.add_argument(
        "--device",
        default="cpu",
        help="device of the destination paged cache and the recompute model",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Quick runs, the JSON document and the plots."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run of a few seconds (small sizes, W=2, 1 repeat)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="JSON output path (default bench/results/bench-<UTC time>.json)",
    )
    p.add_argument("--plots", default=None, help="directory for PNG plots (default bench/results)")
    p.add_argument("--no-plots", action="store_true", help="do not write plots")


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The remote tier, the seed and the log level."""
    p.add_argument(
        "--remote",
        choices=REMOTE_CHOICES,
        default="none",
        help="also restore every layout and size from a remote tier: 'mooncake' saves the state "
        "into a MooncakeTier on a loopback Mooncake Store cluster started for the run "
        "(needs the mooncake package), 'redis' into a RedisTier on a loopback redis-server "
        "(needs redis-server and the bsr-kv[redis] extra); default none",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of tokens, bytes and model weights")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="level of bsr's structlog events printed during the run",
    )


def _add_section_arguments(p: argparse.ArgumentParser) -> None:
    """The machinery sections that can be skipped."""
    p.add_argument(
        "--no-fio",
        action="store_true",
        help="do not read the object files with fio (the physical reference; used when installed)",
    )
    p.add_argument(
        "--no-overhead",
        action="store_true",
        help="skip the overhead section (HostTier restores vs memcpy, 4 KiB .. 32 MiB chunks)",
    )
    p.add_argument(
        "--no-cpu",
        action="store_true",
        help="skip the cpu section (CPU seconds per GiB restored from a HostTier and a FileTier "
        "at 4 KiB, 512 KiB and 32 MiB chunks, beside the floor: fio's read CPU, xxh3, one copy)",
    )
    p.add_argument(
        "--no-concurrency",
        action="store_true",
        help="skip the concurrency section (N = 1, 2, 4, 8 restores at once on one engine)",
    )


def resolve(ns: argparse.Namespace) -> BenchOptions:
    """Fill defaults (``--quick`` changes them) and check the combination."""
    quick = bool(ns.quick)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    opts = BenchOptions(
        sizes=tuple(sorted(set(ns.sizes or ((512, 1024) if quick else DEFAULT_SIZES)))),
        layouts=tuple(ns.layout or DEFAULT_LAYOUTS),
        window=ns.window or (2 if quick else 8),
        io_depth=ns.io_depth or (2 if quick else 4),
        windows=tuple(sorted(set(ns.windows or ((1, 2) if quick else DEFAULT_WINDOWS)))),
        io_depths=tuple(sorted(set(ns.io_depths or ((1, 2) if quick else DEFAULT_IO_DEPTHS)))),
        sweep_tokens=ns.sweep_tokens,
        sweep=not ns.no_sweep,
        path=ns.path,
        keep=bool(ns.keep),
        cache=ns.cache,
        repeats=ns.repeats or (1 if quick else 3),
        model_size=ns.model_size or "tiny",
        recompute=not ns.no_recompute,
        device=ns.device,
        quick=quick,
        json=ns.json or f"bench/results/bench-{stamp}.json",
        plots=ns.plots or "bench/results",
        no_plots=bool(ns.no_plots),
        seed=int(ns.seed),
        log_level=ns.log_level,
        remote=getattr(ns, "remote", None) or "none",
        fio=not getattr(ns, "no_fio", False),
        overhead=not getattr(ns, "no_overhead", False),
        concurrency=not getattr(ns, "no_concurrency", False),
        cpu=not getattr(ns, "no_cpu", False),
    )
    if opts.repeats < 1:
        raise BenchError("--repeats must be >= 1")
    if not 1 <= opts.io_depth <= opts.window:
        raise BenchError(f"--io-depth must be in [1, W={opts.window}], got {opts.io_depth}")
    if opts.sweep_tokens is not None and opts.sweep_tokens not in opts.sizes:
        raise BenchError(f"--sweep-tokens {opts.sweep_tokens} must be one of --sizes {opts.sizes}")
    check_available(opts.remote)
    return opts
