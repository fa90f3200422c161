"""EngineOptions: every knob of a RestoreEngine, declared once.

Where it runs: wherever an engine is built, from keyword arguments (``RestoreEngine(layout,
tiers, window=8, ...)``) or from a config (``EngineConfig`` is the tiers, the namespace's
identity and these options). Pure checks, no I/O.

How it works: :class:`EngineOptions` is a frozen dataclass of ``option(...)`` fields
(:class:`~bsr.Options`), each a name, a type, a default, its documentation and the one parser
that checks it. :class:`~bsr.EngineConfig` inherits the fields, and :func:`takes_options` gives
``RestoreEngine.__init__`` a signature made of the engine's own arguments (the layout, the tiers,
the namespace, the coordinator) and these fields, so a knob added here is a constructor
argument, a config key, a ``BSR_*`` variable and a documented attribute at once, checked by the
same parser (and with the same message) wherever it arrives from.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from .._check import (
    Check,
    Options,
    finite_float,
    option,
    option_fields,
    positive_int,
    short_repr,
)
from .._errors import ConfigError
from ..core._options import Policy, Promote

if TYPE_CHECKING:  # annotations only: the arguments' types
    from ..core._keys import Namespace
    from ..core._layout import StateLayout
    from ..tiers._base import Tier
    from ._coordinator import Coordinator

#: a sliding-window group's window checkpoints, in chunks (see ``EngineOptions``): the bench's
#: hybrid section measures bytes stored and read against the hits each interval keeps
DEFAULT_WINDOW_CHECKPOINT_CHUNKS = 4
#: the largest window (W) accepted: more slots than a 16M-token request has 256-token chunks
#: cannot be used; ``RestoreEngine.from_config`` also checks W x slot bytes against the host
MAX_WINDOW = 1 << 16


def check_share(value: Any, key: str) -> float:
    """A share of a deadline: a finite number in (0, 1]."""
    return finite_float(
        value, key, minimum=0.0, strict=True, maximum=1.0,
        too_large="a share of the deadline (1: the whole of it)", key=key,
    )  # fmt: skip


def check_window(value: Any, key: str) -> int:
    """W: a positive int, at most :data:`MAX_WINDOW`."""
    return positive_int(value, key, maximum=MAX_WINDOW, key=key)


@dataclass(frozen=True, kw_only=True)
class EngineOptions(Options):
    """The knobs of a :class:`~bsr.RestoreEngine`, each checked when constructed.

    ``RestoreEngine(layout, tiers, namespace=ns, window=4)`` and
    ``RestoreEngine(layout, tiers, namespace=ns, options=bsr.EngineOptions(window=4))`` build
    the same engine; :class:`~bsr.EngineConfig` carries the same fields (keys of a config table,
    ``BSR_*`` variables). A bad value is a :class:`~bsr.ConfigError` naming its key, the same
    from each of them.

    Attributes:
        window: W, staging slots (each ``layout.slot_bytes``); peak staging <= W x slot_bytes.
            At most :data:`MAX_WINDOW`.
        io_depth: reads in flight per restore (``1 <= io_depth <= window``).
        memory_workers: worker threads one restore uses at once to verify and copy chunks into
            a host cache when no thread waits on a read: chunks whose first holder is a
            memory-speed tier (a HostTier), or one FileTier reading through io_uring, where
            each thread keeps a read in flight per slot it holds (at most ``io_depth``). That
            work is bound by memory bandwidth, not by a device's queue: on a small host a second
            thread adds CPU and little speed, so the default is 1; raise it where cores and
            memory bandwidth are spare and restore wall time matters more than CPU.
        policy: default commit policy: ``"all_or_nothing"``, ``"truncate"`` or ``"cost"`` (load
            only what is faster to load than to recompute, see :class:`~bsr.CostModel`).
        deadline_s: default per-restore deadline in seconds (``None``: none).
        probe_share: the share of a restore's deadline its probe may spend waiting for the
            tiers' answers (of the time left when it asks them): a tier still answering then is
            cut off, holds nothing for this restore (counted against its circuit breaker, named
            in ``RestoreResult.unanswered``) and the restore goes on with what the other tiers
            hold, in the rest of the deadline. A hung pool below a host tier holding the prefix
            then costs ``probe_share`` of the deadline, not all of it and a recompute. ``1``:
            the whole deadline (a restore whose probe is cut off then ends ``deadline``).
        pin_staging: pinned staging memory when CUDA is available.
        prefault_staging: touch the staging window at open (no page faults in the first
            restore; the window is resident from the start).
        breaker_threshold: consecutive I/O failures or timeouts after which a tier is skipped
            for ``breaker_cooldown_s`` (``None``: never skip a tier).
        breaker_cooldown_s: how long a tripped tier is skipped before one trial call.
        shield_timeout_s: the bound on the calls bsr makes for its own sake: moving a corrupt
            object out of its tier (also within the request's deadline, and never holding a
            caller's cancel: the engine's quarantine already keeps the object out of use, and a
            move cut short is retried at close), waiting for device copies that still read
            staging slots (shielded: the one wait a caller's cancel is held for, as a slot must
            not be reused under a copy), and closing a tier (shielded).
        staging_budget_bytes: host staging the engine may use (an int or ``"512MiB"``). The
            window must fit in it (else a ConfigError when the engine is built); a whole-plan
            restore whose plan exceeds it ends Invalidated with reason ``staging_budget``
            before allocating anything. ``None``: no budget.
        window_checkpoint_chunks: a sliding-window group's *window checkpoints*: a save asked
            for them (``save(..., window_checkpoints=True)``; the vLLM connector always is) also
            stores the group's window at every this-many-th chunk boundary, so a later prompt
            sharing only the first ``j`` chunks restores up to the last checkpoint at or below
            ``j``; ``None``: only the window at the end of each saved prefix.
        promote: when a restore's hits read from a tier below the host tier (the first tier,
            when it is a host tier) are copied into it, after the restore committed and off its
            path (the engine's background task inside ``async with engine``, or
            ``run_promotions``): ``"never"`` (default), ``"second_hit"`` or ``"always"``.
        warm_budget_bytes: the bytes that warms and promotions in flight may write into the
            host tier together (an int or ``"2GiB"``); ``None``: a quarter of its capacity.
        warm_concurrency: warms and promotions running at once (another warm is refused as
            ``"busy"``).

    Every ``*_s`` option is at most :data:`bsr._check.MAX_SECONDS` (2,147,483 s, about 24.8
    days: the longest timeout a socket or ``poll()`` takes); a larger value, infinity or NaN is
    a ConfigError naming its key.
    """

    options_name = "an engine config"

    window: int = option(check_window, 8)
    io_depth: int = option(Check.positive_int, 4)
    memory_workers: int = option(Check.positive_int, 1)
    policy: str = option(Check.one_of(*(p.value for p in Policy)), Policy.ALL_OR_NOTHING.value)
    deadline_s: float | None = option(Check.optional_seconds, None)
    probe_share: float = option(check_share, 0.5)
    pin_staging: bool = option(Check.flag, True)
    prefault_staging: bool = option(Check.flag, True)
    breaker_threshold: int | None = option(Check.optional_positive_int, 3)
    breaker_cooldown_s: float = option(Check.non_negative_seconds, 5.0)
    shield_timeout_s: float = option(Check.seconds, 5.0)
    staging_budget_bytes: int | None = option(Check.optional_size, None)
    window_checkpoint_chunks: int | None = option(
        Check.optional_positive_int, DEFAULT_WINDOW_CHECKPOINT_CHUNKS
    )
    promote: str = option(Check.one_of(*(p.value for p in Promote)), Promote.NEVER.value)
    warm_budget_bytes: int | None = option(Check.optional_size, None)
    warm_concurrency: int = option(Check.positive_int, 2)

    def validate(self) -> None:
        if self.io_depth > self.window:
            raise ConfigError(
                f"io_depth: must be at most window={self.window} (more reads in flight than "
                f"staging slots cannot help), got {self.io_depth}; lower io_depth or raise window",
                key="io_depth",
            )

    def engine_options(self) -> EngineOptions:
        """These knobs alone, as an :class:`EngineOptions` (of an ``EngineConfig`` too)."""
        if type(self) is EngineOptions:
            return self
        return EngineOptions(**knobs(self))


def knobs(options: EngineOptions) -> dict[str, Any]:
    """The knobs of ``options`` (an EngineOptions or an EngineConfig) by name."""
    return {name: getattr(options, name) for name in option_fields(EngineOptions)}


@dataclass(frozen=True, kw_only=True)
class EngineArguments(EngineOptions):
    """What ``RestoreEngine.__init__`` takes: the engine's own arguments and every knob of
    :class:`EngineOptions` (checked by its parsers when constructed).

    Attributes:
        layout: the model's state layout.
        tiers: tiers fastest first (e.g. ``[HostTier(...), FileTier(...)]``); restore falls back
            down this list, save writes through to all of them.
        namespace: model id, tp rank/size, salt; keys are disjoint across namespaces.
        coordinator: cross-rank agreement (default: single rank).
        options: knobs given as one :class:`EngineOptions` (or an ``EngineConfig``); a knob also
            given by name overrides its value there.
    """

    layout: StateLayout = dataclasses.field(kw_only=False)
    tiers: Sequence[Tier] = dataclasses.field(kw_only=False)
    _: KW_ONLY
    namespace: Namespace
    coordinator: Coordinator | None = None
    options: EngineOptions | None = None


E = TypeVar("E")
P = ParamSpec("P")


def takes_options(
    arguments: Callable[P, EngineArguments],
) -> Callable[[Callable[[E, EngineArguments], None]], Callable[Concatenate[E, P], None]]:
    """Decorate ``RestoreEngine.__init__(self, args)`` so the engine takes ``arguments``'
    fields as its own parameters (the engine's counterpart of :func:`bsr.takes_options`).

    ``inspect.signature`` and type checkers see them; the decorated ``__init__`` gets one
    checked :class:`EngineArguments`, whose knobs are those of ``options=`` (when given)
    overridden by the knobs given by name.
    """

    def decorate(init: Callable[[E, EngineArguments], None]) -> Callable[Concatenate[E, P], None]:
        def __init__(self: E, /, *args: P.args, **kwargs: P.kwargs) -> None:
            given = kwargs.get("options")
            if given is not None:
                if not isinstance(given, EngineOptions):
                    raise ConfigError(
                        "options must be a bsr.EngineOptions (or a bsr.EngineConfig), got "
                        f"{type(given).__name__} {short_repr(given)}",
                        key="options",
                    )
                build: Callable[..., EngineArguments] = arguments
                merged = {**knobs(given), **kwargs, "options": given.engine_options()}
                return init(self, build(*args, **merged))
            init(self, arguments(*args, **kwargs))

        params = inspect.signature(arguments).parameters.values()
        me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        __init__.__signature__ = inspect.Signature([me, *params])  # type: ignore[attr-defined]
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(__init__, attr, getattr(init, attr))
        return __init__

    return decorate


def check_tiers(tiers: Any) -> list[Tier]:
    """The engine's tiers: a non-empty sequence of Tier objects with unique names."""
    from ..tiers._base import Tier

    out = list(tiers)
    if not out or not all(isinstance(t, Tier) for t in out):
        raise ConfigError("tiers must be a non-empty list of Tier objects, fastest first")
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"tier names must be unique, got {names}; pass name=... to each tier")
    return out


def check_budget(options: EngineOptions, slot_bytes: int) -> None:
    """The staging window (W slots of ``slot_bytes``) must fit in ``staging_budget_bytes``."""
    budget, window = options.staging_budget_bytes, options.window
    if budget is not None and window * slot_bytes > budget:
        raise ConfigError(
            f"the window needs {window * slot_bytes} bytes of staging ({window} slots of "
            f"{slot_bytes}) but staging_budget_bytes is {budget}; lower window "
            f"to at most {budget // slot_bytes} or raise the budget",
            key="staging_budget_bytes",
            window=window,
        )


def check_coordinator(coordinator: Coordinator | None, namespace: Namespace) -> Coordinator:
    """The engine's coordinator (default: a single rank's), of the namespace's rank and size."""
    from ._coordinator import LocalCoordinator

    c = LocalCoordinator() if coordinator is None else coordinator
    if c.world_size != namespace.tp_size or c.rank != namespace.tp_rank:
        raise ConfigError(
            f"coordinator is rank {c.rank} of {c.world_size} but the namespace says "
            f"tp_rank={namespace.tp_rank}, tp_size={namespace.tp_size}; make them agree"
        )
    return c
