"""RedisTier: objects in a Redis (or Valkey) server or cluster, shared by many serving nodes.

Where it runs: the serving process, talking to a Redis server (``redis://host:port/db``) or a
Redis Cluster (``cluster=True``, the URL of any node). Needs the ``redis`` extra
(``pip install 'bsr-kv[redis]'``: redis-py). Every store call runs in a worker thread through
:class:`bsr.AbandonableCalls` under the tier's ``timeout_s``, so a dead, paused or partitioned
server surfaces as a :class:`~bsr.TierTimeoutError` or :class:`~bsr.TierIOError` within that bound,
never as a hang of the event loop (redis-py's asyncio client would not run on trio).

This module is written only against bsr's public seam (``from bsr import ...``: :class:`~bsr.Tier`,
:class:`~bsr.ObjectCodec`, :class:`~bsr.AbandonableCalls`, :class:`~bsr.TierOptions`, the option
vocabulary and the typed errors); an import-linter contract keeps it so. bsr finds it through the
``bsr.tiers`` entry point group (``kind = "redis"``), as it would find a third party's tier.

How it works:

- Keys. An object ``(key, group)`` is stored under ``<key_prefix>{<object id>}``, its value the
  bsr header and payload as :class:`~bsr.ObjectCodec` encodes them (self-describing and verified
  on every read). An object larger than ``part_bytes`` is split into parts: the first under the
  key above, the others under ``<key_prefix>{<object id>}:<n>``. The ``{...}`` is a Redis
  Cluster hash tag: all parts of one object hash to one slot, so they live on one node and
  multi-key commands on them are allowed and atomic.
- Visible only when complete. A single-part object is written with ``SET ... NX``; a multi-part
  one with ``MSETNX`` over all its keys: Redis applies either command atomically, so a reader
  sees the whole object or nothing, and a second writer of the same object changes nothing and
  gets False. There is no temporary key to rename: the one atomic multi-key write plays the part
  of the rename.
- Probes are one pipelined ``EXISTS`` per object (one round trip per node). A read ``GET``\\ s the
  first key, learns the object's length from its verified header and fetches the other parts with
  one ``MGET``; a part missing (the server evicted it, whichever part it was) is a miss, never a
  short or corrupt object (nothing is quarantined), and the read deletes the object's remaining
  keys, so its probes miss too (a first key left in place would keep the object a probe hit that
  no read can serve). A save that finds some of an object's keys but not all writes it whole
  again. Only a first value shorter than its header says, with no part beside it and not
  ``part_bytes`` long (a value cut short, never something eviction does), is truncated.
- Capacity is the server's own: configure ``maxmemory`` and an eviction policy
  (``allkeys-lru`` for a cache; with ``noeviction`` a full server refuses writes, which this tier
  reports as :class:`~bsr.TierFullError`). A probe hit can become a miss when the server evicts.
  ``capacity_bytes`` is advisory (reported by ``statistics()``); ``statistics()`` counts what this
  tier instance wrote, not the server's contents.
- Errors are typed: a miss is :class:`~bsr.ObjectNotFoundError`, a timeout
  :class:`~bsr.TierTimeoutError`, a refused or lost connection, a cluster that is down or any
  other server error :class:`~bsr.TierIOError`, an out-of-memory refusal
  :class:`~bsr.TierFullError`; bytes that fail verification are an :class:`~bsr.ObjectError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar, TypeVar

import anyio

from bsr import (
    AbandonableCalls,
    Check,
    ChunkKey,
    ConfigError,
    Fetched,
    ObjectCodec,
    ObjectKey,
    ObjectNotFoundError,
    Tier,
    TierError,
    TierFullError,
    TierIOError,
    TierOptions,
    TierTimeoutError,
    TierUsage,
    as_payload_view,
    option,
    takes_options,
)

T = TypeVar("T")

#: the redis-py version this tier is tested against (the ``redis`` extra pins it)
REDIS_PY_VERSION = "8.1.0"
_INSTALL_HINT = f"pip install 'bsr-kv[redis]' (redis=={REDIS_PY_VERSION})"
_SCHEMES = ("redis://", "rediss://", "unix://")
#: the most parts one object may have (part_bytes >= 4 KiB: objects up to 64 MiB at the
#: smallest part size, 512 GiB at the largest); a header claiming more is damaged
_MAX_PARTS = 1 << 14


def _url(value: Any, key: str) -> str:
    text = Check.text(value, key)
    if not text.startswith(_SCHEMES):
        raise ConfigError(
            f"{key} must be a Redis URL such as 'redis://127.0.0.1:6379/0' (or rediss://, "
            f"unix://), got {value!r}",
            key=key,
        )
    return text


_url.takes_string = True  # type: ignore[attr-defined]


def _prefix(value: Any, key: str) -> str:
    text = Check.text(value, key)
    if "{" in text or "}" in text:
        raise ConfigError(
            f"{key} must not contain '{{' or '}}' (the tier puts each object's id in a hash tag "
            f"so its parts stay on one cluster node), got {value!r}",
            key=key,
        )
    return text


_prefix.takes_string = True  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RedisTierOptions(TierOptions):
    """A :class:`RedisTier`: ``{"kind": "redis", "url": "redis://10.0.0.5:6379/0"}``.

    Attributes:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS, ``unix://``); in
            cluster mode the URL of any node.
        name: tier name for statistics, logs and ``bytes_by_tier``.
        cluster: talk to a Redis Cluster (slots discovered from the node at ``url``).
        key_prefix: prefix of every key (separates bsr's objects from other users'); no braces.
        timeout_s: deadline of every tier call (all its round trips and verification).
        connect_timeout_s: deadline of connecting (also bounds :meth:`RedisTier.open`).
        part_bytes: objects larger than this are stored in parts of this size (Redis values hold
            at most 512 MiB; smaller parts spread the load of big objects over time).
        capacity_bytes: advisory capacity reported by ``statistics()`` (the server's
            ``maxmemory`` is the real bound; None: unknown).
        max_inflight: tier calls in progress at once (more wait, within their deadline).
        max_stuck_calls: abandoned (timed-out) calls still running after which new calls fail
            fast with :class:`~bsr.TierIOError`.
    """

    kind = "redis"
    url: str = option(_url)
    name: str = option(Check.text, "redis")
    _: KW_ONLY
    cluster: bool = option(Check.flag, False)
    key_prefix: str = option(_prefix, "bsr:")
    timeout_s: float = option(Check.seconds, 5.0)
    connect_timeout_s: float = option(Check.seconds, 2.0)
    part_bytes: int = option(Check.size, 64 << 20)
    capacity_bytes: int | None = option(Check.optional_size, None)
    max_inflight: int = option(Check.positive_int, 16)
    max_stuck_calls: int = option(Check.positive_int, 16)

    def validate(self) -> None:
        if self.part_bytes < ObjectCodec.HEADER_SIZE or self.part_bytes > 512 << 20:
            raise ConfigError(
                f"part_bytes must be between {ObjectCodec.HEADER_SIZE} and 512 MiB (Redis's "
                f"largest value), got {self.part_bytes}",
                key="part_bytes",
            )

    def build(self) -> Tier:
        return RedisTier(**self.arguments())


class RedisTier(Tier):
    """A tier over a Redis server or cluster (see the module docstring; options as in
    :class:`RedisTierOptions`)."""

    durable: ClassVar[bool] = False  # whether the server persists is its own configuration

    @takes_options(RedisTierOptions)
    def __init__(self, options: RedisTierOptions) -> None:
        o = self.options = options
        super().__init__(o.name)
        self._client: Any = None
        self._errors: Any = None  # the redis.exceptions module, once imported
        self._ops = anyio.CapacityLimiter(o.max_inflight)
        self._calls = AbandonableCalls(
            limiter=anyio.CapacityLimiter(o.max_inflight + 1),
            max_stuck=o.max_stuck_calls,
            too_many=self._unresponsive,
        )
        self._objects = 0
        self._bytes = 0

    # ------------------------------------------------------------------ keys
    def store_keys(self, key: ChunkKey, group: str, parts: int = 1) -> list[str]:
        """The Redis keys of ``(key, group)`` stored in ``parts`` parts (first key first)."""
        head = f"{self.options.key_prefix}{{{ObjectKey(key, group).object_id}}}"
        return [head] + [f"{head}:{i}" for i in range(1, parts)]

    def _head(self, okey: ObjectKey) -> str:
        return f"{self.options.key_prefix}{{{okey.object_id}}}"

    # ------------------------------------------------------------------ plumbing
    def usage(self) -> TierUsage:
        return TierUsage(self._objects, self._bytes, self.options.capacity_bytes or 0)

    def _unresponsive(self, stuck: int) -> TierError:
        self._count(errors=1)
        return TierIOError(
            f"Redis at {self._where()} is unresponsive: {stuck} timed-out calls are still "
            "running; check the server",
            tier=self.name,
        )

    def _where(self) -> str:
        url = self.options.url
        return url.split("@")[-1]  # never log a password

    def _ctx(self, okey: ObjectKey | None) -> dict[str, Any]:
        if okey is None:
            return {"tier": self.name}
        return {"tier": self.name, "key": okey.chunk.hex[:16], "group": okey.group}

    def _typed(self, exc: Exception, op: str, okey: ObjectKey | None) -> TierError:
        errors = self._errors
        ctx = self._ctx(okey)
        if isinstance(exc, errors.TimeoutError):
            return TierTimeoutError(
                f"Redis {op} timed out at {self._where()}: {exc}; check the server", **ctx
            )
        oom = getattr(errors, "OutOfMemoryError", ())
        if isinstance(exc, oom) or (
            isinstance(exc, errors.ResponseError) and str(exc).startswith("OOM")
        ):
            return TierFullError(
                f"Redis at {self._where()} is full ({exc}); raise maxmemory or set an eviction "
                "policy such as allkeys-lru",
                **ctx,
            )
        return TierIOError(
            f"Redis {op} failed at {self._where()}: {type(exc).__name__}: {exc}", **ctx
        )

    @contextlib.contextmanager
    def _deadline(
        self, op: str, okey: ObjectKey | None = None, *, limit: float = 0.0
    ) -> Iterator[None]:
        limit = limit or self.options.timeout_s
        try:
            with anyio.fail_after(limit):
                yield
        except TierError:
            raise
        except TimeoutError:
            self._count(errors=1)
            raise TierTimeoutError(
                f"Redis {op} did not finish within {limit:g} s at {self._where()}; check that "
                "the server is alive, or raise timeout_s",
                **self._ctx(okey),
            ) from None

    async def _call(self, fn: Callable[[], T], op: str, okey: ObjectKey | None = None) -> T:
        """One store call: in a worker thread, abandoned on cancellation, errors typed."""
        errors = self._errors
        try:
            return await self._calls.run(fn)
        except errors.RedisError as exc:
            self._count(errors=1)
            raise self._typed(exc, op, okey) from exc

    def _require(self) -> Any:
        self._check_open()
        if self._client is None:
            raise ConfigError(
                f"tier {self.name!r} is not open; use 'async with tier:' or 'await tier.open()'",
                tier=self.name,
            )
        return self._client

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self._check_open()
        if self._client is not None:
            return
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.cluster import RedisCluster
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigError(f"RedisTier needs redis-py: {exc}; {_INSTALL_HINT}") from exc
        self._errors = redis.exceptions
        o = self.options
        common: dict[str, Any] = {
            "socket_timeout": o.timeout_s,
            "socket_connect_timeout": o.connect_timeout_s,
            # one quick retry (a pooled connection to a restarted server), never a backoff
            # longer than the tier's own deadline
            "retry": Retry(NoBackoff(), 1),
        }

        def connect() -> Any:
            if o.cluster:
                client: Any = RedisCluster.from_url(o.url, require_full_coverage=False, **common)
            else:
                client = redis.Redis.from_url(o.url, **common)
            client.ping()
            return client

        limit = o.connect_timeout_s * (3 if o.cluster else 1) + o.timeout_s
        with self._deadline("connect", limit=limit):
            try:
                self._client = await self._calls.run(connect)
            except redis.exceptions.RedisError as exc:
                self._count(errors=1)
                raise TierIOError(
                    f"cannot reach Redis at {self._where()}: {exc}; start it or fix url",
                    tier=self.name,
                ) from exc
        self._log.info("bsr.tier.redis.open", url=self._where(), cluster=o.cluster)

    async def aclose(self) -> None:
        if self._closed:
            return
        await super().aclose()
        client, self._client = self._client, None
        if client is None or self._calls.stuck:
            return  # a call still runs on the client: leave it to the process exit
        with anyio.move_on_after(self.options.timeout_s):
            await anyio.to_thread.run_sync(client.close, abandon_on_cancel=True)

    # ------------------------------------------------------------------ core
    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        client = self._require()
        if not objects:
            return []
        heads = [self._head(o) for o in objects]

        def probe() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for head in heads:
                pipe.exists(head)
            return list(pipe.execute())

        with self._deadline("EXISTS"):
            async with self._ops:
                found = await self._call(probe, "EXISTS")
        return [bool(n) for n in found]

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        client = self._require()
        okey = ObjectKey(key, group)
        keys = self.store_keys(key, group)

        def fetch() -> bytes | None:
            first: bytes | None = client.get(keys[0])
            if first is None or len(first) < ObjectCodec.HEADER_SIZE:
                return first
            head = ObjectCodec.decode_header(
                first[: ObjectCodec.HEADER_SIZE], okey, where=self.name
            )
            total = ObjectCodec.stored_size(head.payload_len)
            if len(first) >= total:
                return first  # one part (a longer value fails the length check)
            parts = -(-total // len(first))
            if parts > _MAX_PARTS:
                return first  # a forged length: the codec says truncated
            names = self.store_keys(key, group, parts)
            rest = client.mget(names[1:])
            if all(p is None for p in rest) and len(first) != self.options.part_bytes:
                return first  # one value cut short (no part was ever written): truncated
            if any(p is None for p in rest):
                # the server evicted a part (any part: the verified header says the object
                # had these parts): the object is gone, a miss; drop what is left of it
                client.delete(*names)
                return None
            return b"".join([first, *rest])

        with self._deadline("read", okey):
            async with self._ops:
                try:
                    blob = await self._call(fetch, "GET", okey)
                except TierError:
                    raise
                except Exception:  # an ObjectError from the header check
                    self._count(errors=1)
                    raise
                if blob is None:
                    self._count(misses=1)
                    raise ObjectNotFoundError(
                        f"object not in Redis at {self._where()}", **self._ctx(okey)
                    )

                # bounded memory work into the caller's buffer: never abandoned
                fetched = await anyio.to_thread.run_sync(ObjectCodec.copy_out, blob, dst)
        self._count(hits=1, reads=1, bytes_read=fetched.nbytes)
        return fetched

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        client = self._require()
        okey = ObjectKey(key, group)
        mv = as_payload_view(payload)
        part = self.options.part_bytes
        size = ObjectCodec.stored_size(len(mv))
        nparts = max(1, -(-size // part))
        keys = self.store_keys(key, group, nparts)

        def put() -> bool:
            blob = memoryview(ObjectCodec.encode(okey, mv))  # a copy: mv may change after
            if nparts == 1:
                return bool(client.set(keys[0], blob.tobytes(), nx=True))
            mapping = {k: blob[i * part : (i + 1) * part].tobytes() for i, k in enumerate(keys)}
            if client.msetnx(mapping):
                return True
            if client.exists(*keys) == nparts:
                return False  # already stored (kept as is)
            # what is left of an object the server evicted a key of (its first key or any
            # other part): clear it, write again
            client.delete(*keys)
            return bool(client.msetnx(mapping))

        with self._deadline("write", okey):
            async with self._ops:
                new = await self._call(put, "SET", okey)
        if new:
            self._objects += 1
            self._bytes += size
            self._count(writes=1, bytes_written=len(mv))
            self._counters.peak_bytes = max(self._counters.peak_bytes, self._bytes)
        return new

    async def delete(self, key: ChunkKey, group: str) -> bool:
        client = self._require()
        okey = ObjectKey(key, group)
        first = self._head(okey)

        def remove() -> int:
            head = client.getrange(first, 0, ObjectCodec.HEADER_SIZE - 1)
            length = int(client.strlen(first))
            if not length:
                return 0
            parts = 1
            try:
                plen = ObjectCodec.decode_header(head, okey, where=self.name).payload_len
                parts = max(1, -(-ObjectCodec.stored_size(plen) // length))
            except Exception:  # a damaged object: remove its first key (what can be named)
                parts = 1
            removed = int(client.delete(*self.store_keys(key, group, parts)))
            return length if removed else 0

        with self._deadline("delete", okey):
            async with self._ops:
                length = await self._call(remove, "DEL", okey)
        if length:
            self._objects = max(0, self._objects - 1)
            self._bytes = max(0, self._bytes - length)
        return bool(length)

    def __repr__(self) -> str:
        mode = "cluster" if self.options.cluster else "server"
        return f"RedisTier(name={self.name!r}, {mode}={self._where()!r})"
