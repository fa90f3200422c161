"""``bsr store gc`` on a root shared in network mode: no lock, oldest objects first down to the
budget, temp files of dead writers past a grace, nothing foreign touched; nodes read on (the
removed objects are misses) and their accounting settles at their next eviction."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import bsr
from bsr.testing import make_keys, payload
from bsr.tiers.file import gc_store
from support.helpers import bsr_main

OBJ = 16 * 4096 + 4096  # a conformance payload as stored (header block + payload)


async def _fill(root: Path, node: str, keys: list[bsr.ChunkKey], first: int) -> None:
    async with bsr.FileTier(root, 64 * OBJ, shared="network", node=node, reader="posix") as t:
        for i, k in enumerate(keys):
            await t.write(k, "kv", payload(first + i))
            # distinct modification times, oldest first (the collector's order)
            os.utime(t.object_path(k, "kv"), (1_000_000 + first + i,) * 2)


@pytest.mark.anyio
async def test_gc_removes_oldest_first_down_to_the_budget_and_nodes_read_on(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    keys = make_keys(12)
    await _fill(root, "a", keys[:6], 0)
    await _fill(root, "b", keys[6:], 6)
    (root / "objects" / "zz").mkdir()
    foreign = root / "objects" / "zz" / "README"
    foreign.write_text("not bsr's")

    dry = gc_store(root, 5 * OBJ, dry_run=True)
    assert len(dry.removed) == 7 and len(list((root / "objects").glob("*/*.bsr"))) == 12
    report = gc_store(root, 5 * OBJ)
    assert report.network and report.freed_bytes == 7 * OBJ
    assert [o.object_id for o in report.removed] == [
        bsr.ObjectKey(k, "kv").object_id for k in keys[:7]
    ]
    assert report.remaining_bytes == 5 * OBJ
    assert foreign.read_text() == "not bsr's"

    async with bsr.FileTier(root, 64 * OBJ, shared="network", node="b", reader="posix") as b:
        # node b's first object went; its journal entry is dropped on open
        assert b.usage().bytes == 5 * OBJ
        dst = np.zeros(16 * 4096, dtype=np.uint8)
        for i, k in enumerate(keys):
            if i < 7:
                assert not await b.contains(k, "kv")
            else:
                await b.read_into(k, "kv", dst)
                assert np.array_equal(dst, payload(i))
    async with bsr.FileTier(root, 64 * OBJ, shared="network", node="a", reader="posix") as a:
        assert a.usage().bytes == 0  # everything node a wrote was collected


@pytest.mark.anyio
async def test_gc_removes_dead_writers_temp_files_past_the_grace_only(tmp_path: Path) -> None:
    root = tmp_path / "root"
    await _fill(root, "a", make_keys(1), 0)
    tmp = root / "tmp"
    old = tmp / f"{'ab' * 20}.4242.{'0' * 12}.tmp"
    young = tmp / f"{'cd' * 20}.4243.{'1' * 12}.tmp"
    odd = tmp / "notes.txt"  # not bsr's grammar: never touched
    for p in (old, young, odd):
        p.write_bytes(b"x" * 100)
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    os.utime(odd, (an_hour_ago, an_hour_ago))

    report = gc_store(root, 1 << 40, tmp_age_s=600)
    assert report.removed_temps == 1 and not report.removed
    assert not old.exists() and young.exists() and odd.exists()
    assert gc_store(root, 1 << 40, tmp_age_s=0).removed_temps == 1
    assert not young.exists() and odd.exists()


@pytest.mark.anyio
async def test_a_node_whose_objects_were_collected_settles_at_its_next_eviction(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    keys = make_keys(8)
    async with bsr.FileTier(root, 4 * OBJ, shared="network", node="a", reader="posix") as a:
        for i, k in enumerate(keys[:4]):
            await a.write(k, "kv", payload(i))
        assert a.usage().bytes == 4 * OBJ
        gc_store(root, 0)  # behind the node's back
        assert not list((root / "objects").glob("*/*.bsr"))
        # the node still counts them; writing evicts its (gone) victims, settling the count
        for i, k in enumerate(keys[4:], start=4):
            assert await a.write(k, "kv", payload(i))
        assert a.usage().bytes == 4 * OBJ
        assert len(list((root / "objects").glob("*/*.bsr"))) == 4


def test_cli_gc_takes_a_budget_and_refuses_a_negative_grace(tmp_path: Path) -> None:
    import anyio

    root = tmp_path / "root"
    anyio.run(_fill, root, "a", make_keys(3), 0)
    p = bsr_main("store", "gc", str(root), "--budget", str(OBJ), "--tmp-age", "0")
    assert p.returncode == 0, p.stderr
    assert "removed 2 objects" in p.stdout and "temp files" in p.stdout
    assert len(list((root / "objects").glob("*/*.bsr"))) == 1
    bad = bsr_main("store", "gc", str(root), "--budget", "0", "--tmp-age", "-1")
    assert bad.returncode == 2 and "tmp_age_s" in bad.stderr
    assert len(list((root / "objects").glob("*/*.bsr"))) == 1  # refused: nothing removed
