"""A process sharing a FileTier root that SIGKILLs itself at a chosen point of the root's
bookkeeping: inside an eviction, a reservation or a commit.

Used by ``tests/tiers/test_file_tier_shared.py``. ``python tests/children/ledger_crasher.py`` is
a zygote (importing bsr takes seconds): for each line ``ROOT CAPACITY FIRST COUNT POINT K`` on
stdin it forks a child that opens ``FileTier(ROOT, CAPACITY)``, arms the crash, writes objects
``FIRST..FIRST+COUNT-1`` (``shared_root_worker``'s objects: 64 KiB on disk each) and exits 0 if
the crash point was never reached. It prints ``forked PID`` at once and ``reaped PID STATUS``
once the child is gone. The zygote starts no thread and no event loop, so forking it is safe.

Crash points (the child kills itself with SIGKILL, the real thing, at the K-th occurrence):

- ``unlinked``: right after it unlinked an object file under the root's lock (inside an
  eviction, before the ledger says so);
- ``ledger``: instead of its K-th write of the ledger (every locked step ends with one: a
  reservation with its evictions, a commit, an eviction's journal);
- ``renamed``: right after a commit renamed its temp file into ``objects/``;
- ``reserved``: once a write's reservation is recorded, before its bytes are written.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import shared_root_worker as srw
import structlog

import bsr
import bsr.tiers.file._ledger as shared_module
import bsr.tiers.file._root as fileroot_module
import bsr.tiers.file._tier as file_module

POINTS = ("unlinked", "ledger", "renamed", "reserved")


class _Os:
    """The os module as one of bsr's modules sees it, with some calls replaced."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def arm(point: str, k: int) -> None:
    seen = [0]

    def hit() -> None:
        seen[0] += 1
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    def unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        os.unlink(name, *args, **kwargs)
        if str(name).endswith(".bsr"):
            hit()

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        hit()
        return os.pwrite(fd, data, offset)

    def replace(*args: Any, **kwargs: Any) -> None:
        os.replace(*args, **kwargs)
        hit()

    hooked, hooked_root = _Os(), _Os()
    if point == "unlinked":
        hooked.unlink = unlink  # type: ignore[attr-defined]
        hooked_root.unlink = unlink  # type: ignore[attr-defined]  # (bsr before the journal)
    elif point == "ledger":
        hooked.pwrite = pwrite  # type: ignore[attr-defined]
    elif point == "renamed":
        hooked.replace = replace  # type: ignore[attr-defined]
    elif point == "reserved":
        writes = getattr(file_module, "FileWrites", None)  # 0.4: the write steps' own class
        cls: Any = writes if writes is not None else file_module.FileTier
        name = next(n for n in ("write_temp", "_write_temp", "_write_file") if hasattr(cls, n))
        inner = getattr(cls, name)

        def data_phase(self: Any, *args: Any) -> Any:
            hit()
            return inner(self, *args)

        setattr(cls, name, data_phase)
    shared_module.os = hooked  # type: ignore[assignment]
    fileroot_module.os = hooked_root  # type: ignore[assignment]


async def run(root: Path, capacity: int, first: int, count: int) -> None:
    async with bsr.FileTier(root, capacity, reader="posix", fsync=False) as tier:
        for i in range(first, first + count):
            await tier.write(srw.key(i), "kv", srw.payload(i))


def serve() -> None:
    for line in sys.stdin:
        root, capacity, first, count, point, k = line.split()
        pid = os.fork()
        if pid == 0:  # child: never return into the loop
            code = 0
            try:
                arm(point, int(k))
                anyio.run(run, Path(root), int(capacity), int(first), int(count))
            except BaseException as exc:
                print(f"crasher failed: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        print(f"forked {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {pid} {status}", flush=True)


if __name__ == "__main__":
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
    )
    serve()
