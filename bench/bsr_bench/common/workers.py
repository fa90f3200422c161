"""How a program's child processes find this package.

The ``--tp`` ranks, the vLLM engines of ``--engine vllm`` and the LMCache worker run in their own
processes, some under another interpreter (``.venv-vllm``) where the bench is not installed:
each is started with the directory holding ``bsr_bench`` first on ``PYTHONPATH``, so
``python -m bsr_bench.<module>`` runs the very code of this run.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the directory that holds the ``bsr_bench`` package (``bench/`` in a checkout)
BENCH_ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """This process's environment with :data:`BENCH_ROOT` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BENCH_ROOT) + (os.pathsep + rest if rest else "")
    return env


def free_port() -> int:
    """A loopback TCP port free now (the OS's pick)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
