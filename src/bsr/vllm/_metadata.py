"""What the two sides of the connector tell each other, one vLLM engine step at a time.

Where it runs: built in vLLM's EngineCore process (scheduler side) and read in every worker
process, and back: vLLM pickles these between the processes.

* :class:`BsrConnectorMetadata` (scheduler -> workers, every step): the loads to start, the saves
  to start, the lookups whose leases the workers may drop, and the requests to bind to the
  LoRA weights the workers loaded.
* :class:`BsrWorkerMetadata` (workers -> scheduler, every step): the outcome of every load that
  ended in the step, so the scheduler knows which KV is verified before it ever saves it, and
  the KV event notices of the step (:mod:`bsr.vllm._events`).
* :class:`BsrHandshake` (workers -> scheduler, once at startup): where the lookup socket is,
  and the worker's tiers (their names and hit sources).

Block tables are vLLM's block ids, one table per KV cache group (one group, or several with
vLLM's hybrid KV cache manager: sliding-window and full-attention layers apart), in vLLM's group
order; vLLM's null block 0 stands where a sliding-window group holds no block (below its
window), and bsr never reads or writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from bsr import KeyExtra

from ._events import ChunkNotice, SaveEvents

#: vLLM's null block id: where a group holds no block (a sliding window's blocks below the window)
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class LoadJob:
    """Restore ``tokens`` (a prefix of whole chunks) into the request's blocks.

    Attributes:
        req_id: vLLM's request id.
        tokens: the prefix to restore; its full chunks are what the scheduler promised.
        start_tokens: vLLM already holds this many tokens in these blocks (its own prefix-cache
            hit, whole blocks): bsr reads and writes only past them.
        block_ids: the request's blocks per KV cache group, covering ``tokens``.
        lookup_id: the worker's leased probe of ``tokens`` to reuse (``None``: probe again).
        extras: what besides the tokens the request's KV depends on (its salt, adapter,
            images, prompt embeddings: :mod:`bsr.vllm._request_keys`).
        skip_tiers: the worker engine's tiers (by index) its lookup had no answer from (cut
            off, failed, breaker open): a load that probes again does not ask them.
    """

    req_id: str
    tokens: tuple[int, ...]
    start_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    lookup_id: int | None = None
    extras: tuple[KeyExtra, ...] = ()
    skip_tiers: tuple[int, ...] = ()

    @property
    def end_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class SaveJob:
    """Store the full chunks of ``tokens`` held in the request's blocks (per KV cache group),
    keyed with ``extras`` (see :class:`LoadJob`); ``events``: the request's vLLM block hashes
    to announce the stored chunks with (None: KV events are off)."""

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    extras: tuple[KeyExtra, ...] = ()
    events: SaveEvents | None = None


@dataclass(frozen=True)
class WindowJob:
    """Store the sliding-window groups' window at each of ``ends`` while the request runs
    (:mod:`bsr.vllm._windows`): the scheduler holds a reference on the window's blocks until
    every worker reported the job done.

    Attributes:
        job_id: the scheduler's id of the job (the workers report it done).
        req_id: vLLM's request id (logs only).
        tokens: the request's tokens up to the last end.
        ends: prefix ends (tokens, chunk boundaries, ascending) whose windows to store.
        block_ids: per KV cache group, blocks for ``tokens``: vLLM's null block everywhere but
            the sliding groups' windows at ``ends``.
        extras: what besides the tokens the request's KV depends on (see :class:`LoadJob`).
    """

    job_id: int
    req_id: str
    tokens: tuple[int, ...]
    ends: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    extras: tuple[KeyExtra, ...] = ()


@dataclass
class BsrConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers for one step.

    Attributes:
        loads: loads to start (async mode: they run on; sync mode: this step waits for them).
        saves: saves of requests that finished (their blocks are held until the save is done).
        forget_lookups: lookups answered but not used by a load; their leases may go.
        forget_all: drop every leased lookup (``reset_cache``).
        windows: window saves of running requests (after this step's forward).
        adapters: requests this step schedules for the first time under a LoRA adapter:
            request id -> vLLM's adapter id; each worker binds them to the weights it loaded
            (:mod:`bsr.vllm._adapters`), which vLLM loads before the connector's hooks run.
    """

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    forget_lookups: list[int] = field(default_factory=list)
    forget_all: bool = False
    windows: list[WindowJob] = field(default_factory=list)
    adapters: dict[str, int] = field(default_factory=dict)


@dataclass
class BsrWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Loads that ended in one step: request id -> whether it committed every promised token;
    and window saves that ended: job id -> how many ranks report it; and every rank's KV event
    notices of the step (in the order each rank made them).

    Only tensor-parallel rank 0 reports loads (the ranks agree on every commit); a request
    reported by several workers counts as loaded only if every report says so. Every rank
    reports its window saves (each reads its own shard of the blocks).
    """

    loads: dict[str, bool] = field(default_factory=dict)
    windows: dict[int, int] = field(default_factory=dict)
    events: list[ChunkNotice] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, BsrWorkerMetadata):
            return self
        merged = dict(self.loads)
        for rid, ok in other.loads.items():
            merged[rid] = merged.get(rid, True) and ok
        windows = dict(self.windows)
        for job, n in other.windows.items():
            windows[job] = windows.get(job, 0) + n
        return BsrWorkerMetadata(merged, windows, [*self.events, *other.events])


@dataclass
class BsrHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Where a worker serves the scheduler's lookups (``None``: it does not), and its tiers
    fastest first: ``(name, hit source)`` (vLLM's ``CacheHitSource`` value), in the order of a
    lookup answer's per-tier tokens."""

    lookup_socket: str | None = None
    tiers: tuple[tuple[str, str], ...] = ()
