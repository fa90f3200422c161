"""A fleet over each remote store bsr ships as its pool: a Redis Cluster (three nodes) and a
Mooncake Store (one master).

Three ``vllm serve`` instances behind bsr's router, each with its own HostTier above the pool
(the FileTier pool's fleet, with evictions and tenants, is test_fleet_router.py): a
conversation's turns land on the three instances in turn, so each returning turn restores the
earlier ones from the pool (vLLM reports them cached, bsr counts them read from the pool's
tier), and its tokens equal a recompute of the same prompt on the same instance (float32:
exact); then the conversation, sent through the router, goes to the instance whose GPU holds
its prefix (the last one, which computed it again as its reference) and finds it cached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_fleet import BLOCK, CHUNK, Fleet, kv_config, prompt, start_fleet
from vllm_servers import eventually, prom

pytest.importorskip("vllm")
pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1500)

NAMES = ("a", "b", "c")


#: the pool's per-call bound, and the connector's lookup bound: the default 5 s ran out on a busy
#: machine (a read of the Mooncake pool took longer under four test workers on two cores: a miss
#: and a recompute, as it should be, but a restore is what this checks; the bounds have tests of
#: their own). The lookup's 2 s default is cut shorter still: an instance's first lookup of the
#: pool (its client's first call) answering late is a silent miss, "0 cached" on a later turn,
#: as CI saw once on instance c (not reproduced here in 8 runs beside 2-5 busy processes; the
#: message of that assertion now carries the instance's log)
POOL_TIMEOUT_S = 60.0


@contextlib.contextmanager
def pool(kind: str) -> Iterator[dict[str, Any]]:
    """The pool's tier table, its servers started (and stopped) here."""
    if kind == "redis":
        pytest.importorskip("redis")
        from bsr.testing._redis_server import redis_problem, start_cluster

        if (problem := redis_problem()) is not None:
            pytest.skip(problem)
        with start_cluster(3) as cluster:
            yield {"kind": "redis", "url": cluster.url, "cluster": True, "key_prefix": "fleet:",
                   "timeout_s": POOL_TIMEOUT_S}  # fmt: skip
    else:
        pytest.importorskip("mooncake")
        from mooncake_server import require_mooncake, start_cluster

        require_mooncake()
        with start_cluster() as cluster:
            yield {"kind": "mooncake", "client_address": cluster.client_address,
                   "timeout_s": POOL_TIMEOUT_S}  # fmt: skip


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Fleet]]:
    kind = request.param
    root = tmp_path_factory.mktemp(f"fleet-{kind}")
    with (
        pool(kind) as tier,
        start_fleet(
            root,
            NAMES,
            lambda _name: kv_config(tier, lookup_timeout_s=POOL_TIMEOUT_S),
            router=True,
        ) as fleet,
    ):
        yield tier["kind"], fleet


def test_turns_across_instances_restore_from_the_pool_and_the_router_finds_them(
    fleet: tuple[str, Fleet],
) -> None:
    kind, f = fleet
    history = prompt(3, 2 * CHUNK + 8)
    stored = 0  # the tokens of whole chunks the pool holds of this conversation
    for i, name in enumerate(NAMES):  # turn i on instance i: it never saw the earlier turns
        before = prom(f.ports[name], "vllm:bsr_hit_tokens_by_tier_total", tier=kind)
        out, cached = f.turn(name, history)
        why = f"turn {i} on {name}: {cached} cached\n{f.log(name)}"
        assert cached >= stored and (i == 0 or cached > 0), why
        hits = prom(f.ports[name], "vllm:bsr_hit_tokens_by_tier_total", tier=kind) - before
        assert i == 0 or hits > 0, f"nothing read from the {kind} pool: {why}"
        assert out == f.reference(name, history), f"turn {i} on {name}"
        stored = len(history) // CHUNK * CHUNK
        history = history + out + prompt(10 + i, CHUNK)
    # c computed the last turn's prompt again for its reference (its GPU cache holds it), and
    # the router knows it from c's events
    eventually(lambda: f.match("c", history).get("GPU", 0) >= 8, "c's GPU events")
    held = f.match("c", history)["GPU"]
    _, cached, via = f.complete(None, history)
    assert via == "c" and cached >= held * BLOCK
    assert f.router is not None and f.router.snapshot()["reasons"] == {"prefix": 1}
