"""vLLM's engine processes forked, not spawned, in the vLLM tests' engines and servers.

vLLM starts an engine's core (and its workers) as processes of their own. Its default start
method is ``fork`` (``VLLM_WORKER_MULTIPROC_METHOD``), but its CPU platform sets ``spawn`` while
it checks an engine's config: each spawned process imports vLLM, torch and bsr again, ~6 s of CPU
each and 15-30 s on the tests' busy two cores, twice per engine (core and worker) and once more
per tensor-parallel rank, for a few seconds of the engine's actual work. :func:`keep_fork` puts
``fork`` back after that check, so these processes start as vLLM starts them on a GPU, as forks
of a process that has already imported everything. ``BSR_TEST_ENGINE_SPAWN=1`` leaves vLLM's
CPU default (each process spawned) in place.
"""

from __future__ import annotations

import os
from typing import Any


def keep_fork() -> None:
    """From now on, an engine this process starts forks its core and workers."""
    if os.environ.get("BSR_TEST_ENGINE_SPAWN") == "1":
        return
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
