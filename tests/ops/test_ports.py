"""Servers started by the test fixtures die with the process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from bsr.testing._ports import dies_with_this_process

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from bsr.testing._ports import dies_with_this_process
    tied = subprocess.Popen(["sleep", "600"], preexec_fn=dies_with_this_process())
    loose = subprocess.Popen(["sleep", "600"])
    print(tied.pid, loose.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie waits for a reaper: it is dead


def test_a_server_dies_with_the_test_process_that_started_it_when_that_is_killed() -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert starter.stdout is not None
    tied, loose = (int(x) for x in starter.stdout.readline().split())
    try:
        assert _alive(tied) and _alive(loose)
        starter.kill()  # what a timeout or `kill -9` of a test session does
        starter.wait()
        end = time.monotonic() + 60
        while _alive(tied) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(tied), "the tied server outlived the killed process"
        assert _alive(loose)  # the control: without the tie it is left behind
    finally:
        for pid in (tied, loose):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_only_the_main_thread_ties_a_server_to_itself() -> None:
    # the signal follows the forking thread: a worker thread's end would kill the server
    assert dies_with_this_process() is not None
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(dies_with_this_process()))
    t.start()
    t.join()
    assert seen == [None]
