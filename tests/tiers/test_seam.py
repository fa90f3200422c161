"""The public tier seam: the object codec, abandonable calls, the tier-kind registry and the one
option vocabulary that constructors and configs share."""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import bsr
from bsr.redis import RedisTier, RedisTierOptions
from bsr.testing import TierConformance, make_keys, payload
from support.helpers import two_group_layout

KEYS = make_keys(4)


# ------------------------------------------------------------------ codec
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n", [0, 1, 4096, 3 * 4096 + 5])
def test_codec_round_trip(n: int, padded: bool) -> None:
    okey = bsr.ObjectKey(KEYS[0], "kv")
    blob = bsr.ObjectCodec.encode(okey, payload(1, n).tobytes(), padded=padded)
    assert len(blob) == bsr.ObjectCodec.stored_size(n, padded=padded)
    dst = np.zeros(n + 64, dtype=np.uint8)
    assert bsr.ObjectCodec.decode_into(blob, okey, dst) == n
    assert dst[:n].tobytes() == payload(1, n).tobytes() and not dst[n:].any()
    room = np.zeros(bsr.ObjectCodec.stored_size(n), dtype=np.uint8)
    assert bsr.ObjectCodec.encode_into(okey, payload(1, n), room) == len(room)
    assert room.tobytes() == bsr.ObjectCodec.encode(okey, payload(1, n).tobytes())


def test_codec_never_hands_out_unverified_bytes() -> None:
    okey = bsr.ObjectKey(KEYS[0], "kv")
    good = bytearray(bsr.ObjectCodec.encode(okey, payload(2, 8192).tobytes()))
    dst = np.zeros(8192, dtype=np.uint8)
    bad = bytearray(good)
    bad[bsr.ObjectCodec.HEADER_SIZE + 100] ^= 1
    with pytest.raises(bsr.CorruptObjectError):
        bsr.ObjectCodec.decode_into(bytes(bad), okey, dst)
    assert not dst.any()  # verified before the copy
    with pytest.raises(bsr.TruncatedObjectError):
        bsr.ObjectCodec.decode_into(bytes(good[:-1]), okey, dst)
    with pytest.raises(bsr.ForeignObjectError):
        bsr.ObjectCodec.decode_into(bytes(good), bsr.ObjectKey(KEYS[1], "kv"), dst)
    with pytest.raises(bsr.ConfigError, match="destination holds 4096 bytes"):
        bsr.ObjectCodec.decode_into(bytes(good), okey, np.zeros(4096, dtype=np.uint8))
    assert not dst.any()


# ------------------------------------------------------------------ abandonable calls
@pytest.mark.anyio
async def test_abandoned_call_returns_at_once_and_releases_when_the_worker_returns() -> None:
    gate = threading.Event()
    released: list[str] = []
    abandons: list[int] = []
    calls = bsr.AbandonableCalls(
        limiter=anyio.CapacityLimiter(1), max_stuck=1, on_abandon=lambda: abandons.append(1)
    )
    ran: list[str] = []
    with anyio.move_on_after(0.2) as scope:
        await calls.run(gate.wait, release=lambda: released.append("hung"))
    assert scope.cancelled_caught
    assert calls.stuck == 1 and abandons == [1] and released == []  # still running
    # max_stuck reached: the next call fails fast and releases what it was given
    with pytest.raises(bsr.TierIOError, match="abandoned blocking calls"):
        await calls.run(lambda: ran.append("x"), release=lambda: released.append("refused"))
    assert released == ["refused"] and ran == []
    gate.set()
    with anyio.fail_after(30):
        while calls.stuck:  # noqa: ASYNC110 - the worker returns once the gate opens
            await anyio.sleep(0.01)
    assert released == ["refused", "hung"]  # released exactly once, by the worker
    assert await calls.run(lambda: 7, release=lambda: released.append("ok")) == 7
    assert released == ["refused", "hung"]  # a normal return releases nothing


@pytest.mark.anyio
async def test_call_cancelled_before_it_starts_never_runs() -> None:
    gate = threading.Event()
    ran: list[int] = []
    released: list[int] = []
    calls = bsr.AbandonableCalls(limiter=anyio.CapacityLimiter(1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(calls.run, gate.wait)  # holds the one worker token
        await anyio.sleep(0.05)
        with anyio.move_on_after(0.1):
            await calls.run(lambda: ran.append(1), release=lambda: released.append(1))
        assert released == [1]  # never started: released at once
        gate.set()
    await anyio.sleep(0.05)
    assert ran == []


# ------------------------------------------------------------------ options written once
TIERS = [
    (bsr.HostTier, bsr.HostTierOptions),
    (bsr.FileTier, bsr.FileTierOptions),
    (bsr.MooncakeTier, bsr.MooncakeTierOptions),
    (RedisTier, RedisTierOptions),
]


@pytest.mark.parametrize(("tier", "options"), TIERS, ids=lambda x: getattr(x, "__name__", ""))
def test_constructor_takes_exactly_the_options(tier: type[bsr.Tier], options: type[Any]) -> None:
    """The signature help and IDEs show is the options class's: same names in the same order,
    the same defaults, keyword-only where the options are (after ``_: KW_ONLY``)."""
    params = dict(inspect.signature(tier).parameters)
    fields = {f.name: f for f in dataclasses.fields(options)}
    assert list(params) == list(fields)
    for name, p in params.items():
        f = fields[name]
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == default, name
        keyword_only = p.kind is inspect.Parameter.KEYWORD_ONLY
        assert keyword_only == f.kw_only and p.kind is not inspect.Parameter.POSITIONAL_ONLY, name
    assert any(f.kw_only for f in fields.values())  # every tier keeps its keyword-only options


def test_the_constructor_builds_and_checks_its_options(tmp_path: Path) -> None:
    tier = bsr.FileTier(tmp_path / "t", "2MiB", name="f", io_threads=3)  # type: ignore[arg-type]
    assert tier.options == bsr.FileTierOptions(str(tmp_path / "t"), 2 << 20, name="f", io_threads=3)
    assert (tier.capacity_bytes, tier.io_threads, tier.name) == (2 << 20, 3, "f")
    with pytest.raises(bsr.ConfigError, match="io_threads") as err:
        bsr.FileTier(tmp_path / "u", 1 << 20, io_threads=0)
    assert err.value.fields["key"] == "io_threads"
    with pytest.raises(TypeError):
        bsr.HostTier(1 << 20, "named")  # type: ignore[misc]  # name is keyword-only
    with pytest.raises(TypeError, match="nmae"):
        bsr.HostTier(1 << 20, nmae="x")  # type: ignore[call-arg]


def test_a_reader_instance_is_taken_as_is_and_has_no_plain_form(tmp_path: Path) -> None:
    reader = bsr.PosixReader()
    tier = bsr.FileTier(tmp_path / "t", 1 << 20, reader=reader)
    assert tier.reader is reader and tier.options.reader is reader
    with pytest.raises(bsr.ConfigError, match="reader: an ObjectReader instance") as err:
        tier.options.to_dict()
    assert err.value.fields["key"] == "reader"
    assert bsr.FileTier(tmp_path / "u", 1 << 20).options.to_dict()["reader"] == "auto"
    with pytest.raises(bsr.ConfigError, match=r"reader: must be one of"):
        bsr.FileTier(tmp_path / "v", 1 << 20, reader=42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("host", "capacity_bytes", "lots"),
        ("host", "capacity_bytes", True),
        ("file", "io_threads", 0),
        ("file", "reader", "mmap"),
        ("file", "fsync", 1),
        ("mooncake", "timeout_s", math.inf),
        ("mooncake", "protocol", "udp"),
        ("mooncake", "max_stuck_calls", -1),
    ],
)
def test_constructor_and_config_refuse_alike(
    tmp_path: Path, kind: str, key: str, value: Any
) -> None:
    base: dict[str, Any] = {
        "host": {"capacity_bytes": 1 << 20},
        "file": {"path": str(tmp_path / "f"), "capacity_bytes": 1 << 20},
        "mooncake": {"master_address": "127.0.0.1:1"},
    }[kind]
    with pytest.raises(bsr.ConfigError) as config:
        bsr.EngineConfig.from_dict({"tiers": [{"kind": kind, **base, key: value}]})
    assert config.value.fields["key"] == f"tiers[0].{key}"
    cls = {"host": bsr.HostTier, "file": bsr.FileTier, "mooncake": bsr.MooncakeTier}[kind]
    with pytest.raises(bsr.ConfigError) as ctor:
        cls(**{**base, key: value})
    assert ctor.value.fields["key"] == key


ENGINE_CASES = [
    ("window", 0),
    ("window", 1 << 17),
    ("io_depth", True),
    ("deadline_s", math.inf),
    ("deadline_s", -1.0),
    ("breaker_cooldown_s", math.nan),
    ("breaker_threshold", 0),
    ("policy", "best_effort"),
    ("pin_staging", 1),
]


@pytest.mark.parametrize(("key", "value"), ENGINE_CASES)
def test_engine_constructor_and_config_refuse_alike(key: str, value: Any) -> None:
    """EngineConfig(deadline_s=inf) parsed and RestoreEngine refused it: now both refuse."""
    with pytest.raises(bsr.ConfigError) as config:
        bsr.EngineConfig(tiers=(bsr.HostTierOptions(1 << 20),), **{key: value})
    assert config.value.fields["key"] == key
    kwargs: dict[str, Any] = {"window": 2, "io_depth": 1, key: value}
    with pytest.raises(bsr.ConfigError) as ctor:
        bsr.RestoreEngine(
            two_group_layout(), [bsr.HostTier(1 << 20)], namespace=bsr.Namespace("m"), **kwargs
        )
    assert ctor.value.fields["key"] == key


# ------------------------------------------------------------------ a third-party kind
class DictTier(bsr.Tier):
    """A tier written only against the public seam: objects in a dict, via the codec (the
    shape of docs/tiers.md's walk-through)."""

    def __init__(self, name: str = "dict") -> None:
        super().__init__(name)
        self.store: dict[str, bytes] = {}

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        self._check_open()
        return [o.object_id in self.store for o in objects]

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        self._check_open()
        okey = bsr.ObjectKey(key, group)
        blob = self.store.get(okey.object_id)
        if blob is None:
            self._count(misses=1)
            raise bsr.ObjectNotFoundError("not stored", tier=self.name)
        got = bsr.ObjectCodec.copy_out(blob, dst)
        self._count(hits=1, reads=1, bytes_read=min(got.nbytes, len(blob) - 4096))
        return got

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        self._check_open()
        okey = bsr.ObjectKey(key, group)
        if okey.object_id in self.store:
            return False
        self.store[okey.object_id] = bsr.ObjectCodec.encode(okey, payload)
        self._count(writes=1, bytes_written=len(bsr.as_payload_view(payload)))
        return True

    async def delete(self, key: bsr.ChunkKey, group: str) -> bool:
        self._check_open()
        return self.store.pop(bsr.ObjectKey(key, group).object_id, None) is not None

    def usage(self) -> bsr.TierUsage:
        return bsr.TierUsage(len(self.store), sum(len(b) for b in self.store.values()))


@dataclass(frozen=True)
class DictTierOptions(bsr.TierOptions):
    kind = "dict"
    name: str = bsr.option(bsr.Check.text, "dict")

    def build(self) -> bsr.Tier:
        return DictTier(self.name)


class TestDictTierConformance(TierConformance):
    """The walk-through's kind of tier (docs/tiers.md: a key-value store read with
    ``ObjectCodec.copy_out``) passes the suite, its bulk read included (the default, item by
    item through its async ``fetch_into``)."""

    supports_capacity = False

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return DictTier()

    async def put_raw(self, tier: bsr.Tier, key: bsr.ChunkKey, group: str, blob: bytes) -> bool:
        assert isinstance(tier, DictTier)
        tier.store[bsr.ObjectKey(key, group).object_id] = blob
        return True

    async def corrupt_object(
        self, tier: bsr.Tier, key: bsr.ChunkKey, group: str, offset: int
    ) -> bool:
        assert isinstance(tier, DictTier)
        oid = bsr.ObjectKey(key, group).object_id
        if oid not in tier.store:
            return False
        raw = bytearray(tier.store[oid])
        raw[offset] ^= 0xFF
        tier.store[oid] = bytes(raw)
        return True

    async def truncate_object(
        self, tier: bsr.Tier, key: bsr.ChunkKey, group: str, size: int
    ) -> bool:
        assert isinstance(tier, DictTier)
        oid = bsr.ObjectKey(key, group).object_id
        tier.store[oid] = tier.store[oid][:size]
        return True


def test_a_registered_kind_works_in_every_config(tmp_path: Path) -> None:
    with pytest.raises(bsr.ConfigError, match="unknown tier kind 'dict'"):
        bsr.EngineConfig.from_dict({"tiers": [{"kind": "dict"}]})
    bsr.register_tier("dict", DictTierOptions)
    try:
        assert "dict" in bsr.tier_kinds()
        with pytest.raises(bsr.ConfigError, match="already registered"):
            bsr.register_tier("dict", DictTierOptions)
        toml = tmp_path / "c.toml"
        toml.write_text('[bsr]\nmodel_id = "m"\n[[bsr.tiers]]\nkind = "dict"\nname = "d"\n')
        config = bsr.EngineConfig.from_toml(toml)
        assert config.tiers == (DictTierOptions(name="d"),)
        assert bsr.EngineConfig.from_dict(config.to_dict()) == config
        with pytest.raises(bsr.ConfigError) as bad:
            bsr.EngineConfig.from_dict({"tiers": [{"kind": "dict", "nmae": "x"}]})
        assert bad.value.fields["key"] == "tiers[0].nmae" and "did you mean 'name'" in str(
            bad.value
        )
        layout = two_group_layout()
        engine = bsr.RestoreEngine.from_config(config, layout=layout)
        assert [type(t) for t in engine.tiers] == [DictTier]
    finally:
        bsr.unregister_tier("dict")
    assert "dict" not in bsr.tier_kinds()


# ------------------------------------------------------------------ hostile plugins
_PLUGINS = {
    "raises": "raise RuntimeError('the plugin cannot start: no licence server')\n",
    "syntax": "def broken(:\n    pass\n",
    "getattr": "def __getattr__(name):\n    raise RuntimeError(f'lazy attribute {name} failed')\n",
}


@pytest.mark.parametrize("how", sorted(_PLUGINS))
def test_a_plugin_that_fails_at_import_is_a_config_error_naming_kind_and_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A tier plugin whose module raises at import, does not parse, or raises on attribute
    access: register_tier, tier_options (through an installed entry point) and EngineConfig
    each raise ConfigError naming the kind and the module (before: the plugin's own
    RuntimeError / SyntaxError escaped untyped)."""
    module = f"bsr_hostile_plugin_{how}"
    (tmp_path / f"{module}.py").write_text(_PLUGINS[how])
    dist = tmp_path / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    kind = f"hostile_{how}"
    (dist / "entry_points.txt").write_text(f"[bsr.tiers]\n{kind} = {module}:Options\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert kind in bsr.tier_kinds()  # the entry point is seen; its module is not imported yet

    with pytest.raises(bsr.ConfigError) as info:
        bsr.register_tier("hostile_by_name", f"{module}:Options")
    assert info.value.fields["kind"] == "hostile_by_name"
    assert info.value.fields["module"] == module and module in str(info.value)
    assert "hostile_by_name" not in bsr.tier_kinds()

    with pytest.raises(bsr.ConfigError) as info:
        bsr.tier_options(kind)
    assert info.value.fields["kind"] == kind and info.value.fields["module"] == module
    assert repr(kind) in str(info.value) and module in str(info.value)

    with pytest.raises(bsr.ConfigError) as info:
        bsr.EngineConfig.from_dict({"tiers": [{"kind": kind}]})
    assert info.value.fields["key"] == "tiers[0].kind"
    assert repr(kind) in str(info.value) and module in str(info.value)
