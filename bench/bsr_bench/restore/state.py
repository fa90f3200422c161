"""One layout's saved state in a FileTier, and the engine measurements on it.

How it works: the largest requested state is saved once (random bytes, random token ids from
the seed); every smaller size is a prefix of it, so restoring ``n`` tokens reads exactly the
first ``n / chunk_tokens`` chunk objects, the files :meth:`SavedState.files` lists for the raw
read. Restores land in the same paged cache the state was saved from (pre-faulted, so the RSS
figures show staging, not the destination). Each engine gets a fresh :class:`~bsr.FileTier` on
the same directory; a BSR engine's W-slot staging buffer is touched once when the engine opens
(a server allocates it at start-up), and RSS growth is measured against the process RSS before
that engine existed.

With ``--remote`` the state is also saved into a second tier (a :class:`~bsr.MooncakeTier`, see
:mod:`.remote`) right after the FileTier save, and engines opened on that tier alone restore
from it; :meth:`SavedState.restore` takes ``files=None`` for them (no page cache to prepare).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
import xxhash

from bsr import (
    ChunkKey,
    FileTier,
    Namespace,
    PagedKVCache,
    PosixReader,
    RestoreEngine,
    SaveResult,
    Strategy,
    Tier,
    chunk_keys,
)

from ..common.layouts import NamedLayout
from ..common.memory import PeakRss, current_rss, release_free_memory
from ..common.pagecache import CacheMode, prepare
from ..common.stats import BenchError

BLOCK_TOKENS = 16


async def settled_rss(passes: int = 4) -> int:
    """RSS once buffers of closed engines are really gone (they can take a few gc passes and a
    turn of the event loop, e.g. while worker threads finish with a slot's last copy)."""
    rss = current_rss()
    for _ in range(passes):
        release_free_memory()
        await anyio.sleep(0.005)
        now = current_rss()
        if now >= rss - (1 << 20):
            return now
        rss = now
    return rss


@dataclass(frozen=True)
class RestoreSample:
    """One restore: timings, staging and memory, and what was read.

    ``total_s`` is the wall time of the ``engine.restore`` call (probe, window, commit); the
    other timings are the engine's own split of it.
    """

    total_s: float
    probe_s: float
    install_s: float
    settle_s: float
    commit_s: float
    rws_peak_bytes: int
    rss_growth_bytes: int
    rss_method: str
    bytes_read: int
    committed_tokens: int
    resident_before: float | None


@dataclass
class OpenEngine:
    engine: RestoreEngine
    tier: Tier
    rss_baseline: int
    window: int
    io_depth: int


class SavedState:
    """The saved state of one layout (see the module docstring)."""

    def __init__(
        self,
        named: NamedLayout,
        root: Path,
        max_tokens: int,
        *,
        seed: int,
        mode: CacheMode,
        device: str = "cpu",
    ) -> None:
        self.named = named
        self.layout = named.layout
        self.root = root / named.name
        self.mode = mode
        self.device = device
        ct = self.layout.chunk_tokens
        if ct % BLOCK_TOKENS:
            raise BenchError(f"layout {named.name}: chunk_tokens {ct} is not a multiple of 16")
        self.max_tokens = (max_tokens // ct) * ct
        if self.max_tokens == 0:
            raise BenchError(f"layout {named.name}: sizes are below one chunk ({ct} tokens)")
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, 2**31 - 1, size=self.max_tokens, dtype=np.int64)
        self.num_blocks = self.max_tokens // BLOCK_TOKENS
        self.block_ids = np.arange(self.num_blocks, dtype=np.int64)
        self.cache = PagedKVCache(self.layout, self.num_blocks, BLOCK_TOKENS, device=device)
        self.namespace = Namespace(model_id=f"bsr-bench/{named.name}")
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self._digest: dict[str, int] = {}
        self.save_result: SaveResult | None = None
        self.remote_save_result: SaveResult | None = None
        self.direct_active: bool | None = None
        #: the FileTier the state was saved through (it names the object files)
        self.file_tier: FileTier | None = None
        #: the io_uring read depth every engine's FileTier uses (chosen once, after the save)
        self.read_depth: int | None = None
        self.read_calibration: dict[str, Any] | None = None

    @property
    def capacity_bytes(self) -> int:
        return 2 * self.max_tokens * self.layout.token_bytes + (64 << 20)

    # ------------------------------------------------------------------ engines
    async def open_engine(
        self, window: int, io_depth: int, *, prefault: bool, tier: Tier | None = None
    ) -> OpenEngine:
        """An engine on a fresh FileTier over the state's directory, or on ``tier`` alone."""
        baseline = await settled_rss()
        if tier is None:
            tier = self.file_tier_fresh()
        engine = RestoreEngine(
            self.layout,
            [tier],
            window=window,
            io_depth=io_depth,
            namespace=self.namespace,
            # a whole-plan engine never touches its window: keep it out of the RSS figures
            prefault_staging=prefault,
        )
        await engine.open()
        return OpenEngine(engine, tier, baseline, window, io_depth)

    def file_tier_fresh(self) -> FileTier:
        """A FileTier over the state's directory with bsr's default reader (io_uring where it
        works) at the state's read depth (None before :meth:`calibrate`: the tier's default)."""
        return FileTier(
            self.root,
            self.capacity_bytes,
            direct_io=self.mode is CacheMode.DIRECT,
            read_depth=self.read_depth,
        )

    async def calibrate(self) -> dict[str, Any]:
        """Choose the read depth once for every engine of this state: what a FileTier opened
        over it picks (its calibration on open, O_DIRECT and >= 64 MiB; else its default)."""
        tier = self.file_tier_fresh()
        async with tier:
            cal = tier.read_calibration
            reader = tier.reader
        depth = getattr(reader, "depth", None)
        self.read_depth = depth if isinstance(depth, int) else None
        self.read_calibration = {
            "reader": getattr(reader, "name", type(reader).__name__),
            "depth": self.read_depth,
            **({} if cal is None else {"source": cal["source"], "bandwidth_Bps": {
                str(k): v for k, v in cal["bandwidth_Bps"].items()}}),
        }  # fmt: skip
        return self.read_calibration

    # ------------------------------------------------------------------ save
    def _digest_of(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.layout.groups:
            t = self.cache.tensor(g.name).contiguous()
            if t.device.type != "cpu":
                t = t.cpu()
            out[g.name] = int(xxhash.xxh3_64_intdigest(t.numpy().reshape(-1).data))
        return out

    def clear_cache(self) -> None:
        """Zero the destination (touches every page, so it is resident before any restore)."""
        for g in self.layout.groups:
            self.cache.tensor(g.name).zero_()

    async def save(self, remote: Tier | None = None) -> SaveResult:
        """Fill the cache with random bytes, save every chunk, remember its digest, clear it.

        With ``remote``, the same state is then saved into that tier too (an engine on it
        alone; ``remote_save_result``), before the cache is cleared.
        """
        for g in self.layout.groups:
            t = self.cache.tensor(g.name)
            flat = t.view(-1)
            n8 = flat.numel() // 8 * 8
            flat[:n8].view(torch.int64).random_(generator=self._gen)
            if n8 < flat.numel():
                flat[n8:].random_(0, 256, generator=self._gen)
        self._digest = self._digest_of()
        opened = await self.open_engine(8, 4, prefault=False)
        assert isinstance(opened.tier, FileTier)
        self.file_tier = opened.tier
        try:
            result = await opened.engine.save(self.tokens, self.cache, self.block_ids)
        finally:
            await opened.engine.aclose()
        if not result.ok or result.chunks != self.max_tokens // self.layout.chunk_tokens:
            raise BenchError(f"saving {self.named.name} failed: {result}")
        self.save_result = result
        if remote is not None:
            opened = await self.open_engine(8, 4, prefault=False, tier=remote)
            try:
                rres = await opened.engine.save(self.tokens, self.cache, self.block_ids)
            finally:
                await opened.engine.aclose()
            if not rres.ok or rres.chunks != self.max_tokens // self.layout.chunk_tokens:
                raise BenchError(f"saving {self.named.name} into {remote.name} failed: {rres}")
            self.remote_save_result = rres
        self.clear_cache()
        await self.calibrate()
        return result

    def verify(self) -> bool:
        """Whether the cache holds exactly the saved bytes (after a full-size restore)."""
        return self._digest_of() == self._digest

    def files(self, tokens: int) -> list[str]:
        """The object files a restore of the first ``tokens`` tokens reads, in chunk order."""
        keys = self.tier_keys(tokens)
        if self.file_tier is None:
            raise BenchError(f"{self.named.name}: the state is not saved yet")
        out = []
        for c, g in self.layout.needed_objects(len(keys)):
            p = self.file_tier.object_path(keys[c], g)
            if not p.is_file():
                raise BenchError(f"{self.named.name}: object file {p} is missing")
            out.append(str(p))
        return out

    def tier_keys(self, tokens: int) -> list[ChunkKey]:
        fp = self.namespace.fingerprint(self.layout)
        return list(chunk_keys(fp, self.tokens[:tokens], self.layout.chunk_tokens))

    # ------------------------------------------------------------------ measurements
    async def probe(self, opened: OpenEngine, tokens: int) -> float:
        t0 = time.perf_counter()
        probe = await opened.engine.lookup(self.tokens[:tokens])
        dt = time.perf_counter() - t0
        if probe.prefix_tokens != tokens:
            raise BenchError(
                f"{self.named.name}: probe found {probe.prefix_tokens} of {tokens} tokens"
            )
        return dt

    async def restore(
        self, opened: OpenEngine, tokens: int, strategy: Strategy, files: list[str] | None
    ) -> RestoreSample:
        """One restore; ``files`` (None for a remote tier) are put in the run's cache mode."""
        resident = None if files is None else prepare(self.mode, files)
        release_free_memory()
        with PeakRss() as peak:
            t0 = time.perf_counter()
            result = await opened.engine.restore(
                self.tokens[:tokens], self.cache, self.block_ids, strategy=strategy
            )
            wall = time.perf_counter() - t0
        if not result.committed or result.committed_tokens != tokens:
            raise BenchError(
                f"{self.named.name}: {strategy.value} restore of {tokens} tokens ended "
                f"{result.state} ({result.reason}): {list(result.errors)[:3]}"
            )
        reader = opened.tier.reader if isinstance(opened.tier, FileTier) else None
        if isinstance(reader, PosixReader):
            self.direct_active = reader.direct_active
            if self.mode is CacheMode.DIRECT and not reader.direct_active:
                raise BenchError(
                    f"{self.named.name}: the FileTier fell back from O_DIRECT to buffered reads; "
                    "rerun with --cache cold"
                )
        t = result.timings
        return RestoreSample(
            total_s=wall,
            probe_s=t.probe_s,
            install_s=t.install_s,
            settle_s=t.settle_s,
            commit_s=t.commit_s,
            rws_peak_bytes=result.rws_peak_bytes,
            rss_growth_bytes=max(0, peak.peak - opened.rss_baseline),
            rss_method=peak.method,
            bytes_read=result.bytes_read,
            committed_tokens=result.committed_tokens,
            resident_before=resident,
        )
