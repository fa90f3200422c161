"""bsr's public test kit: run it against your own tiers and setups.

- :class:`TierConformance`: generic pytest suite every tier implementation must pass.
- :class:`FaultyTier` / :class:`FaultPlan` / :class:`Fault` / :class:`FaultKind`: seeded,
  replayable fault injection around any tier.
- :class:`LatencyTier`: latency and bandwidth shaping around any tier.

Importing this module needs pytest (``pip install bsr[test]``).
"""

from __future__ import annotations

from ._conformance import TierConformance as TierConformance
from ._conformance import flip_file_byte as flip_file_byte
from ._conformance import make_keys as make_keys
from ._conformance import payload as payload
from ._faults import Fault as Fault
from ._faults import FaultKind as FaultKind
from ._faults import FaultPlan as FaultPlan
from ._faults import FaultyTier as FaultyTier
from ._faults import LatencyTier as LatencyTier
from ._faults import corrupt_stored as corrupt_stored
from ._faults import truncate_stored as truncate_stored

__all__ = (
    "Fault",
    "FaultKind",
    "FaultPlan",
    "FaultyTier",
    "LatencyTier",
    "TierConformance",
    "corrupt_stored",
    "flip_file_byte",
    "make_keys",
    "payload",
    "truncate_stored",
)
