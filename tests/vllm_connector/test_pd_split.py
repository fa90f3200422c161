"""Prefill and decode on two ``vllm serve`` instances, through bsr's pool and bsr's proxy.

The prefill instance (``kv_producer``: saves, never loads) and the decode instance
(``kv_consumer``: loads, never saves; a HostTier above the pool and its warm endpoint) share one
FileTier root. The proxy (:class:`bsr.router.PDSplit` in this process) sends a request to the
prefill side with ``max_tokens`` 1, waits (bounded) until the decode side's warm endpoint finds
the prompt's whole chunks in the pool, then sends the request to the decode side. float32
weights: restored and recomputed tokens agree exactly. Checked:

* the tokens equal a recompute on one instance, and the decode side prefills only the tail that
  is not a whole chunk (the rest is loaded);
* a save that never lands (the request opts out of storing) costs the proxy its bounded wait
  (counted) and the decode side recomputes: the same tokens;
* an object damaged between prefill and decode is caught by the decode side's load (counted as
  a failed load) and recomputed: the same tokens, never partial KV.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_engines import write_llama
from vllm_servers import eventually, post, prom, serve, stop, wait_healthy

pytest.importorskip("vllm")
pytest.importorskip("msgspec")
pytestmark = pytest.mark.timeout(1500)

from bsr.router import PDSplit, Router, RouterServer  # noqa: E402

CHUNK = 64
HOST_BYTES = 8 * (4096 + 2 * CHUNK * 1024)  # eight objects of float32 K/V


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 37) % 490 for i in range(n)]


@dataclass
class Split:
    prefill: int
    decode: int
    pd: PDSplit
    http: RouterServer
    model: Path
    pool: Path

    def body(self, tokens: list[int], **extra: Any) -> dict[str, Any]:
        return {
            "model": str(self.model), "prompt": tokens, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra,
        }  # fmt: skip

    def through_proxy(self, tokens: list[int], **extra: Any) -> list[int]:
        req = urllib.request.Request(
            self.http.url + "/v1/completions",
            data=json.dumps(self.body(tokens, **extra)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.headers["x-bsr-instance"] == "decode"
            return list(json.loads(r.read())["choices"][0]["token_ids"])

    def direct(self, port: int, tokens: list[int], **extra: Any) -> tuple[list[int], int]:
        out = post(port, "/v1/completions", self.body(tokens, **extra))
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return list(out["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)

    def reference(self, tokens: list[int]) -> list[int]:
        """The prompt recomputed on the decode instance: its cache reset, no bsr load."""
        self.reset()
        opts = {"kv_transfer_params": {"bsr": {"load": False}}}
        got, cached = self.direct(self.decode, tokens, **opts)
        assert cached == 0
        self.reset()
        return got

    def reset(self) -> None:
        for port in (self.prefill, self.decode):
            eventually(lambda p=port: post(p, "/reset_prefix_cache", {}).get("success"), "reset")


def kv_config(role: str, pool: Path, warm: str | None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"kind": "file", "path": str(pool), "capacity_bytes": "1GiB"}]
    if role == "kv_consumer":
        tiers.insert(0, {"kind": "host", "capacity_bytes": HOST_BYTES})
    conn: dict[str, Any] = {} if warm is None else {"warm_address": warm}
    return {
        "kv_connector": "BsrConnector",
        "kv_connector_module_path": "bsr.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {"tiers": tiers, "chunk_tokens": CHUNK, "model_id": "pd-llama"},
            "bsr_connector": conn,
        },
    }


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    from bsr.testing._ports import unheld_ports, wait_listening

    root = tmp_path_factory.mktemp("pd")
    model, pool = root / "model", root / "pool"
    write_llama(model)
    p_port, d_port, warm_port = unheld_ports(3)
    saved_env = dict(os.environ)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    procs = {}
    http = None
    try:
        for name, port, role, warm in (
            ("prefill", p_port, "kv_producer", None),
            ("decode", d_port, "kv_consumer", f"127.0.0.1:{warm_port}"),
        ):
            cfg = kv_config(role, pool, warm)
            procs[name] = serve(model, port, root / f"{name}.log", cfg, ["--dtype", "float32"])
        for name, port in (("prefill", p_port), ("decode", d_port)):
            wait_listening(procs[name], port, time.monotonic() + 900, "vllm serve", poll_s=0.5)
            wait_healthy(port, procs[name], root / f"{name}.log", time.monotonic() + 900)
        urls = {"prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}"}
        pd = PDSplit(urls["prefill"], urls["decode"], f"http://127.0.0.1:{warm_port}", CHUNK)
        http = RouterServer(("127.0.0.1", 0), Router(urls, 32), pd=pd)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        yield Split(p_port, d_port, pd, http, model, pool)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for proc in procs.values():
            stop(proc)
        if http is not None:
            http.shutdown()
            http.server_close()


def test_decode_loads_what_prefill_computed_and_prefills_only_the_tail(split: Split) -> None:
    for i, n in enumerate((3 * CHUNK + 8, 2 * CHUNK + 40)):
        tokens = prompt(i + 1, n)
        want = split.reference(tokens)
        before = split.pd.decode_prefilled_tokens
        assert split.through_proxy(tokens) == want
        assert split.pd.decode_prefilled_tokens - before == n % CHUNK
    assert split.pd.await_timeouts == 0
    assert prom(split.decode, "vllm:bsr_saves_total") == 0  # a consumer never saves
    assert prom(split.prefill, "vllm:bsr_loads_total") == 0  # a producer never loads


def test_a_save_that_never_lands_is_waited_for_boundedly_then_recomputed(split: Split) -> None:
    tokens = prompt(7, 2 * CHUNK + 8)
    want = split.reference(tokens)
    split.pd.await_s = 1.0
    try:
        opts = {"kv_transfer_params": {"bsr": {"store": False}}}
        before = split.pd.decode_prefilled_tokens
        assert split.through_proxy(tokens, **opts) == want
    finally:
        split.pd.await_s = 5.0
    assert split.pd.await_timeouts == 1
    assert split.pd.decode_prefilled_tokens - before == len(tokens)  # nothing to load


def test_an_object_damaged_between_prefill_and_decode_is_recomputed(split: Split) -> None:
    tokens = prompt(9, 2 * CHUNK + 8)
    want = split.reference(tokens)
    saves = prom(split.prefill, "vllm:bsr_saves_total")
    files = set(split.pool.rglob("*"))
    split.direct(split.prefill, tokens, max_tokens=1)
    eventually(lambda: prom(split.prefill, "vllm:bsr_saves_total") > saves, "the save")
    new = [f for f in set(split.pool.rglob("*")) - files if f.is_file() and f.stat().st_size > 8192]
    assert len(new) == 2, new  # the prompt's two whole chunks
    for f in new:  # one payload byte flipped in each (the headers stay valid)
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    failed = prom(split.decode, "vllm:bsr_failed_loads_total")
    got, cached = split.direct(split.decode, tokens)
    assert got == want
    assert prom(split.decode, "vllm:bsr_failed_loads_total") > failed or cached == 0
