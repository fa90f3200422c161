"""A fleet end to end: three ``vllm serve`` instances over one bsr pool, behind bsr's router.

Each instance runs BsrConnector over its own HostTier (medium ``CPU``: two objects) above one
FileTier root all three share (medium ``STORAGE``: the pool), and publishes vLLM's KV events
(vLLM's own, medium ``GPU``, and bsr's) to the router's socket under its name. The router
(:mod:`bsr.router`, in this process) indexes them by content (the instances' hash seeds differ)
and routes. float32 weights, so restored and recomputed tokens agree exactly. One fleet serves
every test here (engine starts are the cost); the tests run in order on it:

* a conversation whose turns land on three different instances: each returning turn restores
  the earlier turns from the pool (vLLM reports them cached), and its tokens equal a recompute
  of the same prompt on the same instance (loads and saves off, vLLM's cache reset);
* through the router, the next turn goes where the prefix is (the instance whose GPU and host
  memory hold it), and once that instance's copies are gone (its prefix cache reset, its host
  tier evicted: the events reach the router) it no longer prefers it (a tie broken by load);
* two tenants (``cache_salt``) never share: not in the pool, not in the router's view.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_fleet import BLOCK, CHUNK, Fleet, kv_config, prompt, settled, start_fleet
from vllm_servers import eventually, prom

pytest.importorskip("vllm")
pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1500)

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet-router")
    pool = {"kind": "file", "path": str(root / "pool"), "capacity_bytes": "1GiB"}
    with start_fleet(root, NAMES, lambda _name: kv_config(pool), router=True) as fleet:
        yield fleet


def test_a_conversation_across_three_instances_restores_from_the_pool(fleet: Fleet) -> None:
    history = prompt(1, 3 * CHUNK + 8)
    stored = 0  # the tokens of whole chunks the pool holds of this conversation
    for i, name in enumerate(NAMES):  # turn i on instance i: it never saw the earlier turns
        out, cached = fleet.turn(name, history)
        assert cached >= stored and (i == 0 or cached > 0), f"turn {i} on {name}: {cached}"
        assert out == fleet.reference(name, history), f"turn {i} on {name}"
        stored = len(history) // CHUNK * CHUNK
        history = history + out + prompt(10 + i, CHUNK)
    hits = [prom(fleet.ports[n], "vllm:prompt_tokens_cached_by_source_total", source="disk")
            for n in NAMES]  # fmt: skip
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > 0  # b and c read the pool
    CONVERSATION[:] = history


#: the conversation's prompt after the test above (the next tests continue it)
CONVERSATION: list[int] = []


def test_the_router_sends_a_turn_where_its_prefix_is_until_it_is_gone(fleet: Fleet) -> None:
    if not CONVERSATION:
        pytest.skip("needs the conversation test's turns")
    nxt = CONVERSATION + prompt(20, 40)
    # c served the last turn (its GPU and host tier hold it), b the one before, a the first
    eventually(lambda: fleet.match("c", nxt).get("GPU", 0) >= 8, "c's GPU events")
    held = fleet.match("c", nxt)["GPU"]  # the blocks of the last turn's prompt
    _, cached, via = fleet.complete(None, nxt)
    assert via == "c" and cached >= held * BLOCK
    assert fleet.router.snapshot()["reasons"] == {"prefix": 1}
    # c's copies go: its prefix cache reset (AllBlocksCleared), its host tier filled by others
    fleet.reset("c")
    for seed in range(3):
        fleet.turn("c", prompt(30 + seed, 2 * CHUNK + 1))
    fleet.reset("c")
    eventually(lambda: set(fleet.match("c", nxt)) == {"STORAGE"}, "c's removals at the router")
    b, a = fleet.match("b", nxt), fleet.match("a", nxt)
    assert b.get("GPU", 0) > a.get("GPU", 0) > 0  # b's GPU holds turn 1, a's turn 0
    _, cached, via = fleet.complete(None, nxt)
    assert via == "b" and cached >= b["GPU"] * BLOCK
    assert fleet.router.snapshot()["reasons"] == {"prefix": 2}


def test_tenants_never_share_across_the_fleet(fleet: Fleet) -> None:
    tokens = prompt(40, 2 * CHUNK + 8)
    fleet.turn("a", tokens, cache_salt="tenant-1")
    fleet.reset("a")
    fleet.complete("a", prompt(99, 8))  # vLLM publishes the reset's event with its next step
    want = {"a": {"CPU": 4}, "b": {"STORAGE": 4}, "c": {"STORAGE": 4}}  # a: its host tier
    got = settled(lambda: {n: fleet.match(n, tokens, "tenant-1") for n in NAMES}, want)
    assert got == want  # a's prefix cache reset: no longer on a's GPU
    for name in NAMES:  # the router names tenant-1's blocks apart from anyone else's
        assert fleet.match(name, tokens, "tenant-2") == {}
        assert fleet.match(name, tokens) == {}
    _, cached, _ = fleet.complete("b", tokens, cache_salt="tenant-2")
    assert cached == 0  # another tenant: nothing of tenant-1's in the pool is its
    _, cached, _ = fleet.complete("c", tokens, cache_salt="tenant-1")
    assert cached >= 2 * CHUNK  # the same tenant on another instance: from the pool
