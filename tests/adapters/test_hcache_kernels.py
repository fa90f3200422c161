"""The rebuild's kernels: per layer, one fused K/V GEMM and a constant number of other
operators for each piece of restored tokens, never per block or per token, and no copy
between devices or of the hidden rows beyond the one gather (none for a run of blocks).

Counted with a ``TorchDispatchMode`` (every ATen operator the rebuild dispatches, which on a
GPU is every kernel it launches), so a rebuild that falls back to per-block work fails here on
CPU as it would on a device; the numbers it computes are compared with the model's own
module-by-module projection.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adapters.hcache_kit import build
from bsr import PagedKVCache, StateGroup, StateLayout, hcache

pytest.importorskip("transformers")

BT = 16
LAYERS = 3


#: operators that only make views or read a scalar: no kernel, no bytes moved
VIEWS = {"view", "slice", "select", "unsqueeze", "t", "detach", "unbind", "as_strided"}
VIEWS |= {"_local_scalar_dense", "alias", "expand", "permute", "reshape", "_unsafe_view"}


class _Ops(TorchDispatchMode):
    """Counts the operators dispatched; ``copied`` the sizes of every copy (``copy_``,
    ``_to_copy``: a dtype cast or a move between devices)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.copied: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in ("copy_", "_to_copy"):
            self.copied.append(args[-1 if name == "copy_" else 0].numel())
        return func(*args, **(kwargs or {}))


def _caches(a: hcache.ModelAdapter, blocks: int) -> tuple[PagedKVCache, PagedKVCache]:
    s, item = a.shape, a.dtype.itemsize
    name = str(a.dtype).removeprefix("torch.")
    tokens = blocks * BT
    hl = StateLayout(tokens, (StateGroup("h", s.num_layers, s.hidden * item, dtype=name),))
    kl = StateLayout(tokens, (StateGroup("kv", s.num_layers, 2 * s.kv_dim * item, dtype=name),))
    src = PagedKVCache(hl, blocks, BT)
    src.typed("h").copy_(
        torch.randn(src.typed("h").shape, generator=torch.Generator().manual_seed(1))
    )
    return src, PagedKVCache(kl, blocks, BT)


def _rebuild(
    model: Any, blocks: int, ids: torch.Tensor, **kw: Any
) -> tuple[_Ops, PagedKVCache, PagedKVCache, hcache.ModelAdapter]:
    a = hcache.ModelAdapter(model)
    src, dst = _caches(a, blocks)
    n = blocks * BT
    rope = a.rope(0, n)
    with _Ops() as seen:
        hcache.rebuild_rows(a, src, "h", range(LAYERS), dst, ids, n, rope, **kw)
    return seen, src, dst, a


def _shuffled(blocks: int) -> torch.Tensor:
    return torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_kernels_per_layer_do_not_grow_with_the_blocks(kv_heads: int, dtype: torch.dtype) -> None:
    model = build("llama", layers=LAYERS, kv_heads=kv_heads).to(dtype)
    few, *_ = _rebuild(model, 4, _shuffled(4))
    seen, *_ = _rebuild(model, 64, _shuffled(64))
    many = seen.ops
    assert few.ops == many, (few.ops, many)  # 4 blocks or 64: the same operators, as often
    assert many["mm"] == LAYERS  # one fused K/V GEMM per layer
    assert many["index_select"] == LAYERS and many["index_copy_"] == LAYERS
    # no other copy of hidden or K/V rows (only the per-token scale, cast to bf16)
    assert all(n <= 64 * BT for n in seen.copied), seen.copied
    kernels = sum(v for k, v in many.items() if k not in VIEWS)
    assert kernels <= 20 * LAYERS, many


def test_a_run_of_blocks_is_projected_where_it_lies() -> None:
    model = build("llama", layers=LAYERS, kv_heads=2)
    seen, *_ = _rebuild(model, 32, torch.arange(32))
    assert seen.ops["index_select"] == 0 and seen.ops["mm"] == LAYERS


def test_pieces_are_the_unit_of_work() -> None:
    model = build("llama", layers=LAYERS, kv_heads=2)
    seen, *_ = _rebuild(model, 32, _shuffled(32), piece_tokens=8 * BT)
    assert seen.ops["mm"] == 4 * LAYERS and seen.ops["index_copy_"] == 4 * LAYERS


@pytest.mark.parametrize("order", ["shuffled", "run"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3_partial"])
def test_rebuilt_rows_are_the_modules_projection(kind: str, order: str) -> None:
    """Every block's rows, gathered or viewed in place, on the folded path (llama) and the
    module-by-module one (key norms, partial rotary), against each layer's own modules."""
    blocks = 12
    model = build(kind, layers=LAYERS, kv_heads=2)
    ids = _shuffled(blocks) if order == "shuffled" else torch.arange(blocks)
    _, src, dst, a = _rebuild(model, blocks, ids, piece_tokens=5 * BT)  # 3 pieces, one short
    n = blocks * BT
    rope = a.rope(0, n)
    t = torch.arange(n)
    for layer in range(LAYERS):
        h = src.typed("h")[layer][ids[t // BT], t % BT]
        want = a._project_modules(layer, h, rope)
        got = dst.typed("kv")[layer][ids[t // BT], t % BT]
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (layer, err)


@pytest.mark.parametrize("planes", [False, True], ids=["rows", "planes"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a bias on K and V
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grouped_rebuild_is_the_per_layer_one_in_fewer_kernels(
    kind: str, dtype: torch.dtype, planes: bool
) -> None:
    """``grouped=True``: one batched GEMM and one set of elementwise kernels for the layers of
    a group, per piece; the same rows as the per-layer rebuild (to the dtype's rounding)."""
    model = build(kind, layers=LAYERS, kv_heads=2).to(dtype)
    a = hcache.ModelAdapter(model)
    blocks = 24
    ids = _shuffled(blocks)
    src, _ = _caches(a, blocks)
    n = blocks * BT
    rope = a.rope(0, n)
    s = a.shape
    shape = (blocks, 2, BT, s.kv_dim) if planes else (blocks, BT, 2 * s.kv_dim)
    got = {}
    for grouped in (False, True):
        mine = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
        dst = PagedKVCache.from_layer_tensors(_caches(a, blocks)[1].layout, {"kv": mine}, BT)
        with _Ops() as seen:
            hcache.rebuild_rows(
                a, src, "h", range(LAYERS), dst, ids, n, rope, planes=planes, grouped=grouped,
                piece_tokens=8 * BT,
            )  # fmt: skip
        got[grouped] = (mine, seen.ops)
    (per_layer, ops1), (grouped_rows, ops2) = got[False], got[True]
    for a_, b_ in zip(per_layer, grouped_rows):
        err = ((a_.float() - b_.float()).abs().max() / a_.float().abs().max()).item()
        assert err <= (1e-6 if dtype == torch.float32 else 1e-2), err
    pieces = 3
    assert ops1["mm"] == LAYERS * pieces and ops2["bmm"] == pieces and ops2["mm"] == 0
    assert ops2["index_copy_"] == ops1["index_copy_"] == LAYERS * pieces
    assert ops2["linalg_vector_norm"] == pieces  # one norm pass for the group, per piece
    k1 = sum(v for k, v in ops1.items() if k not in VIEWS)
    k2 = sum(v for k, v in ops2.items() if k not in VIEWS)
    assert k2 <= k1 // 2, (k1, k2)


def test_a_group_that_cannot_go_together_is_rebuilt_layer_by_layer() -> None:
    model = build("qwen3", layers=LAYERS, kv_heads=2)  # key norms: the module-by-module path
    a = hcache.ModelAdapter(model)
    assert not a.groupable(range(LAYERS), a.rope(0, 8))
    seen, *_ = _rebuild(model, 8, _shuffled(8), grouped=True)
    assert seen.ops["bmm"] == 0 and seen.ops["mm"] == LAYERS
