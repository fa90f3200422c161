"""Damaged, truncated and foreign objects are detected before install and treated as a miss.

Each case damages one stored object for real (bit flips in every header field and in the
payload, truncations, a zero-length file, a valid object of another namespace, layout, chunk or
group planted under its file name) and checks that:

- with a good copy in another tier the restore commits, byte-exact, with the bytes of the good
  tier (the damaged copy is quarantined and a fallback counted);
- with no good copy it is Invalidated with 0 tokens (``truncate``: only the chunks before the
  damaged one), the damaged chunk is never installed, and every block the restore wrote is in
  ``invalid_block_ids``;
- a later probe no longer sees the damaged copy.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import bsr
from bsr.core._object import HEADER_SIZE, PAYLOAD_LEN_OFFSET
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier, corrupt_stored, truncate_stored
from support.engines import make_engine

LAYOUT = bsr.StateLayout(
    chunk_tokens=16,
    groups=(
        bsr.StateGroup("kv", num_layers=2, token_bytes=64, dtype="uint8"),
        bsr.StateGroup("swa", num_layers=1, token_bytes=32, dtype="uint8", window_tokens=16),
    ),
)
BT = 4  # block tokens
BPC = LAYOUT.chunk_tokens // BT
TOKENS = list(range(7, 7 + 3 * LAYOUT.chunk_tokens))  # 3 chunks
N = 3
NBLOCKS = 20
SRC_IDS = [4, 9, 1, 17, 0, 12, 5, 19, 2, 8, 14, 3]
DST_IDS = [11, 2, 18, 6, 0, 15, 9, 4, 13, 7, 1, 16]
BAD_CHUNK, BAD_GROUP = 1, "kv"
PLEN = LAYOUT.group_chunk_bytes(BAD_GROUP)
NS = bsr.Namespace("corruption")


def source_cache() -> bsr.PagedKVCache:
    cache = bsr.PagedKVCache(LAYOUT, NBLOCKS, BT)
    gen = torch.Generator().manual_seed(11)
    for g in LAYOUT.groups:
        t = cache.tensor(g.name)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return cache


def dest_cache() -> tuple[bsr.PagedKVCache, dict[str, torch.Tensor]]:
    """A destination prefilled with noise, and a copy of that noise."""
    cache = bsr.PagedKVCache(LAYOUT, NBLOCKS, BT)
    gen = torch.Generator().manual_seed(12)
    before = {}
    for g in LAYOUT.groups:
        t = cache.tensor(g.name)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        before[g.name] = t.clone()
    return cache, before


def chunk_equal(src: bsr.PagedKVCache, dst: bsr.PagedKVCache, group: str, c: int) -> bool:
    a = src.tensor(group)[:, SRC_IDS[c * BPC : (c + 1) * BPC]]
    b = dst.tensor(group)[:, DST_IDS[c * BPC : (c + 1) * BPC]]
    return torch.equal(a, b)


def prefix_exact(src: bsr.PagedKVCache, dst: bsr.PagedKVCache, chunks: int) -> bool:
    return all(
        chunk_equal(src, dst, g.name, c)
        for g in LAYOUT.groups
        for c in LAYOUT.needed_chunks(g.name, chunks)
    )


def changed_blocks(dst: bsr.PagedKVCache, before: dict[str, torch.Tensor]) -> set[int]:
    out: set[int] = set()
    for g in LAYOUT.groups:
        diff = (dst.tensor(g.name) != before[g.name]).flatten(2).any(dim=2).any(dim=0)
        out.update(int(b) for b in torch.nonzero(diff).flatten().tolist())
    return out


def file_tier(path: Path, name: str = "file") -> bsr.FileTier:
    return bsr.FileTier(path, 1 << 26, name=name, reader="posix")


# ------------------------------------------------------------------ damage
Apply = Callable[[bsr.Tier, bsr.ChunkKey, Path], Awaitable[None]]


@dataclass(frozen=True)
class Damage:
    name: str
    #: (tier holding the object, its key, scratch dir): damages the stored object
    apply: Apply
    file_only: bool = False


def flip(offset: int) -> Apply:
    async def apply(tier: bsr.Tier, key: bsr.ChunkKey, scratch: Path) -> None:
        assert corrupt_stored(tier, key, BAD_GROUP, offset)

    return apply


def cut(size: int) -> Apply:
    async def apply(tier: bsr.Tier, key: bsr.ChunkKey, scratch: Path) -> None:
        assert truncate_stored(tier, key, BAD_GROUP, size)

    return apply


def plant(
    namespace: bsr.Namespace = NS,
    layout: bsr.StateLayout = LAYOUT,
    tokens: list[int] = TOKENS,
    chunk: int = BAD_CHUNK,
    group: str = BAD_GROUP,
) -> Apply:
    """Save ``tokens`` with another engine (namespace/layout) and copy one of its object files
    over the damaged object's file."""

    async def apply(tier: bsr.Tier, key: bsr.ChunkKey, scratch: Path) -> None:
        assert isinstance(tier, bsr.FileTier)
        other_dir = scratch / "other"
        shutil.rmtree(other_dir, ignore_errors=True)
        cache = bsr.PagedKVCache(layout, NBLOCKS, BT)
        for g in layout.groups:
            cache.tensor(g.name).fill_(0x5A)
        ft = file_tier(other_dir)
        group_of_ranks = bsr.InProcessGroup(namespace.tp_size)  # save runs no collective
        eng = bsr.RestoreEngine(
            layout,
            [ft],
            window=2,
            io_depth=1,
            namespace=namespace,
            coordinator=group_of_ranks.coordinator(namespace.tp_rank),
        )
        async with eng:
            await eng.save(tokens, cache, SRC_IDS)
            donor = ft.object_path(eng.keys(tokens)[chunk], group)
            shutil.copyfile(donor, tier.object_path(key, BAD_GROUP))

    return apply


OTHER_LAYOUT = bsr.StateLayout(
    chunk_tokens=16,
    groups=(
        bsr.StateGroup("kv", num_layers=2, token_bytes=32, dtype="uint8"),
        bsr.StateGroup("swa", num_layers=1, token_bytes=32, dtype="uint8", window_tokens=16),
    ),
)

DAMAGES = [
    Damage("flip-magic", flip(0)),
    Damage("flip-magic-last", flip(7)),
    Damage("flip-version", flip(8)),
    Damage("flip-flags", flip(10)),
    Damage("flip-namespace", flip(12)),
    Damage("flip-key", flip(40)),
    Damage("flip-group", flip(60)),
    Damage("flip-chunk-index", flip(76)),
    Damage("flip-payload-len", flip(PAYLOAD_LEN_OFFSET)),
    Damage("flip-payload-len-high", flip(PAYLOAD_LEN_OFFSET + 7)),
    Damage("flip-payload-sum", flip(92)),
    Damage("flip-header-sum", flip(100)),
    Damage("flip-header-padding", flip(2000)),
    Damage("flip-payload-first", flip(HEADER_SIZE)),
    Damage("flip-payload-middle", flip(HEADER_SIZE + PLEN // 2)),
    Damage("flip-payload-last", flip(HEADER_SIZE + PLEN - 1)),
    Damage("truncate-payload-half", cut(HEADER_SIZE + PLEN // 2)),
    Damage("truncate-payload-last-byte", cut(HEADER_SIZE + PLEN - 1)),
    Damage("truncate-header-only", cut(HEADER_SIZE)),
    Damage("truncate-partial-header", cut(100)),
    Damage("zero-length", cut(0)),
    Damage("foreign-model", plant(namespace=bsr.Namespace("another-model")), file_only=True),
    Damage("foreign-salt", plant(namespace=bsr.Namespace("corruption", salt=b"t2")), True),
    Damage(
        "foreign-rank", plant(namespace=bsr.Namespace("corruption", tp_rank=1, tp_size=2)), True
    ),
    Damage("foreign-layout", plant(layout=OTHER_LAYOUT), file_only=True),
    Damage("foreign-chunk", plant(chunk=0), file_only=True),
    Damage("foreign-chunk-and-group", plant(chunk=2, group="swa"), file_only=True),
    Damage("foreign-group", plant(tokens=TOKENS[:32], group="swa"), file_only=True),
    Damage(
        "foreign-prefix", plant(tokens=[t + 1 for t in TOKENS]), file_only=True
    ),  # same namespace, another prompt's chunk 1
]
HOST_DAMAGES = [d for d in DAMAGES if not d.file_only]


async def saved_setup(tiers: list[bsr.Tier]) -> tuple[bsr.RestoreEngine, bsr.PagedKVCache]:
    eng = make_engine(LAYOUT, tiers, namespace=NS)
    await eng.open()
    src = source_cache()
    res = await eng.save(TOKENS, src, SRC_IDS)
    assert res.ok and res.chunks == N
    return eng, src


# ------------------------------------------------------------------ good copy below
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.name)
@pytest.mark.parametrize("reopen", [False, True], ids=["live", "reopened"])
@pytest.mark.anyio
async def test_damaged_l2_falls_back_to_good_second_file_tier(
    tmp_path: Path, damage: Damage, reopen: bool
) -> None:
    eng, src = await saved_setup(
        [file_tier(tmp_path / "a", "ssd-a"), file_tier(tmp_path / "b", "ssd-b")]
    )
    key = eng.keys(TOKENS)[BAD_CHUNK]
    bad = eng.tiers[0]
    assert isinstance(bad, bsr.FileTier)
    await damage.apply(bad, key, tmp_path)
    if reopen:  # the damaged directory is scanned again on open
        await eng.aclose()
        eng = make_engine(
            LAYOUT,
            [file_tier(tmp_path / "a", "ssd-a"), file_tier(tmp_path / "b", "ssd-b")],
            namespace=NS,
        )
        await eng.open()
    async with eng:
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.state is bsr.RequestState.COMMITTED, res
        assert res.committed_tokens == N * LAYOUT.chunk_tokens
        assert prefix_exact(src, dst, N)
        assert res.invalid_block_ids == ()
        # the damaged object's bytes came from the good tier, the damaged copy was taken
        # out of service (at open or when read)
        assert res.bytes_by_tier.get("ssd-b", 0) >= PLEN
        assert eng.tiers[0].statistics().quarantined == 1
        if not reopen:
            assert res.fallbacks == 1 and res.quarantined == 1
        # it is out of service now: a probe sees only the good copy
        probe = await eng.lookup(TOKENS)
        assert probe.holders[BAD_CHUNK][BAD_GROUP] == ("ssd-b",)


@pytest.mark.parametrize("damage", HOST_DAMAGES, ids=lambda d: d.name)
@pytest.mark.anyio
async def test_damaged_l1_falls_back_to_good_l2(tmp_path: Path, damage: Damage) -> None:
    eng, src = await saved_setup([bsr.HostTier(1 << 26), file_tier(tmp_path)])
    async with eng:
        key = eng.keys(TOKENS)[BAD_CHUNK]
        await damage.apply(eng.tiers[0], key, tmp_path)
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.state is bsr.RequestState.COMMITTED, res
        assert res.committed_tokens == N * LAYOUT.chunk_tokens
        assert prefix_exact(src, dst, N)
        assert res.bytes_by_tier["file"] == PLEN  # exactly the damaged object, from L2
        assert res.fallbacks == 1


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.name)
@pytest.mark.anyio
async def test_good_l1_copy_hides_damaged_l2(tmp_path: Path, damage: Damage) -> None:
    """With a good HostTier copy above, the damaged L2 copy is never needed: every byte comes
    from L1. Once L1 loses it, the damage is detected and nothing is installed."""

    eng, src = await saved_setup([bsr.HostTier(1 << 26), file_tier(tmp_path)])
    async with eng:
        key = eng.keys(TOKENS)[BAD_CHUNK]
        await damage.apply(eng.tiers[1], key, tmp_path)
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.state is bsr.RequestState.COMMITTED, res
        assert prefix_exact(src, dst, N)
        assert set(res.bytes_by_tier) == {"host"}
        # L1 loses its copy: only the damaged one is left
        assert await eng.tiers[0].delete(key, BAD_GROUP)
        dst2, before = dest_cache()
        res2 = await eng.restore(TOKENS, dst2, DST_IDS)
        assert res2.state is bsr.RequestState.INVALIDATED, res2
        assert res2.committed_tokens == 0
        assert res2.reason is bsr.Reason.CORRUPT
        assert_nothing_valid_exposed(dst2, before, res2)


# ------------------------------------------------------------------ no good copy
def assert_nothing_valid_exposed(
    dst: bsr.PagedKVCache, before: dict[str, torch.Tensor], res: bsr.RestoreResult
) -> None:
    """The damaged chunk was never installed; every written block is reported invalid."""
    bad_blocks = DST_IDS[BAD_CHUNK * BPC : (BAD_CHUNK + 1) * BPC]
    for g in LAYOUT.groups:
        assert torch.equal(dst.tensor(g.name)[:, bad_blocks], before[g.name][:, bad_blocks]), g
    committed_blocks = set(DST_IDS[: (res.committed_tokens // LAYOUT.chunk_tokens) * BPC])
    invalid = set(res.invalid_block_ids)
    assert invalid <= set(DST_IDS)
    assert not invalid & committed_blocks
    assert changed_blocks(dst, before) <= invalid | committed_blocks


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.name)
@pytest.mark.parametrize("policy", ["all_or_nothing", "truncate"])
@pytest.mark.anyio
async def test_no_good_copy_invalidates(tmp_path: Path, damage: Damage, policy: str) -> None:
    eng, src = await saved_setup([file_tier(tmp_path)])
    async with eng:
        key = eng.keys(TOKENS)[BAD_CHUNK]
        await damage.apply(eng.tiers[0], key, tmp_path)
        dst, before = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS, policy=policy)
        assert res.probed_tokens == N * LAYOUT.chunk_tokens
        if policy == "all_or_nothing":
            assert res.state is bsr.RequestState.INVALIDATED, res
            assert res.committed_tokens == 0
            assert res.reason is bsr.Reason.CORRUPT
        else:
            # only the chunk before the damaged one can be committed; the window group of
            # that shorter prefix was not read (it was not needed for the longer one)
            assert res.committed_tokens in (0, BAD_CHUNK * LAYOUT.chunk_tokens)
            assert res.committed_tokens < res.probed_tokens
            assert prefix_exact(src, dst, res.committed_tokens // LAYOUT.chunk_tokens)
        assert res.quarantined == 1
        assert_nothing_valid_exposed(dst, before, res)
        # the damaged object is out of service: later probes stop before it
        probe = await eng.lookup(TOKENS)
        assert probe.prefix_chunks <= BAD_CHUNK
        assert probe.holders[BAD_CHUNK][BAD_GROUP] == ()
    # and kept aside for inspection, not deleted
    assert any((tmp_path / "quarantine").iterdir())


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.name)
@pytest.mark.anyio
async def test_no_good_copy_after_reopen_is_a_miss(tmp_path: Path, damage: Damage) -> None:
    """A damaged directory is opened again: the damage is found at open (structural check) or at
    read; either way the damaged chunk is never exposed."""

    eng, src = await saved_setup([file_tier(tmp_path)])
    await damage.apply(eng.tiers[0], eng.keys(TOKENS)[BAD_CHUNK], tmp_path)
    await eng.aclose()
    async with make_engine(LAYOUT, [file_tier(tmp_path)], namespace=NS) as again:
        dst, before = dest_cache()
        res = await again.restore(TOKENS, dst, DST_IDS)
        if res.state is bsr.RequestState.COMMITTED:  # dropped at open: a shorter hit
            assert res.committed_tokens <= BAD_CHUNK * LAYOUT.chunk_tokens
            assert res.probed_tokens == res.committed_tokens
            assert prefix_exact(src, dst, res.committed_tokens // LAYOUT.chunk_tokens)
        else:  # found at read
            assert res.committed_tokens == 0
            assert res.reason is bsr.Reason.CORRUPT
        assert_nothing_valid_exposed(dst, before, res)


@pytest.mark.anyio
async def test_padding_damage_is_harmless(tmp_path: Path) -> None:
    """Bytes past the payload (zero padding to 4 KiB) are not part of the object: flipping them
    changes nothing that is installed, so the restore commits byte-exact."""
    assert PLEN % 4096, "the layout must leave padding in the file"

    eng, src = await saved_setup([file_tier(tmp_path)])
    async with eng:
        key = eng.keys(TOKENS)[BAD_CHUNK]
        assert corrupt_stored(eng.tiers[0], key, BAD_GROUP, HEADER_SIZE + PLEN + 5)
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.state is bsr.RequestState.COMMITTED and prefix_exact(src, dst, N)


@pytest.mark.anyio
async def test_stray_files_in_the_directory_are_left_alone(tmp_path: Path) -> None:
    """Files that do not look like objects are not indexed, not quarantined and not deleted."""

    eng, src = await saved_setup([file_tier(tmp_path)])
    path = eng.tiers[0].object_path(eng.keys(TOKENS)[0], "kv")  # type: ignore[attr-defined]
    await eng.aclose()
    strays = [path.parent / "notes.txt", path.parent / "0123.bsr", tmp_path / "objects" / "x"]
    for s in strays:
        s.write_bytes(b"hello")
    async with make_engine(LAYOUT, [file_tier(tmp_path)], namespace=NS) as again:
        dst, _ = dest_cache()
        res = await again.restore(TOKENS, dst, DST_IDS)
        assert res.committed_tokens == N * LAYOUT.chunk_tokens and prefix_exact(src, dst, N)
    assert all(s.read_bytes() == b"hello" for s in strays)


# ------------------------------------------------------------------ once bugs, now fixed
@pytest.mark.anyio
async def test_host_tier_detects_truncation_inside_the_payload(tmp_path: Path) -> None:
    eng, _ = await saved_setup([bsr.HostTier(1 << 26), file_tier(tmp_path)])
    async with eng:
        host = eng.tiers[0]
        key = eng.keys(TOKENS)[BAD_CHUNK]
        assert truncate_stored(host, key, BAD_GROUP, HEADER_SIZE + PLEN // 2)
        with pytest.raises(bsr.TruncatedObjectError):
            await host.read_into(key, BAD_GROUP, bytearray(PLEN))
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.state is bsr.RequestState.COMMITTED
        assert res.quarantined == 1  # taken out of service like any damaged object
        assert not await host.contains(key, BAD_GROUP)


@pytest.mark.anyio
async def test_object_saved_again_after_quarantine_is_restorable(tmp_path: Path) -> None:
    """A fresh save of a quarantined object lifts the quarantine (found by the campaign)."""

    eng, src = await saved_setup([bsr.HostTier(1 << 26), file_tier(tmp_path)])
    async with eng:
        key = eng.keys(TOKENS)[BAD_CHUNK]
        assert corrupt_stored(eng.tiers[0], key, BAD_GROUP, HEADER_SIZE + 3)
        first = await eng.restore(TOKENS, dest_cache()[0], DST_IDS)
        assert first.committed and first.quarantined == 1  # host copy quarantined, L2 used
        again = await eng.save(TOKENS, src, SRC_IDS)
        assert again.objects_written == {"host": 1, "file": 0}  # a good copy is back in L1
        for k in eng.keys(TOKENS):  # L2 loses everything
            for g in LAYOUT.group_names:
                await eng.tiers[1].delete(k, g)
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.committed_tokens == N * LAYOUT.chunk_tokens, res
        assert prefix_exact(src, dst, N)


@pytest.mark.anyio
async def test_intact_object_is_restorable_again_after_a_transient_read_error(
    tmp_path: Path,
) -> None:
    plan = FaultPlan()
    tier = FaultyTier(file_tier(tmp_path), plan)
    eng, src = await saved_setup([tier])
    async with eng:
        tier.plan = FaultPlan(
            faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({BAD_CHUNK}), max_times=1),)
        )
        failed = await eng.restore(TOKENS, dest_cache()[0], DST_IDS)
        assert failed.state is bsr.RequestState.INVALIDATED  # the one transient error
        tier.plan = FaultPlan()  # the tier is healthy again, the object was never damaged
        await eng.save(TOKENS, src, SRC_IDS)  # saving it again does not help either
        dst, _ = dest_cache()
        res = await eng.restore(TOKENS, dst, DST_IDS)
        assert res.committed_tokens == N * LAYOUT.chunk_tokens, res
        assert prefix_exact(src, dst, N)


@pytest.mark.anyio
async def test_zero_length_and_truncated_files_are_quarantined_on_open(tmp_path: Path) -> None:
    eng, _ = await saved_setup([file_tier(tmp_path)])
    keys = eng.keys(TOKENS)
    paths = [eng.tiers[0].object_path(k, "kv") for k in keys]  # type: ignore[attr-defined]
    await eng.aclose()
    os.truncate(paths[0], 0)
    os.truncate(paths[1], HEADER_SIZE + 10)
    async with file_tier(tmp_path) as tier:
        present = await tier.contains_many([bsr.ObjectKey(k, "kv") for k in keys])
        assert present == [False, False, True]
        assert tier.statistics().quarantined == 2
    names = sorted(p.name for p in (tmp_path / "quarantine").iterdir())
    assert len(names) == 2 and all(".truncated." in n for n in names)
