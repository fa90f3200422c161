"""TierLadder against an independent model: down the holders in order, skipping the ones the
gate refuses, one report per attempt, stopping at the first read **that passes the check**.

The tiers here are scripted (each answers every read one way: the stored object, a short
payload, one of the errors a tier may raise, or a lie: the right length of wrong bytes, another
key's object, a header that is not an object's), so every path of the ladder is reached; the
gate records. The ladder trusts no tier's word: a lie is a corrupt read like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.core._object import HEADER_SIZE, encode_object
from bsr.core._plan import plan_restore
from bsr.engine._decisions import Quarantine, RestoreGate
from bsr.engine._health import TierHealth
from bsr.testing import make_keys
from bsr.transfer._ladder import Outcome, ReadOutcome, TierLadder
from bsr.transfer._run import RestoreRun

EXPECTED = 4096
KEY, OTHER = make_keys(2)

#: how a scripted tier answers, and the outcome that stands for
BEHAVIOURS: dict[str, Outcome] = {
    "ok": Outcome.OK,
    "short": Outcome.CORRUPT,  # fewer payload bytes than the header says
    "lie": Outcome.CORRUPT,  # the stored header, the right length of wrong bytes
    "other-key": Outcome.CORRUPT,  # another key's object, intact (right bytes, wrong key)
    "no-header": Outcome.CORRUPT,  # the right payload under a header that is no object's
    "corrupt": Outcome.CORRUPT,  # the tier itself says so
    "miss": Outcome.MISS,
    "io": Outcome.IO_ERROR,
    "oserror": Outcome.IO_ERROR,
    "timeout": Outcome.TIMEOUT,
    "bug": Outcome.ERROR,
}


def stored(key: bsr.ChunkKey, marker: int) -> bytes:
    """The object a tier keeps for ``(key, "kv")``: its payload is ``marker`` bytes."""
    return encode_object(bsr.ObjectKey(key, "kv"), bytes([marker]) * EXPECTED)


class Scripted(bsr.Tier):
    """A tier that answers every read the same way; its payload is its marker byte."""

    blocking_reads = True

    def __init__(self, name: str, behaviour: str, marker: int) -> None:
        super().__init__(name)
        self.behaviour, self.marker = behaviour, marker

    def fetch_into_blocking(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        b = self.behaviour
        if b in ("ok", "short", "lie", "other-key", "no-header"):
            blob = bytearray(stored(OTHER if b == "other-key" else key, self.marker))
            if b == "lie":
                blob[HEADER_SIZE:] = b"\x77" * (len(blob) - HEADER_SIZE)
            elif b == "no-header":
                blob[:HEADER_SIZE] = bytes(HEADER_SIZE)
            got = bsr.ObjectCodec.copy_out(bytes(blob), dst)
            return got._replace(nbytes=got.nbytes - 1) if b == "short" else got
        raise {
            "corrupt": bsr.CorruptObjectError("checksum", tier=self.name),
            "miss": bsr.ObjectNotFoundError("gone", tier=self.name),
            "io": bsr.TierIOError("eio", tier=self.name),
            "oserror": OSError(5, "eio"),
            "timeout": bsr.TierTimeoutError("slow", tier=self.name),
            "bug": RuntimeError("a bug in the tier"),
        }[b]

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        return self.fetch_into_blocking(key, group, dst)

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        return [True] * len(objects)

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        raise NotImplementedError

    async def delete(self, key: bsr.ChunkKey, group: str) -> bool:
        raise NotImplementedError


class Recorder:
    """A gate that refuses the named tiers and records every call; it admits no batch."""

    def __init__(self, refused: set[str]) -> None:
        self.refused = refused
        self.reports: list[ReadOutcome] = []
        self.withdrawn: list[str] = []

    def admit(self, tier: str, key: bsr.ChunkKey, group: str) -> str | None:
        return "refused by the test" if tier in self.refused else None

    def admit_batch(self, tier: str, objects: Any) -> Any:
        return None

    def report(self, outcome: ReadOutcome) -> None:
        self.reports.append(outcome)

    def withdraw(self, tier: str) -> None:
        self.withdrawn.append(tier)


def item(region: Any, chunk: int = 3) -> bsr.ReadItem:
    return bsr.ReadItem(KEY, "kv", region, EXPECTED, chunk=chunk)


def model(holders: list[tuple[str, str]], refused: set[str]) -> tuple[list[Any], str | None]:
    """Walk the holders, skip the refused, stop at the first read that passes the check."""
    tried: list[tuple[str, Outcome]] = []
    for name, b in holders:
        if name in refused:
            continue
        tried.append((name, BEHAVIOURS[b]))
        if b == "ok":
            return tried, name
    return tried, None


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
    region = np.zeros(EXPECTED, dtype=np.uint8)
    if blocking:
        result = ladder.read_one_blocking(gate, item(region), names)
    else:
        result = await ladder.read_one(gate, item(region), names)

    tried, served = model(holders, refused)
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
        assert bytes(region) == bytes([tiers[served].marker]) * EXPECTED
        ok = gate.reports[-1]
        assert ok.outcome is Outcome.OK and ok.nbytes == EXPECTED and not ok.error
    else:
        assert result.errors  # says why: each failure, each refusal, or "no tier holds it"
        if not holders:
            assert result.errors == ("no tier holds it",)
    failed = [r for r in gate.reports if r.outcome is not Outcome.OK]
    assert all(r.error.startswith(f"{r.tier}: ") and r.error_type for r in failed)
    # every lie the check caught counts as that tier's error
    for name, b in holders:
        lied = b in ("short", "lie", "other-key", "no-header")
        asked = any(r.tier == name for r in gate.reports)
        assert tiers[name].statistics().errors == (lied and asked)


@pytest.mark.anyio
async def test_a_cancelled_read_is_withdrawn_not_reported() -> None:
    """A read cancelled mid-attempt reports nothing: the gate hears ``withdraw`` (once)."""

    class Stuck(Scripted):
        async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    gate = Recorder(set())
    ladder = TierLadder({"stuck": Stuck("stuck", "ok", 1)})
    with anyio.move_on_after(0.05):
        await ladder.read_one(gate, item(np.zeros(EXPECTED, np.uint8)), ["stuck"])
    assert gate.reports == [] and gate.withdrawn == ["stuck"]


class Batch:
    def __init__(self, owner: BatchRecorder, tier: str) -> None:
        self.owner, self.tier = owner, tier

    def report(self, outcome: ReadOutcome) -> None:
        self.owner.batch_reports.append(outcome)

    def end(self, served: bool) -> None:
        self.owner.ended.append((self.tier, served))


class BatchRecorder(Recorder):
    """:class:`Recorder` that admits batches (unless told not to) and records their ends."""

    def __init__(self, refused: set[str], admit: bool = True) -> None:
        super().__init__(refused)
        self.admit_all = admit
        self.batch_reports: list[ReadOutcome] = []
        self.ended: list[tuple[str, bool]] = []

    def admit_batch(self, tier: str, objects: Any) -> Any:
        return Batch(self, tier) if self.admit_all and tier not in self.refused else None


@settings(max_examples=200, deadline=None)
@given(holders=holders_st.filter(bool), data=st.data(), admit=st.booleans())
def test_a_bulk_read_follows_the_ladder_model(
    holders: list[tuple[str, str]], data: st.DataObject, admit: bool
) -> None:
    """A batch through its first holder's bulk read: admitted at once (its failures reported
    through the batch, its end once), or, when the gate will not, each object admitted and
    reported on its own; an object the first holder did not serve goes on down the ladder
    exactly as ``read_one_blocking`` would, and ends once."""
    names = [n for n, _ in holders]
    refused = set(data.draw(st.lists(st.sampled_from(names[1:])) if names[1:] else st.just([])))
    tiers = {n: Scripted(n, b, marker=i + 1) for i, (n, b) in enumerate(holders)}
    ladder = TierLadder(tiers)
    gate = BatchRecorder(refused, admit=admit)
    regions = [np.zeros(EXPECTED, dtype=np.uint8) for _ in range(3)]
    items = [bsr.ReadItem(KEY, "kv", r, EXPECTED, chunk=c, holders=tuple(names))
             for c, r in enumerate(regions)]  # fmt: skip
    pending = list(reversed(items))
    ended: list[tuple[int, Any]] = []

    def end(it: bsr.ReadItem, result: Any) -> bool:
        ended.append((it.chunk, result))
        return True

    ladder.read_many_blocking(
        gate, names[0], lambda: pending.pop() if pending else None, end, 2,
        objects=[(KEY, "kv")] * 3,
    )  # fmt: skip

    tried, served = model(holders, refused)
    assert sorted(c for c, _ in ended) == [0, 1, 2]  # each item ended once
    first, later = tried[0], tried[1:]
    per_object = [(r.tier, r.outcome) for r in gate.reports]
    if admit:
        assert gate.ended == [(names[0], first[1] is Outcome.OK)]
        assert [(r.tier, r.outcome) for r in gate.batch_reports] == (
            [] if first[1] is Outcome.OK else [first] * 3
        )
        assert per_object == later * 3  # every later attempt on its own
    else:
        assert gate.ended == [] and gate.batch_reports == []
        assert per_object == tried * 3
    for _, result in ended:
        assert result.tier == served and result.attempts == len(tried)
        assert result.corrupt is any(o is Outcome.CORRUPT for _, o in tried)
    if served is not None:
        assert all(bytes(r) == bytes([tiers[served].marker]) * EXPECTED for r in regions)


def test_the_restore_gate_admits_a_batch_only_when_nothing_is_to_decide_per_object() -> None:
    keys = make_keys(3)
    layout = bsr.StateLayout(32, (bsr.StateGroup("kv", 1, 16),))
    run = RestoreRun(plan_restore(layout, 3), bsr.Policy.ALL_OR_NOTHING)
    health = TierHealth(["a", "b"], threshold=1, cooldown_s=60.0)
    quarantine = Quarantine()
    gate = RestoreGate(run, health, quarantine, _Log())
    objs = [(k, "kv") for k in keys]
    batch = gate.admit_batch("a", objs)
    assert batch is not None
    batch.end(True)
    batch.end(True)  # idempotent: one span, one success
    # one object of the batch quarantined on that tier: object by object (the gate skips it)
    quarantine.add("a", bsr.ObjectKey(keys[1], "kv").object_id)
    assert gate.admit_batch("a", objs) is None
    quarantine.lift("a", bsr.ObjectKey(keys[1], "kv").object_id)
    assert gate.admit_batch("a", objs) is not None
    # an open (or half-open) breaker decides per call: object by object
    health.failure("a")
    assert gate.admit_batch("a", objs) is None
    assert gate.admit_batch("b", objs) is not None


class _Log:
    def warning(self, *a: Any, **k: Any) -> None:
        pass
