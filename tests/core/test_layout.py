"""StateLayout / StateGroup: derived sizes, fingerprints and validation."""

from __future__ import annotations

import pytest
import torch

import bsr


def test_sizes_and_offsets() -> None:
    layout = bsr.StateLayout(
        chunk_tokens=256,
        groups=(bsr.StateGroup("kv", 32, 1792), bsr.StateGroup("indexer", 32, 211, dtype="uint8")),
    )
    # DeepSeek-V4-Flash per-rank chunk: 256 tokens x (32 x 1792 + 32 x 211) bytes
    assert layout.chunk_bytes == 16_408_576
    assert layout.slot_bytes == layout.chunk_bytes
    assert layout.slot_offset("kv") == 0
    assert layout.slot_offset("indexer") == 32 * 256 * 1792
    assert layout.token_bytes == 64_096


def test_unaligned_groups_are_padded_in_the_slot() -> None:
    layout = bsr.StateLayout(
        chunk_tokens=4,
        groups=(
            bsr.StateGroup("a", 1, 10, dtype="uint8"),
            bsr.StateGroup("b", 1, 6, dtype="uint8"),
        ),
    )
    assert layout.chunk_bytes == 64
    assert layout.slot_offset("b") == 4096
    assert layout.slot_bytes == 8192


def test_llama3_8b_kv_layout() -> None:
    layout = bsr.kv_layout(num_layers=32, num_kv_heads=8, head_dim=128)
    assert layout.chunk_bytes == 32 * 1024 * 1024
    assert layout.groups[0].torch_dtype == torch.bfloat16


def test_window_chunks() -> None:
    layout = bsr.StateLayout(
        chunk_tokens=16,
        groups=(bsr.StateGroup("kv", 1, 2), bsr.StateGroup("swa", 1, 2, window_tokens=20)),
    )
    assert list(layout.needed_chunks("kv", 5)) == [0, 1, 2, 3, 4]
    assert list(layout.needed_chunks("swa", 5)) == [3, 4]
    assert list(layout.needed_chunks("swa", 1)) == [0]
    assert list(layout.needed_chunks("swa", 0)) == []


def test_fingerprint_tracks_everything_that_changes_bytes() -> None:
    base = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 4),))
    variants = [
        bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 4),)),
        bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 3, 4),)),
        bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 8),)),
        bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 4, dtype="float16"),)),
        bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 4, window_tokens=4),)),
        bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("k2", 2, 4),)),
    ]
    fps = {v.fingerprint for v in variants}
    assert len(fps) == len(variants) and base.fingerprint not in fps
    same = bsr.StateLayout(chunk_tokens=16, groups=[bsr.StateGroup("kv", 2, 4)])  # type: ignore[arg-type]
    assert same.fingerprint == base.fingerprint
    assert bsr.StateLayout.from_dict(base.to_dict()) == base


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: bsr.StateLayout(groups=()), "at least one StateGroup"),
        (
            lambda: bsr.StateLayout(groups=(bsr.StateGroup("a", 1, 2), bsr.StateGroup("a", 1, 2))),
            "duplicate",
        ),
        (
            lambda: bsr.StateLayout(chunk_tokens=0, groups=(bsr.StateGroup("a", 1, 2),)),
            "chunk_tokens",
        ),
        (lambda: bsr.StateGroup("a", 0, 2), "num_layers"),
        (lambda: bsr.StateGroup("a", 1, -2), "token_bytes"),
        (lambda: bsr.StateGroup("", 1, 2), "name"),
        (lambda: bsr.StateGroup("a", 1, 3), "multiple of the bfloat16"),
        (lambda: bsr.StateGroup("a", 1, 2, window_tokens=0), "window_tokens"),
        (lambda: bsr.StateGroup("a", 1, 2, dtype="complex64"), "unsupported dtype"),
        (lambda: bsr.StateLayout(groups=("kv",)), "StateGroup objects"),  # type: ignore[arg-type]
    ],
)
def test_bad_layouts(make: object, fragment: str) -> None:
    with pytest.raises(bsr.LayoutError, match=fragment):
        make()  # type: ignore[operator]


def test_unknown_group() -> None:
    layout = bsr.StateLayout(groups=(bsr.StateGroup("kv", 1, 2),))
    with pytest.raises(bsr.UnknownGroupError, match="kv"):
        layout.group("nope")
    with pytest.raises(KeyError):
        layout.group_chunk_bytes("nope")


def test_lone_surrogate_in_a_group_name_is_a_layout_error() -> None:
    with pytest.raises(bsr.LayoutError, match=r"StateGroup.name 'kv\\udcff' cannot be encoded"):
        bsr.StateGroup("kv\udcff", 1, 64)


def test_group_name_limit_counts_utf8_bytes() -> None:
    bsr.StateGroup("é" * 32, 1, 64)  # 64 bytes
    with pytest.raises(bsr.LayoutError, match="longer than 64 bytes"):
        bsr.StateGroup("é" * 33, 1, 64)


def _reference_needed(layout: bsr.StateLayout, prefix_chunks: int) -> list[tuple[int, str]]:
    out = []
    for c in range(prefix_chunks):
        for g in layout.groups:
            w = g.window_tokens
            first = 0 if w is None else max(0, prefix_chunks - -(-w // layout.chunk_tokens))
            if c >= first:
                out.append((c, g.name))
    return out


@pytest.mark.parametrize("prefix_chunks", [0, 1, 2, 3, 7, 20])
def test_needed_objects_lists_every_object_a_prefix_reads(prefix_chunks: int) -> None:
    layout = bsr.StateLayout(
        chunk_tokens=16,
        groups=(
            bsr.StateGroup("kv", 2, 64),
            bsr.StateGroup("swa", 1, 32, window_tokens=40),  # 3 chunks of 16 cover 40 tokens
            bsr.StateGroup("idx", 1, 8, dtype="uint8"),
        ),
    )
    got = layout.needed_objects(prefix_chunks)
    assert got == _reference_needed(layout, prefix_chunks)
    assert sum(1 for _, g in got if g == "swa") == min(prefix_chunks, 3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_needed_objects_refuses_bad_counts(bad: object) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 64),))
    with pytest.raises(bsr.LayoutError, match="prefix_chunks must be an int >= 0"):
        layout.needed_objects(bad)  # type: ignore[arg-type]
