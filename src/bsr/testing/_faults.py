"""Fault and latency injection as tier wrappers, seeded and replayable.

:class:`FaultyTier` wraps any tier and applies a :class:`FaultPlan`. Whether a fault fires is a
pure function of ``(seed, operation, object id, attempt number on that object)``, so a run is
replayed exactly by the same seed whatever the task interleaving. Corruption and truncation are
done *to the stored object* where the wrapped tier allows it (a tier whose
:meth:`~bsr.Tier.storage_hooks` gives raw access: HostTier, FileTier, MooncakeTier; or any tier
with a ``corrupt_object(key, group, offset)`` / ``truncate_object(key, group, size)`` method), so
detection is exercised for real; on other tiers they are simulated by raising the error a
verifying tier would raise.

The storage functions (:func:`corrupt_stored`, :func:`truncate_stored`, :func:`peek_stored`,
:func:`put_raw_stored`) reach behind a tier's API into its storage through the tier's
:class:`~bsr.tiers._base.StorageHooks` (HostTier's index, FileTier's files, the Mooncake store),
so the tier under test is bypassed; the library itself never calls those hooks. A wrapper's
reads change, so its ``blocking_reads`` is False: a pipeline that batches blocking reads cannot
skip the injected faults.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._check import non_negative_float, optional_positive_float
from .._errors import (
    CorruptObjectError,
    ObjectNotFoundError,
    TierIOError,
    TruncatedObjectError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..core._object import HEADER_SIZE
from ..tiers._base import Tier, TierWrapper
from ..tiers._reads import Fetched


class FaultKind(str, enum.Enum):
    READ_ERROR = "read_error"  #: read_into raises TierIOError
    CORRUPT = "corrupt"  #: the stored payload gets a flipped byte before the read
    TRUNCATE = "truncate"  #: the stored object is cut short before the read
    DELAY = "delay"  #: the call sleeps delay_s first
    HANG = "hang"  #: the call never returns (until cancelled)
    LOST_WRITE = "lost_write"  #: write acknowledges, stores nothing, contains() still says yes
    PROBE_ERROR = "probe_error"  #: contains_many raises TierIOError


_OPS = {
    FaultKind.READ_ERROR: "read",
    FaultKind.CORRUPT: "read",
    FaultKind.TRUNCATE: "read",
    FaultKind.DELAY: "read",
    FaultKind.HANG: "read",
    FaultKind.LOST_WRITE: "write",
    FaultKind.PROBE_ERROR: "contains",
}


@dataclass(frozen=True)
class Fault:
    """One fault rule.

    Args:
        kind: what happens.
        probability: chance per matching call (decided by the plan's seed).
        group: only objects of this group (None: any).
        chunks: only these chunk indices (None: any).
        max_times: stop after firing this often (None: unlimited).
        delay_s: for DELAY.
    """

    kind: FaultKind
    probability: float = 1.0
    group: str | None = None
    chunks: frozenset[int] | None = None
    max_times: int | None = None
    delay_s: float = 0.01

    @property
    def op(self) -> str:
        return _OPS[self.kind]


@dataclass
class FaultPlan:
    """A seeded set of fault rules, optionally limited to some ranks."""

    seed: int = 0
    faults: tuple[Fault, ...] = ()
    ranks: frozenset[int] | None = None
    fired: dict[str, int] = field(default_factory=dict)

    def _u(self, op: str, oid: str, attempt: int, rule: int) -> float:
        h = hashlib.blake2b(f"{self.seed}|{op}|{oid}|{attempt}|{rule}".encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") / 2**64

    def decide(self, op: str, okey: ObjectKey, attempt: int, rank: int) -> list[Fault]:
        """The faults that fire for this call (deterministic in the seed)."""
        if self.ranks is not None and rank not in self.ranks:
            return []
        out = []
        for i, f in enumerate(self.faults):
            if f.op != op:
                continue
            if f.group is not None and f.group != okey.group:
                continue
            if f.chunks is not None and okey.chunk.index not in f.chunks:
                continue
            count = self.fired.get(f"{i}", 0)
            if f.max_times is not None and count >= f.max_times:
                continue
            if self._u(op, okey.object_id, attempt, i) < f.probability:
                self.fired[f"{i}"] = count + 1
                self.fired[f.kind.value] = self.fired.get(f.kind.value, 0) + 1
                out.append(f)
        return out

    @property
    def total_fired(self) -> int:
        return sum(v for k, v in self.fired.items() if not k.isdigit())


def storage_tier(tier: Tier) -> Tier:
    """The tier that holds the bytes: ``tier`` with every :class:`~bsr.TierWrapper` peeled off."""
    while isinstance(tier, TierWrapper):
        tier = tier.inner
    return tier


def _edit_stored(
    tier: Tier, key: ChunkKey, group: str, edit: Callable[[bytearray], bytes | None]
) -> bool:
    """Rewrite the stored bytes of ``(key, group)`` through the tier's storage (not its API)."""
    hooks = storage_tier(tier).storage_hooks()
    blob = None if hooks is None else hooks.peek(key, group)
    if hooks is None or blob is None:
        return False
    new = edit(bytearray(blob))
    return new is not None and hooks.overwrite(key, group, new)


def corrupt_stored(tier: Tier, key: ChunkKey, group: str, offset: int = HEADER_SIZE + 17) -> bool:
    """Flip every bit of the stored byte at ``offset`` of ``(key, group)`` (header included).

    Works on HostTier, FileTier and MooncakeTier (and any wrapper around them) by reaching
    behind the tier's API into its storage, or on a tier with a ``corrupt_object(key, group,
    offset)`` method. False when the tier cannot, or holds no such byte.
    """
    hook = getattr(storage_tier(tier), "corrupt_object", None)
    if callable(hook):
        return bool(hook(key, group, offset))

    def flip(blob: bytearray) -> bytes | None:
        if offset >= len(blob):
            return None
        blob[offset] ^= 0xFF
        return bytes(blob)

    return _edit_stored(tier, key, group, flip)


def truncate_stored(tier: Tier, key: ChunkKey, group: str, size: int = HEADER_SIZE + 100) -> bool:
    """Cut the stored object of ``(key, group)`` to ``size`` bytes; False when the tier cannot.

    Same reach as :func:`corrupt_stored` (or a ``truncate_object(key, group, size)`` method).
    """
    hook = getattr(storage_tier(tier), "truncate_object", None)
    if callable(hook):
        return bool(hook(key, group, size))
    return _edit_stored(
        tier, key, group, lambda blob: bytes(blob[:size]) if 0 <= size < len(blob) else None
    )


def peek_stored(tier: Tier, key: ChunkKey, group: str) -> bytes | None:
    """The raw stored bytes of ``(key, group)`` (header + payload + padding), or None."""
    hooks = storage_tier(tier).storage_hooks()
    return None if hooks is None else hooks.peek(key, group)


def put_raw_stored(tier: Tier, key: ChunkKey, group: str, blob: bytes) -> bool:
    """Store ``blob`` verbatim as the object ``(key, group)``, bypassing the tier's write path.

    The tier then holds (and ``contains_many`` reports) the object whatever its bytes are, as if
    it had been written by someone else into the same storage; HostTier and FileTier index it
    outside their capacity reservation. False when the tier offers no way to do that.
    """
    hooks = storage_tier(tier).storage_hooks()
    return hooks is not None and hooks.put_raw(key, group, blob)


class FaultyTier(TierWrapper[Tier]):
    """Wrap ``inner`` and inject the faults of ``plan`` (as rank ``rank``).

    The wrapper takes the inner tier's name by default, so results and ``bytes_by_tier`` read
    the same as without it.
    """

    def __init__(
        self, inner: Tier, plan: FaultPlan, *, rank: int = 0, name: str | None = None
    ) -> None:
        super().__init__(inner, name=name)
        self.plan = plan
        self.rank = rank
        self._attempts: dict[tuple[str, str], int] = {}
        self._lost: set[str] = set()

    def _faults(self, op: str, okey: ObjectKey) -> list[Fault]:
        k = (op, okey.object_id)
        n = self._attempts.get(k, 0)
        self._attempts[k] = n + 1
        return self.plan.decide(op, okey, n, self.rank)

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        for o in objects[:1]:
            if any(f.kind is FaultKind.PROBE_ERROR for f in self._faults("contains", o)):
                raise TierIOError("injected probe failure", tier=self.name)
        got = await self.inner.contains_many(objects)
        return [g or o.object_id in self._lost for g, o in zip(got, objects)]

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        okey = ObjectKey(key, group)
        if okey.object_id in self._lost:
            raise ObjectNotFoundError(
                "object lost after acknowledged write", tier=self.name, group=group
            )
        for f in self._faults("read", okey):
            if f.kind is FaultKind.DELAY:
                await anyio.sleep(f.delay_s)
            elif f.kind is FaultKind.HANG:
                await anyio.sleep_forever()
            elif f.kind is FaultKind.READ_ERROR:
                raise TierIOError("injected read error", tier=self.name, group=group)
            elif f.kind is FaultKind.CORRUPT and not corrupt_stored(self.inner, key, group):
                raise CorruptObjectError("injected corruption", tier=self.name, group=group)
            elif f.kind is FaultKind.TRUNCATE and not truncate_stored(self.inner, key, group):
                raise TruncatedObjectError("injected truncation", tier=self.name, group=group)
        return await self.inner.fetch_into(key, group, dst)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        okey = ObjectKey(key, group)
        if any(f.kind is FaultKind.LOST_WRITE for f in self._faults("write", okey)):
            if await self.inner.contains(key, group):
                return False
            self._lost.add(okey.object_id)
            return True
        return await self.inner.write(key, group, payload)

    async def delete(self, key: ChunkKey, group: str) -> bool:
        okey = ObjectKey(key, group)
        lost = okey.object_id in self._lost
        self._lost.discard(okey.object_id)
        return await self.inner.delete(key, group) or lost

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        self._lost.discard(ObjectKey(key, group).object_id)
        await self.inner.quarantine(key, group, reason)


class LatencyTier(TierWrapper[Tier]):
    """Wrap ``inner`` adding a fixed latency (and optional bandwidth cap) to reads and probes."""

    def __init__(
        self,
        inner: Tier,
        *,
        read_latency_s: float = 0.001,
        probe_latency_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(inner, name=name)
        self.read_latency_s = non_negative_float(read_latency_s, "LatencyTier.read_latency_s")
        self.probe_latency_s = non_negative_float(probe_latency_s, "LatencyTier.probe_latency_s")
        self.bandwidth = optional_positive_float(
            bandwidth_bytes_per_s, "LatencyTier.bandwidth_bytes_per_s"
        )

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        if self.probe_latency_s:
            await anyio.sleep(self.probe_latency_s)
        return await self.inner.contains_many(objects)

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        await anyio.sleep(self.read_latency_s)
        fetched = await self.inner.fetch_into(key, group, dst)
        if self.bandwidth:
            await anyio.sleep(fetched.nbytes / self.bandwidth)
        return fetched
