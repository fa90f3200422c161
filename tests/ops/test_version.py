"""``bsr --version`` and ``bsr.__version__``: the installed distribution's version, one source.

pyproject.toml names the version once; bsr-bench carries the same one and CHANGELOG.md has a
section for it. An install records it in the metadata, which ``bsr.__version__`` reads (on first
use: ``bsr --help`` does not look it up). A source tree that was never installed says
``0+unknown`` rather than a number that may be stale.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import bsr
from support.helpers import bsr_cli

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[2]


def _version(pyproject: Path) -> str:
    version: str = tomllib.loads(pyproject.read_text())["project"]["version"]
    return version


def test_one_version_for_bsr_bench_and_the_changelog() -> None:
    version = _version(ROOT / "pyproject.toml")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert _version(ROOT / "bench" / "pyproject.toml") == version
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\]", changelog, re.M), (
        f"CHANGELOG.md has no '## [{version}]' section"
    )


def test_version_is_the_installed_metadata() -> None:
    installed = metadata.version("bsr-kv")
    assert installed == _version(ROOT / "pyproject.toml"), "reinstall: make setup"
    assert bsr.__version__ == installed
    p = bsr_cli("--version")
    assert p.returncode == 0 and p.stdout == f"bsr {installed}\n", p.stdout + p.stderr


def test_a_source_tree_never_installed_says_unknown(tmp_path: Path) -> None:
    """``python -S``: no site-packages, so no metadata; the package from ``src`` alone."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'src')!r})\n"
        "import bsr, bsr.cli\n"
        "assert 'importlib.metadata' not in sys.modules, 'looked up before it was asked for'\n"
        "print(bsr.__version__)\n"
        "bsr.cli.main(['--version'])\n"
    )
    p = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "0+unknown\nbsr 0+unknown\n"
