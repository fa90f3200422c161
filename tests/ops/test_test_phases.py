"""tools/test_phases.py, the runner of `make test`'s phases: order, side-by-side groups, the
first failure, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "test_phases.py"


def phases(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *argv], capture_output=True, text=True, timeout=120
    )


def table(out: str) -> dict[str, list[str]]:
    """The closing table: phase name -> its other columns."""
    rows = out.split("=== make test: time per phase", 1)[1].splitlines()[1:]
    parsed = {}
    for row in rows:
        name, _, rest = row.strip().partition("  ")
        parsed[name.strip()] = rest.split()
    return parsed


def test_phases_run_in_order_and_the_table_names_each_with_its_summary() -> None:
    done = phases(
        "one=echo '3 passed, 1 skipped in 0.50s'",
        "two=echo second",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.index("=== one:") < done.stdout.index("=== two:")
    rows = table(done.stdout)
    assert rows["one"][1:] == ["3", "passed,", "1", "skipped"]
    assert rows["two"][1:] == []
    assert rows["total"][-1] == "ok"


def test_a_plus_phase_runs_alongside_the_one_before(tmp_path: Path) -> None:
    """Each of the two waits for the other's file: in turn they would wait forever (the
    timeout ends them with exit 1)."""
    a, b = tmp_path / "a", tmp_path / "b"
    wait = "for i in $(seq 200); do test -e {f} && exit 0; sleep 0.05; done; exit 1"
    done = phases(
        f"left=touch {a}; {wait.format(f=b)}",
        f"+right=touch {b}; {wait.format(f=a)}",
        "after=echo after",
    )
    assert done.returncode == 0, done.stdout
    rows = table(done.stdout)
    assert set(rows) == {"left (||)", "right (||)", "after", "total"}
    assert done.stdout.index("=== after:") > done.stdout.index("=== left:")
    assert done.stdout.index("=== after:") > done.stdout.index("=== right:")


def test_the_first_failed_group_ends_the_run_with_its_status() -> None:
    done = phases("ok=true", "bad=exit 3", "+beside=echo beside", "later=echo later")
    assert done.returncode == 3
    rows = table(done.stdout)
    assert rows["bad (||)"][-2:] == ["exit", "3"]
    assert rows["beside (||)"][-1] != "run"  # it ran, beside the failure
    assert rows["later"] == ["-", "not", "run"]
    assert "=== later:" not in done.stdout
    assert rows["total"][-1] == "FAILED"


@pytest.mark.parametrize("arg", ["nocommand", "=true", "+first=true"])
def test_a_malformed_phase_exits_2_saying_what_was_expected(arg: str) -> None:
    done = phases(arg)
    assert done.returncode == 2
    assert "NAME=COMMAND" in done.stderr or "nothing to run alongside" in done.stderr
