"""bsr's public test kit: run it against your own tiers and setups.

- :class:`TierConformance`: generic pytest suite every tier implementation must pass, with a
  hostile-store section for tiers that keep files (:func:`tmpfs_mount`,
  :func:`remount_read_only` and :func:`fifo_unblocker` are its helpers).
- Storage functions that bypass the tier under test: :func:`corrupt_stored`,
  :func:`truncate_stored`, :func:`peek_stored`, :func:`put_raw_stored`, through the tier's
  :meth:`~bsr.Tier.storage_hooks` (a :class:`StorageHooks`: HostTier, FileTier, MooncakeTier,
  and wrappers around them; :func:`storage_tier` peels the wrappers).
- :class:`FaultyTier` / :class:`FaultPlan` / :class:`Fault` / :class:`FaultKind`: seeded,
  replayable fault injection around any tier.
- :class:`LatencyTier`: latency and bandwidth shaping around any tier.
- :class:`RestoreMachine` / :class:`MultiRankRestoreMachine`: Hypothesis state machines that
  drive a real engine (or one per rank) beside a model and check the all-or-nothing invariants;
  :class:`CampaignStats` collects their figures.
- Hypothesis strategies: :func:`layouts`, :func:`token_streams`, :func:`derived_tokens`,
  :func:`faults`, :func:`fault_plans`.
- Real servers on loopback, started and stopped by PID: :func:`start_cluster` (Mooncake),
  :func:`start_redis_server` and :func:`start_redis_cluster` (``redis-server``;
  :func:`redis_problem` says why they cannot run here).
- :func:`check_key_partition` / :func:`assert_key_partition`: a key-partition conformance suite
  for a serving deployment (a vLLM server or ``LLM`` with a KV connector): a tenant's salt, an
  adapter, an image or prompt embeddings never get another value's KV, and still hit their own
  (:class:`PartitionCase`, :class:`Variant`; clients :class:`OpenAIKeyClient`,
  :class:`LLMKeyClient`, or your own :class:`KeyClient`).
- Fixtures that own what they start: :func:`listening_ports` (the TCP ports a PID itself
  listens on) and :func:`wait_listening` (wait for it; :class:`PortTaken` when another process
  holds the port, so start again on another).

Importing this module needs pytest (``pip install bsr-kv[test]``). The state machines and the
strategies need Hypothesis (also in the ``test`` extra); they are imported lazily, on first use
of one of their names, so ``import bsr.testing`` works without Hypothesis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..tiers._base import StorageHooks as StorageHooks
from ._conformance import BACKENDS as BACKENDS
from ._conformance import TierConformance as TierConformance
from ._conformance import fifo_unblocker as fifo_unblocker
from ._conformance import flip_file_byte as flip_file_byte
from ._conformance import make_keys as make_keys
from ._conformance import payload as payload
from ._conformance import remount_read_only as remount_read_only
from ._conformance import tmpfs_mount as tmpfs_mount
from ._faults import Fault as Fault
from ._faults import FaultKind as FaultKind
from ._faults import FaultPlan as FaultPlan
from ._faults import FaultyTier as FaultyTier
from ._faults import LatencyTier as LatencyTier
from ._faults import corrupt_stored as corrupt_stored
from ._faults import peek_stored as peek_stored
from ._faults import put_raw_stored as put_raw_stored
from ._faults import storage_tier as storage_tier
from ._faults import truncate_stored as truncate_stored
from ._key_partition import CaseReport as CaseReport
from ._key_partition import Completion as Completion
from ._key_partition import KeyClient as KeyClient
from ._key_partition import LLMKeyClient as LLMKeyClient
from ._key_partition import OpenAIKeyClient as OpenAIKeyClient
from ._key_partition import PartitionCase as PartitionCase
from ._key_partition import Variant as Variant
from ._key_partition import assert_key_partition as assert_key_partition
from ._key_partition import check_key_partition as check_key_partition
from ._mooncake_cluster import MOONCAKE_REQUIREMENT as MOONCAKE_REQUIREMENT
from ._mooncake_cluster import MooncakeUnavailable as MooncakeUnavailable
from ._mooncake_cluster import mooncake_problem as mooncake_problem
from ._mooncake_cluster import start_cluster as start_cluster
from ._ports import PortTaken as PortTaken
from ._ports import listening_ports as listening_ports
from ._ports import wait_listening as wait_listening
from ._redis_server import RedisClusterHarness as RedisClusterHarness
from ._redis_server import RedisServer as RedisServer
from ._redis_server import RedisUnavailable as RedisUnavailable
from ._redis_server import redis_problem as redis_problem
from ._redis_server import start_cluster as start_redis_cluster
from ._redis_server import start_server as start_redis_server

if TYPE_CHECKING:
    from ._campaign import CampaignStats as CampaignStats
    from ._campaign import InvariantViolation as InvariantViolation
    from ._cluster import RecordingFaultyTier as RecordingFaultyTier
    from ._cluster import TierFactory as TierFactory
    from ._cluster import default_tier_factory as default_tier_factory
    from ._machine import MultiRankRestoreMachine as MultiRankRestoreMachine
    from ._machine import RestoreMachine as RestoreMachine
    from ._model import Status as Status
    from ._strategies import LayoutCase as LayoutCase
    from ._strategies import derived_tokens as derived_tokens
    from ._strategies import fault_plans as fault_plans
    from ._strategies import faults as faults
    from ._strategies import layouts as layouts
    from ._strategies import state_groups as state_groups
    from ._strategies import token_streams as token_streams

# names that need Hypothesis, loaded on first access
_LAZY = {
    "CampaignStats": "._campaign",
    "InvariantViolation": "._campaign",
    "MultiRankRestoreMachine": "._machine",
    "RecordingFaultyTier": "._cluster",
    "RestoreMachine": "._machine",
    "Status": "._model",
    "TierFactory": "._cluster",
    "default_tier_factory": "._cluster",
    "LayoutCase": "._strategies",
    "derived_tokens": "._strategies",
    "fault_plans": "._strategies",
    "faults": "._strategies",
    "layouts": "._strategies",
    "state_groups": "._strategies",
    "token_streams": "._strategies",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bsr.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = (
    "CampaignStats",
    "CaseReport",
    "Completion",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "FaultyTier",
    "InvariantViolation",
    "KeyClient",
    "LLMKeyClient",
    "LatencyTier",
    "LayoutCase",
    "MOONCAKE_REQUIREMENT",
    "MooncakeUnavailable",
    "MultiRankRestoreMachine",
    "OpenAIKeyClient",
    "PartitionCase",
    "PortTaken",
    "RecordingFaultyTier",
    "RedisClusterHarness",
    "RedisServer",
    "RedisUnavailable",
    "RestoreMachine",
    "Status",
    "BACKENDS",
    "StorageHooks",
    "TierConformance",
    "TierFactory",
    "Variant",
    "assert_key_partition",
    "check_key_partition",
    "corrupt_stored",
    "default_tier_factory",
    "derived_tokens",
    "fault_plans",
    "faults",
    "fifo_unblocker",
    "flip_file_byte",
    "layouts",
    "listening_ports",
    "make_keys",
    "mooncake_problem",
    "payload",
    "peek_stored",
    "put_raw_stored",
    "redis_problem",
    "remount_read_only",
    "start_cluster",
    "start_redis_cluster",
    "start_redis_server",
    "state_groups",
    "storage_tier",
    "tmpfs_mount",
    "token_streams",
    "truncate_stored",
    "wait_listening",
)
