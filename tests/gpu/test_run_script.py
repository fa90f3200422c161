"""bench/gpu/run.py's own machinery, without a GPU: the budget, the step limit, the results.

The whole script runs on the CPU in ``make gpu-dry-run`` (part of ``make test``); these tests pin
the parts a dry run within its budget never reaches: a step that does not fit is skipped with a
line saying so, a step past its limit is stopped with its whole process group, and the pytest
report is read back correctly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

RUN_PY = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "run.py"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bsr_gpu_run", RUN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_steps_that_do_not_fit_the_budget_are_skipped_with_a_line(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the running environment (bsr installed) and a budget that leaves ~5 s after the reserve
    argv = ["--dry-run", "--no-install", "--out", str(tmp_path), "--budget-s", "15",
            "--steps", "tests,hcache", "--state-dir", str(tmp_path / "state")]  # fmt: skip
    (tmp_path / "state").mkdir()
    rc = runner.main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[tests] skipped: needs about 25 s" in out
    assert "[hcache] skipped: needs about 60 s" in out
    [doc_path] = tmp_path.glob("gpu-dry-run-cpu-*.json")
    doc = json.loads(doc_path.read_text())
    assert [(s["name"], s["status"]) for s in doc["steps"]] == [
        ("tests", "skipped"),
        ("hcache", "skipped"),
    ]
    assert doc["environment"]["cuda_available"] is False
    assert (tmp_path / "run.log").read_text().count("skipped: needs about") == 2
    assert (tmp_path / "state").is_dir()  # a folder it was given is left alone


def test_a_step_past_its_limit_is_stopped_with_its_children(
    runner: ModuleType, tmp_path: Path
) -> None:
    ns = runner.parse(["--dry-run", "--out", str(tmp_path), "--state-dir", str(tmp_path)])
    run = runner.Run(ns)
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(60)
        """
    )
    try:
        rc, tail = run.execute([sys.executable, "-c", script], 3.0, dict(os.environ))
    finally:
        shutil.rmtree(run.work)
    assert rc == 124
    assert "started" in tail
    child = int(pid_file.read_text())
    assert _ended(child), "the step's own child outlived the step"
    assert "time.sleep(60)" in (tmp_path / "run.log").read_text()


def _ended(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (dead, not yet reaped), waiting up to 10 s."""
    for _ in range(200):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return True
        if fields[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_junit_counts_and_failures(runner: ModuleType, tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        """<testsuites><testsuite>
        <testcase classname="t.a" name="ok"/>
        <testcase classname="t.a" name="bad"><failure message="assert 1 == 2"/></testcase>
        <testcase classname="t.b" name="broken"><error message="boom"/></testcase>
        <testcase classname="t.b" name="skip"><skipped message="needs CUDA"/></testcase>
        </testsuite></testsuites>"""
    )
    got = runner.junit(xml)
    assert {k: got[k] for k in ("tests", "passed", "failed", "skipped")} == {
        "tests": 4,
        "passed": 1,
        "failed": 2,
        "skipped": 1,
    }
    assert [f["test"] for f in got["failures"]] == ["t.a::bad", "t.b::broken"]
    assert got["failures"][0]["message"] == "assert 1 == 2"
