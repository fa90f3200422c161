"""Hostile config values: every one is a ``bsr.ConfigError`` naming its key, at parse time.

Each value of ``HOSTILE`` is tried in every key of the engine config and of each tier kind. The
rule checked is the one the README promises: the parser either accepts the value, and then the
engine (and its tiers) builds from it without an error, or it refuses it with a ``ConfigError``
whose ``key`` field and message name the key. Nothing else may escape (no ``OverflowError``,
``RecursionError``, ``UnicodeDecodeError``, ``ValueError``, ``OSError``), and the CLI's
``bsr config check`` turns each refusal into exit code 2 and one line naming the key.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import bsr
from bsr.engine._options import MAX_WINDOW
from support.helpers import two_group_layout

BIG = "9" * 400 + "TiB"
HOSTILE: list[Any] = [
    BIG,  # OverflowError (float) before
    "1" + "0" * 400 + ".5",
    "9" * 5000,  # longer than Python converts to int by default
    10**400,
    2**63,
    -1,
    0,
    math.inf,
    -math.inf,
    math.nan,
    1e308,
    "a\udc80",  # a lone surrogate: no UTF-8 form
    "\ud800",
    "a\x00b",  # NUL
    "",
    [],
    {},
    ["host"],  # unhashable where a choice is expected
    None,
    True,
    10**12,  # window: ENOMEM when the engine opened, before
]

ENGINE_KEYS = [
    "window",
    "io_depth",
    "memory_workers",
    "chunk_tokens",
    "policy",
    "deadline_s",
    "breaker_threshold",
    "breaker_cooldown_s",
    "pin_staging",
    "prefault_staging",
    "model_id",
    "tenant",
    "window_checkpoint_chunks",
    "shield_timeout_s",
    "staging_budget_bytes",
]
TIER_KEYS = {
    "host": ["capacity_bytes", "name"],
    "file": [
        "path",
        "capacity_bytes",
        "name",
        "reader",
        "direct_io",
        "fsync",
        "io_threads",
        "read_depth",
    ],
    "mooncake": [
        "name",
        "master_address",
        "metadata_server",
        "protocol",
        "rdma_devices",
        "local_hostname",
        "global_segment_size",
        "local_buffer_size",
        "timeout_s",
        "open_timeout_s",
        "capacity_bytes",
        "key_prefix",
        "max_inflight",
        "max_stuck_calls",
        "bounce_min_bytes",
    ],
    # a kind found through the bsr.tiers entry point, written only against the public seam
    "redis": [
        "url",
        "name",
        "cluster",
        "key_prefix",
        "timeout_s",
        "connect_timeout_s",
        "part_bytes",
        "capacity_bytes",
        "max_inflight",
        "max_stuck_calls",
    ],
}


def _tier(kind: str, root: Path) -> dict[str, Any]:
    if kind == "host":
        return {"kind": "host", "capacity_bytes": "1MiB"}
    if kind == "file":
        return {"kind": "file", "path": str(root / "l2"), "capacity_bytes": "8MiB"}
    if kind == "redis":
        return {"kind": "redis", "url": "redis://127.0.0.1:1/0"}
    return {"kind": "mooncake", "master_address": "127.0.0.1:1"}


def _cases() -> list[tuple[str, str, int]]:
    out = [("engine", k, i) for k in ENGINE_KEYS for i in range(len(HOSTILE))]
    for kind, keys in TIER_KEYS.items():
        out += [(kind, k, i) for k in keys for i in range(len(HOSTILE))]
    return out


#: keys checked when the engine is built, against the layout (chunk_tokens, window's memory) or
#: because the engine needs them (model_id, without a namespace): a ConfigError there is right
BUILD_KEYS = {"chunk_tokens", "window", "model_id", "staging_budget_bytes"}


async def _check_accepted(config: bsr.EngineConfig, kind: str, key: str) -> None:
    """An accepted config builds its engine (and, for host and file tiers, opens it)."""
    layout = two_group_layout()
    try:
        engine = bsr.RestoreEngine.from_config(config, layout=layout)
    except bsr.ConfigError as exc:
        if key not in BUILD_KEYS:
            raise
        assert exc.fields.get("key") == key, exc
        return
    if kind in ("mooncake", "redis") or config.window * layout.slot_bytes > 64 << 20:
        return  # built; opening would dial a server (or allocate a big window)

    async with engine:
        assert engine.statistics().staging.slots == config.window


# one backend (through the plugin): hundreds of hostile values; the parse is under test, not the
# event loop (an engine opens on both backends in tests/engine/test_backends.py)
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("where", "key", "index"), _cases())
async def test_hostile_value_is_accepted_or_a_config_error_naming_the_key(
    tmp_path: Path, where: str, key: str, index: int
) -> None:
    value = HOSTILE[index]
    if key == "path" and isinstance(value, str) and value:
        value = str(tmp_path / value)  # keep relative paths inside the test's directory
    data: dict[str, Any] = {"model_id": "m", "tiers": [_tier("host", tmp_path)]}
    if where == "engine":
        data[key] = value
        full_key = key
    else:
        data["tiers"] = [{**_tier(where, tmp_path), key: value}]
        full_key = f"tiers[0].{key}"
    try:
        config = bsr.EngineConfig.from_dict(data)
    except bsr.ConfigError as exc:
        assert exc.fields.get("key") == full_key, (exc.fields, str(exc))
        assert full_key in str(exc)
        return
    await _check_accepted(config, where, full_key)


@pytest.mark.parametrize(
    ("value", "key"),
    [
        (BIG, "tiers[0].capacity_bytes"),
        (10**400, "tiers[0].capacity_bytes"),
        (math.inf, "deadline_s"),
        ("a\udc80", "model_id"),
        ("a\udc80", "tenant"),
        ("a\udc80", "tiers[0].name"),
        ("a\x00b", "tiers[0].path"),
        (10**12, "window"),
    ],
    ids=["99..9TiB", "10**400", "inf", "surrogate-model_id", "surrogate-tenant",
         "surrogate-tier-name", "nul-path", "window-10**12"],
)  # fmt: skip
def test_the_reported_values_are_refused_at_parse_time(
    tmp_path: Path, value: Any, key: str
) -> None:
    """The values of the report: each escaped as an untyped error, or only when the engine was
    built or opened (ENOMEM for window=10**12, ValueError for a NUL in a path)."""
    data: dict[str, Any] = {"model_id": "m", "tiers": [_tier("file", tmp_path)]}
    if key.startswith("tiers[0]."):
        data["tiers"][0][key.split(".", 1)[1]] = value
    else:
        data[key] = value
    with pytest.raises(bsr.ConfigError) as ei:
        bsr.EngineConfig.from_dict(data)
    assert ei.value.fields["key"] == key


def test_window_is_bounded_and_checked_against_host_memory() -> None:
    tiers = [{"kind": "host", "capacity_bytes": "1MiB"}]
    with pytest.raises(bsr.ConfigError, match=f"at most {MAX_WINDOW}"):
        bsr.EngineConfig.from_dict({"model_id": "m", "window": MAX_WINDOW + 1, "tiers": tiers})
    # within the count bound, but W x slot bytes beyond this host's memory: refused when the
    # engine is built from the config, before the window is allocated
    config = bsr.EngineConfig.from_dict({"model_id": "m", "window": MAX_WINDOW, "tiers": tiers})
    big = bsr.StateLayout(chunk_tokens=256, groups=(bsr.StateGroup("kv", 64, 1 << 16),))
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    assert MAX_WINDOW * big.slot_bytes > pages * page
    with pytest.raises(bsr.ConfigError) as ei:
        bsr.RestoreEngine.from_config(config, layout=big)
    assert ei.value.fields["key"] == "window" and "memory" in str(ei.value)


def test_deeply_nested_env_and_toml_are_config_errors(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(bsr.ConfigError) as ei:
        bsr.EngineConfig.from_env(environ={"BSR_TIERS": deep, "BSR_MODEL_ID": "m"})
    assert ei.value.fields["key"] == "BSR_TIERS"
    toml = tmp_path / "deep.toml"
    toml.write_text("tiers = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(bsr.ConfigError, match="too deeply"):
        bsr.EngineConfig.from_toml(toml)
    with pytest.raises(bsr.ConfigError) as ei:  # an int too long for int()
        bsr.EngineConfig.from_env(environ={"BSR_WINDOW": "9" * 5000})
    assert ei.value.fields["key"] == "window"


def test_non_utf8_toml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('model_id = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(bsr.ConfigError, match="not UTF-8"):
        bsr.EngineConfig.from_toml(bad)
    with pytest.raises(bsr.ConfigError, match="NUL"):
        bsr.EngineConfig.from_toml(str(tmp_path / "a\x00.toml"))


def test_tier_names_must_be_utf8_everywhere() -> None:
    """A tier name without a UTF-8 form made every Prometheus scrape of the process fail."""
    with pytest.raises(bsr.ConfigError, match="UTF-8"):
        bsr.HostTier(1 << 20, name="l1\udcff")
    with pytest.raises(bsr.ConfigError, match="UTF-8"):
        bsr.FileTier("/nonexistent", 1 << 20, name="\ud800")


def test_metrics_labels_are_always_encodable() -> None:
    """Tier names are checked when tiers are built; a label that slipped past anyway (a name
    assigned later) is escaped, so one bad name never makes the whole registry unscrapeable."""
    prometheus_client = pytest.importorskip("prometheus_client")
    import bsr.metrics

    registry = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter("t", "t", ["tier"], registry=registry)
    c.labels(bsr.metrics._label("l1\udcff")).inc()
    assert 'tier="l1\\\\udcff"' in prometheus_client.generate_latest(registry).decode()
    engine = bsr.RestoreEngine(two_group_layout(), [bsr.HostTier(1 << 20)], window=1,
                               io_depth=1, namespace=bsr.Namespace("m"))  # fmt: skip
    with pytest.raises(bsr.ConfigError, match="ASCII"):
        bsr.metrics.PrometheusMetrics(engine, registry=registry, prefix="bsr_\u00e9")


# ---------------------------------------------------------------------- the CLI
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BSR_")}
    return subprocess.run(
        [sys.executable, "-m", "bsr", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
    )


TOML_TIER = '[[tiers]]\nkind = "host"\ncapacity_bytes = "1MiB"\n'


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('model_id = "m"\ndeadline_s = inf\n' + TOML_TIER, "deadline_s"),
        ('model_id = "m"\nwindow = 1000000000000\n' + TOML_TIER, "window"),
        (f'model_id = "m"\n[[tiers]]\nkind = "host"\ncapacity_bytes = "{BIG}"\n', "capacity_bytes"),
        ('model_id = "m"\n[[tiers]]\nkind = "file"\npath = "a\\u0000b"\ncapacity_bytes = 1\n',
         "tiers[0].path"),
        (b'model_id = "caf\xe9"\n' + TOML_TIER.encode(), "not UTF-8"),
        ("tiers = " + "[" * 50_000 + "]" * 50_000 + "\n", "too deeply"),
    ],
    ids=["inf", "window-10**12", "99..9TiB", "nul-path", "latin-1", "nested"],
)  # fmt: skip
def test_config_check_exits_2_naming_the_key(tmp_path: Path, body: str | bytes, key: str) -> None:
    path = tmp_path / "bsr.toml"
    if isinstance(body, bytes):
        path.write_bytes(body)
    else:
        path.write_text(body)
    p = _cli("config", "check", str(path))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert key in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.startswith("bsr config: error:")


def test_config_check_from_env_exits_2_naming_the_variable() -> None:
    tiers = json.dumps([{"kind": "host", "capacity_bytes": "1MiB"}])
    for env, var in (
        ({"BSR_TIERS": "[" * 50_000 + "]" * 50_000}, "BSR_TIERS"),
        ({"BSR_TIERS": tiers, "BSR_DEADLINE_S": "Infinity"}, "BSR_DEADLINE_S"),
        ({"BSR_TIERS": '[{"kind": "host", "capacity_bytes": 1, "name": "\\ud800"}]'}, "BSR_TIERS"),
    ):
        p = _cli("config", "check", env=env)
        assert p.returncode == 2, (env, p.stdout, p.stderr)
        assert var in p.stderr and "Traceback" not in p.stderr


def test_config_check_env_with_undecodable_bytes_exits_2() -> None:
    """An environment value that is not UTF-8 reaches Python as lone surrogates."""
    env = {k.encode(): v.encode() for k, v in os.environ.items() if not k.startswith("BSR_")}
    env[b"BSR_TIERS"] = b'[{"kind": "host", "capacity_bytes": "1MiB"}]'
    env[b"BSR_MODEL_ID"] = b"caf\xe9"
    p = subprocess.run(
        [sys.executable, "-m", "bsr", "config", "check"],
        capture_output=True,
        timeout=120,
        env=env,  # type: ignore[arg-type]
    )
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2 and "BSR_MODEL_ID" in err and "Traceback" not in err, err


@pytest.mark.anyio
async def test_store_gc_with_an_absurd_size_exits_2(tmp_path: Path) -> None:
    async def make() -> None:
        async with bsr.FileTier(tmp_path / "s", 1 << 20):
            pass

    await make()
    p = _cli("store", "gc", str(tmp_path / "s"), "--max-bytes", BIG)
    assert p.returncode == 2 and "--max-bytes" in p.stderr and "Traceback" not in p.stderr


def test_every_engine_knob_is_settable_from_the_config_and_reaches_the_engine(
    tmp_path: Path,
) -> None:
    """Found in the house tidy: the config could not set shield_timeout_s or
    staging_budget_bytes (the engine's constructor could). Each comes through a dict, TOML and
    the environment, and a budget the window does not fit in names the key."""
    layout = two_group_layout()
    tiers = [_tier("host", tmp_path)]
    window_bytes = 2 * layout.slot_bytes
    data = {"model_id": "m", "window": 2, "io_depth": 1, "tiers": tiers,
            "shield_timeout_s": 1.5, "staging_budget_bytes": f"{window_bytes * 4}B"}  # fmt: skip
    toml = tmp_path / "bsr.toml"
    toml.write_text(
        'model_id = "m"\nwindow = 2\nio_depth = 1\nshield_timeout_s = 1.5\n'
        f'staging_budget_bytes = "{window_bytes * 4}B"\n'
        '[[tiers]]\nkind = "host"\ncapacity_bytes = "1MiB"\n'
    )
    env = {"BSR_MODEL_ID": "m", "BSR_WINDOW": "2", "BSR_IO_DEPTH": "1",
           "BSR_SHIELD_TIMEOUT_S": "1.5", "BSR_STAGING_BUDGET_BYTES": f"{window_bytes * 4}B",
           "BSR_TIERS": '[{"kind": "host", "capacity_bytes": "1MiB"}]'}  # fmt: skip
    for config in (
        bsr.EngineConfig.from_dict(data),
        bsr.EngineConfig.from_toml(toml),
        bsr.EngineConfig.from_env(environ=env),
    ):
        assert config.shield_timeout_s == 1.5
        assert config.staging_budget_bytes == window_bytes * 4
        assert bsr.EngineConfig.from_dict(config.to_dict()) == config
        engine = bsr.RestoreEngine.from_config(config, layout=layout)
        assert engine.shield_timeout_s == 1.5
        assert engine.staging_budget_bytes == window_bytes * 4
    small = bsr.EngineConfig.from_dict({**data, "staging_budget_bytes": window_bytes - 1})
    with pytest.raises(bsr.ConfigError, match="staging_budget_bytes") as info:
        bsr.RestoreEngine.from_config(small, layout=layout)
    assert info.value.fields["key"] == "staging_budget_bytes"
    for bad in (0, -1.0, float("nan"), "soon"):
        with pytest.raises(bsr.ConfigError, match="shield_timeout_s"):
            bsr.EngineConfig.from_dict({**data, "shield_timeout_s": bad})
