"""Window saves on the scheduler side (``bsr.vllm._windows``) with vLLM's own request, block pool
and scheduler output objects: which prefix ends get a window save, the blocks each one pins in
vLLM's block pool and when they go back (the engine-level test, ``test_window_checkpoints.py``,
drives the same code through vLLM's scheduler; here each rule is pinned down in milliseconds).

Two KV cache groups as vLLM's hybrid manager makes them for the tiny Gemma3: group 0 a sliding
window (bsr keeps its last 63 tokens: one chunk), group 1 full attention; chunk 64, block 32,
window checkpoints every 4 chunks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import (
    CachedRequestData,
    KVConnectorBlockState,
    SchedulerOutput,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

import bsr
from bsr.vllm._metadata import NULL_BLOCK_ID, BsrWorkerMetadata, WindowJob
from bsr.vllm._scheduler import BsrScheduler, _Req
from vllm_settings import connector_settings

CHUNK, BLOCK, EVERY = 64, 32, 4
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, 600)]


def scheduler(tp: int = 1, every: int | None = EVERY, **opts: Any) -> BsrScheduler:
    engine = bsr.EngineConfig.from_dict(
        {"tiers": [{"kind": "host", "capacity_bytes": "1MiB"}], "window_checkpoint_chunks": every}
    )
    s = connector_settings(BLOCK, CHUNK, opts, engine=engine, tp_size=tp, group_windows=(63, None))
    sched = BsrScheduler(s)
    sched.windows.pool = BlockPool(num_gpu_blocks=128, enable_caching=False, hash_block_size=BLOCK)
    return sched


class Running:
    """A request vLLM runs: its two block tables, drawn from the pool like vLLM does."""

    def __init__(
        self, sched: BsrScheduler, rid: str = "r", prompt: list[int] = PROMPT, **kw: Any
    ) -> None:
        self.sched, self.pool = sched, sched.windows.pool
        params = kw.pop("params", None)
        sp = SamplingParams(
            max_tokens=64, extra_args={"kv_transfer_params": params} if params else None
        )
        self.req = Request(rid, list(prompt), sp, None, **kw)
        self.tables: list[list[int]] = [[], []]
        sched.update_state_after_alloc(self.req, KVCacheBlocks(([], [])), 0)

    def grow(self, tokens: int) -> None:
        """Give both groups blocks for ``tokens`` tokens (vLLM's allocation for a step)."""
        for t in self.tables:
            need = -(-tokens // BLOCK) - len(t)
            t.extend(b.block_id for b in self.pool.get_new_blocks(max(0, need)))

    def free_below(self, computed: int) -> None:
        """vLLM's sliding manager: blocks wholly below the window of ``computed`` tokens go."""
        table = self.tables[0]
        for i in range(min((computed - 63) // BLOCK, len(table))):
            if table[i] != NULL_BLOCK_ID:
                self.pool.free_blocks([self.pool.blocks[table[i]]])
                table[i] = NULL_BLOCK_ID

    def step(self, n: int, drafts: int = 0, sample: bool = True) -> list[WindowJob]:
        """One engine step computing ``n`` tokens, ``drafts`` of them speculative (vLLM keeps
        those in ``spec_token_ids``, apart from ``all_token_ids``); with ``sample``, the
        scheduler knows the tokens sampled up to then (synchronous scheduling)."""
        before = self.req.num_computed_tokens
        self.free_below(before)
        self.grow(before + n)
        out = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={self.req.request_id: n},
            total_num_scheduled_tokens=n,
            scheduled_spec_decode_tokens={self.req.request_id: [7] * drafts} if drafts else {},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
            kv_connector_block_state=KVConnectorBlockState(
                req_ids={self.req.request_id},
                resolve_block_ids=lambda rid: tuple(list(t) for t in self.tables),
                boundary_state_offloads={},
            ),
        )
        jobs = list(self.sched.build_connector_meta(out).windows)
        self.req.num_computed_tokens = before + n - drafts
        if sample:
            self.sample()
        return jobs

    def sample(self) -> None:
        """The scheduler learns the tokens sampled so far (one past the computed ones)."""
        while len(self.req.all_token_ids) <= self.req.num_computed_tokens:
            self.req.append_output_token_ids(11)

    def refs(self, ids: list[int]) -> list[int]:
        return [self.pool.blocks[b].ref_cnt for b in ids]


def report(sched: BsrScheduler, job: WindowJob, ranks: int = 1) -> None:
    out = KVConnectorOutput(kv_connector_worker_meta=BsrWorkerMetadata({}, {job.job_id: ranks}))
    sched.update_connector_output(out)


def stats(sched: BsrScheduler) -> dict[str, Any]:
    taken = sched.take_stats()
    return {} if taken is None else dict(taken.data)


def window(job: WindowJob, end: int) -> list[int]:
    """The sliding group's blocks a job saves for the window at ``end``."""
    return list(job.block_ids[0][end // BLOCK - 2 : end // BLOCK])


def test_a_prefill_saves_its_checkpoints_and_lookup_end_pinned_until_reported() -> None:
    sched = scheduler()
    run = Running(sched)
    (job,) = run.step(600)  # the whole prompt in one step
    # checkpoints at 256 and 512, the prompt's lookup end at 576 (not 600: a lookup leaves the
    # chunk with the prompt's last token to vLLM); the other chunk ends are neither
    assert job.ends == (256, 512, 576)
    assert job.tokens == tuple(PROMPT[:576])
    assert all(b == NULL_BLOCK_ID for b in job.block_ids[1])  # the full group: saved at the end
    real = [b for b in job.block_ids[0] if b != NULL_BLOCK_ID]
    assert real == window(job, 256) + window(job, 512) + window(job, 576)
    assert real == [run.tables[0][i] for i in (6, 7, 14, 15, 16, 17)]
    assert run.refs(real) == [2] * 6  # the request's reference and bsr's
    assert sched.windows.pending
    run.free_below(700)  # vLLM lets the window move on: bsr's reference keeps the blocks
    assert run.refs(real) == [1] * 6
    report(sched, job)
    assert run.refs(real) == [0] * 6 and not sched.windows.pending
    assert stats(sched)["window_saves"] == 3


def test_window_saves_are_keyed_like_the_request_and_never_made_for_an_opt_out() -> None:
    """A window is saved under the request's salt (the same keys its end save and a later
    lookup use); a request that must not be stored, or that bsr cannot key, gets none."""
    from bsr.vllm._request_keys import request_keys

    sched = scheduler()
    salted = Running(sched, "salted", cache_salt="alice")
    (job,) = salted.step(600)
    assert job.extras == request_keys(salted.req, CHUNK).extras and job.extras
    for rid, kw in (
        ("opt-out", {"params": {"bsr": {"store": False}}}),
        ("bad-option", {"params": {"bsr": {"store": "no"}}}),
    ):
        assert Running(sched, rid, **kw).step(600) == []
    taken = stats(sched)
    assert taken["window_saves"] == 3 and taken["rejected_options"] == {
        "kv_transfer_params.bsr.store": 1
    }


def test_every_rank_reports_before_the_blocks_go_back() -> None:
    sched = scheduler(tp=2)
    run = Running(sched)
    (job,) = run.step(600)
    real = [b for b in job.block_ids[0] if b != NULL_BLOCK_ID]
    report(sched, job)
    assert run.refs(real) == [2] * 6 and sched.windows.pending
    report(sched, job)
    assert run.refs(real) == [1] * 6 and not sched.windows.pending


def test_generated_chunks_each_get_their_window_drafts_and_unknown_tokens_wait() -> None:
    sched = scheduler()
    run = Running(sched)
    run.step(600)
    jobs = [j for _ in range(638 - 600) for j in run.step(1)]
    assert not jobs  # no chunk boundary reached yet
    assert not run.step(3, drafts=2)  # tokens 639 and 640 only drafts: 640 not surely reached
    (job,) = run.step(1)
    assert job.ends == (640,) and window(job, 640) == run.tables[0][18:20]
    # asynchronous scheduling: the step's last input token is not known to the scheduler yet
    for _ in range(702 - 640):
        run.step(1, sample=False)  # each step's input token is known one step late
        run.req.append_output_token_ids(11)
    assert not run.step(1, sample=False)  # computes token 702; token 703 is sampled in it
    assert len(run.req.all_token_ids) == 703
    assert not run.step(1, sample=False)  # reaches 704, but token 703 is not known here
    run.sample()
    (job,) = run.step(1)  # known now, and the window at 704 is still whole
    assert job.ends == (704,) and job.tokens == tuple(run.req.all_token_ids[:704])


def test_a_window_vllm_already_let_go_or_an_unverified_request_is_skipped() -> None:
    sched = scheduler()
    run = Running(sched)
    run.step(500)  # a chunked prefill: the checkpoint at 256 now, 512 in the next step
    run.grow(576)
    run.pool.free_blocks([run.pool.blocks[run.tables[0][15]]])
    run.tables[0][15] = NULL_BLOCK_ID  # gone under the window at 512 (a window not whole)
    (job,) = run.step(76)  # reaches 512 (a checkpoint) and 576 (the lookup end)
    assert job.ends == (576,)
    assert stats(sched)["windows_skipped"] == {"freed": 1}
    sched2 = scheduler()
    other = Running(sched2, "u")
    sched2._reqs["u"] = _Req(unverified=True)  # its load's outcome is not known yet
    assert not other.step(600)
    assert stats(sched2)["windows_skipped"] == {"unverified": 3}
    assert not sched2.windows.pending


def test_no_checkpoints_keeps_the_lookup_end_and_a_hit_skips_what_it_covers() -> None:
    sched = scheduler(every=None)
    run = Running(sched)
    run.req.num_computed_tokens = 320  # a hit: ends at or below it were someone else's
    (job,) = run.step(280)
    assert job.ends == (576,)
    sched.request_finished(run.req, tuple(run.tables))
    assert not run.step(64)  # a finished request is forgotten
