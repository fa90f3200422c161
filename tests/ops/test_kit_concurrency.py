"""ConversationCache under concurrent turns: a conversation's blocks belong to it alone.

The four failures reported against the kit are reproduced deterministically: a tier wrapper
holds saves, lookups or reads at a gate, so a second turn runs exactly while the first is inside
the engine. Then a Hypothesis state machine interleaves turns, commits, aborts, cancellations
and gated evictions of several conversations against a model of who owns which block and what
K/V each conversation's valid tokens must hold.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import Any

import anyio
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import bsr
from bsr.kit import Admission, ConversationCache, admit

CT = 16  # tokens per chunk
BT = 4  # tokens per block
LAYOUT = bsr.StateLayout(chunk_tokens=CT, groups=(bsr.StateGroup("kv", 1, 256),))


class GatedTier(bsr.TierWrapper[bsr.Tier]):
    """Holds writes, probes and reads at gates the test opens; counts who is waiting."""

    def __init__(self, inner: bsr.Tier) -> None:
        super().__init__(inner)
        self.gates: dict[str, anyio.Event | None] = {"write": None, "probe": None, "read": None}
        self.waiting = {"write": 0, "probe": 0, "read": 0}
        self.arrived: dict[str, anyio.Event] = {}

    def close(self, *which: str) -> None:
        for w in which:
            if self.gates[w] is None:  # closing a closed gate keeps its waiters' event
                self.gates[w] = anyio.Event()
                self.arrived[w] = anyio.Event()

    async def reached(self, which: str) -> None:
        """Wait until a call is held at the (closed) gate ``which``."""
        with anyio.fail_after(30):
            await self.arrived[which].wait()

    def open_(self, *which: str) -> None:
        for w in which:
            gate, self.gates[w] = self.gates[w], None
            if gate is not None:
                gate.set()

    async def _pass(self, which: str) -> None:
        gate = self.gates[which]
        if gate is not None:
            self.waiting[which] += 1
            self.arrived[which].set()
            try:
                await gate.wait()
            finally:
                self.waiting[which] -= 1

    async def write(self, key: Any, group: str, payload: Any) -> bool:
        await self._pass("write")
        return await self.inner.write(key, group, payload)

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        await self._pass("probe")
        return await self.inner.contains_many(objects)

    async def fetch_into(self, key: Any, group: str, dst: Any) -> bsr.Fetched:
        await self._pass("read")
        return await self.inner.fetch_into(key, group, dst)


def history(conv: int, n: int) -> list[int]:
    """Conversation ``conv``'s first ``n`` tokens (no two conversations share a prefix)."""
    return [1000 * (conv + 1) + t for t in range(n)]


def kv_value(conv: int, t: int) -> torch.Tensor:
    """The K/V 'the model' computes for token ``t`` of conversation ``conv``."""
    gen = torch.Generator().manual_seed(conv * 100_003 + t)
    return torch.randint(0, 256, (LAYOUT.groups[0].token_bytes,), generator=gen, dtype=torch.uint8)


def write_kv(cache: bsr.PagedKVCache, conv: int, blocks: Sequence[int], lo: int, hi: int) -> None:
    kv = cache.tensor("kv")
    for t in range(lo, hi):
        kv[0, blocks[t // BT], t % BT] = kv_value(conv, t)


def kv_ok(cache: bsr.PagedKVCache, conv: int, blocks: Sequence[int], n: int) -> bool:
    kv = cache.tensor("kv")
    return all(torch.equal(kv[0, blocks[t // BT], t % BT], kv_value(conv, t)) for t in range(n))


def owned(convs: ConversationCache) -> dict[Hashable, list[int]]:
    return {c: convs.block_ids(c) for c in convs.resident()}


def assert_ownership(convs: ConversationCache) -> None:
    """Every allocated block belongs to exactly one conversation; none is leaked."""
    blocks = [b for ids in owned(convs).values() for b in ids]
    assert len(blocks) == len(set(blocks)), owned(convs)
    assert convs.allocator.num_used == len(blocks), (convs.allocator.num_used, owned(convs))


def make(num_blocks: int) -> tuple[GatedTier, bsr.RestoreEngine, ConversationCache]:
    tier = GatedTier(bsr.HostTier(1 << 24))
    engine = bsr.RestoreEngine(
        LAYOUT, [tier], window=2, io_depth=1, namespace=bsr.Namespace("kit-concurrency")
    )
    return tier, engine, ConversationCache(engine, bsr.PagedKVCache(LAYOUT, num_blocks, BT))


async def turn(convs: ConversationCache, conv: int, n: int, reserve: int = 0) -> Admission:
    """Admit, write the new tokens' K/V, commit everything."""
    adm = await convs.admit(conv, history(conv, n), reserve_tokens=reserve)
    write_kv(convs.cache, conv, adm.block_ids, adm.cached_tokens, n)
    convs.commit(conv, history(conv, n), n)
    return adm


# ---------------------------------------------------------------------- the reported failures
@pytest.mark.anyio
async def test_two_turns_evicting_at_once_pick_different_victims() -> None:
    """Both turns needed room while one idle conversation stood; both evicted it (KeyError)."""
    tier, engine, convs = make(12)
    async with engine:
        await turn(convs, 0, 2 * CT)  # 8 blocks, idle: the only victim
        tier.close("write")
        results: list[Admission] = []

        async def new_turn(conv: int) -> None:
            results.append(await turn(convs, conv, 5 * BT))  # 5 blocks: needs the victim's

        async with anyio.create_task_group() as tg:
            tg.start_soon(new_turn, 1)
            await tier.reached("write")  # conv 0's save is at the gate
            tg.start_soon(new_turn, 2)
            await anyio.wait_all_tasks_blocked()
            tier.open_("write")
        assert sorted(convs.resident()) == [1, 2] and len(results) == 2
        assert convs.statistics().evictions == 1
        assert_ownership(convs)


@pytest.mark.anyio
async def test_a_turn_of_a_conversation_being_evicted_keeps_its_own_kv() -> None:
    """Its turn was admitted in place while its save ran; then its blocks were freed and given
    to the evicting turn, which overwrote its K/V."""
    tier, engine, convs = make(20)
    async with engine:
        await turn(convs, 0, 2 * CT)  # 8 blocks, least recently used
        await turn(convs, 2, 2 * CT)  # 8 blocks
        tier.close("write")
        adms: dict[int, Admission] = {}

        async def run(conv: int, n: int) -> None:
            adms[conv] = await convs.admit(conv, history(conv, n))
            write_kv(convs.cache, conv, adms[conv].block_ids, adms[conv].cached_tokens, n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 1, 8 * BT)  # needs 8 blocks, 4 are free: evicts conversation 0
            await tier.reached("write")
            tg.start_soon(run, 0, 2 * CT + 3)  # conversation 0's next turn, mid-eviction
            await anyio.wait_all_tasks_blocked()
            tier.open_("write")
        a, b = adms[1], adms[0]
        assert not set(a.block_ids) & set(b.block_ids), (a.block_ids, b.block_ids)
        assert b.source == "restored" and b.cached_tokens == 2 * CT
        assert kv_ok(convs.cache, 0, b.block_ids, 2 * CT + 3)
        assert kv_ok(convs.cache, 1, a.block_ids, 8 * BT)
        assert_ownership(convs)


@pytest.mark.anyio
async def test_two_turns_of_one_conversation_leak_no_blocks() -> None:
    tier, engine, convs = make(32)
    async with engine:
        tier.close("probe")
        outcomes: list[object] = []

        async def run() -> None:
            try:
                outcomes.append(await convs.admit(7, history(7, 3 * BT)))
            except bsr.ConversationBusyError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await tier.reached("probe")
            tg.start_soon(run)
            await anyio.wait_all_tasks_blocked()
            tier.open_("probe")
        assert sorted(type(o).__name__ for o in outcomes) == ["Admission", "ConversationBusyError"]
        busy = next(o for o in outcomes if isinstance(o, bsr.ConversationBusyError))
        assert busy.fields == {"conversation": 7, "state": "admitting"}
        assert_ownership(convs)
        assert convs.allocator.num_used == 3


@pytest.mark.anyio
async def test_a_turn_cancelled_mid_restore_gives_its_blocks_back() -> None:
    tier, engine, convs = make(32)
    async with engine:
        await turn(convs, 3, 4 * CT)
        await convs.evict(3)
        assert convs.allocator.num_used == 0
        tier.close("read")
        async with anyio.create_task_group() as tg:
            tg.start_soon(convs.admit, 3, history(3, 4 * CT + 2))
            await tier.reached("read")  # inside the restore
            tg.cancel_scope.cancel()
        tier.open_("read")
        assert convs.allocator.num_used == 0, owned(convs)  # 17 blocks leaked here before
        assert convs.state(3) is None
        # the module-level admit gives back what it allocated, too
        tier.close("read")
        async with anyio.create_task_group() as tg:
            tg.start_soon(admit, engine, history(3, 4 * CT), convs.cache, convs.allocator)
            await tier.reached("read")
            tg.cancel_scope.cancel()
        tier.open_("read")
        assert convs.allocator.num_used == 0
        again = await turn(convs, 3, 4 * CT + 2)  # and the conversation is still restorable
        assert again.source == "restored" and kv_ok(convs.cache, 3, again.block_ids, 4 * CT)


@pytest.mark.anyio
async def test_cancelled_eviction_keeps_the_victim_resident_and_intact() -> None:
    tier, engine, convs = make(12)
    async with engine:
        await turn(convs, 0, 2 * CT)
        tier.close("write")
        async with anyio.create_task_group() as tg:
            tg.start_soon(convs.admit, 1, history(1, 8 * BT))
            await tier.reached("write")
            tg.cancel_scope.cancel()
        tier.open_("write")
        assert convs.state(0) == "idle" and convs.state(1) is None
        assert kv_ok(convs.cache, 0, convs.block_ids(0), 2 * CT)
        assert_ownership(convs)


@pytest.mark.anyio
async def test_one_turn_at_a_time_commit_abort_and_the_turn_block() -> None:
    _, engine, convs = make(32)
    async with engine:
        adm = await convs.admit(0, history(0, 10))
        for call in (
            lambda: convs.drop(0),
            lambda: convs.evict(0),
            lambda: convs.admit(0, history(0, 11)),
        ):
            with pytest.raises(bsr.ConversationBusyError, match="turn is in flight"):
                result = call()
                if hasattr(result, "__await__"):
                    await result
        convs.abort(0)  # keeps what was valid at admission: nothing
        with pytest.raises(bsr.ConfigError, match="no turn in flight"):
            convs.commit(0, history(0, 10), 10)
        assert convs.state(0) == "idle" and convs.block_ids(0) == list(adm.block_ids)
        with pytest.raises(RuntimeError, match="model failed"):
            async with convs.turn(0, history(0, 10)) as adm:
                write_kv(convs.cache, 0, adm.block_ids, 0, 10)
                raise RuntimeError("model failed")
        assert convs.state(0) == "idle"  # aborted by the block
        async with convs.turn(0, history(0, 10)) as adm:
            write_kv(convs.cache, 0, adm.block_ids, adm.cached_tokens, 10)
            convs.commit(0, history(0, 10), 10)
        resident = await convs.admit(0, history(0, 12))
        assert resident.source == "resident" and resident.cached_tokens == 10
        assert kv_ok(convs.cache, 0, resident.block_ids, 10)


# ---------------------------------------------------------------------- the state machine
CONVS = 4
BLOCKS = 16


async def _quiet() -> None:
    """Let every task run until it waits on something (worker threads included)."""
    threads = anyio.to_thread.current_default_thread_limiter()
    with anyio.fail_after(60):
        while True:
            await anyio.wait_all_tasks_blocked()
            if not threads.borrowed_tokens:
                return
            await anyio.sleep(0.001)


def _pick(options: list[Any], index: int) -> Any:
    """The ``index``-th option, cycling (rules draw an index, never from state: the state of
    concurrent tasks is not replayed exactly, and Hypothesis needs the same draws each time)."""
    return options[index % len(options)] if options else None


class ConcurrentTurns(RuleBasedStateMachine):
    """Turns of four conversations run as tasks on one event loop; the rules start, finish,
    abort and cancel them and hold or release the tier's gates (so evictions, probes and
    restores stop midway). The model is what each conversation's committed history is; after
    every step the blocks of resident conversations are disjoint and account for every
    allocated block, and each conversation's valid tokens hold exactly its own K/V."""

    def __init__(self) -> None:
        super().__init__()
        self._cm = start_blocking_portal()
        self.portal: BlockingPortal = self._cm.__enter__()
        self.tier, self.engine, self.convs = self.portal.call(self._open)
        self.length = dict.fromkeys(range(CONVS), 0)  # the model: committed tokens
        self.tasks: dict[Any, dict[str, Any]] = {}
        self.errors: list[BaseException] = []

    async def _open(self) -> tuple[GatedTier, bsr.RestoreEngine, ConversationCache]:
        tier, engine, convs = make(BLOCKS)
        await engine.open()
        return tier, engine, convs

    async def _turn(self, conv: int, n: int, reserve: int, task: dict[str, Any]) -> None:
        with task["scope"]:
            try:
                async with self.convs.turn(conv, history(conv, n), reserve_tokens=reserve) as adm:
                    task["admission"] = adm
                    write_kv(self.convs.cache, conv, adm.block_ids, adm.cached_tokens, n)
                    task["written"] = n
                    await task["finish"].wait()
                    if task["commit"]:
                        self.convs.commit(conv, history(conv, n), n)
                        self.length[conv] = n
            except (bsr.OutOfBlocksError, bsr.ConversationBusyError) as exc:
                task["outcome"] = type(exc).__name__
                return
            task["outcome"] = "done"

    def _settle(self) -> None:
        self.portal.call(_quiet)
        for conv in [c for c, t in self.tasks.items() if t["done"].is_set()]:
            del self.tasks[conv]

    def _turns(self, admitted: bool) -> list[int]:
        """Conversations with a turn task running (that has been admitted, if ``admitted``)."""
        return sorted(
            c
            for c, t in self.tasks.items()
            if isinstance(c, int) and (not admitted or "admission" in t) and "outcome" not in t
        )

    @rule(index=st.integers(0, CONVS - 1), grow=st.integers(1, 2 * CT), reserve=st.integers(0, 6))
    def start_turn(self, index: int, grow: int, reserve: int) -> None:
        conv = _pick([c for c in range(CONVS) if c not in self.tasks], index)
        if conv is None:
            return
        n = min(self.length[conv] + grow, 3 * CT)
        task: dict[str, Any] = {"commit": True}
        task["scope"], task["finish"], task["done"] = self.portal.call(
            lambda: (anyio.CancelScope(), anyio.Event(), anyio.Event())
        )

        async def body() -> None:
            try:
                await self._turn(conv, n, reserve, task)
            except Exception as exc:  # anything but the two expected refusals is a failure
                self.errors.append(exc)
            finally:
                task["done"].set()

        self.portal.start_task_soon(body)
        self.tasks[conv] = task
        self._settle()

    @rule(index=st.integers(0, CONVS - 1), commit=st.booleans())
    def finish(self, index: int, commit: bool) -> None:
        """The model is done: commit the turn (or abort it)."""
        conv = _pick(self._turns(True), index)
        if conv is not None:
            self.tasks[conv]["commit"] = commit
            self.portal.call(self.tasks[conv]["finish"].set)
            self._settle()

    @rule(index=st.integers(0, CONVS - 1))
    def cancel(self, index: int) -> None:
        conv = _pick(self._turns(False), index)
        if conv is not None:
            self.portal.call(self.tasks[conv]["scope"].cancel)
            self._settle()

    @rule(which=st.sampled_from(["write", "probe", "read"]), hold=st.booleans())
    def gate(self, which: str, hold: bool) -> None:
        self.portal.call(self.tier.close if hold else self.tier.open_, which)
        self._settle()

    @rule(index=st.integers(0, CONVS - 1))
    def evict(self, index: int) -> None:
        """An explicit eviction, running beside the turns (held at the write gate, maybe)."""
        conv = _pick(self._idle(), index)
        if conv is None:
            return
        task: dict[str, Any] = {"done": self.portal.call(anyio.Event)}

        async def body() -> None:
            try:
                await self.convs.evict(conv)
            except bsr.ConversationBusyError:
                pass  # a turn began meanwhile: refused
            except Exception as exc:
                self.errors.append(exc)
            finally:
                task["done"].set()

        self.portal.start_task_soon(body)
        self.tasks[("evict", conv)] = task
        self._settle()

    def _idle(self) -> list[int]:
        return [
            c
            for c in range(CONVS)
            if self.convs.state(c) == "idle" and ("evict", c) not in self.tasks
        ]

    @invariant()
    def no_turn_failed(self) -> None:
        assert not self.errors, self.errors

    @invariant()
    def blocks_belong_to_one_conversation_each(self) -> None:
        self.portal.call(assert_ownership, self.convs)  # on the loop's thread: a consistent view

    @invariant()
    def valid_tokens_hold_their_own_kv(self) -> None:
        self.portal.call(self._check_kv)

    def _check_kv(self) -> None:
        for conv in range(CONVS):
            task = self.tasks.get(conv)
            if task is not None and "written" in task and not task["done"].is_set():
                adm = task["admission"]  # a turn in flight: its prefix and what it wrote
                assert kv_ok(self.convs.cache, conv, adm.block_ids, task["written"])
            elif self.convs.state(conv) == "idle":
                blocks = self.convs.block_ids(conv)
                valid = min(self.length[conv], len(blocks) * BT)
                assert kv_ok(self.convs.cache, conv, blocks, valid), (conv, valid, blocks)

    async def _drain(self) -> None:
        with anyio.fail_after(60):
            for task in self.tasks.values():
                await task["done"].wait()

    def teardown(self) -> None:
        try:
            self.portal.call(self.tier.open_, "write", "probe", "read")
            for task in list(self.tasks.values()):
                if "finish" in task:
                    self.portal.call(task["finish"].set)
            self.portal.call(self._drain)  # with the gates open, every turn ends
            assert not self.errors, self.errors
            assert_ownership(self.convs)
            self.portal.call(self.convs.evict_all)
            assert self.convs.allocator.num_used == 0
            self.portal.call(self.engine.aclose)
        finally:  # on a failure, the portal cancels the turns still running
            self._cm.__exit__(*sys.exc_info())


ConcurrentTurns.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_concurrent_turns_against_an_ownership_model = ConcurrentTurns.TestCase
