"""Shared test helpers: small layouts, filled source caches, the ``bsr`` command.

Import with ``from support.helpers import ...`` (``tests/`` is on pytest's ``pythonpath``); the
engine factory is :func:`support.engines.make_engine`.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import subprocess
import sys
from typing import Any

import torch

import bsr


def two_group_layout(chunk_tokens: int = 32) -> bsr.StateLayout:
    """Full-attention KV plus a sliding-window group; every group chunk is 4 KiB aligned."""
    return bsr.StateLayout(
        chunk_tokens=chunk_tokens,
        groups=(
            bsr.StateGroup("kv", num_layers=2, token_bytes=256),
            bsr.StateGroup("swa", num_layers=1, token_bytes=128, window_tokens=chunk_tokens + 8),
        ),
    )


def filled_cache(
    layout: bsr.StateLayout, num_blocks: int, block_tokens: int, seed: int = 0
) -> bsr.PagedKVCache:
    cache = bsr.PagedKVCache(layout, num_blocks, block_tokens)
    gen = torch.Generator().manual_seed(seed)
    for g in layout.groups:
        t = cache.tensor(g.name)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return cache


def shuffled_blocks(num_blocks: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:n]


def blocks_equal(
    layout: bsr.StateLayout,
    src: bsr.PagedKVCache,
    src_ids: torch.Tensor,
    dst: bsr.PagedKVCache,
    dst_ids: torch.Tensor,
    prefix_chunks: int,
) -> bool:
    """Whether every block a prefix needs (per group, window-aware) matches."""
    bpc = layout.chunk_tokens // src.block_tokens
    for g in layout.groups:
        for c in layout.needed_chunks(g.name, prefix_chunks):
            a = src.tensor(g.name)[:, src_ids[c * bpc : (c + 1) * bpc]]
            b = dst.tensor(g.name)[:, dst_ids[c * bpc : (c + 1) * bpc]]
            if not torch.equal(a, b):
                return False
    return True


def tokens_for(n_tokens: int, seed: int = 1) -> list[int]:
    """Deterministic pseudo-random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n_tokens,), generator=gen).tolist()


# ---------------------------------------------------------------------- the bsr command
def bsr_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bsr ARGS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "bsr", *args], capture_output=True, text=True, timeout=120
    )


def bsr_main(*args: str) -> subprocess.CompletedProcess[str]:
    """The same command through ``bsr.cli.main`` in this process."""
    from bsr.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def retarget_stream_read(r: Any, how: str, stall_fd: int) -> None:
    """Make a streamed object read (``UringReader.stream``'s ``StreamRead``, given to its
    ``_stream_pieces``) read something else: ``"stall"`` a duplicate of ``stall_fd`` (the read
    end of an empty pipe), its header's request only, which stalls until withdrawn;
    ``"ebadf"`` a write-only descriptor of its own file (``EBADF`` from the kernel). The tier
    closes ``r.fd`` when the object ends."""
    if how == "stall":
        new, r.size = os.dup(stall_fd), 4096
    elif how == "ebadf":
        new = os.open(f"/proc/self/fd/{r.fd}", os.O_WRONLY)
    else:
        raise ValueError(f"unknown trap {how!r}")
    os.close(r.fd)
    r.fd = new


def open_fds() -> int:
    """How many file descriptors this process holds now, garbage collected first (an object an
    earlier test dropped closes its descriptors whenever it is collected, which moved a count
    taken around one call: seen once as 160 -> 154 with nothing leaked)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))
