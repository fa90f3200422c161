"""Programs the tests start as child processes, one a file; each docstring says which test starts
it and how. None is a test module (pytest collects nothing here); some are also imported by the
tests that start them, for their constants and helpers (``from children import ... as srw``).

- ``crash_writer.py``: a saving process SIGKILLed at random (tests/proof/test_crash.py);
- ``dist_worker.py``: one rank of the torch.distributed restore (tests/engine/test_distributed.py);
- ``mooncake_dist_worker.py``: one rank over a real Mooncake Store
  (tests/engine/test_mooncake_faults.py);
- ``shared_root_worker.py``: a process holding a FileTier root beside others
  (tests/support/shared_root.py, tests/tiers/test_file_tier_shared*.py);
- ``ledger_crasher.py``: a process that SIGKILLs itself inside the root's bookkeeping
  (tests/tiers/test_file_tier_shared.py);
- ``network_node_worker.py``: one node of a root shared in network mode
  (tests/tiers/test_network_churn.py, test_network_faults.py);
- ``run_engine.py``: one vLLM engine over a spec, and ``engine_forks.py``, the process that forks
  one per run (tests/vllm_engines.py, for tests/vllm_connector).
"""
