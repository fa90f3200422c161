"""A host KV pool built the way SGLang's CPU tests build theirs (``MockHostKVCache`` in
``sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py``).

SGLang's real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` import its CUDA kernels and
device pools, so a CPU test cannot build them from PyPI wheels. This pool has the attributes
HiCache and its storage backends use, with the buffer shapes and page methods copied from
sglang 0.5.23 (``pool_host/mha.py``: ``init_kv_buffer``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``; ``pool_host/mla.py`` likewise).
"""

from __future__ import annotations

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
