"""``--remote mooncake``: a loopback Mooncake Store cluster per layout, and tiers on it.

How it works: for each layout the bench starts a fresh cluster on 127.0.0.1 with
:func:`bsr.testing.start_cluster` (``mooncake_master``, a memory-holding
``mooncake_client`` whose segment holds the layout's largest state plus headroom, and a gateway
``mooncake_client``; every server binds loopback only). Each engine gets its own
:class:`~bsr.MooncakeTier` attached to the gateway (standalone-client mode: this process listens
on no port) under one key prefix, so the state saved by one engine is restored by the others.
Objects cross TCP over loopback from the memory holder, then shared memory to this process.
The cluster is stopped (by PID) when the layout is done, also on errors and Ctrl-C.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from bsr import MooncakeTier, StateLayout, Tier

from ..common.stats import BenchError

REMOTE_CHOICES = ("none", "mooncake", "redis")

_MIB = 1 << 20
#: object header and padding allowance per object (headers are far smaller)
_OBJECT_SLACK = 64 * 1024


def _align(n: int, to: int = _MIB) -> int:
    return (n + to - 1) // to * to


def check_available(remote: str) -> None:
    """Raise :class:`BenchError` when ``--remote`` names a tier that cannot run here."""
    if remote == "none":
        return
    if remote not in REMOTE_CHOICES:
        raise BenchError(f"--remote must be one of {', '.join(REMOTE_CHOICES)}, got {remote!r}")
    if remote == "redis":
        from bsr.testing import redis_problem

        problem = redis_problem()
        if problem is not None:
            raise BenchError(f"--remote redis: {problem}; or run with --remote none")
        return
    from bsr.testing import MOONCAKE_REQUIREMENT, mooncake_problem

    problem = mooncake_problem()
    if problem is not None:
        raise BenchError(
            f"--remote mooncake needs a local Mooncake install ({MOONCAKE_REQUIREMENT}): "
            f"{problem}; or run with --remote none"
        )


@dataclass(frozen=True)
class RemoteSizing:
    """Memory of one layout's cluster: the holder's segment and the shared-memory pools."""

    segment_bytes: int
    pool_bytes: int
    max_inflight: int

    @classmethod
    def for_state(cls, layout: StateLayout, max_tokens: int, io_depth: int) -> RemoteSizing:
        chunks = max_tokens // layout.chunk_tokens
        objects = chunks * len(layout.groups)
        state = max_tokens * layout.token_bytes + objects * _OBJECT_SLACK
        # headroom: stay well below the master's eviction high watermark
        segment = max(_align(int(state * 1.5)) + 64 * _MIB, 64 * _MIB)
        inflight = max(8, io_depth)
        largest = _align(layout.chunk_bytes + _OBJECT_SLACK)
        # bounce buffers are pooled per size; allow two per call in flight
        pool = 2 * inflight * largest + 64 * _MIB
        return cls(segment, pool, inflight)

    @property
    def host_bytes(self) -> int:
        """Host memory the cluster and one run's tiers may touch at most (segment + 3 pools)."""
        return self.segment_bytes + 3 * self.pool_bytes


class RemoteCluster:
    """A running loopback cluster and a factory of tiers on it (one key prefix)."""

    tier_name = "mooncake"

    def __init__(self, address: str, sizing: RemoteSizing, pids: dict[str, int]) -> None:
        self.address = address
        self.sizing = sizing
        self.pids = pids
        self.key_prefix = MooncakeTier.unique_prefix()

    def tier(self) -> Tier:
        return MooncakeTier(
            self.tier_name,
            client_address=self.address,
            local_buffer_size=self.sizing.pool_bytes,
            max_inflight=self.sizing.max_inflight,
            timeout_s=60.0,
            key_prefix=self.key_prefix,
        )

    def describe(self) -> dict[str, object]:
        return {
            "tier": "mooncake",
            "transport": "tcp over 127.0.0.1 (standalone mooncake_client gateway)",
            "cluster": "one fresh loopback cluster per layout, stopped after it",
        }


class RedisRemote(RemoteCluster):
    """A running loopback redis-server and a factory of RedisTiers on it (one key prefix)."""

    tier_name = "redis"

    def __init__(self, url: str, sizing: RemoteSizing, pids: dict[str, int]) -> None:
        super().__init__(url, sizing, pids)
        self.key_prefix = f"bsr-bench:{self.key_prefix.split('/')[-2]}:"

    def tier(self) -> Tier:
        from bsr.redis import RedisTier

        return RedisTier(
            self.address,
            self.tier_name,
            key_prefix=self.key_prefix,
            timeout_s=60.0,
            max_inflight=self.sizing.max_inflight,
        )

    def describe(self) -> dict[str, object]:
        return {
            "tier": "redis",
            "transport": "tcp over 127.0.0.1 (redis-py, one GET per object)",
            "cluster": "one fresh loopback redis-server per layout, stopped after it",
        }


@contextlib.contextmanager
def start_remote(sizing: RemoteSizing, kind: str = "mooncake") -> Iterator[RemoteCluster]:
    """Start a loopback store sized by ``sizing``; stop it on exit (errors and Ctrl-C too)."""
    if kind == "redis":
        from bsr.testing import RedisUnavailable, start_redis_server

        try:
            ctx_r = start_redis_server(maxmemory=str(2 * sizing.segment_bytes))
            server = ctx_r.__enter__()
        except (RedisUnavailable, RuntimeError) as exc:
            raise BenchError(f"starting the loopback redis-server failed: {exc}") from exc
        try:
            yield RedisRemote(server.url, sizing, {"redis-server": server.pid})
        except BaseException as exc:
            if not ctx_r.__exit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            ctx_r.__exit__(None, None, None)
        return
    from bsr.testing import MooncakeUnavailable, start_cluster

    try:
        ctx = start_cluster(
            segment_bytes=sizing.segment_bytes,
            gateway_buffer_bytes=sizing.pool_bytes,
            ready_timeout_s=60.0,
        )
        cluster = ctx.__enter__()
    except (MooncakeUnavailable, RuntimeError) as exc:
        raise BenchError(f"starting the loopback Mooncake cluster failed: {exc}") from exc
    try:
        yield RemoteCluster(cluster.client_address, sizing, cluster.pids)
    except BaseException as exc:
        if not ctx.__exit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        ctx.__exit__(None, None, None)
