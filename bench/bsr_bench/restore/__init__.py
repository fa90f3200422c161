"""The default ``bsr bench`` run: BSR restore vs whole-plan restore, raw reads and recompute.

How it works: :mod:`.program` saves states of growing size for each layout into a
:class:`~bsr.FileTier` and, for every size, measures (:mod:`.measure`) the probe, a BSR
(bounded-window) restore, a whole-plan restore, a raw read of the very same object files and,
for the recompute model's own KV layout, a prefill of the same tokens; a W x io_depth sweep
follows, then the machinery sections. One JSON document (checked against ``schema.json``), PNG
plots and tables come out. See ``bench/README.md``.

Modules: :mod:`.options` (flags and defaults), :mod:`.program` (the run and its document),
:mod:`.measure` (per layout: sizes, sweep, recompute), :mod:`.state` (saved state and engine
measurements), :mod:`.recompute` (HF prefill), :mod:`.remote` (``--remote mooncake``: a
loopback Mooncake cluster per layout), :mod:`.sections` and :mod:`.machinery` (fio, overhead,
concurrency, keys, window), :mod:`.targets` (targets and summary), :mod:`.report` (tables and
plots), :mod:`.ui` (progress and live table).
"""
