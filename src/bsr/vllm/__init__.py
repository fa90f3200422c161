"""bsr inside vLLM: :class:`BsrConnector`, a v1 KV connector (``KVConnectorBase_V1``).

Load it with ``kv_connector="BsrConnector"``, ``kv_connector_module_path="bsr.vllm"`` and the
engine config in ``kv_connector_extra_config={"bsr": {...}}``; see docs/vllm.md. The connector
is a facade over a scheduler side (:mod:`bsr.vllm._scheduler`, vLLM's EngineCore process) and a
worker side (:mod:`bsr.vllm._worker`, each worker process). It needs vLLM (``pip install
'bsr-kv[vllm]'`` on CPU; on a GPU machine install vLLM's CUDA build first); it is imported on first
use, so ``bsr.vllm._layout`` and ``bsr.vllm._options`` work without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and the API reference see; at run time __getattr__ imports
    from ._connector import BsrConnector as BsrConnector
    from ._metadata import BsrConnectorMetadata as BsrConnectorMetadata
    from ._options import ConnectorOptions as ConnectorOptions
    from ._stats import BsrConnectorStats as BsrConnectorStats
    from ._worker import BsrWorker as BsrWorker

__all__ = (
    "BsrConnector",
    "BsrConnectorMetadata",
    "BsrConnectorStats",
    "BsrWorker",
    "ConnectorOptions",
)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'bsr.vllm' has no attribute {name!r}")
    if name == "ConnectorOptions":
        from ._options import ConnectorOptions

        return ConnectorOptions
    try:
        from . import _connector, _metadata, _stats, _worker
    except ImportError as exc:
        if "vllm" not in str(exc):
            raise
        raise ImportError(
            "bsr.vllm.BsrConnector needs vLLM: pip install 'bsr-kv[vllm]' (CPU build), or "
            "install vLLM's CUDA build on a GPU machine"
        ) from exc
    for module in (_connector, _metadata, _stats, _worker):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)  # pragma: no cover - every name of __all__ is above
