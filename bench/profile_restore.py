#!/usr/bin/env python3
"""A restore loop to profile: ``pyinstrument bench/profile_restore.py`` (see bench/README.md).

How it works: one single-group layout of ``--chunk-bytes`` per chunk, ``--chunks`` chunks saved
into a :class:`bsr.HostTier` (no disk, so the profile shows the engine, not the device), then
``--repeats`` restores of the whole prefix into the same paged cache; tokens are a numpy array
(``--tokens-as list`` to include the conversion of a Python list). Only the restore loop runs
under the profiler when ``--pyinstrument`` is given; under ``py-spy`` the save shows too (it is
short). Prints the median restore time and time per chunk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

import bsr


async def run(ns: argparse.Namespace) -> str | None:
    """The restore loop; the pyinstrument text report when profiling."""
    ct = 256
    layout = bsr.StateLayout(ct, (bsr.StateGroup("kv", 1, ns.chunk_bytes // ct, dtype="uint8"),))
    n = ns.chunks * ct
    tokens: Any = np.random.default_rng(0).integers(0, 2**31 - 1, size=n, dtype=np.int64)
    if ns.tokens_as == "list":
        tokens = tokens.tolist()
    blocks = np.arange(n // 16, dtype=np.int64)
    cache = bsr.PagedKVCache(layout, len(blocks), 16)
    cache.tensor("kv").view(-1)[: n * (ns.chunk_bytes // ct) // 8 * 8].view(torch.int64).random_()
    engine = bsr.RestoreEngine(
        layout,
        [bsr.HostTier(capacity_bytes=2 * ns.chunks * ns.chunk_bytes + (64 << 20))],
        window=ns.window,
        io_depth=ns.io_depth,
        namespace=bsr.Namespace("profile"),
    )
    profiler = None
    if ns.pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005, async_mode="enabled")
    samples = []
    async with engine:
        await engine.save(tokens, cache, blocks)
        await engine.restore(tokens, cache, blocks)  # warm-up
        if profiler is not None:
            profiler.start()
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            result = await engine.restore(tokens, cache, blocks)
            samples.append(time.perf_counter() - t0)
            if not result.committed:
                raise SystemExit(f"restore ended {result.state} ({result.reason})")
        if profiler is not None:
            profiler.stop()
    med = statistics.median(samples)
    print(
        f"{ns.chunks} chunks of {ns.chunk_bytes} B: restore median {med * 1e3:.2f} ms, "
        f"{med / ns.chunks * 1e6:.1f} us per chunk ({bsr.__file__})"
    )
    if profiler is None:
        return None
    return str(profiler.output_text(unicode=False, color=False, show_all=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk-bytes", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--window", "-W", type=int, default=8)
    p.add_argument("--io-depth", type=int, default=4)
    p.add_argument("--tokens-as", choices=("numpy", "list"), default="numpy")
    p.add_argument(
        "--pyinstrument",
        default=None,
        metavar="PATH|-",
        help="profile the restore loop with pyinstrument, text report to PATH (- for stdout)",
    )
    ns = p.parse_args(argv)
    text = anyio.run(run, ns)
    if text is not None and ns.pyinstrument == "-":
        print(text)
    elif text is not None:
        Path(ns.pyinstrument).write_text(text)
        print(f"profile: {ns.pyinstrument}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
