"""Run one vLLM CPU engine (own process) over a spec and write its outputs as JSON.

Used by the vLLM tests and the ``bsr bench --engine vllm`` runner: each engine starts in a fresh
process (vLLM spawns workers; a test process must not hold an engine). Usage:
``python run_engine.py spec.json out.json``. The spec names the model directory (a
``config.json`` only: random weights, no download), the connector config (or none), batches of
prompts, and store actions to apply after the engine started (``damage``, ``evict``, ``fifo``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: what a damaged object holds in place of KV: 1024 bfloat16 values of 32768.0
DAMAGE = b"\x00\x47" * 1024


def store_objects(root: str) -> list[Path]:
    """Object files of a FileTier root, or of the per-rank roots below it (TP > 1)."""
    return sorted(p for p in Path(root).glob("**/objects/**/*.bsr") if p.is_file())


def apply(action: dict[str, Any]) -> int:
    """Change a file store behind the running engine's back; returns how many objects."""
    objs = store_objects(action["path"])
    for p in objs:
        if action["kind"] == "damage":  # overwrite payload bytes (the 4 KiB header stays)
            with open(p, "r+b") as f:
                f.seek(4096 + 16)
                f.write(DAMAGE)
        elif action["kind"] == "evict":
            p.unlink()
        elif action["kind"] == "fifo":  # a hung store: opening blocks until a writer shows up
            p.unlink()
            os.mkfifo(p)
    return len(objs)


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    kw: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="BsrConnector",
            kv_connector_module_path="bsr.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        load_format=spec.get("load_format", "dummy"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 2048),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        disable_hybrid_kv_cache_manager=spec.get("disable_hybrid", None),
        **kw,
    )
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0, "actions": [], "batches": []}
    for action in spec.get("after_start", []):
        out["actions"].append(apply(action))
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
    )
    for batch in spec["batches"]:
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params)
        rows = []
        for o in outs:
            m = o.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            rows.append(
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "cached": o.num_cached_tokens,
                    "ttft_s": ttft,
                }
            )
        out["batches"].append({"rows": rows, "wall_s": time.perf_counter() - t1})
    # saves run after each request, in the background: a store run waits for its objects (a
    # shutdown right after the last request could come before its save was even dispatched)
    if spec.get("await_objects"):
        path, count = spec["await_objects"]
        deadline = time.monotonic() + 180
        while len(store_objects(path)) < count and time.monotonic() < deadline:
            time.sleep(0.2)
    Path(out_path).write_text(json.dumps(out))
    # an orderly shutdown (the connector waits for its saves), then exit even if a thread of a
    # deliberately hung store can never be joined
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
