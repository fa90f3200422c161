"""A FUSE mount that never answers: every stat, open or read under it waits until it is let go.

Import with ``from vllm_connector.hung_mount import HungMount`` (``tests/`` is on the path).
It needs ``/dev/fuse`` and the right to mount (root, or ``CAP_SYS_ADMIN``), nothing else: no
FUSE library, no server process. How it works: ``/dev/fuse`` is opened and the kernel's FUSE
file system is mounted over a directory with that descriptor, and nothing ever reads the
descriptor, so the kernel's first request (``INIT``) is never answered and every request after
it waits for it (a stat of the mount point included). :meth:`release` closes the descriptor:
the connection is aborted, every waiting call fails with ``ENOTCONN`` at once, and the mount is
detached (the directory below it is visible again). The mount is this object's own: it is
released by :meth:`release`, by ``with``, or at the latest when the process exits (the
descriptor closes), and never touches anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path
from typing import Any

MNT_DETACH = 2


class MountRefused(Exception):
    """This machine does not let the test mount FUSE (no /dev/fuse, or not allowed)."""


class HungMount:
    """A hung FUSE mount over ``path`` (an existing directory) until :meth:`release`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._lock = threading.Lock()
        try:
            self._fd: int | None = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise MountRefused(f"cannot open /dev/fuse: {exc}") from None
        opts = f"fd={self._fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
        if self._libc.mount(
            b"bsr-hung", str(self.path).encode(), b"fuse.bsr-hung", ctypes.c_ulong(0),
            opts.encode(),
        ) != 0:  # fmt: skip
            err = ctypes.get_errno()
            os.close(self._fd)
            self._fd = None
            raise MountRefused(f"mount of FUSE over {self.path} refused: {os.strerror(err)}")

    def release(self) -> None:
        """Let every waiting call fail (``ENOTCONN``) and take the mount away (idempotent)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)  # aborts the connection: nothing waits on it any more
        self._libc.umount2(str(self.path).encode(), MNT_DETACH)

    def release_after(self, seconds: float) -> threading.Timer:
        """Release in ``seconds`` (a daemon timer; :meth:`release` stays callable meanwhile)."""
        timer = threading.Timer(seconds, self.release)
        timer.daemon = True
        timer.start()
        return timer

    def __enter__(self) -> HungMount:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
