"""Run `make test`'s phases in order, each timed, and print a table of them at the end.

Usage (the Makefile's ``test`` target)::

    python3 tools/test_phases.py "setup=make setup system-deps" "main suite=make test-main" ...

Each argument is ``NAME=COMMAND`` (run by the shell, output passed through as it comes). The
first phase that fails ends the run: the table still prints, the phases after it say "not run",
and the exit status is that phase's. For a phase that ran pytest, the table shows its closing
summary (``N passed, M skipped``): the last such line the phase printed. Standard library only:
it runs before the virtual environment exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

#: pytest's closing line, e.g. "2791 passed, 130 skipped in 898.28s (0:14:58)"
SUMMARY = re.compile(r"^\d+ \w+(?:, \d+ \w+)* in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b")


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m:d}:{s:02d}"


def run_phase(command: str) -> tuple[int, float, str]:
    """Run ``command``; its exit status, wall seconds and the last pytest summary it printed."""
    start = time.monotonic()
    summary = ""
    with subprocess.Popen(
        command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            text = line.strip().strip("=").strip()
            if SUMMARY.match(text):
                summary = ", ".join(f"{n} {what}" for n, what in COUNT.findall(text))
    return proc.returncode, time.monotonic() - start, summary


def main(argv: list[str]) -> int:
    phases = []
    for arg in argv:
        name, sep, command = arg.partition("=")
        if not sep or not name or not command:
            print(f"test_phases: expected NAME=COMMAND, got {arg!r}", file=sys.stderr)
            return 2
        phases.append((name, command))
    rows: list[tuple[str, str, str]] = []
    status = 0
    total = 0.0
    for name, command in phases:
        if status:
            rows.append((name, "-", "not run"))
            continue
        print(f"\n=== {name}: {command}", flush=True)
        code, seconds, summary = run_phase(command)
        total += seconds
        status = code
        failed = "" if code == 0 else f"exit {code}"
        rows.append((name, _clock(seconds), "; ".join(x for x in (summary, failed) if x)))
    width = max(len(name) for name, _, _ in [*rows, ("total", "", "")])
    print("\n=== make test: time per phase (m:ss)")
    for name, clock, note in rows:
        print(f"  {name:<{width}}  {clock:>6}  {note}".rstrip())
    print(f"  {'total':<{width}}  {_clock(total):>6}  {'ok' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
