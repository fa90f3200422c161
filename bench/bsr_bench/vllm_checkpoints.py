"""``bsr bench --engine vllm --vllm-model gemma3-tiny``, section ``checkpoints``: what a
sliding-window group's window checkpoints cost in bytes and what they keep in hits.

Where it runs: the bench process only orchestrates; every engine runs in a child process of the
vLLM interpreter (:mod:`.vllm_engine` running :func:`child`), like the other ``--engine vllm``
sections.

How it works: the hybrid bench model (:data:`.vllm_hybrid_model.MODEL`: five sliding-window layers
to one full one, window 512; block 128, chunk 256) serves the same workload once per checkpoint
interval (``window_checkpoint_chunks``; ``none``: a sliding group keeps only the windows at the ends
a request reaches), each in a fresh engine over an empty FileTier store, vLLM's own prefix cache off
so that every hit is bsr's, one request at a time (each waits for the previous one's saves to land).
The workload: documents that several requests start from, each followed by a question of its own
(shared prefixes, diverging continuations), then every prompt once more. Per interval the child
reports each request's TTFT and the tokens vLLM took from bsr, the bytes bsr read
(``vllm:bsr_loaded_bytes``) and the objects and bytes of the store per state group. The bench side
computes, from the prompts alone, what an ideal prefix cache would serve (the longest prefix of full
chunks an earlier request computed, up to what a lookup asks for: every full chunk but the one with
the prompt's last token), and writes one JSON document with every sample."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .common.stats import BenchError, Dist
from .vllm_common import run_child, tokens, vllm_python
from .vllm_engine import (
    EngineSpec,
    Outcome,
    bsr_config,
    bsr_transfer,
    file_tier,
    first_token,
    loaded_bytes,
    settle,
    start_llm,
    timed_generate,
)

#: checkpoint intervals (chunks) run by default; None: no periodic checkpoints
DEFAULT_INTERVALS: tuple[int | None, ...] = (1, 2, 4, 8, 16, None)
#: document lengths (tokens): the shared prefixes (4, 6, 8 and 11 full chunks of 256)
DOCUMENTS = (1100, 1700, 2300, 2900)
#: question lengths (tokens): each document is asked each of them, one question per request;
#: each is longer than a chunk, so no prompt's own lookup end falls on its document's end
QUESTIONS = (300, 420, 560)


def parse_intervals(text: str) -> tuple[int | None, ...]:
    """``"1,2,4,none"`` -> ``(1, 2, 4, None)``."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "none":
            out.append(None)
            continue
        try:
            k = int(part)
        except ValueError:
            k = 0
        if k < 1:
            raise BenchError(
                f"--vllm-checkpoint-intervals takes positive chunk counts or 'none', got {part!r}"
            )
        out.append(k)
    if not out:
        raise BenchError("--vllm-checkpoint-intervals needs at least one interval")
    return tuple(out)


def workload(seed: int, vocab: int) -> list[list[int]]:
    """The prompts in order: every document's questions, then all of them once more."""
    first = [
        tokens(d, seed * 131 + i, vocab) + tokens(q, seed * 977 + i * 17 + j, vocab)
        for i, d in enumerate(DOCUMENTS)
        for j, q in enumerate(QUESTIONS)
    ]
    return first + [list(p) for p in first]


def ideal_hits(prompts: list[list[int]], chunk: int) -> list[int]:
    """Per prompt, the tokens an ideal prefix cache serves: the longest prefix of full chunks
    that an earlier prompt computed (its first ``len`` tokens: one token generated, none of it
    computed), up to every full chunk but the one with the prompt's last token."""
    out = []
    for i, p in enumerate(prompts):
        ask = (len(p) - 1) // chunk * chunk
        best = 0
        for q in prompts[:i]:
            n = 0
            while n + chunk <= min(ask, len(q)) and p[n : n + chunk] == q[n : n + chunk]:
                n += chunk
            best = max(best, n)
        out.append(best)
    return out


# --------------------------------------------------------------------------- child side
def _group_of(path: Path) -> str:
    """The digest of the state group an object file holds (its header says)."""
    with open(path, "rb") as f:
        f.seek(8 + 2 + 2 + 16 + 32)  # magic, version, flags, namespace, key
        return f.read(16).hex()


def _store(root: str) -> dict[str, dict[str, int]]:
    """Objects and bytes of a FileTier store, per state group name."""
    names = {}
    for i in range(16):  # the connector names vLLM's groups kv0, kv1, ...
        digest = hashlib.blake2b(f"kv{i}".encode(), digest_size=16, person=b"bsr-group")
        names[digest.hexdigest()] = f"kv{i}"
    out: dict[str, dict[str, int]] = {}
    for p in (Path(root) / "objects").glob("**/*.bsr"):
        if p.is_file():
            g = out.setdefault(names.get(_group_of(p), "other"), {"objects": 0, "bytes": 0})
            g["objects"] += 1
            g["bytes"] += p.stat().st_size
    return out


def child(spec: dict[str, Any]) -> Outcome:
    """One engine, one checkpoint interval: the workload one request at a time."""
    from .vllm_hybrid_model import BLOCK_SIZE, CHUNK_TOKENS

    bsr = bsr_config(
        [file_tier(spec["store"])], CHUNK_TOKENS, window_checkpoint_chunks=spec["every"]
    )
    engine = EngineSpec(spec["model"], spec["max_model_len"], BLOCK_SIZE, log_stats=True)
    llm, start_s = start_llm(engine, bsr_transfer(bsr))
    result: dict[str, Any] = {"every": spec["every"], "start_s": start_s}
    params = first_token()
    ttft, cached = [], []
    for prompt in spec["prompts"]:
        s, c = timed_generate(llm, prompt, params)
        ttft.append(s)
        cached.append(c)
        settle(spec["store"])
    result.update(
        ttft_s=ttft, cached_tokens=cached, loaded_bytes=loaded_bytes(llm),
        store=_store(spec["store"]),
    )  # fmt: skip
    return result, llm


# --------------------------------------------------------------------------- bench side
def run_checkpoints(ns: argparse.Namespace, python: str | None = None) -> dict[str, Any]:
    """Run one engine per interval; return the document's ``checkpoints`` section."""
    from .vllm_hybrid_model import CHUNK_TOKENS, MODEL

    intervals = parse_intervals(getattr(ns, "vllm_checkpoint_intervals", None) or "1,2,4,8,16,none")
    python = python or vllm_python(getattr(ns, "vllm_python", None))
    seed = int(getattr(ns, "seed", 0) or 0)
    prompts = workload(seed, MODEL["vocab_size"])
    ideal = ideal_hits(prompts, CHUNK_TOKENS)
    work = Path(tempfile.mkdtemp(prefix="bsr-vllm-checkpoints-"))
    runs = []
    try:
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(MODEL))
        for k in intervals:
            name = f"every-{k}"
            spec = {
                "model": str(work / "model"), "store": str(work / f"store-{name}"), "every": k,
                "prompts": prompts, "max_model_len": max(len(p) for p in prompts) + 64,
            }  # fmt: skip
            out = run_child(python, "bsr_bench.vllm_checkpoints", spec, work, name, 3600)
            if "error" in out:
                raise BenchError(f"the checkpoint interval {k} engine failed: {out['error']}")
            runs.append(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return section(runs, prompts, ideal)


def section(
    runs: list[dict[str, Any]], prompts: list[list[int]], ideal: list[int]
) -> dict[str, Any]:
    """The figures of each interval's run (the child's raw samples kept)."""
    half = len(prompts) // 2
    shared = [i for i in range(half) if ideal[i] > 0]  # first pass, a document asked again
    points = []
    for r in runs:
        cached, store = r["cached_tokens"], r["store"]
        full = max(store, key=lambda g: store[g]["objects"]) if store else None
        sliding = sum(v["bytes"] for g, v in store.items() if g != full)
        points.append(
            {
                "every": r["every"],
                "stored_bytes": sum(v["bytes"] for v in store.values()),
                "stored_bytes_sliding": sliding,
                "stored_bytes_full": store[full]["bytes"] if full else 0,
                "stored_objects": sum(v["objects"] for v in store.values()),
                "store_by_group": store,
                "loaded_bytes": r["loaded_bytes"],
                "hit_tokens_first_pass": sum(cached[:half]),
                "hit_tokens_second_pass": sum(cached[half:]),
                "hit_rate_shared": _rate(cached, ideal, shared),
                "hit_rate_again": _rate(cached, ideal, range(half, len(prompts))),
                "ttft_s_shared": Dist.of([r["ttft_s"][i] for i in shared]).to_dict(),
                "ttft_s_again": Dist.of(r["ttft_s"][half:]).to_dict(),
                "cached_tokens": cached,
                "ttft_s": r["ttft_s"],
                "engine_start_s": r.get("start_s"),
            }
        )
    return {
        "documents": list(DOCUMENTS),
        "questions": list(QUESTIONS),
        "prompt_tokens": [len(p) for p in prompts],
        "ideal_tokens": ideal,
        "ideal_tokens_first_pass": sum(ideal[:half]),
        "ideal_tokens_second_pass": sum(ideal[half:]),
        "points": points,
    }


def _rate(cached: list[int], ideal: list[int], which: Any) -> float:
    want = sum(ideal[i] for i in which)
    return sum(cached[i] for i in which) / want if want else 0.0


def plot(sec: dict[str, Any], out_dir: Path) -> str:
    """Bytes stored and read against the share of the ideal hits kept, one point per interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sec["points"]
    labels = ["none" if p["every"] is None else str(p["every"]) for p in pts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("hit_rate_shared", "shared document"), ("hit_rate_again", "same prompt")):
        xs = [p["stored_bytes_sliding"] / 2**20 for p in pts]
        ax1.plot(xs, [p[key] for p in pts], "o-", label=label)
    for x, y, t in zip([p["stored_bytes_sliding"] / 2**20 for p in pts],
                       [p["hit_rate_shared"] for p in pts], labels):  # fmt: skip
        ax1.annotate(t, (x, y), textcoords="offset points", xytext=(4, -10))
    ax1.set(xlabel="MiB stored by the sliding-window groups", ylabel="restored / ideal tokens",
            title="hits kept per checkpoint interval (chunks)")  # fmt: skip
    ax2.bar(labels, [p["loaded_bytes"] / 2**20 for p in pts])
    ax2.set(xlabel="checkpoint interval (chunks)", ylabel="MiB read by restores",
            title="bytes read")  # fmt: skip
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "vllm_checkpoints.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def print_section(sec: dict[str, Any]) -> None:
    print(
        f"window checkpoints: {len(sec['documents'])} documents x {len(sec['questions'])} "
        "questions, then all again; MiB stored (sliding groups / full group), MiB read, "
        "restored / ideal tokens"
    )
    print(
        f"{'every':>6} {'MiB sliding':>12} {'MiB full':>9} {'MiB read':>9} "
        f"{'shared':>8} {'again':>8} {'TTFT shared':>12}"
    )
    for p in sec["points"]:
        every = "none" if p["every"] is None else str(p["every"])
        print(
            f"{every:>6} {p['stored_bytes_sliding'] / 2**20:>12.2f} "
            f"{p['stored_bytes_full'] / 2**20:>9.2f} {p['loaded_bytes'] / 2**20:>9.2f} "
            f"{p['hit_rate_shared']:>8.2f} {p['hit_rate_again']:>8.2f} "
            f"{p['ttft_s_shared']['median']:>11.3f}s"
        )
