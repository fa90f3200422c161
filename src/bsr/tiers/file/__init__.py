"""The file tier: one file per object in a local directory bsr owns, shared by processes.

- ``_tier``: :class:`FileTier` and its options (writes, reads, probes, eviction);
- ``_root``: the root on disk: its names, the marker that claims it, the scan on open;
- ``_ledger``: the shared ledger, the root's lock and eviction across processes;
- ``_readers``: object readers (io_uring, ``preadv``, kvikio) and regular-file opens;
- ``_uring``: a minimal io_uring through the raw system calls;
- ``_network``: a root shared by nodes of a network filesystem (per-node shares, no lock);
- ``_striped``: :class:`StripedFileTier`, one tier over several roots (devices);
- ``_admin``: administration of a root (``bsr store``: stats, listing, scrub, gc, quarantine).

The rest of bsr imports the file tier from this package, never from its private modules.
"""

from ._admin import (
    GcReport,
    ObjectInfo,
    QuarantinedFile,
    StoreStats,
    VerifyReport,
    gc_store,
    list_objects,
    list_quarantine,
    purge_quarantine,
    store_stats,
    verify_store,
)
from ._readers import (
    KvikioReader,
    ObjectReader,
    PosixReader,
    ReadWithdrawnError,
    UringReader,
    cancellation,
)
from ._striped import StripedFileTier, StripedFileTierOptions
from ._tier import FileTier, FileTierOptions

__all__ = [
    "FileTier",
    "FileTierOptions",
    "GcReport",
    "KvikioReader",
    "ObjectInfo",
    "ObjectReader",
    "PosixReader",
    "QuarantinedFile",
    "ReadWithdrawnError",
    "StoreStats",
    "StripedFileTier",
    "StripedFileTierOptions",
    "UringReader",
    "VerifyReport",
    "cancellation",
    "gc_store",
    "list_objects",
    "list_quarantine",
    "purge_quarantine",
    "store_stats",
    "verify_store",
]
