"""Which filesystem a FileTier root lives on, and whether its locks hold across clients.

Where it runs: a FileTier's open (once), in its worker thread.

How it works: a FileTier root coordinates the processes sharing it through ``flock`` on its
ledger (``_ledger``). On a network or FUSE filesystem that lock is often local to each client:
two nodes mounting the same export both get it at once (measured on two sshfs mounts of one
directory), so both would believe they hold the root's lock and the root's ``capacity_bytes``
stops bounding anything. :func:`mount_type` reads the filesystem type of the mount holding a
path from ``/proc/self/mountinfo`` (the deepest mount point above the path's real path);
:func:`locks_untrusted` says whether that type is one whose ``flock`` bsr cannot trust across
clients. A root there is refused unless the caller says otherwise (``trust_locks=True``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ("NETWORK_TYPES", "locks_untrusted", "mount_type", "parse_mountinfo")

#: filesystem types whose flock is not known to be coherent across clients (every ``fuse.*``
#: type too: FUSE keeps flock in the client's kernel unless the filesystem implements it).
#: Shared-disk cluster filesystems whose lock manager makes flock cluster-wide (GFS2, OCFS2)
#: are not in it.
NETWORK_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "lustre", "gpfs", "glusterfs",
        "beegfs", "wekafs", "orangefs", "pvfs2", "afs", "ncpfs", "davfs", "fuse", "fuseblk",
        "sshfs", "virtiofs",
    }
)  # fmt: skip


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``(mount point, filesystem type)`` of every line of a ``/proc/<pid>/mountinfo`` text."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < 5 or sep + 1 >= len(fields):
            continue
        mounts.append((_unescape(fields[4]), fields[sep + 1]))
    return mounts


def mount_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The filesystem type of the mount holding ``path`` (its real path), or ``None`` when
    ``/proc/self/mountinfo`` cannot be read (not Linux)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    real = os.path.realpath(path)
    best, kind = -1, None
    for point, fstype in parse_mountinfo(mountinfo):  # later lines mount over earlier ones
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, kind = len(point), fstype
    return kind


def locks_untrusted(fstype: str | None) -> bool:
    """Whether ``flock`` on a filesystem of this type may be local to each client."""
    if fstype is None:
        return False
    return fstype in NETWORK_TYPES or fstype.startswith(("fuse.", "nfs"))
