"""Records returned by the engine: Probe, SaveResult, RestoreResult, and the option enums."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ._keys import ChunkKey
from ._lifecycle import Reason, RequestState, TransitionRecord
from ._options import Policy as Policy
from ._options import Strategy as Strategy
from ._options import choice as choice


class Releasable(Protocol):
    """Something held that must be given back (a probe's tier leases)."""

    def release(self) -> None: ...


@dataclass(frozen=True)
class LoadDecision:
    """What policy ``"cost"`` chose for one probed prefix, and from what.

    Attributes:
        choice: ``"load"`` (the whole probed prefix), ``"partial"`` (a shorter prefix: the
            rest is recomputed), ``"recompute"`` (nothing is loaded), ``"unmeasured"`` (a rate
            it needs has no measurement yet: the whole prefix is loaded, which measures it),
            ``"probe"`` (the cheapest was less than the whole prefix, but this is the one such
            decision in ``probe_every`` that loads it all, to measure the tiers it avoided
            again; :class:`~bsr.CostModel`) or ``"empty"`` (nothing to decide: no chunk past
            the caller's own).
        load_chunks: chunks loaded from token 0 (chunks below ``start_chunks`` are the
            caller's own); the probed prefix past them is recomputed.
        probed_chunks: the probed (agreed) prefix.
        start_chunks: whole chunks the caller already holds (neither loaded nor recomputed).
        bytes_by_tier: bytes a load of the whole probed prefix past ``start_chunks`` reads, per
            tier (each object's first holder).
        read_rates: the measured read rate of each of those tiers, bytes/s (None: none yet).
        prefill_rate: the measured prefill rate, tokens/s (None: none yet).
        load_s: estimated seconds to load the chosen chunks (0.0 for none).
        recompute_s: estimated seconds to recompute the rest of the probed prefix.
        full_load_s: estimated seconds to load the whole probed prefix (None: unmeasured).
        full_recompute_s: estimated seconds to recompute it all (None: unmeasured).
    """

    choice: str
    load_chunks: int
    probed_chunks: int
    start_chunks: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    read_rates: dict[str, float | None] = field(default_factory=dict)
    prefill_rate: float | None = None
    load_s: float | None = None
    recompute_s: float | None = None
    full_load_s: float | None = None
    full_recompute_s: float | None = None

    @property
    def loads(self) -> bool:
        """Whether anything past the caller's own chunks is loaded."""
        return self.load_chunks > self.start_chunks

    def to_dict(self) -> dict[str, object]:
        """The decision and its inputs as plain values (logs, traces, JSON)."""
        return {
            "choice": self.choice,
            "load_chunks": self.load_chunks,
            "probed_chunks": self.probed_chunks,
            "start_chunks": self.start_chunks,
            "bytes_by_tier": dict(self.bytes_by_tier),
            "read_rates": dict(self.read_rates),
            "prefill_rate": self.prefill_rate,
            "load_s": self.load_s,
            "recompute_s": self.recompute_s,
            "full_load_s": self.full_load_s,
            "full_recompute_s": self.full_recompute_s,
        }


@dataclass(frozen=True)
class Probe:
    """Where the reusable prefix of a token sequence is, found without moving data.

    Attributes:
        num_tokens: tokens looked up.
        keys: chained keys of every full chunk.
        holders: ``holders[c][group]`` = names of the tiers holding that object, fastest first.
        local_chunks: longest reusable prefix on this rank, in chunks.
        prefix_chunks: the prefix agreed by all ranks, in chunks.
        prefix_tokens: ``prefix_chunks * chunk_tokens``.
        bytes_by_tier: bytes a restore of the agreed prefix would read per tier (first choice).
        duration_s: wall time of the probe.
        unanswered: the tiers this rank's probe did not hear from, in tier order: cut off by
            its deadline, failed, skipped by an open circuit breaker, or not asked before the
            deadline; they hold nothing in ``holders``. Empty when every tier answered.
    """

    num_tokens: int
    chunk_tokens: int
    keys: tuple[ChunkKey, ...]
    holders: tuple[dict[str, tuple[str, ...]], ...]
    local_chunks: int
    prefix_chunks: int
    bytes_by_tier: dict[str, int]
    duration_s: float
    #: digest of (namespace, tokens) so ``restore(..., probe=probe)`` can check it was made
    #: for the same tokens by an engine of the same namespace
    digest: bytes = b""
    #: the engine that made the probe: its holders name that engine's tiers and its lease pins
    #: them, so ``restore(..., probe=probe)`` refuses a probe of another engine
    origin: bytes = b""
    #: the tier leases taken by ``lookup(..., lease_ttl_s=...)`` (released by the restore that
    #: uses this probe, by :meth:`release`, or when their TTL passes)
    lease: Releasable | None = field(default=None, compare=False, repr=False)
    #: policy ``"cost"``: how much of the prefix is worth loading, and from what (a restore
    #: given this probe loads that much)
    decision: LoadDecision | None = None
    unanswered: tuple[str, ...] = ()

    def release(self) -> None:
        """Give back the leases this probe holds (idempotent; a restore does it for you)."""
        if self.lease is not None:
            self.lease.release()

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_chunks * self.chunk_tokens

    @property
    def hit(self) -> bool:
        return self.prefix_chunks > 0


@dataclass(frozen=True)
class SaveResult:
    """Outcome of :meth:`RestoreEngine.save`.

    Attributes:
        saved_tokens: the longest prefix a restore can read from what this save stored: every
            full chunk of the tokens, or a shorter prefix when the block tables hold no block
            where a longer prefix's state lies (e.g. a sliding-window group's blocks already
            outside its window); 0 when none fits. A group without a window may have stored
            more chunks than that (its longest prefix in real blocks), for a later save of a
            sliding window to complete.
        chunks: ``saved_tokens`` in chunks.
        objects_written, objects_skipped, bytes_written, errors: per tier.
        skipped: objects not written because a tier stayed busy past its bound, by reason
            (``{"root_locked": 3}``: a FileTier root whose lock another process held; the
            rest of the save skips that tier), or because its circuit breaker was open
            (``"breaker_open"``: every object of the save; the tier was not asked). Not an
            error: nothing failed, a later save of the same tokens writes them.
    """

    saved_tokens: int
    chunks: int
    objects_written: dict[str, int]
    objects_skipped: dict[str, int]
    bytes_written: dict[str, int]
    errors: dict[str, int]
    rws_peak_bytes: int
    duration_s: float
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No tier failed (a skip because a tier was busy is not a failure: see ``skipped``)."""
        return not any(self.errors.values())


@dataclass(frozen=True)
class Timings:
    """Where one restore's time went, in seconds (wall clock, this rank).

    Attributes:
        probe_s: probing the tiers and agreeing the prefix.
        install_s: windowing (reading chunks and installing them into the cache).
        commit_s: the commit rule and its agreement across ranks.
        total_s: from the call to the result (admission and release included).
        settle_s: between windowing and the commit: waiting for the device copies to land and
            moving the corrupt objects the restore found out of their tiers.
    """

    probe_s: float
    install_s: float
    commit_s: float
    total_s: float
    settle_s: float = 0.0


@dataclass(frozen=True)
class RestoreResult:
    """Outcome of :meth:`RestoreEngine.restore`.

    Attributes:
        state: Committed or Invalidated.
        committed_tokens: tokens now reusable in the cache (0 unless Committed).
        probed_tokens: tokens of the agreed probed prefix.
        bytes_by_tier: payload bytes actually read from each tier.
        rws_peak_bytes: this request's peak staging bytes (its restoration working set).
        timings: probe, install (windowing), settle, commit and total seconds (:class:`Timings`).
        reason: why it ended there.
        invalid_block_ids: blocks written by this restore that hold no valid state (every touched
            block when Invalidated; blocks past the committed prefix under ``truncate``), of
            every group.
        invalid_block_ids_by_group: the same per state group (for callers whose groups have
            block tables of their own, whose ids may repeat across groups).
        trace: the request's transitions.
        strategy, policy: what was asked for.
        decision: policy ``"cost"``: the load-or-recompute decision and its inputs.
        fallbacks: reads served by a lower tier after a higher one failed.
        quarantined: objects taken out of service during this restore.
    """

    request_id: str
    state: RequestState
    committed_tokens: int
    probed_tokens: int
    bytes_by_tier: dict[str, int]
    rws_peak_bytes: int
    timings: Timings
    reason: Reason
    invalid_block_ids: tuple[int, ...]
    trace: tuple[TransitionRecord, ...]
    strategy: Strategy
    policy: Policy
    fallbacks: int = 0
    quarantined: int = 0
    errors: tuple[str, ...] = field(default=())
    invalid_block_ids_by_group: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: policy ``"cost"``: what it chose to load and from what (None under other policies)
    decision: LoadDecision | None = None
    #: seconds each tier had at least one of this restore's reads in flight (its reads'
    #: verified throughput is ``bytes_by_tier[t] / read_s_by_tier[t]``)
    read_s_by_tier: dict[str, float] = field(default_factory=dict)
    #: the tiers its probe did not hear from (cut off at the engine's ``probe_share`` of the
    #: deadline, failed, skipped by an open circuit breaker, not asked): they held nothing for
    #: this restore (``Probe.unanswered`` of the probe it used)
    unanswered: tuple[str, ...] = ()

    @property
    def committed(self) -> bool:
        return self.state is RequestState.COMMITTED

    @property
    def bytes_read(self) -> int:
        return sum(self.bytes_by_tier.values())
