"""Flat byte views of the buffers a tier is handed (destinations) and given (payloads).

Where it runs: anywhere; pure views, no copies.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ConfigError


def as_byte_view(dst: Any) -> memoryview:
    """A writable flat byte view of a CPU buffer (uint8 tensor, numpy array, bytearray...)."""
    if isinstance(dst, torch.Tensor):
        if dst.device.type != "cpu":
            raise ConfigError(
                "this tier reads into host buffers; pass a CPU tensor", device=str(dst.device)
            )
        if not dst.is_contiguous():
            raise ConfigError("read_into needs a contiguous destination tensor")
        dst = dst.view(torch.uint8).reshape(-1).numpy()
    mv = memoryview(dst)
    if mv.readonly:
        raise ConfigError("read_into needs a writable destination buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def as_payload_view(payload: Any) -> memoryview:
    """A flat byte view of a payload to store (bytes-likes as they are, else as_byte_view)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        mv = memoryview(payload)
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    return as_byte_view(payload)
