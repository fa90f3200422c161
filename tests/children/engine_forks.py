"""A process that has imported vLLM and forks one child per engine run (``run_engine.main``).

Importing vLLM, torch and bsr takes ~6 s of CPU, as long as starting a one-process engine and
running its prompts; the vLLM tests run ~50 engines. This server imports them once; each run is
a fresh child of it (``os.fork`` while this process has one thread and has run no torch op), with
its own environment, its own log and its own exit, so a run sees what a new process would,
less the import. Protocol, one JSON object per line: the client writes ``{"spec", "out",
"log", "env"}``; the server answers ``{"pid"}`` when the child started, then ``{"rc"}`` (the
child's exit status, negative: killed by that signal) when it ended. The server ends when its
input closes (the client's process is gone). Usage: ``python engine_forks.py`` (the client:
``vllm_engines.run``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def preload() -> None:
    """What every run imports (run_engine.main's imports, the connector, its test modules), and
    what every engine's start imports on its way (its CPU worker, the sampler, the test models'
    classes: ~0.5 s of a one-process engine's ~3 s start)."""
    import vllm.model_executor.models.llama
    import vllm.v1.sample.rejection_sampler
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import bsr.vllm  # noqa: F401


def child(req: dict[str, object]) -> None:
    """In the forked child: become the run (its environment, its log as stdout and stderr) and
    run it; never returns."""
    code = 1
    try:
        os.setpgrp()  # a run past its time is killed with what it started
        env = req["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        for path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if path and path not in sys.path:
                sys.path.insert(0, path)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(str(req["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        import run_engine

        run_engine.main(str(req["spec"]), str(req["out"]))  # exits the process itself
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    # answers go to the original stdout; anything else that writes there (vLLM's logs at
    # import) goes to stderr instead
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    preload()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(req)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    serve()
