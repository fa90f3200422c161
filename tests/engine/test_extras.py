"""Extra keys through the engine: what computes differently is never served across, what
computes alike is shared; checked against an independent model of what each chunk depends on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import bsr
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, shuffled_blocks, tokens_for

CT = 4  # tokens per chunk (and per block) in the model test
LAYOUT = bsr.StateLayout(chunk_tokens=CT, groups=(bsr.StateGroup("kv", 1, 16),))


# ---------------------------------------------------------------------- the model
# A chunk's state depends on its tokens and on the values bound to the positions of every chunk
# up to it: the model names each chunk by that content (tokens, and which value covers which of
# its positions), with no hashing. A request hits the longest prefix whose chunk contents some
# saved request had; each stored chunk holds the bytes of the first request that saved it.


def chunk_content(tokens: list[int], extras: list[bsr.KeyExtra], c: int) -> tuple[Any, ...]:
    lo, hi = c * CT, (c + 1) * CT
    covers = []
    for e in extras:
        where = tuple(
            p - lo for p in range(lo, hi) if p >= e.start and (e.end is None or p < e.end)
        )
        if where:
            covers.append((e.key, where))
    return (tuple(tokens[lo:hi]), tuple(sorted(covers)))


def prefix_contents(tokens: list[int], extras: list[bsr.KeyExtra]) -> list[tuple[Any, ...]]:
    out, acc = [], ()
    for c in range(len(tokens) // CT):
        acc = (*acc, chunk_content(tokens, extras, c))
        out.append(acc)
    return out


SALTS = [None, b"salt:alice", b"salt:bob"]
ADAPTERS = [None, b"lora:a", b"lora:b"]


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[int], list[bsr.KeyExtra]]:
    n = draw(st.integers(CT, 4 * CT + 3))
    # a small alphabet: requests share prefixes often
    tokens = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    extras = []
    salt = draw(st.sampled_from(SALTS))
    if salt:
        extras.append(bsr.KeyExtra(salt, 0, 1))
    adapter = draw(st.sampled_from(ADAPTERS))
    if adapter:
        extras.append(bsr.KeyExtra(adapter))
    if draw(st.booleans()):  # an image over some placeholder tokens
        start = draw(st.integers(0, n - 1))
        length = draw(st.integers(1, 6))
        extras.append(
            bsr.KeyExtra(draw(st.sampled_from([b"img:1", b"img:2"])), start, start + length)
        )
    return tokens, extras


@pytest.mark.anyio
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(requests(), min_size=2, max_size=6),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=2, max_size=14),
)
async def test_hits_and_bytes_follow_the_content_model(
    reqs: list[tuple[list[int], list[bsr.KeyExtra]]], ops: list[tuple[bool, int]]
) -> None:
    nb = 8
    engine = make_engine(LAYOUT, [bsr.HostTier(1 << 24)], window=2, io_depth=1)
    # model: prefix content -> (request whose save stored that chunk first, its chunk index)
    stored: dict[tuple[Any, ...], int] = {}
    sources = [filled_cache(LAYOUT, nb, CT, seed=i + 1) for i in range(len(reqs))]
    ids = list(range(nb))
    async with engine:
        for is_save, i in ops:
            i %= len(reqs)
            tokens, extras = reqs[i]
            contents = prefix_contents(tokens, extras)
            if is_save:
                res = await engine.save(tokens, sources[i], ids, extras=extras)
                assert res.saved_tokens == len(contents) * CT
                for p in contents:
                    stored.setdefault(p, i)
                continue
            want = 0
            while want < len(contents) and contents[want] in stored:
                want += 1
            probe = await engine.lookup(tokens, extras=extras)
            assert probe.prefix_tokens == want * CT, (probe.prefix_tokens, want)
            dst = bsr.PagedKVCache(LAYOUT, nb, CT)
            r = await engine.restore(tokens, dst, ids, extras=extras, probe=probe)
            note(f"restore of request {i}: {want} chunks")
            assert r.committed_tokens == want * CT
            for c in range(want):  # each chunk holds what its first saver wrote
                src = sources[stored[contents[c]]]
                assert torch.equal(dst.tensor("kv")[:, c], src.tensor("kv")[:, c]), (
                    f"chunk {c} of request {i} holds another request's bytes"
                )


# ---------------------------------------------------------------------- the engine's API


@pytest.mark.anyio
async def test_a_tenant_salt_and_an_adapter_never_hit_each_other(tmp_path: Path) -> None:
    """Through a FileTier reopened by a second engine: the same tokens under another salt or
    adapter miss; under the same ones they restore every chunk, byte-exact."""
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(5 * 16 + 3)
    src = filled_cache(layout, 64, 8, seed=2)
    ids = shuffled_blocks(64, 11, seed=3)
    alice = [bsr.KeyExtra(b"salt:alice", 0, 1), bsr.KeyExtra(b"lora:x")]
    async with make_engine(layout, [bsr.FileTier(tmp_path, 1 << 26)]) as eng:
        saved = await eng.save(toks, src, ids, extras=alice)
        assert saved.saved_tokens == 80
    async with make_engine(layout, [bsr.FileTier(tmp_path, 1 << 26)]) as eng:
        for other in (
            [],
            [bsr.KeyExtra(b"salt:bob", 0, 1), bsr.KeyExtra(b"lora:x")],
            [bsr.KeyExtra(b"salt:alice", 0, 1)],
            [bsr.KeyExtra(b"salt:alice", 0, 1), bsr.KeyExtra(b"lora:y")],
        ):
            assert (await eng.lookup(toks, extras=other)).prefix_tokens == 0, other
            dst = bsr.PagedKVCache(layout, 64, 8)
            r = await eng.restore(toks, dst, ids, extras=other)
            assert r.committed_tokens == 0 and r.bytes_read == 0
        dst = bsr.PagedKVCache(layout, 64, 8)
        r = await eng.restore(toks, dst, ids, extras=list(reversed(alice)))
        assert r.committed and r.committed_tokens == 80
        assert blocks_equal(layout, src, ids, dst, ids, 5)
        # the next turn (a longer prompt under the same adapter and salt) shares them
        more = toks + tokens_for(40, seed=7)
        assert (await eng.lookup(more, extras=alice)).prefix_tokens == 80


@pytest.mark.anyio
async def test_a_probe_of_other_extras_is_refused_before_anything_moves() -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 1, 64),))
    toks = tokens_for(48)
    src = filled_cache(layout, 16, 16)
    async with make_engine(layout, [bsr.HostTier(1 << 24)]) as eng:
        await eng.save(toks, src, [0, 1, 2], extras=[bsr.KeyExtra(b"t:a", 0, 1)])
        probe = await eng.lookup(toks, extras=[bsr.KeyExtra(b"t:a", 0, 1)], lease_ttl_s=30)
        assert probe.prefix_tokens == 48
        dst = bsr.PagedKVCache(layout, 16, 16)
        with pytest.raises(bsr.ConfigError, match="other extras"):
            await eng.restore(
                toks, dst, [0, 1, 2], probe=probe, extras=[bsr.KeyExtra(b"t:b", 0, 1)]
            )
        with pytest.raises(bsr.ConfigError, match="other extras"):
            await eng.restore(toks, dst, [0, 1, 2], probe=probe)
        assert not dst.tensor("kv").any()  # nothing was installed
        r = await eng.restore(
            toks, dst, [0, 1, 2], probe=probe, extras=[bsr.KeyExtra(b"t:a", 0, 1)]
        )
        assert r.committed_tokens == 48


@pytest.mark.anyio
@pytest.mark.parametrize("call", ["lookup", "restore", "save", "keys"])
async def test_bad_extras_are_refused_at_the_call(call: str) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 1, 64),))
    cache = bsr.PagedKVCache(layout, 16, 16)
    async with make_engine(layout, [bsr.HostTier(1 << 24)]) as eng:
        bad: Any = ["salt"]
        with pytest.raises(bsr.TokenError, match=r"bsr\.KeyExtra"):
            if call == "lookup":
                await eng.lookup(tokens_for(32), extras=bad)
            elif call == "restore":
                await eng.restore(tokens_for(32), cache, [0, 1], extras=bad)
            elif call == "save":
                await eng.save(tokens_for(32), cache, [0, 1], extras=bad)
            else:
                eng.keys(tokens_for(32), extras=bad)
        assert eng.statistics().restores == 0 and eng.statistics().saves == 0
