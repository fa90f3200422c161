"""The scheduler side's fleet duties with vLLM's own request and output objects, over a real
lookup socket: hits by source from the answer's per-tier tokens, the hints a lookup carries
(vLLM's own hit, the measured prefill rate), admission by sightings, the block hashes a save
carries, and the relay of the workers' KV event notices into vLLM's event objects."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from bsr.vllm._events import ChunkInfo, ChunkNotice, TierKind
from bsr.vllm._kv_events import hit_sources, vllm_events
from bsr.vllm._lookup import LookupHints, LookupServer, private_socket_path
from bsr.vllm._metadata import BsrWorkerMetadata
from bsr.vllm._scheduler import BsrScheduler
from vllm_settings import connector_settings

CHUNK, BLOCK = 64, 32
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, 200)]  # 3 usable chunks
TIERS = (("host", "host"), ("file", "disk"))


class Worker:
    """A lookup socket answering ``hit`` tokens held ``by_tier``; it keeps each lookup's hints."""

    def __init__(
        self, hit: int = 192, by_tier: tuple[int, ...] = (), skip: tuple[int, ...] = ()
    ) -> None:
        self.hit, self.by_tier, self.skip = hit, by_tier, skip
        self.hints: list[LookupHints] = []
        self.server = LookupServer(private_socket_path(), self._handle)

    def _handle(self, cid: int, seq: int, tokens: Any, extras: Any, hints: LookupHints) -> None:
        self.hints.append(hints)
        self.server.reply(cid, seq, min(self.hit, len(tokens)), self.by_tier, self.skip)


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.server.close()


def scheduler(worker: Worker, kv_events: bool = False, **opts: Any) -> BsrScheduler:
    sched = BsrScheduler(connector_settings(BLOCK, CHUNK, opts, kv_events=kv_events))
    sched.set_lookup_socket(worker.server.path, TIERS)
    return sched


def request(
    rid: str, prompt: list[int] = PROMPT, hashed: bool = False, params: Any = None, **kw: Any
) -> Request:
    hasher = None
    if hashed:  # vLLM's own block hashes, as its engine core computes them
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        hasher = get_request_block_hasher(BLOCK, fn)
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, list(prompt), sp, None, block_hasher=hasher, **kw)


def ask_until(sched: BsrScheduler, req: Request, computed: int = 0) -> tuple[int | None, bool]:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        n, is_async = sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, is_async
        time.sleep(0.005)
    raise AssertionError("no answer")


def step(sched: BsrScheduler, tokens: int = 0) -> Any:
    out = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )  # fmt: skip
    return sched.build_connector_meta(out)


def finish(sched: BsrScheduler, req: Request, computed: int) -> tuple[bool, Any]:
    req.num_computed_tokens = computed
    n = -(-computed // BLOCK)
    return sched.request_finished(req, (list(range(100, 100 + n)),))


def test_hits_are_counted_under_the_tier_that_holds_them() -> None:
    w = Worker(192, (128, 64))  # of 192 offered tokens: 128 in host memory, 64 on disk
    try:
        sched = scheduler(w)
        req = request("r")
        assert ask_until(sched, req) == (192, True)
        sched.update_state_after_alloc(
            req, KVCacheBlocks(([KVCacheBlock(i) for i in range(6)],)), 192
        )
        assert sched.hit_sources(req, 192) == {"host": 128, "disk": 64}
        assert hit_sources(sched.hit_sources(req, 192), 192) == {
            CacheHitSource.HOST: 128, CacheHitSource.DISK: 64,
        }  # fmt: skip
        # vLLM may ask for another count (a hit it trimmed): the split keeps its proportions
        # and sums to the count, the rest under the slower tier
        assert hit_sources(sched.hit_sources(req, 100), 100) == {
            CacheHitSource.HOST: 66, CacheHitSource.DISK: 34,
        }  # fmt: skip
        data = sched.take_stats()
        assert data is not None and data.data["hit_tokens_by_tier"] == {"host": 128, "file": 64}
        assert sched.hit_sources(request("unknown"), 10) == {}  # no answer: vLLM's default
    finally:
        w.server.close()


@pytest.mark.parametrize("skip", [(), (1,), (0, 2, 63)])
def test_the_load_skips_the_tiers_the_lookup_had_no_answer_from(skip: tuple[int, ...]) -> None:
    """The answer names (by index) the tiers the worker's lookup did not hear from; the load
    job carries them to every rank, whose load then does not ask them."""
    w = Worker(192, skip=skip)
    try:
        sched = scheduler(w)
        req = request("r")
        assert ask_until(sched, req) == (192, True)
        blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(6)],))
        sched.update_state_after_alloc(req, blocks, 192)
        (job,) = step(sched).loads
        assert job.req_id == "r" and job.end_tokens == 192 and job.skip_tiers == skip
    finally:
        w.server.close()


def test_a_lookup_carries_vllms_hit_and_the_measured_prefill_rate(worker: Worker) -> None:
    sched = scheduler(worker)
    assert ask_until(sched, request("a"), 64) == (128, True)
    assert worker.hints[-1] == LookupHints(64, 0.0)  # no step measured yet
    step(sched, tokens=512)  # a prefill step: scheduled, then its output came back
    time.sleep(0.05)
    sched.take_stats()
    step(sched, tokens=8)  # a decode step says nothing about prefill
    sched.take_stats()
    assert ask_until(sched, request("b"), 0) == (192, True)
    rate = worker.hints[-1].prefill_rate
    assert 0 < rate <= 512 / 0.05  # tokens over at least the 50 ms the step took


def test_only_prefixes_seen_often_enough_are_saved(worker: Worker) -> None:
    sched = scheduler(worker, admit_after_sightings=2)
    other = PROMPT[:CHUNK] + [7] * (len(PROMPT) - CHUNK)  # shares the first chunk only
    assert finish(sched, request("r1"), 200) == (False, None)  # seen once: not saved
    assert step(sched).saves == []
    assert finish(sched, request("r2", other), 200) == (True, None)  # chunk 0 seen twice
    (job,) = step(sched).saves
    assert len(job.tokens) == CHUNK
    assert finish(sched, request("r3"), 200) == (True, None)  # PROMPT seen twice now
    (job,) = step(sched).saves
    assert len(job.tokens) == 3 * CHUNK
    data = sched.take_stats()
    assert data is not None and data.data["saves_skipped"] == {"not_admitted": 1}


def test_a_save_carries_the_requests_own_block_hashes(worker: Worker) -> None:
    sched = scheduler(worker, kv_events=True)
    req = request("r", hashed=True)
    assert len(req.block_hashes) == 6  # vLLM hashed the prompt's six full blocks
    assert finish(sched, req, 200) == (True, None)
    (job,) = step(sched).saves
    assert job.events is not None and job.events.block_hashes == tuple(req.block_hashes[:6])
    assert job.events.extra_keys is None and job.events.lora_name is None
    plain = scheduler(worker)  # KV events off: nothing extra travels
    assert finish(plain, request("s", hashed=True), 200) == (True, None)
    (job,) = step(plain).saves
    assert job.events is None


def test_a_request_bsr_does_not_store_carries_no_save_and_no_event(worker: Worker) -> None:
    """An opted-out, badly optioned or unkeyable request is never saved: no save job, so no
    block hashes travel and no worker can announce it (vLLM's own hashes of it would cover the
    salt, adapter or image; bsr's keys could not)."""
    sched = scheduler(worker, kv_events=True)
    image = MultiModalFeatureSpec(
        data=None, modality="image", identifier="", mm_position=PlaceholderRange(10, 80)
    )  # an empty identifier: bsr cannot key what the image adds
    unstored = [
        request("opt-out", hashed=True, params={"bsr": {"store": False}}),
        request("bad", hashed=True, params={"bsr": {"store": "no"}}),
        request("image", hashed=True, mm_features=[image]),
    ]
    for req in unstored:
        assert finish(sched, req, 200)[0] is False
    meta = step(sched)
    assert meta.saves == [] and meta.windows == []
    assert sched.take_events() == []
    data = sched.take_stats()
    assert data is not None
    assert data.data["saves_skipped"] == {"opt_out": 1, "rejected_options": 1, "unkeyable": 1}
    assert finish(sched, request("kept", hashed=True), 200) == (True, None)  # the control
    (job,) = step(sched).saves
    assert job.events is not None and len(job.events.block_hashes) == 6


def notice(stored: bool, rank: int, medium: str = "CPU", cause: str = "") -> ChunkNotice:
    info = ChunkInfo(
        group_idx=0, block_hashes=(b"\x01" * 32, b"\x02" * 32), parent_block_hash=b"\x00" * 32,
        token_ids=tuple(range(CHUNK)), block_size=BLOCK, spec_kind="full_attention",
    )  # fmt: skip
    return ChunkNotice(stored, "host", TierKind(medium, "LOCAL", "host"), rank, info, cause)


def test_the_workers_notices_become_vllms_events_once_every_rank_holds_the_chunk() -> None:
    w = Worker()
    try:
        sched = scheduler(w)
        sched.relay.tp_size = 2
        sched.update_connector_output(
            KVConnectorOutput(
                kv_connector_worker_meta=BsrWorkerMetadata({}, events=[notice(True, 0)])
            )
        )
        assert sched.take_events() == []  # rank 1 does not hold its shard yet
        meta = BsrWorkerMetadata({}, events=[notice(True, 1)]).aggregate(
            BsrWorkerMetadata({}, events=[])
        )
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        (ev,) = vllm_events(sched.take_events())
        assert isinstance(ev, BlockStored) and ev.medium == "CPU" and ev.group_idx == 0
        assert ev.block_hashes == [maybe_convert_block_hash(b"\x01" * 32),
                                   maybe_convert_block_hash(b"\x02" * 32)]  # fmt: skip
        assert ev.parent_block_hash == maybe_convert_block_hash(b"\x00" * 32)
        assert ev.token_ids == list(range(CHUNK)) and ev.ownership == "host"
        sched.update_connector_output(  # one rank lost its shard: the chunk is gone
            KVConnectorOutput(
                kv_connector_worker_meta=BsrWorkerMetadata(
                    {}, events=[notice(False, 1, cause="evicted")]
                )
            )
        )
        (ev,) = vllm_events(sched.take_events())
        assert isinstance(ev, BlockRemoved) and ev.medium == "CPU"
        assert sched.take_events() == []
        data = sched.take_stats()
        assert data is not None and data.data["kv_events"] == {"stored": 1, "removed": 1}
    finally:
        w.server.close()


def test_events_are_counted_in_the_stats_of_the_step_that_publishes_them() -> None:
    # vLLM's scheduler takes the connector's stats before its events (``update_from_output``):
    # the events it publishes in a step must be counted in that step's stats, not the next
    # one's (which never comes to an engine gone idle)
    w = Worker()
    try:
        sched = scheduler(w)
        for stored in (True, False):
            meta = BsrWorkerMetadata({}, events=[notice(stored, 0, cause="evicted")])
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
            data = sched.take_stats()  # vLLM's order: stats, then events
            (ev,) = vllm_events(sched.take_events())
            assert isinstance(ev, BlockStored if stored else BlockRemoved)
            kind = "stored" if stored else "removed"
            assert data is not None and data.data["kv_events"] == {kind: 1}
        assert sched.take_stats() is None and sched.take_events() == []  # nothing twice
    finally:
        w.server.close()
