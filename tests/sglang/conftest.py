"""Helpers of the SGLang backend tests: a host KV pool built the way SGLang's CPU tests build
theirs (``MockHostKVCache`` in
``sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py``).

SGLang's real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` import its CUDA kernels and
device pools, so a CPU test cannot build them from PyPI wheels. This pool has the attributes
HiCache and its storage backends use, with the buffer shapes and page methods copied from
sglang 0.5.23 (``pool_host/mha.py``: ``init_kv_buffer``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``; ``pool_host/mla.py`` likewise).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

MHA_DIMS = {
    "layer_first": lambda p: (2, p.layer_num, p.size, p.head_num, p.head_dim),
    "page_first": lambda p: (2, p.size, p.layer_num, p.head_num, p.head_dim),
    "page_first_direct": lambda p: (
        2,
        p.page_num,
        p.layer_num,
        p.page_size,
        p.head_num,
        p.head_dim,
    ),
    "page_head": lambda p: (2, p.page_num, p.head_num, p.page_size, p.layer_num, p.head_dim),
}
MLA_DIMS = {
    "layer_first": lambda p: (p.layer_num, p.size, 1, p.kv_cache_dim),
    "page_first": lambda p: (p.size, p.layer_num, 1, p.kv_cache_dim),
    "page_first_direct": lambda p: (p.page_num, p.layer_num, p.page_size, 1, p.kv_cache_dim),
}


class MHAHostPool:
    """``MHATokenToKVPoolHost``'s buffer and page methods (sglang 0.5.23)."""

    def __init__(self, *, size, page_size, layer_num, head_num, head_dim, layout, dtype):
        self.size, self.page_size, self.layout = size, page_size, layout
        self.page_num = size // page_size
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        self.kv_buffer = torch.zeros(MHA_DIMS[layout](self), dtype=dtype)

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real : real + 1, :, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        ps, n = self.page_size, (self.layer_num, self.head_num, self.head_dim)
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + ps] = data_page.reshape(2, n[0], ps, *n[1:])
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + ps] = data_page.reshape(2, ps, *n)
        elif self.layout == "page_first_direct":
            real = index // ps
            self.kv_buffer[:, real : real + 1] = data_page.reshape(2, 1, n[0], ps, *n[1:])
        else:
            real = index // ps
            self.kv_buffer[:, real : real + 1] = data_page.reshape(2, 1, n[1], ps, n[0], n[2])


class MLAHostPool:
    """``MLATokenToKVPoolHost``'s buffer and page methods (sglang 0.5.23, no DCP)."""

    def __init__(self, *, size, page_size, layer_num, kv_cache_dim, layout, dtype):
        self.size, self.page_size, self.layout = size, page_size, layout
        self.page_num = size // page_size
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        self.kv_buffer = torch.zeros(MLA_DIMS[layout](self), dtype=dtype)

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            page = self.kv_buffer[index : index + self.page_size, :, :, :]
        else:
            real = index // self.page_size
            page = self.kv_buffer[real : real + 1, :, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        shape = (self.layer_num, self.page_size, 1, self.kv_cache_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        ps, n, d = self.page_size, self.layer_num, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + ps] = data_page.reshape(n, ps, 1, d)
        elif self.layout == "page_first":
            self.kv_buffer[index : index + ps] = data_page.reshape(ps, n, 1, d)
        else:
            real = index // ps
            self.kv_buffer[real : real + 1] = data_page.reshape(1, n, ps, 1, d)


def fill_page(pool, page: int, seed: int) -> torch.Tensor:
    """Write random values into ``page`` (through the pool's own page method); its flat page."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(pool.get_dummy_flat_data_page().shape, generator=g).to(pool.dtype)
    pool.set_from_flat_data_page(page * pool.page_size, data)
    return data


#: the ``--hicache-storage-backend-extra-config`` line of docs/sglang.md (its tier path replaced)
DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def documented_extra_config(root: Path) -> dict[str, Any]:
    """The extra config docs/sglang.md gives, its file tier moved under ``root``."""
    text = DOC.read_text()
    line = next(x for x in text.splitlines() if "--hicache-storage-backend-extra-config '" in x)
    extra = json.loads(line.split("--hicache-storage-backend-extra-config", 1)[1].strip(" '\\"))
    for tier in extra["bsr"]["tiers"]:
        if tier["kind"] == "file":
            tier["path"] = str(root)
    return extra


def storage_config(
    root: Path,
    *,
    tp_rank=0,
    tp_size=1,
    mla=False,
    tenant=None,
    window=4,
    model="org/model",
    tiers=None,
) -> Any:
    """SGLang's HiCacheStorageConfig with a bsr config over a file tier at ``root``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    bsr: dict[str, Any] = {
        "window": window,
        "io_depth": min(2, window),
        "tiers": tiers or [{"kind": "file", "path": str(root), "capacity_bytes": "64MiB"}],
    }
    if tenant is not None:
        bsr["tenant"] = tenant
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=model,
        extra_config={"bsr": bsr, "file_storage_path": str(root / "hicache-file")},
    )  # fmt: skip


def mha_pool(layout="page_first", *, pages=16, page_size=4) -> MHAHostPool:
    return MHAHostPool(
        size=pages * page_size, page_size=page_size, layer_num=2, head_num=2, head_dim=8,
        layout=layout, dtype=torch.bfloat16,
    )  # fmt: skip


def mla_pool(layout="page_first", *, pages=16, page_size=4) -> MLAHostPool:
    return MLAHostPool(
        size=pages * page_size, page_size=page_size, layer_num=3, kv_cache_dim=24,
        layout=layout, dtype=torch.float16,
    )  # fmt: skip


def indices(pool, pages) -> torch.Tensor:
    """The host indices of ``pages`` (page_size per page), as HiCache passes them."""
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)


@pytest.fixture(scope="session")
def sg() -> SimpleNamespace:
    """The helpers above (a session fixture, so Hypothesis tests may use them)."""
    return SimpleNamespace(
        MHAHostPool=MHAHostPool, MLAHostPool=MLAHostPool, fill_page=fill_page,
        storage_config=storage_config, mha_pool=mha_pool, mla_pool=mla_pool, indices=indices,
        documented_extra_config=documented_extra_config,
    )  # fmt: skip
