"""FileTier's network mode (``shared="network"``, ``node=...``): nodes of a network filesystem
share one root with no lock across them, each within its own share.

Run on a real network filesystem: two sshfs mounts of one export over an sshd on loopback
(``support.sshfs``), each mount a "node" whose flock is local to it. What is checked against
the export (the server's side, not a node's cached view): the bytes each node's objects hold
on disk (the local shared mode, whose lock both nodes "held" at once, left a root at 3.45x its
capacity here), that no node removes what another wrote, that a node's journal re-adopts its
own objects (and drops vanished ones, and survives a torn last line), that two nodes writing one
object leave it whole, and that only an object a fresh read proves bad is quarantined. The
generic tier conformance suite runs on the mode twice: on a local directory and on an sshfs
mount, where what the suite plants (FIFOs, symlinks, junk, a small tmpfs) is planted on the
server's side, as another machine would, and seen by the tier through the mount.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import bsr
from bsr.core._object import HEADER_SIZE, decode_object
from bsr.testing import (
    TierConformance,
    corrupt_stored,
    fifo_unblocker,
    flip_file_byte,
    make_keys,
    payload,
)
from bsr.tiers.file._fstype import mount_type
from support.sshfs import sshfs_export

#: payload bytes of the targeted tests' objects, and what one object holds on disk
SMALL = 4096
OBJ = bsr.ObjectCodec.stored_size(SMALL, padded=True)
#: each node's share (capacity_bytes) in the targeted tests
SHARE = 6 * OBJ
GROUP = "kv"


# ---------------------------------------------------------------------- fixtures
@dataclass
class Export:
    """One sshfs export and the mounts (nodes) of it this module uses."""

    export: Path
    a: Path
    b: Path
    c: Path  # the conformance suite's node


@dataclass
class Shared:
    """One test's root, as the server sees it and as nodes a and b see it."""

    server: Path
    a: Path
    b: Path


@pytest.fixture(scope="module")
def sshfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Export]:
    with sshfs_export(tmp_path_factory.mktemp("sshfs")) as ex:
        yield Export(ex.export, ex.mount("node-a"), ex.mount("node-b"), ex.mount("node-c"))


@pytest.fixture
def shared(sshfs: Export, tmp_path: Path) -> Shared:
    """A root of this test's own on the export (not made yet)."""
    return Shared(*(where / tmp_path.name / "root" for where in (sshfs.export, sshfs.a, sshfs.b)))


@pytest.fixture
def anyio_backend() -> str:
    """The targeted tests run on asyncio only (the conformance classes run every backend)."""
    return "asyncio"


def node_tier(root: Path, node: str, capacity: int = SHARE, **kw: Any) -> bsr.FileTier:
    return bsr.FileTier(root, capacity, reader="posix", shared="network", node=node, **kw)


def okey(key: bsr.ChunkKey) -> bsr.ObjectKey:
    return bsr.ObjectKey(key, GROUP)


def on_disk(server_root: Path) -> dict[str, int]:
    """``object id -> file size`` of every object file under ``objects/`` (the server's view)."""
    return {
        p.name.removesuffix(".bsr"): p.stat().st_size
        for p in (server_root / "objects").glob("*/*.bsr")
    }


def temp_files(server_root: Path) -> list[Path]:
    return list((server_root / "tmp").iterdir())


def check_file(server_root: Path, key: bsr.ChunkKey, seed: int) -> None:
    """The object file of ``key`` (server's side) holds exactly payload ``seed``."""
    path = server_root / "objects" / okey(key).object_id[:2] / f"{okey(key).object_id}.bsr"
    got = decode_object(path.read_bytes(), okey(key))
    assert bytes(got) == payload(seed, SMALL).tobytes(), path


async def read_back(tier: bsr.Tier, key: bsr.ChunkKey, seed: int) -> None:
    """``tier`` finds ``key`` (a probe: another node may have written it) and reads it exactly."""
    assert await tier.contains(key, GROUP), key
    dst = np.zeros(SMALL, dtype=np.uint8)
    assert await tier.read_into(key, GROUP, dst) == SMALL
    assert np.array_equal(dst, payload(seed, SMALL))


async def write_all(tier: bsr.Tier, keys: list[bsr.ChunkKey], seeds: list[int]) -> list[bool]:
    return [await tier.write(k, GROUP, payload(s, SMALL)) for k, s in zip(keys, seeds)]


def append(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` (a journal line torn mid-write)."""
    with open(path, "ab") as fh:
        fh.write(data)


def tree(root: Path) -> list[Path]:
    """Every entry under ``root``, relative to it, sorted."""
    return sorted(p.relative_to(root) for p in root.rglob("*"))


def journal_entries(server_root: Path, node: str) -> dict[str, int]:
    """The live entries of ``nodes/<node>.log``, parsed here: every line must be whole."""
    raw = (server_root / "nodes" / f"{node}.log").read_bytes()
    head, _, body = raw.partition(b"\n")
    assert head.startswith(b"bsr.FileTier.node"), raw[:64]
    assert body == b"" or body.endswith(b"\n"), body[-64:]
    owned: dict[str, int] = {}
    for line in body.decode().splitlines():
        op, oid, *size = line.split(" ")
        assert op in "+-" and len(oid) == 40, line
        if op == "+":
            owned[oid] = int(size[0])
        else:
            owned.pop(oid, None)
    return owned


# ---------------------------------------------------------------------- conformance
class TestNetworkTierConformance(TierConformance):
    """The suite on network mode over a local directory (every hostile case included)."""

    hostile_store = True

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return node_tier(tmp_path / "l2", "n1", capacity_bytes)

    async def reopen_tier(self, tier: bsr.Tier, tmp_path: Path) -> bsr.Tier | None:
        return node_tier(tmp_path / "l2", "n1", tier.statistics().capacity_bytes)


class TestNetworkTierOnSshfsConformance(TestNetworkTierConformance):
    """The suite on network mode over an sshfs mount. ``tmp_path`` is a directory of the
    export (the server's side): what the suite plants there (junk, FIFOs, symlinks, a tmpfs)
    another machine planted, and the tier, rooted at the same place under the mount, sees it
    through sshfs."""

    @pytest.fixture
    def tmp_path(self, tmp_path: Path, sshfs: Export) -> Path:
        self.export, self.mount = sshfs.export, sshfs.c
        here = sshfs.export / f"conf-{tmp_path.name}"
        here.mkdir()
        return here

    def _mounted(self, server_side: Path) -> Path:
        return self.mount / server_side.relative_to(self.export)

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return node_tier(self._mounted(tmp_path) / "l2", "c", capacity_bytes)

    async def reopen_tier(self, tier: bsr.Tier, tmp_path: Path) -> bsr.Tier | None:
        capacity = tier.statistics().capacity_bytes
        return node_tier(self._mounted(tmp_path) / "l2", "c", capacity)

    def object_file(self, tier: bsr.Tier, key: bsr.ChunkKey, group: str) -> Path | None:
        mounted = super().object_file(tier, key, group)
        return None if mounted is None else self.export / mounted.relative_to(self.mount)

    async def test_hostile_read_only_filesystem(self, tmp_path: Path) -> None:
        pytest.skip(
            "over sshfs the suite's remount of its tmpfs read-only is refused at random "
            "('mount point is busy': the sftp server closes the files a tier used after the "
            "tier did); the local class runs it"
        )

    async def test_the_tier_is_on_sshfs(self, tmp_path: Path) -> None:
        tier = await self.make_tier(tmp_path, self.capacity_bytes)
        assert isinstance(tier, bsr.FileTier)
        assert mount_type(tier.root) == "fuse.sshfs"
        async with tier:
            await tier.write(make_keys(1)[0], GROUP, payload(0))
        assert list((tmp_path / "l2" / "objects").glob("*/*.bsr"))  # the server has it


# ---------------------------------------------------------------------- capacity
@pytest.mark.anyio
async def test_two_nodes_each_keep_within_their_share(shared: Shared) -> None:
    """Nodes a and b each write 4x their share into one root at once (3 writers each): each
    node's objects on disk stay within its share (the local mode's ledger, its lock held by
    both, left 3.45x), its usage says what it holds, and every object left reads exactly."""
    per_node, lanes = 4 * SHARE // OBJ, 3
    keys = make_keys(2 * per_node, model="two-nodes")
    a, b = node_tier(shared.a, "a"), node_tier(shared.b, "b")

    async def lane(tier: bsr.Tier, first: int) -> None:
        for i in range(first, first + per_node, lanes):
            assert await tier.write(keys[i], GROUP, payload(i, SMALL)) is True

    async with a, b:
        async with anyio.create_task_group() as tg:
            for j in range(lanes):
                tg.start_soon(lane, a, j)
                tg.start_soon(lane, b, per_node + j)
        files = on_disk(shared.server)
        ids = [okey(k).object_id for k in keys]
        mine = {
            "a": sum(files.get(oid, 0) for oid in ids[:per_node]),
            "b": sum(files.get(oid, 0) for oid in ids[per_node:]),
        }
        assert sum(files.values()) <= 2 * SHARE, sum(files.values()) / SHARE
        for name, tier in (("a", a), ("b", b)):
            assert SHARE - OBJ < mine[name] <= SHARE, (name, mine[name] / SHARE)
            assert tier.usage().bytes == mine[name], (name, tier.usage(), mine[name])
            assert tier.statistics().peak_bytes <= SHARE, name
        assert not temp_files(shared.server)
        survivors = [i for i, oid in enumerate(ids) if oid in files]
        for i in survivors:
            check_file(shared.server, keys[i], i)
            await read_back(a, keys[i], i)  # a reads b's objects too


@pytest.mark.anyio
async def test_a_node_never_evicts_another_nodes_objects(shared: Shared) -> None:
    """b's objects, which a probed and read (so they are the oldest of a's index), survive
    a's writing 4x its share; b's explicit delete of an object a wrote removes it, and leaves
    b's count alone (a's open drops it from a's)."""
    keys = make_keys(4 + 4 * SHARE // OBJ, model="never-evicts")
    theirs, ours = keys[:4], keys[4:]
    a, b = node_tier(shared.a, "a"), node_tier(shared.b, "b")
    async with a, b:
        assert await write_all(b, theirs, list(range(4))) == [True] * 4
        for i, k in enumerate(theirs):
            await read_back(a, k, i)  # in a's index now, least recently used first
        await write_all(a, ours, list(range(4, len(keys))))
        assert a.statistics().evictions >= len(ours) - SHARE // OBJ
        files = on_disk(shared.server)
        for i, k in enumerate(theirs):
            assert okey(k).object_id in files, f"a evicted b's object {i}"
            check_file(shared.server, k, i)
            await read_back(b, k, i)
            await read_back(a, k, i)
        assert sum(files[okey(k).object_id] for k in ours if okey(k).object_id in files) <= SHARE
        assert b.usage().bytes == 4 * OBJ and a.usage().bytes <= SHARE

        victim = next(k for k in reversed(ours) if okey(k).object_id in files)
        assert await b.contains(victim, GROUP)
        assert await b.delete(victim, GROUP) is True
        assert okey(victim).object_id not in on_disk(shared.server)
        assert b.usage().bytes == 4 * OBJ  # not b's: b's count never held it
    async with node_tier(shared.a, "a") as again:
        left = on_disk(shared.server)
        assert again.usage().bytes == sum(left.get(okey(k).object_id, 0) for k in ours)
        assert okey(victim).object_id not in journal_entries(shared.server, "a")


# ---------------------------------------------------------------------- the journal
@pytest.mark.anyio
async def test_reopen_readopts_a_nodes_objects_and_evicts_them_later(shared: Shared) -> None:
    """A node's objects are its own again after it reopens: counted, and evicted oldest first
    when it needs room; another node opening the root adopts none of them."""
    keys = make_keys(8, model="readopt")
    async with node_tier(shared.a, "a") as a:
        await write_all(a, keys[:4], [0, 1, 2, 3])
    async with node_tier(shared.b, "b") as b, node_tier(shared.a, "a") as a:
        assert b.usage().bytes == 0
        assert a.usage() == bsr.TierUsage(4, 4 * OBJ, SHARE)
        await write_all(a, keys[4:], [4, 5, 6, 7])  # room for 2: the 2 oldest go
        ids = set(on_disk(shared.server))
        assert ids == {okey(k).object_id for k in keys[2:]}
        assert a.usage().bytes == 6 * OBJ
        for i in range(2, 8):
            await read_back(b, keys[i], i)
    assert set(journal_entries(shared.server, "a")) == ids
    async with node_tier(shared.a, "a", 3 * OBJ) as a:  # a smaller share: trimmed on open
        assert set(on_disk(shared.server)) == {okey(k).object_id for k in keys[5:]}
        assert a.usage().bytes == 3 * OBJ


@pytest.mark.anyio
async def test_journal_drops_vanished_objects_and_a_torn_last_line(shared: Shared) -> None:
    """An object whose file went (gc, another node) leaves the node's count when it reopens;
    a line torn mid-write ends the replay, and the journal written back holds whole lines
    only, so the next line appended is read on the open after."""
    keys = make_keys(4, model="journal")
    async with node_tier(shared.a, "a") as a:
        await write_all(a, keys[:3], [0, 1, 2])
    gone = okey(keys[1]).object_id
    (shared.server / "objects" / gone[:2] / f"{gone}.bsr").unlink()  # gc, or another node
    append(shared.server / "nodes" / "a.log", b"+ " + okey(keys[3]).object_id.encode()[:17])
    async with node_tier(shared.a, "a") as a:
        assert a.usage().bytes == 2 * OBJ
        kept = {okey(keys[i]).object_id: OBJ for i in (0, 2)}
        assert journal_entries(shared.server, "a") == kept  # compacted: every line whole
        await write_all(a, keys[3:], [3])
    async with node_tier(shared.a, "a") as a:  # the new line was not glued to the torn one
        assert a.usage().bytes == 3 * OBJ
        assert set(journal_entries(shared.server, "a")) == {*kept, okey(keys[3]).object_id}
        for i in (0, 2, 3):
            await read_back(a, keys[i], i)


def _plant(path: Path, kind: str, outside: Path) -> None:
    """Put a FIFO, a symlink to ``outside`` or a plain file where ``path`` is."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(outside)
    else:
        path.write_bytes(b"not bsr's")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nodes/a.log", "fifo"),
        ("nodes/a.log", "symlink"),
        ("nodes/a.lock", "symlink"),
        ("nodes", "symlink"),
        ("nodes", "file"),
    ],
)
@pytest.mark.anyio
async def test_foreign_entries_in_place_of_a_nodes_files(
    tmp_path: Path, name: str, kind: str
) -> None:
    """A FIFO, a symlink or a file where a node keeps its journal or lock: the open ends
    promptly, opened or with a typed error, and leaves the entry (not bsr's) as it was."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "a.log").write_bytes(b"someone's file")
    async with node_tier(root, "a"):
        pass
    planted = root / name
    _plant(planted, kind, outside / "a.log" if name != "nodes" else outside)
    with fifo_unblocker(planted, after_s=12):  # frees a blocked open, which fails the bound
        try:
            with anyio.fail_after(10):  # a hang guard (an open takes milliseconds)
                async with node_tier(root, "a"):
                    pass
        except bsr.BsrError:
            pass
    assert {"fifo": planted.is_fifo, "symlink": planted.is_symlink, "file": planted.is_file}[
        kind
    ](), f"the tier replaced the {kind} at {name}"
    assert (outside / "a.log").read_bytes() == b"someone's file"


@pytest.mark.anyio
async def test_one_node_id_is_one_process_on_a_mount(shared: Shared) -> None:
    async with node_tier(shared.a, "a"):
        with pytest.raises(bsr.TierRootError) as info:
            async with node_tier(shared.a, "a"):
                pass
        assert info.value.fields["reason"] == "node_in_use", info.value
        assert "nodes/a.lock" in str(info.value)
        async with node_tier(shared.a, "a2") as other:  # another id on the same mount
            await other.write(make_keys(1, model="ids")[0], GROUP, payload(0, SMALL))
    async with node_tier(shared.a, "a"):  # closed: the id is free again
        pass


# ---------------------------------------------------------------------- one object, two nodes
@pytest.mark.anyio
async def test_two_nodes_writing_one_object_leave_it_whole(shared: Shared) -> None:
    """a and b write the same 8 objects at once: each ends whole (on disk, and read by either
    node), nothing is left in tmp/, and each node counts what it says it wrote."""
    keys = make_keys(8, model="same-object")
    a, b = node_tier(shared.a, "a", 16 * OBJ), node_tier(shared.b, "b", 16 * OBJ)
    new: dict[str, list[bool]] = {"a": [], "b": []}

    async def one(tier: bsr.Tier, name: str, i: int) -> None:
        new[name].append(await tier.write(keys[i], GROUP, payload(i, SMALL)))

    async with a, b:
        async with anyio.create_task_group() as tg:
            for i in range(len(keys)):
                tg.start_soon(one, a, "a", i)
                tg.start_soon(one, b, "b", i)
        assert set(on_disk(shared.server)) == {okey(k).object_id for k in keys}
        assert not temp_files(shared.server)
        for i, k in enumerate(keys):
            check_file(shared.server, k, i)
            await read_back(a, k, i)
            await read_back(b, k, i)
        assert a.usage().bytes == OBJ * sum(new["a"])
        assert b.usage().bytes == OBJ * sum(new["b"])


@pytest.mark.parametrize("mode", ["network", "local"])
@pytest.mark.anyio
async def test_an_object_evicted_between_its_rename_and_its_indexing_is_no_ghost(
    tmp_path: Path, mode: str
) -> None:
    """Write A pauses right after its rename (its thread has not returned); write B needs the
    room A holds. Whatever B does, afterwards every object the tier says it holds reads back.
    (8 writers at once into a share of 5 objects left 9 such entries in 64 writes.)"""
    keys = make_keys(2, model="ghost")
    kw: dict[str, Any] = {"shared": "network", "node": "a"} if mode == "network" else {}
    tier = bsr.FileTier(tmp_path, OBJ, reader="posix", lock_timeout_s=0.5, **kw)
    renamed, go = threading.Event(), threading.Event()
    commit = tier._writes.commit

    def paused_commit(oid: str, pending: Any, done: list[bool]) -> None:
        commit(oid, pending, done)
        if oid == okey(keys[0]).object_id:
            renamed.set()
            go.wait(30)  # set below once B is done (a bound, not a timing)

    tier._writes.commit = paused_commit  # type: ignore[method-assign,assignment]
    async with tier:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.write, keys[0], GROUP, payload(0, SMALL))
            await anyio.to_thread.run_sync(renamed.wait)
            try:
                await tier.write(keys[1], GROUP, payload(1, SMALL))
            except (bsr.TierBusyError, bsr.TierFullError):
                pass  # B may wait for A instead: fine, as long as nothing lies
            finally:
                go.set()
        files = on_disk(tmp_path)
        for i, k in enumerate(keys):
            if await tier.contains(k, GROUP):
                assert okey(k).object_id in files, f"object {i} is a ghost"
                await read_back(tier, k, i)
        assert tier.usage().objects == len(files)


# ---------------------------------------------------------------------- quarantine
@pytest.mark.anyio
async def test_damaged_object_fails_its_read_and_is_quarantined(shared: Shared) -> None:
    keys = make_keys(2, model="damaged")
    async with node_tier(shared.a, "a") as a:
        await write_all(a, keys, [0, 1])
        assert corrupt_stored(a, keys[0], GROUP, HEADER_SIZE + 100)
        damaged = a.object_path(keys[0], GROUP).read_bytes()
        with pytest.raises(bsr.ObjectError):
            await a.read_into(keys[0], GROUP, np.zeros(SMALL, dtype=np.uint8))
        await a.quarantine(keys[0], GROUP, "corrupt")  # what the engine does next
        oid = okey(keys[0]).object_id
        assert set(on_disk(shared.server)) == {okey(keys[1]).object_id}
        moved = list((shared.server / "quarantine").iterdir())
        assert len(moved) == 1 and moved[0].name.startswith(oid), moved
        assert moved[0].read_bytes() == damaged
        assert a.statistics().quarantined == 1
        assert a.usage().bytes == OBJ
        assert await a.contains(keys[0], GROUP) is False
        await read_back(a, keys[1], 1)
    assert set(journal_entries(shared.server, "a")) == {okey(keys[1]).object_id}


@pytest.mark.anyio
async def test_a_restore_on_another_node_quarantines_what_a_node_saved_damaged(
    shared: Shared,
) -> None:
    """Node a saves 4 chunks through an engine; one is damaged on disk; node b's engine,
    whose read fails and whose fresh read proves it, moves it (only it) to quarantine/."""
    layout = bsr.StateLayout(64, (bsr.StateGroup("kv", 2, 256, dtype="uint8"),))
    tokens = torch.arange(256)
    src = bsr.PagedKVCache(layout, 16, 16)
    src.tensor("kv").random_(0, 255, generator=torch.Generator().manual_seed(0))
    dst = bsr.PagedKVCache(layout, 16, 16)
    ids = torch.arange(16)

    def engine(tier: bsr.Tier) -> bsr.RestoreEngine:
        return bsr.RestoreEngine(layout, [tier], window=2, io_depth=2, namespace=bsr.Namespace("n"))

    async with engine(node_tier(shared.a, "a", 1 << 20)) as e:
        await e.save(tokens, src, ids)
    ns = bsr.Namespace("n").fingerprint(layout)
    chunks = [okey(k).object_id for k in bsr.chunk_keys(ns, tokens.tolist(), 64)]
    files = set(on_disk(shared.server))
    assert files == set(chunks)
    victim = chunks[2]
    flip_file_byte(shared.server / "objects" / victim[:2] / f"{victim}.bsr", HEADER_SIZE + 9)
    async with engine(node_tier(shared.b, "b", 1 << 20)) as e:
        res = await e.restore(tokens, dst, ids)
    assert res.quarantined == 1 and res.committed_tokens <= 128, res
    assert set(on_disk(shared.server)) == files - {victim}
    moved = list((shared.server / "quarantine").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(victim), moved


@pytest.mark.anyio
async def test_quarantine_of_an_object_that_reads_well_leaves_it(shared: Shared) -> None:
    """A quarantine asked for an object a fresh read finds intact (a stale view elsewhere)
    moves nothing: the object stays in objects/ and reads back."""
    keys = make_keys(1, model="intact")
    async with node_tier(shared.a, "a") as a, node_tier(shared.b, "b") as b:
        await write_all(a, keys, [0])
        before = on_disk(shared.server)
        await b.quarantine(keys[0], GROUP, "test")  # another node's view
        await a.quarantine(keys[0], GROUP, "test")  # the writer's
        assert on_disk(shared.server) == before
        assert not any((shared.server / "quarantine").iterdir())
        assert a.statistics().quarantined == b.statistics().quarantined == 0
        check_file(shared.server, keys[0], 0)
        await read_back(a, keys[0], 0)
        await read_back(b, keys[0], 0)


# ---------------------------------------------------------------------- configuration
BAD_IDS = ["", "a b", "a/b", "../a", ".a", "-a", "a" * 64, "a\n", "ä", 7, None]


@pytest.mark.parametrize("node", BAD_IDS, ids=repr)
def test_network_mode_needs_a_good_node_id(tmp_path: Path, node: Any) -> None:
    with pytest.raises(bsr.ConfigError) as info:
        bsr.FileTier(tmp_path, 1 << 20, shared="network", node=node)
    assert info.value.fields["key"] == "node"
    with pytest.raises(bsr.ConfigError) as info:
        bsr.FileTierOptions(tmp_path, 1 << 20, shared="network", node=node).build()
    assert info.value.fields["key"] == "node"


def test_node_ids_and_modes_go_together(tmp_path: Path) -> None:
    both: list[dict[str, Any]] = [{"node": "a"}, {"node": "a", "shared": "local"}]
    for kw in both:
        with pytest.raises(bsr.ConfigError, match="shared='network'") as info:
            bsr.FileTier(tmp_path, 1 << 20, **kw)
        assert info.value.fields["key"] == "node"
    with pytest.raises(bsr.ConfigError, match="needs this node's id") as info:
        bsr.FileTier(tmp_path, 1 << 20, shared="network")
    assert info.value.fields["key"] == "node"
    for good in ("a", "0", "host-1.rank_0", "a" * 63):
        assert bsr.FileTier(tmp_path, 1 << 20, shared="network", node=good).options.node == good
    assert not any(tmp_path.iterdir())  # nothing made before open


@pytest.mark.anyio
async def test_local_mode_refuses_a_root_nodes_share(tmp_path: Path) -> None:
    keys = make_keys(1, model="refuse")
    async with node_tier(tmp_path, "a") as a:
        await a.write(keys[0], GROUP, payload(0, SMALL))
    before = tree(tmp_path)
    with pytest.raises(bsr.TierRootError) as info:
        async with bsr.FileTier(tmp_path, 1 << 20):
            pass
    assert info.value.fields["reason"] == "network_root", info.value
    assert tree(tmp_path) == before
    async with node_tier(tmp_path, "a") as a:  # untouched: the node still has its object
        await read_back(a, keys[0], 0)


@pytest.mark.anyio
async def test_network_mode_opens_on_sshfs_where_local_mode_is_refused(shared: Shared) -> None:
    with pytest.raises(bsr.UntrustedRootError):
        async with bsr.FileTier(shared.a, 1 << 20):
            pass
    assert not shared.server.exists()
    async with node_tier(shared.a, "a") as a:
        await a.write(make_keys(1, model="opens")[0], GROUP, payload(0, SMALL))
    assert (shared.server / "nodes" / "a.log").is_file()
    assert len(on_disk(shared.server)) == 1
