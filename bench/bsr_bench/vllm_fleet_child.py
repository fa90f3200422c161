"""The child of ``bsr bench --engine vllm --vllm-fleet`` (:mod:`.vllm_fleet`): it starts the
``vllm serve`` instances of each phase (three at a time at most), runs bsr's router in its own
threads, sends the workload through it and writes every sample to its output file.

Phases, one after the other: ``private`` (private_rr), ``shared`` (shared_rr, then
shared_router, salted apart), ``alone`` (vllm_rr), ``pd`` (the prefill/decode split and one
kv_both instance). Run by :mod:`.vllm_engine` (:func:`child`) under the interpreter that has
vLLM, bsr's router extra (``pyzmq``, ``msgspec``) and bsr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .common.stats import load_average
from .common.workers import free_port
from .vllm_common import root_cause, tokens
from .vllm_engine import EngineSpec, Outcome, bsr_transfer, file_tier
from .vllm_fleet import INSTANCES, KV_BYTES_PER_TOKEN, Workload
from .vllm_ttft import BLOCK_SIZE, CHUNK_TOKENS, MODEL

NAMES = tuple("abcdefgh"[:INSTANCES])
START_TIMEOUT_S = 900
#: the decode side's host tier (room for every P/D prompt)
PD_HOST_BYTES = 512 << 20


def _kv(role: str, tiers: list[dict[str, Any]], **conn: Any) -> dict[str, Any]:
    bsr = {"tiers": tiers, "chunk_tokens": CHUNK_TOKENS, "model_id": "fleet-bench"}
    return bsr_transfer(bsr, role=role, options=conn)


def _file(path: Path) -> dict[str, Any]:
    return file_tier(str(path), "8GiB")


class Servers:
    """One phase's ``vllm serve`` instances: started together, healthy, stopped by PID."""

    def __init__(self, spec: dict[str, Any], work: Path) -> None:
        self.spec, self.work = spec, work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(
        self,
        configs: Mapping[str, tuple[dict[str, Any] | None, list[str]]],
        ports: dict[str, int] | None = None,
    ) -> float:
        """Start every instance of ``configs`` (name -> KV transfer config or None, extra
        flags), on ``ports`` or free ones; the seconds until all answer ``/health``."""
        t0 = time.perf_counter()
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        engine = EngineSpec(
            self.spec["model"],
            self.spec["max_model_len"],
            BLOCK_SIZE,
            kv_cache_bytes=self.spec["gpu_tokens"] * KV_BYTES_PER_TOKEN,
            prefix_caching=None,  # vLLM's default: on, the prefix router's events need it
        )
        for name, (kv, extra) in configs.items():
            port = self.ports[name] = (ports or {}).get(name) or free_port()
            cmd = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine.serve_argv(),
                "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
                *extra,
            ]  # fmt: skip
            if kv is not None:
                cmd += ["--kv-transfer-config", json.dumps(kv)]
            with open(self.work / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env
                )
        for name in configs:
            self._wait_healthy(name, time.monotonic() + START_TIMEOUT_S)
        return time.perf_counter() - t0

    def _wait_healthy(self, name: str, deadline: float) -> None:
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = (self.work / f"{name}.log").read_text(errors="replace")
                raise RuntimeError(f"instance {name} exited {proc.returncode}: {root_cause(log)}")
            try:
                with urllib.request.urlopen(self.url(name) + "/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        raise RuntimeError(f"instance {name} did not answer /health within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        self.procs.clear()


@contextmanager
def phase(spec: dict[str, Any], work: Path, name: str) -> Iterator[Servers]:
    """A phase's servers, stopped when it ends."""
    (work / name).mkdir(parents=True, exist_ok=True)
    servers = Servers(spec, work / name)
    try:
        yield servers
    finally:
        servers.stop()


@contextmanager
def router_server(router: Any, pd: Any = None) -> Iterator[Any]:
    """bsr's :class:`~bsr.router.RouterServer` for ``router`` on a loopback port, in a thread."""
    from bsr.router import RouterServer

    http = RouterServer(("127.0.0.1", 0), router, pd=pd)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield http
    finally:
        http.shutdown()
        http.server_close()


# --------------------------------------------------------------------------- requests
def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A non-streamed completion: the answer and the instance that served it."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.loads(r.read())), str(r.headers.get("x-bsr-instance") or "")


def stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion through the router: TTFT (the first streamed token), the answer's
    token ids, the prompt tokens and the cached ones, the instance."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.perf_counter()
    ttft: float | None = None
    answer: list[int] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        instance = str(r.headers.get("x-bsr-instance") or "")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                answer += ids
            usage = event.get("usage") or usage
    if ttft is None:
        raise RuntimeError(f"instance {instance} streamed no token")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft, "latency_s": time.perf_counter() - t0, "answer": answer,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "cached_tokens": int(details.get("cached_tokens") or 0), "instance": instance,
    }  # fmt: skip


def converse(url: str, spec: dict[str, Any], salt: str | None) -> list[dict[str, Any]]:
    """The workload through the router at ``url``: wave by wave, the requests of a wave 50 ms
    apart, each turn the previous prompt + its answer + the new user tokens."""
    from concurrent.futures import ThreadPoolExecutor

    work = Workload(**spec["workload"])
    prompts: dict[int, list[int]] = {}
    samples: list[dict[str, Any]] = []
    base = {
        "model": spec["model"], "max_tokens": work.answer_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    if salt is not None:
        base["cache_salt"] = salt
    with ThreadPoolExecutor(work.concurrency) as pool:
        for wave in work.waves():
            futures = []
            for k, r in wave:
                prompts[k] = prompts.get(k, []) + work.user_part(k, r)
                futures.append(pool.submit(stream, url, {**base, "prompt": list(prompts[k])}))
                time.sleep(0.05)
            for (k, r), fut in zip(wave, futures, strict=True):
                got = fut.result()
                prompts[k] += got.pop("answer")
                samples.append({"conversation": k, "turn": r, **got})
    return samples


def _warm_up(servers: Servers, spec: dict[str, Any]) -> None:
    """One short untimed request per instance (first-touch, thread pools), salted apart."""
    for name in servers.ports:
        body = {
            "model": spec["model"], "prompt": tokens(64, 99, MODEL["vocab_size"]),
            "max_tokens": 2, "ignore_eos": True, "cache_salt": "warm-up",
        }  # fmt: skip
        post(servers.url(name), body)


# --------------------------------------------------------------------------- phases
def run_private(spec: dict[str, Any], work: Path, out: dict[str, Any]) -> None:
    from bsr.router import Router

    with phase(spec, work, "private") as servers:
        stores = {n: [_file(work / "private" / f"store-{n}")] for n in NAMES}
        out["engine_start_s"]["private"] = servers.start(
            {n: (_kv("kv_both", stores[n]), []) for n in NAMES}
        )
        _warm_up(servers, spec)
        router = Router({n: servers.url(n) for n in NAMES}, BLOCK_SIZE, policy="round_robin")
        with router_server(router) as http:
            samples = converse(http.url, spec, None)
        out["variants"]["private_rr"] = {
            "samples": samples,
            "decisions": router.snapshot()["decisions"],
        }


def run_shared(spec: dict[str, Any], work: Path, out: dict[str, Any]) -> None:
    from bsr.router import EventSubscriber, Router

    pool = work / "shared" / "pool"
    with phase(spec, work, "shared") as servers:
        events = None
        try:
            ports = {n: free_port() for n in NAMES}  # the prefix router knows them up front
            urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
            prefix = Router(urls, BLOCK_SIZE, policy="prefix", shared_media=["STORAGE"])
            events = EventSubscriber(prefix, "tcp://127.0.0.1:0").start()
            configs: dict[str, tuple[dict[str, Any] | None, list[str]]] = {}
            for n in NAMES:
                cfg = {
                    "enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": events.endpoint, "topic": n,
                }  # fmt: skip
                configs[n] = (
                    _kv("kv_both", [_file(pool)]),
                    ["--kv-events-config", json.dumps(cfg)],
                )
            out["engine_start_s"]["shared"] = servers.start(configs, ports)
            _warm_up(servers, spec)
            rr = Router(urls, BLOCK_SIZE, policy="round_robin")
            for name, router, salt in (
                ("shared_rr", rr, "fleet-shared-rr"),
                ("shared_router", prefix, "fleet-router"),
            ):
                with router_server(router) as http:
                    samples = converse(http.url, spec, salt)
                snap = router.snapshot()
                out["variants"][name] = {
                    "samples": samples, "decisions": snap["decisions"], "salt": salt,
                    "reasons": snap["reasons"],
                }  # fmt: skip
        finally:
            if events is not None:
                events.close()


def run_alone(spec: dict[str, Any], work: Path, out: dict[str, Any]) -> None:
    from bsr.router import Router

    with phase(spec, work, "alone") as servers:
        out["engine_start_s"]["alone"] = servers.start({n: (None, []) for n in NAMES})
        _warm_up(servers, spec)
        router = Router({n: servers.url(n) for n in NAMES}, BLOCK_SIZE, policy="round_robin")
        with router_server(router) as http:
            samples = converse(http.url, spec, None)
        out["variants"]["vllm_rr"] = {
            "samples": samples,
            "decisions": router.snapshot()["decisions"],
        }


def run_pd(spec: dict[str, Any], work: Path, out: dict[str, Any]) -> None:
    """The P/D split and one kv_both instance, the same fresh prompts on both."""
    from bsr.router import PDSplit, Router

    pool, warm = work / "pd" / "pool", free_port()
    with phase(spec, work, "pd") as servers:
        host = {"kind": "host", "capacity_bytes": PD_HOST_BYTES}
        out["engine_start_s"]["pd"] = servers.start({
            "prefill": (_kv("kv_producer", [_file(pool)]), []),
            "decode": (_kv("kv_consumer", [host, _file(pool)],
                           warm_address=f"127.0.0.1:{warm}"), []),
            "single": (_kv("kv_both", [_file(work / "pd" / "single")]), []),
        })  # fmt: skip
        _warm_up(servers, spec)
        pd = PDSplit(servers.url("prefill"), servers.url("decode"), f"http://127.0.0.1:{warm}",
                     CHUNK_TOKENS, await_s=30.0)  # fmt: skip
        urls = {"prefill": servers.url("prefill"), "decode": servers.url("decode")}
        n = Workload(**spec["workload"]).prompt_tokens(spec["workload"]["turns"] - 1)
        samples = []
        with router_server(Router(urls, BLOCK_SIZE), pd=pd) as http:
            for i in range(spec["pd_prompts"]):
                prompt = tokens(n, 7_000_003 + spec["workload"]["seed"] * 101 + i,
                                MODEL["vocab_size"])  # fmt: skip
                body = {"model": spec["model"], "prompt": prompt, "max_tokens": 1,
                        "temperature": 0.0, "ignore_eos": True}  # fmt: skip
                before = pd.decode_prefilled_tokens
                t0 = time.perf_counter()
                post(http.url, body)
                split_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                single, _ = post(servers.url("single"), body)
                single_s = time.perf_counter() - t0
                details = (single.get("usage") or {}).get("prompt_tokens_details") or {}
                samples.append({
                    "prompt_tokens": n, "split_s": split_s, "single_s": single_s,
                    "decode_prefilled": pd.decode_prefilled_tokens - before,
                    "single_cached": int(details.get("cached_tokens") or 0),
                })  # fmt: skip
        out["pd"] = {"samples": samples, "stats": pd.stats()}


def child(spec: dict[str, Any]) -> Outcome:
    """Every phase in turn; the samples (no in-process engine: the instances stop with their
    phase)."""
    work = Path(spec["work"])
    out: dict[str, Any] = {"variants": {}, "engine_start_s": {}, "pd": None}
    load_start = load_average()
    for run in (run_private, run_shared, run_alone, run_pd):
        run(spec, work, out)
    out["load_average"] = [load_start, load_average()]
    return out, None
