"""The engine's options are declared once, in ``EngineOptions``.

Found in #55: each knob was written three times (``RestoreEngine.__init__``'s parameters,
``from_config`` forwarding them one by one, ``EngineConfig``'s fields with their own docstrings),
``io_depth <= window`` was checked in two places with two messages and ``shield_timeout_s`` by
two parsers. Now the constructor's signature and the config's knobs are ``EngineOptions``'
fields, and a bad value is refused by one parser with one message wherever it arrives from.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

import bsr
from bsr._check import option_fields
from support.helpers import two_group_layout

#: the engine's own arguments: what it is built from, not how it behaves
OWN = ("layout", "tiers", "namespace", "coordinator", "options")
#: what a config says besides the knobs: its tiers and the namespace's identity
IDENTITY = ("tiers", "chunk_tokens", "model_id", "tenant")

#: a value other than the default for every knob (the round trip must carry each)
NOT_DEFAULT: dict[str, Any] = {
    "window": 6,
    "io_depth": 3,
    "memory_workers": 2,
    "policy": "truncate",
    "deadline_s": 7.5,
    "probe_share": 0.25,
    "pin_staging": False,
    "prefault_staging": False,
    "breaker_threshold": None,
    "breaker_cooldown_s": 0.5,
    "shield_timeout_s": 2.5,
    "staging_budget_bytes": 64 << 20,
    "window_checkpoint_chunks": None,
    "promote": "always",
    "warm_budget_bytes": 1 << 20,
    "warm_concurrency": 3,
}

#: a bad value for every knob
BAD: list[tuple[str, Any, str]] = [
    ("window", 0, "positive int"),
    ("window", 1 << 17, "at most 65536"),
    ("io_depth", True, "positive int"),
    ("memory_workers", 0, "positive int"),
    ("policy", "best_effort", "must be one of"),
    ("deadline_s", -1.0, "> 0"),
    ("probe_share", 0, "> 0"),
    ("probe_share", 2, "at most 1"),
    ("pin_staging", 1, "True or False"),
    ("prefault_staging", "yes", "True or False"),
    ("breaker_threshold", 0, "positive int"),
    ("breaker_cooldown_s", float("nan"), "finite"),
    ("shield_timeout_s", 0, "> 0"),
    ("shield_timeout_s", 1e10, "at most 2,147,483 s"),
    ("staging_budget_bytes", "lots", "byte count"),
    ("window_checkpoint_chunks", 0, "positive int"),
    ("promote", "sometimes", "must be one of"),
    ("warm_budget_bytes", -1, "positive byte count"),
    ("warm_concurrency", 2.5, "positive int"),
]


def _engine(**kwargs: Any) -> bsr.RestoreEngine:
    return bsr.RestoreEngine(
        two_group_layout(), [bsr.HostTier(1 << 20)], namespace=bsr.Namespace("m"), **kwargs
    )


def _config(**kwargs: Any) -> bsr.EngineConfig:
    return bsr.EngineConfig(tiers=(bsr.HostTierOptions(1 << 20),), model_id="m", **kwargs)


def test_the_constructor_takes_exactly_the_options() -> None:
    """The signature help and IDEs show: the engine's own arguments, then every knob with the
    name, order and default of its EngineOptions field, keyword-only."""
    params = dict(inspect.signature(bsr.RestoreEngine).parameters)
    fields = {f.name: f for f in dataclasses.fields(bsr.EngineOptions)}
    assert [n for n in params if n not in OWN] == list(fields)
    for name, f in fields.items():
        assert params[name].default == f.default, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert [params[n].kind for n in ("layout", "tiers")] == [
        inspect.Parameter.POSITIONAL_OR_KEYWORD
    ] * 2
    assert params["namespace"].default is inspect.Parameter.empty
    assert params["namespace"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError, match="windw"):
        _engine(windw=4)


def test_the_config_knobs_are_the_options() -> None:
    """EngineConfig adds its tiers and identity to EngineOptions' fields, declaring no knob
    again: same names, defaults and parsers; each knob documented once, in EngineOptions."""
    assert issubclass(bsr.EngineConfig, bsr.EngineOptions)
    config = option_fields(bsr.EngineConfig)
    options = option_fields(bsr.EngineOptions)
    assert set(config) == set(options) | set(IDENTITY)
    assert [n for n in config if n not in IDENTITY] == list(options)
    for name, f in options.items():
        assert config[name].default == f.default, name
        assert config[name].metadata["parse"] is f.metadata["parse"], name
        assert f"\n        {name}: " in (bsr.EngineOptions.__doc__ or ""), name
        assert f"\n        {name}: " not in (bsr.EngineConfig.__doc__ or ""), name
    assert set(NOT_DEFAULT) == set(options)
    assert {key for key, _, _ in BAD} == set(options)


@pytest.mark.parametrize(("key", "value", "says"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_knob_is_refused_alike_by_the_engine_and_the_config(
    key: str, value: Any, says: str
) -> None:
    """One parser, one message: the engine's constructor, EngineOptions, EngineConfig and its
    dict form refuse the value with the same typed error naming the key."""
    errors = []
    for build in (
        lambda: _engine(**{key: value}),
        lambda: bsr.EngineOptions(**{key: value}),
        lambda: _config(**{key: value}),
        lambda: bsr.EngineConfig.from_dict(
            {"tiers": [{"kind": "host", "capacity_bytes": 1 << 20}], key: value}
        ),
    ):
        with pytest.raises(bsr.ConfigError) as info:
            build()
        errors.append(info.value)
    assert {type(e) for e in errors} == {bsr.ConfigError}
    assert {e.fields["key"] for e in errors} == {key}
    assert len({e.message for e in errors}) == 1, [e.message for e in errors]
    assert key in errors[0].message and says in errors[0].message


@pytest.mark.parametrize(
    ("knobs", "key"),
    [({"window": 2, "io_depth": 3}, "io_depth"), ({"io_depth": 9}, "io_depth")],
)
def test_io_depth_beyond_the_window_has_one_check_and_one_message(
    knobs: dict[str, Any], key: str
) -> None:
    with pytest.raises(bsr.ConfigError) as engine:
        _engine(**knobs)
    with pytest.raises(bsr.ConfigError) as config:
        _config(**knobs)
    with pytest.raises(bsr.ConfigError) as parsed:
        bsr.EngineConfig.from_dict({"tiers": [{"kind": "host", "capacity_bytes": 4096}], **knobs})
    assert engine.value.message == config.value.message == parsed.value.message
    assert engine.value.fields["key"] == config.value.fields["key"] == key
    assert "io_depth: must be at most window=" in engine.value.message


def test_a_config_round_trips_every_knob_into_the_engine() -> None:
    """Every knob set away from its default: the engine from_config builds has each one (as
    its options and as its attributes), and the config's dict form reads back equal."""
    defaults = bsr.EngineOptions()
    for name, value in NOT_DEFAULT.items():
        assert getattr(defaults, name) != value, name  # else the round trip proves nothing
    config = bsr.EngineConfig.from_dict(
        {"tiers": [{"kind": "host", "capacity_bytes": "1MiB"}], "model_id": "m", **NOT_DEFAULT}
    )
    engine = bsr.RestoreEngine.from_config(config, layout=two_group_layout())
    assert engine.options == bsr.EngineOptions(**NOT_DEFAULT) == config.engine_options()
    assert type(engine.options) is bsr.EngineOptions
    for name, value in NOT_DEFAULT.items():
        assert getattr(engine.options, name) == value, name
    assert (engine.window, engine.io_depth, engine.memory_workers) == (6, 3, 2)
    assert engine.policy is bsr.Policy.TRUNCATE and engine.deadline_s == 7.5
    assert (engine.pin_staging, engine.prefault_staging) == (False, False)
    assert (engine.shield_timeout_s, engine.staging_budget_bytes) == (2.5, 64 << 20)
    assert engine.window_checkpoint_chunks is None
    assert bsr.EngineConfig.from_dict(config.to_dict()) == config
    assert next(iter(config.to_dict())) == "tiers"


def test_options_can_be_passed_whole_and_a_knob_by_name_overrides() -> None:
    whole = _engine(options=bsr.EngineOptions(window=4, io_depth=2, promote="always"))
    assert whole.options == _engine(window=4, io_depth=2, promote="always").options
    assert (whole.window, whole.io_depth) == (4, 2)
    over = _engine(options=bsr.EngineOptions(window=4, io_depth=2), io_depth=1)
    assert (over.window, over.io_depth) == (4, 1)
    config = _config(window=5, io_depth=5, deadline_s=3.0)
    taken = _engine(options=config)  # a config's knobs (its tiers are not the engine's)
    assert type(taken.options) is bsr.EngineOptions
    assert taken.options == config.engine_options() and taken.deadline_s == 3.0
    with pytest.raises(bsr.ConfigError, match=r"options must be a bsr\.EngineOptions") as info:
        _engine(options={"window": 4})
    assert info.value.fields["key"] == "options"
    with pytest.raises(bsr.ConfigError, match="io_depth: must be at most window=4"):
        _engine(options=bsr.EngineOptions(window=4, io_depth=2), io_depth=5)


def test_the_window_must_fit_the_staging_budget() -> None:
    layout = two_group_layout()
    with pytest.raises(bsr.ConfigError, match="staging_budget_bytes") as info:
        _engine(window=4, io_depth=1, staging_budget_bytes=layout.slot_bytes * 3)
    assert info.value.fields["key"] == "staging_budget_bytes"
    assert _engine(window=4, staging_budget_bytes=layout.slot_bytes * 4).window == 4
