"""Layer 4, engine: the decision side.

Configuration, probing and cross-rank agreement, quarantine and tier health (acting on the
transfer side's outcomes), the restore as named phases, and the coordinators.
"""
