"""What every program of the bench shares.

Modules: :mod:`.stats` (:class:`~.stats.BenchError`, distributions, ratios), :mod:`.document`
(schema.json, validation, the atomic JSON write), :mod:`.machine` (machine, versions, commit,
filesystem), :mod:`.memory` (peak RSS), :mod:`.layouts` (built-in and custom layouts),
:mod:`.pagecache` (page-cache modes), :mod:`.raw` (raw reads of object files), :mod:`.fio` (fio,
the physical reference), :mod:`.workers` (how child processes find the bench).
"""
