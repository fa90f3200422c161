"""Shared fixtures (helper functions live in helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import bsr
from helpers import two_group_layout


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
