"""Several processes on one FileTier root: one capacity, coherent objects, and the CLI's lock.

Each process is ``tests/shared_root_worker.py`` (a FileTier and an engine, driven by commands on
stdin). Before the shared ledger, each process evicted by its own index only, so two writers
filled the directory to twice ``capacity_bytes``, and one never saw what the other saved.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import bsr
from bsr.tiers._fileroot import OBJECTS_DIR

LEDGER_NAME = ".bsr-ledger"  # the root's shared ledger (its flock is the root's mutex)

HERE = Path(__file__).resolve().parents[1]
OBJECT = 64 << 10  # one worker object on disk
CAPACITY = 12 * OBJECT


class Worker:
    """One process with the root open (see shared_root_worker.py)."""

    def __init__(self, root: Path, capacity: int = CAPACITY) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "shared_root_worker.py"), str(root), str(capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.read() == "ready"

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.wait(timeout=30)
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"worker exited ({self.proc.returncode}): {err}")
        return line

    def ask(self, line: str) -> str:
        self.send(line)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def workers(root: Path, n: int = 2, capacity: int = CAPACITY) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        for _ in range(n):
            started.append(Worker(root, capacity))
        yield started
    finally:
        for w in started:
            w.close()


def on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / OBJECTS_DIR).rglob("*.bsr"))


@contextlib.contextmanager
def root_lock(root: Path) -> Iterator[None]:
    """Hold the root's mutex the way a process of bsr does (its ledger's exclusive flock)."""
    fd = os.open(root / LEDGER_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_two_writers_share_one_capacity(tmp_path: Path) -> None:
    """Both write 3x the capacity at once; the directory never holds more than the capacity.

    Before: each process kept its own objects under the capacity, so the directory ended at
    twice the capacity (1.75x was seen with two vLLM servers)."""
    root = tmp_path / "store"
    peaks: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # snapshots under the root's mutex: no rename or unlink is half done
        while not stop.is_set():
            if (root / LEDGER_NAME).exists():
                with root_lock(root):
                    peaks.append(on_disk(root))

    with workers(root) as (a, b):
        w = threading.Thread(target=watch)
        w.start()
        try:
            a.send("write 0 36")
            b.send("write 1000 1036")
            assert (a.read(), b.read()) == ("ok", "ok")
        finally:
            stop.set()
            w.join()
        stats = [w.ask("stats").split() for w in (a, b)]
        assert on_disk(root) <= CAPACITY, on_disk(root) / CAPACITY
        assert peaks and max(peaks) <= CAPACITY, max(peaks) / CAPACITY
        for s in stats:  # what each process saw in the ledger stayed within the capacity too
            assert int(s[3]) <= CAPACITY and int(s[2]) <= CAPACITY
        # both wrote and both evicted: the survivors are the most recent of either
        present_a = a.ask("contains 0 36").split()[1]
        present_b = a.ask("contains 1000 1036").split()[1]
        assert "1" in present_a[-6:] and "1" in present_b[-6:]
        assert present_a.count("1") + present_b.count("1") <= CAPACITY // OBJECT


def test_objects_of_another_process_are_seen_and_evictions_are_misses(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with workers(root) as (a, b):
        assert b.ask("contains 0 4") == "present 0000"
        assert a.ask("write 0 4") == "ok"
        # b opened before a wrote: it sees a's objects (before: its own index only -> 0000)
        assert b.ask("contains 0 4") == "present 1111"
        assert [b.ask(f"read {i}") for i in range(4)] == ["same"] * 4
        # an engine restores what another process's engine saved, byte-exact
        assert a.ask("save 5 7") == "saved 5"
        assert b.ask("restore 5 7") == "restored Committed 80 True"
        # b fills the capacity: a's objects go, and a's reads of them are misses, never bytes
        assert b.ask("write 2000 2012") == "ok"
        assert a.ask("contains 0 4") in ("present 1111", "present 0000")  # a's index may lag
        assert [a.ask(f"read {i}") for i in range(4)] == ["miss"] * 4
        assert on_disk(root) <= CAPACITY


def test_a_process_that_closes_and_reopens_alone_recounts(tmp_path: Path) -> None:
    """The ledger survives its processes; a crash only ever over-counts, and the first process
    to open an unused root recounts from the files."""
    root = tmp_path / "store"
    with workers(root, 1) as (a,):
        assert a.ask("write 0 6") == "ok"
    stale = {"kind": "bsr.FileTier.ledger", "version": 1, "bytes": 999_999_999, "commits": 0}
    (root / LEDGER_NAME).write_text(json.dumps({**stale, "reserved": {"x.tmp": 5}}))
    with workers(root, 1) as (a,):
        objects, nbytes = a.ask("stats").split()[1:3]
        assert int(objects) == 6 and int(nbytes) == on_disk(root) == 6 * OBJECT


@pytest.mark.parametrize("args", [["gc", "--max-bytes", "1"], ["verify", "--quarantine"]])
def test_store_commands_that_change_files_wait_for_the_roots_lock(
    tmp_path: Path, args: list[str]
) -> None:
    """gc and verify --quarantine change objects/ under the same lock as a live engine (they
    ignored it before: an engine mid-write could see its accounting change under it)."""
    root = tmp_path / "store"
    with workers(root, 1) as (a,):
        assert a.ask("write 0 3") == "ok"
        victim = sorted((root / OBJECTS_DIR).rglob("*.bsr"))[0]
        with open(victim, "r+b") as fh:  # a bad payload byte, for verify to quarantine
            fh.seek(5000)
            fh.write(b"\xff\x00")
        with root_lock(root):
            cli = subprocess.Popen(
                [sys.executable, "-m", "bsr", "store", args[0], str(root), *args[1:]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            with pytest.raises(subprocess.TimeoutExpired):
                cli.wait(timeout=5)  # held at the lock (however long it took to start)
            assert victim.exists() and on_disk(root) == 3 * OBJECT
        _, err = cli.communicate(timeout=120)
        assert cli.returncode in (0, 1), err
        assert not victim.exists()
        # the engine's accounting followed: it fills to its capacity again, exactly
        assert a.ask("write 100 112") == "ok"
        stats = a.ask("stats").split()
        assert int(stats[2]) == on_disk(root) <= CAPACITY


def test_in_one_process_two_tiers_on_one_root_share_it_too(tmp_path: Path) -> None:
    from bsr.testing._conformance import make_keys, payload

    keys = make_keys(40)
    size = 64 << 10
    cap = 8 * size

    async def main() -> None:
        async with (
            bsr.FileTier(tmp_path, cap, fsync=False) as t1,
            bsr.FileTier(tmp_path, cap, fsync=False) as t2,
        ):
            async with anyio.create_task_group() as tg:
                for i, k in enumerate(keys):
                    tg.start_soon((t1 if i % 2 else t2).write, k, "kv", payload(i, 60_000))
            assert on_disk(tmp_path) <= cap

    anyio.run(main)
