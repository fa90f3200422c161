"""``bsr config check`` and the file tier roots of a config: a root that does not exist is
noted (FileTier creates it, with its parents, when the engine opens), a root FileTier cannot use
is refused with exit 2. Before: the check printed the config and said nothing, and the example
config's ``/nvme/bsr`` was created, parents and all, at the engine's first open."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

import bsr
from bsr.cli import RootFinding, main, root_findings


def _check(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiers: str) -> tuple[int, str, str]:
    config = tmp_path / "bsr.toml"
    config.write_text('[bsr]\nmodel_id = "m"\n' + tiers)
    code = main(["config", "check", str(config)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _file_tier(path: Path) -> str:
    return f'[[bsr.tiers]]\nkind = "file"\npath = "{path}"\ncapacity_bytes = "1GiB"\n'


def test_a_missing_root_is_noted_with_its_missing_parents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "nvme" / "bsr" / "store"
    code, out, err = _check(tmp_path, capsys, _file_tier(root))
    assert code == 0
    assert json.loads(out)["tiers"][0]["path"] == str(root)  # stdout is still the config
    assert err == (
        f"bsr config: note: tiers[0].path: {root} does not exist; FileTier creates it and its "
        f"missing parents {tmp_path / 'nvme'}, {tmp_path / 'nvme' / 'bsr'} when the engine opens\n"
    )
    assert not (tmp_path / "nvme").exists()  # the check creates nothing


def test_the_note_is_what_the_engine_does(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    config = bsr.EngineConfig.from_dict(
        {"model_id": "m", "tiers": [{"kind": "file", "path": str(root), "capacity_bytes": 1 << 20}]}
    )
    (finding,) = root_findings(config)
    assert finding == RootFinding("tiers[0].path", root, "create", (tmp_path / "a", root))

    async def open_it() -> None:
        layout = bsr.StateLayout(16, (bsr.StateGroup("kv", num_layers=1, token_bytes=8),))
        async with bsr.RestoreEngine.from_config(config, layout=layout):
            pass

    anyio.run(open_it)
    assert root.is_dir() and root_findings(config) == []


def test_an_existing_writable_root_says_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _check(tmp_path, capsys, _file_tier(tmp_path))
    assert (code, err) == (0, "") and json.loads(out)["tiers"][0]["path"] == str(tmp_path)


def test_a_root_that_is_a_file_or_under_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    code, out, err = _check(tmp_path, capsys, _file_tier(plain))
    assert (code, out) == (2, "")
    assert err.startswith(f"bsr config: error: tiers[0].path: {plain} is not a directory;")
    code, out, err = _check(tmp_path, capsys, _file_tier(plain / "store"))
    assert (code, out) == (2, "")
    assert err == (
        f"bsr config: error: tiers[0].path: {plain / 'store'} cannot be created: {plain} is not "
        "a directory; choose another\n"
    )


def test_a_root_this_user_cannot_create_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.access`` answers for the user (root may write anywhere: the answer is patched)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and access(p, mode))
    code, out, err = _check(tmp_path, capsys, _file_tier(locked / "bsr" / "store"))
    assert (code, out) == (2, "")
    assert f"{locked / 'bsr' / 'store'} does not exist and this user" in err
    assert f"{locked} is not writable; create {locked / 'bsr'} for the engine's user" in err
    code, out, err = _check(tmp_path, capsys, _file_tier(locked))
    assert code == 2 and f"tiers[0].path: {locked} is not writable by this user" in err


def test_every_root_of_a_striped_tier_and_relative_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d0").mkdir()
    tiers = (
        '[[bsr.tiers]]\nkind = "host"\ncapacity_bytes = "1MiB"\n'
        '[[bsr.tiers]]\nkind = "striped_file"\npaths = ["d0", "d1"]\ncapacity_bytes = "1GiB"\n'
    )
    code, _, err = _check(tmp_path, capsys, tiers)
    assert code == 0
    assert err == (
        f"bsr config: note: tiers[1].paths[1]: {tmp_path / 'd1'} does not exist; FileTier "
        "creates it when the engine opens\n"
    )
