"""The all-or-nothing campaign: the state machines of bsr.testing against real engines.

``RestoreMachine`` (one engine: saves, evictions, real corruption, faults of every kind,
restores under both policies, concurrent restores sharing the window, cancellation, close and
reopen) and ``MultiRankRestoreMachine`` (two in-process ranks, rank-asymmetric faults) run with
a fixed, derandomized budget sized for CI (well under 3 minutes on 2 cores).

``BSR_CAMPAIGN=long`` selects a long campaign: many more and longer examples, a random seed
(a failure prints the blob that reproduces it; the example database keeps it).

The figures (examples, steps, faults injected by kind, violations, outcome) are printed and
written as JSON to ``$BSR_CAMPAIGN_REPORT`` or, by default, ``bsr-campaign.json`` in pytest's
temporary directory (never inside the repository).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import numpy as np
import pytest
import structlog
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import run_state_machine_as_test

import bsr
from bsr.testing import (
    CampaignStats,
    FaultKind,
    FaultPlan,
    InvariantViolation,
    MultiRankRestoreMachine,
    RestoreMachine,
    fault_plans,
)

MODE = os.environ.get("BSR_CAMPAIGN", "ci")
if MODE not in ("ci", "long"):
    raise ValueError(f"BSR_CAMPAIGN must be 'ci' or 'long', got {MODE!r}")

#: (max_examples, stateful_step_count) per machine and mode
BUDGETS = {
    "ci": {"single": (150, 30), "multi": (150, 30)},
    "long": {"single": (3000, 50), "multi": (1500, 40)},
}
MACHINES: dict[str, type[RestoreMachine]] = {
    "single": RestoreMachine,
    "multi": MultiRankRestoreMachine,
}


def _commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    doc: dict[str, Any] = {
        "kind": "bsr-campaign",
        "mode": MODE,
        "commit": _commit(),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "hypothesis": hypothesis.__version__,
            "bsr": bsr.__version__,
        },
        "machines": {},
    }
    yield doc
    target = os.environ.get("BSR_CAMPAIGN_REPORT")
    path = Path(target) if target else tmp_path_factory.getbasetemp() / "bsr-campaign.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"\nbsr campaign report: {path}")


@pytest.fixture(autouse=True)
def _quieter_logs() -> Iterator[None]:
    """Faults make the engine log thousands of expected warnings: keep errors only here."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    yield
    structlog.configure(**old)


def campaign_settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=MODE == "ci",
        database=None if MODE == "ci" else settings.default.database,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


# the long campaign outlasts the suite's per-test timeout (a timeout firing mid-example would
# make Hypothesis report flaky data generation, not the timeout)
@pytest.mark.slow
@pytest.mark.timeout(0 if MODE == "long" else 600)
@pytest.mark.parametrize("name", ["single", "multi"])
def test_campaign(name: str, report: dict[str, Any]) -> None:
    examples, steps = BUDGETS[MODE][name]
    stats = CampaignStats()
    machine = MACHINES[name].configured(name=f"{MACHINES[name].__name__}Campaign", stats=stats)
    outcome = "passed"
    t0 = time.perf_counter()
    try:
        run_state_machine_as_test(machine, settings=campaign_settings(examples, steps))
    except BaseException as exc:
        outcome = f"failed: {type(exc).__name__}: {str(exc)[:1000]}"
        raise
    finally:
        figures = stats.to_dict()
        report["machines"][name] = {
            "machine": MACHINES[name].__name__,
            "world_size": machine.world_size,
            "settings": {
                "max_examples": examples,
                "stateful_step_count": steps,
                "derandomize": MODE == "ci",
            },
            "duration_s": round(time.perf_counter() - t0, 2),
            "outcome": outcome,
            **figures,
        }
        print(
            f"\n{name}: {figures['examples']} examples, {figures['steps']} steps, "
            f"{figures['restores']} restores ({figures['committed_nonempty']} non-empty commits), "
            f"{figures['faults_injected']} faults injected {figures['faults_by_kind']}, "
            f"{figures['violations']} violations; {outcome}"
        )
    assert stats.violations == 0
    # the campaign exercised what it claims to (a campaign that does nothing cannot fail)
    assert stats.examples >= examples
    assert stats.committed_nonempty >= examples
    assert stats.invalidated > 0 and stats.cancelled > 0 and stats.reopens > 0
    assert stats.corruptions > 0 and stats.evictions > 0
    # faults counted where they were injected agree with FaultPlan.fired
    assert stats.plan_fired == stats.faults_injected
    fired = {k for k, n in stats.faults.items() if n}
    assert len(fired) >= 5, f"only fault kinds {sorted(fired)} fired"


# ------------------------------------------------------------------ the campaign can fail
class _LyingHostTier(bsr.HostTier):
    """Stores one wrong byte for some objects, sealed as if it were right (a tier bug no check
    of a read can see: every read the engine checks matches the header stored with it). A
    tier returning wrong bytes on read is caught by the engine itself (see
    tests/transfer/test_lying_tiers.py); this one only the campaign's model can catch."""

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        if key.digest[0] % 3 == 0:
            flipped = np.array(memoryview(payload.numpy() if isinstance(payload, torch.Tensor)
                                          else payload).cast("B"), dtype=np.uint8)  # fmt: skip
            flipped[0] ^= 0x01
            payload = flipped
        return await super().write(key, group, payload)


class _ForgetfulHostTier(bsr.HostTier):
    """Acknowledges writes and stores nothing for some objects: a durability bug."""

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        if key.digest[0] % 2 == 0:
            return True
        return await super().write(key, group, payload)


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (_LyingHostTier, "differs from the saved bytes"),
        (_ForgetfulHostTier, "vanished"),
    ],
    ids=["wrong-bytes", "lost-writes"],
)
def test_campaign_catches_a_broken_tier(
    tmp_path: Path, tier: type[bsr.HostTier], message: str
) -> None:
    """Plugging a deliberately broken tier into the machine makes the campaign fail."""

    def tiers(directory: Path, rank: int) -> list[bsr.Tier]:
        return [tier(1 << 30, name="host")]

    stats = CampaignStats()
    # no injected faults: every expectation of the model is checked
    machine = RestoreMachine.configured(tier_factory=tiers, stats=stats, fault_kinds=())
    quick = settings(
        campaign_settings(50, 20),
        phases=[hypothesis.Phase.generate],
        print_blob=False,
    )
    with pytest.raises(InvariantViolation, match=message):
        run_state_machine_as_test(machine, settings=quick)
    assert stats.violations >= 1


def test_every_fault_kind_can_be_drawn() -> None:
    """The fault-plan strategy covers every FaultKind (the campaign draws from all of them)."""
    seen: set[FaultKind] = set()

    @settings(max_examples=200, derandomize=True, database=None)
    @given(fault_plans(("kv", "swa"), world_size=2))
    def collect(plan: FaultPlan) -> None:
        seen.update(f.kind for f in plan.faults)
        assert plan.faults
        assert plan.ranks is None or (plan.ranks and plan.ranks < {0, 1})

    collect()
    assert seen == set(FaultKind)
