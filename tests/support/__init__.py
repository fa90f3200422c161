"""What the tests share: helpers (:mod:`support.helpers`) and the one engine factory
(:mod:`support.engines`). ``tests/`` is on pytest's ``pythonpath``: ``from support.engines import
make_engine``."""
