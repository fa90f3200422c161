"""A FileTier in network mode whose server dies or hangs under it (sshfs on loopback).

The root is on an sshfs mount of an export served by the test's own sshd
(:class:`support.sshfs.SshfsExport`); the faults are the server's:

- killed (the sshd and its session processes, SIGKILL): reads, probes and restores end by
  their caller's deadline as misses or typed ``TierIOError`` (never a hang, never wrong bytes),
  a restore commits nothing it cannot read and the engine goes on serving;
- started again: the same tier (not reopened) reads its objects exactly again, over a mount
  that reconnects (``reconnect``, ssh keepalives);
- hung (its session processes SIGSTOPped): a read, a probe and a restore each return by their
  deadline (the worker stuck in the kernel is abandoned); continued (SIGCONT), the tier reads
  exactly again.

No timing is asserted: a deadline ends a call or the call ended earlier; a hang guard
(``anyio.fail_after``) or a watchdog that continues a stopped server only catches a hang.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

import bsr
from bsr.tiers.file import gc_store
from bsr.tiers.file._network import read_journal
from children import network_node_worker as nnw
from support.sshfs import SshfsExport

RAW = range(8)  # raw objects each test writes
PROMPTS = (1, 3, 5)  # prompts each test saves (2, 4 and 6 chunks)
DEADLINE_S = 1.0  # the callers' deadline
HANG_GUARD_S = 30.0  # a hang guard around what must end by DEADLINE_S (not a timing assertion)
RECOVERY_S = 30.0
#: a write on a hung server: how long it may hold its caller past DEADLINE_S (a hang guard)
WRITE_WATCHDOG_S = 5.0  # how long a mount may take to read again once its server is back
ROOT = "kv"


@asynccontextmanager
async def stocked(
    mount: Path, reader: str
) -> AsyncIterator[tuple[bsr.FileTier, bsr.RestoreEngine]]:
    """A node's tier on ``mount`` and an engine over it, holding :data:`RAW` and
    :data:`PROMPTS`, each read back exactly once."""
    tier = bsr.FileTier(mount / ROOT, 8 << 20, shared="network", node="n1", reader=reader)
    engine = bsr.RestoreEngine(
        nnw.LAYOUT, [tier], window=2, io_depth=2, namespace=nnw.PREFIX_NAMESPACE
    )
    async with engine:
        for i in RAW:
            assert await tier.write(nnw.key(i), nnw.GROUP, nnw.payload(i))
        for p in PROMPTS:
            src = nnw.filled(p)
            saved = await engine.save(nnw.prompt(p), src, list(range(src.num_blocks)))
            assert saved.ok and saved.chunks == nnw.chunks_of(p)
        for i in RAW:
            assert await read(tier, i) == "exact"
        for p in PROMPTS:
            assert (await restore(engine, p)).committed_tokens == len(nnw.prompt(p))
        yield tier, engine


async def read(tier: bsr.FileTier, i: int, deadline_s: float | None = None) -> str:
    """Read raw object ``i`` (within ``deadline_s``): ``exact``, ``miss``, ``io`` (a
    TierIOError) or ``deadline``; wrong bytes fail the test."""
    want = nnw.payload(i)
    dst = np.zeros(len(want) + 8192, dtype=np.uint8)
    with anyio.move_on_after(DEADLINE_S if deadline_s is None else deadline_s):
        try:
            n = await tier.read_into(nnw.key(i), nnw.GROUP, dst)
        except bsr.ObjectNotFoundError:
            return "miss"
        except bsr.TierIOError:
            return "io"
        assert n == len(want) and np.array_equal(dst[:n], want), f"object {i}: wrong bytes"
        return "exact"
    return "deadline"


async def restore(
    engine: bsr.RestoreEngine, p: int, deadline_s: float | None = None
) -> bsr.RestoreResult:
    """Restore prompt ``p`` into a fresh cache; the blocks it committed must be exact."""
    src = nnw.filled(p)
    dst = bsr.PagedKVCache(nnw.LAYOUT, src.num_blocks, nnw.BLOCK)
    r = await engine.restore(nnw.prompt(p), dst, list(range(src.num_blocks)), deadline_s=deadline_s)
    k = r.committed_tokens // nnw.BLOCK
    assert torch.equal(dst.tensor("kv")[:, :k], src.tensor("kv")[:, :k]), f"prompt {p}"
    return r


def outcome(r: bsr.RestoreResult) -> str:
    return f"{r.state.value}/{r.reason.value} {r.committed_tokens} tokens {list(r.errors)}"


async def probe(tier: bsr.FileTier, keys: list[bsr.ChunkKey]) -> list[bool] | None:
    """``contains_many`` of ``keys`` within the deadline (None: the deadline ended it)."""
    with anyio.move_on_after(DEADLINE_S):
        return await tier.contains_many([bsr.ObjectKey(k, nnw.GROUP) for k in keys])
    return None


async def until_exact(tier: bsr.FileTier, i: int) -> None:
    """Read object ``i`` until it reads exactly (the mount reconnecting, the stuck requests
    draining), at most :data:`RECOVERY_S`; a miss fails (the tier lost it)."""
    with anyio.fail_after(RECOVERY_S):
        while (got := await read(tier, i)) != "exact":
            assert got in ("io", "deadline"), f"object {i} after the server came back: {got}"
            await anyio.sleep(0.1)


async def staging_drained(engine: bsr.RestoreEngine) -> None:
    with anyio.fail_after(RECOVERY_S):
        while engine.staging.statistics().in_use:  # noqa: ASYNC110 - worker threads return it
            await anyio.sleep(0.02)


UNKNOWN = nnw.key(1000)  # never written: a probe of it asks the mount


@pytest.mark.parametrize("reader", ["posix", "auto"])
def test_a_killed_server_ends_reads_probes_and_restores_by_their_deadline(
    export: SshfsExport, reader: str
) -> None:
    mount = export.mount("n1", reconnect=True)

    async def main() -> None:
        async with stocked(mount, reader) as (tier, engine):
            export.stop_server()
            with anyio.fail_after(HANG_GUARD_S):
                reads = [await read(tier, i) for i in RAW]
                assert set(reads) <= {"miss", "io", "deadline"}, reads
                assert "io" in reads or "deadline" in reads, reads  # the outage was met
                assert await probe(tier, [UNKNOWN]) in ([False], None)  # unseen: absent
                first = await restore(engine, PROMPTS[0], DEADLINE_S)
                assert first.committed_tokens == 0, first  # nothing it could read
                # the engine goes on serving: another request, and a save, each end
                second = await restore(engine, PROMPTS[1], DEADLINE_S)
                assert second.committed_tokens == 0, second
                src = nnw.filled(7)
                saved = await engine.save(nnw.prompt(7), src, list(range(src.num_blocks)))
                print(f"server killed: reads {reads}; restores {outcome(first)}, "
                      f"{outcome(second)}; save errors {saved.errors}")  # fmt: skip
                assert not saved.ok, saved  # counted as errors, not raised
            await staging_drained(engine)

    anyio.run(main)


def test_after_the_server_returns_the_same_tier_reads_its_objects_exactly(
    export: SshfsExport,
) -> None:
    mount = export.mount("n1", reconnect=True)

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, engine):
            export.stop_server()
            with anyio.fail_after(HANG_GUARD_S):
                assert await read(tier, RAW[0]) in ("io", "deadline")
                assert (await restore(engine, PROMPTS[0], DEADLINE_S)).committed_tokens == 0
            export.start_server()
            await until_exact(tier, RAW[0])  # the same tier instance: not reopened
            for i in RAW:
                assert await read(tier, i) == "exact", i
            assert await probe(tier, [nnw.key(i) for i in RAW]) == [True] * len(RAW)
            # a prompt this engine did not try while the server was down restores whole
            r = await restore(engine, PROMPTS[1])
            assert r.committed_tokens == len(nnw.prompt(PROMPTS[1])), r
            # one it tried then was retired in this engine (an I/O error: see the report); saved
            # again, it restores whole
            src = nnw.filled(PROMPTS[0])
            await engine.save(nnw.prompt(PROMPTS[0]), src, list(range(src.num_blocks)))
            r = await restore(engine, PROMPTS[0])
            assert r.committed_tokens == len(nnw.prompt(PROMPTS[0])), r
            # and the tier writes again
            assert await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            dst = np.zeros(len(nnw.payload(100)) + 8192, dtype=np.uint8)
            n = await tier.read_into(nnw.key(100), nnw.GROUP, dst)
            assert np.array_equal(dst[:n], nnw.payload(100))

    anyio.run(main)


def test_a_write_after_the_server_returns_is_journaled(export: SshfsExport) -> None:
    mount = export.mount("n1", reconnect=True)
    journal = export.export / ROOT / "nodes" / "n1.log"
    new = bsr.ObjectKey(nnw.key(100), nnw.GROUP).object_id

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, _):
            export.stop_server()
            assert await read(tier, RAW[0]) in ("io", "deadline")
            export.start_server()
            await until_exact(tier, RAW[0])
            assert await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            assert new in tier._space.owned  # type: ignore[union-attr]  # counted in memory
            assert new in read_journal(journal.read_bytes()), "not in the node's journal"

    anyio.run(main)


@pytest.mark.parametrize("reconnect", [False, True], ids=["plain", "reconnect"])
def test_a_hung_server_costs_a_read_a_probe_and_a_restore_their_deadline(
    export: SshfsExport, reconnect: bool
) -> None:
    mount = export.mount("n1", reconnect=reconnect)
    watchdog_fired = threading.Event()

    def watchdog() -> None:  # only if a call hangs past HANG_GUARD_S (then the test fails)
        watchdog_fired.set()
        export.resume_server()

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, engine):
            assert export.pause_server()
            timer = threading.Timer(HANG_GUARD_S, watchdog)
            timer.start()
            try:
                read_hung = await read(tier, RAW[0])
                probe_hung = await probe(tier, [UNKNOWN])
                first = await restore(engine, PROMPTS[0], DEADLINE_S)
                second = await restore(engine, PROMPTS[1], DEADLINE_S)
                src = nnw.filled(7)
                with anyio.move_on_after(DEADLINE_S):  # the engine's save: bounded too
                    await engine.save(nnw.prompt(7), src, list(range(src.num_blocks)))
            finally:
                timer.cancel()
                export.resume_server()
            assert not watchdog_fired.is_set(), "a call hung until the watchdog resumed the server"
            print(f"server hung: read {read_hung}, probe {probe_hung}, restores {outcome(first)}, "
                  f"{outcome(second)}")  # fmt: skip
            # a plain mount hangs until continued; a reconnecting one may give up on the hung
            # connection (keepalives: about 3 s) before the deadline on a slow machine
            assert read_hung in ("deadline", "io"), read_hung
            assert probe_hung in (None, [False]), probe_hung
            for r in (first, second):
                assert r.committed_tokens == 0 or r.reason is bsr.Reason.COMPLETE, r
            await until_exact(tier, RAW[0])
            for i in RAW:
                assert await read(tier, i) == "exact", i
            await staging_drained(engine)
            if read_hung == "deadline":
                assert tier.statistics().abandoned_reads >= 1
            print(f"after: {tier.statistics()}")

    anyio.run(main)


def cut_during(export: SshfsExport, tier: bsr.FileTier, step: str) -> None:
    """Kill the server as ``tier``'s next write reaches ``step`` of its own (its temp file
    created: ``write_temp``), once."""
    writes = tier._writes
    original = getattr(writes, step)

    def cut(*args: object) -> object:
        setattr(writes, step, original)
        export.stop_server()
        return original(*args)

    setattr(writes, step, cut)


def test_a_write_cut_by_the_servers_death_leaves_a_temp_file_the_collector_removes(
    export: SshfsExport,
) -> None:
    """Its reservation is given back; the temp file it could not remove (the server was gone)
    is a dead writer's, collected by ``gc_store(tmp_age_s=0)``; the object is written again."""
    mount = export.mount("n1", reconnect=True)
    tmp = export.export / ROOT / "tmp"

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, _):
            cut_during(export, tier, "write_temp")
            with anyio.fail_after(HANG_GUARD_S), pytest.raises(OSError):
                await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            assert not tier._space.reserved  # type: ignore[union-attr]
            export.start_server()
            await until_exact(tier, RAW[0])
            assert len(list(tmp.iterdir())) == 1
            report = gc_store(mount / ROOT, 1 << 30, tmp_age_s=0)
            assert report.removed_temps == 1 and not report.removed
            assert not list(tmp.iterdir())
            assert await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            assert await read(tier, 100) == "exact"

    anyio.run(main)


def test_a_write_cut_by_the_servers_death_raises_a_typed_error(export: SshfsExport) -> None:
    mount = export.mount("n1", reconnect=True)

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, _):
            cut_during(export, tier, "write_temp")
            with anyio.fail_after(HANG_GUARD_S), pytest.raises(OSError) as info:
                await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            assert isinstance(info.value, bsr.TierIOError), repr(info.value)

    anyio.run(main)


def test_a_write_whose_connection_breaks_after_its_rename_is_stored_whole(
    export: SshfsExport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temp file is closed before its rename: once renamed, the object is whole and the
    write done, whatever the connection does next (and no descriptor is closed twice)."""
    mount = export.mount("n1", reconnect=True)
    bad_closes: list[int] = []
    real_replace, real_close = os.replace, os.close

    def replace(src: str, dst: str, **kw: int) -> None:  # the object's rename, then the cut
        real_replace(src, dst, **kw)
        if str(src).endswith(".tmp") and "dst_dir_fd" in kw and export.sshd.poll() is None:
            export.stop_server()

    def close(fd: int) -> None:
        try:
            real_close(fd)
        except OSError as exc:
            if exc.errno == errno.EBADF:
                bad_closes.append(fd)
            raise

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, _):
            monkeypatch.setattr(os, "replace", replace)
            monkeypatch.setattr(os, "close", close)
            try:
                with anyio.fail_after(HANG_GUARD_S):
                    assert await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            finally:
                monkeypatch.undo()
            assert not bad_closes, f"descriptors closed twice: {bad_closes}"
            export.start_server()
            await until_exact(tier, 100)

    anyio.run(main)


def test_a_write_whose_close_fails_is_a_typed_error_and_stores_nothing(
    export: SshfsExport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A network filesystem may report a write's failure only when its file is closed (NFS:
    a deferred write-back error): the write fails typed, nothing becomes visible, the temp
    file goes, and its descriptor is closed once."""
    mount = export.mount("n1")
    bad_closes: list[int] = []
    real_close = os.close

    def close(fd: int) -> None:
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            where = ""
        try:
            real_close(fd)  # released, as Linux does even when close fails
        except OSError as exc:
            if exc.errno == errno.EBADF:
                bad_closes.append(fd)
            raise
        if where.endswith(".tmp") and f"/{ROOT}/tmp/" in where:
            raise OSError(errno.EIO, "Input/output error")

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, _):
            monkeypatch.setattr(os, "close", close)
            try:
                with anyio.fail_after(HANG_GUARD_S), pytest.raises(bsr.TierIOError):
                    await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            finally:
                monkeypatch.undo()
            assert not bad_closes, f"descriptors closed twice: {bad_closes}"
            assert not await tier.contains(nnw.key(100), nnw.GROUP)
            assert not tier.object_path(nnw.key(100), nnw.GROUP).exists()
            assert not list((mount / ROOT / "tmp").iterdir())

    anyio.run(main)


def test_a_write_on_a_hung_server_ends_by_its_callers_deadline(export: SshfsExport) -> None:
    mount = export.mount("n1")
    watchdog_fired = threading.Event()

    def watchdog() -> None:
        watchdog_fired.set()
        export.resume_server()

    async def main() -> None:
        async with stocked(mount, "auto") as (tier, _):
            assert export.pause_server()
            timer = threading.Timer(WRITE_WATCHDOG_S, watchdog)
            timer.start()
            try:
                with anyio.move_on_after(DEADLINE_S):
                    await tier.write(nnw.key(100), nnw.GROUP, nnw.payload(100))
            finally:
                timer.cancel()
                export.resume_server()
            assert not watchdog_fired.is_set(), (
                f"a write with a {DEADLINE_S:g} s deadline held its caller until the watchdog "
                f"continued the server ({WRITE_WATCHDOG_S:g} s)"
            )

    anyio.run(main)
