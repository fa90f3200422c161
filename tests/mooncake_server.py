"""The loopback Mooncake cluster for tests: a re-export of :mod:`bsr.testing._mooncake_cluster`
(which ``bsr bench --remote mooncake`` uses too) plus its two pytest fixtures.

Use :func:`start_cluster` (a context manager) or the fixtures :func:`mooncake_cluster` (module
scope, shared) and :func:`fresh_mooncake_cluster` (function scope, for tests that kill or freeze
processes). :func:`require_mooncake` skips when Mooncake is missing, and fails instead when the
environment variable ``CI`` is ``true``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bsr.testing._mooncake_cluster import (
    MOONCAKE_REQUIREMENT,
    MooncakeBinaries,
    MooncakeCluster,
    MooncakeUnavailable,
    find_mooncake,
    loopback_shim,
    mooncake_problem,
    require_mooncake,
    start_cluster,
)
from bsr.testing._ports import free_port

__all__ = [
    "MOONCAKE_REQUIREMENT",
    "MooncakeBinaries",
    "MooncakeCluster",
    "MooncakeUnavailable",
    "find_mooncake",
    "free_port",
    "fresh_mooncake_cluster",
    "loopback_shim",
    "mooncake_cluster",
    "mooncake_problem",
    "require_mooncake",
    "start_cluster",
]


@pytest.fixture(scope="module")
def mooncake_cluster() -> Iterator[MooncakeCluster]:
    """A cluster shared by a test module (skips, or fails under CI=true, without Mooncake)."""
    require_mooncake()
    with start_cluster() as cluster:
        yield cluster


@pytest.fixture
def fresh_mooncake_cluster() -> Iterator[MooncakeCluster]:
    """A cluster of its own, for tests that kill or freeze its processes."""
    require_mooncake()
    with start_cluster(client_ttl_s=3) as cluster:
        yield cluster
