"""Helpers of the vLLM tests: small random models written by transformers, engine runs.

Import with ``from vllm_engines import ...`` (``tests/`` is on pytest's ``pythonpath``). Each
engine runs in its own process (``tests/children/run_engine.py``), forked by a server that
imported vLLM once (:class:`EngineForks`); a test process never holds an engine. An engine runs
in that one process (vLLM's ``UniProcExecutor``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~2 s to
start where the engine core and its worker in processes of their own take ~17 s) unless its core
must run on its own: scripts, the key-partition client, tensor parallelism, or a spec with
``processes``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

RUN_ENGINE = Path(__file__).parent / "children" / "run_engine.py"
ENGINE_FORKS = Path(__file__).parent / "children" / "engine_forks.py"
#: the tests' own connector modules (gated_connector, hung_mount), which engine runs import
CONNECTORS = Path(__file__).parent / "vllm_connector"
#: the longest one engine run may take
RUN_TIMEOUT_S = 600


class EngineForks:
    """This test process's client of ``tests/children/engine_forks.py``: a process that
    imported vLLM once and forks a fresh child per engine run (each run as a new process would see
    it, less ~6 s of imports). Started on first use; it ends when this process does (its input
    closes). ``BSR_TEST_ENGINE_FORKS=0`` starts every run as a new interpreter instead."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._pending = b""  # answer bytes read from the server, not yet a whole line
        self._log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bsr-engine-forks-{os.getpid()}.log"
        #: the server ended under a run, or a run timed out: its log stays for reading
        self._keep_log = False
        atexit.register(self._drop_log)

    def _drop_log(self) -> None:
        """At exit: the server's log (start-up chatter) goes unless something went wrong."""
        if not self._keep_log:
            with contextlib.suppress(OSError):
                self._log.unlink()

    def _server(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._pending = b""
            with open(self._log, "a") as err:
                self._proc = subprocess.Popen(
                    [sys.executable, str(ENGINE_FORKS)], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                )  # fmt: skip
        return self._proc

    def _answer(self, proc: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
        """The server's next answer line. Read from the pipe's descriptor into our own buffer:
        ``select`` cannot see a line a buffered ``readline`` already took in with the one
        before it."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._keep_log = True
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._keep_log = True
                    raise RuntimeError(f"the engine fork server ended (its log: {self._log})")
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return dict(json.loads(line))

    def run(self, spec: Path, out: Path, log: Path, env: dict[str, str]) -> int:
        """Run ``run_engine.main(spec, out)`` in a fork with ``env``, its output in ``log``;
        its exit status (killed, and negative, past :data:`RUN_TIMEOUT_S`)."""
        proc = self._server()
        assert proc.stdin is not None
        req = {"spec": str(spec), "out": str(out), "log": str(log), "env": env}
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 120  # the server imports vLLM before its first answer
        pid = int(self._answer(proc, deadline)["pid"])
        try:
            return int(self._answer(proc, time.monotonic() + RUN_TIMEOUT_S)["rc"])
        except TimeoutError:  # the run and the processes it started (its own group)
            os.killpg(pid, signal.SIGKILL)
            return int(self._answer(proc, time.monotonic() + 60)["rc"])


_FORKS: EngineForks | None = None


def _forks() -> EngineForks:
    global _FORKS
    if _FORKS is None:
        _FORKS = EngineForks()
    return _FORKS


LLAMA = {  # a small random Llama: head_dim 64 (the CPU attention kernels need >= 32)
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: A tiny Gemma3 text model: layers 0 and 2 attend to a 64-token sliding window, 1 and 3 to
#: everything (vLLM's hybrid manager makes two KV cache groups of it).
GEMMA3 = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

#: A tiny DeepSeek-V2 (MLA: one 576-value latent per token and layer, no K/V halves). vLLM's CPU
#: MLA decode kernel needs ``kv_lora_rank=512`` and ``qk_rope_head_dim=64``; both layers dense
#: (``first_k_dense_replace``), so no MoE kernel runs.
DEEPSEEK_V2 = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def write_llama(path: Path, seed: int = 0, **overrides: Any) -> None:
    """Real random weights written by transformers (vLLM's dummy weights ignore the context)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))
    model.to(torch.bfloat16).save_pretrained(path)


def write_gemma3(path: Path, seed: int = 0, **overrides: Any) -> None:
    """A random tiny Gemma3 (sliding-window and full-attention layers), written by transformers."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**GEMMA3, **overrides}))
    model.to(torch.bfloat16).save_pretrained(path)


def write_deepseek_v2(path: Path, seed: int = 0, **overrides: Any) -> None:
    """A random tiny DeepSeek-V2 (MLA), written by transformers."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**DEEPSEEK_V2, **overrides}))
    model.to(torch.bfloat16).save_pretrained(path)


def write_lora(path: Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """A LoRA adapter for the :data:`LLAMA` model on q/k/v/o (random non-zero A and B, float32),
    in the layout peft's ``save_pretrained`` writes (``adapter_config.json``,
    ``adapter_model.safetensors``)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, heads = LLAMA["hidden_size"], LLAMA["num_attention_heads"]
    head_dim = hidden // heads
    kv = LLAMA["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden)}  # fmt: skip
    tensors = {}
    for layer in range(LLAMA["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(shapes),
        "base_model_name_or_path": "random-llama",
    }  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def toks(n: int, seed: int) -> list[int]:
    """``n`` random token ids in [3, 500) (clear of bos/eos/pad), reproducible by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def file_store_connector(path: Path, *, chunk: int, model_id: str, **opts: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for one FileTier store at ``path``."""
    return {
        "bsr": {
            "tiers": [{"kind": "file", "path": str(path), "capacity_bytes": 1 << 30}],
            "chunk_tokens": chunk,
            "window": 4,
            "io_depth": 2,
            "model_id": model_id,
        },
        "bsr_connector": {"lookup_timeout_s": 5.0, **opts},
    }


def run(tmp: Path, name: str, model: str = "model", **spec: Any) -> dict[str, Any]:
    """Run one engine over ``spec`` in its own process; its log is kept as ``<name>.log``."""
    spec["model"] = str(tmp / model)
    spec.setdefault("load_format", "auto")
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    out = tmp / f"{name}.out.json"
    env = dict(os.environ)
    # the tests' own connector modules (gated_connector) are importable in every engine process
    env["PYTHONPATH"] = os.pathsep.join([str(CONNECTORS), env.get("PYTHONPATH", "")])
    # one process (vLLM's UniProcExecutor inside the test's engine process: ~2 s to start instead
    # of ~17 s for two more processes, each importing vLLM) unless the run needs the engine core
    # to run on its own: a script waits without stepping, the key-partition client waits for
    # saves, TP > 1 has a process per rank, or the spec asks (``processes``)
    if not (
        spec.pop("processes", False)
        or "script" in spec
        or "key_partition" in spec
        or spec.get("tensor_parallel_size", 1) > 1
    ):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(spec.pop("env", {}))
    if spec.get("tensor_parallel_size", 1) > 1:  # one core per rank (auto binding refuses)
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores[:2])
    log = tmp / f"{name}.log"  # bsr's and vLLM's events
    code = _launch(tmp, name, out, log, env)
    if code == -signal.SIGILL:
        # an illegal instruction in the engine process (vLLM's CPU kernels: bsr has no native
        # code), seen now and then in CI runs on this VM, in different engine tests: the run is
        # started once more in a fresh process, the first one's log kept beside
        log.replace(tmp / f"{name}.sigill.log")
        out.unlink(missing_ok=True)
        warnings.warn(f"{name}: the engine process died of SIGILL; started once more", stacklevel=2)
        code = _launch(tmp, name, out, log, env)
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-6000:] if log.exists() else ""
        raise AssertionError(f"{name} run failed ({code}):\n{tail}")
    return dict(json.loads(out.read_text()))


def _launch(tmp: Path, name: str, out: Path, log: Path, env: dict[str, str]) -> int:
    """Run the engine of ``<name>.json`` once (a fork of the fork server, or a fresh process);
    its exit code (negative: the signal that ended it)."""
    if os.environ.get("BSR_TEST_ENGINE_FORKS", "1") == "0":
        with open(log, "w") as f:
            proc = subprocess.run(
                [sys.executable, str(RUN_ENGINE), str(tmp / f"{name}.json"), str(out)],
                stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, env=env,
            )  # fmt: skip
        return proc.returncode
    return int(_forks().run(tmp / f"{name}.json", out, log, env))


def tokens_of(result: dict[str, Any]) -> list[list[list[int]]]:
    """Generated tokens, per batch and prompt."""
    return [[r["tokens"] for r in b["rows"]] for b in result["batches"]]


def cached_of(result: dict[str, Any]) -> list[list[int]]:
    """vLLM's ``num_cached_tokens``, per batch and prompt."""
    return [[r["cached"] for r in b["rows"]] for b in result["batches"]]


def store_objects(root: Path) -> list[Path]:
    """Object files of a FileTier root, or of the per-rank roots below it (TP > 1)."""
    return sorted(p for p in root.glob("**/objects/**/*.bsr") if p.is_file())


def group_objects(root: Path, group: str) -> list[Path]:
    """The object files of ``root`` that hold bsr state group ``group`` (their header says;
    ``run_engine.of_group``, which the store actions use too)."""
    spec = importlib.util.spec_from_file_location("bsr_run_engine", RUN_ENGINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [p for p in store_objects(root) if module.of_group(p, group)]


# ------------------------------------------------------------------ shared prompts and store
CHUNK = 64  # two vLLM blocks of 32 (the CPU backend's smallest block size)
SHARED = toks(160, 99)
BATCH_A = [toks(200, 1), toks(128, 2), toks(40, 3), toks(100, 4)]
BATCH_B = [SHARED + toks(30, 100 + i) for i in range(12)]  # concurrent, one shared prefix
# what a restore run should restore: every full chunk, leaving one prompt token to compute
EXPECTED_A = [192, 64, 0, 64]
EXPECTED_B = 128  # the full chunks of the shared 160-token prefix
# full chunks of prompt + 7 computed output tokens: 3 + 2 + 0 + 1 for A, 2 shared + 12 for B
STORED_OBJECTS = 3 + 2 + 0 + 1 + 2 + 12
CHUNK_BYTES = CHUNK * 2 * 512  # 2 layers x (K + V of 2 heads x 64 dims, bfloat16) per token


def connector(path: Path, **opts: Any) -> dict[str, Any]:
    """One FileTier store at ``path``; the same model_id for every weight set (see the control
    test of test_connector.py)."""
    return file_store_connector(path, chunk=CHUNK, model_id="test-llama", **opts)


class Engines:
    """The shared model, its baseline and a written store; ``copy`` gives a test its own store.

    Built once per test session, whatever the number of pytest-xdist workers: the first worker
    to ask builds it in ``shared`` (under an exclusive lock) and writes ``engines.json`` last;
    the others wait on the lock and read that. ``tmp`` is this worker's own: the tests' engine
    runs, logs and store copies go there (``tmp/model`` links to the shared model)."""

    def __init__(self, shared: Path, tmp: Path) -> None:
        self.tmp = tmp
        self.store = shared / "store"
        done = shared / "engines.json"
        shared.mkdir(parents=True, exist_ok=True)
        with open(shared.parent / f"{shared.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not done.exists():
                write_llama(shared / "model")
                baseline = run(shared, "baseline", "model", batches=[BATCH_A, BATCH_B])
                stored = run(
                    shared,
                    "store",
                    "model",
                    connector=connector(self.store),
                    batches=[BATCH_A, BATCH_B],
                    await_objects=[str(self.store), STORED_OBJECTS],
                )
                tmp_done = done.with_suffix(".tmp")
                tmp_done.write_text(json.dumps({"baseline": baseline, "stored": stored}))
                tmp_done.rename(done)
        runs = json.loads(done.read_text())
        self.baseline: dict[str, Any] = runs["baseline"]
        self.stored: dict[str, Any] = runs["stored"]
        (tmp / "model").symlink_to(shared / "model", target_is_directory=True)

    def run(self, name: str, **spec: Any) -> dict[str, Any]:
        spec.setdefault("batches", [])
        return run(self.tmp, name, "model", **spec)

    def copy(self, name: str) -> Path:
        """A private copy of the written store."""
        dst = self.tmp / name
        shutil.copytree(self.store, dst)
        return dst

    def baseline_tokens(self, prompt: list[int]) -> list[int]:
        """The no-connector run's greedy tokens for one of the shared prompts."""
        for batch, rows in zip([BATCH_A, BATCH_B], self.baseline["batches"]):
            for p, row in zip(batch, rows["rows"]):
                if p == prompt:
                    return list(row["tokens"])
        raise KeyError("not one of the baseline prompts")


def metric(snapshot: dict[str, float], name: str, **labels: str) -> float:
    """One counter of a run's metrics snapshot (``run_engine.metrics``); 0 if absent."""
    extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return float(snapshot.get(f"{name}{{{extra}}}" if extra else name, 0.0))


def batch_metric(result: dict[str, Any], i: int, name: str, **labels: str) -> float:
    """How much a counter grew during batch ``i`` of a run with ``log_stats``."""
    after = metric(result["batches"][i]["metrics"], name, **labels)
    before = metric(result["batches"][i - 1]["metrics"], name, **labels) if i else 0.0
    return after - before
