"""bsr as SGLang's HiCache storage backend (``pip install 'bsr-kv[sglang]'``).

Load it through SGLang's dynamic loader (docs/sglang.md)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "bsr", "module_path": "bsr.sglang", "class_name": "BsrHiCacheStorage",
        "interface_v1": 1, "bsr": {"window": 8, "tiers": [...]}}'
"""

from __future__ import annotations

from ._pages import GROUP, PAGE_LAYOUTS, HostPages, PageKeys, host_pages, shard_identity
from ._storage import (
    CONFIG_KEY,
    OPTIONS_KEY,
    BackendOptions,
    BsrHiCacheStorage,
    BsrStorageStats,
    engine_config,
)

__all__ = [
    "CONFIG_KEY",
    "GROUP",
    "OPTIONS_KEY",
    "PAGE_LAYOUTS",
    "BackendOptions",
    "BsrHiCacheStorage",
    "BsrStorageStats",
    "HostPages",
    "PageKeys",
    "engine_config",
    "host_pages",
    "shard_identity",
]
