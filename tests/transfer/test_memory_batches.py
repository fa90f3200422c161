"""A restore from memory-speed tiers into a host cache uses at most ``memory_workers`` worker
threads at once (that work is memory-bandwidth bound; see ``WindowPipeline.run``), while the
restored bytes stay exactly the saved ones.

Real HostTiers and caches. The observation is the tier's own lending call
(``read_many_blocking``, one per worker-thread batch): each call counts itself in and waits
for a partner before it lends, so calls that may overlap do overlap, and the peak count is the
number of batches the pipeline let run together.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import bsr
from bsr.transfer import _pipeline as pipeline
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for

#: 512 KiB chunks: over the inline limit, so every batch is a worker-thread call
LAYOUT = bsr.StateLayout(256, (bsr.StateGroup("kv", 1, 2048, dtype="uint8"),))
CT = LAYOUT.chunk_tokens
BLOCK = 16
HOST = [{"kind": "host", "capacity_bytes": "1MiB"}]


class PartneredHost(bsr.HostTier):
    """A HostTier whose batch lending waits (up to ``wait_s``) until ``partners`` batches are
    inside it at once, and records the most that ever were."""

    def __init__(self, partners: int, wait_s: float) -> None:
        super().__init__(capacity_bytes=1 << 28)
        self.partners = partners
        self.wait_s = wait_s
        self.inside = 0
        self.peak = 0
        self.calls = 0
        self._cond = threading.Condition()

    def read_many_blocking(self, begin: Any, end: Any, ahead: int, *, lend: bool = False) -> None:
        with self._cond:
            self.inside += 1
            self.calls += 1
            self.peak = max(self.peak, self.inside)
            self._cond.notify_all()
            # the peak, not the count inside: once partners met, every waiter goes on
            self._cond.wait_for(lambda: self.peak >= self.partners, timeout=self.wait_s)
        try:
            super().read_many_blocking(begin, end, ahead, lend=lend)
        finally:
            with self._cond:
                self.inside -= 1


async def _save_and_restore(
    tier: bsr.HostTier,
    chunks: int,
    below: bsr.Tier | None = None,
    layout: bsr.StateLayout = LAYOUT,
    **engine: Any,
) -> None:
    """Save ``chunks`` chunks (through to ``below`` too, when given), restore them, check the
    bytes and that the tier keeps nothing pinned. The engine has W=8 and io_depth 4 unless
    ``engine`` says otherwise."""
    toks = tokens_for(chunks * CT)
    ids = torch.arange(chunks * CT // BLOCK)
    src = filled_cache(layout, len(ids), BLOCK)
    tiers: list[bsr.Tier] = [tier] if below is None else [tier, below]
    engine = {"window": 8, "io_depth": 4, **engine}
    async with make_engine(layout, tiers, **engine) as eng:
        assert (await eng.save(toks, src, ids)).ok
        dst = bsr.PagedKVCache(layout, len(ids), BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed and r.committed_tokens == chunks * CT
        assert blocks_equal(layout, src, ids, dst, ids, chunks)
        assert tier._index.statistics().pinned == 0


async def _restore_peak(
    tier: PartneredHost, chunks: int, below: bsr.Tier | None = None, **engine: Any
) -> int:
    """:func:`_save_and_restore`; the most batches the tier lent at once."""
    await _save_and_restore(tier, chunks, below, **engine)
    return tier.peak


@pytest.mark.parametrize("chunks", [3, 8, 17])
@pytest.mark.anyio
async def test_by_default_one_memory_batch_runs_at_a_time(chunks: int) -> None:
    """io_depth 4 would allow four worker threads; the default memory_workers=1 allows one. A
    lone batch waits briefly for a partner that must never come."""
    tier = PartneredHost(partners=2, wait_s=0.05)
    assert await _restore_peak(tier, chunks) == 1
    assert tier.calls >= 1


@pytest.mark.parametrize(("workers", "chunks"), [(2, 8), (2, 17), (3, 9), (4, 16)])
@pytest.mark.anyio
async def test_memory_workers_batches_run_together_and_no_more(workers: int, chunks: int) -> None:
    """With memory_workers=k the restore splits into batches for k threads, and k of them do
    run at once (each waits for the others, so the overlap is certain), never more."""
    tier = PartneredHost(partners=workers, wait_s=60.0)
    assert await _restore_peak(tier, chunks, memory_workers=workers) == workers
    assert tier.calls >= workers


@pytest.mark.parametrize(("workers", "partners", "wait_s"), [(1, 2, 0.05), (2, 2, 60.0)])
@pytest.mark.anyio
async def test_a_file_tier_below_the_host_leaves_the_memory_lane_as_it_is(
    tmp_path: Path, workers: int, partners: int, wait_s: float
) -> None:
    """HostTier over a FileTier, saved through to both: every object is first asked of the
    HostTier, so the restore is memory work and keeps ``memory_workers`` threads (the file
    tier is read only for what the host cannot give): one batch alone (a partner never
    comes), or two that do run together."""
    tier = PartneredHost(partners=partners, wait_s=wait_s)
    below = bsr.FileTier(tmp_path / "store", 1 << 28)
    assert await _restore_peak(tier, 16, below, memory_workers=workers) == workers


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("announce", [False, True])
@pytest.mark.anyio
async def test_a_host_restore_nobody_watches_is_one_batch_per_worker(
    monkeypatch: pytest.MonkeyPatch, announce: bool, workers: int
) -> None:
    """Every worker-thread hop costs CPU on both sides, so a host restore whose chunks nobody
    awaits one by one is one batch per memory worker, whatever its size; with
    ``on_installed`` its chunks are announced batch by batch, so batches keep to
    ``MEMORY_BATCH_BYTES`` (two chunks here). The bytes are the saved ones either way."""
    monkeypatch.setattr(pipeline, "MEMORY_BATCH_BYTES", 2 * LAYOUT.chunk_bytes)
    chunks = 8
    tier = PartneredHost(partners=workers, wait_s=60.0)
    toks = tokens_for(chunks * CT)
    ids = torch.arange(chunks * CT // BLOCK)
    src = filled_cache(LAYOUT, len(ids), BLOCK)
    announced: list[int] = []
    hook = (lambda c, groups: announced.append(c)) if announce else None
    async with make_engine(LAYOUT, [tier], window=8, io_depth=4, memory_workers=workers) as eng:
        assert (await eng.save(toks, src, ids)).ok
        dst = bsr.PagedKVCache(LAYOUT, len(ids), BLOCK)
        r = await eng.restore(toks, dst, ids, on_installed=hook)
        assert r.committed and r.committed_tokens == chunks * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, chunks)
    if announce:
        assert tier.calls == chunks // 2 and sorted(announced) == list(range(chunks))
    else:
        assert tier.calls == workers and not announced


@pytest.mark.anyio
async def test_memory_workers_never_exceed_io_depth() -> None:
    tier = PartneredHost(partners=4, wait_s=0.05)
    assert await _restore_peak(tier, 8, window=4, io_depth=2, memory_workers=4) == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True, None])
def test_a_bad_memory_workers_is_a_config_error_naming_it(bad: Any) -> None:
    with pytest.raises(bsr.ConfigError, match="memory_workers"):
        make_engine(LAYOUT, [bsr.HostTier(capacity_bytes=1 << 20)], memory_workers=bad)
    with pytest.raises(bsr.ConfigError, match="memory_workers"):
        bsr.EngineConfig.from_dict({"model_id": "m", "tiers": HOST, "memory_workers": bad})


def test_memory_workers_comes_from_the_config() -> None:
    config = bsr.EngineConfig.from_dict({"model_id": "m", "memory_workers": 3, "tiers": HOST})
    assert config.memory_workers == 3
    assert bsr.EngineConfig.from_dict(config.to_dict()) == config
    assert bsr.RestoreEngine.from_config(config, layout=LAYOUT).memory_workers == 3
    environ = {"BSR_MODEL_ID": "m", "BSR_MEMORY_WORKERS": "2", "BSR_TIERS": json.dumps(HOST)}
    env = bsr.EngineConfig.from_env(environ=environ)
    assert env.memory_workers == 2
    assert bsr.EngineConfig.from_dict({"model_id": "m", "tiers": HOST}).memory_workers == 1


@pytest.mark.parametrize("held", [0, 1, 3, 4, 5, 7])
@pytest.mark.anyio
async def test_a_batch_lent_span_by_span_goes_on_object_by_object_where_the_host_stops(
    tmp_path: Path, held: int
) -> None:
    """The HostTier holds the first ``held`` chunks, the file tier all 8 (W=1: two batches of
    four chunks): a batch is lent span by span (1 MiB: two chunks) while its first holder is the
    HostTier, and from the first span it cannot lend on, read object by object from the file
    tier; every byte lands once and each tier is credited for what it gave."""
    chunks = 8
    toks = tokens_for(chunks * CT)
    ids = torch.arange(chunks * CT // BLOCK)
    src = filled_cache(LAYOUT, len(ids), BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 28)
    files = bsr.FileTier(tmp_path / "store", 1 << 28)
    async with make_engine(LAYOUT, [host, files], window=1, io_depth=1) as eng:
        assert (await eng.save(toks, src, ids)).ok
        for key in eng.keys(toks)[held:]:
            assert await host.delete(key, "kv")
        dst = bsr.PagedKVCache(LAYOUT, len(ids), BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == chunks * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, chunks)
        chunk_bytes = LAYOUT.group_chunk_bytes("kv")
        assert r.bytes_by_tier.get("host", 0) == held * chunk_bytes
        assert r.bytes_by_tier.get("file", 0) == (chunks - held) * chunk_bytes
        assert host._index.statistics().pinned == 0


class CountingHost(bsr.HostTier):
    """A HostTier that records, per batch call, the thread it ran on and the items it read."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 28)
        self.batches: list[tuple[int, int]] = []  # (thread ident, items)

    def read_many_blocking(self, begin: Any, end: Any, ahead: int, *, lend: bool = False) -> None:
        n = 0

        def counted() -> Any:
            nonlocal n
            item = begin()
            n += item is not None
            return item

        try:
            super().read_many_blocking(counted, end, ahead, lend=lend)
        finally:
            self.batches.append((threading.get_ident(), n))


async def _counted_restore(
    layout: bsr.StateLayout, chunks: int
) -> tuple[int, list[tuple[int, int]]]:
    """:func:`_save_and_restore` through a :class:`CountingHost`; the event loop's thread and
    the tier's batches."""
    tier = CountingHost()
    await _save_and_restore(tier, chunks, layout=layout)
    return threading.get_ident(), tier.batches


@pytest.mark.parametrize(
    ("chunk_bytes", "chunks", "per_batch"),
    [(4 << 10, 150, 64), (64 << 10, 40, 16), (256 << 10, 9, 4), (16 << 10, 64, 64)],
)
@pytest.mark.anyio
async def test_small_host_chunks_move_in_batches_of_a_mebibyte_on_the_loop(
    chunk_bytes: int, chunks: int, per_batch: int
) -> None:
    """Chunks up to INLINE_BYTES from a HostTier into a host cache are copied on the event loop
    (no worker-thread hop) in batches of up to INLINE_BATCH_BYTES and INLINE_CHUNKS chunks
    each (every batch takes slots, a turn and a task switch: fewer batches, fewer of those),
    and every restored byte is the saved one."""
    assert pipeline.INLINE_BATCH_BYTES == 1 << 20 and pipeline.INLINE_CHUNKS == 64
    layout = bsr.StateLayout(256, (bsr.StateGroup("kv", 1, chunk_bytes // 256, dtype="uint8"),))
    loop_thread, batches = await _counted_restore(layout, chunks)
    assert {t for t, _ in batches} == {loop_thread}  # all on the loop
    sizes = [n for _, n in batches]
    assert sum(sizes) == chunks
    assert sizes == [per_batch] * (chunks // per_batch) + [chunks % per_batch] * bool(
        chunks % per_batch
    )


@pytest.mark.anyio
async def test_chunks_over_the_inline_size_go_to_a_worker_thread() -> None:
    """A HostTier chunk over INLINE_BYTES is not copied on the event loop, however small its
    batch: the loop is never held for more than an inline batch. Two 512 KiB chunks: 1 MiB in
    all, an inline batch's size."""
    loop_thread, batches = await _counted_restore(LAYOUT, 2)
    assert batches and all(t != loop_thread for t, _ in batches)
