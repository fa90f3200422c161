"""Restores run by the state machine's rules, and the invariants checked on every result."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

import anyio
import torch

from ..core._lifecycle import RequestState
from ..core._results import Policy, RestoreResult
from ..transfer._cache import PagedKVCache
from ._cluster import _Rank
from ._model import Model, _needed_chunks


class Restores(Model):
    """Runs restores on every rank at once and checks each result against the model."""

    #: deadline of restores while a fault plan is active (bounds HANG faults)
    fault_deadline_s: ClassVar[float] = 0.3
    #: extra time a restore may take past its deadline before it counts as hung
    deadline_slack_s: ClassVar[float] = 5.0

    def _restores(self, jobs: list[tuple[list[int], Policy, int]]) -> list[RestoreResult]:
        """Run ``jobs`` (tokens, policy, seed) at once on every rank; check; rank 0's results."""
        faulty = self.faults_active
        deadline = self.fault_deadline_s if faulty else None
        # expectations come from the model as it was before the restores
        snapshot, breakers = (dict(self.store), set(self.blind)), self._breakers()
        dests = {
            (j, r): self._dest_cache(tokens, seed + 7919 * r)
            for j, (tokens, _, seed) in enumerate(jobs)
            for r in range(self.world_size)
        }
        results, elapsed = self._run_at_once(jobs, dests, deadline)
        self._note_breakers(breakers)
        with self._as_of(*snapshot):
            expect = [
                (self._best(tokens, self._visible_surely), self._best(tokens, self._visible_maybe))
                for tokens, _, _ in jobs
            ]
            intact_snapshot = {
                (j, p): self._all_ranks(tokens, p, self._intact)
                for j, (tokens, _, _) in enumerate(jobs)
                for p in range(len(tokens) // self.chunk_tokens + 1)
            }
        first: list[RestoreResult] = []
        for j, (tokens, policy, _) in enumerate(jobs):
            per_rank = []
            for r in range(self.world_size):
                res = results[(j, r)]
                if isinstance(res, BaseException):
                    raise self._violation(
                        f"restore raised {type(res).__name__}: {res!r} instead of ending "
                        "Committed or Invalidated"
                    ) from res
                limit = (deadline or 0.0) + self.deadline_slack_s
                self._check(
                    deadline is None or elapsed[(j, r)] <= limit,
                    f"restore took {elapsed[(j, r)]:.2f}s past its deadline of {deadline}s",
                )
                cache, ids, before = dests[(j, r)]
                self._check_result(r, tokens, policy, res, cache, ids, before)
                per_rank.append(res)
            self._check_agreement(per_rank)
            res0 = per_rank[0]
            p = res0.probed_tokens // self.chunk_tokens
            if not faulty:
                self._check_clean(per_rank, expect[j], intact_snapshot[(j, p)])
            first.append(res0)
        self._settle()
        return first

    def _run_at_once(
        self,
        jobs: list[tuple[list[int], Policy, int]],
        dests: dict[tuple[int, int], tuple[PagedKVCache, torch.Tensor, dict[str, torch.Tensor]]],
        deadline: float | None,
    ) -> tuple[dict[tuple[int, int], RestoreResult | BaseException], dict[tuple[int, int], float]]:
        """Restore every job on every rank at once; by (job, rank), the result (or what it
        raised) and the seconds it took."""
        results: dict[tuple[int, int], RestoreResult | BaseException] = {}
        elapsed: dict[tuple[int, int], float] = {}

        async def go() -> None:
            async def one(j: int, r: int) -> None:
                tokens, policy, _ = jobs[j]
                cache, ids, _ = dests[(j, r)]
                t0 = time.perf_counter()
                try:
                    results[(j, r)] = await self.ranks[r].engine.restore(
                        tokens, cache, ids, policy=policy, deadline_s=deadline
                    )
                except Exception as exc:
                    results[(j, r)] = exc
                elapsed[(j, r)] = time.perf_counter() - t0

            async with anyio.create_task_group() as tg:
                for j in range(len(jobs)):
                    for r in range(self.world_size):
                        tg.start_soon(one, j, r)

        self._call(go)
        return results, elapsed

    def _check_clean(
        self, per_rank: list[RestoreResult], expect: tuple[int, int], intact: bool
    ) -> None:
        """No fault active: the probed prefix is what the model says is stored, and a prefix
        intact in some tier commits on every rank, reading exactly its bytes."""
        res0 = per_rank[0]
        p = res0.probed_tokens // self.chunk_tokens
        lo, hi = expect
        self._check(
            lo <= p <= hi,
            f"restore probed {p} chunks; the model says between {lo} and {hi} are stored",
        )
        if intact:
            self._check(
                all(x.state is RequestState.COMMITTED for x in per_rank)
                and all(x.committed_tokens == res0.probed_tokens for x in per_rank),
                f"every object of the probed {p}-chunk prefix is intact in some tier and "
                f"no fault is active, yet the restore ended {res0.state} with "
                f"{res0.committed_tokens} tokens ({res0.reason}; {list(res0.errors)[:3]})",
            )
            want = sum(self.layout.group_chunk_bytes(g) for _, g in self._needed(p))
            self._check(
                all(x.bytes_read == want for x in per_rank),
                f"a clean restore read {res0.bytes_read} bytes, the prefix holds {want}",
            )

    def _check_agreement(self, per_rank: list[RestoreResult]) -> None:
        states = {(x.state, x.committed_tokens, x.probed_tokens) for x in per_rank}
        self._check(
            len(states) == 1,
            f"ranks ended differently: {[(str(x.state), x.committed_tokens) for x in per_rank]}",
        )

    def _check_result(
        self,
        rank: int,
        tokens: Sequence[int],
        policy: Policy,
        res: RestoreResult,
        cache: PagedKVCache,
        ids: torch.Tensor,
        before: dict[str, torch.Tensor],
    ) -> None:
        assert self.case is not None
        stats = type(self).stats
        stats.restores += 1
        ct, bpc, bt = self.chunk_tokens, self.case.blocks_per_chunk, self.case.block_tokens
        n = len(tokens) // ct
        self._check(res.state.terminal, f"restore returned in non-terminal state {res.state}")
        if res.state is RequestState.COMMITTED:
            stats.committed += 1
            stats.committed_nonempty += res.committed_tokens > 0
            stats.truncated += 0 < res.committed_tokens < res.probed_tokens
        else:
            stats.invalidated += 1
        committed, probed = res.committed_tokens, res.probed_tokens
        self._check(
            committed % ct == 0 and probed % ct == 0 and 0 <= committed <= probed <= n * ct,
            f"committed {committed} / probed {probed} tokens are not chunk-aligned within {n * ct}",
        )
        if res.state is RequestState.INVALIDATED:
            self._check(committed == 0, f"Invalidated yet committed {committed} tokens")
        if policy is Policy.ALL_OR_NOTHING:
            self._check(
                committed in (0, probed),
                f"all_or_nothing committed {committed} of {probed} probed tokens",
            )
        self._check(
            res.rws_peak_bytes <= self.window * self.layout.slot_bytes,
            f"restore RWS {res.rws_peak_bytes} > W x slot_bytes",
        )
        p = committed // ct
        # every committed block holds exactly the saved bytes
        for g in self.layout.groups:
            got = cache.tensor(g.name)
            for c in _needed_chunks(g, p, ct):
                blocks = ids[c * bpc : (c + 1) * bpc]
                want = self.content(rank, tuple(tokens[: (c + 1) * ct]), g.name)
                self._check(
                    torch.equal(got[:, blocks], want.view(g.num_layers, bpc, bt, g.token_bytes)),
                    f"committed chunk {c} of group {g.name!r} on rank {rank} differs from the "
                    f"saved bytes ({res.state}, {committed} tokens)",
                )
        # blocks the restore wrote outside the committed prefix are reported invalid
        committed_blocks = {int(b) for b in ids[: p * bpc].tolist()}
        invalid = set(res.invalid_block_ids)
        request_blocks = {int(b) for b in ids[: n * bpc].tolist()}
        self._check(
            invalid <= request_blocks,
            f"invalid_block_ids {sorted(invalid - request_blocks)} are not the request's blocks",
        )
        self._check(
            not (invalid & committed_blocks),
            "invalid_block_ids include blocks of the committed prefix",
        )
        changed: set[int] = set()
        for g in self.layout.groups:
            diff = (cache.tensor(g.name) != before[g.name]).flatten(2).any(dim=2).any(dim=0)
            changed.update(int(b) for b in torch.nonzero(diff).flatten().tolist())
        unreported = changed - committed_blocks - invalid
        self._check(
            not unreported,
            f"restore wrote blocks {sorted(unreported)} that are neither committed nor reported "
            f"in invalid_block_ids ({res.state}, {committed} tokens)",
        )

    @staticmethod
    def _counts(rk: _Rank) -> tuple[int, int, int]:
        s = rk.engine.statistics()
        return s.restores, s.committed, s.invalidated
