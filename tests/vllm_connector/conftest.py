"""Engine runs shared by the vLLM test modules (each engine in its own process)."""

from __future__ import annotations

import pytest

from vllm_engines import Engines


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    """One random Llama, its run without connector, and a store written through the connector;
    built once for the session (only by the tests that use it, which need vLLM)."""
    return Engines(tmp_path_factory.mktemp("vllm-shared"))
