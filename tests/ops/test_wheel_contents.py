"""tools/wheel_contents.py, the wheel check's judge of what bsr's wheel holds, and the include list
it checks (pyproject.toml). The build itself runs in ``make wheel-check`` (it needs hatchling)."""

from __future__ import annotations

import importlib.util
import subprocess
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "bsr"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "wheel_contents", ROOT / "tools" / "wheel_contents.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, names: set[str], spec: bytes = b'{"states": []}\n') -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name in sorted(names):
            z.writestr(name, spec if name.endswith(".json") else b"x = 1\n")
        z.writestr("bsr_kv-0.4.0.dist-info/METADATA", "Name: bsr-kv\n")
    return path


def test_the_package_as_it_is_passes(tool: ModuleType, tmp_path: Path) -> None:
    want = tool.expected(PACKAGE)
    assert {"bsr/__init__.py", "bsr/py.typed", "bsr/_spec/request_lifecycle.json"} <= want
    assert tool.problems(_wheel(tmp_path / "w.whl", want), PACKAGE) == []


@pytest.mark.parametrize("stray", ["bsr/kit.py.orig", "bsr/notes.swp", "tests/test_x.py"])
def test_a_stray_file_in_the_wheel_is_reported(
    tool: ModuleType, tmp_path: Path, stray: str
) -> None:
    wheel = _wheel(tmp_path / "w.whl", tool.expected(PACKAGE) | {stray})
    (problem,) = tool.problems(wheel, PACKAGE)
    assert "not the package's own" in problem and stray in problem


@pytest.mark.parametrize("gone", ["bsr/py.typed", "bsr/_spec/request_lifecycle.json", "bsr/kit.py"])
def test_a_missing_file_is_reported(tool: ModuleType, tmp_path: Path, gone: str) -> None:
    wheel = _wheel(tmp_path / "w.whl", tool.expected(PACKAGE) - {gone})
    (problem,) = tool.problems(wheel, PACKAGE)
    assert "missing from the wheel" in problem and gone in problem


def test_a_spec_that_is_not_the_json_is_reported(tool: ModuleType, tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl", tool.expected(PACKAGE), spec=b"../../../spec/x.json")
    assert tool.problems(wheel, PACKAGE) == [
        "the lifecycle spec in the wheel is not the JSON file itself (a symlink?)"
    ]


def test_the_include_list_is_the_modules_and_the_package_data(tool: ModuleType) -> None:
    """pyproject's wheel include list names exactly what the check expects, and every file of
    the package that git tracks and is not a module is in it (a new data file must be added)."""
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    wheel = wheel["targets"]["wheel"]
    assert "packages" not in wheel, "packages takes every file under src/bsr, whatever include says"
    assert wheel["sources"] == ["src"]
    data = [f"src/bsr/{name}" for name in tool.PACKAGE_DATA]
    assert wheel["include"] == ["src/bsr/**/*.py", *data]
    git = subprocess.run(["git", "ls-files", "src/bsr"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode or not git.stdout.strip():
        pytest.skip("not a git checkout (an unpacked sdist)")
    assert sorted(p for p in git.stdout.split() if not p.endswith(".py")) == sorted(data)
