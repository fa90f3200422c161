"""bsr: Bounded-State Restoration of LLM execution state.

Restore an evicted KV cache (and its relatives) from storage tiers into a paged cache through a
window of at most W chunk-sized staging slots, committing all-or-nothing across state groups and
tensor-parallel ranks. See README.md and docs/architecture.md.
"""

from __future__ import annotations

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
from ._errors import StagingError as StagingError
from ._errors import TierError as TierError
from ._errors import TierFullError as TierFullError
from ._errors import TierIOError as TierIOError
from ._errors import TierRootError as TierRootError
from ._errors import TierTimeoutError as TierTimeoutError
from ._errors import TokenError as TokenError
from ._errors import TruncatedObjectError as TruncatedObjectError
from ._errors import UnknownGroupError as UnknownGroupError
from .core._config_digest import model_config_digest as model_config_digest
from .core._keys import FORMAT_VERSION as FORMAT_VERSION
from .core._keys import ChunkKey as ChunkKey
from .core._keys import KeyedTokens as KeyedTokens
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
from .core._results import Policy as Policy
from .core._results import Probe as Probe
from .core._results import RestoreResult as RestoreResult
from .core._results import SaveResult as SaveResult
from .core._results import Strategy as Strategy
from .core._results import Timings as Timings
from .engine._config import EngineConfig as EngineConfig
from .engine._config import FileTierConfig as FileTierConfig
from .engine._config import HostTierConfig as HostTierConfig
from .engine._config import MooncakeTierConfig as MooncakeTierConfig
from .engine._coordinator import Coordinator as Coordinator
from .engine._coordinator import InProcessCoordinator as InProcessCoordinator
from .engine._coordinator import InProcessGroup as InProcessGroup
from .engine._coordinator import LocalCoordinator as LocalCoordinator
from .engine._coordinator import TorchDistributedCoordinator as TorchDistributedCoordinator
from .engine._engine import EngineStatistics as EngineStatistics
from .engine._engine import RestoreEngine as RestoreEngine
from .engine._health import BreakerState as BreakerState
from .tiers._base import Tier as Tier
from .tiers._base import TierLease as TierLease
from .tiers._base import TierStatistics as TierStatistics
from .tiers._base import TierUsage as TierUsage
from .tiers._base import TierWrapper as TierWrapper
from .tiers._file import FileTier as FileTier
from .tiers._host import HostTier as HostTier
from .tiers._mooncake import MooncakeTier as MooncakeTier
from .tiers._readers import KvikioReader as KvikioReader
from .tiers._readers import PosixReader as PosixReader
from .tiers._readers import UringReader as UringReader
from .transfer._cache import PagedKVCache as PagedKVCache
from .transfer._staging import StagingPool as StagingPool
from .transfer._staging import StagingStatistics as StagingStatistics
from .transfer._tables import NULL_BLOCK as NULL_BLOCK

# isort: off
# the kit imports names from this facade, so it comes last
from . import kit as kit

# isort: on

__version__ = "0.1.0"

__all__ = (
    "BlockTableError",
    "BreakerState",
    "BsrError",
    "ChunkKey",
    "ClosedError",
    "ConfigError",
    "ConversationBusyError",
    "Coordinator",
    "CoordinatorError",
    "CorruptObjectError",
    "EngineConfig",
    "EngineStatistics",
    "FORMAT_VERSION",
    "FileTier",
    "FileTierConfig",
    "ForeignObjectError",
    "GuardRejectedError",
    "HostTier",
    "HostTierConfig",
    "IllegalTransitionError",
    "InProcessCoordinator",
    "InProcessGroup",
    "KeyedTokens",
    "KvikioReader",
    "LayoutError",
    "LocalCoordinator",
    "MooncakeTier",
    "MooncakeTierConfig",
    "NULL_BLOCK",
    "Namespace",
    "ObjectError",
    "ObjectKey",
    "ObjectNotFoundError",
    "OutOfBlocksError",
    "PagedKVCache",
    "Policy",
    "PosixReader",
    "UringReader",
    "Probe",
    "Reason",
    "RequestLifecycle",
    "RequestState",
    "RestoreEngine",
    "RestoreResult",
    "SaveResult",
    "StagingError",
    "StagingPool",
    "StagingStatistics",
    "StateGroup",
    "StateLayout",
    "Strategy",
    "Tier",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TierLease",
    "TierRootError",
    "TierStatistics",
    "TierTimeoutError",
    "TierUsage",
    "TierWrapper",
    "Timings",
    "TokenError",
    "TorchDistributedCoordinator",
    "TransitionRecord",
    "TruncatedObjectError",
    "UnknownGroupError",
    "as_token_array",
    "chunk_keys",
    "kv_layout",
    "model_config_digest",
    "prepare_tokens",
)
