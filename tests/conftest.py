"""Shared fixtures (helper functions live in helpers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

import bsr
from helpers import two_group_layout

#: "cpu": run the portable part of the ``cuda`` tests on the CPU (the dry run of bench/gpu/run.py)
CUDA_TESTS_ON = "BSR_CUDA_TESTS_ON"
#: "1": a ``cuda`` test without a CUDA device fails instead of skipping (bench/gpu/run.py on a GPU)
REQUIRE_CUDA = "BSR_REQUIRE_CUDA"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.cuda`` tests need a CUDA device; without one they skip, saying so."""
    if item.get_closest_marker("cuda") is None or torch.cuda.is_available():
        return
    if os.environ.get(REQUIRE_CUDA) == "1":
        pytest.fail(f"{REQUIRE_CUDA}=1 but torch.cuda.is_available() is False", pytrace=False)
    if os.environ.get(CUDA_TESTS_ON) != "cpu":
        pytest.skip(
            "needs a CUDA device (torch.cuda.is_available() is False); bench/gpu/run.py runs "
            "the cuda tests on a GPU machine (docs/gpu.md)"
        )


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs() -> Iterator[None]:
    """Keep structlog quiet in tests (warnings still print)."""
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.reset_defaults()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every ``@pytest.mark.anyio`` test runs once under asyncio and once under trio."""
    return str(request.param)


@pytest.fixture
def layout() -> bsr.StateLayout:
    return two_group_layout()


@pytest.fixture
def l2_path(tmp_path: Path) -> Path:
    return tmp_path / "l2"
