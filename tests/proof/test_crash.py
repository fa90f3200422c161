"""SIGKILL a saving process at random moments; the FileTier never exposes a partial object.

A zygote (``crash_writer.py --serve``) forks one writer per iteration; the test kills it with
SIGKILL after a seeded random delay, dozens of times over the same directory (later writers
continue where earlier ones died). After each kill the directory is opened again and:

- the index is rebuilt from the files, the dead writer's temp files are gone, and nothing had
  to be quarantined (no partial object ever reached ``objects/``: invariant 6);
- every visible object is one the writer meant to store and reads back verified, byte-exact;
- every prompt whose save returned before the kill is restored in full, and every restore of
  any prompt commits byte-exact (a prefix, possibly empty) or misses; none is Invalidated.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import pytest
import torch

import bsr
from bsr.core._keys import chunk_keys
from bsr.core._layout import align_up
from children import crash_writer as cw

HERE = Path(__file__).parents[1]
ITERATIONS = 30
SEED = 20261129
C = cw.LAYOUT.chunk_tokens


class Zygote:
    """The forking writer server, driven line by line."""

    def __init__(self, stderr: IO[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "children" / "crash_writer.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
        )

    def _line(self, prefix: str) -> list[str]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"zygote exited (rc={self.proc.poll()}) before {prefix!r}")
            parts = line.split()
            if parts and parts[0] == prefix:
                return parts[1:]

    def fork(self, directory: Path, seed: int) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{directory} {seed}\n")
        self.proc.stdin.flush()
        return int(self._line("forked")[0])

    def reaped(self, pid: int) -> int:
        got_pid, status = (int(x) for x in self._line("reaped"))
        assert got_pid == pid
        return status

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    with open(tmp_path / "writer.stderr", "w") as err:
        z = Zygote(err)
        try:
            yield z
        finally:
            z.close()


def acked(directory: Path) -> set[int]:
    """Prompts whose save returned (complete lines only: a kill may cut the last one)."""
    path = directory / "acked"
    if not path.exists():
        return set()
    text = path.read_text()
    return {int(x) for x in text[: text.rfind("\n") + 1].split()}


@functools.cache
def candidates() -> dict[str, tuple[bsr.ChunkKey, str, torch.Tensor]]:
    """Every object a writer may store: object id -> (key, group, payload bytes)."""
    ns_fp = cw.NAMESPACE.fingerprint(cw.LAYOUT)
    out: dict[str, tuple[bsr.ChunkKey, str, torch.Tensor]] = {}
    for i in range(cw.PROMPTS):
        tokens = cw.prompt(i)
        for key in chunk_keys(ns_fp, tokens, C):
            for g in cw.LAYOUT.group_names:
                oid = bsr.ObjectKey(key, g).object_id
                out[oid] = (key, g, cw.expected_chunk(tokens, key.index, g).reshape(-1))
    return out


async def check_directory(directory: Path, done: set[int], prompts: list[int]) -> dict[str, int]:
    known = candidates()
    figures = {"visible": 0, "committed_tokens": 0, "misses": 0, "partial": 0}
    # what the dead writer left behind: objects being written when it died
    figures["temp_files"] = len(list((directory / "tmp").iterdir()))
    async with bsr.FileTier(directory, cw.CAPACITY, reader="posix") as tier:
        # the dead writer's temp files are removed, nothing partial was ever visible
        assert not any((directory / "tmp").iterdir()), list((directory / "tmp").iterdir())
        quarantined = list((directory / "quarantine").iterdir())
        assert not quarantined, f"objects/ held damaged files after a kill: {quarantined}"
        # the index is rebuilt from the files
        files = sorted((directory / "objects").rglob("*.bsr"))
        assert tier.statistics().objects == len(files)
        assert sorted(tier.object_paths()) == files
        # every visible object is one the writer meant, and verifies byte-exact
        for path in files:
            oid = path.name[: -len(".bsr")]
            assert oid in known, f"unknown object {path} is visible"
            key, group, want = known[oid]
            buf = torch.empty(align_up(want.numel()), dtype=torch.uint8)
            n = await tier.read_into(key, group, buf)
            assert n == want.numel() and torch.equal(buf[:n], want), path
        figures["visible"] = len(files)
    # later restores commit byte-exact or miss; acked prompts are complete
    async with cw.engine(directory) as eng:
        for i in prompts:
            tokens = cw.prompt(i)
            nblocks = -(-len(tokens) // cw.BLOCK_TOKENS) + 3
            ids = list(range(nblocks))[::-1]
            dst = bsr.PagedKVCache(cw.LAYOUT, nblocks, cw.BLOCK_TOKENS)
            res = await eng.restore(tokens, dst, ids)
            assert res.state is bsr.RequestState.COMMITTED, (i, res)
            p = res.committed_tokens // C
            bpc = C // cw.BLOCK_TOKENS
            for g in cw.LAYOUT.groups:
                for c in cw.LAYOUT.needed_chunks(g.name, p):
                    got = dst.tensor(g.name)[:, ids[c * bpc : (c + 1) * bpc]]
                    want = cw.expected_chunk(tokens, c, g.name)
                    assert torch.equal(got.reshape(-1), want.reshape(-1)), (i, c, g.name)
            if i in done:
                assert p == len(tokens) // C, f"acknowledged prompt {i} lost chunks: {res}"
            figures["committed_tokens"] += res.committed_tokens
            figures["misses"] += p == 0
            figures["partial"] += 0 < p < len(tokens) // C
    return figures


def test_sigkill_while_saving(tmp_path: Path, zygote: Zygote) -> None:
    directory = tmp_path / "l2"
    directory.mkdir()
    rng = random.Random(SEED)
    # calibrate: one batch run to the end tells how long a writer lives
    pid = zygote.fork(directory, seed=0)
    t0 = time.perf_counter()
    status = zygote.reaped(pid)
    duration = time.perf_counter() - t0
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        tmp_path / "writer.stderr"
    ).read_text()
    # sync on purpose: the test forks and reaps writers between its checks, each check runs
    # its own (asyncio) loop
    anyio.run(check_directory, directory, acked(directory), cw.batch(0))
    killed = 0
    report: list[dict[str, Any]] = []
    it = 0
    # at least ITERATIONS writers, and on until half of ITERATIONS were killed mid-save (bounded):
    # on a busy machine a writer's life varies, so a kill may land after it finished
    while it < ITERATIONS or (killed < ITERATIONS // 2 and it < 4 * ITERATIONS):
        it += 1
        before = acked(directory)
        # mostly mid-save; a writer may still finish first (the machine may be busy)
        delay = rng.uniform(0.0, 0.9 * duration)
        pid = zygote.fork(directory, seed=it)
        t_fork = time.perf_counter()
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # finished first
            pass
        status = zygote.reaped(pid)
        if os.WIFSIGNALED(status):
            assert os.WTERMSIG(status) == signal.SIGKILL
            killed += 1
        else:
            assert os.WEXITSTATUS(status) == 0, (tmp_path / "writer.stderr").read_text()
            # it lived at most this long: aim the next kills within that
            duration = min(duration, time.perf_counter() - t_fork)
        done = acked(directory)
        assert before <= done
        # restore the prompts the killed writer was saving, some saved before, some never saved
        earlier = rng.sample(sorted(done), min(6, len(done)))
        never = [i for i in range(cw.PROMPTS) if i not in done][:2]
        prompts = sorted({*cw.batch(it), *earlier, *never})
        figures = anyio.run(check_directory, directory, done, prompts)
        report.append({"delay_s": round(delay, 3), "acked": len(done), **figures})
    temp = sum(1 for row in report if row["temp_files"])
    print(
        f"\ncrash campaign: writer lives {duration:.2f}s; {killed}/{it} killed mid-save, "
        f"{temp} kills left temp files behind"
    )
    for row in report:
        print("  ", row)
    # most kills must land while the writer is at work, or the test proves little
    assert killed >= ITERATIONS // 2
