"""Bad input at the public boundary: a typed error that says what to change, and no damage.

Every case raises a :class:`bsr.BsrError` subclass whose message names the fix (asserted on
fragments), and the data stored before it is still restored byte-exact afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import bsr
from bsr.testing import make_keys, payload
from support.engines import make_engine

LAYOUT = bsr.StateLayout(
    chunk_tokens=16,
    groups=(
        bsr.StateGroup("kv", num_layers=2, token_bytes=64, dtype="uint8"),
        bsr.StateGroup("swa", num_layers=1, token_bytes=32, dtype="uint8", window_tokens=16),
    ),
)
BLOCK_TOKENS = 4
TOKENS = list(range(100, 164))  # 4 chunks
NBLOCKS = 24
SRC_IDS = list(range(3, 19))
DST_IDS = list(range(23, 7, -1))


def source_cache() -> bsr.PagedKVCache:
    cache = bsr.PagedKVCache(LAYOUT, NBLOCKS, BLOCK_TOKENS)
    gen = torch.Generator().manual_seed(7)
    for g in LAYOUT.groups:
        t = cache.tensor(g.name)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return cache


def engine(path: Path, *, window: int = 2, io_depth: int = 1) -> bsr.RestoreEngine:
    return make_engine(
        LAYOUT,
        [bsr.HostTier(1 << 24), bsr.FileTier(path, 1 << 24, reader="posix")],
        window=window,
        io_depth=io_depth,
        model_id="bad-input",
    )


async def assert_restores_exactly(eng: bsr.RestoreEngine, src: bsr.PagedKVCache) -> None:
    """The saved prefix still restores, byte-exact (window-aware per group)."""
    dst = bsr.PagedKVCache(LAYOUT, NBLOCKS, BLOCK_TOKENS)
    res = await eng.restore(TOKENS, dst, DST_IDS)
    assert res.state is bsr.RequestState.COMMITTED, res
    assert res.committed_tokens == len(TOKENS)
    bpc = LAYOUT.chunk_tokens // BLOCK_TOKENS
    for g in LAYOUT.groups:
        for c in LAYOUT.needed_chunks(g.name, len(TOKENS) // LAYOUT.chunk_tokens):
            a = src.tensor(g.name)[:, SRC_IDS[c * bpc : (c + 1) * bpc]]
            b = dst.tensor(g.name)[:, DST_IDS[c * bpc : (c + 1) * bpc]]
            assert torch.equal(a, b), (g.name, c)


Call = Callable[[bsr.RestoreEngine, bsr.PagedKVCache], Awaitable[Any]]
OTHER_LAYOUT = bsr.StateLayout(
    chunk_tokens=16, groups=(bsr.StateGroup("kv", num_layers=2, token_bytes=32, dtype="uint8"),)
)

# (id, call, error type, message fragments)
CASES: list[tuple[str, Call, type[bsr.BsrError], tuple[str, ...]]] = [
    (
        "float-tensor-tokens",
        lambda e, c: e.restore(torch.ones(64), c, DST_IDS),
        bsr.TokenError,
        ("integer tensor", "float32", "tokens.long()"),
    ),
    (
        "float-array-tokens",
        lambda e, c: e.restore(np.linspace(0, 1, 64), c, DST_IDS),
        bsr.TokenError,
        ("integer array", "float64"),
    ),
    (
        "float-list-tokens",
        lambda e, c: e.restore([1.5] * 64, c, DST_IDS),
        bsr.TokenError,
        ("must be ints", "float", "pass token ids"),
    ),
    (
        "bool-tensor-tokens",
        lambda e, c: e.restore(torch.ones(64, dtype=torch.bool), c, DST_IDS),
        bsr.TokenError,
        ("integer tensor", "bool"),
    ),
    (
        "string-tokens",
        lambda e, c: e.restore("the quick brown fox", c, DST_IDS),
        bsr.TokenError,
        ("token ids", "tokenize the text first"),
    ),
    (
        "list-of-strings-tokens",
        lambda e, c: e.restore(["the", "fox"] * 32, c, DST_IDS),
        bsr.TokenError,
        ("must be ints", "str", "pass token ids"),
    ),
    (
        "2d-tokens",
        lambda e, c: e.restore(torch.zeros(2, 32, dtype=torch.long), c, DST_IDS),
        bsr.TokenError,
        ("1-D", "(2, 32)"),
    ),
    (
        "negative-tokens",
        lambda e, c: e.restore([*TOKENS[:-1], -1], c, DST_IDS),
        bsr.TokenError,
        (">= 0", "-1", "strip padding"),
    ),
    (
        "negative-tokens-save",
        lambda e, c: e.save(torch.tensor([-5] * 64), c, SRC_IDS),
        bsr.TokenError,
        (">= 0", "-5", "strip padding"),
    ),
    (
        "meta-tensor-tokens",
        lambda e, c: e.restore(torch.tensor(TOKENS, device="meta"), c, DST_IDS),
        bsr.TokenError,
        ("meta tensor", "holds no data", "pass token ids"),
    ),
    (
        "sparse-tokens-save",
        lambda e, c: e.save(torch.tensor(TOKENS).to_sparse(), c, SRC_IDS),
        bsr.TokenError,
        ("sparse_coo", "dense", "tokens.to_dense()"),
    ),
    (
        "quantized-tokens-lookup",
        lambda e, c: e.lookup(
            torch.quantize_per_tensor(torch.tensor(TOKENS) * 1.0, 1.0, 0, torch.qint32)
        ),
        bsr.TokenError,
        ("quantized tensor", "torch.qint32"),
    ),
    (
        "matrix-tokens",  # before: keyed as 0 chunks (a restore of nothing)
        lambda e, c: e.restore(np.matrix(TOKENS), c, DST_IDS),
        bsr.TokenError,
        ("np.matrix", "(1, 64)", "np.asarray(tokens).ravel()"),
    ),
    (
        "matrix-tokens-save",
        lambda e, c: e.save(np.matrix(TOKENS), c, SRC_IDS),
        bsr.TokenError,
        ("np.matrix",),
    ),
    (
        "too-few-block-ids",
        lambda e, c: e.restore(TOKENS, c, DST_IDS[:-1]),
        bsr.BlockTableError,
        ("need 16 blocks", "has 15", "full block table"),
    ),
    (
        "too-few-block-ids-save",
        lambda e, c: e.save(TOKENS, c, SRC_IDS[:3]),
        bsr.BlockTableError,
        ("need 16 blocks", "has 3", "full block table"),
    ),
    (
        "float-block-ids",
        lambda e, c: e.restore(TOKENS, c, [float(b) for b in DST_IDS]),
        bsr.BlockTableError,
        ("must be integers", "float64"),
    ),
    (
        "out-of-range-block-ids",
        lambda e, c: e.restore(TOKENS, c, [b + 10 for b in DST_IDS]),
        bsr.BlockTableError,
        ("must be in [0, 24)",),
    ),
    (
        "cache-of-another-layout",
        lambda e, c: e.restore(TOKENS, bsr.PagedKVCache(OTHER_LAYOUT, NBLOCKS, 4), DST_IDS),
        bsr.LayoutError,
        ("layout differs", "build the PagedKVCache with the engine's StateLayout"),
    ),
    (
        "cache-of-another-layout-save",
        lambda e, c: e.save(TOKENS, bsr.PagedKVCache(OTHER_LAYOUT, NBLOCKS, 4), SRC_IDS),
        bsr.LayoutError,
        ("build the PagedKVCache with the engine's StateLayout",),
    ),
    (
        "not-a-cache",
        lambda e, c: e.restore(TOKENS, torch.zeros(4), DST_IDS),  # type: ignore[arg-type]
        bsr.ConfigError,
        ("must be a bsr.PagedKVCache", "Tensor"),
    ),
    (
        "non-positive-deadline",
        lambda e, c: e.restore(TOKENS, c, DST_IDS, deadline_s=0),
        bsr.ConfigError,
        ("deadline_s must be > 0", "got 0"),
    ),
    (
        "unknown-tier-name",
        lambda e, c: e.save(TOKENS, c, SRC_IDS, tiers=["ssd"]),
        bsr.ConfigError,
        ("no tier named 'ssd'", "['host', 'file']"),
    ),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's quantization deprecation
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
@pytest.mark.parametrize(
    ("call", "error", "fragments"),
    [pytest.param(call, err, frags, id=name) for name, call, err, frags in CASES],
)
@pytest.mark.anyio
async def test_bad_call_raises_typed_error_and_leaves_stored_data_alone(
    tmp_path: Path, call: Call, error: type[bsr.BsrError], fragments: tuple[str, ...]
) -> None:
    src = source_cache()

    async with engine(tmp_path) as eng:
        await eng.save(TOKENS, src, SRC_IDS)
        before = eng.statistics()
        dst = bsr.PagedKVCache(LAYOUT, NBLOCKS, BLOCK_TOKENS)
        with pytest.raises(error) as info:
            await call(eng, dst)
        assert isinstance(info.value, bsr.BsrError)
        for fragment in fragments:
            assert fragment in str(info.value), (fragment, str(info.value))
        after = eng.statistics()
        # nothing was written, read or taken
        assert after.staging.in_use == 0 and after.staging.acquired == before.staging.acquired
        assert [t.objects for t in after.tiers] == [t.objects for t in before.tiers]
        assert [t.bytes_read for t in after.tiers] == [t.bytes_read for t in before.tiers]
        # and the destination cache was not touched
        assert all(not dst.tensor(g.name).any() for g in LAYOUT.groups)
        await assert_restores_exactly(eng, src)


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        pytest.param(
            {"window": 0, "io_depth": 1},
            ("window must be a positive int", "got 0"),
            id="W=0",
        ),
        pytest.param(
            {"window": -3, "io_depth": 1}, ("window must be a positive int", "got -3"), id="W<0"
        ),
        pytest.param(
            {"window": 2.5, "io_depth": 1}, ("window must be a positive int", "2.5"), id="W-float"
        ),
        pytest.param(
            {"window": True, "io_depth": 1}, ("window must be a positive int",), id="W-bool"
        ),
        pytest.param(
            {"window": 4, "io_depth": 0},
            ("io_depth must be a positive int", "got 0"),
            id="io_depth=0",
        ),
        pytest.param(
            {"window": 4, "io_depth": 5},
            ("io_depth: must be at most window=4", "got 5", "lower io_depth or raise window"),
            id="io_depth>W",
        ),
        pytest.param({"deadline_s": -1.0}, ("deadline_s must be > 0 or None",), id="deadline<0"),
        pytest.param(
            {"tiers": []}, ("tiers must be a non-empty list of Tier objects",), id="no-tiers"
        ),
        pytest.param(
            {"tiers": [bsr.HostTier(1 << 20), bsr.HostTier(1 << 20)]},
            ("tier names must be unique", "pass name="),
            id="duplicate-tier-names",
        ),
        pytest.param(
            {"namespace": bsr.Namespace("m", tp_rank=1, tp_size=2)},
            ("tp_rank=1, tp_size=2", "make them agree"),
            id="namespace-vs-coordinator",
        ),
    ],
)
def test_bad_engine_arguments(
    tmp_path: Path, kwargs: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    args: dict[str, Any] = {
        "tiers": [bsr.HostTier(1 << 20)],
        "window": 2,
        "io_depth": 1,
        "namespace": bsr.Namespace("m"),
    }
    args.update(kwargs)
    tiers = args.pop("tiers")
    with pytest.raises(bsr.ConfigError) as info:
        bsr.RestoreEngine(LAYOUT, tiers, **args)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_chunk_tokens_not_a_multiple_of_block_tokens() -> None:
    with pytest.raises(bsr.LayoutError) as info:
        bsr.PagedKVCache(LAYOUT, NBLOCKS, block_tokens=5)
    msg = str(info.value)
    assert "chunk_tokens=16 is not a multiple of block_tokens=5" in msg
    assert "choose a block size that divides the chunk size" in msg
    with pytest.raises(bsr.LayoutError, match=r"block_tokens=32"):
        bsr.PagedKVCache(LAYOUT, NBLOCKS, block_tokens=32)


@pytest.mark.parametrize(
    ("fn", "fragments"),
    [
        pytest.param(
            lambda: LAYOUT.group("mla"), ("unknown state group 'mla'", "['kv', 'swa']"), id="layout"
        ),
        pytest.param(
            lambda: bsr.PagedKVCache(LAYOUT, 4, 4).tensor("idx"),
            ("unknown state group 'idx'", "['kv', 'swa']"),
            id="cache",
        ),
        pytest.param(
            lambda: LAYOUT.needed_chunks("kv2", 3), ("unknown state group 'kv2'",), id="plan"
        ),
        pytest.param(
            lambda: LAYOUT.slot_offset("nope"), ("unknown state group 'nope'",), id="slot"
        ),
    ],
)
def test_unknown_group(fn: Callable[[], Any], fragments: tuple[str, ...]) -> None:
    with pytest.raises(bsr.UnknownGroupError) as info:
        fn()
    assert isinstance(info.value, KeyError) and info.value.group  # structured field
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("where", ["engine", "restore-policy", "restore-strategy"])
@pytest.mark.anyio
async def test_unknown_policy_or_strategy_is_a_config_error(tmp_path: Path, where: str) -> None:
    async def main() -> None:
        if where == "engine":
            with pytest.raises(bsr.ConfigError, match="all_or_nothing"):
                bsr.RestoreEngine(
                    LAYOUT,
                    [bsr.HostTier(1 << 20)],
                    window=2,
                    io_depth=1,
                    namespace=bsr.Namespace("m"),
                    policy="bogus",
                )
            return
        async with engine(tmp_path) as eng:
            dst = bsr.PagedKVCache(LAYOUT, NBLOCKS, BLOCK_TOKENS)
            kw: dict[str, Any] = (
                {"policy": "bogus"} if where == "restore-policy" else {"strategy": "bogus"}
            )
            with pytest.raises(bsr.ConfigError, match=r"truncate|whole_plan"):
                await eng.restore(TOKENS, dst, DST_IDS, **kw)

    await main()


# ------------------------------------------------------------------ use after close
@pytest.mark.anyio
async def test_engine_use_before_open_and_after_close(tmp_path: Path) -> None:
    src = source_cache()

    eng = engine(tmp_path)
    dst = bsr.PagedKVCache(LAYOUT, NBLOCKS, BLOCK_TOKENS)
    with pytest.raises(bsr.ClosedError, match="use 'async with engine:'"):
        await eng.restore(TOKENS, dst, DST_IDS)
    async with eng:
        await eng.save(TOKENS, src, SRC_IDS)
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: eng.restore(TOKENS, dst, DST_IDS),
        lambda: eng.save(TOKENS, src, SRC_IDS),
        lambda: eng.lookup(TOKENS),
        eng.open,
    ]
    for fn in calls:
        with pytest.raises(bsr.ClosedError, match="create a new one"):
            await fn()
    with pytest.raises(bsr.ClosedError, match="create a new one"):
        eng.statistics()
    assert all(not dst.tensor(g.name).any() for g in LAYOUT.groups)
    # the durable copy is intact: a new engine over the same directory restores it exactly
    async with bsr.RestoreEngine(
        LAYOUT,
        [bsr.FileTier(tmp_path, 1 << 24, reader="posix")],
        window=2,
        io_depth=1,
        namespace=bsr.Namespace("bad-input"),
    ) as again:
        await assert_restores_exactly(again, src)


@pytest.mark.parametrize("kind", ["host", "file"])
@pytest.mark.anyio
async def test_tier_use_after_close(tmp_path: Path, kind: str) -> None:
    key = make_keys(1)[0]
    data = payload(1, 8192)

    tier: bsr.Tier = bsr.HostTier(1 << 24) if kind == "host" else bsr.FileTier(tmp_path, 1 << 24)
    async with tier:
        assert await tier.write(key, "kv", data)
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: tier.contains_many([bsr.ObjectKey(key, "kv")]),
        lambda: tier.read_into(key, "kv", bytearray(8192)),
        lambda: tier.write(key, "kv", data),
        lambda: tier.delete(key, "kv"),
    ]
    for fn in calls:
        with pytest.raises(bsr.ClosedError) as info:
            await fn()
        assert "is closed; open a new one" in str(info.value)
        assert info.value.tier == tier.name  # type: ignore[attr-defined]
    if kind == "file":
        # the object survived the misuse: a new tier over the directory reads it back
        async with bsr.FileTier(tmp_path, 1 << 24) as again:
            out = bytearray(8192)
            assert await again.read_into(key, "kv", out) == 8192
            assert bytes(out) == data.tobytes()


@pytest.mark.anyio
async def test_file_tier_used_before_open(tmp_path: Path) -> None:
    key = make_keys(1)[0]

    tier = bsr.FileTier(tmp_path, 1 << 24)
    with pytest.raises(bsr.BsrError) as info:
        await tier.contains_many([bsr.ObjectKey(key, "kv")])
    assert "use 'async with tier' or await tier.open()" in str(info.value)
