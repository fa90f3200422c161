"""TierLadder against an independent model: down the holders in order, skipping the ones the
gate refuses, one report per attempt, stopping at the first verified read.

The tiers here are scripted (each answers every read one way: the payload, a short payload, or
one of the errors a tier may raise), so every path of the ladder is reached; the gate records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.core._plan import plan_restore
from bsr.engine._decisions import Quarantine, RestoreGate
from bsr.engine._health import TierHealth
from bsr.testing import make_keys
from bsr.transfer._ladder import Outcome, ReadOutcome, TierLadder
from bsr.transfer._pipeline import RestoreRun

EXPECTED = 16
KEY = bsr.ChunkKey(b"k" * 16, 3, b"ns")

#: how a scripted tier answers, and the outcome that stands for (None: a verified read)
BEHAVIOURS: dict[str, Outcome] = {
    "ok": Outcome.OK,
    "short": Outcome.CORRUPT,  # a payload of the wrong length is corrupt
    "corrupt": Outcome.CORRUPT,
    "miss": Outcome.MISS,
    "io": Outcome.IO_ERROR,
    "oserror": Outcome.IO_ERROR,
    "timeout": Outcome.TIMEOUT,
    "bug": Outcome.ERROR,
}


class Scripted(bsr.Tier):
    """A tier that answers every read the same way; it fills the region with its marker."""

    blocking_reads = True

    def __init__(self, name: str, behaviour: str, marker: int) -> None:
        super().__init__(name)
        self.behaviour, self.marker = behaviour, marker

    def read_into_blocking(self, key: bsr.ChunkKey, group: str, dst: Any) -> int:
        b = self.behaviour
        if b in ("ok", "short"):
            n = EXPECTED if b == "ok" else EXPECTED - 1
            dst[:n] = bytes([self.marker]) * n
            return n
        raise {
            "corrupt": bsr.CorruptObjectError("checksum", tier=self.name),
            "miss": bsr.ObjectNotFoundError("gone", tier=self.name),
            "io": bsr.TierIOError("eio", tier=self.name),
            "oserror": OSError(5, "eio"),
            "timeout": bsr.TierTimeoutError("slow", tier=self.name),
            "bug": RuntimeError("a bug in the tier"),
        }[b]

    async def read_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> int:
        return self.read_into_blocking(key, group, dst)

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        return [True] * len(objects)

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        raise NotImplementedError

    async def delete(self, key: bsr.ChunkKey, group: str) -> bool:
        raise NotImplementedError


class Recorder:
    """A gate that refuses the named tiers and records every call."""

    def __init__(self, refused: set[str]) -> None:
        self.refused = refused
        self.reports: list[ReadOutcome] = []
        self.withdrawn: list[str] = []

    def admit(self, tier: str, key: bsr.ChunkKey, group: str) -> str | None:
        return "refused by the test" if tier in self.refused else None

    def report(self, outcome: ReadOutcome) -> None:
        self.reports.append(outcome)

    def withdraw(self, tier: str) -> None:
        self.withdrawn.append(tier)


holders_st = st.lists(st.sampled_from(sorted(BEHAVIOURS)), max_size=6).map(
    lambda bs: [(f"t{i}-{b}", b) for i, b in enumerate(bs)]
)


@pytest.mark.anyio
@settings(max_examples=200, deadline=None)
@given(holders=holders_st, data=st.data(), blocking=st.booleans())
async def test_the_ladder_follows_the_model(
    holders: list[tuple[str, str]], data: st.DataObject, blocking: bool
) -> None:
    names = [n for n, _ in holders]
    refused = set(data.draw(st.lists(st.sampled_from(names)) if names else st.just([])))
    tiers = {n: Scripted(n, b, marker=i + 1) for i, (n, b) in enumerate(holders)}
    ladder = TierLadder(tiers)
    gate = Recorder(refused)
    region = bytearray(EXPECTED)
    if blocking:
        result = ladder.read_blocking(gate, KEY, 3, "kv", names, region, EXPECTED)
    else:
        result = await ladder.read(gate, KEY, 3, "kv", names, region, EXPECTED)

    # the model: walk the holders, skip the refused, stop at the first verified read
    tried: list[tuple[str, Outcome]] = []
    served = None
    for name, b in holders:
        if name in refused:
            continue
        tried.append((name, BEHAVIOURS[b]))
        if b == "ok":
            served = name
            break
    assert [(r.tier, r.outcome) for r in gate.reports] == tried
    assert all(r.key == KEY and r.group == "kv" and r.chunk == 3 for r in gate.reports)
    assert result.tier == served and result.ok is (served is not None)
    assert result.attempts == len(tried)
    assert result.corrupt is any(o is Outcome.CORRUPT for _, o in tried)
    # served, but not by the first holder (one before it was refused or failed)
    assert result.fell_back is (served is not None and names.index(served) > 0)
    assert gate.withdrawn == []
    if served is not None:
        assert result.nbytes == EXPECTED
        assert region == bytes([tiers[served].marker]) * EXPECTED
        ok = gate.reports[-1]
        assert ok.outcome is Outcome.OK and ok.nbytes == EXPECTED and not ok.error
    else:
        assert result.errors  # says why: each failure, each refusal, or "no tier holds it"
        if not holders:
            assert result.errors == ("no tier holds it",)
    failed = [r for r in gate.reports if r.outcome is not Outcome.OK]
    assert all(r.error.startswith(f"{r.tier}: ") and r.error_type for r in failed)


@pytest.mark.anyio
async def test_a_cancelled_read_is_withdrawn_not_reported() -> None:
    """A read cancelled mid-attempt reports nothing: the gate hears ``withdraw`` (once)."""

    class Stuck(Scripted):
        async def read_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> int:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    gate = Recorder(set())
    ladder = TierLadder({"stuck": Stuck("stuck", "ok", 1)})
    with anyio.move_on_after(0.05):
        await ladder.read(gate, KEY, 0, "kv", ["stuck"], bytearray(EXPECTED), EXPECTED)
    assert gate.reports == [] and gate.withdrawn == ["stuck"]


class BatchRecorder(Recorder):
    """:class:`Recorder` that also admits batches (unless told not to) and counts OK reports."""

    def __init__(self, refused: set[str], admit: bool = True) -> None:
        super().__init__(refused)
        self.admit_all = admit
        self.ok: list[str] = []

    def admit_batch(self, tier: str, objects: Any) -> bool:
        return self.admit_all and tier not in self.refused

    def report_ok(self, tier: str) -> None:
        self.ok.append(tier)


@settings(max_examples=200, deadline=None)
@given(holders=holders_st.filter(bool), data=st.data())
def test_an_admitted_batch_read_follows_the_ladder_model(
    holders: list[tuple[str, str]], data: st.DataObject
) -> None:
    """The first holder of an admitted batch is tried without admission; its success is not
    reported per object (the batch reports once); a failure is reported like any attempt and
    the read goes on down the ladder exactly as ``read_blocking`` would."""
    names = [n for n, _ in holders]
    refused = set(data.draw(st.lists(st.sampled_from(names[1:])) if names[1:] else st.just([])))
    tiers = {n: Scripted(n, b, marker=i + 1) for i, (n, b) in enumerate(holders)}
    ladder = TierLadder(tiers)
    gate = BatchRecorder(refused)
    assert ladder.admit_batch(gate, [(KEY, "kv", names)]) == names[0]
    region = bytearray(EXPECTED)
    result = ladder.read_admitted_blocking(gate, names[0], KEY, 3, "kv", names, region, EXPECTED)
    ladder.batch_ok(gate, names[0])

    tried: list[tuple[str, Outcome]] = []
    served = None
    for i, (name, b) in enumerate(holders):
        if i and name in refused:
            continue
        tried.append((name, BEHAVIOURS[b]))
        if b == "ok":
            served = name
            break
    # every failed attempt is reported; a success of a later holder through report_ok (the
    # ladder's one call per object read), the batch's own once at its end
    assert [(r.tier, r.outcome) for r in gate.reports] == [t for t in tried if t[1] != "ok"]
    later = [served] if served is not None and served != names[0] else []
    assert gate.ok == [*later, names[0]]
    assert result.tier == served and result.attempts == len(tried)
    assert result.corrupt is any(o is Outcome.CORRUPT for _, o in tried)
    assert result.fell_back is (served is not None and served != names[0])
    if served is not None:
        assert region == bytes([tiers[served].marker]) * EXPECTED


def test_a_batch_is_admitted_only_when_nothing_is_to_decide_per_object() -> None:
    keys = make_keys(3)
    tiers = {n: Scripted(n, "ok", 1) for n in ("a", "b")}
    ladder = TierLadder(tiers)
    layout = bsr.StateLayout(32, (bsr.StateGroup("kv", 1, 16),))
    run = RestoreRun(plan_restore(layout, 3), bsr.Policy.ALL_OR_NOTHING)
    health = TierHealth(["a", "b"], threshold=1, cooldown_s=60.0)
    quarantine = Quarantine()
    gate = RestoreGate(run, health, quarantine, _Log())
    objs = [(k, "kv", ("a", "b")) for k in keys]
    assert ladder.admit_batch(gate, objs) == "a"
    # other first holders: object by object
    assert ladder.admit_batch(gate, [*objs, (keys[0], "kv", ("b",))]) is None
    # one object of the batch quarantined on that tier: object by object (the gate skips it)
    quarantine.add("a", bsr.ObjectKey(keys[1], "kv").object_id)
    assert ladder.admit_batch(gate, objs) is None
    quarantine.lift("a", bsr.ObjectKey(keys[1], "kv").object_id)
    assert ladder.admit_batch(gate, objs) == "a"
    # an open (or half-open) breaker decides per call: object by object
    health.failure("a")
    assert ladder.admit_batch(gate, objs) is None
    # a tier without blocking reads, or a gate without batch admission: never
    assert ladder.admit_batch(Recorder(set()), objs) is None


class _Log:
    def warning(self, *a: Any, **k: Any) -> None:
        pass
