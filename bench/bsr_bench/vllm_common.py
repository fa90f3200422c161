"""What the ``--engine vllm`` sections share: the vLLM interpreter and its child processes.

Every vLLM engine of the bench runs in a child process (``python -m bsr_bench.<module> ...``) of
an interpreter that has vLLM (``--vllm-python``, default ``.venv-vllm/bin/python`` when it
exists, else this one), because vLLM spawns workers and pins its own dependency stack. That
interpreter needs bsr, not the bench: the child finds this package through ``PYTHONPATH``
(:mod:`.common.workers`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common.stats import BenchError
from .common.workers import child_env


def vllm_python(given: str | None) -> str:
    """The interpreter that runs the engines."""
    if given:
        return given
    local = Path(".venv-vllm/bin/python")
    return str(local.absolute()) if local.exists() else sys.executable  # not resolve(): a venv


def vllm_version(python: str) -> str:
    """vLLM's version in ``python``; a :class:`BenchError` naming the fix when it has none."""
    check = subprocess.run(
        [python, "-c", "import vllm, bsr; print(vllm.__version__)"], capture_output=True, text=True
    )
    if check.returncode != 0:
        raise BenchError(
            f"{python} cannot import vllm and bsr; build the vLLM environment (make .venv-vllm) "
            "or pass --vllm-python"
        )
    return check.stdout.strip()


def object_files(root: str) -> int:
    """The object files a FileTier at ``root`` holds."""
    return sum(1 for _ in (Path(root) / "objects").glob("**/*.bsr"))


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` reproducible random token ids clear of the special ids 0-2 and the last one."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 1) for _ in range(n)]


def root_cause(stderr: str) -> str:
    """The most specific error line of a failed engine start."""
    lines = [ln.split("] ", 1)[-1].strip() for ln in stderr.splitlines()]
    for needle in ("only supported on", "Error:", "error:"):
        hits = [ln for ln in lines if needle in ln and "Engine core initialization" not in ln]
        if hits:
            return hits[0][:500]
    return (lines[-1] if lines else "no output")[:500]


def run_child(
    python: str, argv: list[str], spec: dict[str, Any], work: Path, name: str, timeout_s: float
) -> dict[str, Any]:
    """Run ``python -m <argv...> SPEC OUT`` and return OUT, or ``{"error": ..., ...}``."""
    spec_path, out = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    # vLLM's CPU build reserves one more core when a KV connector is configured: pinned, an
    # engine without bsr and one with it compute on the same number of threads
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **child_env()}
    try:
        proc = subprocess.run(
            [python, "-m", *argv, str(spec_path), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"{name} did not finish within {timeout_s:.0f} s", "returncode": None}
    if out.exists():
        return dict(json.loads(out.read_text()))
    return {"error": root_cause(proc.stderr), "returncode": proc.returncode}


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


def finish_child(llm: Any, out_path: str, result: dict[str, Any]) -> None:
    """Write a child's ``result`` to ``out_path``, shut its engine down in order (the connector
    waits for its saves), then exit at once (a thread of a hung store is never joined)."""
    from pathlib import Path as _Path

    _Path(out_path).write_text(json.dumps(result))
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        sys.stdout.flush()
        os._exit(0)
