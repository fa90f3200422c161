"""FileTier's writes: an object into a temp file, then renamed into ``objects/`` under the lock.

Where it runs: the tier's worker threads (each step a blocking call the tier's event-loop side
hands over, the locked ones through :class:`~bsr.tiers.file._steps.LockedSteps`).

How it works: a write reserves its bytes in the root's shared ledger (evicting), writes and
fsyncs the object into its reserved temp file with no lock held, then renames it into
``objects/<id[:2]>/`` under the root's lock and fsyncs the directory: a probe never sees a
partial object, and every failure path gives the reservation back and removes the temp file.
"""

from __future__ import annotations

import errno
import os
import time
from typing import TYPE_CHECKING, Any

from ..._errors import ClosedError
from ...core._keys import ObjectKey
from .._codec import ObjectCodec
from .._lru import RoomPending
from ._ledger import Pending
from ._root import DIR_FLAGS, OBJECTS_DIR, Dirs, object_relpath
from ._steps import ROOM_POLL_S

if TYPE_CHECKING:
    from ._tier import FileTier

HEADER_SIZE = ObjectCodec.HEADER_SIZE


class FileWrites:
    """The blocking steps of one :class:`~bsr.FileTier`'s writes."""

    def __init__(self, tier: FileTier) -> None:
        self.tier = tier

    def reserve(self, oid: str, size: int, out: list[Pending]) -> int:
        _, space = self.tier._enter_space()
        try:
            pending, evicted = space.reserve(oid, size)
            out.append(pending)
            return evicted
        finally:
            self.tier._leave()

    def abort(self, pending: Pending) -> None:
        try:
            _, space = self.tier._enter_space()
        except ClosedError:  # closed meanwhile: the temp file, unlocked now, is a dead writer's
            if pending.fd >= 0:
                os.close(pending.fd)
                pending.fd = -1
            return
        try:
            space.abort(pending)
        finally:
            self.tier._leave()

    def write_temp(self, okey: ObjectKey, mv: memoryview, pending: Pending) -> None:
        """Write and fsync the object into its reserved temp file (no lock held)."""
        header = ObjectCodec.header(okey, mv)
        pad = b"\x00" * (ObjectCodec.stored_size(len(mv), padded=True) - HEADER_SIZE - len(mv))
        _write_all(pending.fd, [header, mv, pad])
        if self.tier.fsync:
            os.fsync(pending.fd)

    def commit(self, oid: str, pending: Pending, renamed: list[bool]) -> None:
        """Rename the written temp file into ``objects/`` under the root's lock (RootBusy
        while another process holds it; indexed there too), then fsync the directory;
        ``renamed`` gets whether the object is new to the index."""
        dirs, space = self.tier._enter_space()
        try:
            sub_fd = self._object_dir(dirs, oid[:2])
            try:
                renamed.append(space.commit(pending, oid, sub_fd))
                if self.tier.fsync:
                    os.fsync(sub_fd)
            finally:
                os.close(sub_fd)
        finally:
            self.tier._leave()

    def write_network(self, okey: ObjectKey, blob: bytes, size: int) -> bool:
        """A whole write in network mode, in one (abandonable) worker call: reserve (waiting
        up to ``lock_timeout_s`` for room this node's writes in progress hold), write, commit;
        the temp file removed on any failure. Whether the object is new to the index."""
        tier, oid = self.tier, okey.object_id
        give_up = time.monotonic() + tier.lock_timeout_s
        while True:  # room held by this node's writes in progress comes back as they end
            out: list[Pending] = []
            try:
                evicted = self.reserve(oid, size, out)
                break
            except RoomPending:
                if time.monotonic() >= give_up:
                    where = f"writing {object_relpath(oid)}"
                    raise tier._steps.busy("room_pending", where) from None
                time.sleep(ROOM_POLL_S)
        if evicted:
            tier._count(evictions=evicted)
        renamed: list[bool] = []
        try:
            self.write_temp(okey, memoryview(blob), out[0])
            self.commit(oid, out[0], renamed)
        finally:
            if not renamed:
                self.abort(out[0])
        return renamed[0]

    def _object_dir(self, dirs: Dirs, sub: str) -> int:
        try:
            os.mkdir(sub, 0o755, dir_fd=dirs.objects)
        except FileExistsError:
            pass
        try:
            return os.open(sub, DIR_FLAGS, dir_fd=dirs.objects)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                exc.strerror = (
                    f"{OBJECTS_DIR}/{sub} is not a directory bsr made (a symlink or a file); "
                    "remove it"
                )
            raise


def _write_all(fd: int, bufs: list[Any]) -> None:
    want = sum(len(b) for b in bufs)
    done = 0
    while done < want:
        n = os.writev(fd, bufs)
        done += n
        if done < want:  # partial write: rebuild the remaining buffers
            flat = memoryview(b"".join(bytes(b) for b in bufs))[n:]
            bufs = [flat]
