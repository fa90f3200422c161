"""Two real torch.distributed processes (gloo on loopback) agree on commit or invalidation.

The ranks meet through a rendezvous file (no port picked in advance that another process could
take), run in their own session and are killed by PID if they outlive the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parents[1] / "children" / "dist_worker.py"


def run_ranks(tmp_path: Path, fail_rank: int) -> list[dict[str, object]]:
    rendezvous = tmp_path / "rendezvous"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(2):
        out = tmp_path / f"out{rank}.json"
        procs.append(
            (
                out,
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        str(rank),
                        "2",
                        str(rendezvous),
                        str(tmp_path),
                        str(fail_rank),
                        str(out),
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                ),
            )
        )
    results = []
    try:
        for out, p in procs:
            log, _ = p.communicate(timeout=120)
            assert p.returncode == 0, log
            results.append(json.loads(out.read_text()))
    finally:
        for _, p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    return results


def test_both_ranks_succeed_and_commit_the_same_prefix(tmp_path: Path) -> None:
    a, b = run_ranks(tmp_path, fail_rank=-1)
    for r in (a, b):
        assert r["state"] == "Committed" and r["reason"] == "complete"
        assert r["committed_tokens"] == 96 and r["probe_tokens"] == 96
        assert r["exact"] is True and r["in_use"] == 0


def test_one_rank_failing_invalidates_both(tmp_path: Path) -> None:
    a, b = run_ranks(tmp_path, fail_rank=1)
    for r in (a, b):
        assert r["state"] == "Invalidated"
        assert r["committed_tokens"] == 0
        assert r["in_use"] == 0
        assert r["invalid_blocks"]  # every touched block is reported
    assert a["reason"] == "rank_failed"  # rank 0 installed everything but did not commit
    assert b["reason"] == "read_failed"
