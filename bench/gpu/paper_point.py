"""The paper-scale point on a GPU: dsv4-flash at 524,288 tokens (31.28 GiB per rank) restored from
the local disk into GPU memory through W = 32 slots of 16,408,576 B.

    python bench/gpu/paper_point.py --device cuda --state-dir DIR --json OUT --budget-s 240

How it works:

1. a disk probe (1 GiB written with fsync, read back with 1 and 4 threads past the page cache)
   estimates save and restore times; the state is the largest of ``--tokens``, ``--tokens / 2``,
   ... whose save and first restore fit the budget, the disk and the device memory (the
   document says when it is not ``--tokens``);
2. the state: random bytes generated on the device, saved chunk by chunk through an engine into
   a FileTier (fsync), as a server would save it;
3. BSR restores into a second device cache, W = 32, with 4 readers (``io_depth`` 4), then with
   1: TTFT (the wall time of ``restore``, no model step), RWS (exactly ``32 x slot_bytes``),
   host RSS growth, the bytes compared with the source on the device;
4. the whole-plan baseline (``strategy="whole_plan"``, 4 readers) at the same size: its RWS is the
   whole state in host memory, and its host peak is what the paper's L1 table is about.

Each restore reads past the page cache: O_DIRECT where the filesystem takes it, otherwise the
files are dropped with ``posix_fadvise`` first. A restore whose estimate no longer fits the budget
is skipped with a line saying so. Uses bsr's public API only.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import psutil
import torch
from _shared import (
    DSV4_FLASH,
    GIB,
    Budget,
    RssPeak,
    direct_io_works,
    drop_page_cache,
    filesystem,
    filled_cache,
    machine,
    object_files,
    same_bytes,
    timed,
    token_ids,
    write_json,
)

import bsr

NS = bsr.Namespace("bsr-gpu/paper-point")
MIB = 1 << 20
#: the BSR paper (DeepSeek-V4-Flash, TP=2, per rank, local SSD): restore TTFT at 512K tokens
PAPER = {
    "source": "BSR paper: DeepSeek-V4-Flash TP=2 per rank, 524,288 tokens, local SSD",
    "state_gib": 31.277,
    "rws_bytes": 32 * 16_408_576,
    "ttft_s": {"1_reader": 43.1, "4_readers": 17.6},
}


def disk_probe(directory: Path, nbytes: int, direct: bool) -> dict[str, float]:
    """Write ``nbytes`` with fsync, read them back with 1 and 4 threads past the page cache."""
    path = directory / ".disk-probe"
    block = 16 * MIB
    buf = os.urandom(block)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // block):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    size = path.stat().st_size
    out = {"bytes": float(size), "write_Bps": size / write_s}
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def read_range(lo: int, hi: int) -> int:
        mem = mmap.mmap(-1, block)
        fd = os.open(path, flags)
        try:
            got, off = 0, lo
            while off < hi:
                n = os.preadv(fd, [memoryview(mem)[: min(block, hi - off)]], off)
                if n <= 0:
                    break
                got += n
                off += n
            return got
        finally:
            os.close(fd)
            mem.close()

    for threads in (1, 4):
        drop_page_cache([path])
        step = size // threads // block * block
        ranges = [(i * step, size if i == threads - 1 else (i + 1) * step) for i in range(threads)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(lambda r: read_range(*r), ranges))
        out[f"read_{threads}_Bps"] = got / (time.perf_counter() - t0)
    path.unlink()
    return out


class PaperPoint:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.device = ns.device
        self.layout = DSV4_FLASH
        self.root = Path(ns.state_dir) / "paper-point"
        self.budget = Budget(ns.budget_s, self.skip)
        self.skipped: list[str] = []
        self.points: list[dict[str, Any]] = []

    def skip(self, line: str) -> None:
        print(line, flush=True)
        self.skipped.append(line)

    def state_bytes(self, tokens: int) -> int:
        return tokens // self.layout.chunk_tokens * self.layout.chunk_bytes

    def memory_free(self) -> int:
        if torch.device(self.device).type == "cuda":
            return int(torch.cuda.mem_get_info()[0])
        return int(psutil.virtual_memory().available)

    def choose_tokens(self, probe: dict[str, float]) -> tuple[int, list[str]]:
        """The largest halving of --tokens that fits disk, device memory and the budget."""
        notes, tokens = [], self.ns.tokens
        disk = filesystem(self.root)["free_bytes"]
        mem = self.memory_free()
        while tokens >= self.ns.window * self.layout.chunk_tokens:
            s = self.state_bytes(tokens)
            save_s = s / probe["write_Bps"] * 1.2
            first_s = s / probe["read_4_Bps"] * 1.3
            why = None
            if s + 2 * GIB > disk:
                why = f"the disk has {disk / GIB:.1f} GiB free"
            elif 2 * s + 4 * GIB > mem:
                why = (
                    f"the {self.device} memory has {mem / GIB:.1f} GiB free (source + destination)"
                )
            elif save_s + first_s > self.budget.left:
                why = (
                    f"its save (~{save_s:.0f} s) and first restore (~{first_s:.0f} s) exceed "
                    f"the {self.budget.left:.0f} s left"
                )
            if why is None:
                return tokens, notes
            notes.append(f"{tokens} tokens ({s / GIB:.2f} GiB) does not fit: {why}")
            print(notes[-1], flush=True)
            tokens //= 2
        return 0, notes

    async def restore(
        self,
        tokens: int,
        toks: list[int],
        src: Any,
        dst: Any,
        *,
        io_depth: int,
        strategy: str,
        direct: bool,
    ) -> dict[str, Any]:
        cap = 2 * self.state_bytes(tokens) + GIB
        tier = bsr.FileTier(self.root, cap, reader=self.ns.reader, direct_io=direct)
        eng = bsr.RestoreEngine(
            self.layout, [tier], window=self.ns.window, io_depth=io_depth, namespace=NS
        )
        async with eng:
            for g in self.layout.groups:
                dst.tensor(g.name).zero_()
            drop_page_cache(object_files(self.root))
            with RssPeak() as rss, timed(self.device) as t:
                r = await eng.restore(toks, dst, list(range(dst.num_blocks)), strategy=strategy)
            active = getattr(tier.reader, "direct_active", None)
        point = {
            "strategy": strategy,
            "window": self.ns.window,
            "io_depth": io_depth,
            "reader": self.ns.reader,
            "direct_io_active": active,
            "state": str(r.state),
            "reason": str(r.reason),
            "committed_tokens": r.committed_tokens,
            "ttft_s": t["s"],
            "bandwidth_Bps": self.state_bytes(tokens) / t["s"],
            "rws_peak_bytes": r.rws_peak_bytes,
            "rss_growth_bytes": rss.growth,
            "timings": {
                k: getattr(r.timings, f"{k}_s") for k in ("probe", "install", "commit", "total")
            },
        }
        point["verified"] = bool(r.committed and same_bytes(dst, src))
        point["rws_exact"] = r.rws_peak_bytes == (
            self.ns.window * self.layout.slot_bytes
            if strategy == "bounded"
            else self.state_bytes(tokens)
        )
        print(
            f"{strategy} io_depth={io_depth}: {point['state']} TTFT {t['s']:.2f} s "
            f"({point['bandwidth_Bps'] / 1e9:.2f} GB/s), RWS {r.rws_peak_bytes / MIB:.2f} MiB, "
            f"host RSS +{rss.growth / MIB:.0f} MiB, verified {point['verified']}",
            flush=True,
        )
        return point

    async def run(self) -> dict[str, Any]:
        """Probe the disk, choose the size, save the state, run the restores; the document."""
        ns = self.ns
        self.root.mkdir(parents=True, exist_ok=True)
        direct = direct_io_works(self.root)
        doc = self.header(direct)
        probe = disk_probe(self.root, min(GIB, self.state_bytes(ns.tokens)), direct)
        doc["disk_probe"] = probe
        print(
            f"disk: write {probe['write_Bps'] / 1e9:.2f} GB/s, read 1 thread "
            f"{probe['read_1_Bps'] / 1e9:.2f} GB/s, 4 threads {probe['read_4_Bps'] / 1e9:.2f} "
            "GB/s",
            flush=True,
        )
        tokens, notes = self.choose_tokens(probe)
        s = self.state_bytes(tokens)
        doc["config"] = {
            "layout": "dsv4-flash",
            "tokens_asked": ns.tokens,
            "tokens": tokens,
            "state_bytes": s,
            "state_gib": s / GIB,
            "slot_bytes": self.layout.slot_bytes,
            "window": ns.window,
            "expected_rws_bytes": ns.window * self.layout.slot_bytes,
            "reader": ns.reader,
            "size_notes": notes,
        }
        if tokens == 0:
            self.skip("skipped: no state size fits (see config.size_notes)")
            doc["skipped"] = self.skipped
            return doc
        toks = token_ids(tokens, ns.seed)
        src = filled_cache(self.layout, tokens, self.device, ns.seed)
        doc["save"] = await self.save(toks, src, s)
        dst = bsr.PagedKVCache(self.layout, src.num_blocks, 16, device=self.device)
        await self.restores(tokens, toks, src, dst, probe, direct)
        doc["points"] = self.points
        by = {(p["strategy"], p["io_depth"]): p for p in self.points}
        one, four = by.get(("bounded", 1)), by.get(("bounded", 4))
        if one and four:
            doc["readers_row"] = {
                "ttft_1_reader_s": one["ttft_s"],
                "ttft_4_readers_s": four["ttft_s"],
                "speedup": one["ttft_s"] / four["ttft_s"],
            }
        doc["skipped"] = self.skipped
        return doc

    def header(self, direct: bool) -> dict[str, Any]:
        """The document's head: tool, start, machine, storage and the paper's figures."""
        return {
            "tool": "bench/gpu/paper_point.py",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(self.device),
            "storage": {
                **filesystem(self.root),
                "direct_io_supported": direct,
                "cache_mode": "direct (O_DIRECT)"
                if direct
                else "cold (posix_fadvise DONTNEED before each restore)",
            },
            "paper": PAPER,
        }

    async def save(self, toks: list[int], src: Any, s: int) -> dict[str, Any]:
        """Save the state of ``s`` bytes through an engine into a FileTier; the ``save`` entry."""
        ns = self.ns
        cap = 2 * s + GIB
        saver = bsr.RestoreEngine(
            self.layout,
            [bsr.FileTier(self.root, cap, reader="posix")],
            window=ns.window,
            io_depth=min(8, ns.window),
            namespace=NS,
        )
        async with saver:
            with timed(self.device) as t:
                saved = await saver.save(toks, src, list(range(src.num_blocks)))
        if not saved.ok:
            raise SystemExit(f"save failed: {saved}")
        print(f"saved {s / GIB:.2f} GiB ({saved.chunks} chunks) in {t['s']:.1f} s", flush=True)
        return {"s": t["s"], "bytes": s, "Bps": s / t["s"], "chunks": saved.chunks}

    async def restores(
        self,
        tokens: int,
        toks: list[int],
        src: Any,
        dst: Any,
        probe: dict[str, Any],
        direct: bool,
    ) -> None:
        """BSR with 4 readers and with 1, then the whole plan, each if it still fits the budget
        (and the whole plan the host memory); the points go to ``self.points``."""
        s = self.state_bytes(tokens)
        est = s / probe["read_4_Bps"] * 1.3
        runs = [(4, "bounded"), (1, "bounded"), (4, "whole_plan")]
        for io_depth, strategy in runs:
            if io_depth == 1:
                est = est * probe["read_4_Bps"] / probe["read_1_Bps"]
            what = f"{strategy} restore with {io_depth} reader(s) of {s / GIB:.2f} GiB"
            if strategy == "whole_plan" and psutil.virtual_memory().available < 1.2 * s:
                self.skip(f"skipped: {what}: host memory cannot hold the whole state")
                continue
            if not self.budget.fits(what, est):
                continue
            point = await self.restore(
                tokens, toks, src, dst, io_depth=io_depth, strategy=strategy, direct=direct
            )
            self.points.append(point)
            est = point["ttft_s"] * 1.2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=524288, help="state size (default 524288)")
    p.add_argument("--window", "-W", type=int, default=32)
    p.add_argument("--reader", default="posix", choices=["posix", "kvikio"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget (seconds)")
    p.add_argument("--state-dir", required=True, help="directory on the local disk")
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--keep", action="store_true", help="keep the saved state")
    ns = p.parse_args(argv)
    point = PaperPoint(ns)
    try:
        doc = anyio.run(point.run)
    finally:
        if not ns.keep:
            shutil.rmtree(point.root, ignore_errors=True)
    write_json(ns.json, doc)
    print(f"JSON: {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
