"""A real network filesystem on loopback: an sshd of the test's own, and sshfs mounts of one
exported directory (each mount a "node": FUSE keeps flock local to each of them).

``SshfsExport(tmp)`` starts ``sshd`` on a free loopback port with keys made for the run (no
password, no PAM), serving only ``tmp/export`` through its internal sftp; ``mount(name)`` mounts
it at ``tmp/<name>`` with ``sshfs``; ``close()`` unmounts every mount (``fusermount -u``, lazily
if busy) and stops the sshd by its own PID. :func:`sshfs_unavailable` says why it cannot run here
(no ``sshd``/``sshfs``/``ssh-keygen``, no ``/dev/fuse``), for a skip with that reason.

Faults of the server, for the tests of a tier under them:

- ``mount(name, reconnect=True)`` mounts with ``-o reconnect`` and ssh keepalives
  (``ServerAliveInterval=1,ServerAliveCountMax=2``): a mount whose connection broke (the server
  killed, or hung for about 3 s) connects again at its next request once the server listens, so
  it recovers; a plain mount (the default) dies with its connection (``ENOTCONN`` ever after).
- ``stop_server()`` kills the sshd (SIGKILL) with every process of its (the session processes,
  each running the sftp server of one mount's connection): requests fail at once (``EIO`` on a
  reconnecting mount, which cannot reach the server). ``start_server()`` starts it again on the
  same port.
- ``pause_server()`` stops (SIGSTOP) the session processes serving the mounts, the listener
  still accepting: requests on those connections hang (a hung server); ``resume_server()``
  continues them. ``close()`` continues them too before unmounting.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
#: sshfs options that let a mount recover after its connection broke (see the module docstring)
RECONNECT_OPTS = "reconnect,ServerAliveInterval=1,ServerAliveCountMax=2"


def sshfs_unavailable() -> str | None:
    """Why sshfs mounts cannot be made here, or ``None``."""
    for tool in ("sshfs", "ssh-keygen", "fusermount"):
        if shutil.which(tool) is None and not (
            tool == "fusermount" and shutil.which("fusermount3")
        ):
            return f"{tool} is not installed (apt-get install sshfs openssh-server)"
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: FUSE is not available in this container"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc`` (``ppid -> [pid]``)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # the name in () may hold spaces
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class SshfsExport:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.export = tmp / "export"
        self.export.mkdir()
        self.mounts: list[Path] = []
        #: session processes stopped by :meth:`pause_server` (continued by resume or close)
        self.paused: list[int] = []
        keys = tmp / "keys"
        keys.mkdir(mode=0o700)
        for name in ("host", "client"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
                check=True,
            )
        self.key = keys / "client"
        self.port = _free_port()
        self.config = tmp / "sshd_config"
        self.config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\n"
            f"PidFile {tmp / 'sshd.pid'}\nAuthorizedKeysFile {keys / 'client.pub'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "Subsystem sftp internal-sftp\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        self.sshd = self._start_sshd()

    def _start_sshd(self) -> subprocess.Popen[bytes]:
        # -D: stays in the foreground, so this Popen is the sshd and its PID is ours to stop
        sshd = subprocess.Popen(
            [SSHD, "-D", "-f", str(self.config), "-E", str(self.tmp / "sshd.log")],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return sshd
            except OSError:
                if sshd.poll() is not None or time.monotonic() > deadline:
                    if sshd.poll() is None:  # stopped by its own PID: nothing else to undo
                        sshd.kill()
                    sshd.wait()
                    log = self.tmp / "sshd.log"
                    why = log.read_text(errors="replace") if log.exists() else f"exit {sshd.poll()}"
                    raise RuntimeError(f"sshd did not start: {why}") from None
                time.sleep(0.05)

    def mount(self, name: str, *, reconnect: bool = False) -> Path:
        """A new sshfs mount of the export at ``tmp/<name>`` (one node); ``reconnect``: one
        that connects again after its connection broke (see the module docstring)."""
        where = self.tmp / name
        where.mkdir()
        opts = (
            f"IdentityFile={self.key},port={self.port},StrictHostKeyChecking=no,"
            "UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR"
        )
        if reconnect:
            opts += f",{RECONNECT_OPTS}"
        subprocess.run(
            ["sshfs", "-o", opts, f"root@127.0.0.1:{self.export}", str(where)],
            check=True,
            timeout=30,
        )
        self.mounts.append(where)
        return where

    # ------------------------------------------------------------------ server faults
    def session_pids(self) -> list[int]:
        """The sshd's session processes (the sftp servers of the mounts' connections)."""
        return _descendants(self.sshd.pid) if self.sshd.poll() is None else []

    def stop_server(self) -> None:
        """Kill the sshd and its session processes (SIGKILL): every connection breaks."""
        if self.sshd.poll() is not None:
            return
        # stop the tree first, until it holds still (no fork between the listing and the
        # kill), then kill it: a killed parent's children would leave its tree (reparented)
        stopped: set[int] = set()
        while True:
            tree = [self.sshd.pid, *_descendants(self.sshd.pid)]
            new = [p for p in tree if p not in stopped]
            if not new:
                break
            _signal(new, signal.SIGSTOP)
            stopped.update(new)
        _signal(sorted(stopped), signal.SIGKILL)
        self.sshd.wait()
        self.paused.clear()

    def start_server(self) -> None:
        """Start the sshd again on the same port (after :meth:`stop_server`)."""
        if self.sshd.poll() is None:
            raise RuntimeError("the sshd is running; stop_server() first")
        self.sshd = self._start_sshd()

    def pause_server(self) -> list[int]:
        """Stop (SIGSTOP) the session processes serving the mounts: a hung server. The
        listener keeps accepting (a mount's reconnect reaches a fresh session). Returns the
        PIDs stopped."""
        pids = [p for p in self.session_pids() if p not in self.paused]
        _signal(pids, signal.SIGSTOP)
        self.paused.extend(pids)
        return pids

    def resume_server(self) -> None:
        """Continue the session processes :meth:`pause_server` stopped."""
        _signal(self.paused, signal.SIGCONT)
        self.paused.clear()

    def close(self) -> None:
        self.resume_server()  # a stopped server would hold the unmounts
        fusermount = shutil.which("fusermount") or shutil.which("fusermount3") or "fusermount"
        for where in reversed(self.mounts):
            done = subprocess.run([fusermount, "-u", str(where)], capture_output=True)
            if done.returncode:
                subprocess.run([fusermount, "-u", "-z", str(where)], capture_output=True)
        self.mounts.clear()
        if self.sshd.poll() is None:
            sessions = _descendants(self.sshd.pid)
            self.sshd.send_signal(signal.SIGTERM)
            try:
                self.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()
            # sessions the unmounts did not end (a lazy unmount's), still sshd's (not a reused PID)
            _signal([p for p in sessions if _comm(p).startswith("sshd")], signal.SIGKILL)


@contextlib.contextmanager
def sshfs_export(tmp: Path) -> Iterator[SshfsExport]:
    """An :class:`SshfsExport` in ``tmp``, closed after (sshd stopped, every mount unmounted);
    the test is skipped, with the reason, where sshfs cannot run here."""
    why = sshfs_unavailable()
    if why:
        pytest.skip(why)
    ex = SshfsExport(tmp)
    try:
        yield ex
    finally:
        ex.close()
