"""A saving process to be killed: saves prompts into a FileTier until SIGKILL stops it.

Used by ``tests/proof/test_crash.py``. Two ways to run it:

- ``python tests/children/crash_writer.py DIR SEED``: save a seeded batch of prompts into
  ``DIR``, append the index of every prompt whose save returned to ``DIR/acked`` (fsync'ed),
  then exit.
- ``python tests/children/crash_writer.py --serve``: a zygote. Importing torch takes seconds, so
  the zygote imports once and, for each ``DIR SEED`` line on stdin, forks a child that runs the
  batch.
  It prints ``forked PID`` at once and ``reaped PID STATUS`` when the child is gone, so the
  test can SIGKILL the child at any moment. The zygote never starts a thread or an event loop
  itself, so forking it is safe.

The prompts and their cache contents are pure functions of the prompt index, shared with the
test (which imports this module) to check what it reads back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import sys
from pathlib import Path

import anyio
import structlog
import torch

import bsr

LAYOUT = bsr.StateLayout(
    chunk_tokens=16,
    groups=(
        bsr.StateGroup("kv", num_layers=2, token_bytes=64, dtype="uint8"),
        bsr.StateGroup("swa", num_layers=1, token_bytes=32, dtype="uint8", window_tokens=20),
    ),
)
BLOCK_TOKENS = 8
NAMESPACE = bsr.Namespace("crash-test")
#: prompt indices a batch draws from (batches overlap a little: some objects are skipped)
PROMPTS = 200
#: prompts saved per batch
BATCH = 8
CAPACITY = 1 << 30


def prompt(i: int) -> list[int]:
    """Prompt ``i``: 1-4 chunks plus a partial tail; prompts share prefixes in pairs."""
    chunks = 1 + i % 4
    base = (i // 2) * 1000
    tokens = [base + t for t in range(chunks * LAYOUT.chunk_tokens + i % 5)]
    if i % 2:  # diverges from its sibling after the first chunk
        tokens[LAYOUT.chunk_tokens :] = [t + 7 for t in tokens[LAYOUT.chunk_tokens :]]
    return tokens


def expected_chunk(tokens: list[int], chunk: int, group: str) -> torch.Tensor:
    """The bytes of ``chunk`` of ``group`` for a prompt: a function of its prefix only."""
    g = LAYOUT.group(group)
    prefix = tokens[: (chunk + 1) * LAYOUT.chunk_tokens]
    h = hashlib.blake2b(f"{group}|{prefix}".encode(), digest_size=8)
    gen = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") >> 1)
    shape = (g.num_layers, LAYOUT.chunk_tokens, g.token_bytes)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def source(i: int) -> tuple[bsr.PagedKVCache, list[int]]:
    """A cache holding prompt ``i`` at scattered blocks, and its block table."""
    tokens = prompt(i)
    nblocks = -(-len(tokens) // BLOCK_TOKENS)
    ids = list(range(nblocks))
    random.Random(i).shuffle(ids)
    cache = bsr.PagedKVCache(LAYOUT, nblocks, BLOCK_TOKENS)
    bpc = LAYOUT.chunk_tokens // BLOCK_TOKENS
    for c in range(len(tokens) // LAYOUT.chunk_tokens):
        for g in LAYOUT.groups:
            data = expected_chunk(tokens, c, g.name)
            blocks = torch.tensor(ids[c * bpc : (c + 1) * bpc])
            cache.tensor(g.name)[:, blocks] = data.view(g.num_layers, bpc, BLOCK_TOKENS, -1)
    return cache, ids


def engine(directory: Path, *, fsync: bool = True) -> bsr.RestoreEngine:
    return bsr.RestoreEngine(
        LAYOUT,
        [bsr.FileTier(directory, CAPACITY, reader="posix", fsync=fsync)],
        window=4,
        io_depth=2,
        namespace=NAMESPACE,
    )


def batch(seed: int) -> list[int]:
    return random.Random(seed).sample(range(PROMPTS), BATCH)


async def run_batch(directory: Path, seed: int) -> None:
    async with engine(directory) as eng:  # opened first: the tier claims an empty root
        acked = os.open(directory / "acked", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for i in batch(seed):
                cache, ids = source(i)
                res = await eng.save(prompt(i), cache, ids)
                if not res.ok:
                    raise SystemExit(f"save of prompt {i} failed: {res.errors}")
                os.write(acked, f"{i}\n".encode())
                os.fsync(acked)
        finally:
            os.close(acked)


def serve() -> None:
    for line in sys.stdin:
        directory, seed = line.split()
        pid = os.fork()
        if pid == 0:  # child: run the batch, never return into the loop
            code = 0
            try:
                anyio.run(run_batch, Path(directory), int(seed))
            except BaseException as exc:
                print(f"writer failed: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        print(f"forked {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {pid} {status}", flush=True)


if __name__ == "__main__":
    # logs to stderr: stdout carries the zygote's protocol
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        anyio.run(run_batch, Path(sys.argv[1]), int(sys.argv[2]))
