"""A KV pool too small for the batch: vLLM preempts running requests (freeing their blocks) and
resumes them later, asking bsr again; asynchronous loads reserve blocks while they run. The
greedy tokens are those of no connector. Needs vLLM (``make test`` runs it in ``.venv-vllm``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm_engines import BATCH_A, BATCH_B, Engines, batch_metric, connector, tokens_of

pytestmark = pytest.mark.timeout(3600)

BLOCK_BYTES = 32 * 2 * 512  # a block of 32 tokens, 2 layers of K + V (bfloat16)
POOL_BLOCKS = 18  # 576 tokens for 16 requests of 40 to 200 prompt tokens


@pytest.fixture(scope="module")
def tiny(engines: Engines) -> dict[str, Any]:
    return engines.run(
        "tiny_pool",
        connector=connector(engines.copy("tiny-store"), save=False),
        batches=[BATCH_A + BATCH_B],
        kv_cache_bytes=POOL_BLOCKS * BLOCK_BYTES,
        max_model_len=512,
        log_stats=True,
    )


def test_preempted_requests_give_the_tokens_of_no_connector(
    engines: Engines, tiny: dict[str, Any]
) -> None:
    assert batch_metric(tiny, 0, "vllm:num_preemptions") >= 1
    assert tokens_of(tiny) == [tokens_of(engines.baseline)[0] + tokens_of(engines.baseline)[1]]
    assert batch_metric(tiny, 0, "vllm:bsr_loaded_tokens") > 0
    assert batch_metric(tiny, 0, "vllm:bsr_failed_loads", reason="cancelled") == 0
