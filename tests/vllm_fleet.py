"""A fleet of ``vllm serve`` instances over one bsr pool, optionally behind bsr's router, for the
tests (``tests/vllm_connector/test_fleet_router.py``, ``test_fleet_pools.py``).

Import with ``from vllm_fleet import ...`` (``tests/`` is on pytest's ``pythonpath``). Every
instance serves the same random float32 Llama (restored and recomputed tokens agree exactly),
with vLLM's prefix-cache reset endpoint on; each publishes its KV events to the router's socket
under its name when a router is asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr.router import EventSubscriber, Router, RouterServer, block_digests
from vllm_engines import write_llama
from vllm_servers import eventually, post, prom, serve, stop, wait_healthy

BLOCK, CHUNK = 32, 64
#: one object (2 layers x 64 tokens x 1 KiB of float32 K/V) with its header; a host tier of
#: this size holds two
HOST_BYTES = 2 * (4096 + 2 * CHUNK * 1024)


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 37) % 490 for i in range(n)]


def kv_config(
    pool: dict[str, Any], model_id: str = "fleet-llama", **connector: Any
) -> dict[str, Any]:
    """BsrConnector over a HostTier of :data:`HOST_BYTES` above the pool's tier table;
    ``connector``: more ``bsr_connector`` options."""
    return {
        "kv_connector": "BsrConnector",
        "kv_connector_module_path": "bsr.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {
                "tiers": [{"kind": "host", "capacity_bytes": HOST_BYTES}, pool],
                "chunk_tokens": CHUNK,
                "model_id": model_id,
            },
            "bsr_connector": {"kv_events_audit_s": 1.0, **connector},
        },
    }


@dataclass
class Fleet:
    ports: dict[str, int]
    model: Path
    router: Router | None = None
    http: RouterServer | None = None

    def log(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` of ``name``'s log that name bsr, its stores, a warning or an error
        (for a failing assertion's message: why a probe missed or a load fell back)."""
        path = self.model.parent / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        marks = ("bsr", "kv transfer", "mooncake", "redis", "warning", "error")
        mine = [ln[:400] for ln in text.splitlines() if any(m in ln.lower() for m in marks)]
        return f"--- {name}.log (bsr, warnings, errors) ---\n" + "\n".join(mine[-lines:])

    def complete(
        self, name: str | None, tokens: list[int], **extra: Any
    ) -> tuple[list[int], int, str]:
        """Greedy completion on ``name`` (None: through the router): its tokens, the prompt
        tokens vLLM reports cached, and the instance that served it."""
        body = {
            "model": str(self.model), "prompt": tokens, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra,
        }  # fmt: skip
        if name is not None:
            out, via = post(self.ports[name], "/v1/completions", body), name
        else:
            assert self.http is not None, "this fleet has no router"
            req = urllib.request.Request(
                self.http.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                out, via = json.loads(r.read()), r.headers["x-bsr-instance"]
        choice = out["choices"][0]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return list(choice["token_ids"]), int(details.get("cached_tokens") or 0), via

    def saves(self, name: str) -> float:
        return prom(self.ports[name], "vllm:bsr_saves_total")

    def reset(self, name: str) -> None:
        port = self.ports[name]
        eventually(lambda: post(port, "/reset_prefix_cache", {}).get("success"), "a reset")

    def reference(self, name: str, tokens: list[int], **extra: Any) -> list[int]:
        """The same prompt recomputed on ``name``: its cache reset, no bsr load or save."""
        self.reset(name)
        opts = {"kv_transfer_params": {"bsr": {"load": False, "store": False}}}
        got, cached, _ = self.complete(name, tokens, **opts, **extra)
        assert cached == 0
        return got

    def turn(self, name: str, tokens: list[int], **extra: Any) -> tuple[list[int], int]:
        """One turn on ``name``, its save awaited: the output tokens and the cached count."""
        before = self.saves(name)
        out, cached, _ = self.complete(name, tokens, **extra)
        eventually(lambda: self.saves(name) > before, f"{name}'s save")
        return out, cached

    def match(self, name: str, tokens: list[int], salt: str | None = None) -> dict[str, int]:
        """What the router knows ``name`` holds of ``tokens``' blocks, by medium."""
        assert self.router is not None, "this fleet has no router"
        with self.router._lock:
            m = self.router.index.match(name, block_digests(tokens, BLOCK, cache_salt=salt))
        return m.by_medium


@contextlib.contextmanager
def start_fleet(
    root: Path,
    names: tuple[str, ...],
    config: Callable[[str], dict[str, Any]],
    *,
    router: bool = False,
    env: dict[str, str] | None = None,
) -> Iterator[Fleet]:
    """``vllm serve`` instances ``names`` (``config(name)``: each one's --kv-transfer-config),
    started together and stopped by PID; with ``router``, behind bsr's router (the pool's
    medium ``STORAGE`` shared)."""
    from bsr.testing._ports import unheld_ports, wait_listening

    model = root / "model"
    write_llama(model)
    ports = dict(zip(names, unheld_ports(len(names)), strict=True))
    fleet = Fleet(ports, model)
    events = None
    if router:
        urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        fleet.router = Router(urls, BLOCK, shared_media=["STORAGE"])
        events = EventSubscriber(fleet.router, "tcp://127.0.0.1:0").start()
        fleet.http = RouterServer(("127.0.0.1", 0), fleet.router)
        threading.Thread(target=fleet.http.serve_forever, daemon=True).start()
    saved_env = dict(os.environ)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    os.environ.update(env or {})
    procs = {}
    try:
        for name, port in ports.items():
            extra = ["--dtype", "float32"]
            if events is not None:
                cfg = {
                    "enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": events.endpoint, "topic": name,
                }  # fmt: skip
                extra += ["--kv-events-config", json.dumps(cfg)]
            procs[name] = serve(model, port, root / f"{name}.log", config(name), extra)
        for name, port in ports.items():
            wait_listening(procs[name], port, time.monotonic() + 900, "vllm serve", poll_s=0.5)
            wait_healthy(port, procs[name], root / f"{name}.log", time.monotonic() + 900)
        yield fleet
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for proc in procs.values():
            stop(proc)
        if fleet.http is not None:
            fleet.http.shutdown()
            fleet.http.server_close()
        if events is not None:
            events.close()


def settled(fn: Callable[[], Any], want: Any, timeout: float = 120) -> Any:
    """``fn()`` once it equals ``want``, or its last value after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (got := fn()) != want and time.monotonic() < end:
        time.sleep(0.2)
    return got
