"""Write ``store/`` here: a FileTier root saved by bsr with keys format 1 (bsr 0.1 and 0.2).

Run with the source of the last format-1 commit on ``sys.path`` (the chain was BLAKE2b over int64
tokens then); ``tests/ops/test_store_formats.py`` opens a copy of what it wrote with this bsr::

    git archive 15be628 src spec | tar -x -C /tmp/bsr-format1
    PYTHONPATH=/tmp/bsr-format1/src python tests/data/format1/make_store.py tests/data/format1/store

Three chunks of 16 tokens (``range(1000, 1048)``), one group ``kv`` of one layer at 16 bytes a
token, namespace ``Namespace("format1-store")``; the cache holds ``arange % 251`` as bytes.
"""

import sys

import anyio
import torch

import bsr

assert bsr.FORMAT_VERSION == 1, f"run this with format-1 bsr, not {bsr.FORMAT_VERSION}"
root = sys.argv[1]
layout = bsr.StateLayout(
    chunk_tokens=16, groups=(bsr.StateGroup("kv", num_layers=1, token_bytes=16),)
)
tokens = list(range(1000, 1048))
cache = bsr.PagedKVCache(layout, num_blocks=4, block_tokens=16)
t = cache.tensor("kv")
t.copy_((torch.arange(t.numel()) % 251).to(torch.uint8).reshape(t.shape))


async def main() -> None:
    tier = bsr.FileTier(root, 1 << 20)
    ns = bsr.Namespace("format1-store")
    async with bsr.RestoreEngine(layout, [tier], window=2, io_depth=2, namespace=ns) as eng:
        print(await eng.save(tokens, cache, [0, 1, 2]))


anyio.run(main)
