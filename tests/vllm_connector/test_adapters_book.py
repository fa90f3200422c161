"""The worker's book of LoRA adapters as vLLM loaded them, on vLLM's own objects: adapters read
by vLLM's ``LoRAModel.from_local_checkpoint`` from files that transformers' safetensors wrote,
and vLLM's ``AdapterLRUCache`` evicting them (the book's hooks on it). The engine tests drive
the whole path (test_adapters.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
import torch
from vllm.lora.lora_model import LoRAModel
from vllm.lora.model_manager import AdapterLRUCache, LoRAModelManager
from vllm.lora.peft_helper import PEFTHelper

import bsr
from bsr.vllm._adapters import (
    ADAPTER_CHANGED,
    ADAPTER_UNBOUND,
    AdapterBook,
    adapter_book,
    adapter_marker,
    unbound_extras,
    weights_digest,
)
from vllm_engines import write_lora

MODULES = {"q_proj", "k_proj", "v_proj", "o_proj"}


def load(path: Path, lora_id: int) -> LoRAModel:
    """An adapter as vLLM's worker loads it (on the CPU, float32)."""
    helper = PEFTHelper.from_local_dir(str(path), 4096)
    return LoRAModel.from_local_checkpoint(
        str(path), MODULES, helper, lora_model_id=lora_id, device="cpu", dtype=torch.float32
    )


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("adapters")
    w1, w2 = write_lora(tmp / "w1", seed=1), write_lora(tmp / "w2", seed=2)
    copy = tmp / "w1-copy"
    shutil.copytree(w1, copy)
    return {"w1": w1, "w2": w2, "w1-copy": copy}


def test_the_digest_is_the_weights_not_the_files_or_the_id(adapters: dict[str, Path]) -> None:
    d1 = weights_digest(load(adapters["w1"], 1))
    assert weights_digest(load(adapters["w1-copy"], 7)) == d1  # another path, another id
    assert weights_digest(load(adapters["w2"], 1)) != d1  # same shapes, sizes, other values
    # one value of one tensor changes it
    m = load(adapters["w1"], 1)
    next(iter(m.loras.values())).lora_b[0, 0] += 1.0
    assert weights_digest(m) != d1


def extras_of(lora_id: int) -> tuple[bsr.KeyExtra, ...]:
    class Req:
        lora_int_id = lora_id

    return (adapter_marker(Req()),)


def test_lookups_and_loads_use_what_is_loaded_now(adapters: dict[str, Path]) -> None:
    book = AdapterBook()
    marker = extras_of(1)
    assert book.resolve(marker) is None  # not loaded: a miss, at once
    m1 = load(adapters["w1"], 1)
    book.loaded(m1)
    (bound,) = book.resolve(marker) or ()
    assert bound.key == b"vllm-lora:" + weights_digest(m1)
    assert book.resolve(()) == ()  # no adapter: as it is
    book.removed(1, None)  # vLLM freed its GPU slot only: the weights stay registered
    assert book.resolve(marker) is not None
    book.removed(1, m1)  # evicted from vLLM's registered adapters
    assert book.resolve(marker) is None
    # an unbound adapter on a rank: a key that matches nothing, fresh every time
    a, b = unbound_extras(marker), unbound_extras(marker)
    assert a != b and all(e.key.startswith(b"vllm-lora-unbound:") for e in (*a, *b))


def test_a_save_uses_the_weights_that_computed_the_request(adapters: dict[str, Path]) -> None:
    book = AdapterBook()
    m1, m2 = load(adapters["w1"], 1), load(adapters["w2"], 1)
    d1 = weights_digest(m1)
    marker = extras_of(1)
    book.loaded(m1)
    book.bind("steady", 1)
    book.bind("reloaded", 1)
    # a load binds (and resolves) what is loaded when it starts
    assert book.bind_and_resolve("loading", marker) == book.resolve(marker)
    assert book.resolve_bound("never-bound", marker) == ADAPTER_UNBOUND
    (key,) = book.resolve_bound("steady", marker)  # type: ignore[misc]
    assert key.key == b"vllm-lora:" + d1
    # the same weights loaded again (evicted, reloaded from unchanged files): still one set
    book.removed(1, m1)
    book.loaded(load(adapters["w1-copy"], 1))
    assert book.resolve_bound("steady", marker) == (key,)
    # other weights under the same id while "reloaded" and "loading" run: never saved
    book.removed(1, m1)
    book.loaded(m2)
    assert book.resolve_bound("reloaded", marker) == ADAPTER_CHANGED
    assert book.resolve_bound("loading", marker) == ADAPTER_CHANGED
    assert book.bind_and_resolve("loading", marker) is None  # and a load of it would miss
    book.bind("later", 1)  # a request that starts after the reload: the new weights
    (later,) = book.resolve_bound("later", marker)  # type: ignore[misc]
    assert later.key == b"vllm-lora:" + weights_digest(m2)
    for rid in ("steady", "reloaded", "loading", "later"):
        book.forget(rid)
    assert book.bound() == 0


def test_a_binding_older_than_the_history_is_not_trusted(adapters: dict[str, Path]) -> None:
    book = AdapterBook(history=4)
    m1 = load(adapters["w1"], 1)
    book.loaded(m1)
    book.bind("old", 1)
    for i in range(5):  # other adapters come and go
        book.loaded(load(adapters["w2"], 10 + i))
    assert book.resolve_bound("old", extras_of(1)) == ADAPTER_CHANGED


def test_the_hooks_see_what_vllms_cache_evicts(adapters: dict[str, Path]) -> None:
    """The process's book hooks vLLM's classes once: an adapter evicted from a real
    ``AdapterLRUCache`` is forgotten."""
    book = adapter_book()
    assert book.hooked and adapter_book() is book
    assert getattr(LoRAModelManager._add_adapter, "_bsr_hook", False)
    m = load(adapters["w1"], 41)
    book.loaded(m)  # as the hooked _add_adapter reports it
    removed: list[Any] = []
    cache: AdapterLRUCache[LoRAModel] = AdapterLRUCache(1, removed.append)
    cache[41] = m
    cache[42] = load(adapters["w2"], 42)  # over capacity: 41 is evicted
    assert removed == [41]
    assert book.current(41) is None
