"""bsr-bench: the benchmark of bsr, run as ``bsr bench`` (the project's main job).

A client of bsr's public API only (checked by the import contracts in the repository's
``pyproject.toml``), kept out of the ``bsr`` package so the library ships without it; ``bsr
bench`` imports it when it is installed (``make bench``, or ``pip install -e bench/`` in a
checkout).

Programs, one per subpackage or module, chosen by :mod:`.cli` from the flags:

- :mod:`.restore`: the default run, BSR restore vs whole-plan restore, raw reads and recompute;
- :mod:`.paper`: the paper-scale benches, ``--l1-ladder`` and ``--tp N``;
- :mod:`.hcache`: ``--hcache``, HCache restore vs KV restore vs recompute;
- :mod:`.vllm_ttft`: ``--engine vllm``, bsr inside vLLM's CPU engine: time to first token, and
  (:mod:`.vllm_interference`) what a restore costs the requests already decoding.

:mod:`.common` holds what they share (errors and statistics, the JSON document and
``schema.json``, machine and commit, layouts, page cache, raw reads, fio). See
``bench/README.md``.
"""
