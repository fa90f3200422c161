"""Run `make test`'s phases, each timed, and print a table of them at the end.

Usage (the Makefile's ``test`` target)::

    python3 tools/test_phases.py "setup=make setup" "+vLLM setup=make .venv-vllm/.bsr-installed" \\
        "main suite=make test-main" "+vLLM tests=make test-vllm" ...

Each argument is ``NAME=COMMAND`` (run by the shell). Phases run in order; a phase whose name
starts with ``+`` runs alongside the phase before it (a group: the suites leave a third of two
cores idle while they wait on engines, servers and timeouts, so two of them side by side finish
sooner than one after the other). A phase that runs alone passes its output through as it comes;
the phases of a group write to their own logs, each printed whole when it ends. The first group
with a failed phase ends the run (its other phases finish): the table still prints, the phases
after it say "not run", and the exit status is the first failed phase's. For a phase that ran
pytest, the table shows its closing summary (``N passed, M skipped``): the last such line it
printed. The total is the wall time of the whole run. Standard library only: it runs before the
virtual environment exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

#: pytest's closing line, e.g. "2791 passed, 130 skipped in 898.28s (0:14:58)"
SUMMARY = re.compile(r"^\d+ \w+(?:, \d+ \w+)* in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b")


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m:d}:{s:02d}"


def summary_of(line: str) -> str | None:
    """``N passed, M skipped`` when ``line`` is pytest's closing line, else None."""
    text = line.strip().strip("=").strip()
    if not SUMMARY.match(text):
        return None
    return ", ".join(f"{n} {what}" for n, what in COUNT.findall(text))


def run_phase(command: str, out: TextIO) -> tuple[int, float, str]:
    """Run ``command`` with its output written to ``out``; its exit status, wall seconds and
    the last pytest summary it printed."""
    start = time.monotonic()
    summary = ""
    with subprocess.Popen(
        command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            summary = summary_of(line) or summary
    return proc.returncode, time.monotonic() - start, summary


def groups_of(argv: list[str]) -> list[list[tuple[str, str]]]:
    """The phases as groups run one after another, each a list of ``(name, command)`` run side
    by side; a ValueError for an argument that is not ``NAME=COMMAND``."""
    groups: list[list[tuple[str, str]]] = []
    for arg in argv:
        name, sep, command = arg.partition("=")
        alongside = name.startswith("+")
        name = name.removeprefix("+").strip()
        if not sep or not name or not command:
            raise ValueError(f"expected NAME=COMMAND or +NAME=COMMAND, got {arg!r}")
        if alongside and not groups:
            raise ValueError(f"{arg!r}: the first phase has nothing to run alongside")
        if alongside:
            groups[-1].append((name, command))
        else:
            groups.append([(name, command)])
    return groups


def run_group(group: list[tuple[str, str]]) -> list[tuple[int, float, str]]:
    """Run the phases of ``group`` side by side; each one's (status, seconds, summary)."""
    if len(group) == 1:
        name, command = group[0]
        print(f"\n=== {name}: {command}", flush=True)
        return [run_phase(command, sys.stdout)]
    results: list[tuple[int, float, str]] = [(0, 0.0, "")] * len(group)
    lock = threading.Lock()
    names = ", ".join(name for name, _ in group)
    print(f"\n=== side by side: {names} (each one's output when it ends)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bsr-test-phases-") as tmp:

        def lane(i: int, name: str, command: str) -> None:
            log = Path(tmp) / f"{i}.log"
            with open(log, "w") as out:
                results[i] = run_phase(command, out)
            with lock:  # one phase's output at a time, whole
                code, seconds, _ = results[i]
                status = "ok" if code == 0 else f"exit {code}"
                print(f"\n=== {name}: {command} ({status} in {_clock(seconds)})", flush=True)
                sys.stdout.write(log.read_text())
                sys.stdout.flush()

        threads = [
            threading.Thread(target=lane, args=(i, name, command), daemon=True)
            for i, (name, command) in enumerate(group)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def main(argv: list[str]) -> int:
    try:
        groups = groups_of(argv)
    except ValueError as e:
        print(f"test_phases: {e}", file=sys.stderr)
        return 2
    rows: list[tuple[str, str, str]] = []
    status = 0
    start = time.monotonic()
    for group in groups:
        if status:
            rows.extend((name, "-", "not run") for name, _ in group)
            continue
        for (name, _), (code, seconds, summary) in zip(group, run_group(group), strict=True):
            status = status or code
            failed = "" if code == 0 else f"exit {code}"
            label = name if len(group) == 1 else f"{name} (||)"
            rows.append((label, _clock(seconds), "; ".join(x for x in (summary, failed) if x)))
    total = time.monotonic() - start
    width = max(len(name) for name, _, _ in [*rows, ("total", "", "")])
    print("\n=== make test: time per phase (m:ss; || ran side by side with its group)")
    for name, clock, note in rows:
        print(f"  {name:<{width}}  {clock:>6}  {note}".rstrip())
    print(f"  {'total':<{width}}  {_clock(total):>6}  {'ok' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
