"""Layouts the benchmark restores: built-in model shapes and layouts given on the command line.

``--layout`` takes a built-in name (:data:`BUILTIN`) or a JSON spec, inline (starting with
``{``) or as a path to a ``.json`` file. A spec is either a full layout::

    {"name": "mine", "chunk_tokens": 256,
     "groups": [{"name": "kv", "num_layers": 32, "token_bytes": 4096, "dtype": "bfloat16"}]}

or a plain attention KV cache::

    {"name": "mine", "kv": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                            "dtype": "bfloat16"}}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr import StateGroup, StateLayout, kv_layout

from .stats import BenchError


@dataclass(frozen=True)
class NamedLayout:
    """A layout with the name and provenance the report shows."""

    name: str
    layout: StateLayout
    source: str  # "builtin", "cli" or "recompute-model"
    description: str

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "name": self.name,
            "source": self.source,
            "description": self.description,
            "chunk_tokens": lay.chunk_tokens,
            "token_bytes": lay.token_bytes,
            "chunk_bytes": lay.chunk_bytes,
            "slot_bytes": lay.slot_bytes,
            "groups": [g.to_dict() for g in lay.groups],
        }


def llama3_8b() -> NamedLayout:
    """Llama-3-8B GQA: 32 layers x 8 KV heads x 128 head_dim, bf16 = 131,072 B/token."""
    return NamedLayout(
        "llama3-8b",
        kv_layout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
        "builtin",
        "Llama-3-8B GQA KV: 32 layers x 8 KV heads x 128 head_dim x (K,V) bf16; "
        "131,072 B/token, 32 MiB per 256-token chunk",
    )


def dsv4_flash() -> NamedLayout:
    """DeepSeek-V4-Flash per-rank chunk size (TP=2): 64,096 B/token, 16,408,576 B per chunk."""
    return NamedLayout(
        "dsv4-flash",
        StateLayout(
            chunk_tokens=256,
            groups=(
                StateGroup("kv", num_layers=32, token_bytes=1792, dtype="bfloat16"),
                StateGroup("indexer", num_layers=32, token_bytes=211, dtype="uint8"),
            ),
        ),
        "builtin",
        "DeepSeek-V4-Flash per-rank state as in the BSR paper: 64,096 B/token/rank, "
        "16,408,576 B per 256-token chunk; groups kv 32 x 1792 B (bf16) + indexer 32 x 211 B",
    )


def llama3_70b_tp8() -> NamedLayout:
    """Llama-3-70B at TP=8: 80 layers x 1 KV head per rank x 128 head_dim, bf16."""
    return NamedLayout(
        "llama3-70b-tp8",
        kv_layout(num_layers=80, num_kv_heads=1, head_dim=128, dtype="bfloat16"),
        "builtin",
        "Llama-3-70B per rank at TP=8: 80 layers x 1 KV head x 128 head_dim bf16; 40,960 B/token",
    )


def qwen25_7b() -> NamedLayout:
    """Qwen2.5-7B GQA: 28 layers x 4 KV heads x 128 head_dim, bf16."""
    return NamedLayout(
        "qwen2.5-7b",
        kv_layout(num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
        "builtin",
        "Qwen2.5-7B GQA KV: 28 layers x 4 KV heads x 128 head_dim bf16; 57,344 B/token",
    )


def kv_512k() -> NamedLayout:
    """512 KiB chunks: 8 layers x 8 KV heads x 128 head_dim bf16 (32 KiB/token), 16 tokens."""
    return NamedLayout(
        "kv-512k",
        kv_layout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=16),
        "builtin",
        "small chunks: 8 layers x 8 KV heads x 128 head_dim x (K,V) bf16 = 32,768 B/token in "
        "16-token chunks of 512 KiB (one object file each: the per-object costs show)",
    )


BUILTIN: dict[str, Callable[[], NamedLayout]] = {
    "llama3-8b": llama3_8b,
    "dsv4-flash": dsv4_flash,
    "llama3-70b-tp8": llama3_70b_tp8,
    "qwen2.5-7b": qwen25_7b,
    "kv-512k": kv_512k,
}


def _from_spec(spec: dict[str, Any], origin: str) -> NamedLayout:
    if not isinstance(spec, dict):
        raise BenchError(f"layout spec {origin} must be a JSON object")
    name = str(spec.get("name") or "custom")
    try:
        if "kv" in spec:
            kv = dict(spec["kv"])
            kv.setdefault("chunk_tokens", int(spec.get("chunk_tokens", 256)))
            layout = kv_layout(**kv)
        elif "groups" in spec:
            layout = StateLayout.from_dict(
                {"chunk_tokens": spec.get("chunk_tokens", 256), "groups": spec["groups"]}
            )
        else:
            raise BenchError(f"layout spec {origin} needs 'groups' or 'kv'")
    except (TypeError, KeyError, ValueError) as exc:
        raise BenchError(f"layout spec {origin} is invalid: {exc}") from exc
    return NamedLayout(name, layout, "cli", str(spec.get("description", f"from {origin}")))


def resolve_layout(arg: str) -> NamedLayout:
    """A built-in name, an inline JSON spec, or a path to a JSON spec file."""
    if arg in BUILTIN:
        return BUILTIN[arg]()
    text: str
    if arg.lstrip().startswith("{"):
        text, origin = arg, "(inline)"
    elif Path(arg).is_file():
        text, origin = Path(arg).read_text("utf-8"), arg
    else:
        raise BenchError(
            f"unknown layout {arg!r}: use one of {sorted(BUILTIN)}, an inline JSON spec or a "
            "path to a .json spec (see bench/README.md)"
        )
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchError(f"layout spec {origin} is not valid JSON: {exc}") from exc
    return _from_spec(spec, origin)
