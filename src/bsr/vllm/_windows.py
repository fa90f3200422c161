"""Window saves: a sliding-window group's window at the prefix ends a request reaches, stored
while vLLM still holds its blocks.

Where it runs: vLLM's EngineCore process, inside the scheduler's loop (:class:`~bsr.vllm.
_scheduler.BsrScheduler` calls it every step); the saves themselves run on the workers
(:class:`~bsr.vllm._metadata.WindowJob`).

Why: vLLM's hybrid KV cache manager frees a request's sliding-window blocks below the window as
the request runs (``remove_skipped_blocks``: blocks wholly below ``computed - sliding_window + 1
- extra_retained_tokens`` become its null block). When the request finishes, the save at its end
can store every full-attention chunk but a sliding group's window only at the very end of the
computed tokens, and only while that window is still whole in real blocks: a request that ran a
block or more past its last chunk boundary has lost even that. A later request sharing a shorter
prefix (a system prompt, the same prompt, the previous turn of a conversation) needs the window
at *its* prefix end.

How it works: every step, for each request scheduled in it, the chunk boundaries its computed
tokens reach in this step are checked against the ends worth a window: every
``window_checkpoint_chunks``-th chunk boundary (the *window checkpoints*, the ``"bsr"`` config's
option), the end of the prompt's full chunks that a lookup of the same prompt asks for (every
full chunk but the one holding the prompt's last token), and every boundary past it (the
generated tokens: the end of a turn is what the next turn of a conversation asks for). For each
such end whose window lies wholly in real blocks of the request's current tables (vLLM's view
after this step's allocation), the scheduler takes one reference on those blocks in vLLM's block
pool (``BlockPool.touch``: vLLM may drop its own reference as the window moves on, but never
reuses the blocks while bsr holds one) and sends the workers a :class:`WindowJob`: the tokens and
tables with only those blocks real, which each worker saves after this step's forward wrote
them. Every rank reports each job done (:class:`~bsr.vllm._metadata.BsrWorkerMetadata`), and the
references are given back once all have (``BlockPool.free_blocks``); meanwhile the connector
tells vLLM it has work pending (``has_pending_push_work``: vLLM keeps stepping so the reports
come back). A window save is bounded by the load deadline (a hung store holds its blocks no
longer), and vLLM is not told to wait for them rather than preempt: it only has fewer free
blocks meanwhile. A window is saved only from KV vLLM computed or bsr verified: never for a
request whose load is not known good, nor from blocks a load not known good writes (the
scheduler's own rule for saves).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bsr import KeyExtra

from ._metadata import NULL_BLOCK_ID, WindowJob
from ._options import ConnectorSettings
from ._stats import BsrConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: ``may_save(request_id, blocks)``: the scheduler's rule for saving KV from those blocks
MaySave = Callable[[str, frozenset[int]], bool]


@dataclass
class _Track:
    """One running request: the next chunk boundary to look at, and its prompt's lookup end."""

    request: Request
    next_end: int | None = None  # set when the request is first scheduled
    prompt_end: int = 0
    extras: tuple[KeyExtra, ...] = ()  # what else its KV is keyed by (its salt, adapter, ...)


class WindowSaver:
    """The scheduler side of window saves (see the module docstring).

    Args:
        settings: the connector's settings (chunk and block size, each KV cache group's window,
            the checkpoint interval, tensor-parallel ranks, whether this role saves).
        stats: the scheduler's stats (``window_saves``, ``windows_skipped``).
    """

    def __init__(self, settings: ConnectorSettings, stats: BsrConnectorStats) -> None:
        self.chunk = settings.chunk_tokens
        self.block = settings.block_size
        self.windows = settings.group_windows
        self.every = settings.engine.window_checkpoint_chunks
        self.ranks = settings.tp_size
        self.max_pending = settings.options.max_pending_saves
        self.enabled = settings.saves and any(w is not None for w in self.windows)
        self.stats = stats
        self.pool: Any = None  # vLLM's BlockPool (bind_gpu_block_pool)
        self._tracks: dict[str, _Track] = {}
        self._pinned: dict[int, tuple[list[int], int]] = {}  # job -> (blocks, reports missing)
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ requests
    def track(self, request: Request, extras: tuple[KeyExtra, ...] = ()) -> None:
        """Watch a request from its first scheduling on (again after a preemption); its
        windows are keyed with ``extras`` (:mod:`bsr.vllm._request_keys`)."""
        if not self.enabled or request.request_id in self._tracks:
            return
        prompt = int(request.num_prompt_tokens)
        # a lookup of this prompt asks for every full chunk but the one with its last token
        self._tracks[request.request_id] = _Track(
            request, prompt_end=max(0, prompt - 1) // self.chunk * self.chunk, extras=extras
        )

    def forget(self, request_id: str) -> None:
        """The request finished: no more windows of it (its jobs in flight keep their blocks)."""
        self._tracks.pop(request_id, None)

    def wanted(self, track: _Track, end: int) -> bool:
        """Whether a window at prefix ``end`` (tokens, a chunk boundary) is worth saving."""
        if end >= track.prompt_end:  # the prompt's lookup end, or generated tokens
            return True
        return self.every is not None and (end // self.chunk) % self.every == 0

    # ------------------------------------------------------------------ every step
    def plan(
        self,
        scheduler_output: SchedulerOutput,
        blocks_of: Callable[[str], Sequence[Sequence[int]] | None],
        may_save: MaySave,
    ) -> list[WindowJob]:
        """The window saves of this step (their blocks pinned); call from build_connector_meta.

        ``blocks_of(request_id)``: the request's block ids per KV cache group now (vLLM's
        tables after this step's allocation, its null block 0 where it holds none).
        """
        if not self.enabled or not self._tracks:
            return []
        jobs = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            track = self._tracks.get(rid)
            if track is None:
                continue
            req = track.request
            before = int(req.num_computed_tokens)
            if track.next_end is None:  # ends at or below a hit were computed by another
                track.next_end = (before // self.chunk + 1) * self.chunk
            # only tokens known here count: vLLM keeps draft tokens (which may be rejected)
            # apart from all_token_ids, and with asynchronous scheduling a step's last input
            # token is known a step later (its window is saved then, still whole)
            reached = min(before + int(n), len(req.all_token_ids))
            ends = []
            while track.next_end <= reached:
                end, track.next_end = track.next_end, track.next_end + self.chunk
                if self.wanted(track, end):
                    ends.append(end)
            if ends:
                job = self._job(rid, req, ends, blocks_of, may_save, track.extras)
                if job is not None:
                    jobs.append(job)
        return jobs

    def _job(
        self,
        rid: str,
        req: Request,
        ends: list[int],
        blocks_of: Callable[[str], Sequence[Sequence[int]] | None],
        may_save: MaySave,
        extras: tuple[KeyExtra, ...] = (),
    ) -> WindowJob | None:
        tables = blocks_of(rid)
        if tables is None or len(tables) != len(self.windows) or self.pool is None:
            self.stats.count_key("windows_skipped", "no_tables", len(ends))
            return None
        if len(self._pinned) >= self.max_pending:
            self.stats.count_key("windows_skipped", "busy", len(ends))
            return None
        last = ends[-1] // self.block
        out = [[NULL_BLOCK_ID] * last for _ in tables]
        kept = []
        for end in ends:
            spans = self._window_blocks(end)
            if all(_real(tables[g], lo, hi) for g, (lo, hi) in spans.items()):
                kept.append(end)
                for g, (lo, hi) in spans.items():
                    out[g][lo:hi] = tables[g][lo:hi]
            else:  # vLLM already let some of its blocks go (a window not whole in chunks)
                self.stats.count_key("windows_skipped", "freed")
        blocks = frozenset(b for t in out for b in t if b != NULL_BLOCK_ID)
        if not kept or not may_save(rid, blocks):
            if kept:
                self.stats.count_key("windows_skipped", "unverified", len(kept))
            return None
        job = WindowJob(
            next(self._seq), rid, tuple(req.all_token_ids[: kept[-1]]), tuple(kept),
            tuple(tuple(t[: kept[-1] // self.block]) for t in out), extras,
        )  # fmt: skip
        pinned = sorted(blocks)
        self.pool.touch([self.pool.blocks[b] for b in pinned])
        self._pinned[job.job_id] = (pinned, self.ranks)
        self.stats.count("window_saves", len(kept))
        return job

    def _window_blocks(self, end: int) -> dict[int, tuple[int, int]]:
        """Per sliding group (vLLM's group index): the block range ``[lo, hi)`` of the chunks
        its window at prefix ``end`` needs (whole chunks: an object holds its whole chunk)."""
        chunks = end // self.chunk
        per = self.chunk // self.block
        out = {}
        for g, w in enumerate(self.windows):
            if w is not None:
                first = max(0, chunks - -(-w // self.chunk))
                out[g] = (first * per, chunks * per)
        return out

    # ------------------------------------------------------------------ reports
    def done(self, reports: dict[int, int]) -> None:
        """Workers reported window jobs done (job -> ranks): give back the blocks of each job
        every rank has reported."""
        for job, n in reports.items():
            entry = self._pinned.get(job)
            if entry is None:
                continue
            blocks, missing = entry
            missing -= n
            if missing > 0:
                self._pinned[job] = (blocks, missing)
                continue
            del self._pinned[job]
            self.pool.free_blocks(self.pool.blocks[b] for b in reversed(blocks))

    @property
    def pending(self) -> bool:
        """Whether window saves still hold blocks (vLLM must keep stepping for their reports)."""
        return bool(self._pinned)


def _real(table: Sequence[int], lo: int, hi: int) -> bool:
    """Whether entries ``[lo, hi)`` of a vLLM block table all name a block."""
    return hi <= len(table) and all(table[i] != NULL_BLOCK_ID for i in range(lo, hi))
