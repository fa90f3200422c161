"""Install modes: what follows a chunk's checked read, and what ends a run.

Where it runs: :meth:`Installer.after_read`, :meth:`Installer.reclaim` and
:meth:`Installer.drain` in the pipeline's worker threads (or on the event loop for a small
memory-speed batch); :meth:`Installer.finish` on the event loop once every worker ended.

How it works: :meth:`WindowPipeline._installer <bsr.transfer._pipeline.WindowPipeline>` picks one
mode per run and its loop only calls it:

* :class:`StreamedHostInstall` (host cache, bounded): each chunk is copied into the cache in
  the thread that read it, from its staging slot or straight from a payload a tier lent in
  place (a host hit: one copy), and its slot is free again at once.
* :class:`StreamedCudaInstall` (CUDA cache, bounded): each chunk's host-to-device copies are
  enqueued on a side stream, from the slot or from the lent (pinned) payload itself; the slot
  and the lent objects are held until the copy's event completed (:meth:`reclaim` waits for
  the oldest; :meth:`drain` for all, before the thread call returns). A chunk lent whole uses no
  slot bytes: its slot is free at once, its lent objects stay pinned until the copy landed.
* :class:`WholePlanInstall` (the whole-plan baseline, RWS = |S|): every chunk stays staged in
  its own region of a private buffer until every read ended, then everything is installed.

An installer reaches the run only through what it is given: the :class:`RestoreRun` (its
install gate, its record) and a :class:`RunOps` (give a slot back, announce chunks, run in a
worker thread), never the pipeline's private members.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import anyio

from ..core._lifecycle import Reason
from ..tiers._reads import Borrowed
from ._install import CudaInstaller, HostInstaller
from ._run import ChunkFailure, RestoreRun
from ._staging import Slot

#: lent chunks whose device copies may be in flight per worker call before it waits for one
MAX_PENDING_LENT = 16
#: chunks lent whole that a host install copies together (one entry of the install gate)
LENT_INSTALL_BATCH = 16
#: ... as long as their bytes stay under this: a chunk checked just now is copied while the
#: check's pass over it is still in the CPU's cache (a batch of large chunks would evict it)
LENT_INSTALL_BYTES = 256 * 1024


class RunOps(Protocol):
    """What an installer may ask of the pipeline running it."""

    def release(self, run: RestoreRun, slot: Slot) -> None:
        """Installer completion: the copy out of ``slot`` is done; give the slot back."""

    def announce(self, run: RestoreRun, chunks: Sequence[int]) -> Awaitable[None]:
        """Tell the run's listener about every chunk of ``chunks`` now fully installed."""

    def to_thread(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """``fn(*args)`` in a worker thread that a cancelled request abandons."""


def release_lent(lent: Mapping[str, Borrowed] | None) -> None:
    if lent:
        Borrowed.release_all(lent.values())


class Installer:
    """One install mode's rules (see the module docstring).

    Attributes:
        host: the host destination's views (None for a device destination).
        lends: payloads lent by a tier in place may be installed from where they lie.
        one_per_slot: one chunk per batch, each in its own slot (the whole-plan baseline).
        keeps_slots: the slots of a batch stay held after it (staged until :meth:`finish`).
    """

    host: HostInstaller | None = None
    lends = False
    one_per_slot = False
    keeps_slots = False

    def call(self) -> Installer:
        """What one worker call uses (an installer that keeps copies in flight gives each call
        its own; the others are their own)."""
        return self

    def after_read(
        self, run: RestoreRun, c: int, slot: Slot, lent: dict[str, Borrowed] | None, ok: bool
    ) -> list[Slot]:
        """Chunk ``c`` ended its reads (``ok``: every group checked and it is still wanted;
        ``lent``: the groups lent in place); install it, or drop it. The slots free now."""
        release_lent(lent)
        return [slot]

    def reclaim(self) -> list[Slot]:
        """Wait for the oldest copy in flight; the slots it frees ([] when none is in flight)."""
        return []

    def drain(self) -> list[Slot]:
        """Wait for every copy in flight; the slots they free."""
        return []

    async def finish(self, run: RestoreRun, ops: RunOps) -> None:
        """After every worker ended (the run's task group closed)."""


def _failed_install(run: RestoreRun, c: int, exc: BaseException) -> None:
    """A failed copy is a failed chunk, never a raise."""
    groups = run.needed[c]
    run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, [repr(exc)]))


class StreamedHostInstall(Installer):
    """Host destination, bounded: a chunk is copied into the cache in the thread that read it
    (each worker call records its installed chunks at once when it ends: :meth:`call`)."""

    lends = True

    def __init__(self, host: HostInstaller) -> None:
        self.host = host

    def call(self) -> Installer:
        assert self.host is not None
        return _HostCall(self.host)


class _HostCall(Installer):
    """The chunks one worker call of a :class:`StreamedHostInstall` copies into the cache.

    A chunk lent whole (every group a tier's own memory: no byte in its slot) waits with up to
    :data:`LENT_INSTALL_BATCH` others (fewer when they would pass :data:`LENT_INSTALL_BYTES`)
    and they are copied together, under one entry of the run's install gate, then let go (its
    slot is free at once: it holds nothing of it); any other chunk is copied at once. The
    installed chunks are recorded when the call ends (:meth:`drain`): one lock per call, not
    per chunk.
    """

    lends = True

    def __init__(self, host: HostInstaller) -> None:
        self.host: HostInstaller = host
        self.done: list[int] = []
        self.pending: list[tuple[int, dict[str, Borrowed]]] = []
        per = LENT_INSTALL_BYTES // max(1, host.layout.chunk_bytes)
        self.batch = max(1, min(LENT_INSTALL_BATCH, per))
        self.run: RestoreRun | None = None

    def after_read(
        self, run: RestoreRun, c: int, slot: Slot, lent: dict[str, Borrowed] | None, ok: bool
    ) -> list[Slot]:
        self.run = run
        if not ok:
            release_lent(lent)
            return [slot]
        if lent is not None and len(lent) == len(run.needed[c]):
            self.pending.append((c, lent))
            if len(self.pending) >= self.batch:
                self._flush(run)
            return [slot]
        try:
            if run.installs.enter():
                try:
                    payloads = {g: b.payload for g, b in lent.items()} if lent else None
                    self.host.install(c, run.needed[c], slot, payloads)
                    self.done.append(c)
                except Exception as exc:
                    _failed_install(run, c, exc)
                finally:
                    run.installs.leave()
        finally:
            release_lent(lent)
        return [slot]

    def _flush(self, run: RestoreRun) -> None:
        pending, self.pending = self.pending, []
        gate, install, needed, done = run.installs, self.host.install, run.needed, self.done
        try:
            if gate.enter():
                c = -1
                try:
                    for c, lent in pending:
                        if gate.closing or c >= run.limit:
                            break  # the request ended (the close waits for us), or failed
                        install(c, needed[c], None, {g: b.payload for g, b in lent.items()})
                        done.append(c)
                except Exception as exc:
                    _failed_install(run, c, exc)
                finally:
                    gate.leave()
        finally:
            Borrowed.release_all(b for _, lent in pending for b in lent.values())

    def drain(self) -> list[Slot]:
        run = self.run
        if run is not None:
            if self.pending:
                self._flush(run)
            if self.done:
                run.record_installed_many(self.done)
                self.done = []
        return []


class StreamedCudaInstall(Installer):
    """CUDA destination, bounded: copies enqueued on a side stream, from the slot or from the
    lent (pinned) payloads; what they read is held until their event completed. Each worker
    call keeps its own copies in flight (:meth:`call`)."""

    lends = True

    def __init__(self, device: CudaInstaller) -> None:
        self.device = device

    def call(self) -> Installer:
        return _CudaCall(self.device)


class _CudaCall(Installer):
    """The copies one worker call of a :class:`StreamedCudaInstall` has in flight."""

    lends = True

    def __init__(self, device: CudaInstaller) -> None:
        self.device = device
        # (event, chunk, slot still held or None, lent objects held), oldest first
        self.pending: collections.deque[tuple[Any, int, Slot | None, dict[str, Borrowed] | None]]
        self.pending = collections.deque()
        self.lent_pending = 0
        self.run: RestoreRun | None = None

    def after_read(
        self, run: RestoreRun, c: int, slot: Slot, lent: dict[str, Borrowed] | None, ok: bool
    ) -> list[Slot]:
        self.run = run
        if not ok or not run.installs.enter():
            release_lent(lent)
            return [slot]
        try:
            payloads = {g: b.payload for g, b in lent.items()} if lent else None
            event = self.device.install(c, run.needed[c], slot, payloads)
        except Exception as exc:
            _failed_install(run, c, exc)
            release_lent(lent)
            return [slot]
        finally:
            run.installs.leave()
        whole = lent is not None and len(lent) == len(run.needed[c])  # no byte from the slot
        self.pending.append((event, c, None if whole else slot, lent))
        free = [slot] if whole else []
        if lent:
            self.lent_pending += 1
            if self.lent_pending > MAX_PENDING_LENT:
                free += self.reclaim()
        return free

    def reclaim(self) -> list[Slot]:
        if not self.pending:
            return []
        event, c, slot, lent = self.pending.popleft()
        run = self.run
        assert run is not None
        try:
            event.synchronize()
            run.record_installed(c, run.needed[c])
        except Exception as exc:
            _failed_install(run, c, exc)
        finally:
            if lent:
                self.lent_pending -= 1
            release_lent(lent)
        return [] if slot is None else [slot]

    def drain(self) -> list[Slot]:
        freed: list[Slot] = []
        while self.pending:
            freed += self.reclaim()
        return freed


class WholePlanInstall(Installer):
    """The whole-plan baseline (RWS = |S|): every chunk is read into its own region of one
    private buffer and stays staged; once every read ended, everything staged is installed in
    chunk order (host: one worker-thread call; CUDA: one copy at a time)."""

    one_per_slot = True
    keeps_slots = True

    def __init__(self, *, host: HostInstaller | None = None, device: CudaInstaller | None = None):
        self.host = host
        self.device = device
        #: chunks read, waiting for the install
        self.staged: dict[int, Slot] = {}

    def after_read(
        self, run: RestoreRun, c: int, slot: Slot, lent: dict[str, Borrowed] | None, ok: bool
    ) -> list[Slot]:
        release_lent(lent)  # never lent (lends is False): nothing to hold
        if ok:
            self.staged[c] = slot
        return []

    async def finish(self, run: RestoreRun, ops: RunOps) -> None:
        """Install every staged chunk, in order, then announce them."""
        if not self.staged:
            return
        staged = self.staged
        if self.device is not None:
            device = self.device
            for c in sorted(staged):
                if not run.wanted(c):
                    continue
                event = await anyio.to_thread.run_sync(_enqueue, device, run, c, staged[c])
                if event is None:
                    return  # the copy failed (recorded) or the request is over
                while not event.query():  # noqa: ASYNC110 - polling a CUDA event
                    await anyio.sleep(0.0005)
                run.record_installed(c, run.needed[c])
        else:
            host = self.host
            assert host is not None

            def install_all() -> None:
                for c in sorted(staged):
                    if not run.wanted(c) or not run.installs.enter():
                        return
                    try:
                        host.install(c, run.needed[c], staged[c])
                        run.record_installed(c, run.needed[c])
                    except Exception as exc:
                        _failed_install(run, c, exc)
                        return
                    finally:
                        run.installs.leave()

            # abandonable: a late copy is refused by the run's install gate
            await ops.to_thread(install_all)
        await ops.announce(run, sorted(staged))


def _enqueue(device: CudaInstaller, run: RestoreRun, c: int, slot: Slot) -> Any:
    """Enqueue chunk ``c``'s host-to-device copy; its event, or None (the request is over, or
    the copy could not be enqueued: a failed chunk)."""
    if not run.installs.enter():
        return None
    try:
        return device.install(c, run.needed[c], slot)
    except Exception as exc:
        _failed_install(run, c, exc)
        return None
    finally:
        run.installs.leave()
