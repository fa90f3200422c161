"""Fixtures of the ``cuda`` tests (tests/conftest.py skips them without a CUDA device).

``device`` is ``"cuda"`` on a GPU. In the dry run of bench/gpu/run.py (``BSR_CUDA_TESTS_ON=cpu``)
it is ``"cpu"``, so the device-agnostic tests prove their own logic before a GPU is ever used;
tests that need CUDA itself (a side stream, events, pinned memory, kvikio) ask for
``real_cuda`` and skip there.
"""

from __future__ import annotations

import os

import pytest
import torch

#: "1": kvikio must import (bench/gpu/run.py sets it when it installed kvikio)
REQUIRE_KVIKIO = "BSR_REQUIRE_KVIKIO"


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def real_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip(
            "needs CUDA itself (side stream, events, pinned staging); the dry run runs only the "
            "device-agnostic cuda tests, on the CPU"
        )


@pytest.fixture
def kvikio_ok(real_cuda: None) -> None:
    try:
        import kvikio  # noqa: F401
    except Exception as exc:
        if os.environ.get(REQUIRE_KVIKIO) == "1":
            pytest.fail(f"{REQUIRE_KVIKIO}=1 but kvikio does not import: {exc!r}", pytrace=False)
        pytest.skip(f"kvikio does not import ({exc!r}); install kvikio-cu13 (or kvikio-cu12)")
