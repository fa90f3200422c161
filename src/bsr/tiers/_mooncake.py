"""MooncakeTier: L3, objects in a Mooncake Store cluster (distributed DRAM over TCP or RDMA).

Where it runs: the serving process, talking to a running Mooncake cluster (a ``mooncake_master``
plus processes that contribute memory segments). Every blocking store call runs in a worker
thread under the tier's timeout, so the event loop never blocks on the store and a dead or hung
master surfaces as :class:`~bsr.TierTimeoutError` (or :class:`~bsr.TierIOError` when the store
reports the failure first, e.g. ``RPC_FAIL`` on a reset connection) instead of a hang.

Two ways to connect (exactly one):

- ``master_address="host:port"`` (embedded): this process runs its own Mooncake client and
  transfer engine (``MooncakeDistributedStore.setup``). With ``global_segment_size=0`` (the
  default) it contributes no store memory; objects live in other processes' segments.
- ``client_address="host:port"`` (standalone client): this process attaches to a local
  ``mooncake_client`` process over its RPC port and shared memory
  (``MooncakeDistributedStore.setup_dummy``). No transfer engine runs here and this process
  listens on no port; the ``mooncake_client`` does the transfers.

Mooncake's transfer engine (embedded mode, and every ``mooncake_client``) binds its handshake and
TCP data listeners to all interfaces, whatever ``local_hostname`` says; firewall them.

Stored format: store key ``<key_prefix><object_id>`` (default prefix ``"bsr/"``), value the
4096-byte bsr header followed by the payload (no tail padding: the store keeps exact lengths).

How a read works, and why a timed-out read cannot corrupt a staging slot: the object is fetched
with ``get_into`` into a *tier-private* registered bounce buffer, never into the caller's
buffer. Only after the store call has returned, the header, length and checksum are verified in
the bounce buffer and the payload is copied into ``dst`` (in a worker thread that is never
abandoned: bounded memory work). A store call that times out is abandoned (a thread cannot be
killed): its bounce buffer stays owned by that thread and goes back to the pool only when the
thread returns, so a late transfer can only land in memory nobody else uses. The caller's slot
may be reused right after :class:`~bsr.TierTimeoutError`. The price is one host memcpy of the
payload per read; registering the caller's staging slots for zero-copy reads was rejected
because the tier cannot know when the engine reuses a slot after a timeout.

Writes copy header + payload into a bounce buffer (the checksum is computed on the way), then
``put_from``; an abandoned write therefore never reads the caller's memory after ``write``
returned. Mooncake makes an object visible (``is_exist``/``batch_is_exist``) only once ``PutEnd``
completed, so a probe never sees a partial object.

Quirks of the store hidden here (mooncake-transfer-engine 0.3.13.post1):

- ``put``/``put_from`` on an existing key returns 0 and keeps the old value; :meth:`write`
  therefore checks ``is_exist`` first and returns False (a racing writer of the same key may
  both see "absent"; the first value wins and both report True: same key, same bytes).
- A miss is ``-704`` (``OBJECT_NOT_FOUND``) from ``get_into``; an empty value is refused by the
  store (``-600``) and can never be produced here (the header is always present).
- ``get_into`` into a too-small buffer returns ``-600`` (``INVALID_PARAMS``); the tier then
  fetches the whole object once to tell a too-small destination (:class:`~bsr.ConfigError`, the
  object is kept) from a damaged one (an :class:`~bsr.ObjectError`).
- No space is ``-200`` (``NO_AVAILABLE_HANDLE``) -> :class:`~bsr.TierFullError`.
- ``remove`` without ``force`` fails with ``-706`` (``OBJECT_HAS_LEASE``) for the lease time
  after any probe or read; :meth:`delete` uses ``force=True`` (objects are immutable and every
  read is verified, so a concurrent reader can at worst see a verification failure).
- The master evicts objects on its own (high watermark); a probe hit can become a miss.
  ``statistics()`` counts objects and bytes written (minus deleted) through this tier instance,
  not the cluster's contents.
- ``setup`` (embedded mode) holds the GIL while it connects; with an unreachable master it
  retries for about 90 s. :meth:`open` therefore first checks that the address accepts TCP
  connections, within ``timeout_s``. ``close`` also holds the GIL (0.3 to 1 s measured), so
  :meth:`aclose` stalls the event loop that long: close tiers at shutdown, not per request.
- Bounce buffers are 1 MiB multiples, allocated on demand (registered host memory in embedded
  mode, the client's shared-memory pool in standalone mode) and reused; their number is bounded
  by ``max_inflight`` plus the stuck calls. They are released at :meth:`aclose`.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar, TypeVar

import anyio
import numpy as np

from .._check import Check, host_port, option
from .._errors import (
    ConfigError,
    ObjectNotFoundError,
    TierError,
    TierFullError,
    TierIOError,
    TierTimeoutError,
    TruncatedObjectError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..core._layout import align_up
from ._abandon import AbandonableCalls
from ._base import StorageHooks, Tier, TierUsage
from ._codec import ObjectCodec
from ._reads import Fetched
from ._registry import TierOptions, takes_options
from ._views import as_byte_view, as_payload_view

HEADER_SIZE = ObjectCodec.HEADER_SIZE

T = TypeVar("T")

#: the Mooncake version this tier is written and tested against
MOONCAKE_VERSION = "0.3.13.post1"

_INSTALL_HINT = (
    "install it with: pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1' "
    "(or bsr-kv[mooncake]); the wheel needs the system library libibverbs1 "
    "(apt-get install libibverbs1)"
)

# Mooncake ErrorCode values (mooncake-store/include/types.h)
_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -710: "REPLICA_NOT_FOUND",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
_NOT_FOUND = frozenset({-704, -703, -710, -712})
_FULL = frozenset({-200, -10})
_EXISTS = -705
_INVALID_PARAMS = -600

#: bounce buffer sizes are multiples of this
_BOUNCE_ALIGN = 1 << 20
#: the most bytes the too-small-destination diagnosis will fetch
_MAX_DIAGNOSE_BYTES = 1 << 31


def _code_name(rc: int) -> str:
    return f"{_NAMES.get(rc, 'error')} ({rc})"


@dataclass(eq=False)
class _Bounce:
    """A registered host buffer owned by the tier."""

    ptr: int
    size: int
    array: np.ndarray[Any, np.dtype[np.uint8]]
    owner: Any = None


@dataclass(frozen=True)
class MooncakeTierOptions(TierOptions):
    """A :class:`MooncakeTier`: ``{"kind": "mooncake", "master_address": "host:port"}``.

    The fields are the constructor's parameters (see there).
    """

    kind = "mooncake"
    name: str = option(Check.text, "mooncake")
    _: KW_ONLY
    master_address: str | None = option(Check.optional_address, None)
    client_address: str | None = option(Check.optional_address, None)
    metadata_server: str = option(Check.text, "P2PHANDSHAKE")
    protocol: str = option(Check.one_of("tcp", "rdma"), "tcp")
    rdma_devices: str = option(Check.text_or_blank, "")
    local_hostname: str = option(Check.text, "127.0.0.1")
    global_segment_size: int = option(Check.size_or_zero, 0)
    local_buffer_size: int = option(Check.size, 64 << 20)
    timeout_s: float = option(Check.seconds, 5.0)
    open_timeout_s: float | None = option(Check.optional_seconds, None)
    capacity_bytes: int | None = option(Check.optional_size, None)
    key_prefix: str = option(Check.text, "bsr/")
    max_inflight: int = option(Check.positive_int, 16)
    max_stuck_calls: int = option(Check.positive_int, 16)
    bounce_min_bytes: int = option(Check.size, 1 << 20)

    def validate(self) -> None:
        if (self.master_address is None) == (self.client_address is None):
            raise ConfigError(
                "mooncake tier needs exactly one of master_address='host:port' (embedded client) "
                "or client_address='host:port' (a local mooncake_client)",
                key="master_address",
            )

    def build(self) -> Tier:
        return MooncakeTier(**self.arguments())


class MooncakeTier(Tier):
    """L3 tier over a Mooncake Store cluster.

    Args:
        name: tier name used in statistics, logs and ``bytes_by_tier``.
        master_address: ``host:port`` of ``mooncake_master`` (embedded mode).
        client_address: ``host:port`` of a local ``mooncake_client`` (standalone-client mode).
        metadata_server: transfer-engine metadata: ``"P2PHANDSHAKE"`` (no metadata service) or
            an ``http://host:port/metadata`` URL or etcd address (embedded mode).
        protocol: ``"tcp"`` or ``"rdma"`` (embedded mode).
        rdma_devices: RDMA device names, comma separated (``protocol="rdma"``).
        local_hostname: address other nodes reach this client at (embedded mode).
        global_segment_size: bytes of store memory this process contributes (embedded mode;
            default 0: this process holds no objects).
        local_buffer_size: client-side transfer buffer bytes (embedded mode) or shared-memory
            pool bytes (standalone-client mode).
        timeout_s: deadline of every tier call, store round trips and verification included.
        open_timeout_s: deadline of :meth:`open` (connecting a client can take longer than one
            call; default ``max(timeout_s, 30)``).
        capacity_bytes: advisory capacity reported by ``statistics()`` (the store enforces its
            own capacity and eviction; default 0 = unknown).
        key_prefix: prefix of every store key (separates bsr's objects from other users').
        max_inflight: tier calls in progress at once (more wait, within their deadline).
        max_stuck_calls: abandoned (timed-out) store calls still running after which new calls
            fail fast with :class:`~bsr.TierIOError` instead of starting more threads.
        bounce_min_bytes: smallest bounce buffer allocated.
    """

    durable: ClassVar[bool] = False

    @takes_options(MooncakeTierOptions)
    def __init__(self, options: MooncakeTierOptions) -> None:
        o = self.options = options
        super().__init__(o.name)
        self.embedded = o.master_address is not None
        self._address = o.master_address if self.embedded else o.client_address
        self._host, self._port = host_port(
            self._address, "master_address" if self.embedded else "client_address"
        )
        self.metadata_server = o.metadata_server
        self.protocol = o.protocol
        self.rdma_devices = o.rdma_devices
        self.local_hostname = o.local_hostname
        self.global_segment_size = o.global_segment_size
        self.local_buffer_size = o.local_buffer_size
        self.timeout_s = o.timeout_s
        self.open_timeout_s = o.open_timeout_s or max(self.timeout_s, 30.0)
        self.capacity_bytes = o.capacity_bytes or 0
        self.key_prefix = o.key_prefix
        self.max_stuck_calls = o.max_stuck_calls
        self.bounce_min_bytes = o.bounce_min_bytes
        self._store: Any = None
        self._opened = False
        # guards _idle and _all_bounces: worker threads touch them too
        self._lock = threading.Lock()
        self._idle: list[_Bounce] = []
        self._all_bounces: list[_Bounce] = []
        self._ops = anyio.CapacityLimiter(o.max_inflight)
        self._threads = anyio.CapacityLimiter(o.max_inflight + 1)
        self._calls = AbandonableCalls(
            limiter=self._threads, max_stuck=o.max_stuck_calls, too_many=self._unresponsive
        )
        self._objects = 0
        self._bytes = 0

    # ------------------------------------------------------------------ helpers
    @property
    def address(self) -> str:
        """The master (embedded) or mooncake_client (standalone) address."""
        assert self._address is not None
        return self._address

    def store_key(self, key: ChunkKey, group: str) -> str:
        """The Mooncake key under which ``(key, group)`` is stored."""
        return self.key_prefix + ObjectKey(key, group).object_id

    def storage_hooks(self) -> StorageHooks:
        return _MooncakeStorage(self)

    def usage(self) -> TierUsage:
        return TierUsage(self._objects, self._bytes, self.capacity_bytes)

    def _ctx(self, okey: ObjectKey) -> dict[str, Any]:
        return {"tier": self.name, "key": okey.chunk.hex[:16], "group": okey.group}

    def _error(self, rc: int, op: str, okey: ObjectKey | None) -> TierError:
        """The typed error for a negative store return code."""
        ctx: dict[str, Any] = self._ctx(okey) if okey is not None else {"tier": self.name}
        ctx["code"] = rc
        if rc in _NOT_FOUND:
            return ObjectNotFoundError(
                f"object not in the Mooncake store ({_code_name(rc)})", **ctx
            )
        if rc in _FULL:
            return TierFullError(
                f"Mooncake store has no space for the object ({_code_name(rc)}); add segments "
                "to the cluster or lower the eviction high watermark",
                **ctx,
            )
        if rc == -901:
            return TierTimeoutError(
                f"Mooncake {op}: master RPC timed out ({_code_name(rc)})", **ctx
            )
        if rc == -900:
            return TierIOError(
                f"Mooncake {op}: master at {self.address if self.embedded else 'the cluster'} is "
                f"unreachable ({_code_name(rc)})",
                **ctx,
            )
        return TierIOError(f"Mooncake {op} failed: {_code_name(rc)}", **ctx)

    @contextlib.contextmanager
    def _deadline(
        self, op: str, okey: ObjectKey | None = None, *, timeout_s: float | None = None
    ) -> Iterator[None]:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            with anyio.fail_after(limit):
                yield
        except TierError:
            raise
        except TimeoutError:
            self._counters.errors += 1
            ctx = self._ctx(okey) if okey is not None else {"tier": self.name}
            raise TierTimeoutError(
                f"Mooncake {op} did not finish within {limit:g} s; check that the master "
                f"and the memory-holding clients are alive, or raise timeout_s",
                **ctx,
            ) from None

    def _unresponsive(self, stuck: int) -> TierError:
        self._count(errors=1)
        return TierIOError(
            f"Mooncake store is unresponsive: {stuck} timed-out calls are still running; "
            "check the master and the memory-holding clients",
            tier=self.name,
        )

    async def _blocking(
        self, fn: Callable[[], T], *, cleanup: Callable[[], None] | None = None
    ) -> T:
        """Run a store call in a worker thread that is abandoned on cancellation.

        ``cleanup`` runs exactly once after the call unless the call returns normally: by the
        worker thread when it finishes after being abandoned, else right here.
        """
        return await self._calls.run(fn, release=cleanup)

    async def _cpu(self, fn: Callable[[], T]) -> T:
        """Bounded memory work in a worker thread that is never abandoned."""
        return await anyio.to_thread.run_sync(fn, limiter=self._threads)

    def _require_store(self) -> Any:
        self._check_open()
        if self._store is None:
            raise ConfigError(
                f"tier {self.name!r} is not open; use 'async with tier:' or 'await tier.open()'"
            )
        return self._store

    # ------------------------------------------------------------------ bounce buffers
    async def _acquire(self, nbytes: int) -> _Bounce:
        with self._lock:
            fits = [b for b in self._idle if b.size >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.size)
                self._idle.remove(best)
                return best
        size = max(self.bounce_min_bytes, align_up(nbytes, _BOUNCE_ALIGN))
        return await self._allocate(size)

    async def _allocate(self, size: int) -> _Bounce:
        store = self._store
        if self.embedded:
            array = np.empty(size, dtype=np.uint8)
            bounce = _Bounce(int(array.ctypes.data), size, array)
        else:
            ptr = int(await self._blocking(lambda: store.alloc_from_mem_pool(size)))
            if ptr == 0:
                self._counters.errors += 1
                raise TierIOError(
                    f"mooncake_client at {self.address} could not allocate {size} bytes of shared "
                    "memory; raise local_buffer_size or free memory",
                    tier=self.name,
                )
            raw = (ctypes.c_ubyte * size).from_address(ptr)
            array = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
            bounce = _Bounce(ptr, size, array, raw)
        rc = int(await self._blocking(lambda: store.register_buffer(bounce.ptr, size)))
        if rc != 0:
            self._counters.errors += 1
            raise TierIOError(
                f"Mooncake register_buffer of {size} bytes failed ({rc})", tier=self.name
            )
        with self._lock:
            self._all_bounces.append(bounce)
        return bounce

    def _release(self, bounce: _Bounce) -> None:
        """Return a bounce buffer to the pool (thread-safe; called from worker threads too)."""
        with self._lock:
            self._idle.append(bounce)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self._check_open()
        if self._opened:
            return
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError(
                f"MooncakeTier needs the Mooncake store package: {exc}; {_INSTALL_HINT}"
            ) from exc
        with self._deadline("open", timeout_s=self.open_timeout_s):
            try:
                stream = await anyio.connect_tcp(self._host, self._port)
            except OSError as exc:
                self._counters.errors += 1
                role = "master" if self.embedded else "mooncake_client"
                raise TierIOError(
                    f"cannot reach the Mooncake {role} at {self.address}: {exc}; start it or fix "
                    f"{'master_address' if self.embedded else 'client_address'}",
                    tier=self.name,
                ) from exc
            await stream.aclose()
            store = MooncakeDistributedStore()
            if self.embedded:
                rc = await self._blocking(
                    lambda: store.setup(
                        self.local_hostname,
                        self.metadata_server,
                        self.global_segment_size,
                        self.local_buffer_size,
                        self.protocol,
                        self.rdma_devices,
                        self.address,
                    )
                )
            else:
                rc = await self._blocking(
                    lambda: store.setup_dummy(
                        self.local_buffer_size, self.local_buffer_size, self.address
                    )
                )
        if rc != 0:
            self._counters.errors += 1
            raise TierIOError(
                f"Mooncake setup against {self.address} failed ({rc}); check the address, the "
                f"metadata server ({self.metadata_server!r}) and the protocol ({self.protocol!r})",
                tier=self.name,
            )
        self._store = store
        self._opened = True
        self._log.info("bsr.tier.mooncake.open", address=self.address, embedded=self.embedded)

    async def aclose(self) -> None:
        if self._closed:
            return
        await super().aclose()
        store, self._store = self._store, None
        if store is None:
            return
        with anyio.move_on_after(self.timeout_s):
            while self._ops.borrowed_tokens:  # noqa: ASYNC110 - calls end within their deadline
                await anyio.sleep(0.005)
        stuck = self._calls.stuck
        with self._lock:
            idle, self._idle = self._idle, []
            self._all_bounces = []
        if stuck:
            # a store call is still running in an abandoned thread: tearing the client down
            # under it could crash the process, so leave the client to the process exit.
            self._log.warning("bsr.tier.mooncake.close_skipped", stuck_calls=stuck)
            return

        def _teardown() -> None:
            for bounce in idle:
                store.unregister_buffer(bounce.ptr)
            store.close()

        try:
            with anyio.fail_after(self.timeout_s):
                await anyio.to_thread.run_sync(_teardown, abandon_on_cancel=True)
        except TimeoutError:
            self._log.warning("bsr.tier.mooncake.close_timeout", timeout_s=self.timeout_s)

    # ------------------------------------------------------------------ core
    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        store = self._require_store()
        if not objects:
            return []
        keys = [self.key_prefix + o.object_id for o in objects]
        with self._deadline("batch_is_exist"):
            async with self._ops:
                codes = await self._blocking(lambda: store.batch_is_exist(keys))
        if len(codes) != len(keys):
            self._counters.errors += 1
            raise TierIOError(
                f"Mooncake batch_is_exist answered {len(codes)} results for {len(keys)} keys",
                tier=self.name,
            )
        bad = [int(c) for c in codes if int(c) < 0]
        if bad:
            self._counters.errors += 1
            raise self._error(bad[0], "batch_is_exist", None)
        return [int(c) == 1 for c in codes]

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        store = self._require_store()
        okey = ObjectKey(key, group)
        skey = self.key_prefix + okey.object_id
        view = as_byte_view(dst)
        out = np.frombuffer(view, dtype=np.uint8)
        cap = HEADER_SIZE + len(view)
        with self._deadline("read", okey):
            async with self._ops:
                bounce = await self._acquire(cap)
                rc = int(
                    await self._blocking(
                        lambda: store.get_into(skey, bounce.ptr, cap),
                        cleanup=lambda: self._release(bounce),
                    )
                )
                try:
                    if rc < 0:
                        if rc in _NOT_FOUND:
                            self._counters.misses += 1
                            raise self._error(rc, "get_into", okey)
                        if rc == _INVALID_PARAMS:
                            await self._diagnose_too_small(store, skey, okey, len(view))
                        self._counters.errors += 1
                        raise self._error(rc, "get_into", okey)

                    def _copy() -> Fetched:  # bounded memory work into dst: never abandoned
                        got = bounce.array[:rc]
                        n = max(0, min(rc - HEADER_SIZE, len(out)))
                        out[:n] = got[HEADER_SIZE : HEADER_SIZE + n]
                        return Fetched(got[:HEADER_SIZE].tobytes(), n, rc)

                    fetched = await self._cpu(_copy)
                finally:
                    self._release(bounce)
        self._counters.hits += 1
        self._counters.reads += 1
        self._counters.bytes_read += fetched.nbytes
        return fetched

    async def _diagnose_too_small(self, store: Any, skey: str, okey: ObjectKey, room: int) -> None:
        """After ``-600`` from get_into: raise the right error for an object larger than ``dst``.

        The object is fetched once into a large enough bounce buffer and its header verified:
        a valid object with a larger payload means the destination is too small (ConfigError,
        the object is fine); anything else is an ObjectError.
        """
        size = int(await self._blocking(lambda: store.get_size(skey)))
        if size < 0:
            if size in _NOT_FOUND:
                self._counters.misses += 1
            else:
                self._counters.errors += 1
            raise self._error(size, "get_size", okey)
        if size <= HEADER_SIZE + room or size > _MAX_DIAGNOSE_BYTES:
            return  # not a size problem we can explain: the caller raises the generic error
        big = await self._acquire(size)
        rc = int(
            await self._blocking(
                lambda: store.get_into(skey, big.ptr, size), cleanup=lambda: self._release(big)
            )
        )
        try:
            if rc < 0:
                if rc in _NOT_FOUND:
                    self._counters.misses += 1
                else:
                    self._counters.errors += 1
                raise self._error(rc, "get_into", okey)
            self._counters.errors += 1
            head = ObjectCodec.decode_header(
                big.array[: min(rc, HEADER_SIZE)], okey, where=self.name
            )
            plen = head.payload_len
            if plen > room:
                raise ConfigError(
                    f"destination holds {room} bytes, object payload is {plen}; pass a buffer "
                    "of the chunk's size",
                    **self._ctx(okey),
                )
            raise TruncatedObjectError(
                f"stored object is {rc} bytes, its header says {HEADER_SIZE + plen}",
                **self._ctx(okey),
            )
        finally:
            self._release(big)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        store = self._require_store()
        okey = ObjectKey(key, group)
        skey = self.key_prefix + okey.object_id
        mv = as_payload_view(payload)
        nbytes = len(mv)
        size = HEADER_SIZE + nbytes
        with self._deadline("write", okey):
            async with self._ops:
                present = int(await self._blocking(lambda: store.is_exist(skey)))
                if present == 1:
                    return False
                if present < 0:
                    self._counters.errors += 1
                    raise self._error(present, "is_exist", okey)
                bounce = await self._acquire(size)

                def _fill() -> None:
                    ObjectCodec.encode_into(okey, mv, bounce.array)

                try:
                    await self._cpu(_fill)
                except BaseException:
                    self._release(bounce)
                    raise
                rc = int(
                    await self._blocking(
                        lambda: store.put_from(skey, bounce.ptr, size),
                        cleanup=lambda: self._release(bounce),
                    )
                )
                self._release(bounce)
        if rc == _EXISTS:
            return False
        if rc != 0:
            self._counters.errors += 1
            raise self._error(rc, "put_from", okey)
        self._objects += 1
        self._bytes += size
        self._counters.writes += 1
        self._counters.bytes_written += nbytes
        self._counters.peak_bytes = max(self._counters.peak_bytes, self._bytes)
        return True

    async def delete(self, key: ChunkKey, group: str) -> bool:
        store = self._require_store()
        okey = ObjectKey(key, group)
        skey = self.key_prefix + okey.object_id
        with self._deadline("delete", okey):
            async with self._ops:
                size = int(await self._blocking(lambda: store.get_size(skey)))
                if size in _NOT_FOUND:
                    return False
                rc = int(await self._blocking(lambda: store.remove(skey, True)))
        if rc in _NOT_FOUND:
            return False
        if rc != 0:
            self._counters.errors += 1
            raise self._error(rc, "remove", okey)
        if size > 0:
            self._objects = max(0, self._objects - 1)
            self._bytes = max(0, self._bytes - size)
        return True

    @staticmethod
    def unique_prefix(base: str = "bsr/") -> str:
        """A fresh key prefix, e.g. to isolate test runs sharing one cluster."""
        return f"{base}{uuid.uuid4().hex[:12]}/"

    def __repr__(self) -> str:
        mode = "master" if self.embedded else "client"
        return f"MooncakeTier(name={self.name!r}, {mode}={self._address!r})"


class _MooncakeStorage:
    """MooncakeTier's :class:`~bsr.tiers._base.StorageHooks`: its values in the store."""

    def __init__(self, tier: MooncakeTier) -> None:
        self._tier = tier

    def peek(self, key: ChunkKey, group: str) -> bytes | None:
        blob = self._tier._require_store().get(self._tier.store_key(key, group))
        return bytes(blob) if blob else None

    def overwrite(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        return self.put_raw(key, group, blob)

    def put_raw(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        store = self._tier._require_store()
        skey = self._tier.store_key(key, group)
        store.remove(skey, True)
        return int(store.put(skey, blob)) == 0
