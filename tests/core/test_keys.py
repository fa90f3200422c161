"""Chunk keys: deterministic, chained, namespace-separated; token normalisation."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bsr
from bsr.core._keys import chunk_keys

LAYOUT = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64),))
TOKENS = list(range(10, 30))


def fp(**kw: object) -> bytes:
    return bsr.Namespace(**{"model_id": "m", **kw}).fingerprint(LAYOUT)  # type: ignore[arg-type]


def digests(ns: bytes, tokens: object = TOKENS, layout: bsr.StateLayout = LAYOUT) -> list[bytes]:
    return [k.digest for k in chunk_keys(ns, tokens, layout.chunk_tokens)]  # type: ignore[arg-type]


def test_only_full_chunks_get_keys() -> None:
    assert len(digests(fp())) == 5
    assert len(digests(fp(), TOKENS[:7])) == 1
    assert digests(fp(), TOKENS[:3]) == []


def test_keys_are_chained_over_the_whole_prefix() -> None:
    a = digests(fp())
    changed = list(TOKENS)
    changed[1] += 1  # a token in chunk 0 changes every later key
    b = digests(fp(), changed)
    assert all(x != y for x, y in zip(a, b))
    changed2 = list(TOKENS)
    changed2[9] += 1  # chunk 2: keys 0 and 1 stay
    c = digests(fp(), changed2)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:]))


def test_same_chunk_at_another_position_has_another_key() -> None:
    toks = [7, 7, 7, 7] * 3
    d = digests(fp(), toks)
    assert len(set(d)) == 3


@pytest.mark.parametrize(
    "change",
    [{"salt": b"tenant-b"}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"model_id": "other"}],
)
def test_namespace_changes_give_disjoint_keys(change: dict[str, object]) -> None:
    assert not set(digests(fp())) & set(digests(fp(**change)))


def test_layout_change_gives_disjoint_keys() -> None:
    other = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64, dtype="float16"),))
    ns_other = bsr.Namespace("m").fingerprint(other)
    assert not set(digests(fp())) & set(digests(ns_other, layout=other))
    window = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64, window_tokens=8),))
    assert LAYOUT.fingerprint != window.fingerprint


def test_token_types_agree() -> None:
    ref = digests(fp())
    assert digests(fp(), np.asarray(TOKENS, dtype=np.int32)) == ref
    assert digests(fp(), np.asarray(TOKENS, dtype=np.uint16)) == ref
    assert digests(fp(), torch.tensor(TOKENS)) == ref
    assert digests(fp(), torch.tensor([TOKENS], dtype=torch.int32)) == ref
    assert digests(fp(), tuple(TOKENS)) == ref


_SCRIPT = """
import bsr
from bsr.core._keys import chunk_keys
layout = bsr.StateLayout(chunk_tokens=4, groups=(bsr.StateGroup("kv", 2, 64),))
ns = bsr.Namespace("m", salt=b"s").fingerprint(layout)
print(",".join(k.hex for k in chunk_keys(ns, list(range(10, 30)), 4)))
"""


def test_keys_are_deterministic_across_processes() -> None:
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    here = ",".join(
        k.hex for k in chunk_keys(bsr.Namespace("m", salt=b"s").fingerprint(LAYOUT), TOKENS, 4)
    )
    assert outs == {here}


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (torch.tensor([1.0, 2.0]), "integer tensor"),
        (np.array([1.5, 2.5]), "integer array"),
        ("hello", "tokenize"),
        ([1, 2, -3], ">= 0"),
        ([1, 2.0], "must be ints"),
        ([True, False], "must be ints"),
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (42, "sequence of ints"),
    ],
)
def test_bad_tokens_raise_typed_errors(bad: object, fragment: str) -> None:
    with pytest.raises(bsr.TokenError, match=fragment):
        chunk_keys(fp(), bad, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"model_id": ""}, "model_id"),
        ({"model_id": "m", "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"model_id": "m", "tp_size": 0}, "tp_size"),
        ({"model_id": "m", "salt": "str"}, "bytes"),
    ],
)
def test_bad_namespace(kw: dict[str, object], fragment: str) -> None:
    with pytest.raises(bsr.ConfigError, match=fragment):
        bsr.Namespace(**kw)  # type: ignore[arg-type]
