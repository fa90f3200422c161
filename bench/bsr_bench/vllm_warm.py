"""``bsr bench --engine vllm --vllm-warm``: a returning turn's TTFT from a FileTier, with and
without a router's warm hint and with promotion.

Where it runs: two child engines of the interpreter that has vLLM (:mod:`.vllm_common`), one
after the other (vLLM's engine core, and so bsr's worker and its warm endpoint, in a process of
its own, as ``vllm serve`` runs it).

How it works: a random-weight Llama (the TTFT model of :mod:`.vllm_ttft`; vLLM's own prefix
cache off, so every returning turn either recomputes or goes through bsr) first runs as the
**store** engine: one request per conversation (a ``prefix`` of each ``--vllm-prefixes`` length,
``--vllm-repeats`` conversations per variant) saves its KV into a FileTier. Then the **measure**
engine serves over a host tier above that FileTier, with saves off (a save writes a finished
request through to every tier, the host tier too: here only warms and promotions fill it),
``promote="always"`` and the warm endpoint on a loopback port. For each prefix length and
repeat, with the store's files dropped from the page cache (``POSIX_FADV_DONTNEED``) before
each returning turn:

* **recompute**: a prefix that was never stored: the whole prompt is prefilled;
* **cold**: a stored conversation's returning turn, no warm: its prefix is read from the FileTier
  (then promoted into the host tier, off the request's path);
* **promoted**: the same conversation's next returning turn: read from the host tier;
* **warm (lead L)**: for each ``--vllm-warm-leads`` L (ms), another stored conversation: the
  router's ``POST /bsr/warm`` (``"wait": false``) L ms before its returning turn; with L = 0 the
  turn joins the warm in flight rather than reading twice.

A sample is the wall time of ``LLM.generate`` for ``prefix + 32 new tokens`` with
``max_tokens=1`` (the TTFT of an idle engine); the bytes each turn read per tier come from the
connector's ``vllm:bsr_loaded_bytes`` counter. The JSON (``bench/results/vllm-warm-*.json``)
keeps every sample, medians, and ratios of medians measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .common.stats import BenchError, Dist, load_average, ratio
from .common.workers import free_port
from .vllm_common import object_files, run_child, tokens, vllm_python, vllm_version
from .vllm_engine import (
    EngineSpec,
    Outcome,
    bsr_config,
    bsr_transfer,
    file_tier,
    first_token,
    metric_values,
    start_llm,
    suffixed,
    timed_generate,
    wait_for_objects,
)
from .vllm_ttft import BLOCK_SIZE, CHUNK_TOKENS, MODEL, SUFFIX_TOKENS

DEFAULT_LEADS_MS = (0, 50, 200)
#: the connector's bytes read by loads, per tier
LOADED = "vllm:bsr_loaded_bytes"
#: the measure engine's host tier (room for every conversation of a default run)
HOST_BYTES = 4 << 30


# --------------------------------------------------------------------------- child side
def _transfer(spec: dict[str, Any]) -> dict[str, Any]:
    tiers = [file_tier(spec["store"], 16 << 30)]
    opts: dict[str, Any] = {"load": "async"}
    more: dict[str, Any] = {}
    if spec["phase"] == "measure":
        tiers.insert(0, {"kind": "host", "capacity_bytes": HOST_BYTES})
        opts.update(save=False, warm_address=f"127.0.0.1:{spec['port']}")
        more["promote"] = "always"
    return bsr_transfer(bsr_config(tiers, CHUNK_TOKENS, **more), options=opts)


def conversation(spec: dict[str, Any], n: int, r: int, k: int) -> list[int]:
    """The prefix of conversation ``k`` of repeat ``r`` at length ``n`` (k = 0: cold then
    promoted; k = 1 + i: warm lead i)."""
    return tokens(n, spec["seed"] * 1_000_003 + n * 1009 + r * 31 + k, MODEL["vocab_size"])


def _drop_page_cache(root: str) -> None:
    for p in Path(root).glob("objects/**/*.bsr"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(port: int, prefix: list[int]) -> None:
    body = json.dumps({"prompt_token_ids": prefix, "wait": False}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/bsr/warm", data=body,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        if resp.status != 202:
            raise RuntimeError(f"the warm endpoint answered {resp.status}")


class _Asker:
    """Timed requests of one engine, each with the bytes it read per tier."""

    def __init__(self, llm: Any, spec: dict[str, Any]) -> None:
        self.llm, self.spec = llm, spec
        self.params = first_token()
        self.asked = 0

    def ask(self, prefix: list[int]) -> dict[str, Any]:
        self.asked += 1
        prompt = suffixed(prefix, SUFFIX_TOKENS, self.spec["seed"], self.asked, MODEL["vocab_size"])
        before = metric_values(self.llm, LOADED)
        s, cached = timed_generate(self.llm, prompt, self.params)
        after = metric_values(self.llm, LOADED)
        read = {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v > before.get(k, 0.0)}
        return {"ttft_s": s, "cached": cached, "bytes_by_tier": read}


def _store(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    ask = _Asker(llm, spec)
    want = 0
    for n in spec["prefixes"]:
        for r in range(spec["repeats"]):
            for k in range(1 + len(spec["leads_ms"])):
                ask.ask(conversation(spec, n, r, k))
                want += n // CHUNK_TOKENS
    wait_for_objects(spec["store"], want, 300)
    return {"objects": object_files(spec["store"]), "expected_objects": want}


def _measure(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    ask = _Asker(llm, spec)
    points = []
    ask.ask(tokens(256, 1, MODEL["vocab_size"]))  # warm-up: first-touch, thread pools
    for n in spec["prefixes"]:
        point: dict[str, Any] = {"prefix_tokens": n, "recompute": [], "cold": [], "promoted": []}
        point["warm"] = {str(lead): [] for lead in spec["leads_ms"]}
        for r in range(spec["repeats"]):
            point["recompute"].append(ask.ask(tokens(n, 10**6 + n + r, MODEL["vocab_size"])))
            _drop_page_cache(spec["store"])
            point["cold"].append(ask.ask(conversation(spec, n, r, 0)))
            time.sleep(spec["settle_s"])  # the promotion runs off the request's path
            point["promoted"].append(ask.ask(conversation(spec, n, r, 0)))
            for i, lead in enumerate(spec["leads_ms"]):
                prefix = conversation(spec, n, r, 1 + i)
                _drop_page_cache(spec["store"])
                _warm(spec["port"], prefix)
                time.sleep(lead / 1000)
                point["warm"][str(lead)].append(ask.ask(prefix))
        points.append(point)
    return {"points": points}


def child(spec: dict[str, Any]) -> Outcome:
    """One engine (child process): the store phase or the measure phase."""
    load_start = load_average()
    engine = EngineSpec(
        spec["model"], max(spec["prefixes"]) + 2 * SUFFIX_TOKENS, BLOCK_SIZE, log_stats=True
    )
    llm, start_s = start_llm(engine, _transfer(spec))
    result: dict[str, Any] = {"phase": spec["phase"], "start_s": start_s}
    result.update((_store if spec["phase"] == "store" else _measure)(llm, spec))
    result["load_average"] = [load_start, load_average()]
    return result, llm


# --------------------------------------------------------------------------- bench side
def run_warm(
    python: str,
    prefixes: tuple[int, ...],
    repeats: int,
    leads_ms: tuple[int, ...],
    seed: int,
) -> dict[str, Any]:
    """The warm section: the store engine, then the measure engine; its record."""
    work = Path(tempfile.mkdtemp(prefix="bsr-vllm-warm-"))
    t0 = time.perf_counter()
    try:
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(MODEL))
        port = free_port()
        spec = {
            "model": str(work / "model"), "store": str(work / "store"),
            "prefixes": list(prefixes), "repeats": repeats, "leads_ms": list(leads_ms),
            "seed": seed, "port": port, "settle_s": 0.5,
        }  # fmt: skip
        section = "bsr_bench.vllm_warm"
        stored = run_child(python, section, {**spec, "phase": "store"}, work, "store", 1800)
        if "error" in stored:
            raise BenchError(f"the store engine failed: {stored['error']}")
        if stored["objects"] < stored["expected_objects"]:
            raise BenchError(f"the store engine saved {stored['objects']} of the objects")
        measured = run_child(python, section, {**spec, "phase": "measure"}, work, "measure", 1800)
        if "error" in measured:
            raise BenchError(f"the measure engine failed: {measured['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return warm_section(measured, leads_ms, time.perf_counter() - t0)


def _dist(samples: list[dict[str, Any]]) -> dict[str, Any]:
    d = Dist.of([s["ttft_s"] for s in samples]).to_dict()
    tiers: dict[str, int] = {}
    for s in samples:
        for t, n in s["bytes_by_tier"].items():
            tiers[t] = tiers.get(t, 0) + int(n)
    return {
        "ttft_s": d, "cached_tokens": [s["cached"] for s in samples],
        "bytes_by_tier": tiers, "samples": samples,
    }  # fmt: skip


def warm_section(
    measured: dict[str, Any], leads_ms: tuple[int, ...], duration_s: float
) -> dict[str, Any]:
    """The section's record: per prefix length, each variant's distribution and the ratios of
    medians against the cold returning turn and against recompute."""
    points = []
    for p in measured["points"]:
        variants = {
            "recompute": _dist(p["recompute"]),
            "cold": _dist(p["cold"]),
            "promoted": _dist(p["promoted"]),
            **{f"warm_{lead}ms": _dist(p["warm"][str(lead)]) for lead in leads_ms},
        }
        med = {k: v["ttft_s"]["median"] for k, v in variants.items()}
        points.append({
            "prefix_tokens": p["prefix_tokens"],
            "variants": variants,
            "ratios": {
                "cold_vs_recompute": ratio(med["cold"], med["recompute"], "cold/recompute"),
                "promoted_vs_cold": ratio(med["promoted"], med["cold"], "promoted/cold"),
                **{
                    f"warm_{lead}ms_vs_cold": ratio(
                        med[f"warm_{lead}ms"], med["cold"], f"warm {lead} ms/cold"
                    )
                    for lead in leads_ms
                },
            },
        })  # fmt: skip
    return {
        "points": points,
        "leads_ms": list(leads_ms),
        "engine_start_s": measured.get("start_s"),
        "load_average": measured.get("load_average"),
        "duration_s": duration_s,
        "page_cache": "the store's files dropped (POSIX_FADV_DONTNEED) before each returning turn",
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM warm and promote (--engine vllm --vllm-warm)")
    g.add_argument(
        "--vllm-warm",
        action="store_true",
        help="a returning turn's TTFT from a FileTier: no warm, a router's warm hint L ms "
        "before the request, promotion, recompute; needs vLLM",
    )
    g.add_argument(
        "--vllm-warm-leads",
        default=None,
        help="warm lead times in ms, comma-separated (default 0,50,200)",
    )


def _plan(ns: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(ns, "quick", False))
    try:
        prefixes = (
            tuple(int(x) for x in ns.vllm_prefixes.split(","))
            if getattr(ns, "vllm_prefixes", None)
            else ((2048,) if quick else (2048, 8192))
        )
        leads = (
            tuple(int(x) for x in ns.vllm_warm_leads.split(","))
            if getattr(ns, "vllm_warm_leads", None)
            else DEFAULT_LEADS_MS
        )
    except ValueError:
        raise BenchError(
            "--vllm-prefixes and --vllm-warm-leads take comma-separated integers"
        ) from None
    if any(n < CHUNK_TOKENS or n % CHUNK_TOKENS for n in prefixes):
        raise BenchError(f"--vllm-prefixes must be multiples of {CHUNK_TOKENS}, got {prefixes}")
    if not leads or any(v < 0 for v in leads) or len(set(leads)) != len(leads):
        raise BenchError(f"--vllm-warm-leads takes distinct lead times >= 0 ms, got {leads}")
    repeats = getattr(ns, "vllm_repeats", None)
    repeats = (2 if quick else 5) if repeats is None else repeats
    if repeats < 1:
        raise BenchError(f"--vllm-repeats must be >= 1, got {repeats}")
    return {"prefixes": prefixes, "leads_ms": leads, "repeats": repeats}


def run_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """``bsr bench --engine vllm --vllm-warm``: run, write the JSON, print the table."""
    from .common.machine import commit_info, machine_info  # not in the child: psutil, torch

    plan = _plan(ns)
    python = vllm_python(getattr(ns, "vllm_python", None))
    version = vllm_version(python)
    seed = int(getattr(ns, "seed", 0) or 0)
    machine, commit = machine_info(), commit_info()
    warm = run_warm(python, plan["prefixes"], plan["repeats"], plan["leads_ms"], seed)
    machine["load_average_end"] = load_average()
    doc = {
        "kind": "vllm_warm",
        "vllm": version,
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": CHUNK_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "repeats": plan["repeats"],
        "seed": seed,
        "argv": sys.argv[1:],
        "warm": warm,
        "machine": machine,
        "commit": commit,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(getattr(ns, "json", None) or f"bench/results/vllm-warm-{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    doc["json_path"] = str(path)
    print_table(doc)
    return doc


def print_table(doc: dict[str, Any]) -> None:
    warm = doc["warm"]
    names = ["recompute", "cold", "promoted", *(f"warm_{v}ms" for v in warm["leads_ms"])]
    print(
        f"vLLM {doc['vllm']} CPU, random Llama, returning-turn TTFT median (s) of "
        f"{doc['repeats']}; bytes read per tier over the repeats"
    )
    print(f"{'prefix':>7} " + " ".join(f"{n:>14}" for n in names))
    for p in warm["points"]:
        v = p["variants"]
        print(
            f"{p['prefix_tokens']:>7} "
            + " ".join(f"{v[n]['ttft_s']['median']:>14.4f}" for n in names)
        )
        print(f"{'':>7} " + " ".join(f"{_tiers(v[n]['bytes_by_tier']):>14}" for n in names))
        print(f"{'':>7} ratios: {p['ratios']}")
    print(f"JSON: {doc['json_path']}")


def _tiers(by_tier: dict[str, int]) -> str:
    return ",".join(f"{t}:{n >> 20}M" for t, n in sorted(by_tier.items())) or "-"
