"""Several processes opening one fresh FileTier root at the same moment (a fleet's instances
starting on a shared pool): every one opens it, one marker results, and none fails.

Found by the fleet test: three ``vllm serve`` on one new root, one of them refused with
"cannot claim the directory: writing .bsr-tier failed (No such file or directory)": another
claimer had removed its temporary marker as a dead claim's leftover, or saw the directories of
a claim finished meanwhile and called the root someone else's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bsr.tiers.file._root import MARKER_NAME

OPENER = """
import os, sys, time
from pathlib import Path
import anyio, bsr

root, gate = Path(sys.argv[1]), Path(sys.argv[2])
while not gate.exists():
    time.sleep(0.001)

async def main() -> None:
    tier = bsr.FileTier(root, capacity_bytes=1 << 20)
    await tier.open()
    await tier.aclose()

anyio.run(main)
print("opened")
"""

PROCESSES = 6
ROUNDS = 2


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_processes_claiming_one_fresh_root_at_once_all_open_it(tmp_path: Path, round_: int) -> None:
    root, gate = tmp_path / "nested" / "pool", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(root), str(gate)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(PROCESSES)
    ]
    time.sleep(1.0 + 0.25 * round_)  # let them all reach the gate (a late one only claims later)
    gate.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    failed = [err.decode()[-800:] for p, (_, err) in zip(procs, outs, strict=True) if p.returncode]
    assert not failed, failed
    assert all(out.strip() == b"opened" for out, _ in outs)
    marker = json.loads((root / MARKER_NAME).read_text())
    assert marker["kind"] == "bsr.FileTier"
    assert not [e for e in os.listdir(root) if e.startswith(MARKER_NAME + ".")]  # no temp left
    # (this rarely loses the race on an idle machine; the tests below force each interleaving)


def open_root(root: Path) -> None:
    """Open (and claim) ``root`` in this process."""
    import anyio

    import bsr

    async def main() -> None:
        tier = bsr.FileTier(root, capacity_bytes=1 << 20)
        await tier.open()
        await tier.aclose()

    anyio.run(main)


def open_in_child(root: Path) -> None:
    code = OPENER.replace("while not gate.exists():\n    time.sleep(0.001)\n", "")
    out = subprocess.run([sys.executable, "-c", code, str(root), "-"], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()[-800:]


def test_a_claim_finished_by_another_process_after_our_check_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving forced: our check finds no marker, then another process claims the root
    (marker and directories) before we list it."""
    from bsr.tiers.file import _root

    root = tmp_path / "pool"
    real = _root.StoreRoot.check_marker
    calls = []

    def check_then_lose_the_race(self: _root.StoreRoot, root_fd: int) -> bool:
        calls.append(1)
        if len(calls) == 1:
            assert not real(self, root_fd)
            open_in_child(root)  # the other process claims it now
            return False
        return real(self, root_fd)

    monkeypatch.setattr(_root.StoreRoot, "check_marker", check_then_lose_the_race)
    open_root(root)  # before: "the directory is not empty ... holds no .bsr-tier marker"
    assert len(calls) >= 2


def test_a_live_claims_temporary_marker_is_left_and_a_dead_ones_removed(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    root.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, check=True)  # fmt: skip
        (root / f"{MARKER_NAME}.{int(dead.stdout)}.tmp").write_text("{}")
        (root / f"{MARKER_NAME}.{live.pid}.tmp").write_text("{}")
        open_in_child(root)
        left = sorted(e for e in os.listdir(root) if e.startswith(MARKER_NAME + "."))
        assert left == [f"{MARKER_NAME}.{live.pid}.tmp"]  # a claim in progress: not ours
    finally:
        live.kill()
        live.wait()
