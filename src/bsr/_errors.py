"""The bsr error tree.

Every error bsr raises derives from :class:`BsrError` and carries structured fields
(``tier``, ``key``, ``group``, ``state`` ...) besides its message. Where a builtin fits, an
error also subclasses it (``ValueError`` for bad input, ``FileNotFoundError`` for a missing
object), so callers may catch either.

Messages say what to change, not only what went wrong.
"""

from __future__ import annotations

from typing import Any


class BsrError(Exception):
    """Root of every error raised by bsr."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields: dict[str, Any] = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        if not self.fields:
            return self.message
        extra = ", ".join(f"{k}={v!r}" for k, v in self.fields.items() if v is not None)
        return f"{self.message} [{extra}]" if extra else self.message


# --------------------------------------------------------------------- bad input
class ConfigError(BsrError, ValueError):
    """A layout, namespace, engine or cache argument is invalid."""


class LayoutError(ConfigError):
    """A StateLayout or StateGroup is invalid, or a cache does not match the engine's layout."""


class UnsupportedModelError(ConfigError):
    """A model cannot be restored this way exactly (e.g. hidden-state rebuild for an architecture
    whose K/V it cannot reproduce); the message names the missing piece."""


class TokenError(BsrError, TypeError):
    """Tokens are of an unsupported type, dtype or value."""


class BlockTableError(ConfigError):
    """The block table (block_ids) is too short, out of range or not integer."""


class UnknownGroupError(BsrError, KeyError):
    """A state group name is not part of the layout."""


class ClosedError(BsrError, RuntimeError):
    """An engine or tier was used before ``async with`` / after ``aclose()``."""


# --------------------------------------------------------------------- objects
class ObjectError(BsrError):
    """A stored object failed verification; it is never installed and is treated as a miss."""


class CorruptObjectError(ObjectError):
    """Checksum, magic or header mismatch: the bytes were damaged."""


class TruncatedObjectError(ObjectError):
    """The object is shorter (or longer) than its header says."""


class ForeignObjectError(ObjectError):
    """An intact object of another namespace, layout, format version, key or group."""


# --------------------------------------------------------------------- tiers
class TierError(BsrError):
    """A tier operation failed (I/O error, unavailable store, timeout)."""


class ObjectNotFoundError(TierError, FileNotFoundError):
    """The tier does not hold the requested object (any more)."""


class TierIOError(TierError, OSError):
    """An I/O error inside a tier (short read, EIO, permission denied ...)."""


class ReadWithdrawnError(TierIOError):
    """A read withdrawn because its request ended (or its caller stopped waiting): no outcome
    for the object or the tier (the engine reports it to no breaker and quarantines nothing)."""


class TierTimeoutError(TierError, TimeoutError):
    """A tier call did not finish within its timeout."""


class TierBusyError(TierTimeoutError):
    """A tier call was skipped because the tier stayed busy past its bound (``reason``: e.g.
    ``"root_locked"``, a FileTier root whose lock another process held for ``lock_timeout_s``).

    Nothing failed and nothing is wrong with the stored objects: a save skips that tier for
    this request (``SaveResult.skipped``), and a later call may succeed.
    """


class TierFullError(TierError):
    """The object does not fit in the tier even after eviction."""


class TierRootError(TierError):
    """A tier's root directory is not one bsr owns, or cannot be used as one (names the path)."""


class UntrustedRootError(TierRootError):
    """A FileTier root is on a filesystem whose ``flock`` may be local to each client (NFS,
    FUSE such as sshfs, Lustre, CephFS...), so the processes sharing it on several nodes could
    not keep it within its capacity together; ``fstype`` names the filesystem. Share it with
    ``shared="network"`` and a node id per node, use a local filesystem, or pass
    ``trust_locks=True`` when only one node opens the root or its locks are coherent across
    clients."""


# --------------------------------------------------------------------- lifecycle
class IllegalTransitionError(BsrError, RuntimeError):
    """A trigger is not allowed in the request's current state (the state is left unchanged)."""


class GuardRejectedError(IllegalTransitionError):
    """A trigger exists from this state but its guard does not hold (state left unchanged)."""


class CoordinatorError(BsrError):
    """A cross-rank agreement failed or timed out."""


class StagingError(BsrError):
    """Misuse of the staging pool (double release, foreign slot)."""


class OutOfBlocksError(BsrError):
    """A block allocator has fewer free blocks than asked for (free some, or evict)."""


class ConversationBusyError(ConfigError):
    """A conversation already has a turn in flight (``bsr.kit.ConversationCache``): one turn of
    a conversation at a time; commit or abort the current turn first."""
