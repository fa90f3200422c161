"""The save path of one engine: every full chunk of a request, written through to its tiers.

Where it runs: the serving process's event loop, inside ``RestoreEngine.save`` (which keeps the
public signature and documentation).

How it works: :class:`Saves` is one per engine. A save keys the tokens, reads the block tables
and hands the chunks to :func:`~bsr.transfer._save.save_chunks` through the engine's staging
pool; a fresh copy written to a tier lifts that tier's quarantine of the object. A tier whose
circuit breaker is open is neither asked nor written (``SaveResult.skipped["breaker_open"]``). It
counts the engine's saves and the saves that skipped a busy tier, logs the result and reports it
to the engine's listeners.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._check import Check
from ..core._keys import Extras, TokensLike, check_extras
from ..core._layout import StateLayout
from ..core._results import SaveResult
from ..tiers._base import Tier
from ..transfer._cache import PagedKVCache
from ..transfer._save import save_chunks
from ..transfer._staging import StagingPool
from ._decisions import Quarantine
from ._probe import Prober
from ._restores import check_cache

#: the ``SaveResult.skipped`` reason of objects not written to a tier whose breaker is open
BREAKER_OPEN = "breaker_open"


class Saves:
    """Saves of one engine (see the module docstring)."""

    def __init__(
        self,
        layout: StateLayout,
        tiers: list[Tier],
        prober: Prober,
        quarantine: Quarantine,
        *,
        tier: Callable[[str], Tier],
        io_depth: int,
        checkpoint_chunks: int | None,
        counts: dict[str, int],
        log: Any,
        notify: Callable[[Any], None],
    ) -> None:
        self.layout, self.tiers, self.prober, self.quarantine = layout, tiers, prober, quarantine
        self.tier, self.io_depth, self.checkpoint_chunks = tier, io_depth, checkpoint_chunks
        self.counts, self.log, self.notify = counts, log, notify
        #: saves that skipped a tier because it stayed busy, by reason
        self.skipped: dict[str, int] = {}

    async def save(
        self,
        pool: StagingPool,
        tokens: TokensLike,
        cache: PagedKVCache,
        block_ids: Any,
        tiers: Sequence[str] | None,
        extras: Extras | None,
        window_checkpoints: bool,
    ) -> SaveResult:
        """``RestoreEngine.save`` on the engine's open staging pool."""
        every = (
            self.checkpoint_chunks if Check.flag(window_checkpoints, "window_checkpoints") else None
        )
        check_cache(cache, self.layout)
        keyed = await self.prober.keyed(tokens, check_extras(extras))
        tables = cache.block_tables(block_ids, len(keyed.keys) * self.layout.chunk_tokens)
        targets = self.tiers if tiers is None else [self.tier(name) for name in tiers]
        health = self.prober.health
        # a tier whose breaker is open holds nothing for probes until it closes, and one that
        # hangs would hold the save: neither asked nor written (counted in result.skipped)
        down = {t.name: BREAKER_OPEN for t in targets if not health.available(t.name)}
        quarantine = self.quarantine
        result = await save_chunks(
            layout=self.layout, tiers=targets, account=pool.account(), cache=cache, tables=tables,
            keys=list(keyed.keys), io_depth=self.io_depth, log=self.log,
            # a fresh copy replaces a quarantined one: probes may see it again
            on_written=lambda tier, okey: quarantine.lift(tier.name, okey.object_id),
            is_retired=lambda tier, okey: quarantine.retired(tier.name, okey.object_id),
            checkpoint_chunks=every, down=down,
        )  # fmt: skip
        self.counts["saves"] += 1
        for reason in result.skipped:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.log.info(
            "bsr.save.done", tokens=result.saved_tokens, chunks=result.chunks,
            written=result.objects_written, skipped=result.objects_skipped,
            busy_skipped=result.skipped, errors=result.errors,
            duration_s=round(result.duration_s, 6),
        )  # fmt: skip
        self.notify(result)
        return result
