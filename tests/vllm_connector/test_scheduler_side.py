"""The connector's scheduler side with vLLM's own request, block and output objects, asking a real
lookup socket whose answers the test controls (the engine-level tests drive the same code through
vLLM's scheduler; here each rule is pinned down on its own, in milliseconds).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

import bsr
from bsr.vllm._lookup import LookupHints, LookupServer, private_socket_path
from bsr.vllm._metadata import BsrConnectorMetadata, BsrWorkerMetadata
from bsr.vllm._scheduler import BsrScheduler
from vllm_settings import connector_settings

CHUNK, BLOCK = 64, 32
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, 200)]  # 3 usable chunks


class Worker:
    """A lookup socket that answers ``hit`` tokens, at once or when the test says."""

    def __init__(self, hit: int = 192, hold: bool = False) -> None:
        self.hit, self.hold = hit, hold
        self.asked: list[int] = []
        self.extras: list[tuple[bsr.KeyExtra, ...]] = []  # each lookup's extra keys
        self.pending: list[tuple[int, int]] = []
        self.hints: list[LookupHints] = []  # each lookup's hints (vLLM's hit, prefill rate)
        self.by_tier: list[int] = []  # the answer's tokens per tier
        self.server = LookupServer(private_socket_path(), self._handle)

    def _handle(
        self,
        cid: int,
        seq: int,
        tokens: np.ndarray,
        extras: tuple[bsr.KeyExtra, ...],
        hints: LookupHints,
    ) -> None:
        self.asked.append(len(tokens))
        self.extras.append(extras)
        self.hints.append(hints)
        if self.hold:
            self.pending.append((cid, seq))
        else:
            self.server.reply(cid, seq, min(self.hit, len(tokens)), self.by_tier)

    def release(self) -> None:
        for cid, seq in self.pending:
            self.server.reply(cid, seq, self.hit)
        self.pending.clear()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.server.close()


def scheduler(worker: Worker | None, role: str = "kv_both", **opts: Any) -> BsrScheduler:
    s = connector_settings(
        BLOCK, CHUNK, opts, loads=role != "kv_producer", saves=role != "kv_consumer"
    )
    sched = BsrScheduler(s)
    sched.set_lookup_socket(None if worker is None else worker.server.path)
    return sched


def request(rid: str, prompt: list[int] = PROMPT) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8), None)


def ask_until(sched: BsrScheduler, req: Request, computed: int = 0) -> tuple[int | None, bool]:
    """Ask as vLLM's scheduler does, step after step, until the answer is not None."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        n, is_async = sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, is_async
        time.sleep(0.005)
    raise AssertionError("no answer")


def wait_for(cond: Callable[[], bool]) -> None:
    end = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def blocks(first: int, n: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(first + i) for i in range(n)],))


def step(
    sched: BsrScheduler,
    scheduled: list[Request] = (),  # type: ignore[assignment]
    new_blocks: dict[str, list[int]] | None = None,
) -> BsrConnectorMetadata:
    """One step: ``scheduled`` new requests, and running ones given ``new_blocks``."""
    cached = CachedRequestData.make_empty()
    for rid, ids in (new_blocks or {}).items():
        cached.req_ids.append(rid)
        cached.new_block_ids.append((list(ids),))
        cached.num_computed_tokens.append(0)
        cached.num_output_tokens.append(0)
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(r, ([],)) for r in scheduled],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    meta = sched.build_connector_meta(out)
    assert isinstance(meta, BsrConnectorMetadata)
    return meta


def outcome(sched: BsrScheduler, **loads: bool) -> None:
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=BsrWorkerMetadata(dict(loads)))
    )


def finish(sched: BsrScheduler, req: Request, computed: int) -> tuple[bool, Any]:
    req.num_computed_tokens = computed
    n = -(-computed // BLOCK)
    return sched.request_finished(req, (list(range(100, 100 + n)),))


def stats(sched: BsrScheduler) -> dict[str, Any]:
    taken = sched.take_stats()
    return {} if taken is None else dict(taken.data)


def test_none_until_the_answer_is_in_and_one_lookup_per_request() -> None:
    w = Worker(hold=True)
    try:
        sched = scheduler(w)
        req = request("r1")
        for _ in range(5):  # vLLM asks every step; the scheduler never waits
            t0 = time.monotonic()
            assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
            assert time.monotonic() - t0 < 5.0  # the held worker never answers: 5 s is no wait
        wait_for(lambda: bool(w.pending))
        assert w.asked == [192]  # the prompt's full chunks, one token left for vLLM
        w.release()
        assert ask_until(sched, req) == (192, True)
        assert stats(sched)["lookups"] == 1
    finally:
        w.server.close()


def test_sync_mode_answers_false(worker: Worker) -> None:
    assert ask_until(scheduler(worker, load="sync"), request("r1")) == (192, False)


def test_a_local_hit_is_subtracted_and_the_load_starts_past_it(worker: Worker) -> None:
    sched = scheduler(worker)
    req = request("r1")
    assert ask_until(sched, req, computed=96) == (96, True)
    sched.update_state_after_alloc(req, blocks(10, 6), 96)
    (job,) = step(sched).loads
    assert (job.start_tokens, job.end_tokens) == (96, 192)
    assert job.tokens == tuple(PROMPT[:192]) and job.block_ids == (tuple(range(10, 16)),)
    assert job.lookup_id is not None  # the worker's leased probe of exactly these tokens
    assert stats(sched)["hit_tokens"] == 96


def test_an_answer_that_never_comes_is_a_miss_and_asked_again() -> None:
    w = Worker(hold=True)
    try:
        sched = scheduler(w, lookup_timeout_s=0.1)
        req = request("r1")
        assert ask_until(sched, req) == (0, False)  # lookup_timeout_s + grace later
        assert stats(sched)["lookups_timed_out"] == 1
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # a new lookup
        wait_for(lambda: len(w.asked) == 2)
        assert step(sched).forget_lookups  # the lost one's lease may go
    finally:
        w.server.close()


def test_no_socket_means_no_hit() -> None:
    assert scheduler(None).get_num_new_matched_tokens(request("r1"), 0) == (0, False)


def test_requests_sharing_chunks_wait_for_the_first_load(worker: Worker) -> None:
    sched = scheduler(worker)
    r1, r2 = request("r1"), request("r2")
    assert ask_until(sched, r1) == (192, True)
    sched.update_state_after_alloc(r1, blocks(0, 6), 192)
    step(sched)
    # asked step after step: None while r2's lookup is out, then None because r1 is loading
    # r2's chunks (deferred); however long the answer takes on a busy machine
    end = time.monotonic() + 30
    while not sched.stats.data["deferred"]:
        assert time.monotonic() < end, "never deferred"
        assert sched.get_num_new_matched_tokens(r2, 0) == (None, False)
        time.sleep(0.005)
    assert sched.get_num_new_matched_tokens(r2, 0) == (None, False)  # still deferred
    outcome(sched, r1=True)
    step(sched, scheduled=[r1])  # r1 runs: its blocks are in vLLM's prefix cache
    # vLLM now finds r2's prefix in its own cache: nothing more to load
    assert sched.get_num_new_matched_tokens(r2, 192) == (0, False)
    r3 = request("r3", PROMPT[:100] + [7] * 100)  # shares only the first chunk
    assert ask_until(sched, r3) == (192, True)  # nothing of it is loading any more


def test_a_failed_load_is_never_offered_again(worker: Worker) -> None:
    sched = scheduler(worker)
    req = request("r1")
    assert ask_until(sched, req) == (192, True)
    sched.update_state_after_alloc(req, blocks(0, 6), 192)
    step(sched)
    outcome(sched, r1=False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # vLLM recomputes it


def test_only_computed_or_verified_kv_is_saved(worker: Worker) -> None:
    """The store-poisoning finding: vLLM may finish a request before it handles the step's
    failed-load report. While a request's load is not known good it is never saved, nor is a
    request sharing blocks with such a load (sync loads fill blocks vLLM caches at once)."""
    sched = scheduler(worker, load="sync")
    r1, r2 = request("r1"), request("r2", PROMPT[:64] + [9] * 40)
    assert ask_until(sched, r1) == (192, False)
    sched.update_state_after_alloc(r1, blocks(100, 7), 192)
    step(sched)
    assert finish(sched, r1, 200) == (False, None)  # aborted before the outcome
    assert finish(sched, r2, 104) == (False, None)  # its first blocks are r1's (100, 101)
    assert stats(sched)["saves_skipped"] == {"unverified": 2}
    assert step(sched).saves == []
    outcome(sched, r1=False)  # the failed load is handled by now: computed KV is saved again
    r3 = request("r3", [5] * 100)  # vLLM gives it blocks 100 and 101 afresh, to compute
    worker.hit = 0
    assert ask_until(sched, r3) == (0, False)
    sched.update_state_after_alloc(r3, blocks(100, 4), 0)
    assert finish(sched, r3, 104) == (True, None)
    (save,) = step(sched).saves
    assert save.req_id == "r3" and len(save.tokens) == 64 and save.block_ids == ((100, 101),)


def admit(sched: BsrScheduler, req: Request, local_hit: int, table: KVCacheBlocks) -> None:
    """vLLM admits ``req`` with its own prefix-cache hit of ``local_hit`` tokens: the
    connector is asked past it (nothing to load here), then told the blocks."""
    assert sched.get_num_new_matched_tokens(req, local_hit) == (0, False)
    sched.update_state_after_alloc(req, table, 0)


def failed_sync_load(sched: BsrScheduler, req: Request) -> None:
    """A sync load of ``req`` into blocks 100..106, reported failed. vLLM cached the blocks
    when it allocated them (a sync load's are cached at once), before bsr wrote them."""
    assert ask_until(sched, req) == (192, False)
    sched.update_state_after_alloc(req, blocks(100, 7), 192)
    step(sched)


def test_a_failed_sync_load_left_in_vllms_cache_is_never_saved(worker: Worker) -> None:
    """Found by the connector model (spec/connector.pml): a request aborted while its sync load
    fails is not in vLLM's running list when vLLM handles the step's invalid blocks, so nothing
    recomputes or evicts them, and vLLM's prefix cache hands them to the next request with that
    prompt. That request's KV is not computed or verified: it must never be saved."""
    sched = scheduler(worker, load="sync")
    r1 = request("r1")
    failed_sync_load(sched, r1)
    assert finish(sched, r1, 200) == (False, None)  # aborted before the outcome: not saved
    outcome(sched, r1=False)
    r2 = request("r2")  # the same prompt: vLLM's own cache holds its 192 tokens (r1's blocks)
    admit(sched, r2, 192, blocks(100, 7))
    assert finish(sched, r2, 200) == (False, None)
    assert step(sched).saves == []
    assert stats(sched)["saves_skipped"] == {"unverified": 2}


def test_a_request_handed_blocks_of_a_sync_load_that_fails_is_never_saved(
    worker: Worker,
) -> None:
    """Found by the connector model: r2 is admitted on r1's cached blocks while r1's sync load
    runs (in the same step, or in the next one under async scheduling); the load fails. vLLM
    has r1 recompute the blocks, but r2 may have computed over them meanwhile (vLLM keeps what
    r2 computed when another request recomputes the shared block), so r2 is never saved."""
    sched = scheduler(worker, load="sync")
    r1, r2 = request("r1"), request("r2")
    failed_sync_load(sched, r1)
    admit(sched, r2, 192, blocks(100, 7))  # before the load's outcome
    outcome(sched, r1=False)
    assert finish(sched, r1, 200) == (True, None)  # r1 recomputed its blocks in place
    assert finish(sched, r2, 200) == (False, None)
    (save,) = step(sched).saves
    assert save.req_id == "r1" and save.block_ids == (tuple(range(100, 106)),)


def test_a_failed_sync_load_recomputed_in_place_heals(worker: Worker) -> None:
    """vLLM truncates a running request at the first block its sync load failed to fill and
    recomputes from there into the same blocks: once the request finished past them, they hold
    computed KV, and requests that find them in vLLM's cache afterwards are saved again."""
    sched = scheduler(worker, load="sync")
    r1, r2 = request("r1"), request("r2")
    failed_sync_load(sched, r1)
    outcome(sched, r1=False)
    assert finish(sched, r1, 200) == (True, None)
    admit(sched, r2, 192, blocks(100, 7))
    assert finish(sched, r2, 200) == (True, None)
    assert [s.req_id for s in step(sched).saves] == ["r1", "r2"]


def test_a_request_preempted_during_its_failing_sync_load_is_never_saved(
    worker: Worker,
) -> None:
    """Found by the connector model: vLLM preempts r1 (async scheduling) while the step with
    its sync load runs; r1 is not running when the failure is reported, so nothing recomputes
    the blocks, and readmitted r1 finds them in vLLM's cache: never saved."""
    sched = scheduler(worker, load="sync")
    r1 = request("r1")
    failed_sync_load(sched, r1)
    outcome(sched, r1=False)
    admit(sched, r1, 192, blocks(100, 7))  # readmitted after the preemption
    assert finish(sched, r1, 200) == (False, None)
    assert step(sched).saves == []


def test_blocks_computed_over_a_failed_sync_load_are_never_saved() -> None:
    """Found by the connector model with two preemptions: the step of a sync load computes the
    rest of the prompt over the loaded blocks, and vLLM caches those blocks in the same step. If
    the load fails and its request is aborted (or preempted) before vLLM handles the failure,
    they stay in vLLM's cache holding KV computed over garbage. Once the loaded blocks
    themselves have been given out afresh (the chain re-rooted on a recomputed first chunk),
    a request with that prompt is admitted on them: never saved."""
    w = Worker(hit=64)  # bsr holds the first chunk only: the step computes the other two
    try:
        sched = scheduler(w, load="sync")
        r1 = request("r1")
        assert ask_until(sched, r1) == (64, False)
        sched.update_state_after_alloc(r1, blocks(100, 7), 64)  # load: 100, 101; computed: rest
        step(sched)
        assert finish(sched, r1, 200) == (False, None)  # aborted before the outcome
        outcome(sched, r1=False)
        # vLLM gives 100 and 101 out afresh (to r3, a short prompt); another request computes
        # the prompt from token 0 into 300..306: the first chunk's hashes now name 300 and 301,
        # the later ones still name 102..105 first (vLLM hands out the first block cached)
        admit(sched, request("r3", PROMPT[:40]), 0, blocks(100, 2))
        r2 = request("r2")
        table = [300, 301, 102, 103, 104, 105, 306]
        admit(sched, r2, 192, KVCacheBlocks(([KVCacheBlock(b) for b in table],)))
        r2.num_computed_tokens = 200
        assert sched.request_finished(r2, (table,)) == (False, None)
        assert step(sched).saves == []
    finally:
        w.server.close()


def test_blocks_the_next_step_computes_over_a_failed_sync_load_are_never_saved() -> None:
    """The same one step later: async scheduling schedules the next step before the load's
    report, and a long prompt's prefill goes on in it (chunked prefill) over the loaded blocks,
    into new blocks vLLM caches at once. Not in the connector model (it allocates a request's
    blocks at once); the scheduler side learns them from the step's new block ids."""
    w = Worker(hit=64)
    try:
        sched = scheduler(w, load="sync")
        r1 = request("r1")
        assert ask_until(sched, r1) == (64, False)
        sched.update_state_after_alloc(r1, blocks(100, 4), 64)  # the first prefill chunk
        step(sched)
        step(sched, new_blocks={"r1": [104, 105, 106]})  # the rest, before the load's report
        assert finish(sched, r1, 200) == (False, None)  # aborted
        outcome(sched, r1=False)
        admit(sched, request("r3", PROMPT[:40]), 0, blocks(100, 4))  # 100..103 afresh
        r2 = request("r2")
        table = [300, 301, 302, 303, 104, 105, 306]
        admit(sched, r2, 192, KVCacheBlocks(([KVCacheBlock(b) for b in table],)))
        r2.num_computed_tokens = 200
        assert sched.request_finished(r2, (table,)) == (False, None)
        assert step(sched).saves == []
    finally:
        w.server.close()


def test_a_verified_load_is_saved_with_the_request(worker: Worker) -> None:
    sched = scheduler(worker)
    req = request("r1")
    assert ask_until(sched, req) == (192, True)
    sched.update_state_after_alloc(req, blocks(0, 6), 192)
    step(sched)
    assert finish(sched, req, 192) == (False, None)  # aborted while loading: vLLM holds blocks
    req2 = request("r2")
    for _ in range(100):  # answered by now, but r1's (cancelled) load of its chunks still runs
        assert sched.get_num_new_matched_tokens(req2, 0) == (None, False)
        time.sleep(0.005)
    assert stats(sched)["deferred"] >= 1
    outcome(sched, r1=False)  # the worker reports r1's cancelled load once it ended
    assert ask_until(sched, req2) == (192, True)
    sched.update_state_after_alloc(req2, blocks(10, 7), 192)
    step(sched)
    outcome(sched, r2=True)
    assert finish(sched, req2, 207) == (True, None)  # the full chunks of prompt + outputs
    assert len(step(sched).saves[0].tokens) == 192


def test_roles(worker: Worker) -> None:
    producer = scheduler(worker, role="kv_producer")
    assert producer.get_num_new_matched_tokens(request("p"), 0) == (0, False)
    assert worker.asked == []  # a producer never looks
    consumer = scheduler(worker, role="kv_consumer")
    assert ask_until(consumer, request("c")) == (192, True)
    assert finish(consumer, request("c2", [5] * 100), 104) == (False, None)  # never saves


def test_reset_cache_forgets_answers_and_leases(worker: Worker) -> None:
    sched = scheduler(worker)
    req = request("r1")
    assert ask_until(sched, req) == (192, True)  # answered, not yet loaded (leased)
    assert sched.reset_cache() is True
    meta = step(sched)
    assert meta.forget_all
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # asked again
    wait_for(lambda: len(worker.asked) == 2)


def test_the_scheduler_thread_is_the_only_user(worker: Worker) -> None:
    """Nothing of the scheduler side starts a thread (it runs inside vLLM's one loop)."""
    before = threading.active_count()
    sched = scheduler(worker)
    ask_until(sched, request("r1"))
    assert threading.active_count() == before
    sched.shutdown()
    assert os.path.exists(worker.server.path)  # the worker's socket is the worker's
