"""A tenant's salt, a LoRA adapter and prompt embeddings never get another value's KV from the
store, and still restore their own: bsr's key-partition suite (``bsr.testing``) on vLLM's CPU
engine, through ``vllm serve`` and through ``LLM(...)``, with the tokens of a run without any
connector as the reference; an adapter whose files are rewritten under the running server and
then reloaded in place never gets the KV its old weights computed. Hostile per-request options
(a 16 MiB option name, 300 distinct ones) neither stall a running decode nor grow ``/metrics``.

Engines: one OpenAI server (connector, three adapters, prompt embeddings, vLLM's prefix cache
off so that every hit is bsr's, runtime adapter reloads allowed), one ``LLM`` with the
connector and one without it (the reference tokens). Weights and adapters are random, written
by transformers and safetensors.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from vllm_engines import file_store_connector, run, write_llama, write_lora
from vllm_servers import bsr_kv_config, eventually, post, prom, start, stop

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(1800)

from bsr.testing import (  # noqa: E402
    OpenAIKeyClient,
    PartitionCase,
    Variant,
    assert_key_partition,
    check_key_partition,
)
from bsr.testing._key_partition import draw_prompts  # noqa: E402

CHUNK = 64
EXPECTED_HIT = (200 - 1) // CHUNK * CHUNK  # every full chunk of a 200-token prompt: 192
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "4"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama and two adapters on its attention."""
    tmp = tmp_path_factory.mktemp("keys")
    write_llama(tmp / "model")
    write_lora(tmp / "lora-a", seed=1)
    write_lora(tmp / "lora-b", seed=2)
    shutil.copytree(tmp / "lora-a", tmp / "lora-c")  # rewritten under the server (a test)
    write_lora(tmp / "lora-new", seed=3)
    return tmp


def lora(tmp: Path, name: str) -> list[Any]:
    return [name, {"a": 1, "b": 2}[name], str(tmp / f"lora-{name}")]


@pytest.fixture(scope="module")
def server(assets: Path) -> Iterator[tuple[int, Path]]:
    """One ``vllm serve`` with BsrConnector over a fresh FileTier root."""
    store = assets / "serve-store"
    extra = [
        *LORA_ARGS,
        "--lora-modules", f"a={assets / 'lora-a'}", f"b={assets / 'lora-b'}",
        f"c={assets / 'lora-c'}", "--enable-prompt-embeds", "--no-enable-prefix-caching",
    ]  # fmt: skip
    saved = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    try:
        proc, port = start(
            assets / "model", assets / "serve.log",
            bsr_kv_config(store, chunk=CHUNK, model_id="keys-llama"), extra,
        )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = saved
    try:
        yield port, store
    finally:
        stop(proc)


def server_cases(assets: Path) -> list[PartitionCase]:
    import torch

    gen = torch.Generator().manual_seed(7)
    x, y = (torch.randn(200, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    return [
        PartitionCase(
            "cache_salt",
            Variant("salt=alice", {"cache_salt": "alice"}),
            Variant("salt=bob", {"cache_salt": "bob"}),
            changes_output=False,
        ),
        PartitionCase("lora", Variant("base", {}), Variant("lora=a", {"model": "a"})),
        PartitionCase("lora", Variant("lora=a", {"model": "a"}), Variant("lora=b", {"model": "b"})),
        PartitionCase(
            "prompt_embeds",
            Variant("embeds=x", {"prompt_embeds": x}),
            Variant("embeds=y", {"prompt_embeds": y}),
        ),
    ]


def llm_cases(assets: Path) -> list[PartitionCase]:
    return [
        PartitionCase(
            "cache_salt",
            Variant("salt=alice", {"cache_salt": "alice"}),
            Variant("salt=bob", {"cache_salt": "bob"}),
            changes_output=False,
        ),
        PartitionCase("lora", Variant("base", {}), Variant("lora=a", {"lora": lora(assets, "a")})),
        PartitionCase(
            "lora",
            Variant("lora=b", {"lora": lora(assets, "b")}),
            Variant("lora=a", {"lora": lora(assets, "a")}),
        ),
    ]


SERVER_SEED, LLM_SEED = 11, 12


@pytest.fixture(scope="module")
def reference(assets: Path) -> dict[tuple[tuple[int, ...], str], list[int]]:
    """The tokens of a run without any connector for each (prompt, value) the suites send."""
    items: list[dict[str, Any]] = []
    wanted: list[tuple[tuple[int, ...], str]] = []
    for cases, seed in ((server_cases(assets), SERVER_SEED), (llm_cases(assets), LLM_SEED)):
        for case, prompt in zip(cases, draw_prompts(cases, seed)):
            if case.kind == "prompt_embeds":
                continue  # the suite's own store-less references stand for these
            for v in (case.a, case.b):
                name = v.fields.get("model") or (v.fields.get("lora") or [None])[0]
                items.append({
                    "prompt": prompt, "cache_salt": v.fields.get("cache_salt"),
                    "lora": None if name is None else lora(assets, name),
                })  # fmt: skip
                wanted.append((tuple(prompt), v.name))
    result = run(
        assets, "reference", batches=[], generate=items, prefix_caching=False,
        llm_args={"enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
    )  # fmt: skip
    return dict(zip(wanted, result["generated"]))


def check_against_reference(
    reports: list[dict[str, Any]], reference: dict[tuple[tuple[int, ...], str], list[int]]
) -> None:
    for r in reports:
        if r["kind"] == "prompt_embeds":
            continue
        prompt = tuple(r["prompt"])
        ref_a, ref_b = reference[(prompt, r["a"])], reference[(prompt, r["b"])]
        # computed (no store), computed and stored, restored, and the other value's after the
        # save: each the tokens of the run without a connector
        assert r["reference_a"]["tokens"] == ref_a, r
        assert r["hit"]["tokens"] == ref_a, r
        assert r["reference_b"]["tokens"] == ref_b, r
        assert r["cross"]["tokens"] == ref_b, r
        assert r["late"]["tokens"] == ref_b, r


def test_key_partition_through_vllm_serve(
    assets: Path, server: tuple[int, Path], reference: dict[Any, list[int]]
) -> None:
    """Two tenants' salts, the base model and an adapter, two adapters, two prompt embeddings:
    a save under one is never a hit (0 cached prompt tokens) under the other, the same value
    restores every full chunk (192 of 200), and the tokens are those of no connector. The
    adapter changes the tokens (the control)."""
    from bsr.testing._key_partition import report_dict

    port, _store = server
    client = OpenAIKeyClient(f"http://127.0.0.1:{port}", str(assets / "model"))
    reports = check_key_partition(
        client, server_cases(assets), chunk_tokens=CHUNK, seed=SERVER_SEED
    )
    assert_key_partition(reports)
    assert all(r.hit.cached_tokens == EXPECTED_HIT for r in reports)
    check_against_reference([report_dict(r) for r in reports], reference)
    # bsr's own count of what it loaded: the four hits, nothing for the others
    loaded = eventually(lambda: prom(port, "vllm:bsr_loaded_tokens_total") >= 4 * EXPECTED_HIT,
                        "the loaded tokens")  # fmt: skip
    assert loaded and prom(port, "vllm:bsr_loaded_tokens_total") == 4 * EXPECTED_HIT
    # every request but the stored one ran with {"bsr": {"store": false}} (the reference of B,
    # the cross, the hit, the late cross): 16 requests not saved
    skipped = partial_prom(port, "vllm:bsr_saves_skipped_total", reason="opt_out")
    assert eventually(lambda: skipped() >= 16, "the skipped saves") and skipped() == 16


def partial_prom(port: int, name: str, **labels: str) -> Any:
    return lambda: prom(port, name, **labels)


def test_request_options_through_vllm_serve(assets: Path, server: tuple[int, Path]) -> None:
    """``kv_transfer_params={"bsr": ...}``: ``load: false`` and ``max_load_tokens`` limit what
    a stored prompt restores; a bad value serves the request without bsr (never an error of
    the engine) and says why in the response."""
    port, _ = server
    model = str(assets / "model")
    prompt = [3 + (i * 53) % 490 for i in range(200)]

    def complete(params: dict[str, Any] | None) -> tuple[list[int], int, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        out = post(port, "/v1/completions", body)
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return (
            list(out["choices"][0]["token_ids"]),
            int(details.get("cached_tokens") or 0),
            out.get("kv_transfer_params") or {},
        )

    saves = prom(port, "vllm:bsr_saves_total")
    stored, cached, _ = complete(None)
    assert cached == 0
    eventually(lambda: prom(port, "vllm:bsr_saves_total") > saves, "the save")
    assert complete({"bsr": {"load": False}})[:2] == (stored, 0)
    assert complete({"bsr": {"max_load_tokens": 100}})[:2] == (stored, 64)
    assert complete({"bsr": {"max_load_tokens": 0}})[:2] == (stored, 0)
    assert complete({"bsr": {}})[:2] == (stored, EXPECTED_HIT)
    tokens, cached, params = complete({"bsr": {"store": "no"}})
    assert (tokens, cached) == (stored, 0)  # served, without bsr
    assert params["bsr"]["field"] == "kv_transfer_params.bsr.store"
    assert "must be True or False" in params["bsr"]["error"]
    tokens, cached, params = complete({"bsr": {"max_load_token": 64}})
    assert (tokens, cached) == (stored, 0)
    assert "did you mean 'max_load_tokens'" in params["bsr"]["error"]
    rejected = partial_prom(port, "vllm:bsr_rejected_options_total")
    assert eventually(lambda: rejected() >= 2, "the rejected options") and rejected() == 2
    assert post(port, "/health") == {}  # the engine is still serving


def test_key_partition_through_llm(assets: Path, reference: dict[Any, list[int]]) -> None:
    """The same suite in an ``LLM(...)`` engine (salt; the base model and an adapter; two
    adapters), with the tokens of no connector."""
    store = assets / "llm-store"
    spec = {
        "cases": [
            {
                "kind": c.kind,
                "a": {"name": c.a.name, "fields": dict(c.a.fields)},
                "b": {"name": c.b.name, "fields": dict(c.b.fields)},
                "changes_output": c.changes_output,
            }
            for c in llm_cases(assets)
        ],
        "chunk_tokens": CHUNK,
        "seed": LLM_SEED,
        "store": str(store),
    }
    result = run(
        assets, "llm-keys", batches=[], key_partition=spec, prefix_caching=False,
        connector=file_store_connector(store, chunk=CHUNK, model_id="keys-llama"),
        llm_args={"enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
    )  # fmt: skip
    reports = result["key_partition"]
    assert [p for r in reports for p in r["problems"]] == []
    assert all(r["hit"]["cached"] == EXPECTED_HIT for r in reports)
    check_against_reference(reports, reference)


def _post_text(port: int, path: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        return str(resp.read().decode())


def test_an_adapter_rewritten_under_the_server_and_reloaded_in_place(
    assets: Path, server: tuple[int, Path]
) -> None:
    """Adapter ``c``'s files are rewritten (same sizes, mtimes kept) while the server computes
    with the weights it loaded at startup; the suite stores and restores a prompt under ``c``,
    then reloads ``c`` in place (``/v1/load_lora_adapter``, ``load_inplace``): the same request
    gets no cached token and the tokens of the new weights. Before: the KV the old weights
    computed was keyed by the new files, and the reloaded adapter was served it (192 tokens)."""
    from bsr.testing._key_partition import report_dict

    port, _ = server
    for f in sorted((assets / "lora-new").iterdir()):
        target = assets / "lora-c" / f.name
        st = target.stat()
        shutil.copyfile(f, target)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

    def reload() -> None:
        body = {"lora_name": "c", "lora_path": str(assets / "lora-c"), "load_inplace": True}
        assert "Success" in _post_text(port, "/v1/load_lora_adapter", body)

    c = Variant("lora=c", {"model": "c"})
    case = PartitionCase("lora", c, Variant("lora=c reloaded", {"model": "c"}), change=reload)
    client = OpenAIKeyClient(f"http://127.0.0.1:{port}", str(assets / "model"))
    reports = check_key_partition(client, [case], chunk_tokens=CHUNK, seed=13)
    print(report_dict(reports[0]))
    assert_key_partition(reports)
    (rep,) = reports
    assert rep.hit.cached_tokens == EXPECTED_HIT and rep.cross.cached_tokens == 0
    # against runs without any connector: c's old weights are a's, its new ones lora-new's
    prompt = list(rep.prompt)
    ref = run(
        assets, "reload-reference", batches=[], prefix_caching=False,
        generate=[
            {"prompt": prompt, "lora": lora(assets, "a")},
            {"prompt": prompt, "lora": ["new", 3, str(assets / "lora-new")]},
        ],
        llm_args={"enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
    )["generated"]  # fmt: skip
    assert list(rep.reference_a.tokens) == ref[0] and list(rep.hit.tokens) == ref[0]
    assert list(rep.reference_b.tokens) == ref[1] and list(rep.cross.tokens) == ref[1]


def _stream_times(port: int, body: dict[str, Any], into: list[float]) -> None:
    """Stream a completion; the arrival time of each of its chunks."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                into.append(time.monotonic())


#: tries of each stall measurement (the shortest counts)
TRIES = 3


def _stall_beside(port: int, model: str, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The longest wait between two chunks of a running decode around a request with
    ``kv_transfer_params=params``; that request's response."""
    times: list[float] = []
    decode = {
        "model": model, "prompt": [5 + i % 400 for i in range(40)], "max_tokens": 120,
        "temperature": 0.0, "ignore_eos": True,
    }  # fmt: skip
    t = threading.Thread(target=_stream_times, args=(port, decode, times))
    t.start()
    deadline = time.monotonic() + 120
    while len(times) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = time.monotonic()
    body = {
        "model": model, "prompt": [7] * 16, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": params,
    }  # fmt: skip
    out = post(port, "/v1/completions", body)
    t.join(300)
    before = [x for x in times if x <= sent]
    seq = [before[-1], *(x for x in times if x > sent)]
    return max(b - a for a, b in itertools.pairwise(seq)), out


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as resp:
        return str(resp.read().decode())


def test_hostile_option_names_neither_stall_a_decode_nor_grow_metrics(
    assets: Path, server: tuple[int, Path]
) -> None:
    """A 16 MiB option name under ``kv_transfer_params["bsr"]`` beside a running decode: the
    decode waits no longer than beside the same 16 MiB under a key bsr does not read (what
    vLLM itself spends on it), the response's error is short, and ``/metrics`` gains no
    series for it; then 300 requests with distinct 1 KiB names: one ``unknown`` series, the
    exposition barely grows. Before: difflib on the name stalled the decode (1.5 s), the name
    came back in the response, and each name became a label (33.6 MB per scrape; 300 series)."""
    port, _ = server
    model = str(assets / "model")
    huge = "x" * (16 << 20)
    text0 = _metrics(port)
    rejected = partial_prom(port, "vllm:bsr_rejected_options_total")
    n0 = rejected()
    # the shortest of three tries each, taken in turn: the stall came with every such request
    # (difflib on the name), a busy machine's pause with one (one try each failed under the
    # suite's other workers: 1.28 s beside 0.11 s)
    bases, stalls, out = [], [], {}
    for _ in range(TRIES):
        bases.append(_stall_beside(port, model, {"other": {huge: 1}})[0])  # not bsr's: ignored
        stall, out = _stall_beside(port, model, {"bsr": {huge: 1}})
        stalls.append(stall)
    base, stall = min(bases), min(stalls)
    print(f"decode stall beside a 16 MiB option name: {stalls} s (beside 16 MiB bsr does not "
          f"read: {bases} s)")  # fmt: skip
    assert stall < max(3 * base, base + 0.75), (bases, stalls)
    params = out.get("kv_transfer_params") or {}
    assert params["bsr"]["field"] == "kv_transfer_params.bsr"
    assert len(json.dumps(params)) < 1024
    eventually(lambda: rejected() >= n0 + TRIES, "the rejected options")

    def bad(i: int) -> None:
        name = f"{i:04d}" + "k" * 1020
        post(port, "/v1/completions", {
            "model": model, "prompt": [9] * 8, "max_tokens": 1,
            "kv_transfer_params": {"bsr": {name: True}},
        })  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(bad, range(300)))
    eventually(lambda: rejected() >= n0 + TRIES + 300, "the 300 rejected options")
    assert rejected() == n0 + TRIES + 300
    text = _metrics(port)
    series = [ln for ln in text.splitlines() if ln.startswith("vllm:bsr_rejected_options_total{")]
    print(f"/metrics: {len(text0)} bytes before, {len(text)} after; rejected_options series: "
          f"{len(series)}")  # fmt: skip
    assert len(series) <= 2, series  # "kv_transfer_params.bsr.store" (an earlier test), unknown
    assert all('field="unknown"' in ln or 'field="kv_transfer_params.bsr' in ln for ln in series)
    assert len(text) < len(text0) + 16 * 1024
    assert post(port, "/health") == {}
