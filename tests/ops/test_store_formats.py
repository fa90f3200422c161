"""A store written by an older bsr (keys format 1) under this version: what CHANGELOG.md says.

``tests/data/format1/store`` was written by bsr's last format-1 source (BLAKE2b chain over int64
tokens; ``tests/data/format1/make_store.py`` says how). Each test works on a copy. The engine
must treat it as a clean miss (never a misread, nothing quarantined), and ``bsr store`` must
list it and report it as another format version: not bad, never moved by ``verify
--quarantine``, removed only by a ``gc`` that was asked to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import bsr
from support.helpers import bsr_main

FORMAT1 = Path(__file__).resolve().parents[1] / "data" / "format1" / "store"
LAYOUT = bsr.StateLayout(
    chunk_tokens=16, groups=(bsr.StateGroup("kv", num_layers=1, token_bytes=16),)
)
TOKENS = list(range(1000, 1048))  # what make_store.py saved: three chunks
NAMESPACE = bsr.Namespace("format1-store")
OBJECT_BYTES = 8192  # a 4 KiB header and 256 payload bytes, rounded up to 4 KiB


def _objects(root: Path) -> dict[str, bytes]:
    return {p.name[:-4]: p.read_bytes() for p in sorted((root / "objects").rglob("*.bsr"))}


@pytest.fixture
def old_store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(FORMAT1, root)
    for sub in ("tmp", "quarantine"):  # git keeps no empty directories
        (root / sub).mkdir(exist_ok=True)
    return root


OLD = _objects(FORMAT1)


def test_the_committed_store_is_format_1() -> None:
    """The fixture is what it claims: three intact objects whose header says version 1."""
    assert len(OLD) == 3 and bsr.FORMAT_VERSION != 1
    for blob in OLD.values():
        assert len(blob) == OBJECT_BYTES and blob[:8] == b"BSR\x00OBJ\x01"  # bsr's magic
        assert int.from_bytes(blob[8:10], "little") == 1, "the header's format version"


def _cache() -> bsr.PagedKVCache:
    cache = bsr.PagedKVCache(LAYOUT, num_blocks=4, block_tokens=16)
    t = cache.tensor("kv")
    t.copy_((torch.arange(t.numel()) % 251).to(torch.uint8).reshape(t.shape))
    return cache


@pytest.mark.anyio
async def test_an_old_store_is_a_clean_miss_and_stays_as_it_was(old_store: Path) -> None:
    tier = bsr.FileTier(old_store, 1 << 20)
    dst = bsr.PagedKVCache(LAYOUT, num_blocks=4, block_tokens=16)
    async with bsr.RestoreEngine(LAYOUT, [tier], window=2, io_depth=2, namespace=NAMESPACE) as eng:
        assert tier.statistics().objects == 3  # counted in the tier's capacity
        probe = await eng.lookup(TOKENS)
        assert probe.prefix_chunks == 0
        r = await eng.restore(TOKENS, dst, [0, 1, 2])
        assert r.committed_tokens == 0 and r.quarantined == 0 and r.fallbacks == 0, r
        assert not dst.tensor("kv").any()  # nothing written into the cache
        s = tier.statistics()
        assert s.errors == 0 and s.quarantined == 0 and s.reads == 0
        # this version saves the same prefix beside them under its own keys, and hits those
        src = _cache()
        assert (await eng.save(TOKENS, src, [0, 1, 2])).chunks == 3
        again = await eng.restore(TOKENS, dst, [0, 1, 2])
        assert again.committed_tokens == 48 and again.quarantined == 0, again
        # blocks 0-2 (layers x blocks x block tokens x bytes), as saved
        assert torch.equal(dst.tensor("kv")[:, :3], src.tensor("kv")[:, :3])
    now = _objects(old_store)
    assert len(now) == 6 and {k: now[k] for k in OLD} == OLD  # the old ones, byte for byte
    assert list((old_store / "quarantine").iterdir()) == []


def test_store_commands_report_another_format_never_bad(old_store: Path) -> None:
    stats = bsr_main("store", "stats", str(old_store))
    assert stats.returncode == 0 and "objects    3 " in stats.stdout, stats.stdout
    ls = bsr_main("store", "ls", str(old_store))
    assert sorted(line.split()[0] for line in ls.stdout.splitlines()) == sorted(OLD)
    text = bsr_main("store", "verify", str(old_store))
    assert text.returncode == 0, text.stdout + text.stderr
    assert "BAD" not in text.stdout and text.stdout.count("OTHER FORMAT") == 3
    assert "verified 3 objects" in text.stdout and "3 of another format version" in text.stdout
    report = json.loads(bsr_main("store", "verify", str(old_store), "--json").stdout)
    assert report["bad"] == [] and report["checked"] == 3
    assert sorted(o["object_id"] for o in report["other_format"]) == sorted(OLD)
    assert all("format version 1" in o["detail"] for o in report["other_format"])
    moved = bsr_main("store", "verify", str(old_store), "--quarantine")
    assert moved.returncode == 0, moved.stdout
    assert _objects(old_store) == OLD and list((old_store / "quarantine").iterdir()) == []


@pytest.mark.anyio
async def test_verify_quarantine_moves_the_damaged_object_only(old_store: Path) -> None:
    async with bsr.RestoreEngine(
        LAYOUT, [bsr.FileTier(old_store, 1 << 20)], window=2, io_depth=2, namespace=NAMESPACE
    ) as eng:
        assert (await eng.save(TOKENS, _cache(), [0, 1, 2])).chunks == 3
    new = sorted(set(_objects(old_store)) - set(OLD))
    victim = next((old_store / "objects").rglob(f"{new[1]}.bsr"))
    raw = bytearray(victim.read_bytes())
    raw[4096 + 7] ^= 0xFF  # one payload byte flipped, the header intact
    victim.write_bytes(bytes(raw))
    p = bsr_main("store", "verify", str(old_store), "--quarantine", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert [(b["object_id"], b["reason"]) for b in report["bad"]] == [(new[1], "corrupt")]
    assert report["bad"][0]["quarantined_to"] is not None
    assert sorted(o["object_id"] for o in report["other_format"]) == sorted(OLD)
    left = _objects(old_store)
    assert set(left) == {*OLD, new[0], new[2]} and {k: left[k] for k in OLD} == OLD
    assert bsr_main("store", "verify", str(old_store)).returncode == 0  # the rest is not bad


def test_gc_removes_old_objects_only_when_asked(old_store: Path) -> None:
    dry = bsr_main("store", "gc", str(old_store), "--max-bytes", "0", "--dry-run")
    assert dry.returncode == 0 and "would remove 3 objects" in dry.stdout, dry.stdout
    assert _objects(old_store) == OLD
    gc = bsr_main("store", "gc", str(old_store), "--max-bytes", "0")
    assert gc.returncode == 0 and "removed 3 objects" in gc.stdout, gc.stdout
    assert _objects(old_store) == {}


@pytest.mark.anyio
async def test_a_full_tier_evicts_old_objects_oldest_first(old_store: Path) -> None:
    """A FileTier that needs room evicts old-format objects like any other (oldest first): the
    capacity is the operator's bound, and its statistics count each eviction."""
    tier = bsr.FileTier(old_store, 4 * OBJECT_BYTES)
    async with bsr.RestoreEngine(LAYOUT, [tier], window=2, io_depth=2, namespace=NAMESPACE) as eng:
        assert (await eng.save(TOKENS, _cache(), [0, 1, 2])).chunks == 3
        assert tier.statistics().evictions == 2
    left = _objects(old_store)
    assert len(left) == 4 and len(set(left) & set(OLD)) == 1
