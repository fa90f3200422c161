"""ConversationCache admission: a prefix seen once is not saved (``admit_after_sightings``), a
turn that says ``store=False`` keeps its conversation out of the store."""

from __future__ import annotations

import hashlib

import pytest

import bsr
from bsr.kit import ConversationCache
from support.engines import make_engine
from support.helpers import tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))
CT = LAYOUT.chunk_tokens


async def held_tokens(eng: bsr.RestoreEngine, tokens: list[int]) -> int:
    return (await eng.lookup(tokens)).prefix_tokens


async def turn(convs: ConversationCache, conv: str, tokens: list[int], **kw: object) -> None:
    await convs.admit(conv, tokens, **kw)  # type: ignore[arg-type]
    convs.commit(conv, tokens, len(tokens))  # (the model's KV is not what this test checks)


@pytest.mark.anyio
async def test_only_what_was_seen_often_enough_is_saved() -> None:
    system = tokens_for(CT, seed=9)  # a system prompt two conversations share
    a = [*system, *tokens_for(CT, seed=1)]
    b = [*system, *tokens_for(CT, seed=2)]
    lone = tokens_for(2 * CT, seed=3)
    async with make_engine(LAYOUT, [bsr.HostTier(1 << 24)]) as eng:
        convs = ConversationCache(eng, bsr.PagedKVCache(LAYOUT, 10, 8), admit_after_sightings=2)
        await turn(convs, "lone", lone)
        await turn(convs, "a", a)  # 8 + 8 > 10 blocks: evicts "lone", seen once: not saved
        assert convs.statistics().not_admitted == 1 and await held_tokens(eng, lone) == 0
        await turn(convs, "b", b)  # evicts "a": its system prompt was seen twice (a and b)
        assert await held_tokens(eng, a) == CT  # the shared chunk only
        assert convs.statistics().saved_tokens == CT
        await turn(convs, "lone", [*lone, 5])  # seen again: its two chunks now twice
        assert await held_tokens(eng, b) == CT  # "b" evicted: shared chunk (already there)
        await convs.evict_all()
        assert await held_tokens(eng, lone) == 2 * CT


@pytest.mark.anyio
async def test_a_turn_that_says_store_false_keeps_its_conversation_out() -> None:
    a = tokens_for(2 * CT, seed=1)
    async with make_engine(LAYOUT, [bsr.HostTier(1 << 24)]) as eng:
        convs = ConversationCache(eng, bsr.PagedKVCache(LAYOUT, 16, 8))
        await turn(convs, "a", a)
        await turn(convs, "a", [*a, *tokens_for(CT, seed=4)], store=False)
        await turn(convs, "a", [*a, *tokens_for(CT, seed=4), 1], store=True)  # still out
        await convs.evict_all()
        assert convs.statistics().opted_out == 1 and await held_tokens(eng, a) == 0
        with pytest.raises(bsr.ConfigError, match="store"):
            await convs.admit("b", a, store="no")  # type: ignore[arg-type]
        with pytest.raises(bsr.ConfigError, match="admit_after_sightings"):
            ConversationCache(eng, bsr.PagedKVCache(LAYOUT, 16, 8), admit_after_sightings=0)


@pytest.mark.anyio
async def test_admission_still_filters_after_heavy_traffic() -> None:
    """A counter shared with another server loop has sighted four times its width of prefixes
    seen once (262,144). Histories seen once are still not saved (before the doorkeeper, 79%
    of new prefixes passed 2 sightings at that volume and the kit saved them); a history seen
    twice still is."""
    counter = bsr.SightingCounter()
    for i in range(4 * counter.width // 64):
        counter.add([hashlib.sha256(b"other/%d/%d" % (i, j)).digest() for j in range(64)])
    lone = [tokens_for(2 * CT, seed=100 + i) for i in range(6)]
    again = tokens_for(2 * CT, seed=99)
    async with make_engine(LAYOUT, [bsr.HostTier(1 << 24)]) as eng:
        convs = ConversationCache(
            eng, bsr.PagedKVCache(LAYOUT, 64, 8), admit_after_sightings=2, sightings=counter
        )
        await turn(convs, "again", again)
        for i, toks in enumerate(lone):
            await turn(convs, f"lone{i}", toks)
        await turn(convs, "again", [*again, 7])  # its two chunks now seen twice
        await convs.evict_all()
        assert [await held_tokens(eng, toks) for toks in lone] == [0] * 6
        assert convs.statistics().not_admitted == 6
        assert await held_tokens(eng, again) == 2 * CT
