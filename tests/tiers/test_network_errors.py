"""A FileTier in network mode under the errors network filesystems return and local disks do
not (ESTALE, ENOTCONN, EIO on open or read), and the reports routers see: an error is a miss,
never a quarantine or wrong bytes, and the engine serves on; a node's eviction reports only the
objects it removed (another node's object it passed over is still there, and no event says
otherwise)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import bsr
from bsr.testing import make_keys, payload
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8
OBJ = 16 * 4096 + 4096


def _node(root: Path, node: str, capacity: int = 64 << 20) -> bsr.FileTier:
    return bsr.FileTier(root, capacity, shared="network", node=node, reader="posix")


@pytest.mark.anyio
@pytest.mark.parametrize("code", [errno.ESTALE, errno.ENOTCONN, errno.EIO])
async def test_a_network_error_on_open_is_a_miss_not_a_quarantine(
    tmp_path: Path, code: int
) -> None:
    n = 4
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 32, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    tier = _node(tmp_path / "root", "a")
    failing = {"on": False}

    async with make_engine(LAYOUT, [tier]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        orig = tier._io.open_object

        def open_object(dirs: Any, oid: str) -> Any:
            if failing["on"]:
                raise OSError(code, errno.errorcode[code])
            return orig(dirs, oid)

        tier._io.open_object = open_object  # type: ignore[method-assign]
        failing["on"] = True
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 32, BLOCK), ids)
        assert r.committed_tokens == 0  # a miss: nothing exposed
        # the engine retired the copy it could not read (in this engine only: an I/O error
        # asks the tier to move nothing); the tier kept the file where it was
        assert r.quarantined >= 1
        assert not any((tmp_path / "root" / "quarantine").iterdir())
        with pytest.raises(bsr.TierIOError):
            await tier.read_into(eng.keys(toks)[0], "kv", np.zeros(1 << 20, np.uint8))
        failing["on"] = False  # the server is back: the next save replaces the retired copy
        assert (await eng.save(toks, src, ids)).ok
        dst = bsr.PagedKVCache(LAYOUT, 32, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == n * CT, (r.reason, r.errors)
        assert blocks_equal(LAYOUT, src, ids, dst, ids, n)


@pytest.mark.anyio
async def test_a_probe_that_cannot_see_a_file_says_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bsr.tiers.file import _ledger

    keys = make_keys(2)
    async with _node(tmp_path / "root", "a") as a:
        for i, k in enumerate(keys):
            await a.write(k, "kv", payload(i))
    async with _node(tmp_path / "root", "b") as b:
        assert await b.contains(keys[0], "kv")  # a's object, found by a probe

        def stale(*args: Any, **kw: Any) -> Any:
            raise OSError(errno.ESTALE, "Stale file handle")

        monkeypatch.setattr(_ledger, "open_regular", stale)
        assert await b.contains_many([bsr.ObjectKey(keys[1], "kv")]) == [False]
        monkeypatch.undo()
        assert await b.contains_many([bsr.ObjectKey(keys[1], "kv")]) == [True]


@pytest.mark.anyio
async def test_an_eviction_reports_only_what_its_node_removed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    keys = make_keys(10)
    async with _node(root, "a") as a:
        for i, k in enumerate(keys[:4]):
            await a.write(k, "kv", payload(i))
    events: list[bsr.ObjectRemoved] = []
    async with _node(root, "b", capacity=3 * OBJ) as b:
        b.on_removed(events.append)
        # b learns a's objects (probes) and reads one: they are in its index, least recent
        assert await b.contains_many([bsr.ObjectKey(k, "kv") for k in keys[:4]]) == [True] * 4
        for i, k in enumerate(keys[4:], start=4):
            await b.write(k, "kv", payload(i))  # six writes into a share of three
        own = {bsr.ObjectKey(k, "kv").object_id for k in keys[4:]}
        assert events and {e.object_id for e in events} <= own
        assert all(e.cause is bsr.Removal.EVICTED for e in events)
        assert len(events) == 3 and b.usage().bytes == 3 * OBJ
    dst = np.zeros(16 * 4096, np.uint8)
    async with _node(root, "c") as c:  # a's objects are all still there, intact (read
        # without a probe first: a node looks on disk for an object it has not seen)
        for i, k in enumerate(keys[:4]):
            await c.read_into(k, "kv", dst)
            assert np.array_equal(dst, payload(i))


@pytest.mark.anyio
async def test_an_object_retired_for_an_io_error_is_tried_again_after_the_cooldown(
    tmp_path: Path,
) -> None:
    """An I/O error retires the object in the engine for one breaker cooldown, not for the
    engine's life: once the server is back the same engine restores the prefix without a
    save in between (a corrupt object, by contrast, stays out until written again)."""
    n = 3
    toks = tokens_for(n * CT, seed=9)
    src = filled_cache(LAYOUT, 32, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    tier = _node(tmp_path / "root", "a")
    failing = {"on": False}
    async with make_engine(LAYOUT, [tier], breaker_cooldown_s=0.2) as eng:
        assert (await eng.save(toks, src, ids)).ok
        orig = tier._io.open_object

        def open_object(dirs: Any, oid: str) -> Any:
            if failing["on"]:
                raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
            return orig(dirs, oid)

        tier._io.open_object = open_object  # type: ignore[method-assign]
        failing["on"] = True
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 32, BLOCK), ids)
        assert r.committed_tokens == 0 and r.quarantined >= 1
        failing["on"] = False
        dst = bsr.PagedKVCache(LAYOUT, 32, BLOCK)
        for _ in range(500):  # the cooldown passes (a bound, not a timing assertion)
            r = await eng.restore(toks, dst, ids)
            if r.committed_tokens == n * CT:
                break
            await anyio.sleep(0.02)
        assert r.committed_tokens == n * CT, (r.reason, r.errors)
        assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
