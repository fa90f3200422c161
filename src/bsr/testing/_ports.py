"""Which process listens on a port: fixtures own the servers they start.

A fixture that starts a server on a port it picked must not take "something answers on the port"
for "my server is up": another process (another test run, a leftover server) may hold that port,
and the fixture would then test against a stranger while its own server died on ``EADDRINUSE``.
:func:`wait_listening` waits until the started process *itself* listens on the port, by its PID,
and says when another process holds the port instead (:class:`PortTaken`), so the fixture can
pick another port and start again.

How it works (Linux): a process's listening sockets are the TCP entries in state LISTEN of
``/proc/<pid>/net/tcp`` and ``tcp6`` (the table of its network namespace) whose socket inode is
one of the process's open file descriptors (``/proc/<pid>/fd/*`` -> ``socket:[inode]``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_LISTEN = "0A"


class PortTaken(RuntimeError):
    """Another process listens on the port a fixture chose; choose another and start again."""

    def __init__(self, port: int, what: str) -> None:
        super().__init__(f"port {port} chosen for {what} is held by another process")
        self.port = port


class ProcessExited(RuntimeError):
    """The started process exited before it listened on its port."""


_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Any:
    """libc's ``prctl`` from the symbols already in this process (no library search at import:
    ``find_library`` would run ``ldconfig``), or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: servers are stopped by the fixtures only
        return None


def dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the server gets SIGKILL when the process
    that started it dies, so a test session killed by a timeout or ``kill -9`` leaves no server
    behind holding ports and memory (Linux ``PR_SET_PDEATHSIG``).

    The signal follows the *thread* that forked, so this is only given for the main thread (a
    worker thread ending would kill the server); elsewhere it is ``None`` and the fixture's own
    stop is the only one.
    """
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def tie() -> None:  # in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the tie took
            os._exit(1)

    return tie


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may take it before it is used:
    start servers with :func:`wait_listening`, and retry on :class:`PortTaken`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports, each free on 127.0.0.1 right now."""
    out: list[int] = []
    while len(out) < n:
        port = free_port()
        if port not in out:
            out.append(port)
    return out


def unheld_ports(n: int) -> list[int]:
    """``n`` distinct ports, each free on 127.0.0.1 now and held by no listener (see
    :func:`free_port`; a port some process listens on is never handed to a server)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port()
        if port not in out and not port_listeners(port):
            out.append(port)
    return out


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in /proc)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                state = fh.read().rsplit(") ", 1)[1][:1]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # the thread exited meanwhile
        if state not in ("T", "t"):
            return False
    return bool(tids)


def _listen_table(pid: int | str) -> Iterator[tuple[int, int]]:
    """``(port, socket inode)`` of every TCP socket in LISTEN in ``pid``'s network namespace."""
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{proto}", encoding="ascii") as fh:
                lines = fh.read().splitlines()[1:]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                yield int(fields[1].rsplit(":", 1)[1], 16), int(fields[9])


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return out
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            out.add(int(target[8:-1]))
    return out


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` itself listens on (empty if it is gone)."""
    inodes = _socket_inodes(pid)
    return {port for port, inode in _listen_table(pid) if inode in inodes}


def port_listeners(port: int) -> set[int]:
    """Socket inodes listening on ``port`` in this process's network namespace (any owner)."""
    return {inode for p, inode in _listen_table("self") if p == port}


def wait_listening(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str],
    port: int,
    deadline: float,
    what: str,
    *,
    poll_s: float = 0.05,
) -> None:
    """Wait until ``proc`` itself listens on ``port`` (``deadline``: ``time.monotonic()``).

    Raises:
        PortTaken: another process listens on ``port`` (``proc`` cannot bind it: pick another).
        ProcessExited: ``proc`` exited first.
        TimeoutError: neither happened by ``deadline``.
    """
    while True:
        if proc.poll() is not None:
            raise ProcessExited(f"{what} exited with code {proc.returncode} during startup")
        if port in listening_ports(proc.pid):
            return
        others = port_listeners(port) - _socket_inodes(proc.pid)
        if others:
            raise PortTaken(port, what)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} (pid {proc.pid}) did not listen on port {port} in time")
        time.sleep(poll_s)


def stop_process(popen: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """Stop a server this process started, by its PID: SIGTERM (after SIGCONT: a frozen process
    cannot handle SIGTERM), then SIGKILL if it has not exited within ``grace_s``."""
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(popen.pid, signal.SIGCONT)
        os.kill(popen.pid, signal.SIGTERM)
    try:
        popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, signal.SIGKILL)
        popen.wait(timeout=grace_s)
