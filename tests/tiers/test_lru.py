"""LruIndex beside an independent model: capacity with reservations, pins, leases, LRU order.

The model keeps plain lists and recomputes every answer from its definition (the victims of a
reservation are the shortest run of least recently used, unpinned objects that makes room);
Hypothesis drives both with the same operations and a fake clock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import bsr
from bsr.tiers._lru import LruIndex, Reservation, RoomPending

CAPACITY = 100
OIDS = [f"{i:040x}" for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Model:
    order: list[str] = field(default_factory=list)  # least recently used first
    sizes: dict[str, int] = field(default_factory=dict)
    pins: dict[str, int] = field(default_factory=dict)
    leases: dict[int, tuple[float, frozenset[str]]] = field(default_factory=dict)
    reserved: dict[int, int] = field(default_factory=dict)

    def pinned(self, oid: str, now: float) -> bool:
        live = [objs for exp, objs in self.leases.values() if exp > now]
        return self.pins.get(oid, 0) > 0 or any(oid in objs for objs in live)

    def used(self) -> int:
        return sum(self.sizes.values()) + sum(self.reserved.values())


class LruMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.index: LruIndex[str] = LruIndex(CAPACITY, clock=self.clock, name="t")
        self.model = Model()
        self.open: dict[int, Reservation] = {}
        self.lease_handles: dict[int, bsr.TierLease] = {}
        self.next_id = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(size=st.integers(1, 120))
    def reserve(self, size: int) -> None:
        m, now = self.model, self.clock.now
        if size > CAPACITY:
            with pytest.raises(bsr.TierFullError):
                self.index.reserve(size)
            return
        need = m.used() + size - CAPACITY
        victims: list[str] = []
        for oid in m.order:  # the shortest LRU run of unpinned objects that makes room
            if need <= 0:
                break
            if not m.pinned(oid, now):
                victims.append(oid)
                need -= m.sizes[oid]
        if need > 0:
            pinned = sum(s for o, s in m.sizes.items() if m.pinned(o, now))
            pending = bool(m.reserved) and pinned + size <= CAPACITY
            with pytest.raises(RoomPending if pending else bsr.TierFullError) as info:
                self.index.reserve(size)
            assert isinstance(info.value, RoomPending) == pending
            return
        r, evicted = self.index.reserve(size)
        assert [o for o, _ in evicted] == victims
        for oid in victims:
            m.order.remove(oid)
            del m.sizes[oid]
        rid = self._id()
        m.reserved[rid] = size
        self.open[rid] = r

    @precondition(lambda self: self.open)
    @rule(data=st.data(), oid=st.sampled_from(OIDS), commit=st.booleans())
    def finish(self, data: st.DataObject, oid: str, commit: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.open)))
        r = self.open.pop(rid)
        size = self.model.reserved.pop(rid)
        if not commit:
            r.abort()
            return
        fresh = oid not in self.model.sizes
        assert r.commit(oid) is fresh
        if fresh:
            self.model.sizes[oid] = size
            self.model.order.append(oid)
        r.abort()  # after a commit: a no-op

    @rule(oid=st.sampled_from(OIDS))
    def pin(self, oid: str) -> None:
        got = self.index.pin(oid)
        assert (got is not None) == (oid in self.model.sizes)
        if got is not None:
            self.model.pins[oid] = self.model.pins.get(oid, 0) + 1
            self.model.order.remove(oid)
            self.model.order.append(oid)

    @precondition(lambda self: any(self.model.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        oid = data.draw(st.sampled_from(sorted(o for o, n in self.model.pins.items() if n)))
        self.index.unpin(oid)
        self.model.pins[oid] -= 1

    @rule(oids=st.lists(st.sampled_from(OIDS), max_size=5))
    def pin_many(self, oids: list[str]) -> None:
        """One lock for a batch: each of ``oids`` pinned (and used) as by :meth:`pin`."""
        got = self.index.pin_many(oids)
        assert [g is not None for g in got] == [o in self.model.sizes for o in oids]
        for oid in oids:
            if oid in self.model.sizes:
                self.model.pins[oid] = self.model.pins.get(oid, 0) + 1
                self.model.order.remove(oid)
                self.model.order.append(oid)

    @precondition(lambda self: any(self.model.pins.values()))
    @rule(data=st.data())
    def unpin_many(self, data: st.DataObject) -> None:
        held = [o for o, n in sorted(self.model.pins.items()) for _ in range(n)]
        picks = data.draw(st.lists(st.sampled_from(range(len(held))), unique=True, min_size=1))
        oids = [held[i] for i in picks]  # each pin at most once
        self.index.unpin_many(oids)
        for o in oids:
            self.model.pins[o] -= 1

    @rule(oids=st.lists(st.sampled_from(OIDS), max_size=5))
    def contains_many(self, oids: list[str]) -> None:
        assert self.index.contains_many(oids) == [o in self.model.sizes for o in oids]

    @rule(oids=st.lists(st.sampled_from(OIDS), max_size=4), ttl=st.floats(0.5, 5.0))
    def lease(self, oids: list[str], ttl: float) -> None:
        lease = self.index.lease(oids, ttl)
        held = frozenset(o for o in oids if o in self.model.sizes)
        assert set(lease.objects) == held
        lid = self._id()
        self.model.leases[lid] = (self.clock.now + ttl, held)
        self.lease_handles[lid] = lease

    @precondition(lambda self: self.lease_handles)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.lease_handles)))
        self.lease_handles.pop(lid).release()
        del self.model.leases[lid]

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @rule(oid=st.sampled_from(OIDS))
    def touch(self, oid: str) -> None:
        assert self.index.touch(oid) == (oid in self.model.sizes)
        if oid in self.model.sizes:
            self.model.order.remove(oid)
            self.model.order.append(oid)

    @rule(oid=st.sampled_from(OIDS))
    def discard(self, oid: str) -> None:
        assert self.index.discard(oid) == (oid in self.model.sizes)
        if oid in self.model.sizes:
            self.model.order.remove(oid)
            del self.model.sizes[oid]

    @invariant()
    def agrees(self) -> None:
        s = self.index.statistics()
        m = self.model
        assert self.index.oids() == m.order
        assert s.bytes == sum(m.sizes.values())
        assert s.reserved_bytes == sum(m.reserved.values())
        assert s.bytes + s.reserved_bytes <= CAPACITY
        assert s.peak_bytes <= CAPACITY
        for oid in OIDS:
            assert self.index.is_pinned(oid) == m.pinned(oid, self.clock.now)


TestLruIndexAgainstModel = LruMachine.TestCase
TestLruIndexAgainstModel.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


def test_unpin_many_refuses_an_unpin_without_a_pin() -> None:
    index: LruIndex[str] = LruIndex(CAPACITY, name="t")
    r, _ = index.reserve(10)
    r.commit(OIDS[0])
    assert index.pin_many([OIDS[0], OIDS[1]])[1] is None  # not held: nothing pinned
    with pytest.raises(bsr.TierError, match="without a pin"):
        index.unpin_many([OIDS[0], OIDS[0]])
    assert not index.is_pinned(OIDS[0])


def test_lease_limit_refuses_typed() -> None:
    idx: LruIndex[None] = LruIndex(100, lease_limit_bytes=50)
    for i, size in enumerate((30, 30, 30)):
        r, _ = idx.reserve(size)
        r.commit(OIDS[i])
    held = idx.lease(OIDS[:1], 10.0)
    with pytest.raises(bsr.TierFullError, match="lease"):
        idx.lease(OIDS[1:2], 10.0)  # 60 > 50
    held.release()
    held.release()  # idempotent
    idx.lease(OIDS[1:2], 10.0)
    with pytest.raises(bsr.ConfigError):
        idx.lease(OIDS[:1], float("nan"))


@pytest.mark.anyio
async def test_reserve_waiting_waits_for_writes_in_progress_only() -> None:
    idx: LruIndex[None] = LruIndex(100)
    first, _ = idx.reserve(80)
    got: list[int] = []

    async def second() -> None:
        r, _ = await idx.reserve_waiting(50)
        got.append(r.size)
        r.abort()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.sleep(0.05)
        assert got == []  # waiting: only the first write stands in the way
        first.commit(OIDS[0])  # committed objects are evictable: room
    assert got == [50]
    assert OIDS[0] not in idx
    with idx.lease(OIDS[:0], 1.0):
        pass
    r, _ = idx.reserve(60)
    r.commit(OIDS[1])
    idx.pin(OIDS[1])
    with pytest.raises(bsr.TierFullError) as info:  # a pin, not a write: fail at once
        await idx.reserve_waiting(60)
    assert not isinstance(info.value, RoomPending)


def test_index_is_thread_safe_under_concurrent_pins_and_reservations() -> None:
    idx: LruIndex[None] = LruIndex(10_000)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(300):
                oid = OIDS[(n + i) % len(OIDS)]
                r, _ = idx.reserve(700)
                r.commit(oid) or r.abort()
                if idx.pin(oid) is not None:
                    idx.unpin(oid)
                with idx.lease([oid], 0.01):
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = idx.statistics()
    assert s.reserved_bytes == 0 and s.pinned == 0 and s.peak_bytes <= 10_000
    assert s.bytes == 700 * s.objects
