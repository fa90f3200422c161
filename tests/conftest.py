"""Shared fixtures: small layouts, filled source caches, engines over real tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

import bsr


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs() -> Iterator[None]:
    """Keep structlog quiet in tests (warnings still print)."""
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.reset_defaults()


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


@pytest.fixture
def layout() -> bsr.StateLayout:
    return two_group_layout()


@pytest.fixture
def l2_path(tmp_path: Path) -> Path:
    return tmp_path / "l2"
