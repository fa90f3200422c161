"""Layer 1, core: what a restore *is*, with no I/O and no anyio.

Layout, chunk keys, the object format, prefix planning, the request lifecycle table and the
commit rule as pure functions. Everything here is synchronous and deterministic, so it is tested
exhaustively. Imports nothing from the layers above (checked by import-linter in CI).
"""
