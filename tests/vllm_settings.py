"""One builder of :class:`bsr.vllm._options.ConnectorSettings` for the vLLM connector tests, which
read settings that vLLM's config would give (``bsr.vllm._options.settings``) without a vLLM
config to read them from.

Import with ``from vllm_settings import connector_settings`` (``tests/`` is on pytest's
``pythonpath``). The defaults are the settings of a plain ``kv_both`` connector: one rank, both
loads and saves, ``recompute`` on a failed load, no KV events, one full attention group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import bsr
from bsr.vllm._options import ConnectorOptions, ConnectorSettings


def connector_settings(
    block: int, chunk: int, options: Mapping[str, Any] | None = None, **fields: Any
) -> ConnectorSettings:
    """Settings for vLLM block size ``block`` and bsr chunk size ``chunk``, with the
    ``bsr_connector`` options ``options``; ``fields``: any other field of the settings, in place
    of its default.

    The engine config (``engine=``) defaults to one host tier of 1 MiB: a test that builds its
    own engine never builds one from it, and one that does gives its own config.
    """
    values: dict[str, Any] = {
        "options": ConnectorOptions.from_dict(options or {}),
        "block_size": block,
        "chunk_tokens": chunk,
        "tp_size": 1,
        "model_id": "m",
        "config_digest": "",
        "engine_id": "e",
        "loads": True,
        "saves": True,
        "failure_policy": "recompute",
        **fields,
    }
    if "engine" not in values:
        values["engine"] = bsr.EngineConfig.from_dict(
            {"tiers": [{"kind": "host", "capacity_bytes": 1 << 20}]}
        )
    return ConnectorSettings(**values)
