"""The ``bsr`` command: ``bsr bench`` (the main job), ``bsr spec diagram``, ``bsr demo``.

Heavy imports (torch, rich, transformers) happen inside the subcommand that needs them, so
``bsr --help`` and ``bsr spec diagram`` stay fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_DIAGRAM = "spec/request_lifecycle.mmd"


def _cmd_bench(ns: argparse.Namespace) -> int:
    from ._bench import run_from_namespace

    return run_from_namespace(ns)


def _cmd_spec_diagram(ns: argparse.Namespace) -> int:
    from .core._lifecycle import mermaid

    text = mermaid()
    if ns.write:
        out = Path(ns.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        current = out.read_text("utf-8") if out.is_file() else None
        if current == text:
            print(f"{out} is up to date")
        else:
            out.write_text(text, "utf-8")
            print(f"wrote {out}")
    elif ns.check:
        out = Path(ns.output)
        if not out.is_file() or out.read_text("utf-8") != text:
            print(
                f"{out} differs from the spec table; run `bsr spec diagram --write`",
                file=sys.stderr,
            )
            return 1
        print(f"{out} matches the spec table")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    import anyio

    from ._errors import BsrError

    try:
        anyio.run(_demo, ns.tokens, ns.window)
    except BsrError as exc:
        print(f"bsr demo: error: {exc}", file=sys.stderr)
        return 2
    return 0


async def _demo(num_tokens: int, window: int) -> None:
    """Save a Llama-3-8B-shaped KV state, evict it, probe it, restore it both ways."""
    import logging
    import tempfile

    import numpy as np
    import structlog
    import torch

    import bsr

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    layout = bsr.kv_layout(num_layers=32, num_kv_heads=8, head_dim=128)
    n = num_tokens // layout.chunk_tokens * layout.chunk_tokens
    if n == 0:
        raise bsr.ConfigError(f"--tokens must be at least one chunk ({layout.chunk_tokens})")
    tokens = np.random.default_rng(0).integers(0, 128_000, size=n)
    blocks = np.arange(n // 16)
    src = bsr.PagedKVCache(layout, num_blocks=len(blocks), block_tokens=16)
    src.tensor("kv").view(torch.int64).random_(generator=torch.Generator().manual_seed(0))
    mib = 1 << 20
    print(
        f"layout: llama3-8b KV, {layout.token_bytes} B/token, chunk {layout.chunk_bytes / mib:.0f}"
        f" MiB; state of {n} tokens = {n * layout.token_bytes / mib:.0f} MiB; W={window}"
    )
    with tempfile.TemporaryDirectory(prefix="bsr-demo-") as d:
        tier = bsr.FileTier(d, capacity_bytes=4 * n * layout.token_bytes + (64 << 20))
        engine = bsr.RestoreEngine(
            layout,
            [tier],
            window=window,
            io_depth=min(4, window),
            namespace=bsr.Namespace(model_id="demo/llama3-8b"),
        )
        async with engine:
            saved = await engine.save(tokens, src, blocks)
            print(
                f"save:    {saved.chunks} chunks in {saved.duration_s:.2f} s "
                f"(staging peak {saved.rws_peak_bytes / mib:.0f} MiB)"
            )
            probe = await engine.lookup(tokens)
            print(
                f"probe:   {probe.prefix_tokens} of {probe.num_tokens} tokens reusable, "
                f"{probe.duration_s * 1e3:.2f} ms, no data moved"
            )
            for strategy in ("bounded", "whole_plan"):
                dst = bsr.PagedKVCache(layout, num_blocks=len(blocks), block_tokens=16)
                r = await engine.restore(tokens, dst, blocks, strategy=strategy)
                same = torch.equal(dst.tensor("kv"), src.tensor("kv"))
                print(
                    f"restore ({strategy}): {r.state} {r.committed_tokens} tokens in "
                    f"{r.timings.total_s:.2f} s, RWS {r.rws_peak_bytes / mib:.0f} MiB, "
                    f"bytes identical: {same}"
                )
                del dst
            miss = await engine.lookup(np.arange(n))
            print(f"probe of other tokens: {miss.prefix_tokens} tokens reusable (a miss)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="bsr",
        description="Bounded-State Restoration: restore evicted KV-cache state through a bounded "
        "staging window.",
    )
    parser.add_argument("--version", action="version", version=f"bsr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="benchmark BSR restore vs whole-plan restore, raw reads and recompute",
        description="Save states of growing size, restore them with BSR (bounded window) and the "
        "whole-plan baseline, read the same files raw, prefill the same tokens, and write one "
        "JSON document plus plots (see bench/README.md).",
    )
    from ._bench.options import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    spec = sub.add_parser("spec", help="the formal request lifecycle")
    spec_sub = spec.add_subparsers(dest="spec_command", metavar="SPEC_COMMAND")
    diagram = spec_sub.add_parser(
        "diagram", help="print the mermaid state diagram generated from the lifecycle table"
    )
    mode = diagram.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write it to --output")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 unless --output matches the table"
    )
    diagram.add_argument(
        "--output",
        default=DEFAULT_DIAGRAM,
        help=f"file for --write/--check (default {DEFAULT_DIAGRAM})",
    )
    diagram.set_defaults(func=_cmd_spec_diagram)
    spec.set_defaults(func=lambda ns: _missing(spec))

    demo = sub.add_parser("demo", help="a short save / probe / restore demo in a temp directory")
    demo.add_argument("--tokens", type=int, default=4096, help="tokens to save and restore")
    demo.add_argument("--window", "-W", type=int, default=4, help="staging slots W")
    demo.set_defaults(func=_cmd_demo)
    return parser


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``bsr``."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    code: int = ns.func(ns)
    return code


if __name__ == "__main__":
    sys.exit(main())
