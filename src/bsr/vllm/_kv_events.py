"""KV events, the translating half: bsr's notices in vLLM's terms (KV events, the event payload
of a save, cache hit sources).

Which is which: :mod:`bsr.vllm._events` is the deciding half (what to announce, and when: the
journal of each rank and the relay across ranks, with no vLLM import); this module is the only
one of the two that imports vLLM's types, and only converts: a request's block hashes into that
module's :class:`~bsr.vllm._events.SaveEvents`, its notices into vLLM's ``BlockStored`` /
``BlockRemoved``.

Where it runs: the scheduler side (vLLM's EngineCore process: :func:`save_events` when a
request finishes, :func:`vllm_events` in ``take_events``, :func:`hit_sources` at admission) and
the worker side (:func:`group_specs` at startup).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ._events import ChunkNotice, SaveEvents


def save_events(request: Any, num_tokens: int, block_size: int) -> SaveEvents | None:
    """What a save of ``request``'s first ``num_tokens`` tokens announces its chunks with: the
    request's own vLLM block hashes (those vLLM's prefix cache and its KV events use), each
    block's extra keys as vLLM's events carry them, its LoRA adapter. None: vLLM computed no
    hashes for that many blocks (nothing is announced)."""
    n = num_tokens // block_size
    hashes = list(getattr(request, "block_hashes", ()) or ())
    if n == 0 or len(hashes) < n or any(h is None for h in hashes[:n]):
        return None
    extra: tuple[Any, ...] | None = None
    lora = getattr(request, "lora_request", None)
    if (
        lora is not None
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "prompt_embeds", None) is not None
    ):
        keys: list[Any] = []
        mm_idx = 0
        for b in range(n):
            k, mm_idx = generate_block_hash_extra_keys(
                request, b * block_size, (b + 1) * block_size, mm_idx
            )
            keys.append(k)
        converted = to_event_extra_keys(keys)
        extra = None if converted is None else tuple(converted)
    return SaveEvents(
        block_hashes=tuple(bytes(h) for h in hashes[:n]),
        extra_keys=extra,
        lora_name=None if lora is None else str(lora.name),
        lora_id=None if lora is None else int(lora.adapter_id),
    )


def vllm_events(notices: list[ChunkNotice]) -> list[KVCacheEvent]:
    """``BlockStored`` / ``BlockRemoved`` for each notice, in order (block hashes as vLLM
    publishes its own: bytes, or 64-bit ints under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    out: list[KVCacheEvent] = []
    for n in notices:
        info = n.info
        hashes = [maybe_convert_block_hash(h) for h in info.block_hashes]  # type: ignore[arg-type]
        if n.stored:
            parent = info.parent_block_hash
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),  # type: ignore[arg-type]
                    token_ids=list(info.token_ids),
                    block_size=info.block_size,
                    lora_id=info.lora_id,
                    medium=n.kind.medium,
                    lora_name=info.lora_name,
                    extra_keys=None if info.extra_keys is None else list(info.extra_keys),
                    group_idx=info.group_idx,
                    kv_cache_spec_kind=info.spec_kind,
                    kv_cache_spec_sliding_window=info.sliding_window,
                    locality=n.kind.locality,
                    ownership=n.tier,
                )
            )
        else:
            out.append(
                BlockRemoved(
                    block_hashes=hashes,
                    medium=n.kind.medium,
                    group_idx=info.group_idx,
                    locality=n.kind.locality,
                    ownership=n.tier,
                )
            )
    return out


def group_specs(kv_cache_config: Any) -> list[tuple[str | None, int | None]]:
    """Each KV cache group's spec kind and sliding window, as vLLM's events name them."""
    out: list[tuple[str | None, int | None]] = []
    for g in list(getattr(kv_cache_config, "kv_cache_groups", ()) or ()):
        spec = g.kv_cache_spec
        try:
            kind: str | None = get_kv_cache_spec_kind(spec).value
        except Exception:  # a spec vLLM itself cannot classify: no kind
            kind = None
        out.append((kind, get_kv_cache_spec_sliding_window(spec)))
    return out


def hit_sources(by_source: dict[str, int], total: int) -> dict[CacheHitSource, int]:
    """``total`` tokens split by source in proportion to ``by_source`` (what the lookup's probe
    said each tier holds); counts sum to ``total`` exactly (the remainder goes to the
    outermost source). Empty without a split."""
    weights = {CacheHitSource(k): v for k, v in by_source.items() if v > 0}
    if total <= 0 or not weights:
        return {}
    whole = sum(weights.values())
    out = {s: total * v // whole for s, v in weights.items()}
    rest = total - sum(out.values())
    if rest:
        outer = CacheHitSource.outermost(out)
        out[outer] += rest
    return {s: n for s, n in out.items() if n > 0}
