"""What each instance of a fleet holds, from the KV events its engine publishes.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events for its own
prefix cache (medium ``GPU``) and, through bsr's connector, for bsr's tiers (``CPU`` for a
HostTier, ``STORAGE`` for a FileTier, a RedisTier or a MooncakeTier). A block's hash is
vLLM's: it depends on a per-process seed unless ``PYTHONHASHSEED`` is fixed fleet-wide, so two
instances may name the same content differently. The index therefore names every block by a
digest of its *content*: the digest of its parent, its tokens and its extra keys (adapter,
``cache_salt``), computed by the router from the events (a stored block's parent is looked up
in what the same instance announced before) and from a request's tokens in the same way. A
block whose parent the index never saw is skipped: the index only ever under-claims.

Holdings are kept per instance and medium. A medium named *shared* (a pool every instance reads,
such as a FileTier shared root or a Redis cluster) counts for every instance while any instance
announces the block there; a removal from the instance that saw it vanish ends that
instance's claim.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "MEDIA",
    "FleetIndex",
    "Match",
    "block_digests",
    "request_extra_keys",
]

#: the media vLLM's events name, fastest first (``None`` in an event means ``GPU``)
MEDIA = ("GPU", "CPU", "STORAGE")

#: hash -> digest entries of removed blocks kept per instance, so a block stored after its
#: parent left every medium (vLLM evicts leaves first, not always) still gets its digest
RECENT_PARENTS = 65536


def _norm(extra: Any) -> tuple[Any, ...]:
    """An event's or a request's extra keys for one block, as a hashable tuple (``None`` and an
    empty list are the same: no extra keys)."""
    if not extra:
        return ()
    return tuple(_norm(x) if isinstance(x, list | tuple) else x for x in extra)


def _digest(parent: bytes | None, tokens: Sequence[int], extra: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(b",".join(str(int(t)).encode() for t in tokens))
    h.update(repr(_norm(extra)).encode())
    return h.digest()


def request_extra_keys(
    num_blocks: int, *, cache_salt: str | None = None, lora_name: str | None = None
) -> list[tuple[Any, ...]]:
    """Each full block's extra keys the way vLLM's events carry them for a text prompt: the
    adapter's name on every block (when there is one), the ``cache_salt`` on the first only."""
    out: list[tuple[Any, ...]] = []
    for b in range(num_blocks):
        keys: list[Any] = [lora_name] if lora_name else []
        if b == 0 and cache_salt:
            keys.append(cache_salt)
        out.append(tuple(keys))
    return out


def block_digests(
    tokens: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[bytes]:
    """The content digests of ``tokens``' full blocks (a partial last block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(tokens) // block_size
    extras = request_extra_keys(n, cache_salt=cache_salt, lora_name=lora_name)
    out: list[bytes] = []
    parent: bytes | None = None
    for b in range(n):
        parent = _digest(parent, tokens[b * block_size : (b + 1) * block_size], extras[b])
        out.append(parent)
    return out


@dataclass(frozen=True)
class Match:
    """How much of a request's prefix an instance can serve, block by block from the start.

    Attributes:
        instance: the instance's name.
        blocks: the leading full blocks held in some medium the instance reads (its own, or a
            shared one).
        by_medium: of those, how many are read from each medium (a block held in several counts
            under the fastest).
        cost: the sum of the per-medium costs of the prefix and of the recompute of the rest
            (the policy's score; lower is better).
    """

    instance: str
    blocks: int
    by_medium: dict[str, int]
    cost: float


@dataclass
class _Instance:
    #: vLLM block hash -> content digest, for blocks held in some medium
    digests: dict[Any, bytes] = field(default_factory=dict)
    #: recently removed block hash -> digest (parents of blocks stored later)
    recent: OrderedDict[Any, bytes] = field(default_factory=OrderedDict)
    #: medium -> block hash -> content digest
    held: dict[str, dict[Any, bytes]] = field(default_factory=dict)
    #: medium -> content digest -> how many of this instance's blocks carry it
    contents: dict[str, dict[bytes, int]] = field(default_factory=dict)


class FleetIndex:
    """Every instance's holdings, per medium, from the events each publishes.

    Not thread-safe: one thread applies events and answers (the router's server holds a lock).

    Args:
        shared_media: media every instance reads (a pool): a block announced there by one
            instance counts for all of them.
        costs: per-block cost of serving from each medium, and of recomputing (``"miss"``).
    """

    DEFAULT_COSTS: ClassVar[dict[str, float]] = {
        "GPU": 0.0,
        "CPU": 1.0,
        "STORAGE": 2.0,
        "miss": 10.0,
    }

    def __init__(
        self,
        shared_media: Iterable[str] = (),
        costs: dict[str, float] | None = None,
    ) -> None:
        self.shared = frozenset(shared_media)
        unknown = self.shared - set(MEDIA)
        if unknown:
            raise ValueError(f"unknown shared media {sorted(unknown)}; known: {list(MEDIA)}")
        self.costs = {**self.DEFAULT_COSTS, **(costs or {})}
        self._instances: dict[str, _Instance] = {}
        #: shared medium -> content digest -> instances announcing it there
        self._pool: dict[str, dict[bytes, set[str]]] = {m: {} for m in self.shared}
        self.skipped_orphans = 0

    @property
    def instances(self) -> list[str]:
        return list(self._instances)

    def add_instance(self, name: str) -> None:
        self._instances.setdefault(name, _Instance())

    def apply(self, instance: str, events: Iterable[Any]) -> None:
        """Apply one batch of ``instance``'s events (vLLM's event objects, or the plain dicts a
        msgpack decoder gives: ``{"type": "BlockStored", ...}``), in order."""
        inst = self._instances.setdefault(instance, _Instance())
        for e in events:
            kind, get = _accessor(e)
            if kind == "BlockStored":
                self._stored(instance, inst, get)
            elif kind == "BlockRemoved":
                medium = get("medium") or "GPU"
                for h in get("block_hashes") or ():
                    self._removed(instance, inst, medium, _key(h))
            elif kind == "AllBlocksCleared":
                for h in list(inst.held.get("GPU", {})):
                    self._removed(instance, inst, "GPU", h)

    def _stored(self, instance: str, inst: _Instance, get: Any) -> None:
        medium = get("medium") or "GPU"
        hashes = [_key(h) for h in get("block_hashes") or ()]
        tokens = list(get("token_ids") or ())
        size = int(get("block_size") or 0)
        extras = get("extra_keys") or [None] * len(hashes)
        parent_hash = get("parent_block_hash")
        parent: bytes | None = None
        if parent_hash is not None:
            ph = _key(parent_hash)
            parent = inst.digests.get(ph) or inst.recent.get(ph)
            if parent is None:  # a parent this index never saw: the run cannot be named
                self.skipped_orphans += 1
                return
        if size <= 0 or len(tokens) < size * len(hashes):
            return
        for i, h in enumerate(hashes):
            extra = extras[i] if i < len(extras) else None
            parent = _digest(parent, tokens[i * size : (i + 1) * size], extra)
            self._hold(instance, inst, medium, h, parent)

    def _hold(self, instance: str, inst: _Instance, medium: str, h: Any, digest: bytes) -> None:
        held = inst.held.setdefault(medium, {})
        old = held.get(h)
        if old == digest:
            return
        if old is not None:
            self._removed(instance, inst, medium, h)
        held[h] = digest
        inst.digests[h] = digest
        contents = inst.contents.setdefault(medium, {})
        contents[digest] = contents.get(digest, 0) + 1
        if medium in self._pool:
            self._pool[medium].setdefault(digest, set()).add(instance)

    def _removed(self, instance: str, inst: _Instance, medium: str, h: Any) -> None:
        digest = inst.held.get(medium, {}).pop(h, None)
        if digest is None:
            return
        contents = inst.contents[medium]
        contents[digest] -= 1
        if contents[digest] == 0:
            del contents[digest]
            holders = self._pool.get(medium, {}).get(digest)
            if holders is not None:
                holders.discard(instance)
                if not holders:
                    del self._pool[medium][digest]
        if not any(h in held for held in inst.held.values()):
            inst.digests.pop(h, None)
            inst.recent[h] = digest
            inst.recent.move_to_end(h)
            while len(inst.recent) > RECENT_PARENTS:
                inst.recent.popitem(last=False)

    def forget(self, instance: str) -> None:
        """Drop everything ``instance`` announced (its events were missed: what it announces
        next is learnt again)."""
        inst = self._instances.get(instance)
        if inst is None:
            return
        for medium, held in inst.held.items():
            for h in list(held):
                self._removed(instance, inst, medium, h)
        self._instances[instance] = _Instance()

    def holds(self, instance: str, medium: str, digest: bytes) -> bool:
        """Whether ``instance`` can read the block named ``digest`` from ``medium``."""
        if medium in self._pool:
            return bool(self._pool[medium].get(digest))
        inst = self._instances.get(instance)
        return inst is not None and digest in inst.contents.get(medium, {})

    def match(self, instance: str, digests: Sequence[bytes]) -> Match:
        """How much of the prefix named by ``digests`` ``instance`` serves, and at what cost."""
        by: dict[str, int] = {}
        blocks = 0
        cost = 0.0
        for d in digests:
            medium = next((m for m in MEDIA if self.holds(instance, m, d)), None)
            if medium is None:
                break
            by[medium] = by.get(medium, 0) + 1
            cost += self.costs[medium]
            blocks += 1
        cost += self.costs["miss"] * (len(digests) - blocks)
        return Match(instance, blocks, by, cost)

    def held_count(self, instance: str, medium: str) -> int:
        """How many blocks ``instance`` announced in ``medium`` (its own claims)."""
        inst = self._instances.get(instance)
        return 0 if inst is None else len(inst.held.get(medium, {}))


def _key(h: Any) -> Any:
    """A block hash as a dict key (msgpack gives bytes or ints; lists become tuples)."""
    return tuple(h) if isinstance(h, list) else h


def _accessor(e: Any) -> tuple[str, Any]:
    """An event's kind and a field getter, for vLLM's structs and for decoded dicts."""
    if isinstance(e, dict):
        return str(e.get("type", "")), e.get
    return type(e).__name__, lambda name: getattr(e, name, None)
