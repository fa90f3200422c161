"""Nodes of a FileTier root shared in network mode, killed (-9) and restarted while they churn.

Three nodes, each ``tests/children/network_node_worker.py`` on its own sshfs mount of one export
(its own node id, its own share of the root), write, read, delete, save and restore prefixes and
now and then collect (``gc_store``), while the test kills random nodes at random points (inside
their open too) and starts them again with the same node id on the same mount: a restarted node must
open (a killed process's node lock must not linger). Every read a node makes is checked against
the key's payload (a pure function of the key). Afterwards, with every node stopped:

- foreign files planted in the root (``objects/zz/README`` and the like) are intact;
- each node's journal claims at most its share; after a final ``gc_store(budget,
  tmp_age_s=0)`` (through a fresh mount: a long-lived sshfs mount lists a directory from its
  cache for up to 20 s, missing other nodes' newest objects and listing ones they removed) the
  root holds at most the budget, no temp file is left in ``tmp/``, and each node reopened
  accounts at most its share (a journal's own temp file left in ``nodes/`` by a node killed
  mid-compaction is printed: :func:`test_a_journal_temp_file_of_a_killed_node_is_collected`);
- a fresh reader (a new node on a fresh mount) reads every object left in ``objects/`` back as
  exactly the bytes saved for its key, restores every prompt's committed blocks exactly, and
  the scrub (``verify_store``) finds nothing bad; nothing was quarantined.

The nodes are forks of one "zygote" process that imported bsr and torch once, so a restart
costs an open, not an import. The seed is printed (``BSR_CHURN_SEED`` picks another); the kills'
moments depend on the machine's speed, the checks do not.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import numpy as np
import torch

import bsr
from bsr.tiers.file import gc_store, verify_store
from bsr.tiers.file._network import read_journal
from children import network_node_worker as nnw
from support.sshfs import SshfsExport

TESTS = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("BSR_CHURN_SEED", "20250611"))
NODES = 3
SHARE = 256 << 10  # each node's share: about 16 of its objects (the keys hold about 3x that)
WORKER_BUDGET = SHARE  # the nodes' own collections (below the shares' sum: they remove)
FINAL_BUDGET = SHARE  # the last collection, every node stopped
CHURN_S = 12.0
READY_S = 60.0  # the longest a (re)started node may take to open (a hang guard)
ROOT = "kv"
#: foreign files in the root (path in the root -> bytes): no node and no collection touches them
FOREIGN = {
    "NOTES.md": b"not bsr's\n",
    "objects/zz/README": b"a foreign fan-out directory\n",
    "objects/README": b"a foreign file among the fan-out directories\n",
    # of the object grammar, but in another object's fan-out directory: not an object
    f"objects/ab/{'cd' * 20}.bsr": b"misplaced\n",
    "tmp/README": b"not a temp file of bsr's grammar\n",
    f"tmp/{'ef' * 20}.0.abcdefabcdef.tmp": b"pid 0: not the grammar\n",
    "nodes/README": b"not a node's journal\n",
    "quarantine/README": b"not quarantined by bsr\n",
}
OLD = 1_000_000_000  # the foreign files' mtime (2001): oldest of all, were they collected


class Zygote:
    """``network_node_worker.py zygote``: starts the nodes as forks of itself (see there)."""

    def __init__(self, logs: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        with open(logs / "zygote.err", "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "children" / "network_node_worker.py"), "zygote"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
            )  # fmt: skip
        self.err = logs / "zygote.err"
        self._buf = b""
        assert self._line(READY_S) == "zygote"

    def ask(self, line: str, timeout_s: float = 60.0) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        return self._line(timeout_s).split()

    def _line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"the zygote did not answer in {timeout_s:g} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"the zygote exited: {self.err.read_text(errors='replace')}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        """End it: it kills and reaps the nodes still running (none, unless a test failed)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Worker:
    """One incarnation of a node's process, a fork of the zygote (its output in files).

    Its PID is signalled only while the zygote has not reaped it (until :meth:`poll` or a wait
    saw it end), so it always names this process."""

    def __init__(self, zygote: Zygote, logs: Path, root: Path, node: str, incarnation: int) -> None:
        self.zygote, self.node, self.incarnation = zygote, node, incarnation
        seed = SEED * 1000 + int(node[1:]) * 100 + incarnation
        self.out = logs / f"{node}.{incarnation}.out"
        self.err = logs / f"{node}.{incarnation}.err"
        reply = zygote.ask(
            f"spawn {self.out} {self.err} {root} {node} {SHARE} {seed} {WORKER_BUDGET}"
        )
        assert reply[0] == "pid", reply
        self.pid = int(reply[1])
        self.code: int | None = None  # its exit status, once reaped

    def lines(self) -> list[str]:
        return self.out.read_text(errors="replace").splitlines() if self.out.exists() else []

    def failure(self, what: str) -> AssertionError:
        err = self.err.read_text(errors="replace")[-4000:] if self.err.exists() else ""
        return AssertionError(
            f"node {self.node} (incarnation {self.incarnation}, seed {SEED}) {what} "
            f"(exit {self.code}): stdout {self.lines()!r}\nstderr: {err}"
        )

    def _ended(self, reply: list[str]) -> int | None:
        if reply[0] == "status":
            self.code = int(reply[2])
        return self.code

    def check_alive(self) -> None:
        """Fail when it exited on its own (a refused reopen, wrong bytes, a crash)."""
        if self.code is not None or self._ended(self.zygote.ask(f"poll {self.pid}")) is not None:
            raise self.failure("exited")

    def is_ready(self) -> bool:
        self.check_alive()
        return "ready" in self.lines()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while not self.is_ready():
            if time.monotonic() > deadline:
                raise self.failure(f"did not open within {READY_S:g} s")
            time.sleep(0.02)

    def kill(self) -> None:
        self.check_alive()
        os.kill(self.pid, signal.SIGKILL)
        assert self._ended(self.zygote.ask(f"wait {self.pid}")) == -signal.SIGKILL

    def stop(self) -> None:
        """Ask it to stop (SIGTERM); it closes its tier and reports."""
        self.check_alive()
        os.kill(self.pid, signal.SIGTERM)
        self._ended(self.zygote.ask(f"wait {self.pid}", timeout_s=60))
        if self.code != 0 or not any(ln.startswith("done ") for ln in self.lines()):
            raise self.failure("did not stop cleanly")

    def warnings(self) -> list[str]:
        """The events it logged at warning level or above (structlog's console lines)."""
        text = "".join(f.read_text(errors="replace") for f in (self.out, self.err) if f.exists())
        return re.findall(r"\[(?:warning|error|critical) *\] (\S+)", text)

    def counts(self) -> Counter[str]:
        """Its counts: its last report (a killed node's work up to its last report)."""
        for ln in reversed(self.lines()):
            if ln.startswith(("done ", "counts ")):
                return Counter(json.loads(ln.split(" ", 1)[1]))
        return Counter()

    def reap(self) -> None:
        """Kill it if it still runs (a failed test's cleanup; the zygote reaps it)."""
        if self.code is None:
            os.kill(self.pid, signal.SIGKILL)
            self.code = -signal.SIGKILL


def plant_foreign(root: Path) -> dict[str, tuple[bytes, int]]:
    for rel, data in FOREIGN.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (OLD, OLD))
    return {rel: (data, OLD) for rel, data in FOREIGN.items()}


def check_foreign(root: Path, planted: dict[str, tuple[bytes, int]]) -> None:
    for rel, (data, mtime) in planted.items():
        path = root / rel
        assert path.is_file(), f"foreign file {rel} is gone"
        assert path.read_bytes() == data, f"foreign file {rel} was changed"
        assert int(path.stat().st_mtime) == mtime, f"foreign file {rel} was touched"


def object_files(root: Path) -> dict[str, int]:
    """``oid -> size`` of the files of bsr's object grammar in their own fan-out directory."""
    out = {}
    for path in (root / "objects").glob("??/*.bsr"):
        oid = path.name[: -len(".bsr")]
        if len(oid) == 40 and oid[:2] == path.parent.name:
            out[oid] = path.stat().st_size
    return out


def churn(workers: list[Worker], spawn: Callable[[int], Worker], rng: random.Random) -> int:
    """Kill random nodes at random points for :data:`CHURN_S` and start them again; how many
    kills. Mostly a node that is churning; after a restart, now and then the new process again
    at once (inside its open: its node lock taken, its journal replayed and compacted). Every
    restarted node must open (a killed process's node lock lingering would refuse it)."""
    kills = 0
    start = time.monotonic()
    while time.monotonic() - start < CHURN_S:
        time.sleep(rng.uniform(0.3, 1.5))
        while not (ready := [i for i, w in enumerate(workers) if w.is_ready()]):
            time.sleep(0.02)  # (is_ready checks each is alive: a refused open fails the test)
        i = rng.choice(ready)
        kills += kill(workers, i, spawn, "churning", start)
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0.0, 0.1))
            if not workers[i].is_ready():
                kills += kill(workers, i, spawn, "opening", start)
    for w in workers:
        w.wait_ready()  # the last restarts open too
    return kills


def kill(
    workers: list[Worker], i: int, spawn: Callable[[int], Worker], what: str, t0: float
) -> int:
    victim = workers[i]
    print(f"{time.monotonic() - t0:6.2f} s: kill n{i} #{victim.incarnation} ({what})")
    victim.kill()
    workers[i] = spawn(i)
    return 1


def test_nodes_killed_and_restarted_keep_exact_bytes_shares_and_foreign_files(
    export: SshfsExport,
) -> None:
    print(f"network churn seed {SEED} (BSR_CHURN_SEED)")
    rng = random.Random(SEED)
    mounts = [export.mount(f"n{i}") for i in range(NODES)]
    server_root = export.export / ROOT
    logs = export.tmp / "logs"
    logs.mkdir()

    async def claim() -> None:  # node n0's first open claims the root; foreign files go in after
        async with bsr.FileTier(mounts[0] / ROOT, SHARE, shared="network", node="n0"):
            pass

    anyio.run(claim)
    planted = plant_foreign(server_root)
    incarnations = Counter[int]()

    every: list[Worker] = []  # every incarnation, reaped whatever happens
    zygote = Zygote(logs)

    def spawn(i: int) -> Worker:
        incarnations[i] += 1
        every.append(Worker(zygote, logs, mounts[i] / ROOT, f"n{i}", incarnations[i]))
        return every[-1]

    try:
        workers = [spawn(i) for i in range(NODES)]
        for w in workers:
            w.wait_ready()
        start = time.monotonic()
        kills = churn(workers, spawn, rng)
        for w in workers:
            w.stop()
        counts: Counter[str] = sum((w.counts() for w in every), Counter())
        print(f"{kills} kills in {time.monotonic() - start:.1f} s; counts {dict(counts)}")
        warned = Counter(ev for w in every for ev in w.warnings())
        print(f"warnings logged by the nodes: {dict(warned)}")
    finally:
        for w in every:
            w.reap()
        zygote.close()
    assert kills >= 3
    assert counts["hit"] > 0 and counts["restores"] > 0 and counts["written"] > 0, counts
    refused = {k: v for k, v in counts.items() if "refused" in k}
    assert not refused, f"reads refused by verification (a torn or stale object?): {refused}"

    check_foreign(server_root, planted)
    check_journals(server_root)
    # a fresh mount: a long-lived one's directory cache may be 20 s old (module docstring)
    check_final_gc(export.mount("collector") / ROOT, server_root, planted)
    check_reopened_nodes(mounts)
    check_fresh_reader(export.mount("reader") / ROOT, server_root)
    check_foreign(server_root, planted)


def check_journals(server_root: Path) -> None:
    """What each node's journal claims (and is still there) is within its share."""
    files = object_files(server_root)
    for i in range(NODES):
        claimed = read_journal((server_root / "nodes" / f"n{i}.log").read_bytes())
        held = sum(size for oid, size in claimed.items() if oid in files)
        assert held <= SHARE, f"node n{i}'s journal claims {held} bytes > its share {SHARE}"


def check_final_gc(root: Path, server_root: Path, planted: dict[str, tuple[bytes, int]]) -> None:
    """A last collection (every node stopped) leaves at most its budget and no temp file."""
    report = gc_store(root, FINAL_BUDGET, tmp_age_s=0)
    print(f"final gc: removed {len(report.removed)}, {report.remaining_bytes} bytes left")
    assert report.remaining_bytes <= FINAL_BUDGET
    assert sum(object_files(server_root).values()) <= FINAL_BUDGET
    temps = sorted(
        p.name for p in (server_root / "tmp").iterdir() if f"tmp/{p.name}" not in planted
    )
    assert not temps, f"temp files left in tmp/ after gc_store(tmp_age_s=0): {temps}"
    # a node killed inside its journal's compaction leaves nodes/<node>.log.<rand>.tmp, which
    # nothing collects yet (test_a_journal_temp_file_of_a_killed_node_is_collected)
    journal_temps = sorted(p.name for p in (server_root / "nodes").glob("*.log.*.tmp"))
    if journal_temps:
        print(f"journal temp files left in nodes/: {journal_temps}")
    check_foreign(server_root, planted)


def check_reopened_nodes(mounts: list[Path]) -> None:
    """Each node, reopened (same id, same mount), accounts at most its share."""

    async def main() -> None:
        for i, mount in enumerate(mounts):
            async with bsr.FileTier(mount / ROOT, SHARE, shared="network", node=f"n{i}") as t:
                used = t.usage().bytes
                assert used <= SHARE, f"node n{i} reopened accounts {used} > its share {SHARE}"

    anyio.run(main)


def check_fresh_reader(root: Path, server_root: Path) -> None:
    """A new node reads every object left exactly, and restores every prompt exactly."""
    expected = nnw.expected()
    left = object_files(server_root)
    unknown = sorted(set(left) - set(expected))
    assert not unknown, f"objects/ holds objects no node wrote: {unknown}"

    async def main() -> int:
        tier = bsr.FileTier(root, 1 << 30, shared="network", node="reader")
        engine = bsr.RestoreEngine(
            nnw.LAYOUT, [tier], window=2, io_depth=2, namespace=nnw.PREFIX_NAMESPACE
        )
        async with engine:
            for oid in left:
                key, want = expected[oid]
                assert (await tier.contains_many([bsr.ObjectKey(key, nnw.GROUP)]))[0], oid
                dst = np.zeros(len(want) + 8192, dtype=np.uint8)
                n = await tier.read_into(key, nnw.GROUP, dst)
                assert n == len(want) and np.array_equal(dst[:n], want), oid
            committed = 0
            for p in range(nnw.PROMPTS):
                src = nnw.filled(p)
                dst_cache = bsr.PagedKVCache(nnw.LAYOUT, src.num_blocks, nnw.BLOCK)
                r = await engine.restore(nnw.prompt(p), dst_cache, list(range(src.num_blocks)))
                k = r.committed_tokens // nnw.BLOCK
                assert torch.equal(dst_cache.tensor("kv")[:, :k], src.tensor("kv")[:, :k]), p
                committed += r.committed_tokens
            return committed

    committed = anyio.run(main)
    print(f"fresh reader: {len(left)} objects read exactly, {committed} tokens restored")
    scrub = verify_store(server_root)
    assert scrub.clean, scrub.bad
    quarantined = [p.name for p in (server_root / "quarantine").iterdir() if p.name != "README"]
    assert not quarantined, f"objects were quarantined: {quarantined}"


def test_a_journal_temp_file_of_a_killed_node_is_collected(tmp_path: Path) -> None:
    """The state a node killed mid-compaction leaves, made directly (the window is the write
    of the journal's body: too short to hit with a kill on purpose); a local directory is enough,
    the network filesystem plays no part in it."""
    root = tmp_path / ROOT

    async def open_node() -> None:
        async with bsr.FileTier(root, SHARE, shared="network", node="n0") as tier:
            assert await tier.write(nnw.key(0), nnw.GROUP, nnw.payload(0))

    anyio.run(open_node)
    nodes = root / "nodes"
    leftover = nodes / "n0.log.0123456789ab.tmp"
    leftover.write_bytes((nodes / "n0.log").read_bytes()[:30])  # a torn body
    os.utime(leftover, (OLD, OLD))

    async def reopen(node: str) -> None:
        async with bsr.FileTier(root, SHARE, shared="network", node=node) as tier:
            assert tier.usage().objects == (1 if node == "n0" else 0)

    anyio.run(reopen, "n0")  # the node's next open removes its own
    assert not leftover.exists(), "nodes/n0.log.0123456789ab.tmp outlived its node's open"
    other = nodes / "n9.log.0123456789ab.tmp"  # a node gone for good: the collector's
    other.write_bytes(b"bsr.FileTier.node 1\n")
    young = nodes / "n8.log.00000000000a.tmp"
    young.write_bytes(b"bsr.FileTier.node 1\n")
    os.utime(other, (OLD, OLD))
    assert gc_store(root, 1 << 30, tmp_age_s=600).removed_temps == 1
    assert not other.exists() and young.exists()  # a young one may be a live compaction
