"""HCache's rebuild on the device (#49): every operator of a rebuilt layer runs where the model
runs, a constant number of them per layer and piece whatever the number of blocks, no hidden or
K/V rows copied between devices, and the rebuilt K/V equal to the model's own projection
within the dtype's tolerance, in fp32 and in bf16 (what a GPU serves).

Marked ``cuda``: run by ``bench/gpu/run.py`` on a GPU, on the CPU in its dry run.
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
pytestmark = pytest.mark.cuda

BT, LAYERS = 16, 3
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class _Where(TorchDispatchMode):
    """Counts operators, the devices of the values they were given, and copies of more than
    a few rows between devices."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.devices: set[str] = set()
        self.cross: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        ts = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        # where the values live (block ids are a CPU table, moved once per piece)
        self.devices |= {a.device.type for a in ts if a.is_floating_point()}
        out = func(*args, **(kwargs or {}))
        copies = name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor)
        if copies and any(a.device != out.device and a.numel() > BT * 64 for a in ts):
            self.cross.append(name)
        return out


def _rebuild(model: Any, blocks: int, device: str) -> tuple[_Where, float]:
    a = hcache.ModelAdapter(model)
    s, item = a.shape, a.dtype.itemsize
    name = str(a.dtype).removeprefix("torch.")
    n = blocks * BT
    hl = StateLayout(n, (StateGroup("h", s.num_layers, s.hidden * item, dtype=name),))
    kl = StateLayout(n, (StateGroup("kv", s.num_layers, 2 * s.kv_dim * item, dtype=name),))
    src = PagedKVCache(hl, blocks, BT, device=device)
    src.typed("h").copy_(
        torch.randn(src.typed("h").shape, generator=torch.Generator().manual_seed(3))
    )
    dst = PagedKVCache(kl, blocks, BT, device=device)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks))
    rope = a.rope(0, n)
    with _Where() as seen:
        hcache.rebuild_rows(a, src, "h", range(LAYERS), dst, ids, n, rope)
    t = torch.arange(n)
    worst = 0.0
    for layer in range(LAYERS):
        h = src.typed("h")[layer][ids[t // BT], t % BT]
        want = a._project_modules(layer, h, rope).float()
        got = dst.typed("kv")[layer][ids[t // BT], t % BT].float()
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return seen, worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_rebuild_runs_on_the_device_in_constant_kernels(
    device: str, kv_heads: int, dtype: torch.dtype
) -> None:
    model = build("llama", layers=LAYERS, kv_heads=kv_heads).to(device=device, dtype=dtype)
    few, err_few = _rebuild(model, 4, device)
    many, err_many = _rebuild(model, 48, device)
    assert few.ops == many.ops, (few.ops, many.ops)
    assert many.ops["mm"] == LAYERS
    assert many.devices == {torch.device(device).type}, many.devices
    assert not many.cross, many.cross
    assert max(err_few, err_many) <= TOLERANCE[dtype], (err_few, err_many)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rebuild_lands_in_vllms_per_layer_planes_on_the_device(
    device: str, dtype: torch.dtype
) -> None:
    """vLLM's per-layer tensors ``[blocks, 2, block, kv_dim]`` on the device: each block's K
    rows then its V rows, equal to the rows the bsr.hf layout gets, still one copy per layer."""
    model = build("llama", layers=LAYERS, kv_heads=2).to(device=device, dtype=dtype)
    a = hcache.ModelAdapter(model)
    s, item = a.shape, a.dtype.itemsize
    name = str(a.dtype).removeprefix("torch.")
    blocks, kd = 24, s.kv_dim
    n = blocks * BT
    hl = StateLayout(n, (StateGroup("h", s.num_layers, s.hidden * item, dtype=name),))
    kl = StateLayout(n, (StateGroup("kv", s.num_layers, 2 * kd * item, dtype=name),))
    src = PagedKVCache(hl, blocks, BT, device=device)
    src.typed("h").normal_()
    rows = PagedKVCache(kl, blocks, BT, device=device)
    mine = [torch.zeros(blocks, 2, BT, kd, dtype=dtype, device=device) for _ in range(LAYERS)]
    planes = PagedKVCache.from_layer_tensors(kl, {"kv": mine}, BT)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(7))
    rope = a.rope(0, n)
    hcache.rebuild_rows(a, src, "h", range(LAYERS), rows, ids, n, rope)
    with _Where() as seen:
        hcache.rebuild_rows(a, src, "h", range(LAYERS), planes, ids, n, rope, planes=True)
    assert seen.ops["index_copy_"] == LAYERS and not seen.cross
    for layer in range(LAYERS):
        want = rows.typed("kv")[layer].view(blocks, BT, 2, kd).transpose(1, 2)
        assert torch.equal(mine[layer], want), layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.anyio
async def test_a_gqa_restore_lands_on_the_device_in_token_order(
    device: str, dtype: torch.dtype
) -> None:
    """Hidden rows wider than K/V rows (MQA here; Llama-3-8B's GQA in the bench) restored from a
    HostTier into a serving cache on the device: they land in a buffer on the device sized to
    the request, the engine copies into it, the rebuild reads it in place, and the K/V in the
    caller's shuffled blocks equal the served ones within the dtype's tolerance."""
    import bsr
    from adapters.hcache_kit import forward, next_cache, prompt, shuffled
    from bsr import hf

    model = build("llama", layers=LAYERS, kv_heads=1).to(device=device, dtype=dtype)
    hc = hcache.HCache(model, hcache.fixed_plan(model.config, ["hidden"] * LAYERS, dtype=dtype))
    assert hc.lands_apart
    chunk, num_blocks = hc.layout.chunk_tokens, 96
    n = 2 * chunk
    toks = prompt(n + 5)
    src_ids, dst_ids = shuffled(num_blocks, -(-(n + 5) // BT), 1), shuffled(num_blocks, n // BT, 2)
    served = PagedKVCache(hc.kv_layout, num_blocks, BT, device=device)
    store = hc.hidden_store(num_blocks, BT)
    with torch.no_grad(), hc.capture(store, src_ids):
        past = next_cache(forward(model, toks.to(device), None))
    hf.write_kv_to_cache(past, served, src_ids, n + 5, config=model.config)
    views: list[PagedKVCache] = []
    make = hc.restore_view

    def spy(cache: Any, num_tokens: Any = None) -> Any:
        views.append(make(cache, num_tokens))
        return views[-1]

    hc.restore_view = spy  # type: ignore[method-assign]
    dst = PagedKVCache(hc.kv_layout, num_blocks, BT, device=device)
    engine = bsr.RestoreEngine(
        hc.layout, [bsr.HostTier(64 << 20)], window=4, io_depth=2, namespace=hc.namespace("gpu")
    )
    async with engine:
        await hc.save(engine, toks[0, :n], served, store, src_ids)
        res = await hc.restore(engine, toks[0, :n], dst, dst_ids)
    assert res.committed_tokens == n and res.reason is None, res.reason
    (landing,) = {t.device.type for g in views[0].layout.group_names for t in views[0].layers(g)}
    assert landing == torch.device(device).type
    assert views[0].group_blocks["hidden.0"] == n // BT  # the request's blocks, not 96
    t = torch.arange(n)
    want = served.typed("kv")[:, src_ids[t // BT], t % BT].float()
    got = dst.typed("kv")[:, dst_ids[t // BT], t % BT].float()
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOLERANCE[dtype]
