"""Engine runs shared by the vLLM test modules (each engine in its own process)."""

from __future__ import annotations

import os

import pytest

from vllm_engines import Engines


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    """One random Llama, its run without connector, and a store written through the connector;
    built once for the session, by the first worker whose tests use it (they need vLLM): the
    workers share the session's base temporary directory's parent under pytest-xdist."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return Engines(shared / "vllm-shared", tmp_path_factory.mktemp("vllm-own"))
