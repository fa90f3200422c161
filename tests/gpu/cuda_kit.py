"""Shared pieces of the ``cuda`` tests: a layout, a filled source, byte comparisons, and
destination caches that delay or fail the copies bsr enqueues on its CUDA side stream.

The reference of every comparison is the source cache the state was saved from (CPU tensors),
never anything bsr computed: a restored block must hold the source block's bytes, and a block the
restore was not given must still hold zeros.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

import bsr
from support.engines import make_engine
from support.helpers import shuffled_blocks, tokens_for

BLOCK = 16
#: three groups: full KV (bf16), a sliding window (needs only its last chunks) and a uint8 index;
#: 64-token chunks, every group chunk a multiple of 4 KiB, slot = 176 KiB
LAYOUT = bsr.StateLayout(
    chunk_tokens=64,
    groups=(
        bsr.StateGroup("kv", num_layers=4, token_bytes=512),
        bsr.StateGroup("swa", num_layers=2, token_bytes=256, window_tokens=64 + 8),
        bsr.StateGroup("idx", num_layers=4, token_bytes=64, dtype="uint8"),
    ),
)


class Case:
    """A saved state: ``chunks`` full chunks of random bytes in a CPU cache, with block tables.

    ``src_ids`` and ``dst_ids`` are shuffled, so chunks land in non-consecutive blocks on both
    sides and the destination has blocks no table names (they must stay zero).
    """

    def __init__(self, chunks: int, *, seed: int = 0, layout: bsr.StateLayout = LAYOUT) -> None:
        self.layout = layout
        self.chunks = chunks
        self.n_tokens = chunks * layout.chunk_tokens
        self.num_blocks = 2 * self.n_tokens // BLOCK
        used = self.n_tokens // BLOCK
        self.tokens = tokens_for(self.n_tokens, seed=seed + 1)
        self.src = bsr.PagedKVCache(layout, self.num_blocks, BLOCK)
        gen = torch.Generator().manual_seed(seed)
        for g in layout.groups:
            t = self.src.tensor(g.name)
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        self.src_ids = shuffled_blocks(self.num_blocks, used, seed=seed + 2)
        self.dst_ids = shuffled_blocks(self.num_blocks, used, seed=seed + 3)

    def engine(self, tiers: list[bsr.Tier], **kw: Any) -> bsr.RestoreEngine:
        return make_engine(self.layout, tiers, model_id="cuda-tests", **kw)

    def destination(self, device: str, cls: type[bsr.PagedKVCache] = bsr.PagedKVCache) -> Any:
        return cls(self.layout, self.num_blocks, BLOCK, device=device)

    def source_chunk(self, group: str, chunk: int) -> torch.Tensor:
        """The bytes of ``chunk`` of ``group`` as stored: ``[layers, chunk blocks, block, row]``."""
        bpc = self.layout.chunk_tokens // BLOCK
        blocks = self.src_ids[chunk * bpc : (chunk + 1) * bpc]
        return self.src.tensor(group)[:, blocks]

    def mismatches(self, dst: bsr.PagedKVCache, prefix_chunks: int) -> list[tuple[str, int]]:
        """The (group, chunk) pairs of a ``prefix_chunks`` prefix whose bytes in ``dst`` differ
        from the source (read back on the default stream, after a device synchronize)."""
        if dst.device.type == "cuda":
            torch.cuda.synchronize(dst.device)
        bpc = self.layout.chunk_tokens // BLOCK
        bad = []
        for g in self.layout.groups:
            for c in self.layout.needed_chunks(g.name, prefix_chunks):
                got = chunk_bytes(dst, g.name, self.dst_ids[c * bpc : (c + 1) * bpc])
                if not torch.equal(got, self.source_chunk(g.name, c)):
                    bad.append((g.name, c))
        return bad

    def stray_writes(self, dst: bsr.PagedKVCache) -> int:
        """Nonzero bytes in destination blocks that no block table entry names."""
        others = sorted(set(range(self.num_blocks)) - set(self.dst_ids.tolist()))
        idx = torch.tensor(others, dtype=torch.int64)
        return sum(
            int(torch.count_nonzero(chunk_bytes(dst, g.name, idx))) for g in self.layout.groups
        )


def chunk_bytes(cache: bsr.PagedKVCache, group: str, blocks: torch.Tensor) -> torch.Tensor:
    """``[layers, len(blocks), block_tokens, token_bytes]`` uint8 on the CPU, for stacked and
    per-layer caches alike."""
    layers = cache.layers(group)
    idx = blocks.to(layers[0].device)
    return torch.stack([layer[idx] for layer in layers]).cpu()


def _on_side_stream(device: torch.device) -> bool:
    return bool(torch.cuda.current_stream(device) != torch.cuda.default_stream(device))


class SlowSideStreamCache(bsr.PagedKVCache):
    """A CUDA destination whose copies on bsr's side stream each start behind a spin kernel.

    bsr's CUDA installer looks the destination tensor up (``tensor()``) inside its side-stream
    context just before it enqueues the host-to-device copy; a ``torch.cuda._sleep`` enqueued
    there holds that copy back on the GPU for ``cycles`` clock cycles (real device work, no
    mock). A staging slot given back before its copy's event completed would be refilled by the
    next read while the copy still waits, and the wrong bytes would land.
    """

    cycles = 0

    def tensor(self, group: str) -> torch.Tensor:
        if self.cycles and _on_side_stream(self.device):
            torch.cuda._sleep(self.cycles)  # type: ignore[no-untyped-call]
        return super().tensor(group)


class FailingInstallCache(bsr.PagedKVCache):
    """A CUDA destination whose ``fail_at``-th side-stream install raises a CUDA-style error.

    Stands for a copy that cannot be enqueued (e.g. out of memory for the device-side staging
    tensor): the restore must end Invalidated (install_failed) and give every slot back, as on
    the host path, not raise.
    """

    fail_at = 3

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._calls = itertools.count(1)  # next() is atomic: installs run in worker threads

    def tensor(self, group: str) -> torch.Tensor:
        if _on_side_stream(self.device) and next(self._calls) == self.fail_at:
            raise RuntimeError("CUDA error: out of memory (injected by the test)")
        return super().tensor(group)


def staging_settled(engine: bsr.RestoreEngine) -> tuple[bool, Any]:
    """Whether every slot of the engine's pool is back (none held, parked or awaited)."""
    s = engine.statistics().staging
    return s.in_use == 0 and s.parked == 0 and s.waiting == 0 and s.acquired == s.released, s
