"""bsr: Bounded-State Restoration of LLM execution state.

Restore an evicted KV cache (and its relatives) from storage tiers into a paged cache through a
window of at most W chunk-sized staging slots, committing all-or-nothing across state groups and
tensor-parallel ranks. See README.md and docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# the option rules and the errors are light (no torch): always there, so `except bsr.BsrError`
# needs no import
from ._check import Check as Check
from ._check import Options as Options
from ._check import option as option
from ._errors import BlockTableError as BlockTableError
from ._errors import BsrError as BsrError
from ._errors import ClosedError as ClosedError
from ._errors import ConfigError as ConfigError
from ._errors import ConversationBusyError as ConversationBusyError
from ._errors import CoordinatorError as CoordinatorError
from ._errors import CorruptObjectError as CorruptObjectError
from ._errors import ForeignObjectError as ForeignObjectError
from ._errors import GuardRejectedError as GuardRejectedError
from ._errors import IllegalTransitionError as IllegalTransitionError
from ._errors import LayoutError as LayoutError
from ._errors import ObjectError as ObjectError
from ._errors import ObjectNotFoundError as ObjectNotFoundError
from ._errors import OutOfBlocksError as OutOfBlocksError
from ._errors import ReadWithdrawnError as ReadWithdrawnError
from ._errors import StagingError as StagingError
from ._errors import TierBusyError as TierBusyError
from ._errors import TierError as TierError
from ._errors import TierFullError as TierFullError
from ._errors import TierIOError as TierIOError
from ._errors import TierRootError as TierRootError
from ._errors import TierTimeoutError as TierTimeoutError
from ._errors import TokenError as TokenError
from ._errors import TruncatedObjectError as TruncatedObjectError
from ._errors import UnknownGroupError as UnknownGroupError
from ._errors import UntrustedRootError as UntrustedRootError

if TYPE_CHECKING:  # what mypy and readers see; at run time __getattr__ imports on first use
    from . import kit as kit

    #: the installed distribution's version (``bsr._version``), read on first use
    __version__: str
    from .core._config_digest import model_config_digest as model_config_digest
    from .core._keys import FORMAT_VERSION as FORMAT_VERSION
    from .core._keys import ChunkKey as ChunkKey
    from .core._keys import KeyedTokens as KeyedTokens
    from .core._keys import KeyExtra as KeyExtra
    from .core._keys import Namespace as Namespace
    from .core._keys import ObjectKey as ObjectKey
    from .core._keys import as_token_array as as_token_array
    from .core._keys import chunk_keys as chunk_keys
    from .core._keys import prepare_tokens as prepare_tokens
    from .core._layout import StateGroup as StateGroup
    from .core._layout import StateLayout as StateLayout
    from .core._layout import kv_layout as kv_layout
    from .core._lifecycle import Reason as Reason
    from .core._lifecycle import RequestLifecycle as RequestLifecycle
    from .core._lifecycle import RequestState as RequestState
    from .core._lifecycle import TransitionRecord as TransitionRecord
    from .core._options import Promote as Promote
    from .core._results import LoadDecision as LoadDecision
    from .core._results import Policy as Policy
    from .core._results import Probe as Probe
    from .core._results import RestoreResult as RestoreResult
    from .core._results import SaveResult as SaveResult
    from .core._results import Strategy as Strategy
    from .core._results import Timings as Timings
    from .core._sightings import SightingCounter as SightingCounter
    from .core._sightings import SightingStatistics as SightingStatistics
    from .engine._budget import DeadlineSplit as DeadlineSplit
    from .engine._config import EngineConfig as EngineConfig
    from .engine._coordinator import Coordinator as Coordinator
    from .engine._coordinator import InProcessCoordinator as InProcessCoordinator
    from .engine._coordinator import InProcessGroup as InProcessGroup
    from .engine._coordinator import LocalCoordinator as LocalCoordinator
    from .engine._coordinator import TorchDistributedCoordinator as TorchDistributedCoordinator
    from .engine._cost import CostModel as CostModel
    from .engine._cost import CostStatistics as CostStatistics
    from .engine._engine import EngineStatistics as EngineStatistics
    from .engine._engine import RestoreEngine as RestoreEngine
    from .engine._health import BreakerState as BreakerState
    from .engine._options import EngineOptions as EngineOptions
    from .engine._warm import WarmResult as WarmResult
    from .engine._warm import WarmStatistics as WarmStatistics
    from .tiers._abandon import AbandonableCalls as AbandonableCalls
    from .tiers._base import Medium as Medium
    from .tiers._base import Tier as Tier
    from .tiers._base import TierLease as TierLease
    from .tiers._base import TierStatistics as TierStatistics
    from .tiers._base import TierUsage as TierUsage
    from .tiers._base import TierWrapper as TierWrapper
    from .tiers._base import as_byte_view as as_byte_view
    from .tiers._base import as_payload_view as as_payload_view
    from .tiers._codec import ObjectCodec as ObjectCodec
    from .tiers._codec import ObjectHeader as ObjectHeader
    from .tiers._host import HostTier as HostTier
    from .tiers._host import HostTierOptions as HostTierOptions
    from .tiers._mooncake import MooncakeTier as MooncakeTier
    from .tiers._mooncake import MooncakeTierOptions as MooncakeTierOptions
    from .tiers._reads import Borrowed as Borrowed
    from .tiers._reads import Fetched as Fetched
    from .tiers._reads import ReadItem as ReadItem
    from .tiers._registry import TierOptions as TierOptions
    from .tiers._registry import register_tier as register_tier
    from .tiers._registry import takes_options as takes_options
    from .tiers._registry import tier_kinds as tier_kinds
    from .tiers._registry import tier_options as tier_options
    from .tiers._registry import unregister_tier as unregister_tier
    from .tiers._watch import ObjectRemoved as ObjectRemoved
    from .tiers._watch import Removal as Removal
    from .tiers.file import FileTier as FileTier
    from .tiers.file import FileTierOptions as FileTierOptions
    from .tiers.file import KvikioReader as KvikioReader
    from .tiers.file import PosixReader as PosixReader
    from .tiers.file import StripedFileTier as StripedFileTier
    from .tiers.file import StripedFileTierOptions as StripedFileTierOptions
    from .tiers.file import UringReader as UringReader
    from .transfer._cache import PagedKVCache as PagedKVCache
    from .transfer._staging import StagingPool as StagingPool
    from .transfer._staging import StagingStatistics as StagingStatistics
    from .transfer._tables import NULL_BLOCK as NULL_BLOCK

#: where each lazily imported public name lives (the module, relative to this package)
_LAZY: dict[str, tuple[str, ...]] = {
    ".core._config_digest": ("model_config_digest",),
    ".core._keys": (
        "FORMAT_VERSION",
        "ChunkKey",
        "KeyExtra",
        "KeyedTokens",
        "Namespace",
        "ObjectKey",
        "as_token_array",
        "chunk_keys",
        "prepare_tokens",
    ),
    ".core._layout": ("StateGroup", "StateLayout", "kv_layout"),
    ".core._lifecycle": ("Reason", "RequestLifecycle", "RequestState", "TransitionRecord"),
    ".core._options": ("Promote",),
    ".core._results": (
        "LoadDecision",
        "Policy",
        "Probe",
        "RestoreResult",
        "SaveResult",
        "Strategy",
        "Timings",
    ),
    ".core._sightings": ("SightingCounter", "SightingStatistics"),
    ".engine._budget": ("DeadlineSplit",),
    ".engine._config": ("EngineConfig",),
    ".engine._coordinator": (
        "Coordinator",
        "InProcessCoordinator",
        "InProcessGroup",
        "LocalCoordinator",
        "TorchDistributedCoordinator",
    ),
    ".engine._cost": ("CostModel", "CostStatistics"),
    ".engine._engine": ("EngineStatistics", "RestoreEngine"),
    ".engine._health": ("BreakerState",),
    ".engine._options": ("EngineOptions",),
    ".engine._warm": ("WarmResult", "WarmStatistics"),
    ".tiers._abandon": ("AbandonableCalls",),
    ".tiers._base": (
        "Medium",
        "Tier",
        "TierLease",
        "TierStatistics",
        "TierUsage",
        "TierWrapper",
        "as_byte_view",
        "as_payload_view",
    ),
    ".tiers._codec": ("ObjectCodec", "ObjectHeader"),
    ".tiers._reads": ("Borrowed", "Fetched", "ReadItem"),
    ".tiers.file": (
        "FileTier",
        "FileTierOptions",
        "KvikioReader",
        "PosixReader",
        "StripedFileTier",
        "StripedFileTierOptions",
        "UringReader",
    ),
    ".tiers._host": ("HostTier", "HostTierOptions"),
    ".tiers._mooncake": ("MooncakeTier", "MooncakeTierOptions"),
    ".tiers._registry": (
        "TierOptions",
        "register_tier",
        "takes_options",
        "tier_kinds",
        "tier_options",
        "unregister_tier",
    ),
    ".tiers._watch": ("ObjectRemoved", "Removal"),
    ".transfer._cache": ("PagedKVCache",),
    ".transfer._staging": ("StagingPool", "StagingStatistics"),
    ".transfer._tables": ("NULL_BLOCK",),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name's module on first use (``bsr.kit`` is a submodule)."""
    import importlib

    if name == "kit":
        return importlib.import_module(".kit", __name__)
    if name == "__version__":
        from ._version import installed_version

        globals()[name] = version = installed_version()
        return version
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*(n for n in globals() if n.startswith("_")), *__all__, "kit", "__version__"})


#: the public names, sorted: the light ones imported above (the option rules, the errors) and every
#: name of the lazy table. Generated, so a name added to the table is exported (tests/test_api.py
#: checks it against the TYPE_CHECKING imports)
__all__ = tuple(
    sorted(
        {
            *(n for n, v in globals().items() if getattr(v, "__module__", "").startswith("bsr.")),
            *_WHERE,
        }
    )
)
