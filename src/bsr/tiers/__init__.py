"""Layer 2, tiers: where bytes rest.

The :class:`~bsr.Tier` base with working defaults and capability flags, the shared LRU index,
wrapper tiers, and the built-in tiers: host DRAM, Mooncake and local files (the package
:mod:`bsr.tiers.file`). Imports only core.
"""
