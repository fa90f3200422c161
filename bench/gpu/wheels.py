"""The wheels carried to a GPU machine that cannot reach a package index (see README.md here).

    python bench/gpu/wheels.py ensure [--dest .whl] [--python-version 3.12 --python-version host]

``download`` asks pip for exactly the pins of requirements.txt and build-requirements.txt (binary
wheels, no dependencies) for each Python version (``host``: the interpreter running this).
``check`` proves, without network, that

* the folder resolves every pin for each version (pip itself, config and index ignored);
* every requirement of bsr (its dependencies and its ``bench`` and ``test`` extras) and of each
  carried wheel is carried or named in target.txt (what the target Python must hold); the build
  wheels' own requirements must all be carried, since pip builds bsr in an isolated environment;
* the working tree plus the folder fit the carry limit (``--limit-mib``, 64 by default).

``ensure`` checks each version, downloads for those that do not resolve, and checks again.
Standard library only, plus ``packaging`` (a dependency of pytest, so in the dev venv).
"""

from __future__ import annotations

import argparse
import email.parser
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip vendors
    from pip._vendor import tomli as tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNTIME = HERE / "requirements.txt"
BUILD = HERE / "build-requirements.txt"
TARGET = HERE / "target.txt"
#: manylinux tags pip accepts for an x86-64 glibc 2.28+ target (pip matches each exactly)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
#: bsr's test extra names these only for `make` targets that never run on the GPU machine (pyzmq
#: and msgspec: the fleet router's socket tests, which skip without them); bsr-kv (bsr itself,
#: which bsr-bench requires) is installed from the tree
NOT_NEEDED_THERE = {"import-linter", "pytest-xdist", "bsr-kv", "pyzmq", "msgspec"}


def names_in(path: Path) -> list[str]:
    """Requirement lines of a requirements file (comments and blanks dropped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def host_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def target_args(version: str) -> list[str]:
    """pip flags selecting wheels for ``version`` (none for the running interpreter)."""
    if version in ("host", host_version()):
        return ["--only-binary=:all:"]
    args = ["--only-binary=:all:", "--python-version", version, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def offline_env() -> dict[str, str]:
    """The environment minus pip's configuration, so only the folder can satisfy a pin."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pip(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


def download(dest: Path, version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    print(f"downloading the pinned wheels for Python {version} into {dest}")
    r = pip(
        [
            "download",
            "--no-deps",
            "-d",
            str(dest),
            *target_args(version),
            "-r",
            str(RUNTIME),
            "-r",
            str(BUILD),
        ]
    )
    if r.returncode:
        sys.exit(f"pip download failed:\n{r.stdout}\n{r.stderr}")


def resolve(dest: Path, version: str, into: Path) -> str | None:
    """Copy the wheels pip picks from ``dest`` for ``version`` into ``into``; None or the error."""
    r = pip(
        [
            "download",
            "--no-index",
            "--find-links",
            str(dest),
            "--no-deps",
            "-d",
            str(into),
            *target_args(version),
            "-r",
            str(RUNTIME),
            "-r",
            str(BUILD),
        ],
        env=offline_env(),
    )
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["pip failed"])[-1]


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(name).decode())


def marker_env(version: str) -> dict[str, str]:
    env = dict(default_environment())
    if version != "host":
        env.update(
            python_version=version,
            python_full_version=f"{version}.0",
            implementation_name="cpython",
            platform_python_implementation="CPython",
            sys_platform="linux",
            os_name="posix",
            platform_machine="x86_64",
        )
    return env


def needs(reqs: list[str], env: dict[str, str]) -> set[str]:
    """Names of the requirements that apply in ``env`` (extras not asked for are dropped)."""
    out = set()
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.add(canonicalize_name(req.name))
    return out


def bsr_requirements() -> list[str]:
    """What bsr (with its test extra) and the bench (bsr-bench, bench/pyproject.toml) need."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    bench = tomllib.loads((REPO / "bench" / "pyproject.toml").read_text())["project"]
    reqs = [
        *project["dependencies"],
        *project["optional-dependencies"]["test"],
        *bench["dependencies"],
    ]
    return [r for r in reqs if canonicalize_name(Requirement(r).name) not in NOT_NEEDED_THERE]


def closure_problems(chosen: list[Path], version: str) -> list[str]:
    env = marker_env(version)
    build_names = {canonicalize_name(Requirement(r).name) for r in names_in(BUILD)}
    carried: dict[str, list[str]] = {}
    for w in chosen:
        meta = metadata(w)
        carried[canonicalize_name(meta["Name"])] = meta.get_all("Requires-Dist") or []
    target = {canonicalize_name(n) for n in names_in(TARGET)}
    problems = []
    for name in sorted(needs(bsr_requirements(), env) - set(carried) - target):
        problems.append(f"bsr needs {name}: neither carried nor in target.txt")
    for name, reqs in sorted(carried.items()):
        have = set(carried) if name in build_names else set(carried) | target
        where = "carried (isolated build)" if name in build_names else "carried nor in target.txt"
        for missing in sorted(needs(reqs, env) - have):
            problems.append(f"{name} needs {missing}: not {where}")
    return problems


def tree_bytes() -> int | None:
    """Bytes of the files that travel with a checkout: tracked plus untracked, not ignored."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for rel in out.decode().split("\0"):
        p = REPO / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def check(dest: Path, versions: list[str], limit_mib: float) -> bool:
    ok = True
    for version in versions:
        with tempfile.TemporaryDirectory() as tmp:
            err = resolve(dest, version, Path(tmp))
            if err is not None:
                print(f"FAIL  Python {version}: {dest} does not resolve every pin: {err}")
                ok = False
                continue
            chosen = sorted(Path(tmp).glob("*.whl"))
            problems = closure_problems(chosen, version)
            for p in problems:
                print(f"FAIL  Python {version}: {p}")
            ok = ok and not problems
            if not problems:
                print(
                    f"ok    Python {version}: {len(chosen)} wheels resolve offline, "
                    "requirements covered"
                )
    wheels = sum(p.stat().st_size for p in dest.glob("*.whl"))
    tree = tree_bytes()
    total = wheels + (tree or 0)
    line = f"{wheels / 2**20:.1f} MiB of wheels in {dest}"
    if tree is not None:
        line += f" + {tree / 2**20:.1f} MiB working tree = {total / 2**20:.1f} MiB"
    if total > limit_mib * 2**20:
        print(f"FAIL  {line}, over the {limit_mib:g} MiB carry limit")
        return False
    print(f"ok    {line} (limit {limit_mib:g} MiB)")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["download", "check", "ensure"])
    p.add_argument("--dest", type=Path, default=REPO / ".whl", help="wheel folder (.whl)")
    p.add_argument(
        "--python-version",
        action="append",
        dest="versions",
        help="target Python, repeatable; 'host' = this one (default 3.12 and host)",
    )
    p.add_argument("--limit-mib", type=float, default=64.0, help="carry limit (default 64)")
    ns = p.parse_args(argv)
    versions = ns.versions or ["3.12", "host"]
    dest = ns.dest.resolve()
    if ns.command == "download":
        for v in versions:
            download(dest, v)
        return 0
    if ns.command == "ensure":
        for v in versions:
            with tempfile.TemporaryDirectory() as tmp:
                if not dest.is_dir() or resolve(dest, v, Path(tmp)) is not None:
                    download(dest, v)
    return 0 if check(dest, versions, ns.limit_mib) else 1


if __name__ == "__main__":
    sys.exit(main())
