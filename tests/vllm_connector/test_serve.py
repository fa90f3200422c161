"""BsrConnector behind `vllm serve` (the OpenAI server on vLLM's CPU build), two fresh servers.

The first server computes a prompt and saves its KV through bsr; a second server, started fresh
over the same store, answers the same prompt with the same greedy tokens and reports the restored
prefix as cached prompt tokens. bsr's numbers are on each server's ``/metrics`` (``vllm:bsr_*``)
and in vLLM's periodic "KV Transfer metrics" log line. Needs vLLM (``make test`` runs it in
``.venv-vllm``).
"""

from __future__ import annotations

import subprocess
from functools import partial
from pathlib import Path

import pytest

from vllm_servers import bsr_kv_config, eventually, post, prom, stop
from vllm_servers import start as start_server

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(1200)

CHUNK = 64
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT = [3 + (i * 37) % 490 for i in range(200)]  # 3 full chunks of 64 + 8 tokens


def start(model: Path, store: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    return start_server(model, log, bsr_kv_config(store, chunk=CHUNK, model_id="serve-llama"))


def complete(port: int, model: Path) -> tuple[list[int], int]:
    out = post(
        port,
        "/v1/completions",
        {
            "model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        },
    )  # fmt: skip
    choice = out["choices"][0]
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(choice["token_ids"]), int(details.get("cached_tokens") or 0)


def objects(store: Path) -> list[Path]:
    return [p for p in store.glob("**/objects/**/*.bsr") if p.is_file()]


def test_vllm_serve_restores_a_prefix_in_a_fresh_server(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16).save_pretrained(model)
    store = tmp_path / "store"
    results = []
    seen: dict[str, float] = {}
    for run in ("store", "restore"):
        log = tmp_path / f"{run}.log"
        proc, port = start(model, store, log)
        try:
            results.append(complete(port, model))
            if run == "store":  # the save runs after the request: wait for its objects
                eventually(lambda: len(objects(store)) >= 3, "the saved objects")
                seen["saves"] = eventually(partial(prom, port, "vllm:bsr_saves_total"), "saves")
                seen["saved"] = prom(port, "vllm:bsr_saved_bytes_total", tier="file")
            else:
                loaded = partial(prom, port, "vllm:bsr_loaded_tokens_total")
                seen["loaded"] = eventually(loaded, "loaded tokens")
                seen["bytes"] = prom(port, "vllm:bsr_loaded_bytes_total", tier="file")
                seen["lookups"] = prom(port, "vllm:bsr_lookups_total")
                seen["failed"] = prom(port, "vllm:bsr_failed_loads_total")
                logged = partial(lambda path: "loaded_tokens=192" in path.read_text(), log)
                eventually(logged, "the stats log line")
        finally:
            stop(proc)
    (stored_tokens, stored_cached), (restored_tokens, restored_cached) = results
    assert len(objects(store)) >= 3  # the full chunks of the prompt
    assert stored_cached == 0  # a fresh store: nothing to reuse
    assert restored_cached == 3 * CHUNK  # every full chunk came back through bsr
    assert restored_tokens == stored_tokens and len(stored_tokens) == 8
    # bsr's numbers on the OpenAI server's /metrics: 3 chunks of 64 tokens x 1 KiB saved, then
    # looked up once and loaded (asynchronously: the default), nothing failed
    chunk_bytes = CHUNK * 2 * 512
    assert seen == {
        "saves": 1.0, "saved": 3 * chunk_bytes, "loaded": 3.0 * CHUNK,
        "bytes": 3 * chunk_bytes, "lookups": 1.0, "failed": 0.0,
    }  # fmt: skip
    assert "KV Transfer metrics: " in (tmp_path / "restore.log").read_text()
