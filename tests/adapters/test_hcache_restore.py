"""Every kind of HCache restore decodes like the never-evicted run; failures leave nothing.

A 4-layer random Llama (MHA and GQA) serves a prompt and two decode steps with capture hooks on
(the hidden states are appended step by step, no second forward). The plan's state is saved
through a RestoreEngine over a FileTier and restored into a fresh serving cache: pure KV, pure
hidden states, recompute + hidden + KV, recompute + KV. Decoding from the restored cache must
match the never-evicted run. A failed read of one hidden-state object, and a projection that
raises, must both end with nothing reported reusable.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import bsr
from adapters.hcache_kit import (
    build,
    decode_from,
    forward,
    max_diff,
    next_cache,
    prompt,
    same_tokens,
    shuffled,
)
from bsr import hcache, hf
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier
from support.engines import HangingContains, make_engine

pytest.importorskip("transformers")

CHUNK, BLOCK, NUM_BLOCKS = 32, 8, 64
#: MHA (a hidden row is half a K/V row: it lands inside the K/V blocks), GQA with a hidden row
#: as wide as the K/V row (also inside), and MQA, whose hidden rows are twice its K/V rows: they
#: land in a buffer of their own, sized to the request
KV_HEADS, KV_HEAD_IDS = [4, 2, 1], ["mha", "gqa", "mqa-landing"]
PREFIX = 4 * CHUNK
PROMPT = PREFIX + 7


class Served:
    """A request served with capture on: serving cache, hidden store, block table."""

    def __init__(self, model: Any, methods: list[str]) -> None:
        self.model = model
        self.hc = hcache.HCache(
            model, hcache.fixed_plan(model.config, methods, group_layers=1), chunk_tokens=CHUNK
        )
        self.toks = prompt(PROMPT + 2)
        n_blocks = -(-(PROMPT + 2) // BLOCK)
        self.src_ids = shuffled(NUM_BLOCKS, n_blocks, 1)
        self.dst_ids = shuffled(NUM_BLOCKS, n_blocks, 2)
        self.kv = bsr.PagedKVCache(self.hc.kv_layout, NUM_BLOCKS, BLOCK)
        self.store = self.hc.hidden_store(NUM_BLOCKS, BLOCK)
        with torch.no_grad(), self.hc.capture(self.store, self.src_ids) as cap:
            past = next_cache(forward(model, self.toks[:, :PROMPT], None))
            for t in range(PROMPT, PROMPT + 2):  # decode steps: capture appends one row each
                past = next_cache(forward(model, self.toks[:, t : t + 1], past))
        assert cap.tokens == (PROMPT + 2 if "hidden" in methods else 0)  # nothing to capture
        hf.write_kv_to_cache(past, self.kv, self.src_ids, PROMPT + 2, config=model.config)

    def engine(self, root: Path, tier: Any = None) -> bsr.RestoreEngine:
        return make_engine(
            self.hc.layout,
            [tier or bsr.FileTier(root, 1 << 26)],
            window=2,
            io_depth=2,
            namespace=self.hc.namespace("hcache-restore"),
        )

    async def save_restore(
        self, root: Path, tier: Any = None
    ) -> tuple[bsr.PagedKVCache, hcache.HCacheRestore]:
        dst = bsr.PagedKVCache(self.hc.kv_layout, NUM_BLOCKS, BLOCK)

        async with self.engine(root, tier) as engine:
            await self.hc.save(engine, self.toks[0, :PREFIX], self.kv, self.store, self.src_ids)
            return dst, await self.hc.restore(engine, self.toks[0, :PROMPT], dst, self.dst_ids)


PLANS = {
    "kv": ["kv"] * 4,
    "hidden": ["hidden"] * 4,
    "recompute+hidden+kv": ["recompute", "hidden", "hidden", "kv"],
    "recompute+kv": ["recompute", "kv", "kv", "kv"],
}


@pytest.mark.parametrize("kv_heads", KV_HEADS, ids=KV_HEAD_IDS)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.anyio
async def test_every_plan_decodes_like_the_never_evicted_run(
    plan: str, kv_heads: int, tmp_path: Path
) -> None:
    model = build("llama", layers=4, kv_heads=kv_heads)
    served = Served(model, PLANS[plan])
    dst, res = await served.save_restore(tmp_path)
    assert res.committed_tokens == PREFIX and res.reason is None and res.invalid_block_ids == ()
    assert res.engine is not None and res.engine.committed_tokens == PREFIX
    # bytes read: exactly the plan's groups
    layout = served.hc.layout
    assert sum(res.engine.bytes_by_tier.values()) == 4 * layout.chunk_bytes
    # the restored K/V rows equal the served ones for every layer, recompute and rebuild included
    n = torch.arange(PREFIX)
    a = served.kv.typed("kv")[:, served.src_ids[n // BLOCK], n % BLOCK]
    b = dst.typed("kv")[:, served.dst_ids[n // BLOCK], n % BLOCK]
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    rebuilt = hf.read_kv_from_cache(dst, served.dst_ids, PREFIX, model.config)
    toks = served.toks[:, :PROMPT]
    want = decode_from(model, toks, 0, None)
    got = decode_from(model, toks, PREFIX, rebuilt)
    assert max_diff(got, want) <= 1e-5 and same_tokens(got, want)


def test_hidden_states_land_inside_the_kv_blocks_for_mha() -> None:
    """Restored MHA hidden states need no memory of their own: each lands in its own K/V block."""
    model = build("llama", layers=4, kv_heads=4)
    hc = hcache.HCache(model, hcache.fixed_plan(model.config, ["hidden"] * 4), chunk_tokens=CHUNK)
    kv = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
    view = hc.restore_view(kv)
    base = kv.tensor("kv")
    for j, layer in enumerate(view.layers("hidden.0")):
        assert layer.data_ptr() == base[j].data_ptr()  # block 0 of layer j, first bytes
        assert layer.stride(0) == base.stride(1)  # one K/V block apart: block-contiguous
    assert view.nbytes < base.numel()  # the view is half of the K/V bytes
    gqa = build("llama", layers=4, kv_heads=1)
    hg = hcache.HCache(gqa, hcache.fixed_plan(gqa.config, ["hidden"] * 4), chunk_tokens=CHUNK)
    kvg = bsr.PagedKVCache(hg.kv_layout, NUM_BLOCKS, BLOCK)
    landing = hg.restore_view(kvg).layers("hidden.0")[0]
    assert not (
        kvg.tensor("kv").data_ptr() <= landing.data_ptr() < kvg.tensor("kv").data_ptr() + kvg.nbytes
    )


@pytest.mark.anyio
async def test_a_landing_holds_the_requests_blocks_not_the_caches(tmp_path: Path) -> None:
    """Hidden rows wider than K/V rows (MQA here, GQA-8 at 7B) land in a buffer of the request's
    size, filled in token order, so the rebuild reads them where they lie; the caller's blocks
    stay the K/V layers' and the rebuilt ones."""
    model = build("llama", layers=4, kv_heads=1)
    served = Served(model, ["hidden", "hidden", "kv", "kv"])
    hc = served.hc
    assert hc.lands_apart
    kv = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
    view = hc.restore_view(kv, 5 * BLOCK - 3)  # 5 blocks, not the cache's 64
    assert view.group_blocks == {"kv": NUM_BLOCKS, "hidden.0": 5, "hidden.1": 5}
    assert view.num_blocks == 5  # one table for every group must fit the smallest
    with pytest.raises(bsr.BlockTableError):
        view.block_tables(torch.arange(6), 6 * BLOCK)
    views: list[bsr.PagedKVCache] = []
    sources: list[Any] = []
    make, rebuild = hc.restore_view, hc.rebuild

    def spy_view(cache: Any, num_tokens: Any = None) -> Any:
        views.append(make(cache, num_tokens))
        return views[-1]

    def spy_rebuild(*a: Any, **kw: Any) -> None:
        sources.append(kw.get("src_ids"))
        rebuild(*a, **kw)

    hc.restore_view, hc.rebuild = spy_view, spy_rebuild  # type: ignore[method-assign]
    dst, res = await served.save_restore(tmp_path)
    assert res.committed_tokens == PREFIX and res.reason is None
    # the prompt's whole chunks (4), not the cache's 64 blocks
    assert views[0].group_blocks["hidden.0"] == PREFIX // BLOCK
    assert sources and all(torch.equal(s, torch.arange(PREFIX // BLOCK)) for s in sources)
    n = torch.arange(PREFIX)
    a = served.kv.typed("kv")[:, served.src_ids[n // BLOCK], n % BLOCK]
    b = dst.typed("kv")[:, served.dst_ids[n // BLOCK], n % BLOCK]
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    # blocks outside the request were not written
    others = sorted(set(range(NUM_BLOCKS)) - set(served.dst_ids[: PREFIX // BLOCK].tolist()))
    assert not dst.typed("kv")[:, others].any()
    # a hit shorter than the prompt lands the hit only, a miss nearly nothing: the engine
    # restores the prefix this restore's own lookup found
    longer = torch.cat((served.toks[0, :PREFIX], prompt(3 * CHUNK, seed=9)[0]))
    ids = shuffled(NUM_BLOCKS, len(longer) // BLOCK, 4)
    async with served.engine(tmp_path) as engine:
        short = await hc.restore(
            engine, longer, bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK), ids
        )
        miss = await hc.restore(
            engine, longer[CHUNK:], bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK), ids
        )
    assert short.committed_tokens == PREFIX and views[1].group_blocks["hidden.0"] == PREFIX // BLOCK
    assert miss.committed_tokens == 0 and views[2].group_blocks["hidden.0"] == 1


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa-landing"])
@pytest.mark.anyio
async def test_a_failed_hidden_read_invalidates_the_whole_request(
    kv_heads: int, tmp_path: Path
) -> None:
    model = build("llama", layers=4, kv_heads=kv_heads)
    served = Served(model, ["hidden", "hidden", "kv", "kv"])
    plan = FaultPlan(
        seed=1, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({2}), group="hidden.1"),)
    )
    tier = FaultyTier(bsr.FileTier(tmp_path, 1 << 26), plan)
    _, res = await served.save_restore(tmp_path, tier)
    assert res.committed_tokens == 0 and not res.committed
    assert res.engine is not None and res.engine.state is bsr.RequestState.INVALIDATED
    # what the engine touched in the caller's cache, nothing outside the request's prefix (a
    # landing's blocks are the landing's, not the caller's)
    touched = res.engine.invalid_block_ids_by_group
    callers = ["kv"] if served.hc.lands_apart else list(touched)
    assert {b for g in callers for b in touched.get(g, ())} <= set(res.invalid_block_ids)
    assert set(res.invalid_block_ids) <= set(served.dst_ids[: PREFIX // BLOCK].tolist())


class CountingContains(bsr.TierWrapper[bsr.Tier]):
    """Counts the tier's metadata queries."""

    calls = 0

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        self.calls += 1
        return await self.inner.contains_many(objects)


@pytest.mark.parametrize("kv_heads", KV_HEADS, ids=KV_HEAD_IDS)
@pytest.mark.anyio
async def test_a_restore_asks_the_tiers_once(kv_heads: int, tmp_path: Path) -> None:
    """One metadata query per restore, a landing's too: its probe is cut to the prefix it
    restores (``RestoreEngine.narrow``). A landing restore probed the prefix a second time."""
    served = Served(build("llama", layers=4, kv_heads=kv_heads), ["hidden", "hidden", "kv", "kv"])
    tier = CountingContains(bsr.FileTier(tmp_path, 1 << 26))
    hc, dst = served.hc, bsr.PagedKVCache(served.hc.kv_layout, NUM_BLOCKS, BLOCK)
    async with served.engine(tmp_path, tier) as engine:
        await hc.save(engine, served.toks[0, :PREFIX], served.kv, served.store, served.src_ids)
        tier.calls = 0  # the save's own query (what the tier holds already) is not counted
        res = await hc.restore(engine, served.toks[0, :PROMPT], dst, served.dst_ids)
    assert res.committed_tokens == PREFIX and tier.calls == 1
    rebuilt = hf.read_kv_from_cache(dst, served.dst_ids, PREFIX, served.model.config)
    toks = served.toks[:, :PROMPT]
    want = decode_from(served.model, toks, 0, None)
    got = decode_from(served.model, toks, PREFIX, rebuilt)
    assert max_diff(got, want) <= 1e-5 and same_tokens(got, want)


@pytest.mark.anyio
async def test_a_hung_tier_below_the_host_is_cut_off_by_the_deadline(tmp_path: Path) -> None:
    """HCache's own lookup (the prefix for recompute and projection) and the engine's restore
    share the restore's deadline: the lookup cuts the hung tier off at the engine's
    ``probe_share`` of it, the host's copy is restored in what is left, and the whole ends
    within the one deadline. Before, that lookup waited on the hung tier for ever, whatever
    the deadline; then (0.4) it took the whole deadline and the engine's restore another."""
    model = build("llama", layers=4, kv_heads=4)
    served = Served(model, ["recompute", "hidden", "kv", "kv"])
    host, slow = bsr.HostTier(1 << 26), HangingContains(bsr.FileTier(tmp_path, 1 << 26))
    hc, toks = served.hc, served.toks[0]
    engine = make_engine(
        hc.layout, [host, slow], namespace=hc.namespace("hcache-restore"), probe_share=0.25
    )
    async with engine:
        await hc.save(engine, toks[:PREFIX], served.kv, served.store, served.src_ids)
        slow.hang = True
        dst = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
        t0 = time.perf_counter()
        with anyio.fail_after(60):  # a hang guard: the bound under test is 4 s
            res = await hc.restore(engine, toks[:PROMPT], dst, served.dst_ids, deadline_s=4.0)
        elapsed = time.perf_counter() - t0
        assert res.committed_tokens == PREFIX
        assert engine.health.state(slow.name).consecutive_failures >= 1
        # the lookup waited its quarter (1 s) for the hung tier; the whole, within the 4 s
        assert 0.9 <= elapsed < 4.0, elapsed
    n = torch.arange(PREFIX)  # every layer as served: recomputed, projected and read
    a = served.kv.typed("kv")[:, served.src_ids[n // BLOCK], n % BLOCK]
    b = dst.typed("kv")[:, served.dst_ids[n // BLOCK], n % BLOCK]
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


@pytest.mark.anyio
async def test_a_failed_read_also_reports_the_recomputed_blocks(tmp_path: Path) -> None:
    model = build("llama", layers=4, kv_heads=4)
    served = Served(model, ["recompute", "hidden", "kv", "kv"])
    plan = FaultPlan(
        seed=1, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({3}), group="kv"),)
    )
    _, res = await served.save_restore(tmp_path, FaultyTier(bsr.FileTier(tmp_path, 1 << 26), plan))
    assert res.committed_tokens == 0 and res.recompute_s > 0
    assert set(res.invalid_block_ids) == set(served.dst_ids[: PREFIX // BLOCK].tolist())


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa-landing"])
@pytest.mark.anyio
async def test_a_failed_projection_invalidates_the_whole_request(
    kv_heads: int, tmp_path: Path
) -> None:
    model = build("llama", layers=4, kv_heads=kv_heads)
    served = Served(model, ["hidden", "hidden", "kv", "kv"])
    broken = served.hc.adapter._proj[1]
    broken.weight = broken.wkv = torch.zeros(3, 3)  # the GEMM of layer 1 now raises
    _, res = await served.save_restore(tmp_path)
    # the reads were fine; the engine commits (the failure came after its last chunk) or not
    # (the hook raised for a later chunk): either way nothing of the request is reusable
    assert res.engine is not None and res.engine.committed_tokens in (0, PREFIX)
    assert (
        res.committed_tokens == 0 and res.reason is not None and "projection failed" in res.reason
    )
    prefix_blocks = set(served.dst_ids[: PREFIX // BLOCK].tolist())
    assert set(res.invalid_block_ids) == prefix_blocks


@pytest.mark.anyio
async def test_rope_is_computed_once_per_restore(tmp_path: Path) -> None:
    model = build("llama", layers=4, kv_heads=4)
    served = Served(model, ["hidden", "hidden", "hidden", "kv"])  # three hidden groups
    calls: list[int] = []
    hook = model.model.rotary_emb.register_forward_hook(lambda *_: calls.append(1))
    try:
        _, res = await served.save_restore(tmp_path)
    finally:
        hook.remove()
    assert res.committed_tokens == PREFIX and len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma", "phi3"])
def test_fast_projection_matches_the_module_by_module_one(kind: str, dtype: torch.dtype) -> None:
    """Folded norm, one GEMM, RoPE on its output (the fast path) against the model's own
    modules, per layer, in fp32 and in bf16 (what a GPU serves)."""
    model = build(kind, kv_heads=2).to(dtype)
    a = hcache.ModelAdapter(model)
    rope = a.rope(0, 40)
    assert all(a.fast(i, rope) for i in range(3))
    h = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i in range(3):
        fast = a.project(i, h, rope).float()
        p = a._proj[i]
        saved, p.wkv = p.wkv, None  # force the module-by-module path
        slow = a.project(i, h, rope).float()
        p.wkv = saved
        err = ((fast - slow).abs().max() / slow.abs().max()).item()
        assert err <= tol, err


@pytest.mark.anyio
async def test_truncate_commits_the_installed_prefix_for_every_layer(tmp_path: Path) -> None:
    """policy=truncate: a failed read of chunk 3 leaves chunks 0-2, rebuilt and recomputed."""
    model = build("llama", layers=4, kv_heads=4)
    served = Served(model, ["recompute", "hidden", "kv", "kv"])
    plan = FaultPlan(seed=1, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({3})),))
    tier = FaultyTier(bsr.FileTier(tmp_path, 1 << 26), plan)
    dst = bsr.PagedKVCache(served.hc.kv_layout, NUM_BLOCKS, BLOCK)

    async def main() -> hcache.HCacheRestore:
        async with served.engine(tmp_path, tier) as engine:
            await served.hc.save(
                engine, served.toks[0, :PREFIX], served.kv, served.store, served.src_ids
            )
            return await served.hc.restore(
                engine, served.toks[0, :PROMPT], dst, served.dst_ids, policy="truncate"
            )

    res = await main()
    n = 3 * CHUNK
    assert res.committed_tokens == n and res.reason is None
    bpc = CHUNK // BLOCK
    # chunk 3's blocks: what the engine touched and the recompute (run for the probed 4 chunks)
    assert set(res.invalid_block_ids) == set(served.dst_ids[3 * bpc : 4 * bpc].tolist())
    rebuilt = hf.read_kv_from_cache(dst, served.dst_ids, n, model.config)
    toks = served.toks[:, :PROMPT]
    want = decode_from(model, toks, 0, None)
    got = decode_from(model, toks, n, rebuilt)
    assert max_diff(got, want) <= 1e-5 and same_tokens(got, want)


async def _restore_with(
    served: Served, root: Path, **kw: Any
) -> tuple[bsr.PagedKVCache, hcache.HCacheRestore]:
    dst = bsr.PagedKVCache(served.hc.kv_layout, NUM_BLOCKS, BLOCK)

    async with served.engine(root) as engine:
        hc = served.hc
        await hc.save(engine, served.toks[0, :PREFIX], served.kv, served.store, served.src_ids)
        return dst, await hc.restore(engine, served.toks[0, :PROMPT], dst, served.dst_ids, **kw)


@pytest.mark.parametrize("kv_heads", KV_HEADS, ids=KV_HEAD_IDS)
@pytest.mark.anyio
async def test_chunks_are_projected_while_later_chunks_are_still_being_read(
    kv_heads: int, tmp_path: Path
) -> None:
    """The last chunk's on_installed (a caller's hook, called after HCache's own) waits until
    chunk 0 has been projected: that can only finish if the projection runs before the engine
    returns. Every token is projected exactly once, and the decode still matches the
    never-evicted run."""
    import threading

    model = build("llama", layers=4, kv_heads=kv_heads)
    served = Served(model, ["hidden", "hidden", "kv", "kv"])
    calls: list[tuple[int, int]] = []
    first_done = threading.Event()
    real = served.hc.rebuild

    def rebuild(view: Any, kv: Any, ids: Any, n: int, **kw: Any) -> None:
        real(view, kv, ids, n, **kw)
        calls.append((kw.get("start", 0), n))
        if kw.get("start", 0) == 0:
            first_done.set()

    served.hc.rebuild = rebuild  # type: ignore[method-assign]
    seen: list[int] = []
    overlapped: list[bool] = []

    async def wait_for_chunk0(chunk: int, groups: tuple[str, ...]) -> None:
        seen.append(chunk)
        if len(seen) == PREFIX // CHUNK:  # the last chunk to land
            with anyio.move_on_after(10):
                while not first_done.is_set():  # noqa: ASYNC110 - set by a worker thread
                    await anyio.sleep(0.001)
            overlapped.append(first_done.is_set())

    dst, res = await _restore_with(served, tmp_path, on_installed=wait_for_chunk0)
    assert overlapped == [True]  # chunk 0 was projected before the engine returned
    assert res.committed_tokens == PREFIX and res.reason is None
    assert sorted(seen) == list(range(PREFIX // CHUNK))
    # runs of chunks that landed together are projected in one call: every token exactly once
    spans = sorted(calls)
    assert spans[0][0] == 0 and spans[-1][1] == PREFIX
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(lo % CHUNK == 0 for lo, _ in spans)
    rebuilt = hf.read_kv_from_cache(dst, served.dst_ids, PREFIX, model.config)
    toks = served.toks[:, :PROMPT]
    want = decode_from(model, toks, 0, None)
    got = decode_from(model, toks, PREFIX, rebuilt)
    assert max_diff(got, want) <= 1e-5 and same_tokens(got, want)


@pytest.mark.anyio
async def test_a_projection_failing_on_one_chunk_invalidates_the_whole_request(
    tmp_path: Path,
) -> None:
    """Chunk 1's projection raises while the others succeed: nothing of the request is
    reported reusable, whichever chunks the engine had committed."""
    model = build("llama", layers=4, kv_heads=4)
    served = Served(model, ["hidden", "kv", "kv", "kv"])
    real = served.hc.rebuild

    def rebuild(view: Any, kv: Any, ids: Any, n: int, **kw: Any) -> None:
        if kw.get("start", 0) <= CHUNK < n:  # this call covers chunk 1
            raise RuntimeError("chunk 1 GEMM failed")
        real(view, kv, ids, n, **kw)

    served.hc.rebuild = rebuild  # type: ignore[method-assign]
    for policy in ("all_or_nothing", "truncate"):
        _, res = await _restore_with(served, tmp_path / policy, policy=policy)
        assert res.committed_tokens == 0 and not res.committed
        assert res.reason is not None and "chunk 1 GEMM failed" in res.reason
        assert set(res.invalid_block_ids) >= set(served.dst_ids[: PREFIX // BLOCK].tolist())


@pytest.mark.anyio
async def test_pipeline_off_projects_everything_in_one_pass_after_the_reads(tmp_path: Path) -> None:
    """``pipeline=False`` (the benchmark's baseline): one rebuild of the whole prefix, after the
    engine returned; the restored K/V are the same as the pipelined restore's."""
    model = build("llama", layers=4, kv_heads=4)
    served = Served(model, ["hidden", "hidden", "kv", "kv"])
    on, res_on = await served.save_restore(tmp_path / "on")
    served.hc.pipeline = False
    calls: list[tuple[int, int]] = []
    real = served.hc.rebuild

    def rebuild(view: Any, kv: Any, ids: Any, n: int, **kw: Any) -> None:
        calls.append((kw.get("start", 0), n))
        real(view, kv, ids, n, **kw)

    served.hc.rebuild = rebuild  # type: ignore[method-assign]
    off, res_off = await served.save_restore(tmp_path / "off")
    assert res_on.committed_tokens == res_off.committed_tokens == PREFIX
    assert calls == [(0, PREFIX)]
    n = torch.arange(PREFIX)
    a = on.typed("kv")[:, served.dst_ids[n // BLOCK], n % BLOCK]
    b = off.typed("kv")[:, served.dst_ids[n // BLOCK], n % BLOCK]
    assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def test_runs_of_consecutive_chunks() -> None:
    from bsr.hcache._session import _runs

    assert _runs([]) == []
    assert _runs([0, 1, 3, 4, 5, 7]) == [range(0, 2), range(3, 6), range(7, 8)]


@pytest.mark.anyio
async def test_hcache_restores_only_under_the_extras_it_saved_with(tmp_path: Path) -> None:
    """A tenant's (or adapter's) hidden states and KV are never rebuilt for another."""
    served = Served(build("llama", layers=4), ["hidden", "hidden", "kv", "kv"])
    alice, bob = [bsr.KeyExtra(b"tenant:alice", 0, 1)], [bsr.KeyExtra(b"tenant:bob", 0, 1)]
    hc, toks = served.hc, served.toks[0]
    async with served.engine(tmp_path) as engine:
        await hc.save(engine, toks[:PREFIX], served.kv, served.store, served.src_ids, extras=alice)
        dst = bsr.PagedKVCache(hc.kv_layout, NUM_BLOCKS, BLOCK)
        other = await hc.restore(engine, toks[:PROMPT], dst, served.dst_ids, extras=bob)
        own = await hc.restore(engine, toks[:PROMPT], dst, served.dst_ids, extras=alice)
    assert other.committed_tokens == 0
    assert other.engine is not None and other.engine.bytes_read == 0
    assert own.committed_tokens == PREFIX


def _planes(rows: bsr.PagedKVCache, kd: int) -> list[torch.Tensor]:
    """vLLM's per-layer layout of ``rows``' K/V: one ``[blocks, 2, block, kv_dim]`` tensor per
    layer, each block's K rows then its V rows (a copy, the engine's own memory)."""
    typed = rows.typed("kv")  # [layers, blocks, block, 2 kv_dim]
    layers, nb, bt, _ = typed.shape
    return [typed[i].view(nb, bt, 2, kd).transpose(1, 2).contiguous() for i in range(layers)]


async def _restore_layers(
    hc: hcache.HCache,
    served: Served,
    root: Path,
    src: list[torch.Tensor],
    mine: list[torch.Tensor],
    want: list[torch.Tensor],
) -> None:
    """Save from per-layer tensors ``src`` (the engine's own), restore into ``mine`` and check
    every layer's restored blocks, read from ``mine`` directly, against ``want``."""
    src_cache = bsr.PagedKVCache.from_layer_tensors(hc.kv_layout, {"kv": src}, BLOCK)
    dst = bsr.PagedKVCache.from_layer_tensors(hc.kv_layout, {"kv": mine}, BLOCK)
    engine = make_engine(
        hc.layout, [bsr.FileTier(root, 1 << 26)], window=2, io_depth=2,
        namespace=hc.namespace("hcache-layers"),
    )  # fmt: skip
    async with engine:
        await hc.save(engine, served.toks[0, :PREFIX], src_cache, served.store, served.src_ids)
        res = await hc.restore(engine, served.toks[0, :PROMPT], dst, served.dst_ids)
    assert res.committed_tokens == PREFIX and res.reason is None
    blocks = PREFIX // BLOCK
    for layer in range(len(mine)):
        a = want[layer][served.src_ids[:blocks]]
        b = mine[layer][served.dst_ids[:blocks]]
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (layer, (a - b).abs().max())


@pytest.mark.parametrize("kv_heads", KV_HEADS, ids=KV_HEAD_IDS)
@pytest.mark.parametrize("plan", ["hidden", "recompute+hidden+kv"])
@pytest.mark.anyio
async def test_restore_into_vllms_per_layer_planes(
    plan: str, kv_heads: int, tmp_path: Path
) -> None:
    """``kv_block_layout="planes"``: the served and the restored caches are per-layer tensors
    in vLLM's layout; the rebuilt K and V land in their planes, equal to the served ones."""
    model = build("llama", layers=4, kv_heads=kv_heads)
    served = Served(model, PLANS[plan])
    kd = served.hc.adapter.shape.kv_dim
    hc = hcache.HCache(
        model,
        hcache.fixed_plan(model.config, PLANS[plan], group_layers=1),
        chunk_tokens=CHUNK,
        kv_block_layout="planes",
    )
    mine = [torch.zeros(NUM_BLOCKS, 2, BLOCK, kd) for _ in range(4)]
    await _restore_layers(
        hc, served, tmp_path, _planes(served.kv, kd), mine, _planes(served.kv, kd)
    )
    # the rows layout would have put V rows where K rows belong: the planes are not a no-op
    rows_hc = served.hc
    assert not rows_hc.planes and hc.planes


def test_an_unknown_kv_block_layout_is_refused() -> None:
    model = build("llama", layers=4, kv_heads=2)
    with pytest.raises(bsr.ConfigError, match="kv_block_layout must be 'rows'"):
        hcache.HCache(model, hcache.fixed_plan(model.config, ["kv"] * 4), kv_block_layout="heads")


@pytest.mark.parametrize("kv_heads", KV_HEADS, ids=KV_HEAD_IDS)
@pytest.mark.parametrize("layout", ["rows", "planes"])
@pytest.mark.anyio
async def test_a_grouped_rebuild_restores_what_was_served(
    layout: str, kv_heads: int, tmp_path: Path
) -> None:
    """``grouped_rebuild=True``: the four hidden-state layers of one group rebuilt together,
    chunk by chunk as they land, equal the served K/V."""
    model = build("llama", layers=4, kv_heads=kv_heads)
    served = Served(model, ["hidden"] * 4)
    kd = served.hc.adapter.shape.kv_dim
    plan = hcache.fixed_plan(model.config, ["hidden"] * 4)  # one group of 4 layers
    hc = hcache.HCache(
        model, plan, chunk_tokens=CHUNK, kv_block_layout=layout, grouped_rebuild=True
    )
    assert hc.plan.hidden_groups[0][1] == (0, 1, 2, 3)
    if layout == "planes":
        src_t, want = _planes(served.kv, kd), _planes(served.kv, kd)
        mine = [torch.zeros(NUM_BLOCKS, 2, BLOCK, kd) for _ in range(4)]
    else:
        src_t = list(served.kv.tensor("kv").unbind(0))
        want = [t.view(NUM_BLOCKS, BLOCK, 2 * kd) for t in served.kv.typed("kv").unbind(0)]
        mine = [torch.zeros(NUM_BLOCKS, BLOCK, 2 * kd) for _ in range(4)]
    await _restore_layers(hc, served, tmp_path, src_t, mine, want)
