"""RedisTier on real redis-server processes (loopback, started and stopped by PID here): the
conformance suite on a server and on a 3-node cluster, hostile values in the store, the fault
ladder (killed, paused with SIGSTOP, restarted empty, full), and a cluster node killed in the
middle of an engine restore. Every failure is a miss or a typed error within a bound, never
wrong bytes.

Skips when redis-server or redis-py is missing, and fails instead under ``CI=true`` (``make
system-deps`` installs the server, ``make setup`` the ``redis`` extra).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import bsr
from bsr.testing import TierConformance, make_keys, payload
from bsr.testing._redis_server import (
    RedisClusterHarness,
    RedisServer,
    redis_problem,
    start_cluster,
    start_server,
)
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, shuffled_blocks, two_group_layout

pytestmark = pytest.mark.timeout(300)
HEADER = bsr.ObjectCodec.HEADER_SIZE
#: the tier's deadline in these tests, and the bound every failure must come within
TIMEOUT_S = 1.0
BOUND_S = 3 * TIMEOUT_S + 5.0


def require_redis() -> None:
    problem = redis_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    require_redis()
    with start_server() as server:
        yield server


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    require_redis()
    with start_server() as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterHarness]:
    require_redis()
    with start_cluster(3) as cluster:
        yield cluster


@pytest.fixture
def fresh_cluster() -> Iterator[RedisClusterHarness]:
    require_redis()
    with start_cluster(3) as cluster:
        yield cluster


def prefix() -> str:
    return f"bsr-test:{uuid.uuid4().hex[:12]}:"


def raw_client(url: str, cluster: bool = False) -> Any:
    import redis
    from redis.cluster import RedisCluster

    if cluster:
        return RedisCluster.from_url(url, socket_timeout=5)
    return redis.Redis.from_url(url, socket_timeout=5)


# ---------------------------------------------------------------------- conformance
class _RawHooks(TierConformance):
    """Damage and seeding hooks that reach the store directly with a plain client."""

    supports_capacity = False  # the server's maxmemory bounds it; capacity_bytes is advisory
    url = ""
    cluster = False
    part_bytes = 64 << 20

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        from bsr.redis import RedisTier

        return RedisTier(
            self.url,
            cluster=self.cluster,
            key_prefix=prefix(),
            capacity_bytes=capacity_bytes,
            part_bytes=self.part_bytes,
            timeout_s=10.0,
        )

    def _get_all(self, tier: bsr.Tier, key: bsr.ChunkKey, group: str) -> list[bytes]:
        """The stored values of ``(key, group)``, first key first (parts until one is absent)."""
        client = raw_client(self.url, self.cluster)
        out = []
        for k in tier.store_keys(key, group, 1 << 10):  # type: ignore[attr-defined]
            v = client.get(k)
            if v is None:
                break
            out.append(v)
        return out

    async def put_raw(self, tier: bsr.Tier, key: bsr.ChunkKey, group: str, blob: bytes) -> bool:
        client = raw_client(self.url, self.cluster)
        client.set(tier.store_keys(key, group)[0], blob)  # type: ignore[attr-defined]
        return True

    async def corrupt_object(
        self, tier: bsr.Tier, key: bsr.ChunkKey, group: str, offset: int
    ) -> bool:
        parts = self._get_all(tier, key, group)
        blob = bytearray(b"".join(parts))
        if offset >= len(blob):
            return False
        blob[offset] ^= 0xFF
        keys = tier.store_keys(key, group, len(parts))  # type: ignore[attr-defined]
        client = raw_client(self.url, self.cluster)
        pos = 0
        for k, p in zip(keys, parts):
            client.set(k, bytes(blob[pos : pos + len(p)]))
            pos += len(p)
        return True

    async def truncate_object(
        self, tier: bsr.Tier, key: bsr.ChunkKey, group: str, size: int
    ) -> bool:
        blob = b"".join(self._get_all(tier, key, group))
        if not 0 <= size < len(blob):
            return False
        client = raw_client(self.url, self.cluster)
        parts = len(self._get_all(tier, key, group))
        client.delete(*tier.store_keys(key, group, parts))  # type: ignore[attr-defined]
        client.set(tier.store_keys(key, group)[0], blob[:size])  # type: ignore[attr-defined]
        return True


class TestRedisConformance(_RawHooks):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> Iterator[None]:
        self.url = redis_server.url
        yield


class TestRedisClusterConformance(_RawHooks):
    """On a 3-node cluster, with small parts, so most objects span several keys on one node."""

    cluster = True
    part_bytes = 3 * 4096

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisClusterHarness) -> Iterator[None]:
        self.url = redis_cluster.url
        yield


# ---------------------------------------------------------------------- behaviour
def make_tier(url: str, **kw: Any) -> Any:
    from bsr.redis import RedisTier

    kw.setdefault("key_prefix", prefix())
    kw.setdefault("timeout_s", TIMEOUT_S)
    return RedisTier(url, **kw)


@pytest.mark.anyio
async def test_parts_of_one_object_share_a_cluster_slot(redis_cluster: RedisClusterHarness) -> None:
    keys = make_keys(8)
    tier = make_tier(redis_cluster.url, cluster=True, part_bytes=8192, timeout_s=10.0)
    async with tier:
        nodes = set()
        for i, k in enumerate(keys):
            assert await tier.write(k, "kv", payload(i, 5 * 8192))
            names = tier.store_keys(k, "kv", 6)
            owners = {redis_cluster.node_for(n).port for n in names}
            assert len(owners) == 1, names  # the hash tag keeps the parts together
            nodes |= owners
            dst = np.zeros(5 * 8192, dtype=np.uint8)
            assert await tier.read_into(k, "kv", dst) == 5 * 8192
            assert dst.tobytes() == payload(i, 5 * 8192).tobytes()
        assert len(nodes) > 1  # and different objects spread over the nodes


@pytest.mark.anyio
async def test_hostile_values_in_the_store_are_typed(redis_server: RedisServer) -> None:
    """Wrong types, short values and evicted parts at bsr's keys: typed errors or misses."""
    keys = make_keys(4)
    client = raw_client(redis_server.url)
    tier = make_tier(redis_server.url, part_bytes=8192)
    async with tier:
        dst = np.zeros(4 * 8192, dtype=np.uint8)
        client.rpush(tier.store_keys(keys[0], "kv")[0], b"x")  # a list, not a string
        with pytest.raises(bsr.TierIOError, match="WRONGTYPE"):
            await tier.read_into(keys[0], "kv", dst)
        client.set(tier.store_keys(keys[1], "kv")[0], b"short")
        with pytest.raises(bsr.ObjectError):
            await tier.read_into(keys[1], "kv", dst)
        assert await tier.write(keys[2], "kv", payload(2, 4 * 8192))
        client.delete(tier.store_keys(keys[2], "kv", 5)[3])  # the server evicted one part
        with pytest.raises(bsr.ObjectNotFoundError):
            await tier.read_into(keys[2], "kv", dst)
        # the first key evicted, parts left over: the object can be written again
        assert await tier.write(keys[3], "kv", payload(3, 4 * 8192))
        client.delete(tier.store_keys(keys[3], "kv")[0])
        assert await tier.write(keys[3], "kv", payload(3, 4 * 8192))
        assert await tier.read_into(keys[3], "kv", dst) == 4 * 8192
        assert dst.tobytes() == payload(3, 4 * 8192).tobytes()
        assert not dst[:0].any()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("url", "http://127.0.0.1:6379"),
        ("url", ""),
        ("key_prefix", "bsr{x}:"),
        ("timeout_s", float("inf")),
        ("timeout_s", 1e10),  # accepted before, then OverflowError when the tier opened
        ("connect_timeout_s", 1e10),
        ("connect_timeout_s", 1e300),
        ("timeout_s", 4294967.8),  # 2**32 ms + 0.5 s: a socket timing out after 0.5 s
        ("part_bytes", 100),
        ("cluster", "yes"),
        ("max_stuck_calls", 0),
    ],
)
def test_options_refused_alike_by_config_and_constructor(key: str, value: Any) -> None:
    from bsr.redis import RedisTier

    base = {"url": "redis://127.0.0.1:6379/0"}
    with pytest.raises(bsr.ConfigError) as config:
        bsr.EngineConfig.from_dict({"tiers": [{"kind": "redis", **base, key: value}]})
    assert config.value.fields["key"] == f"tiers[0].{key}"
    with pytest.raises(bsr.ConfigError) as ctor:
        RedisTier(**{**base, key: value})
    assert ctor.value.fields["key"] == key


def test_redis_kind_comes_from_the_entry_point() -> None:
    from importlib import metadata

    from bsr.redis import RedisTier, RedisTierOptions

    eps = {ep.name: ep.value for ep in metadata.entry_points(group="bsr.tiers")}
    assert eps.get("redis") == "bsr.redis:RedisTierOptions"
    config = bsr.EngineConfig.from_dict(
        {"tiers": [{"kind": "redis", "url": "redis://127.0.0.1:1/0", "cluster": True}]}
    )
    assert config.tiers == (RedisTierOptions(url="redis://127.0.0.1:1/0", cluster=True),)
    (tier,) = config.build_tiers()
    assert isinstance(tier, RedisTier) and tier.options.cluster


# ---------------------------------------------------------------------- evicted parts
PART = 4096


def _stored(client: Any, tier: Any, key: bsr.ChunkKey, parts: int) -> list[bool]:
    return [bool(client.exists(k)) for k in tier.store_keys(key, "kv", parts)]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("size", "gone"),
    [
        (4 * PART, (2,)),  # a middle part of five
        (4 * PART, (1,)),  # the part after the first: read as "truncated" before
        (4 * PART, (1, 2, 3, 4)),  # every part but the first
        (PART, (1,)),  # the last of two
    ],
    ids=["middle", "second", "all-but-first", "last-of-two"],
)
async def test_an_evicted_part_is_a_miss_and_the_object_is_written_again(
    redis_server: RedisServer, size: int, gone: tuple[int, ...]
) -> None:
    """A multi-part object missing any part is a miss (ObjectNotFoundError, not an
    ObjectError), its remaining keys are dropped (its probe misses too), and it can be saved
    again. Before: a missing second part read as a truncated object (quarantined by an
    engine), and the object stayed a probe hit that no save could repair."""
    client = raw_client(redis_server.url)
    tier = make_tier(redis_server.url, part_bytes=PART)
    keys = make_keys(2)
    parts = -(-(size + HEADER) // PART)
    async with tier:
        for i, k in enumerate(keys):
            assert await tier.write(k, "kv", payload(i, size))
            assert all(_stored(client, tier, k, parts))
            client.delete(*[tier.store_keys(k, "kv", parts)[j] for j in gone])
        dst = np.zeros(size, dtype=np.uint8)
        with pytest.raises(bsr.ObjectNotFoundError):
            await tier.read_into(keys[0], "kv", dst)
        assert not dst.any()
        assert not any(_stored(client, tier, keys[0], parts))  # nothing of it is left
        assert await tier.contains_many([bsr.ObjectKey(keys[0], "kv")]) == [False]
        assert await tier.write(keys[0], "kv", payload(0, size))
        # a save finding what is left of an object (never read since) writes it whole again
        assert await tier.contains_many([bsr.ObjectKey(keys[1], "kv")]) == [True]
        assert await tier.write(keys[1], "kv", payload(1, size))
        for i, k in enumerate(keys):
            assert await tier.read_into(k, "kv", dst) == size
            assert dst.tobytes() == payload(i, size).tobytes()
        assert not await tier.write(keys[1], "kv", payload(1, size))  # whole: kept as is


@pytest.mark.anyio
async def test_a_value_cut_short_is_still_a_truncated_object(redis_server: RedisServer) -> None:
    """Only eviction is a miss: a first value shorter than its header says, alone and not a
    part's length (written so by something else), still reads as truncated."""
    client = raw_client(redis_server.url)
    tier = make_tier(redis_server.url, part_bytes=PART)
    (key,) = make_keys(1)
    async with tier:
        assert await tier.write(key, "kv", payload(0, 2 * PART))
        blob = b"".join(client.get(k) for k in tier.store_keys(key, "kv", 3))
        client.delete(*tier.store_keys(key, "kv", 3))
        client.set(tier.store_keys(key, "kv")[0], blob[: HEADER + 100])
        with pytest.raises(bsr.TruncatedObjectError):
            await tier.read_into(key, "kv", np.zeros(2 * PART, dtype=np.uint8))


@pytest.mark.anyio
async def test_an_engine_restoring_an_object_with_an_evicted_part_quarantines_nothing(
    redis_server: RedisServer,
) -> None:
    layout = two_group_layout()  # a kv chunk is 16 KiB: five parts of 4 KiB
    chunks, block_tokens = 4, 8
    tokens = list(range(1000, 1000 + chunks * layout.chunk_tokens))
    num_blocks = 2 * len(tokens) // block_tokens
    src = filled_cache(layout, num_blocks, block_tokens, seed=9)
    ids = shuffled_blocks(num_blocks, len(tokens) // block_tokens, seed=10)
    tier = make_tier(redis_server.url, part_bytes=PART, key_prefix=f"{prefix()}eng:")
    client = raw_client(redis_server.url)
    async with make_engine(layout, [tier], model_id="redis-parts") as eng:
        assert (await eng.save(tokens, src, ids)).chunks == chunks
        key = bsr.chunk_keys(
            bsr.Namespace("redis-parts").fingerprint(layout), tokens, layout.chunk_tokens
        )[1]
        assert client.delete(tier.store_keys(key, "kv", 5)[1]) == 1  # a middle part evicted
        dst = bsr.PagedKVCache(layout, num_blocks, block_tokens)
        r = await eng.restore(tokens, dst, ids)
        assert r.state is bsr.RequestState.INVALIDATED and r.committed_tokens == 0, r
        assert eng.statistics().quarantined == 0, r.errors  # a miss, not a corrupt object
        assert (await eng.save(tokens, src, ids)).ok
        r = await eng.restore(tokens, dst, ids)
        assert r.committed_tokens == len(tokens), r
        assert blocks_equal(layout, src, ids, dst, ids, chunks)


@pytest.mark.anyio
async def test_the_longest_timeouts_accepted_work_against_a_server(
    redis_server: RedisServer,
) -> None:
    """``timeout_s`` and ``connect_timeout_s`` at bsr.MAX_SECONDS: the tier opens, writes,
    reads and closes (the socket takes them, as 1e10 it could not)."""
    from bsr._check import MAX_SECONDS

    (key,) = make_keys(1)
    tier = make_tier(
        redis_server.url, timeout_s=MAX_SECONDS, connect_timeout_s=MAX_SECONDS, part_bytes=PART
    )
    with anyio.fail_after(30):
        async with tier:
            assert await tier.write(key, "kv", payload(0, 3 * PART))
            dst = np.zeros(3 * PART, dtype=np.uint8)
            assert await tier.read_into(key, "kv", dst) == 3 * PART
            assert dst.tobytes() == payload(0, 3 * PART).tobytes()


# ---------------------------------------------------------------------- fault ladder
async def _bounded(coro: Any) -> BaseException | Any:
    t0 = time.monotonic()
    try:
        with anyio.fail_after(BOUND_S):
            out: Any = await coro
    except bsr.BsrError as exc:
        out = exc
    assert time.monotonic() - t0 < BOUND_S
    return out


@pytest.mark.anyio
async def test_fault_ladder_killed_paused_restarted(fresh_redis: RedisServer) -> None:
    keys = make_keys(3)
    n = 3 * 4096
    tier = make_tier(fresh_redis.url)
    async with tier:
        for i, k in enumerate(keys):
            assert await tier.write(k, "kv", payload(i, n))
        objs = [bsr.ObjectKey(k, "kv") for k in keys]
        dst = np.zeros(n, dtype=np.uint8)

        # paused: every call is a timeout within the bound, the buffer untouched
        fresh_redis.pause()
        for call in (
            tier.read_into(keys[0], "kv", dst),
            tier.contains_many(objs),
            tier.write(make_keys(1, model="x")[0], "kv", payload(9, n)),
        ):
            got = await _bounded(call)
            assert isinstance(got, bsr.TierTimeoutError), got
        assert not dst.any()
        fresh_redis.resume()
        with anyio.fail_after(BOUND_S):
            while tier._calls.stuck:  # noqa: ASYNC110 - the abandoned calls return now
                await anyio.sleep(0.02)
        assert await tier.read_into(keys[0], "kv", dst) == n
        assert dst.tobytes() == payload(0, n).tobytes()

        # killed: typed I/O errors (or timeouts) within the bound
        fresh_redis.kill()
        dst[:] = 0
        for call in (tier.read_into(keys[1], "kv", dst), tier.contains_many(objs)):
            got = await _bounded(call)
            assert isinstance(got, (bsr.TierIOError, bsr.TierTimeoutError)), got
        assert not dst.any()

        # restarted empty: misses (or one typed error on a stale connection), never bytes
        fresh_redis.start()
        for k in keys:
            got = await _bounded(tier.read_into(k, "kv", dst))
            assert isinstance(got, (bsr.ObjectNotFoundError, bsr.TierIOError)), got
        assert await tier.contains_many(objs) == [False] * 3
        assert not dst.any()
        assert await tier.write(keys[2], "kv", payload(2, n))
        assert await tier.read_into(keys[2], "kv", dst) == n
        assert dst.tobytes() == payload(2, n).tobytes()


@pytest.mark.anyio
async def test_full_server_is_typed_and_lru_server_evicts(tmp_path: Path) -> None:
    require_redis()
    n = 256 << 10
    for policy in ("noeviction", "allkeys-lru"):
        with start_server(maxmemory="4mb", policy=policy, directory=tmp_path / policy) as server:
            tier = make_tier(server.url, timeout_s=10.0)
            keys = make_keys(40)
            async with tier:
                written = []
                for i, k in enumerate(keys):
                    try:
                        assert await tier.write(k, "kv", payload(i, n))
                        written.append(i)
                    except bsr.TierFullError:
                        assert policy == "noeviction"
                        break
                else:
                    assert policy == "allkeys-lru"
                objs = [bsr.ObjectKey(keys[i], "kv") for i in written]
                present = await tier.contains_many(objs)
                if policy == "noeviction":
                    assert len(written) < len(keys) and all(present)
                else:
                    assert not all(present)  # the server evicted some
                dst = np.zeros(n, dtype=np.uint8)
                for i in written:  # every read is the right bytes or a miss
                    try:
                        assert await tier.read_into(keys[i], "kv", dst) == n
                        assert dst.tobytes() == payload(i, n).tobytes()
                    except bsr.ObjectNotFoundError:
                        assert policy == "allkeys-lru"


# ---------------------------------------------------------------------- cluster, engine
@pytest.mark.anyio
async def test_cluster_node_killed_mid_restore_never_exposes_a_partial_prefix(
    fresh_cluster: RedisClusterHarness,
) -> None:
    layout = two_group_layout()
    chunks, block_tokens = 12, 8
    n_tokens = chunks * layout.chunk_tokens + 5
    num_blocks = 4 * (n_tokens // block_tokens + 1)
    tokens = torch.randint(0, 50_000, (n_tokens,), generator=torch.Generator().manual_seed(5))
    src = filled_cache(layout, num_blocks, block_tokens, seed=3)
    ids = shuffled_blocks(num_blocks, -(-n_tokens // block_tokens), seed=4)

    def engine() -> bsr.RestoreEngine:
        tier = make_tier(fresh_cluster.url, cluster=True, key_prefix="bsr-mid:", timeout_s=2.0)
        return make_engine(
            layout, [tier], window=2, io_depth=1, model_id="redis-mid", deadline_s=30.0
        )

    async with engine() as eng:
        saved = await eng.save(tokens.tolist(), src, ids)
        assert saved.ok and saved.chunks == chunks, saved
        clean = bsr.PagedKVCache(layout, num_blocks, block_tokens)
        r = await eng.restore(tokens.tolist(), clean, ids)
        assert r.committed_tokens == chunks * layout.chunk_tokens, r
        assert blocks_equal(layout, src, ids, clean, ids, chunks)

    # a node holding a later chunk is killed once the first chunk is installed
    tier = eng.tiers[0]
    last_key = bsr.chunk_keys(
        bsr.Namespace("redis-mid").fingerprint(layout), tokens.tolist(), layout.chunk_tokens
    )[chunks - 1]
    victim = fresh_cluster.node_for(tier.store_keys(last_key, "kv")[0])
    killed: list[int] = []

    def kill_once(chunk: int, groups: Any) -> None:
        if not killed:
            victim.kill()
            killed.append(chunk)

    async with engine() as eng:
        dst = bsr.PagedKVCache(layout, num_blocks, block_tokens)
        t0 = time.monotonic()
        r = await eng.restore(tokens.tolist(), dst, ids, on_installed=kill_once)
        assert time.monotonic() - t0 < 30.0 + BOUND_S
        assert killed, r
        detail = f"{r.state} {r.reason} {r.committed_tokens} {r.errors[:3]}"
        # the window (2 slots) cannot have read the last chunk before the first installed:
        # its node is gone, so all-or-nothing vouches for none of the prefix
        assert r.state is bsr.RequestState.INVALIDATED, detail
        assert r.reason is bsr.Reason.READ_FAILED and r.committed_tokens == 0, detail
        assert any("ConnectionError" in e or "timed out" in e for e in r.errors), detail
        assert eng.staging.statistics().in_use == 0


@pytest.mark.anyio
async def test_a_paused_redis_below_the_host_leaves_a_restore_the_hosts_hit(
    fresh_redis: RedisServer,
) -> None:
    """A real paused server (SIGSTOP) below a HostTier that holds the prefix: a restore given a
    deadline waits for the server's lookup the engine's ``probe_share`` of it (the tier's own
    timeout is longer), then commits the host's copy, every byte, within the deadline; the
    server's tier is named as not heard from. Resumed, the next restore hears from it again."""
    layout = two_group_layout()
    n = 4 * layout.chunk_tokens
    toks = np.arange(1, n + 1, dtype=np.int64)
    src = filled_cache(layout, 32, 8, seed=4)
    ids = torch.arange(n // 8)
    host = bsr.HostTier(1 << 24)
    tier = make_tier(fresh_redis.url, timeout_s=60.0)  # the cut, not the tier, ends the wait
    deadline = 4.0
    async with make_engine(layout, [host, tier], model_id="paused", probe_share=0.25) as eng:
        assert (await eng.save(toks, src, ids)).ok
        fresh_redis.pause()
        try:
            dst = bsr.PagedKVCache(layout, 32, 8)
            t0 = time.monotonic()
            with anyio.fail_after(30):  # a hang guard: the bound under test is the deadline
                r = await eng.restore(toks, dst, ids, deadline_s=deadline)
            elapsed = time.monotonic() - t0
        finally:
            fresh_redis.resume()
        assert r.committed and r.committed_tokens == n, r
        assert r.bytes_by_tier.keys() == {host.name} and r.unanswered == (tier.name,)
        assert blocks_equal(layout, src, ids, dst, ids, 4)
        assert 0.9 <= elapsed < deadline, elapsed  # its quarter (1 s) for the server, no more
        with anyio.fail_after(BOUND_S + 30):  # the cut call returns once the server runs
            while tier._calls.stuck:  # noqa: ASYNC110 - the abandoned calls return now
                await anyio.sleep(0.02)
        r = await eng.restore(toks, bsr.PagedKVCache(layout, 32, 8), ids, deadline_s=deadline)
        assert r.committed and r.unanswered == (), r
