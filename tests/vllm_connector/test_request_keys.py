"""What a vLLM request is keyed by (salt, adapter, images, prompt embeddings) and its per-request
options, at the scheduler seam: vLLM's own ``Request`` objects (with ``mm_features``,
``lora_request``, ``cache_salt``, ``prompt_embeds``), the connector's scheduler side, and a real
bsr engine answering its lookups over the real socket (the engine tests drive the same code
through vLLM's engine: tests/vllm_connector/test_key_partition.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

import bsr
from bsr.vllm._bridge import LoopThread
from bsr.vllm._lookup import LookupServer, private_socket_path
from bsr.vllm._request_keys import (
    MAX_OPTION_CHARS,
    OPTION_FIELDS,
    RequestOptionError,
    RequestOptions,
    option_label,
    request_keys,
)
from bsr.vllm._scheduler import BsrScheduler
from vllm_settings import connector_settings

CHUNK, BLOCK = 64, 32
LAYOUT = bsr.StateLayout(chunk_tokens=CHUNK, groups=(bsr.StateGroup("kv", 1, 64),))
PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, 500, 200)]  # 3 usable chunks


def image(ident: str, offset: int = 10, length: int = 80) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset, length)
    )


def request(rid: str, prompt: list[int] | None = PROMPT, **kw: Any) -> Request:
    params = kw.pop("params", None)
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, None if prompt is None else list(prompt), sp, None, **kw)


def write_adapter(path: Path, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "seed": seed}))
    (path / "adapter_model.safetensors").write_bytes(bytes([seed]) * 64)
    return path


# ---------------------------------------------------------------------- the keys


def test_each_input_kind_separates_the_keys_and_equal_inputs_share_them(tmp_path: Path) -> None:
    a, b = write_adapter(tmp_path / "a", 1), write_adapter(tmp_path / "b", 2)
    emb = torch.randn(200, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    cases = {
        "plain": {},
        "salt alice": {"cache_salt": "alice"},
        "salt bob": {"cache_salt": "bob"},
        "lora a": {"lora_request": LoRARequest("a", 1, str(a))},
        "lora b": {"lora_request": LoRARequest("b", 2, str(b))},
        "image x": {"mm_features": [image("x")]},
        "image y": {"mm_features": [image("y")]},
        "image x later": {"mm_features": [image("x", offset=11)]},
        "two images": {"mm_features": [image("x"), image("y", offset=100, length=20)]},
    }
    keys = {name: request_keys(request(name, **kw), CHUNK) for name, kw in cases.items()}
    assert all(k.usable and k.loads and k.stores for k in keys.values())
    chains = {
        name: tuple(bsr.chunk_keys(b"n" * 16, PROMPT, CHUNK, extras=k.extras))
        for name, k in keys.items()
    }
    assert len(set(chains.values())) == len(chains), "two input kinds or values share keys"
    # a value changes the keys from the chunk it touches on: the second image (at token 100)
    # leaves chunk 0 as the first image alone has it, so a prompt with only that image shares it
    firsts = {name: c[0] for name, c in chains.items() if name != "two images"}
    assert len(set(firsts.values())) == len(firsts)
    assert chains["two images"][0] == chains["image x"][0]
    assert chains["two images"][1] != chains["image x"][1]
    # the same inputs in another request: the same keys (a later request hits); an adapter is
    # vLLM's id here (each worker binds it to the weights it loaded: test_adapters.py), its
    # name and path are not read
    again = request_keys(request("again", lora_request=LoRARequest("a2", 1, "/elsewhere")), CHUNK)
    assert again.extras == keys["lora a"].extras
    assert request_keys(request("x2", mm_features=[image("x")]), CHUNK).extras == (
        keys["image x"].extras
    )
    # prompt embeddings: equal rows share, other rows of the same shape do not
    e1 = request_keys(request("e1", None, prompt_embeds=emb), CHUNK)
    e2 = request_keys(request("e2", None, prompt_embeds=emb.clone()), CHUNK)
    other = emb.clone()
    other[150, 3] += 1  # one value in the third chunk
    e3 = request_keys(request("e3", None, prompt_embeds=other), CHUNK)
    assert e1.extras == e2.extras and len(e1.extras) == 4  # 3 full chunks + the last rows
    k1 = bsr.chunk_keys(b"n" * 16, [0] * 200, CHUNK, extras=e1.extras)
    k3 = bsr.chunk_keys(b"n" * 16, [0] * 200, CHUNK, extras=e3.extras)
    assert k1[:2] == k3[:2] and k1[2] != k3[2]  # shared up to the chunk that differs


def test_an_adapter_is_keyed_without_touching_its_files(tmp_path: Path) -> None:
    """The scheduler keys a LoRA request by vLLM's adapter id alone: a path that does not
    exist, or a FIFO whose open would block, is never looked at (a stat on vLLM's scheduler
    loop stalled every running request behind a hung mount: test_adapters.py)."""
    fifo = tmp_path / "adapter"
    os.mkfifo(fifo)
    for path in ("/nonexistent/adapter", str(fifo)):
        keys = request_keys(request("r", lora_request=LoRARequest("a", 3, path)), CHUNK)
        assert keys.usable and keys.loads and keys.stores
        assert [e.key for e in keys.extras] == [b"vllm-lora-ref:3"]


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"mm_features": [image("")]}, "mm_identifier"),
    ],
)
def test_what_cannot_be_keyed_is_neither_loaded_nor_saved(kw: dict[str, Any], reason: str) -> None:
    keys = request_keys(request("r", **kw), CHUNK)
    assert keys.unkeyable == reason and not keys.loads and not keys.stores


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"bsr": {"store": "no"}}, "kv_transfer_params.bsr.store"),
        ({"bsr": {"load": 0}}, "kv_transfer_params.bsr.load"),
        ({"bsr": {"max_load_tokens": -5}}, "kv_transfer_params.bsr.max_load_tokens"),
        ({"bsr": {"max_load_tokens": 1.5}}, "kv_transfer_params.bsr.max_load_tokens"),
        ({"bsr": {"stor": False}}, "kv_transfer_params.bsr.stor"),
        ({"bsr": "store=false"}, "kv_transfer_params.bsr"),
    ],
)
def test_bad_request_options_are_typed_errors_naming_the_field(
    params: dict[str, Any], field: str
) -> None:
    with pytest.raises(RequestOptionError) as ei:
        RequestOptions.from_params(params)
    assert ei.value.fields["field"] == field and isinstance(ei.value, bsr.ConfigError)
    if field.endswith(".stor"):
        assert "did you mean 'store'" in str(ei.value)
    keys = request_keys(request("r", params=params), CHUNK)
    assert keys.error is not None and not keys.loads and not keys.stores


def test_request_options_parse() -> None:
    assert RequestOptions.from_params(None) == RequestOptions()
    assert RequestOptions.from_params({"do_remote_prefill": True}) == RequestOptions()
    got = RequestOptions.from_params({"bsr": {"store": False, "max_load_tokens": 128}})
    assert got == RequestOptions(load=True, store=False, max_load_tokens=128)


def test_hostile_option_names_and_values_are_refused_in_bounded_work() -> None:
    """A client's option name or value is refused by its kind and size: never compared with
    difflib (a 16 MiB name took 1.5 s there, on vLLM's scheduler loop), never copied into the
    message (which the response, the log and before this the metric label carried)."""
    huge = "x" * (16 << 20)
    cases = [
        ({"bsr": {huge: 1}}, "kv_transfer_params.bsr"),
        ({"bsr": {"store": huge}}, "kv_transfer_params.bsr.store"),
        ({"bsr": {"max_load_tokens": [0] * 1_000_000}}, "kv_transfer_params.bsr.max_load_tokens"),
        ({"bsr": {"load": {"a": 1}}}, "kv_transfer_params.bsr.load"),
        ({"bsr": {"max_load_tokens": 1 << 4000}}, "kv_transfer_params.bsr.max_load_tokens"),
        ({"bsr": huge}, "kv_transfer_params.bsr"),
        ({"bsr": {f"k{i}": 1 for i in range(100_000)}}, "kv_transfer_params.bsr"),
        ({"bsr": {7: True}}, "kv_transfer_params.bsr"),
    ]
    for params, field in cases:
        t0 = time.perf_counter()
        with pytest.raises(RequestOptionError) as ei:
            RequestOptions.from_params(params)
        took = time.perf_counter() - t0
        err = ei.value
        assert err.fields["field"] == field, (field, err.fields)
        assert len(str(err)) < 300 and len(repr(err.fields)) < 300, str(err)[:300]
        assert option_label(err) in (*OPTION_FIELDS, "unknown")
        assert took < 0.5, (field, took)  # bounded work (microseconds); difflib took 1.5 s
    # a short unknown name still gets its suggestion and is named in the field, but its label
    # is "unknown": no metric series per client-chosen name
    with pytest.raises(RequestOptionError) as ei:
        RequestOptions.from_params({"bsr": {"stor": False}})
    assert ei.value.fields["field"] == "kv_transfer_params.bsr.stor"
    assert "did you mean 'store'" in str(ei.value) and option_label(ei.value) == "unknown"
    long_name = "s" * (MAX_OPTION_CHARS + 1)
    with pytest.raises(RequestOptionError) as ei:
        RequestOptions.from_params({"bsr": {long_name: False}})
    assert long_name not in str(ei.value) and "did you mean" not in str(ei.value)


def test_rejected_options_labels_come_from_a_closed_set() -> None:
    """300 requests with distinct 1 KiB option names, and one 16 MiB name, through the
    scheduler: their counts go to the closed label ``unknown`` (the scheduler's stats, vLLM's
    aggregation, the Prometheus series), and every keyed counter keeps a bounded number of
    series whatever is counted."""
    from bsr.vllm._stats import MAX_LABELS, OTHER, BsrConnectorStats

    # no lookup socket: bad options are refused before any lookup
    sched = BsrScheduler(connector_settings(BLOCK, CHUNK, model_id="seam"))
    names = [f"{i:04d}" + "k" * 1020 for i in range(300)] + ["x" * (16 << 20)]
    for i, name in enumerate(names):
        req = request(f"r{i}", params={"bsr": {name: True}})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        done, params = finish(sched, req)
        assert not done and len(json.dumps(params)) < 1024
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["rejected_options"] == {"unknown": len(names)}
    # what a worker (or anything) counts under client-looking labels stays bounded too
    many = BsrConnectorStats({"saves_skipped": {f"reason{i}": 1 for i in range(500)}})
    assert len(many.data["saves_skipped"]) == MAX_LABELS
    assert many.data["saves_skipped"][OTHER] == 500 - (MAX_LABELS - 1)
    forged = BsrConnectorStats({"rejected_options": {"kv_transfer_params.bsr.zzz": 3}})
    assert forged.data["rejected_options"] == {"unknown": 3}


# ---------------------------------------------------------------------- through the scheduler


class EngineWorker:
    """A real bsr engine (HostTier) answering the scheduler's lookups over the real socket."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.engine = bsr.RestoreEngine(
            LAYOUT, [bsr.HostTier(1 << 24)], window=2, io_depth=1,
            namespace=bsr.Namespace("seam"),
        )  # fmt: skip
        self.loop.call(self.engine.open)
        self.cache = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
        self.asked: list[tuple[bsr.KeyExtra, ...]] = []
        self.server = LookupServer(private_socket_path(), self._on_lookup)

    def _on_lookup(
        self, cid: int, seq: int, tokens: np.ndarray, extras: Any, hints: Any = None
    ) -> None:
        self.asked.append(extras)

        async def answer() -> None:
            probe = await self.engine.lookup(tokens, extras=extras)
            self.server.reply(cid, seq, probe.prefix_tokens)

        self.loop.submit(answer)

    def save(self, tokens: list[int], extras: tuple[bsr.KeyExtra, ...]) -> int:
        async def go() -> int:
            blocks = list(range(len(tokens) // BLOCK))
            return (await self.engine.save(tokens, self.cache, blocks, extras=extras)).saved_tokens

        return int(self.loop.call(go))

    def close(self) -> None:
        self.server.close()
        self.loop.call_bounded(self.engine.aclose, timeout=10)
        self.loop.close()


@pytest.fixture
def worker() -> Iterator[EngineWorker]:
    w = EngineWorker()
    yield w
    w.close()


def scheduler(worker: EngineWorker) -> BsrScheduler:
    sched = BsrScheduler(connector_settings(BLOCK, CHUNK, model_id="seam"))
    sched.set_lookup_socket(worker.server.path)
    return sched


def ask(sched: BsrScheduler, req: Request, computed: int = 0) -> tuple[int | None, bool]:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        n, is_async = sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, is_async
        time.sleep(0.005)
    raise AssertionError("no answer")


def finish(sched: BsrScheduler, req: Request) -> tuple[bool, Any]:
    req.num_computed_tokens = len(req.all_token_ids)
    return sched.request_finished(req, ([*range(16)],))


@pytest.mark.parametrize(
    ("stored", "other"),
    [
        ({"mm_features": [image("x")]}, {"mm_features": [image("y")]}),
        ({"mm_features": [image("x")]}, {"mm_features": [image("x", offset=12)]}),
        ({"mm_features": [image("x")]}, {}),
        ({"cache_salt": "alice"}, {"cache_salt": "bob"}),
        ({"cache_salt": "alice"}, {}),
        ({}, {"cache_salt": "bob"}),
    ],
    ids=["image-y", "image-moved", "no-image", "salt-bob", "no-salt", "salted-vs-plain"],
)
def test_a_save_under_one_input_never_answers_another(
    worker: EngineWorker, stored: dict[str, Any], other: dict[str, Any]
) -> None:
    """The scheduler keys vLLM's request objects as their save was keyed: the same inputs hit
    every full chunk, other inputs (the same token ids) miss."""
    sched = scheduler(worker)
    saved = request("saved", **stored)
    sched.get_num_new_matched_tokens(saved, 0)  # its keys are computed when it is first seen
    done, _ = finish(sched, saved)
    assert done
    (job,) = sched.build_connector_meta(_empty_output()).saves
    assert job.extras == request_keys(saved, CHUNK).extras
    assert worker.save(list(job.tokens), job.extras) == 192
    assert ask(sched, request("same", **stored)) == (192, True)
    assert ask(sched, request("other", **other)) == (0, False)
    assert worker.asked[-1] == request_keys(request("o", **other), CHUNK).extras


def test_per_request_options_reach_the_scheduler(worker: EngineWorker) -> None:
    sched = scheduler(worker)
    assert worker.save(PROMPT[:192], ()) == 192
    # load false: no lookup at all
    assert ask(sched, request("no-load", params={"bsr": {"load": False}})) == (0, False)
    # max_load_tokens: whole chunks past vLLM's own hit (64 here)
    capped = request("capped", params={"bsr": {"max_load_tokens": 100}})
    assert ask(sched, capped, computed=64) == (64, True)
    assert ask(sched, request("zero", params={"bsr": {"max_load_tokens": 0}})) == (0, False)
    assert len(worker.asked) == 1  # only the capped request asked
    # store false: finished, never saved
    opt_out = request("opt-out", params={"bsr": {"store": False}})
    assert finish(sched, opt_out) == (False, None)
    # a bad option: served without bsr (no lookup, no save), the error in its output params
    bad = request("bad", params={"bsr": {"store": "no"}})
    assert ask(sched, bad) == (0, False)
    done, params = finish(sched, bad)
    assert not done and params["bsr"]["field"] == "kv_transfer_params.bsr.store"
    assert "must be True or False" in params["bsr"]["error"]
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["saves_skipped"] == {"opt_out": 1, "rejected_options": 1}
    assert stats.data["rejected_options"] == {"kv_transfer_params.bsr.store": 1}
    assert len(worker.asked) == 1 and not sched.build_connector_meta(_empty_output()).saves


def test_unkeyable_requests_are_counted_and_never_saved(worker: EngineWorker) -> None:
    sched = scheduler(worker)
    req = request("r", mm_features=[image("")])
    assert ask(sched, req) == (0, False)
    assert finish(sched, req) == (False, None)
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["unkeyable_requests"] == {"mm_identifier": 1}
    assert stats.data["saves_skipped"] == {"unkeyable": 1}
    assert worker.asked == []


def _empty_output() -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )  # fmt: skip
