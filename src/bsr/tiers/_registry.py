"""Tier kinds: one typed options class per tier, found by its kind name.

Where it runs: wherever tiers are built from configuration (``EngineConfig``, the CLI).

How it works (after fsspec's registry): a tier kind (``"host"``, ``"file"``, ``"redis"``...)
names a :class:`TierOptions` subclass, a frozen dataclass whose fields are the tier's options,
each checked by a parser of the option vocabulary (``option(Check.size)``), and whose
:meth:`~TierOptions.build` makes the tier. The tier's constructor checks its arguments through
the same class, so a constructor and a config can never disagree: :func:`takes_options` makes
the constructor's signature the options class's own, so the options are declared once. Kinds are
looked up in order:

1. kinds registered in this process with :func:`register_tier`;
2. bsr's built-in kinds, each imported only when first asked for (a config naming no Mooncake
   tier never imports the Mooncake module);
3. the ``bsr.tiers`` entry point group: a package declares
   ``[project.entry-points."bsr.tiers"] mykind = "mypkg.tier:MyTierOptions"`` and its kind works
   in every config once it is installed, loaded on first use. bsr's own ``redis`` kind
   (:mod:`bsr.redis`) is declared this way, as any third party would.

Plugins never take a built-in kind: the kinds bsr provides (:data:`RESERVED_KINDS`: ``host``,
``file``, ``mooncake`` and bsr's own entry point ``redis``) are bsr's wherever the packages lie
on ``sys.path``. An entry point of another package naming one of them is refused: ignored, with
a ``UserWarning`` (and a ``bsr.tiers.plugin_refused`` log event) naming the package, so a
config's ``"file"`` always means bsr's FileTier. Only this process's own code may replace a
kind, explicitly: ``register_tier("file", ..., replace=True)``. Two other packages declaring one
kind make that kind a ConfigError naming both (neither is chosen silently), and a package whose
metadata cannot be read is skipped with a warning. A plugin's module is third-party code run at
import: whatever it raises there (any ``BaseException`` but ``KeyboardInterrupt``, so
``SystemExit`` too) is a :class:`~bsr.ConfigError` naming the kind and the module, from
:func:`register_tier`, :func:`tier_options` and ``EngineConfig`` alike.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

from .._check import Options, short_repr
from .._errors import ConfigError
from .._log import logger
from .._version import DISTRIBUTION
from ._base import Tier

#: the entry point group third-party tier kinds are declared in
ENTRY_POINT_GROUP = "bsr.tiers"

#: bsr's own kinds, imported lazily by name
BUILTIN_TIERS: dict[str, str] = {
    "host": "bsr.tiers._host:HostTierOptions",
    "file": "bsr.tiers.file:FileTierOptions",
    "striped_file": "bsr.tiers.file:StripedFileTierOptions",
    "mooncake": "bsr.tiers._mooncake:MooncakeTierOptions",
}
#: the distribution bsr is installed as, ``bsr-kv`` (its entry points are bsr's own kinds)
OWN_DISTRIBUTION = DISTRIBUTION
#: kinds only bsr provides: the built-in ones and those bsr declares as entry points itself
#: (``redis``); an entry point of another package naming one is refused with a warning
RESERVED_KINDS = frozenset({*BUILTIN_TIERS, "redis"})

OptionsT = TypeVar("OptionsT", bound="TierOptions")
TierT = TypeVar("TierT", bound=Tier)
P = ParamSpec("P")


@dataclasses.dataclass(frozen=True)
class TierOptions(Options):
    """Base of a tier kind's options: a frozen dataclass of ``option(...)`` fields.

    A subclass sets ``kind``, declares its fields (a ``name`` field is expected: engines need
    unique tier names) and implements :meth:`build`. Direct construction checks every field
    (``__post_init__``); :meth:`from_dict` also refuses unknown keys (see :class:`~bsr.Options`).
    Override :meth:`validate` for rules across fields (raise a ConfigError naming one key).
    """

    kind: ClassVar[str] = ""
    options_other_keys: ClassVar[tuple[str, ...]] = ("kind",)

    def build(self) -> Tier:
        """A new, unopened tier with these options."""
        raise NotImplementedError(f"{type(self).__name__}.build() is not implemented")

    def for_rank(self: OptionsT, rank: int, world: int) -> OptionsT:
        """The options of tensor-parallel rank ``rank``'s instance of this tier (of ``world``
        ranks, each serving its own shard in its own process). Default: these options, shared
        (a store that every process may use at once: objects are keyed by rank anyway). A tier
        that one process must own (a local directory) gives each rank its own place."""
        return self

    def arguments(self) -> dict[str, Any]:
        """Every option by name: the keyword arguments of the tier's constructor, which takes
        the same options (``build`` is then ``MyTier(**self.arguments())``)."""
        return super().to_dict()

    def to_dict(self) -> dict[str, Any]:
        """The plain form (``kind`` first); ``tier_options(kind).from_dict`` reads it back."""
        return {"kind": self.kind, **self.arguments()}


def takes_options(
    options: Callable[P, OptionsT],
) -> Callable[[Callable[[TierT, OptionsT], None]], Callable[Concatenate[TierT, P], None]]:
    """Decorate a tier's ``__init__(self, options)`` so the tier takes its options class's
    fields as its own parameters: the options are declared once, in the options class.

    ``MyTier(address, timeout_s=3)`` builds ``MyTierOptions(address, timeout_s=3)`` (every value
    checked, a bad one refused with the ConfigError naming its key) and hands it to the
    decorated ``__init__``. Type checkers see the constructor's parameters as the options
    class's (a ``ParamSpec``), and ``inspect.signature`` (help, IDEs, docs) shows them too.
    Fields after ``_: dataclasses.KW_ONLY`` are keyword-only in both::

        @dataclass(frozen=True)
        class KvTierOptions(bsr.TierOptions):
            kind = "kv"
            address: str = bsr.option(bsr.Check.address)
            _: dataclasses.KW_ONLY
            name: str = bsr.option(bsr.Check.text, "kv")

        class KvTier(bsr.Tier):
            @bsr.takes_options(KvTierOptions)
            def __init__(self, options: KvTierOptions) -> None:
                self.options = options
                super().__init__(options.name)
    """

    def decorate(init: Callable[[TierT, OptionsT], None]) -> Callable[Concatenate[TierT, P], None]:
        def __init__(self: TierT, /, *args: P.args, **kwargs: P.kwargs) -> None:
            init(self, options(*args, **kwargs))

        params = inspect.signature(options).parameters.values()
        me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        __init__.__signature__ = inspect.Signature([me, *params])  # type: ignore[attr-defined]
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(__init__, attr, getattr(init, attr))
        return __init__

    return decorate


_lock = threading.Lock()
_registered: dict[str, type[TierOptions]] = {}


def register_tier(kind: str, options: type[TierOptions] | str, *, replace: bool = False) -> None:
    """Add a tier kind: ``options`` is its TierOptions class, or ``"module:Class"`` (imported on
    first use).

    Raises:
        ConfigError: ``kind`` is taken (pass ``replace=True`` to override it) or ``options`` is
            not a TierOptions subclass.
    """
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ConfigError(f"a tier kind must be an identifier like 'redis', got {short_repr(kind)}")
    cls = _import(kind, options) if isinstance(options, str) else options
    if not (isinstance(cls, type) and issubclass(cls, TierOptions)):
        raise ConfigError(
            f"tier kind {kind!r}: {short_repr(cls)} is not a bsr.TierOptions subclass"
        )
    with _lock:
        if not replace and (kind in _registered or kind in BUILTIN_TIERS):
            raise ConfigError(
                f"tier kind {kind!r} is already registered; pass replace=True to override it"
            )
        _registered[kind] = cls


def unregister_tier(kind: str) -> None:
    """Remove a kind added with :func:`register_tier` (built-ins come back)."""
    with _lock:
        _registered.pop(kind, None)


def _import(kind: str, target: str) -> type[TierOptions]:
    """Import ``"module:Class"`` for ``kind``; whatever goes wrong is a ConfigError naming both.

    A plugin's module is third-party code: at import it may raise anything (an ImportError of
    its own dependency, a RuntimeError, a SyntaxError in its source, even ``SystemExit`` from a
    ``sys.exit()`` at module level), and its module may refuse the attribute with something
    other than AttributeError. All of it but ``KeyboardInterrupt`` (the user's own Ctrl-C) is a
    ConfigError here: a config naming a broken plugin must not end the process.
    """
    module, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"tier kind {kind!r} needs {module}, which cannot be imported: {_describe(exc)}",
            kind=kind,
            module=module,
        ) from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the module itself failed while importing (SystemExit too)
        raise ConfigError(
            f"tier kind {kind!r}: importing {module} failed ({_describe(exc)}); fix or "
            "reinstall the package that provides it, or remove the kind from the config",
            kind=kind,
            module=module,
        ) from exc
    try:
        cls = getattr(mod, attr)
    except AttributeError:
        raise ConfigError(
            f"tier kind {kind!r}: {module} has no {attr}", kind=kind, module=module
        ) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a module-level __getattr__ that raised something else
        raise ConfigError(
            f"tier kind {kind!r}: reading {attr} from {module} failed ({_describe(exc)})",
            kind=kind,
            module=module,
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, TierOptions)):
        raise ConfigError(
            f"tier kind {kind!r}: {target} is not a bsr.TierOptions subclass",
            kind=kind,
            module=module,
        )
    return cls


def _describe(exc: BaseException) -> str:
    """``"Type: text"`` of a third party's exception, bounded (its ``__str__`` may be huge, or
    raise)."""
    try:
        text = str(exc)
    except Exception:
        text = "(its message cannot be shown)"
    text = text if len(text) <= 200 else f"{text[:200]}...({len(text)} characters)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _normalized(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _refused(message: str, **fields: Any) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)
    logger.warning("bsr.tiers.plugin_refused", reason=message, **fields)


#: an installed kind: the distributions declaring it and their entry points (one, unless two
#: packages claim the kind)
_Declared = list[tuple[str, metadata.EntryPoint]]


def _entry_points() -> dict[str, _Declared]:
    """The ``bsr.tiers`` entry points of the installed distributions, by kind.

    Each distribution counts once (the first on ``sys.path``, as importlib.metadata does). An
    entry point of another package naming a reserved kind is dropped with a warning; a
    package whose metadata cannot be read is skipped with a warning (a damaged
    ``entry_points.txt`` of one unrelated package must not break every config).
    """
    seen: set[str] = set()
    out: dict[str, _Declared] = {}
    for dist in metadata.distributions():
        try:
            key = getattr(dist, "_normalized_name", None)  # from the path: no file read
            if not isinstance(key, str):
                key = _normalized(str(dist.metadata["Name"] or ""))
            if key in seen:
                continue
            seen.add(key)
            eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
            name = str(dist.metadata["Name"] or key) if eps else key
            key = _normalized(name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            where = str(getattr(dist, "_path", None) or repr(dist))
            where = where if len(where) <= 300 else f"...{where[-300:]}"
            _refused(
                f"bsr: skipped the installed package at {where}: its metadata cannot be read "
                f"({_describe(exc)}); reinstall or remove it",
                distribution=where,
            )
            continue
        for ep in eps:
            if ep.name in RESERVED_KINDS and key != OWN_DISTRIBUTION:
                _refused(
                    f"bsr: ignored the entry point {ep.name} = {ep.value!r} of the package "
                    f"{name!r}: {ep.name!r} is a built-in bsr tier kind, which a plugin cannot "
                    "replace; the plugin should declare a kind of its own name (or register it "
                    f"in code with bsr.register_tier({ep.name!r}, ..., replace=True))",
                    kind=ep.name,
                    distribution=name,
                )
                continue
            out.setdefault(ep.name, []).append((name, ep))
    return out


def tier_kinds() -> list[str]:
    """Every kind a config may name: registered, built-in and installed (entry points)."""
    with _lock:
        kinds = set(_registered) | set(BUILTIN_TIERS)
    return sorted(kinds | set(_entry_points()))


def tier_options(kind: str) -> type[TierOptions]:
    """The options class of ``kind`` (imported on first use).

    Raises:
        ConfigError: no such kind (the message lists the known ones), or its module fails to
            import.
    """
    if not isinstance(kind, str):
        raise ConfigError(f"a tier kind is a string such as 'file', got {short_repr(kind)}")
    with _lock:
        cls = _registered.get(kind)
        known = set(_registered) | set(BUILTIN_TIERS)
    if cls is not None:
        return cls
    installed = _entry_points()  # also warns of a package declaring a built-in kind
    if kind in BUILTIN_TIERS:
        return _import(kind, BUILTIN_TIERS[kind])
    declared = installed.get(kind)
    if not declared:
        known |= set(installed)
        raise ConfigError(f"unknown tier kind {short_repr(kind)}; known kinds: {sorted(known)}")
    if len(declared) > 1:
        who = "; ".join(f"{dist!r} ({ep.value})" for dist, ep in declared)
        raise ConfigError(
            f"tier kind {kind!r} is declared by {len(declared)} installed packages: {who}; "
            "uninstall all but one, or choose one in code with "
            f"bsr.register_tier({kind!r}, 'module:Class')",
            kind=kind,
        )
    # not cached as registered: every lookup sees what is installed now (and warns of an
    # impostor); the module itself is imported once (sys.modules)
    return _import(kind, declared[0][1].value)
