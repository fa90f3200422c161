"""What bsr's wheel holds: the package bsr and only its own files, even from a tree with strays.

The wheel (pyproject.toml, ``[tool.hatch.build.targets.wheel]``) takes the package's files by an
explicit list: every module (``*.py``), the PEP 561 marker ``py.typed`` and the data file the
package reads at run time (the lifecycle spec, ``bsr.core._lifecycle``). An editor's leftovers
under ``src/bsr`` (``kit.py.orig``, ``notes.swp``) must not travel with it.

Usage (``tools/wheel_check.sh``, ``make wheel-check``):
    python tools/wheel_contents.py check WHEEL SRC_PACKAGE  # a built wheel against src/bsr
    python tools/wheel_contents.py strays ROOT  # build from a copy with strays, check that
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: the package's files that are not modules, each needed by an installed bsr
PACKAGE_DATA = ("py.typed", "_spec/request_lifecycle.json")
#: what the copy of the tree needs to build a wheel (``spec``: the lifecycle spec's target)
BUILD_INPUTS = ("pyproject.toml", "README.md", ".gitignore", "src", "spec")
#: stray files planted in the copy, relative to the package; none may reach the wheel
STRAYS = ("kit.py.orig", "notes.swp", "tiers/.file.py.swp", "_spec/draft.json", "core/scratch.txt")


def expected(package: Path) -> set[str]:
    """The wheel's names for ``package`` (src/bsr): its modules and :data:`PACKAGE_DATA`."""
    names = {
        "bsr/" + p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    return names | {f"bsr/{name}" for name in PACKAGE_DATA}


def problems(wheel: Path, package: Path) -> list[str]:
    """What is wrong with ``wheel`` built from ``package``: files missing, or files beyond it."""
    spec_name = "bsr/_spec/request_lifecycle.json"
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}
        spec = z.read(spec_name) if spec_name in names else b""
    infos = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    out = []
    if len(infos) != 1:
        out.append(f"expected one .dist-info folder, found {sorted(infos)}")
    files = {n for n in names if n.split("/", 1)[0] not in infos}
    want = expected(package)
    if missing := sorted(want - files):
        out.append(f"files of the package missing from the wheel: {missing}")
    if extra := sorted(files - want):
        out.append(f"files in the wheel that are not the package's own: {extra}")
    if spec and not spec.lstrip().startswith(b"{"):
        out.append("the lifecycle spec in the wheel is not the JSON file itself (a symlink?)")
    return out


def build_with_strays(root: Path, work: Path, python: str = sys.executable) -> tuple[Path, Path]:
    """Copy ``root``'s build inputs to ``work``, plant :data:`STRAYS`, build a wheel there.

    Returns the wheel and the copy's package folder (``src/bsr``).
    """
    tree = work / "tree"
    tree.mkdir()
    for name in BUILD_INPUTS:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, tree / name, symlinks=True, ignore=_caches)
        else:
            shutil.copy2(src, tree / name)
    package = tree / "src" / "bsr"
    for name in STRAYS:
        (package / name).write_text("not part of bsr\n")
    dist = work / "dist"
    cmd = [python, "-m", "build", "--wheel", "--outdir", str(dist), str(tree)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"building the wheel failed:\n{p.stdout}{p.stderr}")
    (wheel,) = dist.glob("*.whl")
    return wheel, package


def _caches(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("__pycache__", ".mypy_cache", ".ruff_cache")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check a built wheel against the package's folder")
    check.add_argument("wheel", type=Path)
    check.add_argument("package", type=Path, help="src/bsr")
    strays = sub.add_parser("strays", help="build from a copy of ROOT with stray files, check")
    strays.add_argument("root", type=Path)
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bsr-wheel-contents-") as tmp:
        if ns.command == "check":
            wheel, package = ns.wheel, ns.package
        else:
            wheel, package = build_with_strays(ns.root.resolve(), Path(tmp))
            print(f"built {wheel.name} from a copy with {len(STRAYS)} stray files in src/bsr")
        found = problems(wheel, package)
        for line in found:
            print(f"wheel contents: {line}", file=sys.stderr)
        if not found:
            print(f"{wheel.name}: {len(expected(package))} files of the package bsr, nothing else")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
