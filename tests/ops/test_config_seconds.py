"""Every seconds option has an upper bound the platform can represent, checked at parse time.

Found as a hostile user: ``Check.seconds`` had no upper bound, so a Redis ``timeout_s`` of 1e10,
the connector's ``deadline_s=1e10`` and ``shutdown_timeout_s=1e10`` were accepted and crashed
later with ``OverflowError`` (when the tier opened, in the worker's sync wait, at shutdown).
Now every option whose value is a time (declared with ``Check.seconds``,
``Check.optional_seconds`` or ``Check.non_negative_seconds``, and every option named ``*_s``)
refuses a value above :data:`bsr._check.MAX_SECONDS`, infinity and NaN with a ConfigError naming
its key, wherever it arrives from: ``EngineConfig`` (dict, TOML, environment), a tier kind's
options and constructor, the vLLM connector's settings parser, and ``bsr config check``.

The options are enumerated from their declarations, so a new one is covered without editing
this file; the option classes are the engine's, every tier kind's and the connector's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

import bsr
from bsr._check import MAX_SECONDS, Check, option_fields
from bsr.vllm._options import ConnectorOptions, settings

SECONDS_PARSERS = {Check.seconds, Check.optional_seconds, Check.non_negative_seconds}
#: refused by every seconds option
TOO_LONG: list[Any] = [1e10, 1e300, math.inf, -math.inf, math.nan, 10**400, MAX_SECONDS + 1]
TOO_LONG_IDS = ["1e10", "1e300", "inf", "-inf", "nan", "10**400", "max+1"]

#: a tier of each kind with only its required options (a new kind must be added here)
MINIMAL_TIER: dict[str, dict[str, Any]] = {
    "host": {"capacity_bytes": "1MiB"},
    "file": {"path": "/tmp/bsr-seconds-test", "capacity_bytes": "1MiB"},
    "striped_file": {"paths": ["/tmp/bsr-seconds-test-0"], "capacity_bytes": "1MiB"},
    "mooncake": {"master_address": "127.0.0.1:1"},
    "redis": {"url": "redis://127.0.0.1:1/0"},
}


def seconds_options(cls: Any) -> list[str]:
    """The options of ``cls`` that are a time: a seconds parser, or a name ending in ``_s``."""
    return [
        name
        for name, f in option_fields(cls).items()
        if f.metadata["parse"] in SECONDS_PARSERS or name.endswith("_s")
    ]


def tier_classes() -> dict[str, type[bsr.TierOptions]]:
    return {kind: bsr.tier_options(kind) for kind in bsr.tier_kinds()}


def _cases() -> list[Any]:
    out = [
        pytest.param("engine", key, id=f"engine.{key}") for key in seconds_options(bsr.EngineConfig)
    ]
    for kind, cls in tier_classes().items():
        out += [pytest.param(kind, key, id=f"{kind}.{key}") for key in seconds_options(cls)]
    out += [
        pytest.param("connector", key, id=f"connector.{key}")
        for key in seconds_options(ConnectorOptions)
    ]
    return out


CASES = _cases()


def test_the_enumeration_finds_the_options_of_the_report() -> None:
    found = {(p.values[0], p.values[1]) for p in CASES}
    assert {
        ("engine", "deadline_s"),
        ("engine", "shield_timeout_s"),
        ("engine", "breaker_cooldown_s"),
        ("redis", "timeout_s"),
        ("redis", "connect_timeout_s"),
        ("file", "lock_timeout_s"),
        ("mooncake", "timeout_s"),
        ("connector", "shutdown_timeout_s"),
        ("connector", "load_deadline_s"),
        ("connector", "lookup_read_timeout_s"),
    } <= found
    assert set(MINIMAL_TIER) == set(bsr.tier_kinds())  # a new kind: add its minimal table


@pytest.mark.parametrize(("where", "key"), CASES)
def test_every_time_option_is_declared_with_a_seconds_parser(where: str, key: str) -> None:
    """An option named ``*_s`` must be parsed as seconds (so the bound applies to it)."""
    cls = {"engine": bsr.EngineConfig, "connector": ConnectorOptions}.get(where)
    cls = cls or bsr.tier_options(where)
    assert option_fields(cls)[key].metadata["parse"] in SECONDS_PARSERS, (where, key)


def _engine_data(where: str, key: str, value: Any) -> tuple[dict[str, Any], str]:
    data: dict[str, Any] = {"model_id": "m", "tiers": [{"kind": "host", "capacity_bytes": 4096}]}
    if where == "engine":
        data[key] = value
        return data, key
    data["tiers"] = [{"kind": where, **MINIMAL_TIER[where], key: value}]
    return data, f"tiers[0].{key}"


@pytest.mark.parametrize("value", TOO_LONG, ids=TOO_LONG_IDS)
@pytest.mark.parametrize(("where", "key"), CASES)
def test_a_time_beyond_the_bound_is_refused_naming_the_key(
    where: str, key: str, value: Any
) -> None:
    """Through every parser that reads the option: the dict/TOML parser, the options class's
    own constructor (which tier constructors and ``EngineConfig(...)`` use), the connector's."""
    if where == "connector":
        with pytest.raises(bsr.ConfigError) as info:
            ConnectorOptions.from_dict({key: value})
        assert info.value.fields["key"] == f"bsr_connector.{key}"
        assert f"bsr_connector.{key}" in str(info.value)
        with pytest.raises(bsr.ConfigError) as info:
            ConnectorOptions(**{key: value})
        assert info.value.fields["key"] == f"bsr_connector.{key}"
        return
    data, full = _engine_data(where, key, value)
    with pytest.raises(bsr.ConfigError) as info:
        bsr.EngineConfig.from_dict(data)
    assert info.value.fields["key"] == full and full in str(info.value)
    if where == "engine":
        with pytest.raises(bsr.ConfigError) as info:
            bsr.EngineConfig(tiers=(bsr.HostTierOptions(4096),), **{key: value})
        assert info.value.fields["key"] == key
        return
    cls = bsr.tier_options(where)
    with pytest.raises(bsr.ConfigError) as info:
        cls.from_dict({**MINIMAL_TIER[where], key: value})
    assert info.value.fields["key"] == key
    with pytest.raises(bsr.ConfigError) as info:
        cls(**{**MINIMAL_TIER[where], key: value})
    assert info.value.fields["key"] == key


@pytest.mark.parametrize(("where", "key"), CASES)
def test_the_bound_itself_is_accepted(where: str, key: str) -> None:
    if where == "connector":
        assert getattr(ConnectorOptions.from_dict({key: MAX_SECONDS}), key) == MAX_SECONDS
        return
    data, _ = _engine_data(where, key, MAX_SECONDS)
    config = bsr.EngineConfig.from_dict(data)
    options = config if where == "engine" else config.tiers[0]
    assert getattr(options, key) == MAX_SECONDS


def test_the_message_says_the_bound_and_what_to_do() -> None:
    with pytest.raises(bsr.ConfigError) as info:
        bsr.EngineConfig.from_dict(
            {"tiers": [{"kind": "host", "capacity_bytes": 1}], "deadline_s": 1e10}
        )
    text = str(info.value)
    assert "deadline_s must be at most 2,147,483 s or None" in text
    assert "24.8 days" in text and "None: no limit" in text


# --------------------------------------------------------------------- the connector
def _vllm_config(bsr_config: dict[str, Any], connector: dict[str, Any]) -> Any:
    """The parts of vLLM's config :func:`bsr.vllm._options.settings` reads (no vLLM)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"bsr": bsr_config, "bsr_connector": connector},
            kv_role="kv_both",
            engine_id="e",
            kv_load_failure_policy="recompute",
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, data_parallel_size=1, tensor_parallel_size=1
        ),
        model_config=SimpleNamespace(
            model="m", revision=None, dtype="float32", hf_config={"model_type": "llama"}
        ),
    )


_HOST = {"tiers": [{"kind": "host", "capacity_bytes": "1MiB"}], "model_id": "m"}


@pytest.mark.parametrize(
    ("bsr_config", "connector", "key"),
    [
        ({**_HOST, "deadline_s": 1e10}, {}, "deadline_s"),
        ({**_HOST, "shield_timeout_s": 1e300}, {}, "shield_timeout_s"),
        (_HOST, {"shutdown_timeout_s": 1e10}, "bsr_connector.shutdown_timeout_s"),
        (_HOST, {"load_deadline_s": 1e10}, "bsr_connector.load_deadline_s"),
        (_HOST, {"lookup_read_timeout_s": 4294967.8}, "bsr_connector.lookup_read_timeout_s"),
        (
            {"tiers": [{"kind": "redis", "url": "redis://h:1/0", "timeout_s": 1e10}]},
            {},
            "tiers[0].timeout_s",
        ),
    ],
    ids=["deadline_s", "shield_timeout_s", "shutdown", "load_deadline", "read-49.7d", "redis"],
)
def test_the_connectors_settings_refuse_them_at_startup(
    bsr_config: dict[str, Any], connector: dict[str, Any], key: str
) -> None:
    """The values of the report, through the parser both sides of the connector run at startup
    (before: accepted, then OverflowError in ``BsrWorker._wait_sync`` or at shutdown)."""
    good = settings(_vllm_config(_HOST, {}), None)
    assert good.engine.deadline_s is None  # the stub is enough for the parser
    with pytest.raises(bsr.ConfigError) as info:
        settings(_vllm_config(bsr_config, connector), None)
    assert info.value.fields["key"] == key and key in str(info.value)


# --------------------------------------------------------------------- the CLI and the env
@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("deadline_s = 1e10", "deadline_s"),
        ("shield_timeout_s = 1e300", "shield_timeout_s"),
        ("breaker_cooldown_s = inf", "breaker_cooldown_s"),
        ("deadline_s = nan", "deadline_s"),
    ],
)
def test_bsr_config_check_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, key: str
) -> None:
    from bsr.cli import main

    path = tmp_path / "bsr.toml"
    path.write_text(f'[bsr]\nmodel_id = "m"\n{line}\n[[bsr.tiers]]\nkind = "host"\n'
                    'capacity_bytes = "1MiB"\n')  # fmt: skip
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bsr config: error:") and key in err
    redis = tmp_path / "redis.toml"
    timeout = line.replace(key, "connect_timeout_s")
    redis.write_text(f'[[tiers]]\nkind = "redis"\nurl = "redis://h:1/0"\n{timeout}\n')
    assert main(["config", "check", str(redis)]) == 2
    assert "tiers[0].connect_timeout_s" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["1e10", "1e300", "Infinity", "NaN", "2147484"])
def test_environment_values_are_refused_naming_the_variable(
    raw: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from bsr.cli import main

    env = {"BSR_TIERS": json.dumps([{"kind": "host", "capacity_bytes": 4096}])}
    env["BSR_SHIELD_TIMEOUT_S"] = raw
    with pytest.raises(bsr.ConfigError) as info:
        bsr.EngineConfig.from_env(environ=env)
    assert info.value.fields["key"] == "shield_timeout_s" and "BSR_SHIELD_TIMEOUT_S" in str(
        info.value
    )
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main(["config", "check"]) == 2
    assert "BSR_SHIELD_TIMEOUT_S" in capsys.readouterr().err


# --------------------------------------------------------------------- the bound is usable
def test_the_bound_is_a_timeout_the_platform_represents() -> None:
    """Why 2**31 ms: a socket timeout is handed to poll() in milliseconds as a C int. At the
    bound, a read still waits (it is not cut short by a wrapped timeout) and gets its data;
    thread waits and the clock take it; 1e10 s (the report's value) cannot even be set."""
    assert MAX_SECONDS * 1000 < 2**31 - 1 and MAX_SECONDS < threading.TIMEOUT_MAX
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(MAX_SECONDS)
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(a.recv(1)))
        reader.start()
        time.sleep(0.3)
        assert reader.is_alive() and not got  # still waiting, as a 24.8-day timeout must
        b.send(b"x")
        reader.join(10)
        assert got == [b"x"]
        with pytest.raises(OverflowError):
            a.settimeout(1e10)
    lock = threading.Lock()
    assert lock.acquire(timeout=MAX_SECONDS)
    assert math.isfinite(time.monotonic() + MAX_SECONDS)


@pytest.mark.anyio
async def test_an_engine_at_the_bounds_saves_and_restores() -> None:
    """Every engine time option at its maximum: the engine opens, saves, restores, closes."""
    from support.helpers import filled_cache, two_group_layout

    layout = two_group_layout()
    fields = {f.name for f in dataclasses.fields(bsr.EngineConfig)}
    times = {key: MAX_SECONDS for key in seconds_options(bsr.EngineConfig) if key in fields}
    config = bsr.EngineConfig.from_dict(
        {"model_id": "m", "tiers": [{"kind": "host", "capacity_bytes": "4MiB"}], "window": 2,
         "io_depth": 1, **times}
    )  # fmt: skip
    tokens = list(range(layout.chunk_tokens * 2))
    src = filled_cache(layout, 16, 4)
    blocks = list(range(len(tokens) // 4))
    async with bsr.RestoreEngine.from_config(config, layout=layout) as engine:
        await engine.save(tokens, src, blocks)
        dst = bsr.PagedKVCache(layout, 16, 4)
        with anyio.fail_after(60):
            result = await engine.restore(tokens, dst, blocks, deadline_s=MAX_SECONDS)
        assert result.state is bsr.RequestState.COMMITTED


@pytest.mark.parametrize("value", [1e10, 1e300, math.inf])
@pytest.mark.anyio
async def test_the_engines_own_times_and_per_call_times_are_bounded_alike(value: float) -> None:
    """The engine's constructor and its calls take times too: ``shield_timeout_s`` and
    ``breaker_cooldown_s`` when it is built, ``deadline_s`` and ``lease_ttl_s`` per call, a
    tier's lease ``ttl_s``; each refused naming its key, as the config refuses it."""
    from support.helpers import filled_cache, two_group_layout

    layout = two_group_layout()
    ns = bsr.Namespace("m")
    host = bsr.HostTier(1 << 22)
    for key in ("shield_timeout_s", "breaker_cooldown_s", "deadline_s"):
        with pytest.raises(bsr.ConfigError) as info:
            bsr.RestoreEngine(layout, [host], namespace=ns, **{key: value})
        assert info.value.fields["key"] == key
    tokens = list(range(layout.chunk_tokens * 2))
    src, blocks = filled_cache(layout, 16, 4), list(range(len(tokens) // 4))
    async with bsr.RestoreEngine(layout, [host], window=2, io_depth=1, namespace=ns) as engine:
        await engine.save(tokens, src, blocks)
        dst = bsr.PagedKVCache(layout, 16, 4)
        calls = {
            "restore deadline_s": lambda: engine.restore(tokens, dst, blocks, deadline_s=value),
            "lookup deadline_s": lambda: engine.lookup(tokens, deadline_s=value),
            "lookup lease_ttl_s": lambda: engine.lookup(tokens, lease_ttl_s=value),
            "tier lease ttl_s": lambda: host.lease([], value),
        }
        for what, call in calls.items():
            with pytest.raises(bsr.ConfigError) as info:
                await call()
            assert f"{MAX_SECONDS:,}" in str(info.value) or "finite" in str(info.value), what
