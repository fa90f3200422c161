"""The CUDA figures ``bsr bench`` does not report, measured side by side in one process.

    python bench/gpu/cuda_figures.py --device cuda --tokens 16384 --state-dir DIR --json OUT

On a dsv4-flash state (random bytes generated on the device, saved once into a HostTier and a
FileTier), each measured ``--repeats`` times, medians reported:

* ``install``: BSR restores from the HostTier (host memory: its objects in one pinned arena,
  each host hit copied by DMA straight from where it lies, checked on the CPU beside it)
  against a pinned host-to-device copy of the same bytes, whole and chunk by chunk, and a host
  memcpy of them (what a staging copy costs);
* ``layer_install``: the same into vLLM's per-layer layout (a llama-class model: 32 layers of
  ``[num_blocks, 2, block_size, 8 * 128]`` bfloat16 tensors, ``--layer-tokens`` tokens);
* ``readers``: BSR restores from the FileTier with the POSIX and with the kvikio reader, and raw
  reads of the same object files with each (``io_depth`` threads, no verification), the page
  cache dropped (``posix_fadvise``) before every measurement;
* ``rws``: every restore's ``rws_peak_bytes`` against ``W x slot_bytes``.

Every restore is checked byte for byte against the source on the device. Uses bsr's public API
only; ``--device cpu`` runs the same sections on the CPU (the dry run), without kvikio.
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
import numpy as np
import torch
import xxhash
from _shared import (
    DSV4_FLASH,
    GIB,
    dist,
    drop_page_cache,
    filesystem,
    filled_cache,
    machine,
    median,
    object_files,
    same_bytes,
    sync,
    timed,
    token_ids,
    write_json,
)

import bsr

NS = bsr.Namespace("bsr-gpu/cuda-figures")


def kvikio_problem(device: str) -> str | None:
    """Why the kvikio reader cannot run here, or None."""
    if torch.device(device).type != "cuda":
        return "kvikio reads need a CUDA device"
    try:
        import kvikio  # noqa: F401
    except Exception as exc:
        return f"kvikio does not import: {exc!r}"
    return None


def bandwidth(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else float("inf")


class Figures:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.device = ns.device
        self.layout = DSV4_FLASH
        ct = self.layout.chunk_tokens
        self.tokens = ns.tokens // ct * ct
        self.chunks = self.tokens // ct
        self.state_bytes = self.chunks * self.layout.chunk_bytes
        self.src = filled_cache(self.layout, self.tokens, self.device, ns.seed)
        self.dst = bsr.PagedKVCache(self.layout, self.src.num_blocks, 16, device=self.device)
        self.ids = list(range(self.src.num_blocks))
        self.toks = token_ids(self.tokens, ns.seed)
        self.root = Path(ns.state_dir) / "cuda-figures"
        self.rws_ok: list[bool] = []

    def engine(self, tiers: list[bsr.Tier]) -> bsr.RestoreEngine:
        return bsr.RestoreEngine(
            self.layout, tiers, window=self.ns.window, io_depth=self.ns.io_depth, namespace=NS
        )

    async def restore(self, eng: bsr.RestoreEngine, files: list[Path] | None) -> dict[str, Any]:
        """``--repeats`` restores into a zeroed destination; the first one verified."""
        times, verified, rws = [], None, []
        for i in range(self.ns.repeats):
            for g in self.layout.groups:
                self.dst.tensor(g.name).zero_()
            if files is not None:
                drop_page_cache(files)
            with timed(self.device) as t:
                r = await eng.restore(self.toks, self.dst, self.ids)
            if not r.committed or r.committed_tokens != self.tokens:
                raise SystemExit(f"restore did not commit the whole state: {r}")
            times.append(t["s"])
            rws.append(r.rws_peak_bytes)
            if i == 0:
                verified = same_bytes(self.dst, self.src)
                if not verified:
                    raise SystemExit("restored bytes differ from the source")
        want = self.ns.window * self.layout.slot_bytes
        self.rws_ok.append(all(x == want for x in rws))
        return {"ttft_s": dist(times), "verified": verified, "rws_peak_bytes": rws}

    # ------------------------------------------------------------------ install
    def memcpy_reference(self) -> dict[str, Any]:
        """Pinned host-to-device copies of the state's bytes, whole and per chunk."""
        cuda = torch.device(self.device).type == "cuda"
        n = self.state_bytes
        host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        off = 0
        for g in self.layout.groups:  # the state's own (random) bytes, not zeros
            t = self.src.tensor(g.name).view(-1)
            host[off : off + t.numel()].copy_(t)
            off += t.numel()
        dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        cb = self.layout.chunk_bytes
        whole, chunked, host_copy = [], [], []
        other = np.empty(n, dtype=np.uint8)
        for _ in range(self.ns.repeats + 1):  # the first of each is a warm-up
            with timed(self.device) as t:
                dev.copy_(host, non_blocking=True)
            whole.append(t["s"])
            with timed(self.device) as t:
                for c in range(self.chunks):
                    dev[c * cb : (c + 1) * cb].copy_(host[c * cb : (c + 1) * cb], non_blocking=True)
            chunked.append(t["s"])
            a = host.numpy()
            t0 = time.perf_counter()
            np.copyto(other, a)
            host_copy.append(time.perf_counter() - t0)
        del dev
        return {
            "pinned": cuda,
            "h2d_whole_s": dist(whole[1:]),
            "h2d_per_chunk_s": dist(chunked[1:]),
            "host_memcpy_s": dist(host_copy[1:]),
            "verify": self.verify_rate(host.numpy(), cb),
        }

    def verify_rate(self, host: np.ndarray, cb: int) -> dict[str, Any]:
        """The check a host hit gets before its DMA (xxh3-64 of each chunk's bytes), on 1 and
        on ``io_depth`` threads (the worker threads a CUDA restore verifies on): whether the
        CPU checks keep up with the link."""
        views = [memoryview(host[c : c + cb]) for c in range(0, host.size - cb + 1, cb)]
        out: dict[str, Any] = {"chunk_bytes": cb}
        for threads in sorted({1, self.ns.io_depth}):
            runs = []
            with ThreadPoolExecutor(threads) as pool:
                for _ in range(self.ns.repeats + 1):
                    t0 = time.perf_counter()
                    list(pool.map(xxhash.xxh3_64_intdigest, views))
                    runs.append(time.perf_counter() - t0)
            out[f"threads_{threads}_Bps"] = bandwidth(len(views) * cb, median(runs[1:]))
        return out

    # ------------------------------------------------------------------ raw reads
    def raw_reads(self, files: list[Path], reader: str) -> dict[str, Any]:
        """Every object file end to end, ``io_depth`` threads, no verification."""
        size = max(p.stat().st_size for p in files)
        depth = self.ns.io_depth
        if reader == "kvikio":
            import kvikio

            bufs = [
                torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(depth)
            ]

            def read(i: int, p: Path) -> int:
                with kvikio.CuFile(p, "r") as f:
                    n = p.stat().st_size
                    return int(f.pread(bufs[i % depth], n, 0).get())
        else:
            maps = [mmap.mmap(-1, size) for _ in range(depth)]

            def read(i: int, p: Path) -> int:
                fd = os.open(p, os.O_RDONLY)
                try:
                    return os.preadv(fd, [maps[i % depth]], 0)
                finally:
                    os.close(fd)

        times, total = [], sum(p.stat().st_size for p in files)
        for _ in range(self.ns.repeats):
            drop_page_cache(files)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(depth) as pool:
                got = sum(pool.map(read, range(len(files)), files))
            times.append(time.perf_counter() - t0)
            if got != total:
                raise SystemExit(f"raw {reader} read {got} of {total} bytes")
        return {"reader": reader, "threads": depth, "bytes": total, "s": dist(times)}

    # ------------------------------------------------------------------ run
    async def run(self) -> dict[str, Any]:
        """Save the state, then the install and readers sections; the document."""
        ns = self.ns
        cap = 2 * self.state_bytes + GIB
        doc: dict[str, Any] = {
            "tool": "bench/gpu/cuda_figures.py",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(self.device),
            "storage": filesystem(Path(ns.state_dir)),
            "config": {
                "layout": "dsv4-flash",
                "tokens": self.tokens,
                "chunks": self.chunks,
                "state_bytes": self.state_bytes,
                "slot_bytes": self.layout.slot_bytes,
                "window": ns.window,
                "io_depth": ns.io_depth,
                "repeats": ns.repeats,
                "cache_mode": "cold (posix_fadvise DONTNEED before each file read)",
            },
        }
        self.root.mkdir(parents=True, exist_ok=True)
        await self.install_section(doc, cap)
        doc["layer_install"] = await self.layer_install_section()
        doc["readers"] = await self.readers_section(cap)
        doc["rws"] = {
            "expected_bytes": ns.window * self.layout.slot_bytes,
            "every_restore_exact": all(self.rws_ok),
        }
        sync(self.device)
        return doc

    async def install_section(self, doc: dict[str, Any], cap: int) -> None:
        """Save into a HostTier and a FileTier (``save_s``), restore from the HostTier against
        the memcpy reference (``install``)."""
        host = bsr.HostTier(cap)
        async with self.engine([host, bsr.FileTier(self.root, cap, reader="posix")]) as eng:
            with timed(self.device) as t:
                saved = await eng.save(self.toks, self.src, self.ids)
            if not saved.ok:
                raise SystemExit(f"save failed: {saved}")
            doc["save_s"] = t["s"]
            print(f"saved {self.state_bytes / GIB:.2f} GiB in {t['s']:.1f} s", flush=True)
            restore = await self.restore(eng, None)  # the HostTier is the fastest holder
        ref = self.memcpy_reference()
        r_s, w_s = restore["ttft_s"]["median"], ref["h2d_whole_s"]["median"]
        c_s = ref["h2d_per_chunk_s"]["median"]
        doc["install"] = {
            "restore_from_host_tier": restore,
            "reference": ref,
            "restore_bandwidth_Bps": bandwidth(self.state_bytes, r_s),
            "h2d_bandwidth_Bps": bandwidth(self.state_bytes, w_s),
            "restore_vs_h2d_bandwidth": w_s / r_s,
            "restore_vs_h2d_per_chunk_bandwidth": c_s / r_s,
        }
        print(
            f"install: restore from host memory {self.state_bytes / r_s / 1e9:.2f} GB/s, "
            f"pinned copy {self.state_bytes / w_s / 1e9:.2f} GB/s",
            flush=True,
        )

    async def layer_install_section(self) -> dict[str, Any]:
        """HostTier restores into vLLM's per-layer tensors against a pinned host-to-device copy
        of the same bytes (whole and per chunk)."""
        layers, heads = 32, 8 * 128  # llama-3-8b's KV: 8 heads of 128, K and V, bfloat16
        layout = bsr.StateLayout(256, (bsr.StateGroup("kv", layers, 2 * heads * 2),))
        tokens = self.ns.layer_tokens // 256 * 256
        nblocks = tokens // 16
        gen = torch.Generator(device=self.device).manual_seed(self.ns.seed + 1)

        def tensors(fill: bool) -> list[torch.Tensor]:
            out = []
            for _ in range(layers):
                t = torch.empty(nblocks, 2, 16, heads, dtype=torch.bfloat16, device=self.device)
                flat = t.view(-1).view(torch.int16)
                flat.random_(generator=gen) if fill else flat.zero_()
                out.append(t)
            return out

        src_layers, dst_layers = tensors(True), tensors(False)
        src = bsr.PagedKVCache.from_layer_tensors(layout, {"kv": src_layers}, 16)
        dst = bsr.PagedKVCache.from_layer_tensors(layout, {"kv": dst_layers}, 16)
        toks, ids = token_ids(tokens, self.ns.seed + 1), list(range(nblocks))
        state = tokens * layout.groups[0].token_bytes * layers
        host = bsr.HostTier(state + GIB)
        eng = bsr.RestoreEngine(layout, [host], window=self.ns.window,
                                io_depth=self.ns.io_depth, namespace=NS)  # fmt: skip
        times: list[float] = []
        async with eng:
            if not (await eng.save(toks, src, ids)).ok:
                raise SystemExit("per-layer save failed")
            for i in range(self.ns.repeats + 1):  # the first is a warm-up
                for t in dst_layers:
                    t.zero_()
                with timed(self.device) as t_:
                    r = await eng.restore(toks, dst, ids)
                if r.committed_tokens != tokens:
                    raise SystemExit(f"per-layer restore did not commit: {r}")
                if i == 0 and not all(
                    torch.equal(a.view(torch.int16), b.view(torch.int16))
                    for a, b in zip(src_layers, dst_layers)
                ):
                    raise SystemExit("per-layer restored bytes differ from the source")
                times.append(t_["s"])
        cuda = torch.device(self.device).type == "cuda"
        ref_host = torch.empty(state, dtype=torch.uint8, pin_memory=cuda)
        ref_dev = torch.empty(state, dtype=torch.uint8, device=self.device)
        cb = layout.chunk_bytes
        whole, chunked = [], []
        for _ in range(self.ns.repeats + 1):
            with timed(self.device) as t_:
                ref_dev.copy_(ref_host, non_blocking=True)
            whole.append(t_["s"])
            with timed(self.device) as t_:
                for c in range(0, state, cb):
                    ref_dev[c : c + cb].copy_(ref_host[c : c + cb], non_blocking=True)
            chunked.append(t_["s"])
        r_s, w_s, c_s = median(times[1:]), median(whole[1:]), median(chunked[1:])
        out = {
            "layers": layers,
            "tokens": tokens,
            "state_bytes": state,
            "host_tier_pinned": host.pinned,
            "restore_s": dist(times[1:]),
            "h2d_whole_s": dist(whole[1:]),
            "h2d_per_chunk_s": dist(chunked[1:]),
            "restore_bandwidth_Bps": bandwidth(state, r_s),
            "restore_vs_h2d_bandwidth": w_s / r_s,
            "restore_vs_h2d_per_chunk_bandwidth": c_s / r_s,
            "verified": True,
        }
        print(
            f"layer install: restore from host memory {state / r_s / 1e9:.2f} GB/s, pinned "
            f"copy {state / w_s / 1e9:.2f} GB/s ({out['restore_vs_h2d_bandwidth']:.2f})",
            flush=True,
        )
        return out

    async def readers_section(self, cap: int) -> dict[str, Any]:
        """FileTier restores and raw reads with the POSIX and the kvikio reader (``readers``)."""
        files = object_files(self.root)
        readers: dict[str, Any] = {}
        why_not = kvikio_problem(self.device)
        for reader in ("posix", "kvikio"):
            if reader == "kvikio" and why_not is not None:
                readers[reader] = {"skipped": why_not}
                print(f"readers: kvikio skipped ({why_not})", flush=True)
                continue
            tier = bsr.FileTier(self.root, cap, reader=reader)
            async with self.engine([tier]) as eng:
                rest = await self.restore(eng, files)
            raw = self.raw_reads(files, reader)
            rt, wt = rest["ttft_s"]["median"], raw["s"]["median"]
            readers[reader] = {
                "restore": rest,
                "raw": raw,
                "restore_bandwidth_Bps": bandwidth(raw["bytes"], rt),
                "raw_bandwidth_Bps": bandwidth(raw["bytes"], wt),
                "restore_vs_raw_bandwidth": wt / rt,
            }
            print(
                f"readers: {reader} restore {raw['bytes'] / rt / 1e9:.2f} GB/s, raw "
                f"{raw['bytes'] / wt / 1e9:.2f} GB/s",
                flush=True,
            )
        if "restore" in readers.get("kvikio", {}):
            k, p = readers["kvikio"], readers["posix"]
            readers["kvikio_vs_posix_restore"] = (
                p["restore"]["ttft_s"]["median"] / k["restore"]["ttft_s"]["median"]
            )
            readers["kvikio_vs_posix_raw"] = p["raw"]["s"]["median"] / k["raw"]["s"]["median"]
        return readers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=16384, help="state size (default 16384: 1 GiB)")
    p.add_argument("--layer-tokens", type=int, default=8192, help="per-layer state (8192: 1 GiB)")
    p.add_argument("--window", "-W", type=int, default=8)
    p.add_argument("--io-depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", required=True, help="directory on the disk to measure")
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--keep", action="store_true", help="keep the saved state")
    ns = p.parse_args(argv)
    figures = Figures(ns)
    try:
        doc = anyio.run(figures.run)
    finally:
        if not ns.keep:
            shutil.rmtree(figures.root, ignore_errors=True)
    write_json(ns.json, doc)
    print(f"JSON: {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
