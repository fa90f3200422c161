"""The engine's upkeep of its tiers: audits, and moving quarantined objects out.

Where it runs: the serving process's event loop (``RestoreEngine.audit``, a restore or a warm
that found a corrupt object, the engine's close, which also closes the tiers here).

How it works: :meth:`Upkeep.audit` asks each tier's storage itself whether objects are still
there (metadata only), reports those found gone to the engine's removal listeners, and, where
asked, reads each held one back through the tier's verified read into one staging slot (a
corrupt one is quarantined). :meth:`Upkeep.move_out` asks tiers to quarantine objects within a
time bound and leaves what is left to the engine's quarantine, which retries it at close.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio

from .._errors import BsrError, ConfigError, ObjectError, ObjectNotFoundError
from ..core._keys import ObjectKey
from ..core._layout import StateLayout
from ..tiers._base import Tier
from ..tiers._watch import Removal, RemovalFeed
from ..transfer._staging import StagingPool
from ._decisions import Quarantine, TierQuarantine


class Upkeep:
    """Audits and quarantine moves of one engine's tiers (see the module docstring)."""

    def __init__(
        self,
        layout: StateLayout,
        tiers: list[Tier],
        quarantine: Quarantine,
        removals: RemovalFeed,
        shield_timeout_s: float,
        log: Any,
    ) -> None:
        self.layout, self.tiers, self._quarantine = layout, tiers, quarantine
        self._removals, self.shield_timeout_s, self._log = removals, shield_timeout_s, log

    def tier(self, name: str) -> Tier:
        """The engine's tier named ``name`` (else a ConfigError listing them)."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    async def move_out(self, moves: list[TierQuarantine], budget: float, log: Any) -> None:
        """Ask each tier to quarantine its objects within ``budget``; defer what is left."""
        left = list(moves)
        try:
            with anyio.move_on_after(budget):
                while left:
                    q = left[0]
                    try:
                        await self.tier(q.tier).quarantine(q.key, q.group, q.why)
                    except Exception as exc:
                        log.warning("bsr.tier.quarantine_failed", tier=q.tier, error=repr(exc))
                    left.pop(0)
        finally:
            if left:
                self._quarantine.defer(left)
                log.warning("bsr.tier.quarantine_deferred", objects=len(left))

    async def close(self) -> None:
        """At the engine's close: the quarantine moves a cancel or a bound cut short, tried once
        more, then every tier closed, each bounded by ``shield_timeout_s`` and shielded."""
        owed = self._quarantine.take_deferred()
        if owed:
            with anyio.CancelScope(shield=True):
                await self.move_out(owed, self.shield_timeout_s, self._log)
        for t in self.tiers:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.shield_timeout_s) as sc:
                try:
                    await t.aclose()
                except Exception as exc:
                    self._log.warning("bsr.tier.close_failed", tier=t.name, error=repr(exc))
            if sc.cancelled_caught:
                self._log.warning("bsr.tier.close_timeout", tier=t.name)

    async def audit(
        self,
        pool: StagingPool,
        objects: Sequence[tuple[str, ObjectKey]],
        deadline: float | None,
        verify: bool | Sequence[bool],
    ) -> list[bool | None]:
        """``RestoreEngine.audit``, its arguments checked but ``verify``."""
        checks = [bool(verify)] * len(objects) if isinstance(verify, bool) else list(verify)
        if len(checks) != len(objects):
            raise ConfigError(
                f"verify has {len(checks)} flags for {len(objects)} objects; pass one flag, or "
                "one per object"
            )
        by_tier: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(objects):
            self.tier(name)  # an unknown tier name is the caller's error
            by_tier.setdefault(name, []).append(i)
        out: list[bool | None] = [None] * len(objects)
        with anyio.move_on_after(math.inf if deadline is None else deadline):
            for name, idx in by_tier.items():
                try:
                    held = await self.tier(name).recheck_many([objects[i][1] for i in idx])
                except (BsrError, OSError) as exc:
                    self._log.warning("bsr.engine.audit_failed", tier=name, error=repr(exc))
                    continue
                unread: list[int] = []
                for i, h in zip(idx, held):
                    oid = objects[i][1].object_id
                    out[i] = bool(h) and (name, oid) not in self._quarantine
                    if not h:
                        self._removals.emit(oid, Removal.VANISHED, tier=name)
                    elif out[i] and checks[i]:
                        out[i] = None  # not known good until read back
                        unread.append(i)
                if unread:
                    await self._verify_held(pool, name, [(i, objects[i][1]) for i in unread], out)
        return out

    async def _verify_held(
        self,
        pool: StagingPool,
        name: str,
        objects: list[tuple[int, ObjectKey]],
        out: list[bool | None],
    ) -> None:
        """:meth:`audit`'s read-back: each object through ``tier.read_into`` into one staging
        slot (the slot goes back in ``finally``); ``out[i]`` is True (it verified), False (gone,
        or corrupt and now quarantined) or stays None (the read failed otherwise)."""
        tier = self.tier(name)
        slot = await pool.acquire()
        try:
            for i, okey in objects:
                try:
                    nbytes = self.layout.group_chunk_bytes(okey.group)
                    await tier.read_into(okey.chunk, okey.group, slot.tensor[:nbytes])
                except ObjectNotFoundError:
                    out[i] = False
                    self._removals.emit(okey.object_id, Removal.VANISHED, tier=name)
                except ObjectError as exc:  # corrupt or truncated: never served, moved out
                    out[i] = False
                    self._log.warning(
                        "bsr.engine.audit_corrupt", tier=name, key=okey.chunk.hex[:16],
                        group=okey.group, error=repr(exc),
                    )  # fmt: skip
                    self._quarantine.add(name, okey.object_id)
                    why = type(exc).__name__
                    await self.move_out(
                        [TierQuarantine(name, okey.chunk, okey.group, why)],
                        self.shield_timeout_s,
                        self._log,
                    )
                except (BsrError, OSError) as exc:
                    self._log.warning("bsr.engine.audit_unread", tier=name, error=repr(exc))
                else:
                    out[i] = True
        finally:
            pool.release(slot)
