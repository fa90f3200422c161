"""The bench's one engine runner (``bsr_bench.vllm_engine``): every section's child builds the
engine it always built (the arguments below are each section's, written out), and a child
reports its result, or its error, the one same way. No vLLM needed: the engine start is caught
before vLLM is imported."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from bsr_bench import (
    vllm_checkpoints,
    vllm_cost,
    vllm_engine,
    vllm_fleet_child,
    vllm_hybrid,
    vllm_interference_child,
    vllm_ttft,
    vllm_warm,
)
from bsr_bench.vllm_common import run_child

#: what every bench engine but the interference section's passes ``vllm.LLM``
BASE = {
    "model": "/m", "load_format": "dummy", "skip_tokenizer_init": True, "enforce_eager": True,
    "dtype": "bfloat16", "block_size": 128, "kv_cache_memory_bytes": 1 << 30,
    "enable_prefix_caching": False, "seed": 0,
}  # fmt: skip
FILE = {"kind": "file", "path": "/s", "capacity_bytes": 8 << 30}


def bsr(
    extra: dict[str, Any], connector: str = "BsrConnector", module: str = "bsr.vllm"
) -> dict[str, Any]:
    """A BsrConnector's KV transfer config, as the sections wrote it out."""
    return {
        "kv_connector": connector, "kv_connector_module_path": module, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }  # fmt: skip


class Started(Exception):
    """Raised by the stand-in for ``start_llm``: what the section asked for."""

    def __init__(self, kwargs: dict[str, Any], transfer: dict[str, Any] | None) -> None:
        self.kwargs, self.transfer = kwargs, transfer


def started(module: Any, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Started:
    def start(
        engine: vllm_engine.EngineSpec, transfer: dict[str, Any] | None = None, **extra: Any
    ) -> Any:
        raise Started({**engine.llm_kwargs(), **extra}, transfer)

    monkeypatch.setattr(module, "start_llm", start)
    with pytest.raises(Started) as got:
        module.child(spec)
    return got.value


@pytest.mark.parametrize("mode", ["recompute", "bsr", "bsr_sync", "offloading"])
def test_ttft_engines(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"model": "/m", "prefixes": [256, 512], "repeats": 1, "seed": 0, "store": "/s"}
    got = started(vllm_ttft, {**spec, "mode": mode}, monkeypatch)
    assert got.kwargs == {**BASE, "max_model_len": 512 + 64}
    want = {
        "recompute": None,
        "bsr": bsr({"bsr": {"tiers": [FILE], "chunk_tokens": 256, "window": 8, "io_depth": 4},
                    "bsr_connector": {"load": "async"}}),
        "bsr_sync": bsr({"bsr": {"tiers": [FILE], "chunk_tokens": 256, "window": 8,
                                 "io_depth": 4}, "bsr_connector": {"load": "sync"}}),
        "offloading": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
    }  # fmt: skip
    assert got.transfer == want[mode]


@pytest.mark.parametrize("mode", ["recompute", "hybrid", "one_group"])
def test_hybrid_engines(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"model": "/m", "prefixes": [1024], "repeats": 1, "seed": 0, "store": "/s"}
    got = started(vllm_hybrid, {**spec, "mode": mode}, monkeypatch)
    assert got.kwargs == {
        **BASE, "max_model_len": 1024 + 64, "disable_log_stats": False,
        "disable_hybrid_kv_cache_manager": mode == "one_group",
    }  # fmt: skip
    conf = {"tiers": [FILE], "chunk_tokens": 256, "window": 8, "io_depth": 4}
    assert got.transfer == (None if mode == "recompute" else bsr({"bsr": conf}))


def test_checkpoint_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"model": "/m", "store": "/s", "every": 4, "prompts": [[5] * 300], "max_model_len": 364}
    got = started(vllm_checkpoints, spec, monkeypatch)
    assert got.kwargs == {**BASE, "max_model_len": 364, "disable_log_stats": False}
    conf = {"tiers": [FILE], "chunk_tokens": 256, "window": 8, "io_depth": 4,
            "window_checkpoint_chunks": 4}  # fmt: skip
    assert got.transfer == bsr({"bsr": conf})


@pytest.mark.parametrize("policy", ["load", "cost"])
def test_cost_engines(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BSR_BENCH_TIERS", raising=False)  # the child sets it for its engine
    spec = {
        "model": "/m", "store": "/s", "condition": "mixed", "policy": policy, "seed": 0,
        "prefix_tokens": 1024, "prefixes": 1, "repeats": 1, "slow_bytes_per_s": 5e5,
    }  # fmt: skip
    got = started(vllm_cost, spec, monkeypatch)
    assert got.kwargs == {**BASE, "max_model_len": 1024 + 64, "disable_log_stats": False}
    conf = {
        "tiers": [{"kind": "host", "capacity_bytes": 1 << 30}, FILE], "chunk_tokens": 256,
        "window": 8, "io_depth": 4, "policy": "cost" if policy == "cost" else "all_or_nothing",
    }  # fmt: skip
    assert got.transfer == bsr({"bsr": conf}, "CostBenchConnector", "bsr_bench.vllm_cost_connector")
    assert json.loads(os.environ["BSR_BENCH_TIERS"]) == {
        "slow_bytes_per_s": 5e5, "host_chunks": 2,
    }  # fmt: skip


@pytest.mark.parametrize("phase", ["store", "measure"])
def test_warm_engines(phase: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"model": "/m", "store": "/s", "prefixes": [2048], "port": 7, "phase": phase}
    got = started(vllm_warm, spec, monkeypatch)
    assert got.kwargs == {**BASE, "max_model_len": 2048 + 64, "disable_log_stats": False}
    tiers: list[dict[str, Any]] = [{**FILE, "capacity_bytes": 16 << 30}]
    conf: dict[str, Any] = {"tiers": tiers, "chunk_tokens": 256, "window": 8, "io_depth": 4}
    opts: dict[str, Any] = {"load": "async"}
    if phase == "measure":
        tiers.insert(0, {"kind": "host", "capacity_bytes": 4 << 30})
        conf["promote"] = "always"
        opts.update(save=False, warm_address="127.0.0.1:7")
    assert got.transfer == bsr({"bsr": conf, "bsr_connector": opts})


CONNECTORS = [
    None,
    {"role": "kv_producer", "load": "async"},
    {"role": "kv_both", "load": "sync", "direct_io": True},
]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_interference_engines(
    connector: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = {
        "job": "rounds", "model": "/m", "store": "/s", "store_capacity_bytes": 5 << 30,
        "prefix_tokens": 1024, "new_tokens": 32, "block_size": 16, "kv_cache_bytes": 3 << 30,
        "chunk_tokens": 256, "window": 4, "io_depth": 2, "connector": connector,
    }  # fmt: skip
    got = started(vllm_interference_child, spec, monkeypatch)
    assert got.kwargs == {
        "model": "/m", "skip_tokenizer_init": True, "enforce_eager": True, "dtype": "bfloat16",
        "block_size": 16, "max_model_len": 1024 + 32 + 64, "kv_cache_memory_bytes": 3 << 30,
        "enable_prefix_caching": True, "disable_log_stats": True, "seed": 0,
    }  # fmt: skip
    if connector is None:
        assert got.transfer is None
        return
    tier = {"kind": "file", "path": "/s", "capacity_bytes": 5 << 30,
            "direct_io": bool(connector.get("direct_io"))}  # fmt: skip
    want = bsr({"bsr": {"tiers": [tier], "chunk_tokens": 256, "window": 4, "io_depth": 2},
                "bsr_connector": {"load": connector["load"]}})  # fmt: skip
    assert got.transfer == {**want, "kv_role": connector["role"]}


def test_fleet_instances(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet instance's ``vllm serve`` command: the same flags as before the runner."""

    class Spawned(Exception):
        pass

    def popen(cmd: list[str], **kw: Any) -> Any:
        raise Spawned(cmd)

    monkeypatch.setattr(vllm_fleet_child.subprocess, "Popen", popen)
    servers = vllm_fleet_child.Servers(
        {"model": "/m", "max_model_len": 900, "gpu_tokens": 10}, tmp_path
    )
    kv = vllm_fleet_child._kv("kv_consumer", [vllm_fleet_child._file(Path("/s"))], load="sync")
    with pytest.raises(Spawned) as got:
        servers.start({"a": (kv, ["--x", "1"])}, {"a": 8000})
    cmd = got.value.args[0]
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = cmd[3:]
    want = [
        "--model", "/m", "--host", "127.0.0.1", "--port", "8000", "--skip-tokenizer-init",
        "--enforce-eager", "--dtype", "bfloat16", "--load-format", "dummy", "--block-size", "128",
        "--max-model-len", "900", "--kv-cache-memory-bytes", str(10 * 4096), "--seed", "0",
        "--enable-prompt-tokens-details", "--x", "1", "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    assert sorted(pairs(flags)) == sorted(pairs(want))
    assert kv == {
        "kv_connector": "BsrConnector", "kv_connector_module_path": "bsr.vllm",
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bsr": {"tiers": [{"kind": "file", "path": "/s", "capacity_bytes": "8GiB"}],
                    "chunk_tokens": 256, "model_id": "fleet-bench"},
            "bsr_connector": {"load": "sync"},
        },
    }  # fmt: skip


def pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    """``--flag value`` and bare ``--flag`` as pairs (their order aside)."""
    out: list[tuple[str, str | None]] = []
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out.append((a, None if nxt is None or nxt.startswith("--") else nxt))
    return out


def test_serve_flags_follow_the_spec() -> None:
    spec = vllm_engine.EngineSpec("/m", 64, 16, dummy_weights=False, log_stats=False)
    argv = spec.serve_argv()
    assert "--load-format" not in argv and "--no-enable-prefix-caching" in argv
    assert "--disable-log-stats" in argv
    argv = vllm_engine.EngineSpec("/m", 64, 16, prefix_caching=True, log_stats=True).serve_argv()
    assert "--enable-prefix-caching" in argv and "--disable-log-stats" not in argv


def test_the_entry_point_writes_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def child(spec: dict[str, Any]) -> vllm_engine.Outcome:
        seen.append(spec)
        return {"ok": spec["n"] + 1}, None

    monkeypatch.setattr(vllm_fleet_child, "child", child)
    (tmp_path / "spec.json").write_text(json.dumps({"n": 1}))
    out = tmp_path / "out.json"
    vllm_engine.main(["bsr_bench.vllm_fleet_child", str(tmp_path / "spec.json"), str(out)])
    assert seen == [{"n": 1}] and json.loads(out.read_text()) == {"ok": 2}
    for argv in ([], ["bsr_bench.vllm_fleet_child", "a"], ["os", "a", "b"]):
        with pytest.raises(SystemExit, match=r"usage: python -m bsr_bench\.vllm_engine"):
            vllm_engine.main(argv)


@pytest.mark.slow
def test_a_failing_child_is_reported_by_its_most_specific_line(tmp_path: Path) -> None:
    """The real child process (this interpreter): a section that raises writes no result, and
    the bench side reports the error line of its traceback."""
    got = run_child(
        sys.executable, "bsr_bench.vllm_interference_child", {"job": "bogus"}, tmp_path, "x", 120
    )
    assert got == {"error": "ValueError: unknown job 'bogus'", "returncode": 1}
    assert not (tmp_path / "x.out.json").exists()
