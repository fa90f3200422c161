"""The loopback Mooncake cluster for tests: a re-export of :mod:`bsr.testing._mooncake_cluster`
(which ``bsr bench --remote mooncake`` uses too) plus its pytest fixtures.

Use :func:`start_cluster` (a context manager) or the fixtures :func:`mooncake_cluster` (module
scope, shared), :func:`fresh_mooncake_cluster` (function scope, for tests that kill processes)
and :func:`frozen_master_cluster` (function scope, for tests that freeze the master).
:func:`require_mooncake` skips when Mooncake is missing, and fails instead when the environment
variable ``CI`` is ``true``.
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
    "frozen_master_cluster",
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


@pytest.fixture
def frozen_master_cluster() -> Iterator[MooncakeCluster]:
    """A cluster of its own for tests that freeze the master (SIGSTOP) and use it after.

    The master drops a client whose last ping is older than its client TTL, and with it the
    client's segment and every object in it. A frozen master's clock keeps running, so when it
    resumes, its monitor thread may run before it has read the pings queued during the freeze:
    with a TTL shorter than the freeze, the memory holder is dropped and the test's objects are
    gone (OBJECT_NOT_FOUND after resume, seen once in CI under load). The TTL here outlasts any
    freeze a test makes.
    """
    require_mooncake()
    with start_cluster(client_ttl_s=600) as cluster:
        yield cluster
