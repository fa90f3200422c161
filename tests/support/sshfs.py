"""A real network filesystem on loopback: an sshd of the test's own, and sshfs mounts of one
exported directory (each mount a "node": FUSE keeps flock local to each of them).

``SshfsExport(tmp)`` starts ``sshd`` on a free loopback port with keys made for the run (no
password, no PAM), serving only ``tmp/export`` through its internal sftp; ``mount(name)`` mounts
it at ``tmp/<name>`` with ``sshfs``; ``close()`` unmounts every mount (``fusermount -u``, lazily
if busy) and stops the sshd by its own PID. :func:`sshfs_unavailable` says why it cannot run here
(no ``sshd``/``sshfs``/``ssh-keygen``, no ``/dev/fuse``), for a skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


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


class SshfsExport:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.export = tmp / "export"
        self.export.mkdir()
        self.mounts: list[Path] = []
        keys = tmp / "keys"
        keys.mkdir(mode=0o700)
        for name in ("host", "client"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
                check=True,
            )
        self.key = keys / "client"
        self.port = _free_port()
        config = tmp / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\n"
            f"PidFile {tmp / 'sshd.pid'}\nAuthorizedKeysFile {keys / 'client.pub'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "Subsystem sftp internal-sftp\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        # -D: stays in the foreground, so this Popen is the sshd and its PID is ours to stop
        self.sshd = subprocess.Popen(
            [SSHD, "-D", "-f", str(config), "-E", str(tmp / "sshd.log")],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self.sshd.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"sshd did not start: {(tmp / 'sshd.log').read_text(errors='replace')}"
                    ) from None
                time.sleep(0.05)

    def mount(self, name: str) -> Path:
        """A new sshfs mount of the export at ``tmp/<name>`` (one node)."""
        where = self.tmp / name
        where.mkdir()
        opts = (
            f"IdentityFile={self.key},port={self.port},StrictHostKeyChecking=no,"
            "UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR"
        )
        subprocess.run(
            ["sshfs", "-o", opts, f"root@127.0.0.1:{self.export}", str(where)],
            check=True,
            timeout=30,
        )
        self.mounts.append(where)
        return where

    def close(self) -> None:
        fusermount = shutil.which("fusermount") or shutil.which("fusermount3") or "fusermount"
        for where in reversed(self.mounts):
            done = subprocess.run([fusermount, "-u", str(where)], capture_output=True)
            if done.returncode:
                subprocess.run([fusermount, "-u", "-z", str(where)], capture_output=True)
        self.mounts.clear()
        if self.sshd.poll() is None:
            self.sshd.send_signal(signal.SIGTERM)
            try:
                self.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()
