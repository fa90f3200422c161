"""kv_producer saves and never loads; kv_consumer loads and never saves: two engines, one store.

Before the split both roles behaved like ``kv_both``. Needs vLLM (``make test`` runs it in
``.venv-vllm``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm_engines import (
    BATCH_A,
    EXPECTED_A,
    Engines,
    batch_metric,
    cached_of,
    connector,
    store_objects,
    tokens_of,
    toks,
)

pytestmark = pytest.mark.timeout(3600)

NEW = [toks(150, 4242)]  # two full chunks nobody stored
A_OBJECTS = 3 + 2 + 0 + 1


@pytest.fixture(scope="module")
def roles(engines: Engines) -> dict[str, Any]:
    store = engines.tmp / "roles-store"  # empty
    out: dict[str, Any] = {}
    # vLLM's own prefix cache off: the second batch could only be served by bsr
    out["producer"] = engines.run(
        "producer",
        connector=connector(store),
        role="kv_producer",
        prefix_caching=False,
        batches=[BATCH_A, BATCH_A],
        before_batch={"1": [{"kind": "wait_objects", "path": str(store), "count": A_OBJECTS}]},
        await_objects=[str(store), A_OBJECTS],
        log_stats=True,
    )
    out["after_producer"] = len(store_objects(store))
    out["consumer"] = engines.run(
        "consumer",
        connector=connector(store),
        role="kv_consumer",
        batches=[BATCH_A, NEW],
        log_stats=True,
        reset_connector=True,
    )
    out["after_consumer"] = len(store_objects(store))
    return out


def test_producer_saves_and_never_loads(engines: Engines, roles: dict[str, Any]) -> None:
    p = roles["producer"]
    assert roles["after_producer"] == A_OBJECTS
    assert tokens_of(p) == [tokens_of(engines.baseline)[0]] * 2
    # the second batch ran with every chunk stored: a producer never even looks
    assert cached_of(p) == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert batch_metric(p, 1, "vllm:bsr_lookups") == 0
    assert batch_metric(p, 1, "vllm:bsr_loaded_tokens") == 0


def test_consumer_loads_and_never_saves(engines: Engines, roles: dict[str, Any]) -> None:
    c = roles["consumer"]
    assert tokens_of(c)[0] == tokens_of(engines.baseline)[0]
    assert cached_of(c)[0] == EXPECTED_A
    assert batch_metric(c, 0, "vllm:bsr_loaded_tokens") == sum(EXPECTED_A)
    # NEW's two chunks were computed but not stored (kv_both stores them)
    assert roles["after_consumer"] == A_OBJECTS
    assert batch_metric(c, 1, "vllm:bsr_saves") == 0
    assert c["reset_connector"] is True
