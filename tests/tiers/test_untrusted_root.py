"""A FileTier root on a filesystem whose flock may be local to each client is refused.

Measured here on a real network filesystem (two sshfs mounts of one export over an sshd on
loopback, each mount a "node"): an exclusive flock succeeds on both mounts at once, so two nodes
sharing a root would each hold its lock and fill it past ``capacity_bytes`` together (tried
before this check: two nodes saving 24 MiB each into an 8 MiB root left it at 27.6 MiB). The
root is now refused with ``UntrustedRootError`` before anything is made there, unless the caller
says ``trust_locks=True``; a local root opens as before. The filesystem type comes from
``/proc/self/mountinfo``, parsed here against lines written by hand too.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import anyio
import pytest
import torch

import bsr
from bsr.tiers.file._fstype import locks_untrusted, mount_type, parse_mountinfo
from support.sshfs import SshfsExport

MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:26 / /mnt/nfs rw,relatime shared:9 - nfs4 srv:/export rw,vers=4.2
31 22 0:27 / /mnt/my\040disk rw,relatime - xfs /dev/sdb rw
32 30 0:28 / /mnt/nfs/local rw,relatime - tmpfs tmpfs rw
33 22 0:29 / /lustre rw - lustre 10.0.0.1@tcp:/fs rw
34 22 0:30 / /home/u/remote rw,nosuid - fuse.sshfs u@h:/x rw,user_id=0
35 22 0:31 / /ceph rw - ceph 10.0.0.2:/ rw
"""


@pytest.mark.parametrize(
    ("path", "fstype", "untrusted"),
    [
        ("/var/lib/bsr", "ext4", False),
        ("/mnt/nfs/bsr", "nfs4", True),
        ("/mnt/nfs", "nfs4", True),
        ("/mnt/nfs/local/bsr", "tmpfs", False),  # a local mount inside the NFS one
        ("/mnt/nfsx/bsr", "ext4", False),  # a sibling named like it: not inside
        ("/mnt/my disk/bsr", "xfs", False),  # mountinfo escapes the space
        ("/lustre/scratch/bsr", "lustre", True),
        ("/home/u/remote/kv", "fuse.sshfs", True),
        ("/ceph/kv", "ceph", True),
    ],
)
def test_the_mount_holding_a_path_names_its_filesystem(
    path: str, fstype: str, untrusted: bool
) -> None:
    assert mount_type(path, MOUNTINFO) == fstype
    assert locks_untrusted(fstype) is untrusted


def test_mountinfo_lines_without_a_separator_are_skipped() -> None:
    assert parse_mountinfo("garbage\n" + MOUNTINFO.splitlines()[0]) == [("/", "ext4")]
    assert locks_untrusted(None) is False  # no mountinfo (not Linux): nothing to go by


def test_this_machines_local_root_opens(tmp_path: Path) -> None:
    assert not locks_untrusted(mount_type(tmp_path))

    async def main() -> None:
        async with bsr.FileTier(tmp_path / "root", 1 << 20):
            pass

    anyio.run(main)


def test_flock_on_two_sshfs_mounts_is_taken_by_both(export: SshfsExport) -> None:
    """The premise, measured: FUSE keeps flock local to each mount."""
    a, b = export.mount("node-a"), export.mount("node-b")
    fa = os.open(a / "ledger", os.O_CREAT | os.O_RDWR)
    fb = os.open(b / "ledger", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fa, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fb, fcntl.LOCK_EX | fcntl.LOCK_NB)  # would raise if the lock were shared
    finally:
        os.close(fa)
        os.close(fb)


@pytest.mark.parametrize("options", [False, True], ids=["FileTier", "FileTierOptions"])
def test_a_root_on_sshfs_is_refused_before_anything_is_made(
    export: SshfsExport, options: bool
) -> None:
    node = export.mount("node-a")
    root = node / "bsr"
    tier = bsr.FileTierOptions(root, 1 << 20).build() if options else bsr.FileTier(root, 1 << 20)

    async def main() -> None:
        with pytest.raises(bsr.UntrustedRootError, match="trust_locks=True") as info:
            await tier.open()
        await tier.aclose()
        assert isinstance(info.value, bsr.TierRootError)
        assert info.value.fstype == "fuse.sshfs" and info.value.reason == "untrusted_locks"

    anyio.run(main)
    assert not root.exists() and not (export.export / "bsr").exists()


def test_a_trusted_root_on_sshfs_serves_exact_bytes(export: SshfsExport) -> None:
    """``trust_locks=True`` (one node): save and restore through the network filesystem."""
    node = export.mount("node-a")
    layout = bsr.StateLayout(64, (bsr.StateGroup("kv", 2, 256, dtype="uint8"),))
    tokens = torch.arange(256)
    src = bsr.PagedKVCache(layout, 16, 16)
    src.tensor("kv").random_(0, 255, generator=torch.Generator().manual_seed(0))
    dst = bsr.PagedKVCache(layout, 16, 16)
    ids = torch.arange(16)

    async def main() -> bsr.RestoreResult:
        tier = bsr.FileTier(node / "bsr", 8 << 20, trust_locks=True)
        engine = bsr.RestoreEngine(
            layout, [tier], window=2, io_depth=2, namespace=bsr.Namespace("nfs")
        )
        async with engine as e:
            await e.save(tokens, src, ids)
            return await e.restore(tokens, dst, ids.flip(0))

    res = anyio.run(main)
    assert res.committed_tokens == 256
    assert torch.equal(dst.tensor("kv")[:, ids.flip(0)], src.tensor("kv")[:, ids])
    assert any((export.export / "bsr" / "objects").rglob("*"))  # written through the mount
