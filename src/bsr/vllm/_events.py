"""KV events, the deciding half: which objects bsr announces as stored or removed, and when.

Which is which: this module decides *what* to announce (the per-rank :class:`EventJournal`, the
cross-rank :class:`EventRelay`, their plain notices) and imports nothing of vLLM;
:mod:`bsr.vllm._kv_events` is the translating half, the only one that imports vLLM's event
types: it turns these notices into vLLM's ``BlockStored`` / ``BlockRemoved`` and reads a
request's block hashes into a :class:`SaveEvents`. What bsr holds is so told to vLLM's KV event
publisher, for routers to index.

Where it runs: :class:`EventJournal` on the worker side (every rank: its engine's loop thread,
and the tiers' worker threads that report removals); :class:`EventRelay` on the scheduler side
(vLLM's EngineCore process), which hands the events to vLLM's own publisher
(``KVEventsConfig``, ZMQ) through ``take_events``. The notices are plain values (vLLM pickles
them between the processes).

How it works:

* **Which hashes.** A save carries the request's own vLLM block hashes (``request.block_hashes``,
  the ones vLLM's prefix cache and its own KV events use, per block) with each block's extra
  keys and LoRA name (:class:`SaveEvents`). An object of bsr chunk ``c`` of KV cache group ``i``
  covers vLLM blocks ``c*C/B .. (c+1)*C/B - 1``: its event names those blocks' hashes, the hash
  before them as parent, the chunk's tokens, ``group_idx=i`` (a sliding-window group stores and
  so announces only its window's chunks).
* **Stored only once durable, and verified.** After a save returns, the worker asks every
  tier's storage itself whether it holds each object (``RestoreEngine.audit``), and reads back
  through the tier's verified read each object the save found already held (not written by it:
  a server's restart, another server sharing the root) that is not announced there yet; a
  damaged one is quarantined, never announced. Only what it holds becomes a stored notice,
  with the tier's medium (``CPU`` for a HostTier, ``STORAGE`` for a FileTier or a remote
  store, ``locality`` LOCAL or REMOTE). A save that failed in a tier announces nothing
  there. A removal of that object in that tier reported while the save and the audit ran
  (:meth:`EventJournal.begin` numbers them) cancels the notice, so an eviction racing the save
  is never followed by a stale "stored".
* **Every removal.** The engine reports each object that leaves a tier (``on_removed``: an LRU
  eviction, a quarantine, a delete, and what an audit finds gone: ``bsr store gc``, another
  server sharing the root, a remote store's own eviction). An object announced in that tier
  becomes a removed notice, once. An audit of every announced object runs every ``audit_s``
  seconds, so a removal behind bsr's back is announced within that time (plus an engine step).
* **Bounded.** The journal keeps at most ``max_objects`` announced objects (least recently
  stored first out); one that falls out is withdrawn (a removed notice): a router may then
  under-claim, never over-claim.
* **Several ranks.** Each rank announces its own objects; :class:`EventRelay` publishes a chunk
  as stored in a tier once every rank reported it stored there, and as removed as soon as one
  rank reported it removed (a prefix is served only if every rank holds its shard).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bsr import Medium, ObjectKey, ObjectRemoved, Tier

#: vLLM's medium strings (``vllm.distributed.kv_events``)
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
#: what ``locality`` says, relative to the publishing instance
LOCAL, REMOTE = "LOCAL", "REMOTE"
#: vLLM's ``CacheHitSource`` values a tier's hits are counted under
SOURCE_HOST, SOURCE_DISK, SOURCE_EXTERNAL = "host", "disk", "external_unspecified"

#: announced objects a journal keeps by default
DEFAULT_MAX_OBJECTS = 1 << 16


@dataclass(frozen=True)
class TierKind:
    """How one bsr tier appears to vLLM: its event medium and locality, its hit source."""

    medium: str
    locality: str
    source: str


#: how each medium a tier declares (:attr:`bsr.Tier.medium`) appears to vLLM
_KINDS = {
    Medium.HOST: TierKind(MEDIUM_CPU, LOCAL, SOURCE_HOST),
    Medium.DISK: TierKind(MEDIUM_STORAGE, LOCAL, SOURCE_DISK),
    Medium.REMOTE: TierKind(MEDIUM_STORAGE, REMOTE, SOURCE_EXTERNAL),
}


def tier_kind(tier: Tier) -> TierKind:
    """As the tier declares its medium (:attr:`bsr.Tier.medium`; wrappers read through): host
    memory is ``CPU`` (hits under ``host``), local storage ``STORAGE`` (``disk``), a remote
    store (Redis, Mooncake, a registered kind by default) ``STORAGE`` with ``REMOTE``
    locality, hits under ``external_unspecified`` (vLLM 0.32 has no source for a shared
    remote store)."""
    return _KINDS.get(tier.medium, _KINDS[Medium.REMOTE])


@dataclass(frozen=True)
class SaveEvents:
    """What a save needs to announce its chunks in vLLM's terms (sent with the SaveJob).

    Attributes:
        block_hashes: the request's vLLM block hashes (raw, one per block) covering the save.
        extra_keys: each block's extra keys as vLLM's events carry them (None: none at all).
        lora_name, lora_id: the request's adapter (None: the base model).
    """

    block_hashes: tuple[bytes, ...]
    extra_keys: tuple[Any, ...] | None = None
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True)
class ChunkInfo:
    """The ``BlockStored`` payload of one object (one chunk of one KV cache group), no medium."""

    group_idx: int
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: tuple[Any, ...] | None = None
    spec_kind: str | None = None
    sliding_window: int | None = None

    @property
    def ident(self) -> tuple[int, bytes]:
        """The chunk across ranks: its group and the hash of its last block (names the prefix)."""
        return self.group_idx, self.block_hashes[-1]


@dataclass(frozen=True)
class ChunkNotice:
    """One rank's news about one chunk in one tier: stored (durably) or removed."""

    stored: bool
    tier: str
    kind: TierKind
    rank: int
    info: ChunkInfo
    cause: str = ""


def chunk_infos(
    events: SaveEvents,
    tokens: Sequence[int],
    *,
    chunk_tokens: int,
    block_size: int,
    chunk: int,
    group_idx: int,
    spec_kind: str | None = None,
    sliding_window: int | None = None,
) -> ChunkInfo | None:
    """The payload of chunk ``chunk`` of group ``group_idx`` (None: the save's hashes do not
    cover it)."""
    per = chunk_tokens // block_size
    first, last = chunk * per, (chunk + 1) * per
    if last > len(events.block_hashes) or (chunk + 1) * chunk_tokens > len(tokens):
        return None
    extra = None
    if events.extra_keys is not None and last <= len(events.extra_keys):
        extra = tuple(events.extra_keys[first:last])
        if all(e is None for e in extra):
            extra = None
    return ChunkInfo(
        group_idx=group_idx,
        block_hashes=tuple(events.block_hashes[first:last]),
        parent_block_hash=events.block_hashes[first - 1] if first > 0 else None,
        token_ids=tuple(int(t) for t in tokens[chunk * chunk_tokens : (chunk + 1) * chunk_tokens]),
        block_size=block_size,
        lora_name=events.lora_name,
        lora_id=events.lora_id,
        extra_keys=extra,
        spec_kind=spec_kind,
        sliding_window=sliding_window,
    )


@dataclass
class _Entry:
    okey: ObjectKey
    info: ChunkInfo
    tiers: set[str]


class EventJournal:
    """One rank's announced objects and the notices not yet sent (see the module docstring).

    Thread-safe: :meth:`removed` is called from tier worker threads.

    Args:
        kinds: each tier's :class:`TierKind`, by tier name.
        rank: this worker's tensor-parallel rank.
        max_objects: announced objects kept (least recently stored first out).
    """

    def __init__(
        self, kinds: dict[str, TierKind], *, rank: int = 0, max_objects: int = DEFAULT_MAX_OBJECTS
    ) -> None:
        self.kinds = dict(kinds)
        self.rank = rank
        self.max_objects = max_objects
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # object id -> announced
        self._out: list[ChunkNotice] = []
        self._seq = 0
        self._open: dict[int, int] = {}  # checks in flight: their start sequence -> count
        self._removed_at: dict[tuple[str, str], int] = {}  # (tier, oid) -> sequence
        self.counts: dict[str, int] = {}  # "stored", "removed.<cause>", "withdrawn"

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    # ------------------------------------------------------------------ stores
    def begin(self) -> int:
        """Start a check (a save, then its audit); removals from now on cancel its notices."""
        with self._lock:
            since = self._seq
            self._open[since] = self._open.get(since, 0) + 1
            return since

    def end(self, since: int) -> None:
        """The check that :meth:`begin` returned ``since`` for is over."""
        with self._lock:
            n = self._open.get(since, 0) - 1
            if n > 0:
                self._open[since] = n
            else:
                self._open.pop(since, None)
            if not self._open:
                self._removed_at.clear()
            else:  # keep only what a check still in flight may ask about
                oldest = min(self._open)
                self._removed_at = {k: v for k, v in self._removed_at.items() if v > oldest}

    def stored(self, tier: str, okey: ObjectKey, info: ChunkInfo, since: int) -> bool:
        """The audit after a save found ``okey`` held in ``tier``: announce it (once), unless
        a removal of it there was reported since ``since``. Whether a notice was queued."""
        oid = okey.object_id
        with self._lock:
            if self._removed_at.get((tier, oid), -1) > since:
                return False
            entry = self._entries.get(oid)
            if entry is None:
                entry = self._entries[oid] = _Entry(okey, info, set())
            self._entries.move_to_end(oid)
            if tier in entry.tiers:
                return False
            entry.tiers.add(tier)
            self._out.append(ChunkNotice(True, tier, self.kinds[tier], self.rank, entry.info))
            self._count("stored")
            while len(self._entries) > self.max_objects:
                _, old = self._entries.popitem(last=False)
                for t in sorted(old.tiers):
                    self._out.append(
                        ChunkNotice(False, t, self.kinds[t], self.rank, old.info, "withdrawn")
                    )
                    self._count("withdrawn")
            return True

    # ------------------------------------------------------------------ removals
    def removed(self, record: ObjectRemoved) -> None:
        """An object left a tier (the engine's ``on_removed`` listener)."""
        key = (record.tier, record.object_id)
        with self._lock:
            self._seq += 1
            if self._open:
                self._removed_at[key] = self._seq
            entry = self._entries.get(record.object_id)
            if entry is None or record.tier not in entry.tiers:
                return
            entry.tiers.discard(record.tier)
            if not entry.tiers:
                del self._entries[record.object_id]
            kind = self.kinds.get(record.tier)
            if kind is None:
                return
            self._out.append(
                ChunkNotice(False, record.tier, kind, self.rank, entry.info, str(record.cause))
            )
            self._count(f"removed.{record.cause}")

    # ------------------------------------------------------------------ reading
    def is_announced(self, tier: str, object_id: str) -> bool:
        """Whether ``object_id`` is announced as stored in ``tier`` now."""
        with self._lock:
            entry = self._entries.get(object_id)
            return entry is not None and tier in entry.tiers

    def announced(self) -> list[tuple[str, ObjectKey]]:
        """Every ``(tier, object)`` announced as stored now (what an audit rechecks)."""
        with self._lock:
            return [(t, e.okey) for e in self._entries.values() for t in sorted(e.tiers)]

    def take(self) -> list[ChunkNotice]:
        """The notices since the last call, in the order they happened."""
        with self._lock:
            out, self._out = self._out, []
            return out


class EventRelay:
    """The scheduler's view of every rank's notices: what to publish (see the module docstring).

    Args:
        tp_size: tensor-parallel ranks (a chunk is stored in a tier once all of them said so).
    """

    def __init__(self, tp_size: int = 1) -> None:
        self.tp_size = max(1, int(tp_size))
        self._ranks: dict[tuple[str, int, bytes], set[int]] = {}
        self._published: dict[tuple[str, int, bytes], ChunkInfo] = {}
        self._out: list[ChunkNotice] = []

    def add(self, notices: Iterable[ChunkNotice]) -> None:
        for n in notices:
            key = (n.tier, *n.info.ident)
            if n.stored:
                ranks = self._ranks.setdefault(key, set())
                ranks.add(n.rank)
                if len(ranks) >= self.tp_size and key not in self._published:
                    self._published[key] = n.info
                    self._out.append(n)
            else:
                held = self._ranks.get(key)
                if held is not None:
                    held.discard(n.rank)
                    if not held:
                        del self._ranks[key]
                if self._published.pop(key, None) is not None:
                    self._out.append(n)

    def published(self) -> int:
        """Chunks (per tier) announced as stored now."""
        return len(self._published)

    def take(self) -> list[ChunkNotice]:
        """What to publish since the last call, in order."""
        out, self._out = self._out, []
        return out
