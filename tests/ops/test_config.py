"""EngineConfig: from_dict / from_toml / from_env, validation naming the key, from_config."""

from __future__ import annotations

from pathlib import Path

import pytest

import bsr
from support.helpers import filled_cache, tokens_for, two_group_layout


def _dict(tmp_path: Path) -> dict[str, object]:
    return {
        "window": 4,
        "io_depth": 2,
        "model_id": "m@1",
        "tiers": [
            {"kind": "host", "capacity_bytes": "16MiB"},
            {"kind": "file", "path": str(tmp_path / "l2"), "capacity_bytes": "1GB"},
        ],
    }


def test_from_dict_parses_sizes_and_round_trips(tmp_path: Path) -> None:
    c = bsr.EngineConfig.from_dict(_dict(tmp_path))
    assert c.window == 4 and c.io_depth == 2 and c.policy == "all_or_nothing"
    host, file = c.tiers
    assert isinstance(host, bsr.HostTierOptions) and host.capacity_bytes == 16 << 20
    assert isinstance(file, bsr.FileTierOptions) and file.capacity_bytes == 10**9
    assert bsr.EngineConfig.from_dict(c.to_dict()) == c
    tiers = c.build_tiers()
    assert [type(t) for t in tiers] == [bsr.HostTier, bsr.FileTier]
    assert tiers[1].capacity_bytes == 10**9  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("patch", "key", "hint"),
    [
        ({"windw": 4}, "windw", "did you mean 'window'"),
        ({"window": 0}, "window", "positive int"),
        ({"io_depth": 9}, "io_depth", "at most window=4"),
        ({"policy": "some"}, "policy", "truncate"),
        ({"deadline_s": -1}, "deadline_s", "> 0"),
        ({"tiers": []}, "tiers", "at least one tier"),
        ({"tiers": [{"kind": "ssd"}]}, "tiers[0].kind", "'file'"),
        (
            {"tiers": [{"kind": "host", "capacity_bytes": "8 gigs"}]},
            "tiers[0].capacity_bytes",
            "64GiB",
        ),
        ({"tiers": [{"kind": "host"}]}, "tiers[0].capacity_bytes", "required"),
        ({"tiers": [{"kind": "host", "capacity_bytes": 1, "nme": "x"}]}, "tiers[0].nme", "'name'"),
        (
            {
                "tiers": [
                    {"kind": "host", "capacity_bytes": 1},
                    {"kind": "host", "capacity_bytes": 1},
                ]
            },
            "tiers[1].name",
            "own name",
        ),
        ({"tiers": [{"kind": "mooncake"}]}, "tiers[0].master_address", "exactly one"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, patch: dict[str, object], key: str, hint: str) -> None:
    d = {**_dict(tmp_path), **patch}
    with pytest.raises(bsr.ConfigError) as ei:
        bsr.EngineConfig.from_dict(d)
    assert ei.value.fields["key"] == key
    assert key in str(ei.value) and hint in str(ei.value)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(bsr.ConfigError, match="window"):
        bsr.EngineConfig(tiers=(bsr.HostTierOptions(1 << 20),), window=-1)
    with pytest.raises(bsr.ConfigError, match="capacity_bytes"):
        bsr.HostTierOptions("lots")  # type: ignore[arg-type]
    c = bsr.EngineConfig(tiers=(bsr.HostTierOptions("1MiB"),))  # type: ignore[arg-type]
    assert c.tiers[0].capacity_bytes == 1 << 20


def test_from_toml_bsr_table_and_top_level(tmp_path: Path) -> None:
    text = """
window = 6
io_depth = 3
model_id = "llama@rev"
tenant = "acme"
deadline_s = 2.5
[[tiers]]
kind = "host"
capacity_bytes = "8GiB"
[[tiers]]
kind = "file"
path = "/nvme/bsr"
capacity_bytes = 500_000_000_000
direct_io = true
"""
    top = tmp_path / "top.toml"
    top.write_text(text)
    nested = tmp_path / "nested.toml"
    nested.write_text("[other]\nx = 1\n[bsr]\n" + text.replace("[[tiers]]", "[[bsr.tiers]]"))
    a = bsr.EngineConfig.from_toml(top)
    b = bsr.EngineConfig.from_toml(nested)
    assert a == b
    assert a.window == 6 and a.deadline_s == 2.5 and a.tenant == "acme"
    assert a.tiers[1] == bsr.FileTierOptions("/nvme/bsr", 500 * 10**9, direct_io=True)
    bad = tmp_path / "bad.toml"
    bad.write_text("window = [\n")
    with pytest.raises(bsr.ConfigError, match="not valid TOML"):
        bsr.EngineConfig.from_toml(bad)
    with pytest.raises(bsr.ConfigError, match="cannot read"):
        bsr.EngineConfig.from_toml(tmp_path / "missing.toml")


def test_from_env() -> None:
    env = {
        "BSR_WINDOW": "8",
        "BSR_IO_DEPTH": "4",
        "BSR_POLICY": "truncate",
        "BSR_MODEL_ID": "123",  # a string key stays a string
        "BSR_DEADLINE_S": "0.5",
        "BSR_BREAKER_THRESHOLD": "null",
        "BSR_TIERS": '[{"kind": "host", "capacity_bytes": "8GiB"}]',
        "BSR_CAMPAIGN": "long",  # another tool's variable: ignored unless strict
        "PATH": "/bin",
    }
    c = bsr.EngineConfig.from_env(environ=env)
    assert (c.window, c.io_depth, c.policy, c.model_id) == (8, 4, "truncate", "123")
    assert c.deadline_s == 0.5 and c.breaker_threshold is None
    assert c.tiers == (bsr.HostTierOptions(8 << 30),)
    with pytest.raises(bsr.ConfigError, match="BSR_CAMPAIGN"):
        bsr.EngineConfig.from_env(environ=env, strict=True)
    with pytest.raises(bsr.ConfigError, match=r"BSR_TIERS.*JSON"):
        bsr.EngineConfig.from_env(environ={"BSR_TIERS": "host"})
    with pytest.raises(bsr.ConfigError, match="BSR_WINDOW: window"):
        bsr.EngineConfig.from_env(environ={**env, "BSR_WINDOW": "eight"})
    with pytest.raises(bsr.ConfigError, match=r"BSR_TIERS: tiers\[0\]\.capacity_bytes"):
        bsr.EngineConfig.from_env(environ={"BSR_TIERS": '[{"kind": "host", "capacity_bytes": 0}]'})
    mine = bsr.EngineConfig.from_env(
        prefix="APP_BSR_", environ={"APP_BSR_TIERS": '[{"kind": "host", "capacity_bytes": 4096}]'}
    )
    assert mine.window == 8


@pytest.mark.anyio
async def test_engine_from_config_restores(tmp_path: Path) -> None:
    layout = two_group_layout()
    config = bsr.EngineConfig.from_dict(
        {**_dict(tmp_path), "chunk_tokens": layout.chunk_tokens, "deadline_s": 30}
    )
    engine = bsr.RestoreEngine.from_config(config, layout=layout)
    assert engine.window == 4 and engine.io_depth == 2 and engine.deadline_s == 30
    assert engine.namespace == bsr.Namespace("m@1")
    assert [t.name for t in engine.tiers] == ["host", "file"]
    n = 3 * layout.chunk_tokens
    src = filled_cache(layout, 32, 8)
    ids = list(range(n // 8))

    async with engine:
        await engine.save(tokens_for(n), src, ids)
        dst = bsr.PagedKVCache(layout, 32, 8)
        r = await engine.restore(tokens_for(n), dst, ids)
        assert r.committed and r.committed_tokens == n

    assert (tmp_path / "l2" / "objects").is_dir()


def test_engine_from_config_namespace_rules(tmp_path: Path) -> None:
    layout = two_group_layout()
    base = _dict(tmp_path)
    with pytest.raises(bsr.ConfigError, match="chunk_tokens") as ei:
        bsr.RestoreEngine.from_config(
            bsr.EngineConfig.from_dict({**base, "chunk_tokens": 64}), layout=layout
        )
    assert ei.value.fields["key"] == "chunk_tokens"
    no_model = {k: v for k, v in base.items() if k != "model_id"}
    with pytest.raises(bsr.ConfigError, match="model_id"):
        bsr.RestoreEngine.from_config(bsr.EngineConfig.from_dict(no_model), layout=layout)
    eng = bsr.RestoreEngine.from_config(
        bsr.EngineConfig.from_dict(no_model), layout=layout, namespace=bsr.Namespace("x")
    )
    assert eng.namespace.model_id == "x"
    with pytest.raises(bsr.ConfigError, match=r"namespace\.model_id"):
        bsr.RestoreEngine.from_config(
            bsr.EngineConfig.from_dict(base), layout=layout, namespace=bsr.Namespace("x")
        )
    tenant = bsr.RestoreEngine.from_config(
        bsr.EngineConfig.from_dict({**base, "tenant": "acme"}), layout=layout
    )
    assert tenant.namespace.salt == b"acme"
    # an explicit namespace must carry the config's tenant: another salt would share prefixes
    acme = bsr.EngineConfig.from_dict({**no_model, "tenant": "acme"})
    for other in (bsr.Namespace("x"), bsr.Namespace("x", salt=b"globex")):
        with pytest.raises(bsr.ConfigError, match="tenant") as ei:
            bsr.RestoreEngine.from_config(acme, layout=layout, namespace=other)
        assert ei.value.fields["key"] == "tenant"
    same = bsr.RestoreEngine.from_config(
        acme, layout=layout, namespace=bsr.Namespace("x", salt=b"acme")
    )
    assert same.namespace.salt == b"acme"
    group = bsr.InProcessGroup(2)
    ranked = bsr.RestoreEngine.from_config(
        bsr.EngineConfig.from_dict(base), layout=layout, coordinator=group.coordinator(1)
    )
    assert (ranked.namespace.tp_rank, ranked.namespace.tp_size) == (1, 2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64GiB", 64 << 30), ("1.5 KiB", 1536), ("500mb", 500 * 10**6), (7, 7)],
)
def test_byte_sizes(text: object, expected: int) -> None:
    c = bsr.HostTierOptions(text)  # type: ignore[arg-type]
    assert c.capacity_bytes == expected


@pytest.mark.parametrize("bad", ["1.5B", "-3", "12 parsecs", True, 0, 2.0])
def test_bad_byte_sizes(bad: object) -> None:
    with pytest.raises(bsr.ConfigError, match="capacity_bytes"):
        bsr.HostTierOptions(bad)  # type: ignore[arg-type]


def test_bsr_config_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from bsr.cli import main

    good = tmp_path / "bsr.toml"
    good.write_text(
        '[bsr]\nmodel_id = "m"\n[[bsr.tiers]]\nkind = "host"\ncapacity_bytes = "1MiB"\n'
    )
    assert main(["config", "check", str(good)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert bsr.EngineConfig.from_dict(printed) == bsr.EngineConfig.from_toml(good)
    assert printed["tiers"][0]["capacity_bytes"] == 1 << 20
    bad = tmp_path / "bad.toml"
    bad.write_text('windw = 3\n[[tiers]]\nkind = "host"\ncapacity_bytes = 1\n')
    assert main(["config", "check", str(bad)]) == 2
    assert "did you mean 'window'" in capsys.readouterr().err
    monkeypatch.setenv("BSR_TIERS", '[{"kind": "host", "capacity_bytes": 4096}]')
    monkeypatch.setenv("BSR_WINDOW", "3")
    monkeypatch.setenv("BSR_IO_DEPTH", "2")
    assert main(["config", "check"]) == 0
    assert json.loads(capsys.readouterr().out)["window"] == 3
