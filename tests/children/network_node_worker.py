"""One node of a FileTier root shared in network mode, churning until told to stop.

Used by ``tests/tiers/test_network_churn.py``. ``python tests/children/network_node_worker.py
ROOT NODE SHARE SEED BUDGET`` runs one node: it opens ``FileTier(ROOT, SHARE, shared="network",
node=NODE)`` and an engine over it, prints ``ready``, then loops on random steps
(``random.Random(SEED)``) until SIGTERM. ``python tests/children/network_node_worker.py zygote``
imports all that once and starts nodes as forks of itself on command (:func:`zygote`): a node killed
(-9) and started again opens at once, not after importing torch anew. The steps:

- ``write``: a raw object ``i`` of :data:`OBJECTS` (its payload :func:`payload`, a pure function
  of ``i``);
- ``read``: probe and read object ``i``: a hit must be exactly :func:`payload` ``(i)``;
- ``delete``: probe and delete object ``i`` (whichever node wrote it);
- ``save`` / ``restore``: the engine saves prompt ``p`` of :data:`PROMPTS` (its tokens
  :func:`prompt`, its cache :func:`filled`), or restores it into a fresh cache: every committed
  block must equal :func:`filled` ``(p)``'s;
- ``gc``: ``bsr.tiers.file.gc_store(ROOT, BUDGET, tmp_age_s=GC_TMP_AGE_S)``.

After every step this node's accounted bytes (``tier.usage().bytes``) must be within SHARE.
Misses, typed tier errors (``TierIOError``: a temp file the collector took; ``TierFullError``)
and skipped saves are counted, never wrong bytes: a read or restore that returns bytes other
than the key's prints ``BAD ...`` and exits 3. Every :data:`REPORT_EVERY` steps it prints
``counts {json}`` (its counts so far); on SIGTERM it closes everything, prints ``done {json
counts}`` and exits 0.

Every payload is a pure function of its key, so any process (another node, the test's fresh
reader) knows what any object must hold: :func:`expected` maps an object id to its bytes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path

import anyio
import numpy as np
import structlog
import torch

import bsr

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128, dtype="uint8"),))
BLOCK = 8
#: raw objects (``tier.write``) and prompts (``engine.save``): how many keys of each
OBJECTS = 40
PROMPTS = 8
MAX_CHUNKS = 6
RAW_NS = bsr.Namespace("net-objects").fingerprint(LAYOUT)
PREFIX_NAMESPACE = bsr.Namespace("net-prefixes")
PREFIX_NS = PREFIX_NAMESPACE.fingerprint(LAYOUT)
GROUP = "kv"
#: temp files older than this are the collector's (a live write takes milliseconds)
GC_TMP_AGE_S = 5.0
#: a pause between steps: three nodes on two cores leave room for the restarted ones' opens
STEP_PAUSE_S = 0.002
#: every so many steps a node prints its counts so far (a killed node's work is counted too)
REPORT_EVERY = 20
#: the steps and their weights
STEPS = {"write": 30, "read": 30, "delete": 8, "save": 12, "restore": 14, "gc": 3}


def key(i: int) -> bsr.ChunkKey:
    return bsr.chunk_keys(RAW_NS, list(range(i * 16, i * 16 + 16)), 16)[0]


def payload(i: int) -> np.ndarray:
    """Object ``i``'s payload: 1 to 19 KB (objects of 8 to 24 KiB on disk), bytes from ``i``."""
    n = 1000 + (i * 7919 % 7) * 3000
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def prompt(p: int) -> list[int]:
    return [p * 100_000 + t for t in range(chunks_of(p) * LAYOUT.chunk_tokens)]


def chunks_of(p: int) -> int:
    return 1 + p % MAX_CHUNKS


def filled(p: int) -> bsr.PagedKVCache:
    n = chunks_of(p) * LAYOUT.chunk_tokens
    cache = bsr.PagedKVCache(LAYOUT, -(-n // BLOCK), BLOCK)
    t = cache.tensor("kv")
    gen = torch.Generator().manual_seed(p)
    t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return cache


def expected() -> dict[str, tuple[bsr.ChunkKey, np.ndarray]]:
    """Every object id a worker may write: its key and its payload."""
    out = {bsr.ObjectKey(key(i), GROUP).object_id: (key(i), payload(i)) for i in range(OBJECTS)}
    for p in range(PROMPTS):
        keys = bsr.chunk_keys(PREFIX_NS, prompt(p), LAYOUT.chunk_tokens)
        kv = filled(p).tensor("kv")
        per = LAYOUT.chunk_tokens // BLOCK
        for c, k in enumerate(keys):
            # a chunk's payload: its blocks of every layer, layer-major (as the engine packs it)
            blocks = kv[:, c * per : (c + 1) * per].contiguous()
            out[bsr.ObjectKey(k, GROUP).object_id] = (k, blocks.numpy().reshape(-1))
    return out


def bad(what: str) -> None:
    print(f"BAD {what}", flush=True)
    sys.exit(3)


class Node:
    def __init__(self, root: Path, share: int, budget: int, rng: random.Random) -> None:
        self.root, self.share, self.budget, self.rng = root, share, budget, rng
        self.counts: Counter[str] = Counter()

    async def step(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        name = self.rng.choices(list(STEPS), weights=list(STEPS.values()))[0]
        try:
            await getattr(self, name)(tier, engine)
        except bsr.ObjectError as exc:  # refused by verification: never wrong bytes, but seen
            self.counts[f"{name}_refused_{type(exc).__name__}"] += 1
        except (bsr.TierIOError, bsr.TierFullError, bsr.TierBusyError) as exc:
            self.counts[f"{name}_{type(exc).__name__}"] += 1
        used = tier.usage().bytes
        if used > self.share:
            bad(f"usage {used} > share {self.share} after {name}")

    async def write(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        i = self.rng.randrange(OBJECTS)
        self.counts["written" if await tier.write(key(i), GROUP, payload(i)) else "kept"] += 1

    async def read(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        i = self.rng.randrange(OBJECTS)
        want = payload(i)
        dst = np.zeros(len(want) + 8192, dtype=np.uint8)
        if not (await tier.contains_many([bsr.ObjectKey(key(i), GROUP)]))[0]:
            self.counts["absent"] += 1
            return
        try:
            n = await tier.read_into(key(i), GROUP, dst)
        except bsr.ObjectNotFoundError:
            self.counts["miss"] += 1
            return
        if not np.array_equal(dst[:n], want):
            bad(f"object {i}: read {n} bytes that are not its payload ({len(want)} bytes)")
        self.counts["hit"] += 1

    async def delete(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        i = self.rng.randrange(OBJECTS)
        if (await tier.contains_many([bsr.ObjectKey(key(i), GROUP)]))[0]:
            self.counts["deleted" if await tier.delete(key(i), GROUP) else "not_deleted"] += 1

    async def save(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        p = self.rng.randrange(PROMPTS)
        src = filled(p)
        r = await engine.save(prompt(p), src, list(range(src.num_blocks)))
        self.counts["saved_chunks"] += r.chunks
        self.counts["save_errors"] += sum(r.errors.values())
        self.counts["save_skipped"] += sum(r.skipped.values())

    async def restore(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        p = self.rng.randrange(PROMPTS)
        src = filled(p)
        dst = bsr.PagedKVCache(LAYOUT, src.num_blocks, BLOCK)
        r = await engine.restore(prompt(p), dst, list(range(src.num_blocks)))
        k = r.committed_tokens // BLOCK
        if not torch.equal(dst.tensor("kv")[:, :k], src.tensor("kv")[:, :k]):
            bad(f"prompt {p}: {r.committed_tokens} tokens committed that are not its state")
        self.counts["restored_tokens"] += r.committed_tokens
        self.counts["restores"] += 1

    async def gc(self, tier: bsr.FileTier, engine: bsr.RestoreEngine) -> None:
        from bsr.tiers.file import gc_store

        report = await anyio.to_thread.run_sync(
            lambda: gc_store(self.root, self.budget, tmp_age_s=GC_TMP_AGE_S)
        )
        self.counts["gc"] += 1
        self.counts["gc_removed"] += len(report.removed)


async def serve(
    root: Path, node: str, share: int, seed: int, budget: int, stop: threading.Event
) -> None:
    me = Node(root, share, budget, random.Random(seed))
    tier = bsr.FileTier(root, share, shared="network", node=node)
    engine = bsr.RestoreEngine(LAYOUT, [tier], window=2, io_depth=2, namespace=PREFIX_NAMESPACE)
    async with engine:
        print("ready", flush=True)
        steps = 0
        while not stop.is_set():
            await me.step(tier, engine)
            steps += 1
            if steps % REPORT_EVERY == 0:
                print("counts", json.dumps(dict(me.counts), sort_keys=True), flush=True)
            await anyio.sleep(STEP_PAUSE_S)
    print("done", json.dumps(dict(me.counts), sort_keys=True), flush=True)


def run_node(args: list[str]) -> int:
    """One node (``ROOT NODE SHARE SEED BUDGET``) until SIGTERM; its exit status."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    root, node, share, seed, budget = args
    try:
        anyio.run(serve, Path(root), node, int(share), int(seed), int(budget), stop)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def zygote() -> None:
    """Start nodes as forks of this process (bsr and torch imported once, not per restart),
    one command a line on stdin, one answer a line:

    - ``spawn OUT ERR ROOT NODE SHARE SEED BUDGET`` -> ``pid PID`` (its stdout and stderr go to
      the files OUT and ERR);
    - ``poll PID`` -> ``running PID`` or ``status PID CODE`` (reaped: CODE is the exit status,
      or minus the signal that ended it); ``wait PID`` the same, once it ended.

    A node stays unreaped until polled or waited for, so its PID names it until then (the test
    signals it by PID). On the end of stdin, every node still running is killed and reaped.
    """
    children: set[int] = set()
    print("zygote", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "spawn":
            pid = os.fork()
            if pid == 0:
                os._exit(_child(args))
            children.add(pid)
            print("pid", pid, flush=True)
        elif cmd in ("poll", "wait"):
            pid = int(args[0])
            done, status = os.waitpid(pid, os.WNOHANG if cmd == "poll" else 0)
            if done == 0:
                print("running", pid, flush=True)
            else:
                children.discard(pid)
                print("status", pid, os.waitstatus_to_exitcode(status), flush=True)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _child(args: list[str]) -> int:
    out, err, *node_args = args
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
        code = run_node(node_args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        sys.exit(run_node(sys.argv[1:6]))
