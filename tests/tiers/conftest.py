"""Fixtures of the tier tests: ``export``, a real network filesystem on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.sshfs import SshfsExport, sshfs_export


@pytest.fixture
def export(tmp_path: Path) -> Iterator[SshfsExport]:
    """An sshd of the test's own exporting ``tmp_path/export``; ``export.mount(name)`` makes a
    node (see :class:`support.sshfs.SshfsExport`); skipped where sshfs cannot run."""
    with sshfs_export(tmp_path) as ex:
        yield ex
