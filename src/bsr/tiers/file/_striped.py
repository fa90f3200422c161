"""StripedFileTier: one file tier over several roots (devices), objects placed by key hash.

Where it runs: the serving process, like :class:`~bsr.FileTier`: each root is a FileTier of its
own (its own directory, share of the capacity, worker threads and io_uring read depth); bulk
reads run one lane per root on a small thread pool of the tier's.

How it works:

- **Placement** by rendezvous (highest random weight) hashing: an object goes to the root whose
  ``blake2b(root id, object id)`` is highest, a root's id being its path as given. Adding a root
  moves only the objects the new root now wins (about 1/(N+1) of them: those become misses and
  are saved again there); removing one loses only its own objects; the other roots' objects
  stay where they are, and the order of ``paths`` does not matter. A root whose path changes
  (a new mount point) is a new root: its objects are misses, never wrong bytes.
- **Capacity** ``capacity_bytes`` is split evenly (each root holds ``capacity_bytes // N``); a
  root full before the others evicts its own least recently used objects.
- **Bulk reads** (:meth:`read_many_blocking`): the caller's thread takes items from ``begin()``
  and hands each to its root's lane; each lane runs its root's own bulk read (io_uring, up to
  ``ahead`` reads in flight per root) in a thread of the pool; results come back to the
  caller's thread, which calls ``end`` for each, in the order they complete (at most
  ``ahead`` objects in flight in all: the caller's staging slots bound the bytes). The call returns
  only once every lane returned, so no destination is written after it; a request that ends
  (``end`` says stop, or the caller's withdrawal check) stops the lanes from beginning more,
  and what was handed to a lane but not begun there ends as :class:`~bsr.ReadWithdrawnError`.
- **A failed root** (unmounted, EIO, unreadable) fails the reads of its own objects only:
  those end with its error and the engine falls down its ladder for them; the other roots
  serve on.
- Probes, writes, deletes, quarantines and leases go to each object's root (batches split by
  root and run concurrently); usage and statistics are the roots' sums.

``bsr store`` reads each root as the FileTier root it is (``bsr store stats ROOT...`` takes
several); ``bsr store gc --budget`` over all of a stripe's roots collects oldest first across
them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import anyio

from ..._check import Check, option
from ..._errors import ConfigError, ReadWithdrawnError
from ...core._keys import ChunkKey, ObjectKey
from .._abandon import cancel_check, cancellation
from .._base import Medium, StorageHooks, Tier, TierLease, TierStatistics, TierUsage
from .._reads import Begin, Borrowed, End, Fetched, ReadItem
from .._registry import TierOptions, takes_options
from .._watch import ObjectRemoved
from ._tier import FileTier, FileTierOptions

#: lanes per root the pool keeps (restores running at once that each read every root)
LANES_PER_ROOT = 4


def _paths(value: Any, key: str) -> tuple[str, ...]:
    """One or more distinct filesystem paths (a list or tuple)."""
    if isinstance(value, (str, bytes, os.PathLike)) or not isinstance(value, Sequence):
        raise ConfigError(
            f"{key}: give a list of root directories (one per device), got {value!r}", key=key
        )
    paths = tuple(Check.path(p, f"{key}[{i}]") for i, p in enumerate(value))
    if len(paths) < 1:
        raise ConfigError(f"{key}: give at least one root directory", key=key)
    seen: dict[str, int] = {}
    for i, p in enumerate(paths):
        norm = os.path.normpath(os.path.abspath(p))
        if norm in seen:
            raise ConfigError(
                f"{key}[{i}]: {p!r} is the same root as {key}[{seen[norm]}]; give each root once",
                key=key,
            )
        seen[norm] = i
    return paths


def _file_options(value: Any, key: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: give FileTier options as a mapping, got {value!r}", key=key)
    for k in ("path", "capacity_bytes", "name", "kind"):
        if k in value:
            raise ConfigError(
                f"{key}.{k}: set by the striped tier itself (paths, capacity_bytes, name); "
                "remove it",
                key=f"{key}.{k}",
            )
    return dict(value)


@dataclass(frozen=True)
class StripedFileTierOptions(TierOptions):
    """A :class:`StripedFileTier`: ``{"kind": "striped_file", "paths": ["/nvme0/bsr",
    "/nvme1/bsr"], "capacity_bytes": N, "file": {"reader": "uring"}}``."""

    kind = "striped_file"
    #: the roots, one per device (a list or tuple; kept as a tuple of strings)
    paths: Sequence[str | os.PathLike[str]] = option(_paths)
    capacity_bytes: int = option(Check.size)
    _: KW_ONLY
    name: str = option(Check.text, "file")
    #: options of every root's FileTier (``reader``, ``direct_io``, ``shared``, ``node``...)
    file: dict[str, Any] | None = option(_file_options, None)

    def validate(self) -> None:
        if self.capacity_bytes // len(self.paths) < 1:
            raise ConfigError(
                f"capacity_bytes: {self.capacity_bytes} bytes over {len(self.paths)} roots "
                "leaves a root nothing; raise it",
                key="capacity_bytes",
            )
        self.root_options()  # every root's FileTier options check here, named as ours

    def root_options(self) -> list[FileTierOptions]:
        """The FileTier options of each root."""
        share = self.capacity_bytes // len(self.paths)
        out = []
        for i, p in enumerate(self.paths):
            data = {
                **(self.file or {}),
                "path": p,
                "capacity_bytes": share,
                "name": f"{self.name}.{i}",
            }
            out.append(FileTierOptions.from_dict(data, prefix="file."))
        return out

    def build(self) -> Tier:
        return StripedFileTier(**self.arguments())

    def for_rank(self, rank: int, world: int) -> StripedFileTierOptions:
        """Each tensor-parallel rank gets its own directory under every root."""
        if world <= 1:
            return self
        sub = f"rank-{rank}-of-{world}"
        return dataclasses.replace(self, paths=tuple(str(Path(p) / sub) for p in self.paths))


class StripedFileTier(Tier):
    """L2 tier over several roots (devices): see the module docstring.

    Args:
        paths: the root directories, one per device (each a FileTier root: empty, missing or
            claimed before). Objects are placed by rendezvous hashing over these paths as
            given: keep them stable; add or remove roots freely.
        capacity_bytes: the bound on stored bytes over all roots (each root gets an equal
            share).
        name: the tier's name (each root's FileTier is ``<name>.<i>`` in logs).
        file: options of every root's :class:`~bsr.FileTier` (``reader``, ``direct_io``,
            ``read_depth``, ``io_threads``, ``shared``, ``node``...).
    """

    durable = True
    blocking_reads = True
    bulk_reads = True
    medium = Medium.DISK

    @takes_options(StripedFileTierOptions)
    def __init__(self, options: StripedFileTierOptions) -> None:
        super().__init__(options.name)
        self.options = options
        self.roots = tuple(FileTier(**o.arguments()) for o in options.root_options())
        # a root's id is its path as given (normalised: "a/b/" is "a/b")
        self._salts = tuple(
            hashlib.blake2b(os.path.normpath(p).encode(), digest_size=16).digest()
            for p in options.paths
        )
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._unsubscribe: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ placement
    def placement(self, oid: str) -> int:
        """The index of the root object ``oid`` lives in (rendezvous hashing)."""
        if len(self.roots) == 1:
            return 0
        raw = bytes.fromhex(oid)
        best, where = b"", 0
        for i, salt in enumerate(self._salts):
            score = hashlib.blake2b(raw, digest_size=8, key=salt).digest()
            if score > best:
                best, where = score, i
        return where

    def root_of(self, key: ChunkKey, group: str) -> FileTier:
        """The root's FileTier holding (or to hold) ``(key, group)``."""
        return self.roots[self.placement(ObjectKey(key, group).object_id)]

    def object_path(self, key: ChunkKey, group: str) -> Path:
        """Where ``(key, group)`` is (or would be) stored; for tests and tooling."""
        return self.root_of(key, group).object_path(key, group)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self._check_open()
        opened: list[FileTier] = []
        try:
            for t in self.roots:
                await t.open()
                opened.append(t)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for t in opened:
                    await t.aclose()
            raise
        if not self._unsubscribe:
            self._unsubscribe = [t.on_removed(self._forward) for t in self.roots]

    async def aclose(self) -> None:
        await super().aclose()
        for stop in self._unsubscribe:
            stop()
        self._unsubscribe = []
        for t in self.roots:
            await t.aclose()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def _forward(self, ev: ObjectRemoved) -> None:
        self._removed(ev.object_id, ev.cause)

    # ------------------------------------------------------------------ accounting
    def usage(self) -> TierUsage:
        us = [t.usage() for t in self.roots]
        return TierUsage(
            sum(u.objects for u in us), sum(u.bytes for u in us), sum(u.capacity_bytes for u in us)
        )

    def statistics(self) -> TierStatistics:
        """The roots' statistics summed (reads this tier's reader refused counted here)."""
        stats = [t.statistics() for t in self.roots]
        sums = {
            f.name: sum(getattr(s, f.name) for s in stats)
            for f in dataclasses.fields(TierStatistics)
            if f.name != "name"
        }
        sums["errors"] += self._counters.errors
        return TierStatistics(name=self.name, **sums)

    # ------------------------------------------------------------------ per object
    def _split(self, objects: Sequence[ObjectKey]) -> dict[int, list[int]]:
        by_root: dict[int, list[int]] = {}
        for i, o in enumerate(objects):
            by_root.setdefault(self.placement(o.object_id), []).append(i)
        return by_root

    async def _per_root(
        self, objects: Sequence[ObjectKey], call: Callable[[FileTier, list[ObjectKey]], Any]
    ) -> list[bool]:
        """``call(root, its objects)`` for every root holding some, concurrently; the answers
        put back in the objects' order."""
        out = [False] * len(objects)

        async def one(root: int, idx: list[int]) -> None:
            got = await call(self.roots[root], [objects[i] for i in idx])
            for i, v in zip(idx, got):
                out[i] = v

        async with anyio.create_task_group() as tg:
            for root, idx in self._split(objects).items():
                tg.start_soon(one, root, idx)
        return out

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        self._check_open()
        return await self._per_root(objects, lambda t, objs: t.contains_many(objs))

    async def recheck_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        self._check_open()
        return await self._per_root(objects, lambda t, objs: t.recheck_many(objs))

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        return await self.root_of(key, group).fetch_into(key, group, dst)

    def fetch_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        return self.root_of(key, group).fetch_into_blocking(key, group, dst)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._check_open()
        return await self.root_of(key, group).write(key, group, payload)

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._check_open()
        return await self.root_of(key, group).delete(key, group)

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        self._check_open()
        await self.root_of(key, group).quarantine(key, group, reason)

    async def lease(self, objects: Sequence[ObjectKey], ttl_s: float) -> TierLease:
        self._check_open()
        leases = []
        try:
            for root, idx in self._split(objects).items():
                leases.append(await self.roots[root].lease([objects[i] for i in idx], ttl_s))
        except BaseException:
            for held in leases:
                held.release()
            raise
        return _Leases(leases)

    def storage_hooks(self) -> StorageHooks:
        return _StripedStorage(self)

    # ------------------------------------------------------------------ bulk reads
    def _lanes(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=LANES_PER_ROOT * len(self.roots),
                    thread_name_prefix=f"bsr-stripe-{self.name}",
                )
            return self._pool

    def read_many_blocking(self, begin: Begin, end: End, ahead: int, *, lend: bool = False) -> None:
        """Every root's objects read by that root's own bulk read, the roots in parallel (one
        lane each; at most ``ahead`` objects in flight in all, each root's io_uring within its
        own read depth); ``end`` is called on this thread for each item in the order they
        complete. See the module docstring."""
        if len(self.roots) == 1:
            self.roots[0].read_many_blocking(begin, end, ahead, lend=lend)
            return
        run = _StripedRead(self, ahead, lend, cancel_check())
        try:
            run.drive(begin, end)
        except BaseException:
            run.close(early=True)
            raise
        run.close(early=False)


class _Lane:
    """One root's part of a striped bulk read: items handed over by the caller's thread, read
    by the root's own ``read_many_blocking`` in a pool thread while there are any, results
    handed back. A lane holds a pool thread only while it has items (an idle lane leaves, and
    the next item starts it again), so lanes of concurrent reads never wait on each other."""

    def __init__(self, read: _StripedRead, tier: FileTier) -> None:
        self.read = read
        self.tier = tier
        self.lock = threading.Lock()
        self.items: deque[ReadItem] = deque()
        self.running = False
        self.future: concurrent.futures.Future[None] | None = None
        #: what the caller's ``end`` said of this lane's last result
        self.reply: queue.SimpleQueue[bool] = queue.SimpleQueue()

    def is_running(self) -> bool:
        with self.lock:
            return self.running

    def put(self, item: ReadItem) -> None:
        with self.lock:
            self.items.append(item)
            if self.running:
                return
            self.running = True
        self.future = self.read.tier._lanes().submit(self.run)

    def _begin(self, outstanding: dict[int, ReadItem]) -> ReadItem | None:
        if self.read.stopped:
            return None
        with self.lock:
            if not self.items:
                return None
            item = self.items.popleft()
        outstanding[id(item)] = item
        return item

    def run(self) -> None:
        read = self.read
        outstanding: dict[int, ReadItem] = {}  # begun by the root, not ended yet

        def end(item: ReadItem, result: int | Borrowed | BaseException) -> bool:
            # the item's header (and a lent payload) are valid only until this returns: wait
            # for the caller's end to have taken them (other roots' reads go on meanwhile)
            outstanding.pop(id(item), None)
            read.results.put((item, result, self))
            return self.reply.get() and not read.stopped

        while True:
            try:
                with cancellation(read.check) if read.check else contextlib.nullcontext():
                    self.tier.read_many_blocking(
                        lambda: self._begin(outstanding), end, read.ahead, lend=read.lend
                    )
            except BaseException as exc:  # the root's read failed: what it began ends with it
                for item in outstanding.values():
                    read.results.put((item, exc, None))
                outstanding.clear()
            with self.lock:
                left: list[ReadItem] = []
                if read.stopped:  # handed over but never begun: withdrawn
                    left, self.items = list(self.items), deque()
                if not self.items:
                    self.running = False
                    break
        for item in left:
            withdrawn = ReadWithdrawnError("the read was withdrawn", tier=self.tier.name)
            read.results.put((item, withdrawn, None))


class _StripedRead:
    """One :meth:`StripedFileTier.read_many_blocking` call: the caller's loop and its lanes."""

    def __init__(
        self, tier: StripedFileTier, ahead: int, lend: bool, check: Callable[[], bool] | None
    ) -> None:
        self.tier = tier
        self.ahead = max(1, ahead)
        self.lend = lend
        self.check = check
        #: (item, result, the lane waiting for end's answer, or None)
        self.results: queue.SimpleQueue[tuple[ReadItem, Any, _Lane | None]] = queue.SimpleQueue()
        self.stopped = False
        self.lanes: dict[int, _Lane] = {}

    def drive(self, begin: Begin, end: End) -> None:
        in_flight = 0
        while True:
            while not self.stopped and in_flight < self.ahead and (item := begin()) is not None:
                root = self.tier.placement(ObjectKey(item.key, item.group).object_id)
                lane = self.lanes.get(root)
                if lane is None:
                    lane = self.lanes[root] = _Lane(self, self.tier.roots[root])
                lane.put(item)
                in_flight += 1
            if not in_flight:
                return
            item, result, lane = self.results.get()
            in_flight -= 1
            try:
                more = end(item, result)
            except BaseException:
                self.stopped = True
                if lane is not None:
                    lane.reply.put(False)
                raise
            if not more:
                self.stopped = True
            if lane is not None:
                lane.reply.put(more)

    def close(self, *, early: bool) -> None:
        """Wait for every lane to leave: no destination is written after this returns.

        A caller that left ``early`` (its ``begin`` or ``end`` raised) may leave lanes waiting
        for an answer to a result: each is answered "no more" (a lent payload given back) until
        every lane left. Otherwise every result was taken and the lanes only have to leave."""
        self.stopped = True
        if not early:
            for lane in self.lanes.values():
                while lane.is_running():
                    if lane.future is not None:
                        lane.future.result()
            return
        while any(lane.is_running() for lane in self.lanes.values()):
            try:
                _, result, waiting = self.results.get(timeout=0.01)
            except queue.Empty:
                continue
            if isinstance(result, Borrowed):
                result.release()
            if waiting is not None:
                waiting.reply.put(False)


class _Leases(TierLease):
    __slots__ = ("_parts",)

    def __init__(self, parts: list[TierLease]) -> None:
        objects = tuple(o for p in parts for o in p.objects)
        expires = min((p.expires_at for p in parts), default=float("inf"))
        super().__init__(objects, expires)
        self._parts = parts

    def release(self) -> None:
        for p in self._parts:
            p.release()


class _StripedStorage:
    """Raw access to each object in its root (:class:`~bsr.tiers._base.StorageHooks`)."""

    def __init__(self, tier: StripedFileTier) -> None:
        self._tier = tier

    def _hooks(self, key: ChunkKey, group: str) -> StorageHooks:
        return self._tier.root_of(key, group).storage_hooks()

    def peek(self, key: ChunkKey, group: str) -> bytes | None:
        return self._hooks(key, group).peek(key, group)

    def overwrite(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        return self._hooks(key, group).overwrite(key, group, blob)

    def put_raw(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        return self._hooks(key, group).put_raw(key, group, blob)


__all__ = ("StripedFileTier", "StripedFileTierOptions")
