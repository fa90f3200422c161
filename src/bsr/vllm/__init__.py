"""bsr inside vLLM: :class:`BsrConnector`, a v1 KV connector (``KVConnectorBase_V1``).

Load it with ``kv_connector="BsrConnector"``, ``kv_connector_module_path="bsr.vllm"`` and the
engine config in ``kv_connector_extra_config={"bsr": {...}}``; see docs/vllm.md. The connector
needs vLLM (``pip install 'bsr[vllm]'`` on CPU; on a GPU machine install vLLM's CUDA build
first); it is imported on first use, so ``bsr.vllm._layout`` works without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ("BsrConnector", "BsrConnectorMetadata")


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'bsr.vllm' has no attribute {name!r}")
    try:
        from . import _connector
    except ImportError as exc:
        if "vllm" not in str(exc):
            raise
        raise ImportError(
            "bsr.vllm.BsrConnector needs vLLM: pip install 'bsr[vllm]' (CPU build), or "
            "install vLLM's CUDA build on a GPU machine"
        ) from exc
    return getattr(_connector, name)
