"""Window checkpoints in bsr's own engine: a shorter shared prefix restores up to the last
checkpoint, every group alike, and a damaged checkpoint object never commits anything partial.

The source cache holds every token's state in every group (a model that keeps its sliding layers'
whole KV, or a server that wrote its paged cache at each checkpoint), so a save asked for window
checkpoints stores each sliding-window group's window at every ``window_checkpoint_chunks``-th
chunk boundary and at the end. A later prompt shares only the first ``j`` chunks (its own tokens
after them, so the chained keys differ). Each token's bytes are a pure function of its group and
of the prefix up to its chunk's end (like real KV state), so a restored block is checked byte for
byte against what that prompt's own computation would hold.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bsr
from support.engines import make_engine

CT, BT = 16, 4  # chunk and block tokens


def layout_for(window: int) -> bsr.StateLayout:
    return bsr.StateLayout(
        chunk_tokens=CT,
        groups=(
            bsr.StateGroup("kv", 2, 8, dtype="uint8"),
            bsr.StateGroup("swa", 1, 8, window_tokens=window, dtype="uint8"),
        ),
    )


def content(group: str, layers: int, prefix: list[int], tb: int) -> torch.Tensor:
    """The bytes of the last chunk of ``prefix`` in ``group``: ``[layers, CT, tb]``."""
    h = hashlib.blake2b(group.encode() + np.asarray(prefix, "<i8").tobytes(), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    return torch.from_numpy(rng.integers(0, 256, (layers, CT, tb), dtype=np.uint8))


def fill(cache: bsr.PagedKVCache, tokens: list[int], ids: list[int]) -> None:
    """Every token's state in every group, at block ``ids[t // BT]``."""
    for g in cache.layout.groups:
        view = cache.typed(g.name)
        for c in range(len(tokens) // CT):
            data = content(g.name, g.num_layers, tokens[: (c + 1) * CT], g.token_bytes)
            for j in range(CT // BT):
                view[:, ids[c * CT // BT + j]] = data[:, j * BT : (j + 1) * BT]


def needed(layout: bsr.StateLayout, p: int) -> set[tuple[int, str]]:
    """From the definition: every chunk of "kv"; the chunks of "swa" overlapping its window."""
    w = layout.group("swa").window_tokens
    assert w is not None
    return {(c, "kv") for c in range(p)} | {
        (c, "swa") for c in range(p) if (c + 1) * CT > p * CT - w
    }


def check_restored(
    layout: bsr.StateLayout, cache: bsr.PagedKVCache, tokens: list[int], ids: list[int], p: int
) -> None:
    """Each token a prefix of ``p`` chunks needs holds the bytes of ``tokens``' own prefix."""
    for c, g in needed(layout, p):
        grp = layout.group(g)
        data = content(g, grp.num_layers, tokens[: (c + 1) * CT], grp.token_bytes)
        view = cache.typed(g)
        for j in range(CT // BT):
            assert torch.equal(view[:, ids[c * CT // BT + j]], data[:, j * BT : (j + 1) * BT]), (
                c,
                g,
            )


def engine_at(root: Path, layout: bsr.StateLayout, every: int | None) -> bsr.RestoreEngine:
    return make_engine(
        layout, [bsr.FileTier(root, 1 << 26)], window=2, io_depth=1, model_id="m",
        pin_staging=False, prefault_staging=False, window_checkpoint_chunks=every,
    )  # fmt: skip


BASE = [(7 * i + 3) % 50 for i in range(8 * CT)]  # 8 chunks


def sharing(j: int, extra: int = CT + 5) -> list[int]:
    """A prompt sharing BASE's first ``j`` chunks, then its own tokens."""
    return BASE[: j * CT] + [60 + (i % 7) for i in range(extra)]


@pytest.mark.anyio
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "end_only"])
async def test_a_shorter_shared_prefix_restores_to_the_last_checkpoint(
    tmp_path: Path, checkpoints: bool
) -> None:
    """BASE (8 chunks) saved with checkpoints every 3 chunks; a prompt sharing its first 7
    chunks restores 6 (the last checkpoint), both groups, byte for byte. Without checkpoints
    (the end's window only, as before) it misses."""
    layout = layout_for(CT - 1)
    nb = 80
    src, dst = bsr.PagedKVCache(layout, nb, BT), bsr.PagedKVCache(layout, nb, BT)
    ids = list(range(32))
    fill(src, BASE, ids)
    async with engine_at(tmp_path, layout, 3) as engine:
        saved = await engine.save(BASE, src, ids, window_checkpoints=checkpoints)
        assert saved.saved_tokens == 8 * CT
        assert engine.checkpoint_tokens(8 * CT) == (3 * CT, 6 * CT)
        # "swa" stores chunk 7 (the end's window) and, with checkpoints, chunks 2 and 5
        assert sum(saved.objects_written.values()) == 8 + (3 if checkpoints else 1)
        prompt = sharing(7)
        out = list(range(40, 40 + len(prompt) // BT + 1))
        result = await engine.restore(prompt, dst, out)
    if not checkpoints:
        assert result.committed_tokens == 0 and result.probed_tokens == 0
        return
    assert result.committed and result.committed_tokens == 6 * CT
    check_restored(layout, dst, prompt, out, 6)
    # every group: the full group's 6 chunks and the window group's chunk 5
    assert result.bytes_read == 6 * layout.group_chunk_bytes("kv") + layout.group_chunk_bytes("swa")


def test_checkpoint_tokens_and_the_option() -> None:
    with pytest.raises(bsr.ConfigError, match="window_checkpoint_chunks"):
        engine_at(Path("/nonexistent"), layout_for(CT), 0)
    tiers = [{"kind": "host", "capacity_bytes": 1 << 20}]
    config = bsr.EngineConfig.from_dict({"tiers": tiers, "window_checkpoint_chunks": None})
    assert config.window_checkpoint_chunks is None
    assert bsr.EngineConfig.from_dict({"tiers": tiers}).window_checkpoint_chunks == 4
    engine = engine_at(Path("/nonexistent"), layout_for(CT), None)
    assert engine.checkpoint_tokens(8 * CT) == ()
    engine = engine_at(Path("/nonexistent"), layout_for(CT), 2)
    assert engine.checkpoint_tokens(8 * CT + 3) == (2 * CT, 4 * CT, 6 * CT)


# --------------------------------------------------------------------------- damage
@st.composite
def damage_cases(draw: st.DrawFn) -> dict[str, object]:
    window = draw(st.sampled_from((CT - 1, CT, CT + 5, 2 * CT)))
    every = draw(st.integers(1, 4))
    j = draw(st.integers(1, 8))
    layout = layout_for(window)
    stored = bsr.StateLayout.stored_objects(layout, 8, every)
    windows = sorted(c for c, g in stored if g == "swa" and c < j)
    damaged = draw(st.sets(st.sampled_from(windows), max_size=3)) if windows else set()
    return {"window": window, "every": every, "j": j, "damaged": sorted(damaged)}


@pytest.mark.anyio
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=damage_cases())
async def test_a_damaged_checkpoint_misses_or_falls_back_never_partial(
    case: dict[str, object],
) -> None:
    """Damage some of the window group's objects only (Hypothesis picks which). A restore of a
    prompt sharing ``j`` chunks either commits a prefix whose every needed object is intact,
    byte for byte, or commits nothing (its written blocks reported); each failed restore puts
    the damaged object it read out of use, so restoring again falls back to the previous
    checkpoint, and ends at exactly the longest prefix whose needed objects are all intact."""
    window, every, j = int(case["window"]), int(case["every"]), int(case["j"])  # type: ignore[call-overload]
    damaged: list[int] = case["damaged"]  # type: ignore[assignment]
    layout = layout_for(window)
    nb = 100
    src = bsr.PagedKVCache(layout, nb, BT)
    ids = list(range(32))
    fill(src, BASE, ids)
    prompt = sharing(j)
    stored = set(layout.stored_objects(8, every))
    intact = stored - {(c, "swa") for c in damaged}
    shared = {(c, g) for c, g in stored if c < j}
    probed = max(p for p in range(j + 1) if needed(layout, p) <= shared)
    final = max(p for p in range(j + 1) if needed(layout, p) <= shared & intact)
    with tempfile.TemporaryDirectory() as d:
        async with engine_at(Path(d), layout, every) as engine:
            await engine.save(BASE, src, ids, window_checkpoints=True)
            keys = engine.keys(BASE)
            tier = engine.tiers[0]
            assert isinstance(tier, bsr.FileTier)
            for c in damaged:  # one group's object: payload bytes flipped, header intact
                path = tier.object_path(keys[c], "swa")
                raw = bytearray(path.read_bytes())
                raw[4096 + 1] ^= 0xFF
                path.write_bytes(bytes(raw))
            for attempt in range(len(damaged) + 2):
                dst = bsr.PagedKVCache(layout, nb, BT)
                before = [t.clone() for t in (dst.tensor("kv"), dst.tensor("swa"))]
                out = list(range(50, 50 + len(prompt) // BT + 1))
                result = await engine.restore(prompt, dst, out)
                if attempt == 0:
                    assert result.probed_tokens == probed * CT
                if result.committed:
                    assert result.committed_tokens == final * CT
                    if final:
                        check_restored(layout, dst, prompt, out, final)
                    break
                # nothing partial: nothing committed, every block written reported
                assert result.committed_tokens == 0
                changed = set()
                for old, new in zip(before, (dst.tensor("kv"), dst.tensor("swa"))):
                    diff = (old != new).flatten(2).any(dim=2).any(dim=0)
                    changed.update(int(b) for b in torch.nonzero(diff).flatten())
                assert changed <= set(result.invalid_block_ids)
            else:
                pytest.fail(f"no restore committed after {len(damaged) + 2} attempts")
