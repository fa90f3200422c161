"""StagingPool: bounded, FIFO, accounted, cancellation-safe."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

import bsr
from bsr.transfer._staging import StagingPool


def test_slots_are_page_aligned_and_sized() -> None:
    pool = StagingPool(3, 8192)
    assert pool.size == 3 and pool.buffer.numel() == 3 * 8192
    assert pool.buffer.data_ptr() % 4096 == 0
    assert pool.statistics().capacity_bytes == 3 * 8192


@pytest.mark.anyio
async def test_acquire_release_and_peak() -> None:
    pool = StagingPool(2, 4096)
    acc = pool.account()
    a = await acc.acquire()
    b = acc.acquire_nowait()
    with pytest.raises(anyio.WouldBlock):
        pool.acquire_nowait()
    assert a.tensor.data_ptr() != b.tensor.data_ptr()
    acc.release(a)
    acc.release(b)
    s = pool.statistics()
    assert (s.in_use, s.peak_in_use, s.acquired, s.released) == (0, 2, 2, 2)
    assert acc.peak_bytes == 2 * 4096
    with pytest.raises(bsr.StagingError):
        pool.release(a)  # double release


def test_never_acquired_slot_cannot_be_released() -> None:
    pool = StagingPool(1, 4096)
    other = StagingPool(1, 4096)
    slot = other.acquire_nowait()
    with pytest.raises(bsr.StagingError):
        pool.release(slot)


@pytest.mark.anyio
async def test_waiters_are_served_fifo() -> None:
    pool = StagingPool(1, 4096)
    first = await pool.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        s = await pool.acquire()
        order.append(i)
        await anyio.sleep(0.001)
        pool.release(s)

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(waiter, i)
            # enqueue in order: each waiter queued before the next starts (a 1 ms sleep was not
            # enough on a loaded machine under trio, which may run a batch in any order)
            with anyio.fail_after(30):  # a hang guard, not a timing claim
                while pool.statistics().waiting < i + 1:
                    await anyio.lowlevel.checkpoint()
        assert pool.statistics().waiting == 5
        pool.release(first)
    assert order == [0, 1, 2, 3, 4]
    assert pool.statistics().peak_in_use == 1


@pytest.mark.anyio
async def test_cancelled_waiter_gives_nothing_away() -> None:
    pool = StagingPool(1, 4096)
    held = await pool.acquire()
    with anyio.move_on_after(0.01):
        await pool.acquire()
    assert pool.statistics().waiting == 0
    pool.release(held)
    s = pool.statistics()
    assert s.in_use == 0
    again = pool.acquire_nowait()  # the slot went back to the free list
    pool.release(again)


def test_window_must_be_positive() -> None:
    with pytest.raises(bsr.ConfigError, match="W"):
        StagingPool(0, 4096)
