"""Per-group block tables: NULL_BLOCK placeholders, group tensors aliasing one buffer, checked
against an independent oracle.

The caches here are built like vLLM's hybrid KV cache manager builds them: one pool of block
ids shared by every group (a block belongs to one group's table at a time), each group's layer
``i`` viewing the same buffer as every other group's layer ``i`` when the example aliases them,
and a sliding-window group's table holding ``NULL_BLOCK`` for the blocks outside its window.

The oracle below is written from the token ranges, not from bsr's planning code: a prefix of
``p`` chunks needs every token of a full-attention group and the last ``window`` tokens of a
windowed one; an object is the whole chunk of one group; a save stores only whole chunks (a full
group its longest prefix of them, a windowed group its window at the end of the tokens and at the
longest prefix every group can serve), and a restore commits the longest stored prefix only if the
destination tables hold a real block wherever that prefix's needed tokens go. Each token's bytes
are a pure function of the prefix up to its chunk's end (like real KV state).
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import bsr

NULL = bsr.NULL_BLOCK


def note(what: str) -> None:
    """Count a kind of example in Hypothesis' statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(what)


# ------------------------------------------------------------------ the oracle
def needed_tokens(window: int | None, p: int, ct: int) -> tuple[int, int]:
    end = p * ct
    return (0 if window is None else max(0, end - window)), end


def needed_chunks(window: int | None, p: int, ct: int) -> range:
    lo, hi = needed_tokens(window, p, ct)
    return range(lo // ct, -(-hi // ct)) if hi > lo else range(0)


def needed_objects(groups: list[bsr.StateGroup], p: int, ct: int) -> set[tuple[int, str]]:
    return {(c, g.name) for g in groups for c in needed_chunks(g.window_tokens, p, ct)}


def content(group: str, layers: int, prefix: tuple[int, ...], ct: int, tb: int) -> np.ndarray:
    """The bytes of the last chunk of ``prefix`` in ``group``: ``[layers, ct, tb]``."""
    h = hashlib.blake2b(group.encode() + np.asarray(prefix, "<i8").tobytes(), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    return rng.integers(0, 256, (layers, ct, tb), dtype=np.uint8)


@dataclass
class Cache:
    """A paged cache over buffers ``[num_blocks, bt, tb]``, groups possibly aliasing them."""

    cache: bsr.PagedKVCache
    buffers: list[torch.Tensor]
    views: dict[str, list[torch.Tensor]]


def make_cache(
    layout: bsr.StateLayout, nb: int, bt: int, alias: bool, stacked: bool, seed: int
) -> Cache:
    """Per-layer tensors (``from_layer_tensors``, vLLM's way) or one stacked tensor per group;
    with ``alias`` layer ``i`` of every group views the same memory."""
    gen = torch.Generator().manual_seed(seed)
    most = max(g.num_layers for g in layout.groups)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    views: dict[str, list[torch.Tensor]] = {}
    if stacked:
        tb = layout.groups[0].token_bytes
        shared = noise(most, nb, bt, tb) if alias else None
        tensors = {
            g.name: shared[: g.num_layers] if shared is not None
            else noise(g.num_layers, nb, bt, g.token_bytes)
            for g in layout.groups
        }  # fmt: skip
        cache = bsr.PagedKVCache(layout, nb, bt, tensors=tensors)
        views = {g: list(t.unbind(0)) for g, t in tensors.items()}
        buffers = list(shared.unbind(0)) if shared is not None else [
            v for vs in views.values() for v in vs
        ]  # fmt: skip
        return Cache(cache, buffers, views)
    buffers = []
    for g in layout.groups:
        ts = []
        for i in range(g.num_layers):
            if alias and i < len(buffers):
                ts.append(buffers[i])  # layer i of every group views one buffer
                continue
            buffers.append(noise(nb, bt, g.token_bytes))
            ts.append(buffers[-1])
        views[g.name] = ts
    cache = bsr.PagedKVCache.from_layer_tensors(layout, views, bt)
    return Cache(cache, buffers, views)


def changed_blocks(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    out: set[int] = set()
    for a, b in zip(before, after):
        diff = (a != b).flatten(1).any(dim=1)
        out.update(int(x) for x in torch.nonzero(diff).flatten().tolist())
    return out


# ------------------------------------------------------------------ drawing an example
@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    ct = draw(st.sampled_from((16, 32)))
    bt = draw(st.sampled_from([b for b in (4, 8, 16) if ct % b == 0]))
    alias = draw(st.booleans())
    tb = draw(st.sampled_from((8, 16, 64)))
    sizes = (None, ct - 1, ct - 1, ct, ct + 3, 2 * ct - 1, 3 * ct, 1, bt - 1, ct // 2 + 1)
    windows = [None, *draw(st.lists(st.sampled_from(sizes), min_size=1, max_size=2))]
    groups = tuple(
        bsr.StateGroup(
            f"g{i}",
            draw(st.integers(1, 2)),
            tb if alias else draw(st.sampled_from((8, 16, 64))),
            window_tokens=w if w else None,
            dtype="uint8",
        )
        for i, w in enumerate(windows)
    )
    layout = bsr.StateLayout(chunk_tokens=ct, groups=groups)
    base = draw(st.lists(st.integers(0, 9), min_size=5 * ct, max_size=5 * ct))
    # (tokens, how far the engine's window moved on past them: its blocks below are freed (None:
    # it freed none), and how many blocks at the end of the full group's table hold no block)
    saves = [
        (
            draw(st.integers(1, 4)) * ct + draw(st.integers(0, ct - 1)),
            draw(st.sampled_from((None,) * 6 + (0, 0, 0, 1, bt, ct // 2, 2 * ct))),
            draw(st.sampled_from((0, 0, 0, 0, 0, 0, 1, ct // bt + 1))),
        )
        for _ in range(draw(st.integers(1, 2)))
    ]
    n_restore = draw(
        st.one_of(
            st.sampled_from([n for n, _, _ in saves]),
            st.sampled_from([n for n, _, _ in saves]),
            st.integers(0, 4).map(lambda k: k * ct + 1),
            st.integers(0, 5 * ct),
        )
    )
    diverge = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, n_restore)))
    restore_tokens = list(base[:n_restore])
    if diverge is not None and diverge < n_restore:
        restore_tokens[diverge] = 10 + restore_tokens[diverge]  # a different prefix from here
    return {
        "layout": layout, "bt": bt, "alias": alias, "base": base, "saves": saves,
        "restore": restore_tokens, "shared_table": not alias and draw(st.integers(0, 3)) == 0,
        "stacked": draw(st.booleans()),
        "damage": draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 2**16))),
        "bad_null": draw(st.integers(0, 7)) == 0, "seed": draw(st.integers(0, 2**16)),
    }  # fmt: skip


def make_tables(
    layout: bsr.StateLayout, bt: int, n_tokens: int, nulls_before: dict[str, int], pool: list[int]
) -> dict[str, list[int]]:
    """Per group, a table for ``n_tokens`` tokens drawing distinct blocks from ``pool`` (popped),
    ``NULL_BLOCK`` for the group's first ``nulls_before[g]`` blocks."""
    nblocks = -(-n_tokens // bt)
    out = {}
    for g in layout.group_names:
        k = min(nulls_before.get(g, 0), nblocks)
        out[g] = [NULL] * k + [pool.pop() for _ in range(nblocks - k)]
    return out


def freed_blocks(window: int | None, tokens: int, bt: int) -> int:
    """Blocks a serving engine frees below a window once ``tokens`` tokens are computed."""
    return 0 if window is None else max(0, tokens - window) // bt


# ------------------------------------------------------------------ the test
class Run:
    """One case against the engine: its block pool, tier and what the oracle knows is stored."""

    def __init__(self, case: dict[str, Any], root: Path) -> None:
        self.case = case
        self.layout: bsr.StateLayout = case["layout"]
        self.ct, self.bt = self.layout.chunk_tokens, case["bt"]
        self.groups = list(self.layout.groups)
        bt, ngroups = self.bt, len(self.groups)
        nb = 2 + sum(-(-n // bt) for n, _, _ in case["saves"]) * ngroups
        self.nb = nb + -(-len(case["restore"]) // bt) * ngroups
        rng = np.random.default_rng(case["seed"])
        self.pool = [int(b) for b in rng.permutation(self.nb - 1)]  # block nb-1 never handed out
        self.tier = bsr.FileTier(root / "store", 1 << 26)
        self.engine = bsr.RestoreEngine(
            self.layout, [self.tier], window=2, io_depth=1, namespace=bsr.Namespace("m"),
            pin_staging=False, prefault_staging=False,
        )  # fmt: skip
        self.stored: set[tuple[tuple[int, ...], str]] = set()

    # ----------------------------------------------------------------- save
    async def save(self, i: int, tokens: list[int], past: int | None, tail: int) -> None:
        case, ct, bt, groups = self.case, self.ct, self.bt, self.groups
        src = make_cache(self.layout, self.nb, bt, case["alias"], case["stacked"], case["seed"] + i)
        n = len(tokens) // ct
        nulls = {}
        if past is not None and not case["shared_table"]:
            nulls = {g.name: freed_blocks(g.window_tokens, n * ct + past, bt) for g in groups}
        tables = make_tables(self.layout, bt, n * ct, nulls, self.pool)
        if case["shared_table"]:
            tables = dict.fromkeys(tables, tables[groups[0].name])
        full = tables[groups[0].name]
        full[max(0, len(full) - tail) :] = [NULL] * min(tail, len(full))
        self.fill_source(src, tokens, n, tables)
        result = await self.engine.save(tokens, src.cache, tables)
        chosen, fit = self.oracle_save(tables, n)
        want = max(p for p in range(n + 1) if needed_objects(groups, p, ct) <= chosen)
        assert want >= fit
        assert result.saved_tokens == want * ct, (result.saved_tokens, want, nulls)
        note(f"save: {'whole' if want == n else 'shorter prefix' if want else 'nothing'}")
        self.stored.update((tuple(tokens[: (c + 1) * ct]), g) for c, g in chosen)

    def fill_source(
        self, src: Any, tokens: list[int], n: int, tables: dict[str, list[int]]
    ) -> None:
        """The source holds each token's state in its group's real blocks."""
        ct, bt = self.ct, self.bt
        for g in self.groups:
            for c in range(n):
                data = content(g.name, g.num_layers, tuple(tokens[: (c + 1) * ct]), ct,
                               g.token_bytes)  # fmt: skip
                for j, b in enumerate(tables[g.name][c * ct // bt : (c + 1) * ct // bt]):
                    if b != NULL:
                        for layer, v in enumerate(src.views[g.name]):
                            v[b] = torch.from_numpy(data[layer, j * bt : (j + 1) * bt])

    def oracle_save(self, tables: dict[str, list[int]], n: int) -> tuple[set[tuple[int, str]], int]:
        """What a save of ``n`` chunks stores: each full group its longest whole prefix, each
        windowed group its window at the end and at the longest prefix every group fits, where
        whole; and that longest prefix every group fits."""
        ct, bt, groups = self.ct, self.bt, self.groups

        def whole(c: int, g: str) -> bool:
            return all(b != NULL for b in tables[g][c * ct // bt : (c + 1) * ct // bt])

        fits = [p for p in range(n, 0, -1) if all(whole(*o) for o in needed_objects(groups, p, ct))]
        fit = fits[0] if fits else 0
        full = [g for g in groups if g.window_tokens is None]
        m = next((p for p in range(n, 0, -1)
                  if all(whole(c, g.name) for g in full for c in range(p))), 0)  # fmt: skip
        chosen = {(c, g.name) for g in full for c in range(m)}
        for g in groups:
            if g.window_tokens is not None:
                for end in {n, fit}:
                    win = needed_chunks(g.window_tokens, end, ct)
                    if all(whole(c, g.name) for c in win):
                        chosen.update((c, g.name) for c in win)
        return chosen, fit

    # -------------------------------------------------------------- restore
    async def restore(self, tokens: list[int]) -> None:
        case, ct, bt, groups = self.case, self.ct, self.bt, self.groups
        n = len(tokens) // ct
        dst = make_cache(
            self.layout, self.nb, bt, case["alias"], case["stacked"], case["seed"] + 99
        )
        nulls = {g.name: freed_blocks(g.window_tokens, n * ct, bt) for g in groups}
        bad = case["bad_null"] and n > 0
        if bad:  # one placeholder where the whole prefix's window needs a block
            g = next((g for g in groups if g.window_tokens is not None), groups[0])
            nulls[g.name] = n * ct // bt
        tables = make_tables(self.layout, bt, n * ct, nulls, self.pool)
        before = [b.clone() for b in dst.buffers]
        if bad:
            with pytest.raises(bsr.BlockTableError, match="NULL_BLOCK"):
                await self.engine.restore(tokens, dst.cache, tables)
            assert changed_blocks(before, dst.buffers) == set()
            return
        probed = next(
            (p for p in range(n, 0, -1)
             if all((tuple(tokens[: (c + 1) * ct]), g) in self.stored
                    for c, g in needed_objects(groups, p, ct))),
            0,
        )  # fmt: skip
        damaged = self.damage_one(tokens, probed)
        res = await self.engine.restore(tokens, dst.cache, tables)
        assert res.probed_tokens == probed * ct
        commit = probed > 0 and self.served(tables, probed) and damaged is None
        note(
            "restore: " + ("miss" if not probed else "committed" if commit else
                           "damaged" if damaged else "window outside the tables")
            + (", aliased" if case["alias"] else "")
            + (", placeholders" if any(NULL in t for t in tables.values()) else "")
        )  # fmt: skip
        assert res.committed == (commit or probed == 0), (res.state, res.reason, res.errors)
        assert res.committed_tokens == (probed * ct if commit else 0)
        self.check_written(res, before, dst, tables, probed, commit)
        if commit:
            self.check_restored(tokens, dst, tables, probed)
            want_bytes = sum(
                self.layout.group_chunk_bytes(g) for _, g in needed_objects(groups, probed, ct)
            )
            assert res.bytes_read == want_bytes  # a window group reads its window's chunks only

    def damage_one(self, tokens: list[int], probed: int) -> tuple[int, str] | None:
        """Damage one needed object of the probed prefix (when the case says so)."""
        if self.case["damage"] is None or not probed:
            return None
        objs = sorted(needed_objects(self.groups, probed, self.ct))
        c, g = objs[self.case["damage"] % len(objs)]
        key = self.engine.keys(tokens)[c]
        path = self.tier.object_path(key, g)  # one group's object, damaged
        raw = bytearray(path.read_bytes())
        raw[4096 + 3 : 4096 + 6] = b"\xff\x00\xff"
        path.write_bytes(bytes(raw))
        return c, g

    def served(self, tables: dict[str, list[int]], p: int) -> bool:
        """Whether the tables hold a real block wherever a prefix of ``p`` chunks needs one."""
        for g in self.groups:
            lo, hi = needed_tokens(g.window_tokens, p, self.ct)
            if any(b == NULL for b in tables[g.name][lo // self.bt : -(-hi // self.bt)]):
                return False
        return True

    def check_written(
        self, res: Any, before: list[torch.Tensor], dst: Any, tables: dict[str, list[int]],
        probed: int, commit: bool,
    ) -> None:  # fmt: skip
        """Only the read chunks' real blocks changed, and a failed restore reported each."""
        ct = self.ct
        written: dict[int, str] = {}
        for c, g in needed_objects(self.groups, probed, ct):
            blocks = tables[g][c * ct // self.bt : (c + 1) * ct // self.bt]
            if commit and NULL in blocks and any(b != NULL for b in blocks):
                note(
                    "restore: committed a chunk straddling placeholders"
                    + (", stacked" if self.case["stacked"] else "")
                )
            for b in blocks:
                if b != NULL:
                    written[b] = g
        changed = changed_blocks(before, dst.buffers)
        assert changed <= set(written), "a block outside the read chunks' real blocks changed"
        assert self.nb - 1 not in changed  # what NULL_BLOCK (-1) would index
        invalid = {b for bs in res.invalid_block_ids_by_group.values() for b in bs}
        assert set(res.invalid_block_ids) == invalid
        if not commit:
            assert changed <= invalid, "a written block of a failed restore was not reported"
        else:
            assert not invalid

    def check_restored(
        self, tokens: list[int], dst: Any, tables: dict[str, list[int]], probed: int
    ) -> None:
        """Every token the committed prefix needs holds the saved bytes."""
        ct = self.ct
        for g in self.groups:
            view = dst.views[g.name]
            lo, hi = needed_tokens(g.window_tokens, probed, ct)
            for c in range(lo // ct, -(-hi // ct)):
                data = content(g.name, g.num_layers, tuple(tokens[: (c + 1) * ct]), ct,
                               g.token_bytes)  # fmt: skip
                for t in range(max(lo, c * ct), min(hi, (c + 1) * ct)):
                    b = tables[g.name][t // self.bt]
                    for layer in range(g.num_layers):
                        got = view[layer][b, t % self.bt].numpy()
                        assert np.array_equal(got, data[layer, t - c * ct]), (g.name, t, layer)


async def run_case(case: dict[str, Any], root: Path) -> None:
    run = Run(case, root)
    async with run.engine:
        for i, (n, past, tail) in enumerate(case["saves"]):
            await run.save(i, case["base"][:n], past, tail)
        await run.restore(case["restore"])


@pytest.mark.anyio
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
async def test_group_tables_against_the_oracle(case: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        await run_case(case, Path(d))


@pytest.mark.anyio
@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
@pytest.mark.parametrize("damage", [None, 0, 5], ids=["intact", "damage_full", "damage_window"])
async def test_a_window_straddling_a_chunk_restores_into_its_real_blocks(
    tmp_path: Path, stacked: bool, damage: int | None
) -> None:
    """A 20-token window over 16-token chunks of 4-token blocks: the restore of 3 chunks reads
    chunks 1 and 2 of the window group, whose table holds NULL_BLOCK for blocks 0..6 (chunk 1's
    first three blocks); only real blocks are written, the whole prefix commits. With one
    group's object damaged (the full group's chunk 0, or the window group's chunk 1) nothing
    commits, and every block written is reported (guarantee 1: nothing partial)."""
    layout = bsr.StateLayout(
        chunk_tokens=16,
        groups=(
            bsr.StateGroup("full", 2, 8, dtype="uint8"),
            bsr.StateGroup("win", 1, 8, window_tokens=20, dtype="uint8"),
        ),
    )
    case = {
        "layout": layout, "bt": 4, "alias": True, "base": list(range(80)),
        "saves": [(48 + 5, None, 0)], "restore": list(range(48 + 5)), "shared_table": False,
        "stacked": stacked, "damage": damage, "bad_null": False, "seed": 7,
    }  # fmt: skip
    await run_case(case, tmp_path)
