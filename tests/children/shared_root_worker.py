"""A process holding one FileTier root open beside others, driven line by line on stdin.

Used by ``tests/tiers/test_file_tier_shared*.py``: ``python
tests/children/shared_root_worker.py ROOT CAPACITY [POINT:K:ACTION]`` opens ``FileTier(ROOT,
CAPACITY)`` and an engine over it, prints ``ready``, then answers one command per line with one
line:

- ``write A B``: write objects ``A..B-1`` (payload ``i``) -> ``ok``
- ``contains A B``: which of objects ``A..B-1`` the tier holds -> ``present 0101...``
- ``read I``: read object ``I`` -> ``same`` (its payload, verified), ``miss``, or ``error TYPE``
- ``save N SEED``: the engine saves ``N`` chunks of prompt ``SEED`` -> ``saved CHUNKS``
- ``restore N SEED``: the engine restores it into a fresh cache -> ``restored STATE TOKENS SAME``
- ``stats`` -> ``stats OBJECTS BYTES PEAK EVICTIONS``
- ``stop-in-lock``: take the root's lock the way every change does, print ``locked``, stop
  this process with SIGSTOP while holding it; once continued (SIGCONT) leave it -> ``unlocked``
- ``quit``: close everything and exit.

Objects and prompts are pure functions of their index, so every process knows what any other
one wrote.

``POINT:K:ACTION`` pauses the open at a point of its work on the root, the K-th time it gets
there, and prints ``paused POINT`` (before ``ready``); the open goes on once the pause ends:

- points: ``scan`` (before the K-th object file the open's scan checks, no lock held);
  ``claim`` (inside a first member's first step: holding the root's lock and the members' lock
  exclusively); ``recount`` (before the K-th step of a first member's recount, no lock held;
  one fan-out directory a step, so K-1 of them are counted);
- actions: ``wait`` (for a line on stdin: the process runs, its open does not move) or ``stop``
  (SIGSTOP itself; SIGCONT ends the pause).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import anyio
import numpy as np
import structlog
import torch

import bsr

try:
    from bsr.tiers.file._ledger import RootBusy
except ImportError:  # a bsr before bounded locking, whose lock always waits (before/after runs)

    class RootBusy(Exception):  # type: ignore[no-redef]
        pass


PAYLOAD = 60_000  # one object is 64 KiB on disk (header + payload, padded)
LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128, dtype="uint8"),))
BLOCK = 8


NS = bsr.Namespace("shared-objects").fingerprint(LAYOUT)


def key(i: int) -> bsr.ChunkKey:
    return bsr.chunk_keys(NS, list(range(i * 16, i * 16 + 16)), 16)[0]


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAYLOAD, dtype=np.uint8)


def prompt(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + t for t in range(n)]


def filled(seed: int, n: int) -> bsr.PagedKVCache:
    cache = bsr.PagedKVCache(LAYOUT, -(-n // BLOCK), BLOCK)
    t = cache.tensor("kv")
    t.copy_(torch.randint(0, 256, t.shape, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.uint8))  # fmt: skip
    return cache


def pause_at(point: str, k: int, action: str) -> None:
    """Make this process's open pause (see the module docstring)."""
    from bsr.tiers.file._ledger import SharedSpace
    from bsr.tiers.file._root import StoreRoot

    seen = [0]

    def pause() -> None:
        seen[0] += 1
        if seen[0] != k:
            return
        print("paused", point, flush=True)
        if action == "stop":  # this thread stops at once (os.kill: maybe a little later)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        else:
            sys.stdin.readline()

    if point == "scan":
        check = StoreRoot.check_file

        def checked(fd: int, size: int) -> str:
            pause()
            return check(fd, size)

        StoreRoot.check_file = staticmethod(checked)  # type: ignore[method-assign]
    elif point == "claim":
        try_alone = SharedSpace._try_alone

        def claimed(self: SharedSpace) -> bool:
            alone = try_alone(self)
            if alone:
                pause()
            return alone

        SharedSpace._try_alone = claimed  # type: ignore[method-assign]
    elif point == "recount":
        import bsr.tiers.file._ledger as ledger_module

        step = SharedSpace.recount  # (a bsr without a recount fails here: nothing to pause)
        ledger_module.RECOUNT_HOLD_S = 0.0  # one fan-out directory a step: K-1 counted

        def counted(self: SharedSpace) -> bool:
            pause()
            return step(self)

        SharedSpace.recount = counted  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown pause point {point!r}")


async def serve(root: Path, capacity: int) -> None:
    tier = bsr.FileTier(root, capacity, reader="posix", fsync=False)
    engine = bsr.RestoreEngine(LAYOUT, [tier], window=2, io_depth=2,
                               namespace=bsr.Namespace("shared-root"))  # fmt: skip
    async with engine:
        print("ready", flush=True)
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "quit":
                break
            print(await run(tier, engine, cmd, [int(a) for a in args]), flush=True)


async def run(tier: bsr.FileTier, engine: bsr.RestoreEngine, cmd: str, a: list[int]) -> str:
    if cmd == "write":
        for i in range(a[0], a[1]):
            await tier.write(key(i), "kv", payload(i))
        return "ok"
    if cmd == "contains":
        got = await tier.contains_many([bsr.ObjectKey(key(i), "kv") for i in range(a[0], a[1])])
        return "present " + "".join("1" if g else "0" for g in got)
    if cmd == "read":
        dst = np.zeros(PAYLOAD + 4096, dtype=np.uint8)
        try:
            n = await tier.read_into(key(a[0]), "kv", dst)
        except bsr.ObjectNotFoundError:
            return "miss"
        except bsr.BsrError as exc:
            return f"error {type(exc).__name__}"
        return "same" if np.array_equal(dst[:n], payload(a[0])) else "DIFFERENT"
    if cmd in ("save", "restore"):
        n = a[0] * LAYOUT.chunk_tokens
        tokens, src = prompt(a[1], n), filled(a[1], n)
        ids = list(range(src.num_blocks))
        if cmd == "save":
            return f"saved {(await engine.save(tokens, src, ids)).chunks}"
        dst = bsr.PagedKVCache(LAYOUT, src.num_blocks, BLOCK)
        r = await engine.restore(tokens, dst, ids)
        k = r.committed_tokens // BLOCK
        same = torch.equal(dst.tensor("kv")[:, :k], src.tensor("kv")[:, :k])
        return f"restored {r.state.value} {r.committed_tokens} {same}"
    if cmd == "stop-in-lock":
        space = tier._space
        assert space is not None
        while True:
            try:
                with space.locked():  # a stopped peer: frozen inside the root's lock
                    print("locked", flush=True)
                    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)  # at once
                return "unlocked"
            except RootBusy:
                await anyio.sleep(0.01)
    if cmd == "stats":
        s = tier.statistics()
        return f"stats {s.objects} {s.bytes} {s.peak_bytes} {s.evictions}"
    return f"unknown {cmd}"


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if len(sys.argv) > 3:
        where, count, how = sys.argv[3].split(":")
        pause_at(where, int(count), how)
    anyio.run(serve, Path(sys.argv[1]), int(sys.argv[2]))
