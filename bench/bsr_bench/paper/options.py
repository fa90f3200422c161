"""Flags and options of the paper-scale benches: ``bsr bench --l1-ladder`` and ``--tp N``.

The two share one argument group (``--ladder-sizes``, ``--destination``, ...); each resolves its
own options (:func:`resolve_ladder` here, :func:`.tp.resolve_tp`).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..common.stats import BenchError

GIB = 1 << 30
MIB = 1 << 20
#: the paper's states: 1.956 / 7.823 / 15.646 GiB of dsv4-flash per rank
DEFAULT_LADDER_TOKENS = (32768, 131072, 262144)
DEFAULT_BUDGETS = tuple(int(g * GIB) for g in (0.25, 0.5, 1, 2, 4, 8, 16))
_UNITS = {"b": 1, "kib": 1 << 10, "mib": MIB, "gib": GIB, "k": 1 << 10, "m": MIB, "g": GIB}


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"0.25,0.5,1"`` (GiB) or with units ``"64MiB,1GiB,4096B"`` -> bytes, ascending."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low = part.lower()
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if low.endswith(u)), None)
        num = low[: -len(unit)] if unit else low
        try:
            value = float(num) * (_UNITS[unit] if unit else GIB)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected budgets like 0.25,1,16 (GiB) or 64MiB,1GiB, got {part!r}"
            ) from None
        if not math.isfinite(value) or value < 1:
            raise argparse.ArgumentTypeError(f"a budget must be at least 1 byte, got {part!r}")
        out.append(int(value))
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one budget, got {text!r}")
    return tuple(sorted(set(out)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The paper-scale flags: ``--l1-ladder``, ``--tp`` and what they read."""
    g = p.add_argument_group("paper scale (--l1-ladder, --tp)")
    g.add_argument(
        "--l1-ladder",
        action="store_true",
        help="instead of the default bench: restore states of growing size whole-plan and BSR "
        "under host staging budgets (see bench/README.md, 'Paper scale')",
    )
    g.add_argument(
        "--ladder-sizes",
        default=None,
        help="state sizes in tokens for --l1-ladder / --tp (default 32768,131072,262144: the "
        "paper's 1.956/7.823/15.646 GiB of dsv4-flash; 524288 is its 31.28 GiB point)",
    )
    g.add_argument(
        "--ladder-budgets",
        type=parse_budgets,
        default=None,
        help="host staging budgets, GiB or with units (default 0.25,0.5,1,2,4,8,16)",
    )
    g.add_argument(
        "--ladder-max-window",
        type=int,
        default=32,
        help="BSR uses W = min(this, budget // slot_bytes) (default 32, as in the paper)",
    )
    g.add_argument(
        "--destination",
        choices=("auto", "memory", "file"),
        default="auto",
        help="destination of --l1-ladder / --tp restores: resident memory, a file-backed "
        "(mmap) cache, or auto: file once the state exceeds a quarter of memory",
    )
    g.add_argument(
        "--lmcache",
        choices=("auto", "off", "require"),
        default="auto",
        help="--l1-ladder: also run LMCache 0.5.6's whole-plan retrieve side by side from "
        ".venv-lmcache (make lmcache-venv); auto skips it with a note when the venv is absent",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="instead of the default bench: N ranks (processes, gloo) restore their shards and "
        "agree on prefix and commit; reports per-rank RWS, agreement overhead and a fault case",
    )


@dataclass(frozen=True)
class LadderOptions:
    """Resolved options of one ``--l1-ladder`` run (recorded in the JSON under ``args``)."""

    layout: str
    sizes: tuple[int, ...]
    budgets: tuple[int, ...]
    max_window: int
    io_depth: int
    path: str | None
    keep: bool
    destination: str
    direct_io: bool
    lmcache: str
    seed: int
    json: str
    plots: str
    no_plots: bool
    quick: bool

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x.replace("_", "")) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchError(
            f"--ladder-sizes: expected comma-separated integers, got {text!r}"
        ) from None
    if not vals or min(vals) < 1:
        raise BenchError(f"--ladder-sizes: expected positive integers, got {text!r}")
    return tuple(sorted(set(vals)))


def resolve_ladder(ns: argparse.Namespace) -> LadderOptions:
    """Options of a ladder run from the parsed ``bsr bench`` flags."""
    quick = bool(ns.quick)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    layouts = ns.layout or ["dsv4-flash"]
    if len(layouts) != 1:
        raise BenchError("--l1-ladder restores one layout; pass --layout once")
    sizes = (
        _ints(ns.ladder_sizes)
        if ns.ladder_sizes
        else ((1024, 4096) if quick else DEFAULT_LADDER_TOKENS)
    )
    budgets = ns.ladder_budgets or (
        tuple(int(x * MIB) for x in (8, 32, 64)) if quick else DEFAULT_BUDGETS
    )
    if ns.ladder_max_window < 1:
        raise BenchError(f"--ladder-max-window must be >= 1, got {ns.ladder_max_window}")
    return LadderOptions(
        layout=layouts[0],
        sizes=sizes,
        budgets=budgets,
        max_window=ns.ladder_max_window,
        io_depth=ns.io_depth or 8,
        path=ns.path,
        keep=bool(ns.keep),
        destination=ns.destination,
        direct_io=ns.cache in ("auto", "direct"),
        lmcache=ns.lmcache,
        seed=int(ns.seed),
        quick=quick,
        json=ns.json or f"bench/results/ladder-{stamp}.json",
        plots=ns.plots or "bench/results",
        no_plots=bool(ns.no_plots),
    )
