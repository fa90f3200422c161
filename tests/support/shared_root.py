"""Processes sharing one FileTier root, for the shared-root tests.

:class:`Worker` drives one ``tests/children/shared_root_worker.py`` process (a FileTier and an
engine on the root, commands on stdin, optionally paused inside its open); :func:`root_lock`
holds the root's mutex the way bsr does; :func:`on_disk` and :func:`ledger` read what the root
holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bsr.tiers.file._root import OBJECTS_DIR

LEDGER_NAME = ".bsr-ledger"  # the root's shared ledger (its flock is the root's mutex)

TESTS = Path(__file__).resolve().parents[1]
WORKER = TESTS / "children" / "shared_root_worker.py"
OBJECT = 64 << 10  # one worker object on disk
CAPACITY = 12 * OBJECT
#: how long a process stopped by a test is left stopped at most (then continued)
WATCHDOG_S = 30.0


class Worker:
    """One process with the root open (see shared_root_worker.py).

    Args:
        pause: ``POINT:K:ACTION``: the open pauses there (see shared_root_worker.py); the
            caller reads ``paused POINT``, ends the pause (:meth:`go`) and reads ``ready``.
        ready: wait for ``ready`` here (without ``pause``).
    """

    def __init__(
        self, root: Path, capacity: int = CAPACITY, *, pause: str = "", ready: bool = True
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(root), str(capacity)] + ([pause] if pause else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        if ready and not pause:
            assert self.read() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

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
                os.kill(self.proc.pid, signal.SIGCONT)  # (a test that failed while it was stopped)
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


def wait_stopped(pid: int) -> None:
    """Return once every thread of ``pid`` is stopped (it SIGSTOPped itself)."""
    from bsr.testing._ports import all_threads_stopped

    for _ in range(3000):
        if all_threads_stopped(pid):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


@contextlib.contextmanager
def watchdog(pid: int) -> Iterator[None]:
    """Continue ``pid`` (SIGCONT) when the block ends, or after :data:`WATCHDOG_S`."""
    timer = threading.Timer(WATCHDOG_S, os.kill, (pid, signal.SIGCONT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


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


def ledger(root: Path) -> dict[str, Any]:
    """The root's ledger, read under its lock."""
    with root_lock(root):
        doc: dict[str, Any] = json.loads((root / LEDGER_NAME).read_text())
    return doc
