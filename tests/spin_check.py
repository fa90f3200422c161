"""Run spin on a Promela model from a test: find the tools, build pan, run it, read its report.

Import with ``from spin_check import ...`` (``tests/`` is on pytest's ``pythonpath``). A test
that needs spin calls :func:`tools`: without spin or a C compiler it skips, except under
``CI=true``, where it fails (CI must run the model checks).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

SPIN_TIMEOUT_S = 60.0
CC_TIMEOUT_S = 180.0
#: a hang guard, not a bound: the longest search (the connector model's liveness run) takes
#: about 30 s of CPU, and ran past 300 s of wall time on this 2-core machine at load average 17
PAN_TIMEOUT_S = 1200.0
#: pytest-timeout for tests that run pan (pyproject's 600 s would end them first)
PAN_TEST_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Tools:
    spin: str
    cc: str


@functools.cache
def find_tools() -> Tools | None:
    spin = shutil.which("spin")
    cc = shutil.which("gcc") or shutil.which("cc")
    return None if spin is None or cc is None else Tools(spin=spin, cc=cc)


def tools(model: str) -> Tools:
    """spin and a C compiler, or skip the test; under ``CI=true``, fail it instead."""
    found = find_tools()
    if found is None:
        msg = (
            f"spin or gcc/cc not on PATH: the Promela model {model} cannot be verified "
            "(`make system-deps` installs both: `apt-get install spin gcc`)"
        )
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"CI=true, so this is a failure, not a skip: {msg}")
        pytest.skip(msg)
    return found


@dataclass(frozen=True)
class PanRun:
    """What one pan run printed, and how long it searched."""

    output: str
    seconds: float

    @property
    def errors(self) -> int:
        m = re.search(r"errors: (\d+)", self.output)
        assert m is not None, f"no 'errors:' line in pan output:\n{self.output}"
        return int(m.group(1))

    def stat(self, name: str) -> int:
        m = re.search(rf"(\d+) {name}", self.output)
        assert m is not None, f"no '{name}' in pan output"
        return int(m.group(1))

    @property
    def depth(self) -> int:
        m = re.search(r"depth reached (\d+)", self.output)
        assert m is not None, "no depth in pan output"
        return int(m.group(1))

    @property
    def first_violation(self) -> str | None:
        """The first error pan reported (``pan:1: ...``), if any."""
        m = re.search(r"pan:1: (.*)", self.output)
        return None if m is None else m.group(1)

    @property
    def complete(self) -> bool:
        """A full search: nothing cut off by the depth limit or memory."""
        return (
            "Full statespace search" in self.output
            and "Search not completed" not in self.output
            and "max search depth too small" not in self.output
        )


def run(argv: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv)} ran over {timeout:.0f} s: {exc}")


def build_pan(
    found: Tools, model_text: str, workdir: Path, cflags: Sequence[str], name: str
) -> Path:
    """Write ``model_text`` to ``workdir/name``, generate pan.c with spin and compile it."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / name).write_text(model_text)
    gen = run([found.spin, "-a", name], workdir, SPIN_TIMEOUT_S)
    assert gen.returncode == 0 and (workdir / "pan.c").exists(), (
        f"spin -a failed:\n{gen.stdout}\n{gen.stderr}"
    )
    # -w: pan.c trips gcc's -Wstringop-overflow on array indexing; harmless.
    cc = run([found.cc, "-w", *cflags, "-o", "pan", "pan.c"], workdir, CC_TIMEOUT_S)
    assert cc.returncode == 0, f"compiling pan.c failed:\n{cc.stdout}\n{cc.stderr}"
    return workdir / "pan"


def run_pan(pan: Path, args: Sequence[str] = ()) -> PanRun:
    start = time.monotonic()
    proc = run([str(pan), *args], pan.parent, PAN_TIMEOUT_S)
    return PanRun(output=proc.stdout + proc.stderr, seconds=time.monotonic() - start)


def pan(
    found: Tools,
    model_text: str,
    workdir: Path,
    cflags: Sequence[str],
    args: Sequence[str] = (),
    name: str = "model.pml",
) -> PanRun:
    """Build pan for ``model_text`` and run it once."""
    return run_pan(build_pan(found, model_text, workdir, cflags, name), args)


@dataclass(frozen=True)
class Mutation:
    """A plausible bug written into a model as exact text edits, and what must catch it."""

    edits: tuple[tuple[str, str], ...]  # (exact text, replacement), each text unique
    expect: str  # regex the first violation pan reports must match
    doc: str
    liveness: bool = False  # caught by an ltl claim (a run that never ends), not an assertion


def mutate(text: str, mutation: Mutation) -> str:
    """``text`` with the mutation's edits applied; each anchor must occur exactly once."""
    for old, new in mutation.edits:
        count = text.count(old)
        assert count == 1, f"mutation anchor found {count} times (model changed?): {old!r}"
        text = text.replace(old, new)
    return text
