"""The child side of every ``--engine vllm`` section: one entry point, one engine builder, one
connector config, the timing of one request.

A section's child runs as ``python -m bsr_bench.vllm_engine MODULE SPEC OUT`` under the
interpreter that has vLLM (:func:`.vllm_common.run_child` starts it): this module reads the spec
(JSON) from ``SPEC``, calls ``MODULE.child(spec)``, writes the result it returns to ``OUT`` and,
when it returns an engine too, shuts that engine down in order (the connector waits for its
saves) and exits at once (a thread of a hung store is never joined). A child that fails raises:
its traceback goes to stderr, the process exits non-zero, ``OUT`` is not written, and the bench
side reports the most specific line of stderr (:func:`.vllm_common.root_cause`), where vLLM's
engine core process writes its own errors too.

Nothing here imports vLLM until a function that needs it runs.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .vllm_common import object_files, tokens

#: what a section's ``child(spec)`` returns: its result (JSON), and the in-process ``LLM`` to
#: shut down after the result is written (None: no engine, e.g. a ``vllm serve`` fleet)
Outcome = tuple[dict[str, Any], Any]
USAGE = "usage: python -m bsr_bench.vllm_engine MODULE SPEC OUT (MODULE: bsr_bench.vllm_...)"


# --------------------------------------------------------------------------- the entry point
def main(argv: list[str]) -> None:
    """``MODULE SPEC OUT``: run ``MODULE.child`` on the spec, write its result, stop its engine."""
    if len(argv) != 3 or not argv[0].startswith("bsr_bench.vllm_"):
        raise SystemExit(USAGE)
    module, spec_path, out_path = argv
    section: Callable[[dict[str, Any]], Outcome] = importlib.import_module(module).child
    result, llm = section(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        sys.stdout.flush()
        os._exit(0)


# --------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class EngineSpec:
    """The arguments every bench engine shares: bf16, eager, no tokenizer, seed 0, a random
    model from a ``config.json`` (``load_format="dummy"``) unless ``dummy_weights`` is off.

    ``prefix_caching`` and ``log_stats``: None leaves vLLM's default (``LLM`` turns its stats
    off, ``vllm serve`` keeps them on; both enable the prefix cache). A section's other
    arguments go to :func:`start_llm` by name."""

    model: str
    max_model_len: int
    block_size: int
    kv_cache_bytes: int = 1 << 30
    dummy_weights: bool = True
    prefix_caching: bool | None = False
    log_stats: bool | None = None
    seed: int = 0

    def llm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``vllm.LLM``."""
        kw: dict[str, Any] = {
            "model": self.model,
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": "bfloat16",
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "seed": self.seed,
        }
        if self.dummy_weights:
            kw["load_format"] = "dummy"
        if self.prefix_caching is not None:
            kw["enable_prefix_caching"] = self.prefix_caching
        if self.log_stats is not None:
            kw["disable_log_stats"] = not self.log_stats
        return kw

    def serve_argv(self) -> list[str]:
        """The same engine as ``vllm serve`` flags (the server's address and the rest are the
        caller's)."""
        argv = [
            "--model", self.model, "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "bfloat16", "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--seed", str(self.seed),
        ]  # fmt: skip
        if self.dummy_weights:
            argv += ["--load-format", "dummy"]
        if self.prefix_caching is not None:
            argv.append(f"--{'' if self.prefix_caching else 'no-'}enable-prefix-caching")
        if self.log_stats is False:
            argv.append("--disable-log-stats")
        return argv


def start_llm(
    engine: EngineSpec, transfer: dict[str, Any] | None = None, **extra: Any
) -> tuple[Any, float]:
    """A ``vllm.LLM`` for ``engine`` with the KV transfer config ``transfer`` (a dict, e.g.
    :func:`bsr_transfer`'s; None: no connector) and the section's ``extra`` arguments; the
    engine and the seconds it took to start."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = engine.llm_kwargs()
    if transfer is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**transfer)
    t0 = time.perf_counter()
    llm = LLM(**kw, **extra)
    return llm, time.perf_counter() - t0


# --------------------------------------------------------------------------- the connector
def file_tier(path: str, capacity: int | str = 8 << 30, **more: Any) -> dict[str, Any]:
    """A FileTier's entry of a bsr config's ``tiers``."""
    return {"kind": "file", "path": str(path), "capacity_bytes": capacity, **more}


def bsr_config(
    tiers: list[dict[str, Any]], chunk_tokens: int, window: int = 8, io_depth: int = 4, **more: Any
) -> dict[str, Any]:
    """A bsr config (the connector's ``"bsr"`` key) with the bench's usual window and depth."""
    return {"tiers": tiers, "chunk_tokens": chunk_tokens, "window": window,
            "io_depth": io_depth, **more}  # fmt: skip


def bsr_transfer(
    bsr: dict[str, Any],
    *,
    role: str = "kv_both",
    options: dict[str, Any] | None = None,
    connector: str = "BsrConnector",
    module: str = "bsr.vllm",
) -> dict[str, Any]:
    """vLLM's KV transfer config (as a dict: ``KVTransferConfig(**it)``, or the JSON of
    ``--kv-transfer-config``) of bsr's connector over the bsr config ``bsr``: a failed load
    recomputes; ``options``: the connector's own (``"bsr_connector"``: ``load``, ``save``,
    ``warm_address``; None: none given); ``connector``/``module``: a subclass of it."""
    extra: dict[str, Any] = {"bsr": bsr}
    if options is not None:
        extra["bsr_connector"] = options
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


# --------------------------------------------------------------------------- requests
def first_token(extra_args: dict[str, Any] | None = None) -> Any:
    """Greedy sampling of one token (no detokenizer), with ``extra_args`` for the connector."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra_args
    )


def timed_generate(llm: Any, prompt: list[int], params: Any) -> tuple[float, int]:
    """The wall time of ``LLM.generate`` for one prompt of token ids (with :func:`first_token`:
    the TTFT of an idle engine) and the tokens vLLM found cached for it."""
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - t, int(out.num_cached_tokens or 0)


def suffixed(prefix: list[int], suffix_tokens: int, seed: int, i: int, vocab: int) -> list[int]:
    """``prefix`` and a fresh suffix, the ``i``-th of the run's ``seed``."""
    return prefix + tokens(suffix_tokens, seed * 7919 + i, vocab)


def restore_until_hit(ask: Callable[[int], tuple[float, int]], n: int) -> None:
    """Untimed requests ``ask(-2)``, ``ask(-3)``, ... (up to ten) until one finds ``n`` tokens
    cached: a stored object is visible on disk before the tier has indexed it."""
    for i in range(10):
        if ask(-2 - i)[1] >= n:
            return
        time.sleep(0.2)


def wait_for_objects(store: str, want: int, timeout_s: float, poll_s: float = 0.05) -> int:
    """Wait until the FileTier at ``store`` holds ``want`` object files, ``timeout_s`` at most;
    how many it holds then."""
    deadline = time.monotonic() + timeout_s
    while (n := object_files(store)) < want and time.monotonic() < deadline:
        time.sleep(poll_s)
    return n


def settle(store: str, timeout_s: float = 120.0, *, nonempty: bool = False) -> None:
    """Wait until the saves after a request have landed: the FileTier's object count unchanged
    over five polls 0.2 s apart (with ``nonempty``, and above zero), ``timeout_s`` at most."""
    end, last, stable = time.monotonic() + timeout_s, -1, 0
    while time.monotonic() < end and stable < 5:
        n = object_files(store)
        stable = stable + 1 if n == last and (n > 0 or not nonempty) else 0
        last = n
        time.sleep(0.2)


def metric_values(llm: Any, name: str) -> dict[str, float]:
    """A vLLM metric of an in-process ``LLM`` (``llm.get_metrics()``), summed per label values
    other than ``engine`` and ``model_name`` (joined by commas: a ``tier``, a ``choice``)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "value"):
            key = ",".join(
                f"{v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
            )
            out[key] = out.get(key, 0.0) + float(m.value)
    return out


def loaded_bytes(llm: Any) -> float:
    """The bytes bsr's loads have read so far, every tier (``vllm:bsr_loaded_bytes``)."""
    return sum(metric_values(llm, "vllm:bsr_loaded_bytes").values())


if __name__ == "__main__":
    main(sys.argv[1:])
