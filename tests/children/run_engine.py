"""Run one vLLM CPU engine (own process) over a spec and write its outputs as JSON.

Used by the vLLM tests (``vllm_engines.run``): each engine starts in a fresh process, a fork of
``engine_forks.py`` or a new interpreter (a test process must not hold an
engine). Usage: ``python run_engine.py spec.json out.json``. The spec names the model directory (a
``config.json`` only: random weights, no download), the connector config (or none) and its
class, role and failure policy, store actions to apply after the engine started (``damage``,
``evict``, ``fifo``; ``warm``: a router's warm hint), and either batches of prompts
(``llm.generate``; a prompt may continue an earlier one with the tokens generated for it: the
next turn of a conversation) or a ``script``:
steps driven one engine step at a time, for aborts, hung stores and requests added while others run
(see :func:`run_script`). With ``log_stats`` the run also reports vLLM's metrics (bsr's
``vllm:bsr_*`` counters, preemptions) after each batch or where the script asks. ``generate``
runs single requests with a LoRA adapter and a ``cache_salt`` each; ``key_partition`` runs
``bsr.testing.check_key_partition`` in the engine's process (:func:`run_key_partition`).
``add_loras`` loads adapters into the engine's worker right after it started (as ``vllm serve
--lora-modules`` does), ``dtype`` sets the model's (bfloat16 by default).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: what a damaged object holds in place of KV: 1024 bfloat16 values of 32768.0
DAMAGE = b"\x00\x47" * 1024
#: where an object's header keeps the digest of its state group (magic, version, flags,
#: namespace, key come first)
GROUP_OFFSET = 8 + 2 + 2 + 16 + 32
#: the metrics a run reports (name prefixes)
METRICS = (
    "vllm:bsr_",
    "vllm:num_preemptions",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens_cached_by_source",
)


def store_objects(root: str) -> list[Path]:
    """Object files of a FileTier root, or of the per-rank roots below it (TP > 1)."""
    return sorted(p for p in Path(root).glob("**/objects/**/*.bsr") if p.is_file())


def group_digest(group: str) -> bytes:
    """The digest of a state group name in an object's header (bsr's object format)."""
    return hashlib.blake2b(group.encode(), digest_size=16, person=b"bsr-group").digest()


def of_group(path: Path, group: str) -> bool:
    """Whether the object file at ``path`` holds state group ``group`` (its header says)."""
    with open(path, "rb") as f:
        f.seek(GROUP_OFFSET)
        return f.read(16) == group_digest(group)


def apply(action: dict[str, Any]) -> Any:
    """Change a file store behind the running engine's back; returns how many objects.

    ``group``: only the objects of that bsr state group (e.g. ``"kv0"``, vLLM's first KV cache
    group). ``warm``: POST ``body`` to the worker's warm endpoint at ``address`` as a router
    would; returns ``[HTTP status, answer]``.
    """
    if action["kind"] == "warm":
        return warm(action["address"], action["body"])
    if action["kind"] == "wait_objects":  # until the saves so far have landed
        deadline = time.monotonic() + 180
        while len(store_objects(action["path"])) < action["count"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {action['count']} objects after 180 s")
            time.sleep(0.1)
        return action["count"]
    if action["kind"] not in ("damage", "evict", "fifo"):
        raise ValueError(f"unknown store action {action['kind']!r}")
    objs = store_objects(action["path"])
    if action.get("group") is not None:
        objs = [p for p in objs if of_group(p, action["group"])]
    for p in objs:
        if action["kind"] == "damage":  # overwrite payload bytes (the 4 KiB header stays)
            with open(p, "r+b") as f:
                f.seek(4096 + 16)
                f.write(DAMAGE)
        elif action["kind"] == "evict":
            p.unlink()
        elif action["kind"] == "fifo":  # an open that would block (bsr refuses non-files)
            p.unlink()
            os.mkfifo(p)
    return len(objs)


def warm(address: str, body: dict[str, Any]) -> list[Any]:
    """``POST /bsr/warm`` (the connector's warm endpoint); ``[status, JSON answer]``."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://{address}/bsr/warm", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return [resp.status, json.loads(resp.read())]
    except urllib.error.HTTPError as exc:
        return [exc.code, json.loads(exc.read() or b"{}")]


def metrics(llm: Any) -> dict[str, float]:
    """vLLM's in-process Prometheus metrics that the tests read, ``name{label=value}``."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith(METRICS) or not hasattr(m, "value"):
            continue
        extra = {k: v for k, v in m.labels.items() if k not in ("model_name", "engine")}
        labels = ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
        out[f"{m.name}{{{labels}}}" if labels else m.name] = m.value
    return out


def row(o: Any) -> dict[str, Any]:
    m = o.metrics
    return {
        "tokens": list(o.outputs[0].token_ids),
        "cached": o.num_cached_tokens,
        "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None,
        "finished": bool(o.finished),
        "reason": o.outputs[0].finish_reason,
    }


def run_script(llm: Any, script: list[dict[str, Any]], params: Any) -> dict[str, Any]:
    """Drive the engine one step at a time.

    Ops: ``add`` (id, prompt, max_tokens, optional ``lora``: ``[name, id, path]``), ``abort``
    (ids), ``touch`` / ``rm`` (path),
    ``wait_file`` (path, timeout: wait without stepping; the engine core runs on its own),
    ``sleep`` (s), ``action`` (a store action), ``metrics`` (name), ``note`` (name, exists: a
    path; records whether it exists now), and ``run`` (until: ids that must finish, or
    ``min_tokens`` each; ``watchdog``: after that many seconds remove ``release`` and record
    that the watchdog fired, so a stalled engine fails the test instead of hanging it). Each
    row keeps ``times``: when its outputs arrived, ``[seconds since the script began, tokens
    so far]``, and ``added_s``: when it was added.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    engine = llm.llm_engine
    rows: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"rows": rows, "notes": {}, "metrics": {}, "waits": {}}
    began = time.monotonic()
    for op in script:
        kind = op["op"]
        if kind == "add":
            p = SamplingParams(
                max_tokens=op.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                detokenize=False,
            )  # fmt: skip
            lora = op.get("lora")
            engine.add_request(
                op["id"], TokensPrompt(prompt_token_ids=op["prompt"]), p,
                lora_request=None if lora is None else LoRARequest(*lora),
            )  # fmt: skip
            rows[op["id"]] = {
                "tokens": [], "cached": None, "finished": False, "reason": None, "times": [],
                "added_s": time.monotonic() - began,
            }  # fmt: skip
        elif kind == "abort":
            engine.abort_request(op["ids"])
            for rid in op["ids"]:
                rows[rid]["aborted"] = True
        elif kind == "touch":
            Path(op["path"]).touch()
        elif kind == "rm":
            Path(op["path"]).unlink(missing_ok=True)
        elif kind == "wait_file":
            end = time.monotonic() + op.get("timeout", 120)
            while not Path(op["path"]).exists() and time.monotonic() < end:
                time.sleep(0.05)
            out["waits"][op["path"]] = Path(op["path"]).exists()
        elif kind == "sleep":
            time.sleep(op["s"])
        elif kind == "action":
            apply(op["action"])
        elif kind == "metrics":
            out["metrics"][op["name"]] = metrics(llm)
        elif kind == "note":
            out["notes"][op["name"]] = Path(op["exists"]).exists()
        elif kind == "run":
            _run_until(engine, rows, op, out, began)
        else:
            raise ValueError(f"unknown script op {kind!r}")
    return out


def _run_until(
    engine: Any, rows: dict[str, Any], op: dict[str, Any], out: dict[str, Any], began: float
) -> None:
    ids = op["until"]
    min_tokens = op.get("min_tokens")
    fired = threading.Event()
    timer = None
    if "watchdog" in op:

        def release() -> None:
            fired.set()
            Path(op["release"]).unlink(missing_ok=True)

        timer = threading.Timer(op["watchdog"], release)
        timer.start()

    def done(rid: str) -> bool:
        r = rows[rid]
        if min_tokens is not None:
            return r["finished"] or len(r["tokens"]) >= min_tokens
        return bool(r["finished"])

    try:
        while not all(done(rid) for rid in ids) and engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id in rows:
                    r = rows[o.request_id]
                    r.update(row(o))
                    r["times"].append([time.monotonic() - began, len(r["tokens"])])
    finally:
        if timer is not None:
            timer.cancel()
    if "watchdog" in op:
        out["notes"][f"watchdog:{op.get('name', ','.join(ids))}"] = fired.is_set()


def generate_each(
    llm: Any, items: list[dict[str, Any]], params: Any, cached: list[int] | None = None
) -> list[list[int]]:
    """Greedy tokens of each ``{"prompt", "lora": [name, id, path] | None, "cache_salt",
    "params": kv_transfer_params, "copy": [src dir, dst dir]}`` (``copy``: before the request,
    rewrite each file of ``dst`` in place with ``src``'s); vLLM's cached prompt tokens of each
    go to ``cached``."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    out = []
    for item in items:
        if item.get("copy"):
            src, dst = (Path(p) for p in item["copy"])
            for f in sorted(src.iterdir()):
                shutil.copyfile(f, dst / f.name)  # the same file (inode), new bytes
        request: dict[str, Any] = {"prompt_token_ids": item["prompt"]}
        if item.get("cache_salt"):
            request["cache_salt"] = item["cache_salt"]
        p = params
        if item.get("params") is not None:
            p = SamplingParams(
                max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                extra_args={"kv_transfer_params": item["params"]},
            )  # fmt: skip
        lora = item.get("lora")
        (o,) = llm.generate(
            [request], p, lora_request=None if lora is None else LoRARequest(*lora),
            use_tqdm=False,
        )  # fmt: skip
        out.append(list(o.outputs[0].token_ids))
        if cached is not None:
            cached.append(int(o.num_cached_tokens or 0))
        settle(llm)
    return out


def run_key_partition(llm: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """bsr's key-partition suite over this engine: ``cases`` (kind, a and b as ``{"name",
    "fields"}``, changes_output, prompt_tokens), ``chunk_tokens``, ``seed``; a save has landed
    once the FileTier root at ``store`` holds more objects."""
    from bsr.testing import LLMKeyClient, PartitionCase, Variant, check_key_partition
    from bsr.testing._key_partition import report_dict

    cases = [
        PartitionCase(
            c["kind"],
            Variant(c["a"]["name"], c["a"]["fields"]),
            Variant(c["b"]["name"], c["b"]["fields"]),
            c.get("changes_output", True),
            c.get("prompt_tokens", 200),
        )
        for c in spec["cases"]
    ]
    client = LLMKeyClient(llm, saves=lambda: len(store_objects(spec["store"])))
    reports = check_key_partition(
        client, cases, chunk_tokens=spec["chunk_tokens"], seed=spec["seed"]
    )
    return [report_dict(r) for r in reports]


def continued(
    prompt: list[int] | dict[str, Any], prompts: list[list[list[int]]], done: list[dict[str, Any]]
) -> list[int]:
    """A batch's prompt: a list of token ids, or the next turn of a conversation,
    ``{"after": [batch, row], "then": [...]}``: that earlier prompt, the tokens this engine
    generated for it, then ``then``."""
    if isinstance(prompt, list):
        return prompt
    b, r = prompt["after"]
    return [*prompts[b][r], *done[b]["rows"][r]["tokens"], *prompt["then"]]


#: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's
#: ``UniProcExecutor``): nothing steps it between this script's calls (see :func:`settle`)
IN_PROCESS = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def settle(llm: Any, timeout_s: float = 180.0) -> None:
    """Step a one-process engine until its core holds no request, as the core's own loop does
    in its process: a finished request's save is dispatched with the step after it finished and
    its blocks come back when the save is reported done. Gives up after ``timeout_s`` (a
    deliberately hung store). Nothing to do when the core runs in its own process."""
    if not IN_PROCESS:
        return
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.002)


def reset_prefix_cache(llm: Any) -> None:
    """Empty vLLM's prefix cache (once finished requests' saves have given their blocks back)."""
    deadline = time.monotonic() + 120
    settle(llm)
    while not llm.reset_prefix_cache():
        settle(llm, timeout_s=0.1)
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset: blocks still held")
        time.sleep(0.1)


def make_llm(spec: dict[str, Any]) -> Any:
    """The ``vllm.LLM`` the spec describes (its connector, if it names one)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec.get("connector_class", "BsrConnector"),
            kv_connector_module_path=spec.get("connector_module", "bsr.vllm"),
            kv_role=spec.get("role", "kv_both"),
            kv_load_failure_policy=spec.get("failure_policy", "recompute"),
            kv_connector_extra_config=spec["connector"],
        )
    return LLM(
        model=spec["model"],
        load_format=spec.get("load_format", "dummy"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec.get("dtype", "bfloat16"),
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 2048),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        disable_hybrid_kv_cache_manager=spec.get("disable_hybrid"),
        disable_log_stats=not spec.get("log_stats", False),
        **spec.get("llm_args", {}),
        **kw,
    )


def run_batches(llm: Any, spec: dict[str, Any], params: Any, out: dict[str, Any]) -> None:
    """The spec's batches, in order, each with its actions and resets before it."""
    from vllm.inputs import TokensPrompt

    prompts: list[list[list[int]]] = []  # each batch's prompts, as run
    for i, batch in enumerate(spec.get("batches", [])):
        for action in spec.get("before_batch", {}).get(str(i), []):
            out["actions"].append(apply(action))
        if i in spec.get("reset_prefix_cache_before", []):  # vLLM forgets its own cache
            reset_prefix_cache(llm)
        batch = [continued(p, prompts, out["batches"]) for p in batch]
        prompts.append(batch)
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params)
        done = {"rows": [row(o) for o in outs], "wall_s": time.perf_counter() - t1}
        settle(llm)
        if spec.get("log_stats"):
            done["metrics"] = metrics(llm)
        out["batches"].append(done)


def await_results(llm: Any, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Saves run after each request, in the background: a store run waits for its objects (a
    shutdown right after the last request could come before its save was even dispatched),
    and for the files the spec names."""
    if spec.get("await_objects"):
        path, count = spec["await_objects"]
        deadline = time.monotonic() + 180
        while len(store_objects(path)) < count and time.monotonic() < deadline:
            settle(llm, timeout_s=0.2)
            time.sleep(0.2)
    for name, path in spec.get("await_files", {}).items():
        deadline = time.monotonic() + 180
        while not Path(path).exists() and time.monotonic() < deadline:
            settle(llm, timeout_s=0.1)
            time.sleep(0.1)
        out.setdefault("files", {})[name] = Path(path).read_text() if Path(path).exists() else None


def main(spec_path: str, out_path: str) -> None:
    from fork_start import keep_fork
    from vllm import SamplingParams

    keep_fork()
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = make_llm(spec)
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0, "actions": [], "batches": []}
    if spec.get("add_loras"):
        from vllm.lora.request import LoRARequest

        for lora in spec["add_loras"]:  # into the worker now, as vllm serve --lora-modules
            llm.llm_engine.add_lora(LoRARequest(*lora))
    for action in spec.get("after_start", []):
        out["actions"].append(apply(action))
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
    )
    if "script" in spec:
        out["script"] = run_script(llm, spec["script"], params)
    if "generate" in spec:
        out["generated_cached"] = []
        out["generated"] = generate_each(llm, spec["generate"], params, out["generated_cached"])
    if "key_partition" in spec:
        out["key_partition"] = run_key_partition(llm, spec["key_partition"])
    run_batches(llm, spec, params, out)
    if spec.get("reset_connector"):
        out["reset_connector"] = llm.llm_engine.reset_prefix_cache(reset_connector=True)
    await_results(llm, spec, out)
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
