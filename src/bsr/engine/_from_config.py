"""What ``RestoreEngine.from_config`` checks before it builds: a config, a layout, a namespace
and a host that agree.

Where it runs: a server's startup code, the ``bsr`` CLI, the vLLM connector (each building an
engine from an :class:`~bsr.EngineConfig`). No I/O but reading the host's memory size.

How it works: :func:`configured` refuses a config that disagrees with the layout
(``chunk_tokens``), a window larger than the host's memory, and a namespace that disagrees with
the config's identity (``model_id``, ``tenant``), each a :class:`~bsr.ConfigError` naming the
key; it returns the tiers and the namespace to build with. The knobs themselves are checked by
:class:`~bsr.EngineOptions` (the config is one), so they are not checked again here. This
module imports no engine: ``RestoreEngine.from_config`` calls it, then the engine's
constructor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .._check import short_repr
from .._errors import ConfigError
from ..core._keys import Namespace
from ..core._layout import StateLayout
from ..tiers._base import Tier
from ._config import EngineConfig
from ._coordinator import Coordinator


def configured(
    config: EngineConfig,
    layout: StateLayout,
    namespace: Namespace | None,
    coordinator: Coordinator | None,
    tiers: Sequence[Tier] | None,
) -> tuple[Sequence[Tier], Namespace]:
    """``(tiers, namespace)`` to build an engine of ``config`` with (see
    ``RestoreEngine.from_config`` for the arguments and what is refused)."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(
            "config must be a bsr.EngineConfig (use EngineConfig.from_dict), got "
            f"{type(config).__name__}"
        )
    if not isinstance(layout, StateLayout):
        raise ConfigError(f"layout must be a StateLayout, got {type(layout).__name__}")
    if config.chunk_tokens is not None and config.chunk_tokens != layout.chunk_tokens:
        raise ConfigError(
            f"chunk_tokens: the config says {short_repr(config.chunk_tokens)} but the layout "
            f"has chunk_tokens={layout.chunk_tokens}; make them agree (or leave chunk_tokens "
            "unset to take the layout's)",
            key="chunk_tokens",
        )
    check_window_memory(config.window, layout)
    if namespace is None:
        rank = 0 if coordinator is None else coordinator.rank
        size = 1 if coordinator is None else coordinator.world_size
        namespace = config.namespace(tp_rank=rank, tp_size=size)
    else:
        check_identity(config, namespace)
    return (config.build_tiers() if tiers is None else tiers), namespace


def check_identity(config: EngineConfig, namespace: Namespace) -> None:
    """A namespace passed with a config must agree with its ``model_id`` and ``tenant``."""
    if config.model_id is not None and namespace.model_id != config.model_id:
        raise ConfigError(
            f"model_id: the config says {config.model_id!r} but namespace.model_id is "
            f"{namespace.model_id!r}; drop one or make them agree",
            key="model_id",
        )
    if config.tenant is not None and bytes(namespace.salt) != config.tenant.encode():
        # a tenant's prefixes must never be served to another tenant by a silent override
        raise ConfigError(
            f"tenant: the config says {config.tenant!r} but the namespace's salt is "
            f"{bytes(namespace.salt)!r}; pass namespace=bsr.Namespace(..., "
            f"salt={config.tenant.encode()!r}) or drop tenant from the config",
            key="tenant",
        )


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes (None where the OS does not say)."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def check_window_memory(window: int, layout: StateLayout) -> None:
    """The staging window (W x slot bytes, allocated once when the engine opens) must fit in the
    host's physical memory: a larger one can only fail (ENOMEM) or swap, so it is refused here,
    naming ``window``, before anything is allocated."""
    need = window * layout.slot_bytes
    have = host_memory_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"window: {window} staging slots of {layout.slot_bytes} bytes need {need} bytes, "
            f"more than this host's {have} bytes of memory; lower window to at most "
            f"{max(1, have // layout.slot_bytes // 2)} (half the memory) or less",
            key="window",
        )
