"""Layer 3, transfer: moves bytes and decides nothing.

The staging pool, the paged destination cache and its installers, the tier ladder (which reports
an outcome per (chunk, group)), the restore pipeline and the save path. Imports core and tiers.
"""
