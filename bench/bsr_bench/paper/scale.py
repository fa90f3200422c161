"""States too large for memory: saved chunk by chunk, restored into a file-backed destination.

Where it runs: the bench process (CPU), on a :class:`~bsr.FileTier` directory; used by the
paper-scale benches (:mod:`.ladder`, :mod:`.tp`).

How it works: :class:`ChunkedState` never holds the state in memory. It fills the destination
``ring_chunks`` chunks at a time with seeded random bytes (one generator per chunk), saves the
prefix up to the last filled chunk (objects already stored are skipped by the engine, so each
step writes only its own chunks, still in the page cache) and keeps an xxh3 digest of every
chunk. :class:`Destination` is the cache a restore lands in: resident
memory, or a sparse file per group mapped with ``torch.from_file(shared=True)`` so only the pages
being written are resident (the kernel writes them back). :meth:`Destination.fresh` truncates the
files, so every restore starts from zeros and a digest match proves the restore wrote the bytes.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
import xxhash

from bsr import FileTier, Namespace, PagedKVCache, RestoreEngine

from ..common.layouts import NamedLayout
from ..common.stats import BenchError

BLOCK_TOKENS = 16


class DestinationKind(str, enum.Enum):
    """Where restored bytes land."""

    #: a resident CPU tensor per group (the default bench's destination)
    MEMORY = "memory"
    #: a sparse file per group, memory-mapped (shared): the state need not fit in memory
    FILE = "file"


def chunk_digest(cache: PagedKVCache, ids: torch.Tensor, chunk: int) -> int:
    """xxh3 over every group's bytes of one chunk, in block-table order."""
    blocks = cache.chunk_blocks(ids, chunk)
    h = xxhash.xxh3_64()
    for g in cache.layout.groups:
        h.update(cache.tensor(g.name)[:, blocks].contiguous().numpy().reshape(-1).data)
    return int(h.intdigest())


def _fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill ``t`` in place (a block-range view is not contiguous: fill it layer by layer)."""
    if not t.is_contiguous():
        for sub in t:
            _fill_random(sub, gen)
        return
    flat = t.view(-1)
    n8 = flat.numel() // 8 * 8 if flat.storage_offset() % 8 == 0 else 0
    if n8:
        flat[:n8].view(torch.int64).random_(generator=gen)
    if n8 < flat.numel():
        flat[n8:].random_(0, 256, generator=gen)


class SoloRank:
    """Rank ``rank`` of ``world_size`` that agrees with itself only (no collective).

    Saves need no agreement, and a rank restoring its shard alone with it is the baseline the
    TP bench subtracts to measure what agreement costs.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    async def agree_min(self, value: int) -> int:
        await anyio.lowlevel.checkpoint()
        return value

    async def agree_all(self, value: bool) -> bool:
        await anyio.lowlevel.checkpoint()
        return value


class ChunkedState:
    """One layout's state of ``max_tokens`` tokens in a FileTier (see the module docstring)."""

    def __init__(
        self,
        named: NamedLayout,
        root: Path,
        max_tokens: int,
        *,
        seed: int,
        ring_chunks: int = 64,
        direct_io: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.named = named
        self.layout = named.layout
        ct = self.layout.chunk_tokens
        if ct % BLOCK_TOKENS:
            raise BenchError(f"layout {named.name}: chunk_tokens {ct} is not a multiple of 16")
        self.chunks = max_tokens // ct
        if self.chunks < 1:
            raise BenchError(f"layout {named.name}: {max_tokens} tokens is below one chunk")
        self.max_tokens = self.chunks * ct
        self.blocks_per_chunk = ct // BLOCK_TOKENS
        self.num_blocks = self.chunks * self.blocks_per_chunk
        self.ring_chunks = max(1, min(ring_chunks, self.chunks))
        self.seed = seed
        self.direct_io = direct_io
        self.root = root / named.name
        # the same token ids on every rank (TP ranks hold shards of one conversation's state)
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, 2**31 - 1, size=self.max_tokens, dtype=np.int64)
        self.namespace = Namespace(
            model_id=f"bsr-bench/{named.name}", tp_rank=tp_rank, tp_size=tp_size
        )
        self.rank_seed = seed * 1_000_003 + tp_rank * 7919
        self.digests: list[int] = []
        self.save_s = 0.0
        self.stored_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return 2 * self.max_tokens * self.layout.token_bytes + (64 << 20)

    def state_bytes(self, tokens: int) -> int:
        return tokens // self.layout.chunk_tokens * self.layout.chunk_bytes

    def plan_bytes(self, tokens: int) -> int:
        """What a whole-plan restore of ``tokens`` tokens stages (one slot per chunk)."""
        return tokens // self.layout.chunk_tokens * self.layout.slot_bytes

    def tier(self, *, name: str = "file") -> FileTier:
        """A fresh FileTier over the stored state (O_DIRECT reads unless ``direct_io=False``)."""
        return FileTier(
            self.root, self.capacity_bytes, name=name, reader="posix", direct_io=self.direct_io
        )

    def identity_ids(self, tokens: int | None = None) -> torch.Tensor:
        n = self.num_blocks if tokens is None else tokens // BLOCK_TOKENS
        return torch.arange(n, dtype=torch.int64)

    async def save(self, cache: PagedKVCache) -> dict[str, Any]:
        """Fill ``cache`` (identity block table, e.g. a :class:`Destination`) ``ring_chunks`` at a
        time and save each step; returns what the JSON records of the save.

        Each step saves the whole prefix so far: the engine skips objects already stored, so a
        step reads and writes only its own chunks while they are still in the page cache.
        """
        t0 = time.perf_counter()
        lay, step, bpc = self.layout, self.ring_chunks, self.blocks_per_chunk
        if cache.num_blocks < self.num_blocks:
            raise BenchError(
                f"{self.named.name}: the save cache has {cache.num_blocks} blocks, "
                f"the state needs {self.num_blocks}"
            )
        engine = RestoreEngine(
            lay,
            [self.tier()],
            window=min(8, step),
            io_depth=min(4, step),
            namespace=self.namespace,
            coordinator=SoloRank(self.namespace.tp_rank, self.namespace.tp_size),
            prefault_staging=False,
        )
        ids = self.identity_ids()
        self.digests = []
        written = 0
        async with engine:
            for start in range(0, self.chunks, step):
                end = min(self.chunks, start + step)
                for c in range(start, end):
                    gen = torch.Generator().manual_seed(self.rank_seed + c)
                    for g in lay.groups:
                        _fill_random(cache.tensor(g.name)[:, c * bpc : (c + 1) * bpc], gen)
                    self.digests.append(chunk_digest(cache, ids, c))
                n_tok = end * lay.chunk_tokens
                result = await engine.save(self.tokens[:n_tok], cache, ids[: n_tok // BLOCK_TOKENS])
                new = sum(result.objects_written.values())
                expected = len(lay.needed_objects(end)) - len(lay.needed_objects(start))
                if not result.ok or new != expected:
                    raise BenchError(
                        f"{self.named.name}: saving chunks {start}..{end - 1} failed: {result}"
                    )
                written += sum(result.bytes_written.values())
            probe = await engine.lookup(self.tokens)
        if probe.prefix_tokens != self.max_tokens:
            raise BenchError(
                f"{self.named.name}: probe after save found {probe.prefix_tokens} of "
                f"{self.max_tokens} tokens"
            )
        self.save_s = time.perf_counter() - t0
        self.stored_bytes = _tree_bytes(self.root)
        return {
            "tokens": self.max_tokens,
            "chunks": self.chunks,
            "payload_bytes": written,
            "stored_bytes": self.stored_bytes,
            "seconds": round(self.save_s, 3),
            "step_chunks": step,
        }

    def verify(
        self, cache: PagedKVCache, tokens: int, *, sample: int | None = None
    ) -> dict[str, Any]:
        """Compare the destination's chunks of a ``tokens``-token restore with the saved digests.

        Args:
            sample: check this many chunks spread over the prefix (first and last included);
                ``None`` checks every chunk.
        """
        n = tokens // self.layout.chunk_tokens
        if sample is None or sample >= n:
            which = list(range(n))
        else:
            which = sorted({round(i * (n - 1) / max(1, sample - 1)) for i in range(sample)})
        ids = self.identity_ids(tokens)
        bad = [c for c in which if chunk_digest(cache, ids, c) != self.digests[c]]
        return {"chunks_checked": len(which), "chunks": n, "mismatched": bad[:8], "ok": not bad}


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


class Destination:
    """The paged cache restores land in: resident memory or one sparse mapped file per group."""

    def __init__(
        self, named: NamedLayout, num_blocks: int, kind: DestinationKind, directory: Path
    ) -> None:
        self.layout = named.layout
        self.num_blocks = num_blocks
        self.kind = kind
        self.directory = directory
        self._cache: PagedKVCache | None = None
        if kind is DestinationKind.FILE:
            directory.mkdir(parents=True, exist_ok=True)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * BLOCK_TOKENS * self.layout.token_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "bytes": self.nbytes,
            "path": str(self.directory) if self.kind is DestinationKind.FILE else None,
            "note": (
                "file-backed destination: a sparse file per group mapped with "
                "torch.from_file(shared=True); only pages being written are resident"
                if self.kind is DestinationKind.FILE
                else "resident CPU tensors"
            ),
        }

    def fresh(self) -> PagedKVCache:
        """An all-zero destination (files truncated and mapped again)."""
        self._cache = None
        if self.kind is DestinationKind.MEMORY:
            cache = PagedKVCache(self.layout, self.num_blocks, BLOCK_TOKENS)
        else:
            tensors: dict[str, torch.Tensor] = {}
            for g in self.layout.groups:
                n = g.num_layers * self.num_blocks * BLOCK_TOKENS * g.token_bytes
                path = self.directory / f"{g.name}.bin"
                with open(path, "wb") as f:  # truncates: old pages, dirty or not, are dropped
                    f.truncate(n)
                t = torch.from_file(str(path), shared=True, size=n, dtype=torch.uint8)
                tensors[g.name] = t.view(g.num_layers, self.num_blocks, BLOCK_TOKENS, g.token_bytes)
            cache = PagedKVCache(self.layout, self.num_blocks, BLOCK_TOKENS, tensors=tensors)
        self._cache = cache
        return cache

    def close(self) -> None:
        self._cache = None
        if self.kind is DestinationKind.FILE:
            for g in self.layout.groups:
                (self.directory / f"{g.name}.bin").unlink(missing_ok=True)


class AnonPeak:
    """Peak anonymous RSS (``RssAnon``) inside a block, sampled every ``interval_s``.

    A file-backed destination's written pages count in total RSS; anonymous memory is what a
    staging buffer (or a whole-plan buffer) costs, so this is what the paper-scale benches report.
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.start = self.peak = anon_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bsr-anon-peak", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, anon_rss())

    def __enter__(self) -> AnonPeak:
        self.start = self.peak = anon_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss())

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.start)


def anon_rss() -> int:
    """This process's anonymous resident memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def choose_destination(state_bytes: int, available: int, asked: str) -> DestinationKind:
    """``asked`` is "memory", "file" or "auto" (file once the state exceeds a quarter of RAM)."""
    if asked == "auto":
        return DestinationKind.FILE if state_bytes > available // 4 else DestinationKind.MEMORY
    return DestinationKind(asked)
