"""EngineConfig: one typed, validated description of a RestoreEngine and its tiers.

Where it runs: wherever an engine is built from configuration (a server's startup code, the
``bsr`` CLI, the vLLM connector). Pure parsing and validation, no I/O except reading a TOML file.

How it works: :meth:`EngineConfig.from_dict` is the one parser. :meth:`~EngineConfig.from_toml`
reads a file (a ``[bsr]`` table, or the top level) and :meth:`~EngineConfig.from_env` reads
``BSR_*`` environment variables, and both hand a plain dict to ``from_dict``. Every key is
checked by a small parser named in the field's metadata; an unknown key is an error with a
close-match suggestion, and every error is a :class:`~bsr.ConfigError` naming the dotted key
(``tiers[1].capacity_bytes``) and what to write instead. Tier entries are dicts with a ``kind``
(``"host"``, ``"file"``, ``"mooncake"``) whose other keys are the constructor arguments of
:class:`~bsr.HostTier`, :class:`~bsr.FileTier` and :class:`~bsr.MooncakeTier`.
:func:`engine_from_config` (behind ``RestoreEngine.from_config``) builds the tiers and the engine.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .._check import (
    byte_size,
    fs_path,
    non_negative_float,
    non_negative_int,
    optional_positive_float,
    positive_float,
    positive_int,
    short_repr,
    text,
)
from .._errors import ConfigError
from ..core._keys import Namespace
from ..core._layout import StateLayout, utf8_name
from ..core._results import Policy
from ..tiers._base import Tier

if TYPE_CHECKING:
    from ._coordinator import Coordinator
    from ._engine import RestoreEngine

Parser = Callable[[Any, str], Any]


# --------------------------------------------------------------------- value parsers
# Each parser takes (value, key) and returns the normalised value or raises a ConfigError naming
# the key; the checks themselves live in bsr._check, the vocabulary every constructor uses.

#: a config file larger than this is refused before parsing (a config is a few lines)
MAX_CONFIG_BYTES = 1 << 20
#: the largest window (W) a config accepts: more slots than a 16M-token request has 256-token
#: chunks cannot be used; the engine also checks W x slot bytes against the host's memory
MAX_WINDOW = 1 << 16


def _err(key: str, message: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}: {message}, got {short_repr(value)}", key=key)


def _size(value: Any, key: str) -> int:
    return byte_size(value, key, key=key)


def _opt_size(value: Any, key: str) -> int | None:
    return None if value is None else _size(value, key)


def _pos_int(value: Any, key: str) -> int:
    return positive_int(value, key, key=key)


def _window(value: Any, key: str) -> int:
    return positive_int(value, key, maximum=MAX_WINDOW, key=key)


def _nonneg_int(value: Any, key: str) -> int:
    return non_negative_int(value, key, key=key)


def _opt_pos_int(value: Any, key: str) -> int | None:
    return None if value is None else _pos_int(value, key)


def _pos_float(value: Any, key: str) -> float:
    return positive_float(value, f"{key} (seconds)", key=key)


def _nonneg_float(value: Any, key: str) -> float:
    return non_negative_float(value, f"{key} (seconds)", key=key)


def _opt_pos_float(value: Any, key: str) -> float | None:
    return optional_positive_float(value, f"{key} (seconds)", key=key)


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise _err(key, "must be true or false", value)
    return value


def _str(value: Any, key: str) -> str:
    return text(value, key, key=key)


def _opt_str(value: Any, key: str) -> str | None:
    return None if value is None else _str(value, key)


def _policy(value: Any, key: str) -> str:
    options = [p.value for p in Policy]
    if isinstance(value, Policy):
        return value.value
    if value not in options:
        raise _err(key, f"must be one of {options}", value)
    return str(value)


def _address(value: Any, key: str) -> str | None:
    if value is None:
        return None
    from ..tiers._mooncake import _parse_address  # the check MooncakeTier itself makes

    try:
        _parse_address(key, _str(value, key))
    except ConfigError as exc:
        raise ConfigError(exc.message.replace(f"MooncakeTier.{key}", key), key=key) from None
    return str(value)


def _protocol(value: Any, key: str) -> str:
    options = ["tcp", "rdma"]
    if value not in options:
        raise _err(key, f"must be one of {options}", value)
    return str(value)


def _path(value: Any, key: str) -> str:
    return fs_path(value, key, key=key)


def _reader(value: Any, key: str) -> str:
    options = ["auto", "uring", "posix", "kvikio"]
    if value not in options:
        raise _err(key, f"must be one of {options}", value)
    return str(value)


def _str_or_blank(value: Any, key: str) -> str:
    return "" if value == "" else _str(value, key)


def _size_or_zero(value: Any, key: str) -> int:
    return 0 if value == 0 else _size(value, key)


def _validate(obj: Any) -> None:
    """Run every field's parser on a directly constructed config (same checks as from_dict)."""
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, f.metadata["parse"](getattr(obj, f.name), f.name))


def _opt(parser: Parser) -> dict[str, Any]:
    return {"parse": parser}


#: parsers that take a string as it is (environment values are not JSON-decoded for them)
_STRING_PARSERS: frozenset[Parser] = frozenset(
    {_str, _opt_str, _str_or_blank, _policy, _path, _reader, _address, _protocol}
)


# --------------------------------------------------------------------- tier configs
@dataclass(frozen=True)
class HostTierConfig:
    """A :class:`~bsr.HostTier`: ``{"kind": "host", "capacity_bytes": "8GiB", "name": "host"}``."""

    kind: ClassVar[str] = "host"
    capacity_bytes: int = field(metadata=_opt(_size))
    name: str = field(default="host", metadata=_opt(_str))

    def __post_init__(self) -> None:
        _validate(self)

    def build(self) -> Tier:
        from ..tiers._host import HostTier

        return HostTier(self.capacity_bytes, name=self.name)


@dataclass(frozen=True)
class FileTierConfig:
    """A :class:`~bsr.FileTier`: ``{"kind": "file", "path": "/nvme/bsr", "capacity_bytes": N}``."""

    kind: ClassVar[str] = "file"
    path: str = field(metadata=_opt(_path))
    capacity_bytes: int = field(metadata=_opt(_size))
    name: str = field(default="file", metadata=_opt(_str))
    reader: str = field(default="auto", metadata=_opt(_reader))
    direct_io: bool = field(default=False, metadata=_opt(_bool))
    fsync: bool = field(default=True, metadata=_opt(_bool))
    io_threads: int = field(default=8, metadata=_opt(_pos_int))
    #: io_uring requests in flight; 0: chosen by the tier (calibrated on open)
    read_depth: int = field(default=0, metadata=_opt(_nonneg_int))

    def __post_init__(self) -> None:
        _validate(self)

    def build(self) -> Tier:
        from ..tiers._file import FileTier

        return FileTier(
            self.path,
            self.capacity_bytes,
            name=self.name,
            reader=self.reader,
            direct_io=self.direct_io,
            fsync=self.fsync,
            io_threads=self.io_threads,
            read_depth=self.read_depth or None,
        )


@dataclass(frozen=True)
class MooncakeTierConfig:
    """A :class:`~bsr.MooncakeTier`: ``{"kind": "mooncake", "master_address": "host:port"}``."""

    kind: ClassVar[str] = "mooncake"
    name: str = field(default="mooncake", metadata=_opt(_str))
    master_address: str | None = field(default=None, metadata=_opt(_address))
    client_address: str | None = field(default=None, metadata=_opt(_address))
    metadata_server: str = field(default="P2PHANDSHAKE", metadata=_opt(_str))
    protocol: str = field(default="tcp", metadata=_opt(_protocol))
    rdma_devices: str = field(default="", metadata=_opt(_str_or_blank))
    local_hostname: str = field(default="127.0.0.1", metadata=_opt(_str))
    global_segment_size: int = field(default=0, metadata=_opt(_size_or_zero))
    local_buffer_size: int = field(default=64 << 20, metadata=_opt(_size))
    timeout_s: float = field(default=5.0, metadata=_opt(_pos_float))
    open_timeout_s: float | None = field(default=None, metadata=_opt(_opt_pos_float))
    capacity_bytes: int | None = field(default=None, metadata=_opt(_opt_size))
    key_prefix: str = field(default="bsr/", metadata=_opt(_str))
    max_inflight: int = field(default=16, metadata=_opt(_pos_int))
    max_stuck_calls: int = field(default=16, metadata=_opt(_pos_int))
    bounce_min_bytes: int = field(default=1 << 20, metadata=_opt(_size))

    def __post_init__(self) -> None:
        _validate(self)
        if (self.master_address is None) == (self.client_address is None):
            raise ConfigError(
                "mooncake tier needs exactly one of master_address='host:port' (embedded client) "
                "or client_address='host:port' (a local mooncake_client)",
                key="master_address",
            )

    def build(self) -> Tier:
        from ..tiers._mooncake import MooncakeTier

        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MooncakeTier(**kw)


TierConfig = HostTierConfig | FileTierConfig | MooncakeTierConfig
_TIER_KINDS: dict[str, type[Any]] = {
    c.kind: c for c in (HostTierConfig, FileTierConfig, MooncakeTierConfig)
}


# --------------------------------------------------------------------- generic dataclass parsing
def _unknown(key: str, name: str, known: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return ConfigError(f"unknown key {key!r}{hint}", key=key)


def _parse_fields(
    cls: type[Any], data: Mapping[str, Any], prefix: str, skip: Sequence[str] = ()
) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    out: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise _unknown(key, str(name), list(fields) + list(skip))
        out[name] = fields[name].metadata["parse"](value, key)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in out:
            where = f"the {prefix[:-1]} table" if prefix else "the config"
            raise ConfigError(
                f"{prefix}{name} is required; add {name} = ... to {where}", key=f"{prefix}{name}"
            )
    return out


def _tier(value: Any, key: str) -> TierConfig:
    if isinstance(value, (HostTierConfig, FileTierConfig, MooncakeTierConfig)):
        return value
    if not isinstance(value, Mapping):
        raise _err(key, 'must be a table/dict such as {"kind": "file", "path": ...}', value)
    kind = value.get("kind")
    if not isinstance(kind, str) or kind not in _TIER_KINDS:
        raise _err(f"{key}.kind", f"must be one of {sorted(_TIER_KINDS)}", kind)
    cls = _TIER_KINDS[kind]
    rest = {k: v for k, v in value.items() if k != "kind"}
    kwargs = _parse_fields(cls, rest, f"{key}.", skip=("kind",))
    try:
        return cls(**kwargs)  # type: ignore[no-any-return]
    except ConfigError as exc:
        where = f"{key}.{exc.fields.get('key', 'kind')}"
        raise ConfigError(f"{where}: {exc.message}", key=where) from None


def _tiers(value: Any, key: str) -> tuple[TierConfig, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _err(key, "must be a list of tier tables, fastest first", value)
    if not value:
        raise ConfigError(f"{key} must name at least one tier, fastest first", key=key)
    tiers = tuple(_tier(t, f"{key}[{i}]") for i, t in enumerate(value))
    seen: dict[str, int] = {}
    for i, t in enumerate(tiers):
        if t.name in seen:
            raise ConfigError(
                f"{key}[{i}].name: {t.name!r} is already the name of {key}[{seen[t.name]}]; "
                "give every tier its own name",
                key=f"{key}[{i}].name",
            )
        seen[t.name] = i
    return tiers


# --------------------------------------------------------------------- the config
@dataclass(frozen=True)
class EngineConfig:
    """How to build a :class:`~bsr.RestoreEngine` (tiers and knobs), validated once.

    Attributes:
        tiers: tier configs, fastest first (see the module docstring for the dict form).
        window: W, the number of staging slots.
        io_depth: reads in flight per restore (``1 <= io_depth <= window``).
        chunk_tokens: tokens per chunk; ``None`` takes the layout's. When both are given they
            must agree.
        policy: default commit policy, ``"all_or_nothing"`` or ``"truncate"``.
        deadline_s: default per-restore deadline in seconds (``None``: none).
        breaker_threshold: consecutive tier failures that trip its breaker (``None``: never).
        breaker_cooldown_s: how long a tripped tier is skipped.
        pin_staging: pinned staging memory when CUDA is available.
        prefault_staging: touch the staging window at open.
        model_id: the namespace's model id, used when no namespace is passed.
        tenant: optional tenant name; its UTF-8 bytes salt the namespace.
    """

    tiers: tuple[TierConfig, ...] = field(metadata=_opt(_tiers))
    window: int = field(default=8, metadata=_opt(_window))
    io_depth: int = field(default=4, metadata=_opt(_pos_int))
    chunk_tokens: int | None = field(default=None, metadata=_opt(_opt_pos_int))
    policy: str = field(default="all_or_nothing", metadata=_opt(_policy))
    deadline_s: float | None = field(default=None, metadata=_opt(_opt_pos_float))
    breaker_threshold: int | None = field(default=3, metadata=_opt(_opt_pos_int))
    breaker_cooldown_s: float = field(default=5.0, metadata=_opt(_nonneg_float))
    pin_staging: bool = field(default=True, metadata=_opt(_bool))
    prefault_staging: bool = field(default=True, metadata=_opt(_bool))
    model_id: str | None = field(default=None, metadata=_opt(_opt_str))
    tenant: str | None = field(default=None, metadata=_opt(_opt_str))

    def __post_init__(self) -> None:
        _validate(self)  # direct construction is checked exactly like from_dict
        if self.io_depth > self.window:
            raise ConfigError(
                f"io_depth: must be at most window={self.window} (more reads in flight than "
                f"staging slots cannot help), got {self.io_depth}; lower io_depth or raise window",
                key="io_depth",
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Parse a plain dict (the ``to_dict`` form; sizes may be strings like ``"64GiB"``)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"an engine config must be a dict/table, got {type(data).__name__}")
        return cls(**_parse_fields(cls, data, ""))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> EngineConfig:
        """Read a TOML file: the ``[bsr]`` table if there is one, else the top level.

        Example::

            [bsr]
            window = 8
            model_id = "llama-3-8b@rev1"
            [[bsr.tiers]]
            kind = "host"
            capacity_bytes = "8GiB"
            [[bsr.tiers]]
            kind = "file"
            path = "/nvme/bsr"
            capacity_bytes = "500GiB"
        """
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
            except ModuleNotFoundError:
                raise ConfigError(
                    "reading TOML on Python 3.10 needs the tomli package; pip install tomli"
                ) from None
        p = Path(fs_path(path, "config file path"))
        try:
            with p.open("rb") as fh:
                raw = fh.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file {str(p)!r}: {exc.strerror or exc}"
            ) from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {str(p)!r} is larger than {MAX_CONFIG_BYTES} bytes; "
                "an engine config is a few lines"
            )
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {str(p)!r} is not UTF-8 text (byte {raw[exc.start]:#04x} at "
                f"offset {exc.start}); TOML files are UTF-8"
            ) from None
        except RecursionError:
            raise ConfigError(f"config file {str(p)!r} nests tables or arrays too deeply") from None
        except ValueError as exc:  # TOMLDecodeError, or an integer too long to convert
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
        if "bsr" in data:
            table = data["bsr"]
            if not isinstance(table, dict):
                raise ConfigError(f"{str(p)!r}: 'bsr' must be a table ([bsr])", key="bsr")
            data = table
        return cls.from_dict(data)

    @classmethod
    def from_env(
        cls,
        prefix: str = "BSR_",
        environ: Mapping[str, str] | None = None,
        *,
        strict: bool = False,
    ) -> EngineConfig:
        """Read ``<prefix><KEY>`` variables, e.g. ``BSR_WINDOW=8``, ``BSR_TIERS='[...]'``.

        Values are JSON (``8``, ``0.5``, ``true``, ``null``, a list of tier tables) except for
        string keys (``BSR_MODEL_ID=llama``, ``BSR_POLICY=truncate``), which are taken as they
        are; sizes may be strings (``BSR_TIERS='[{"kind": "host", "capacity_bytes": "8GiB"}]'``).

        Args:
            prefix: variable name prefix.
            environ: the environment to read (default: ``os.environ``).
            strict: reject unknown ``<prefix>*`` variables. Off by default because other tools
                share the prefix (the test suite's ``BSR_CAMPAIGN``, for example).
        """
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        data: dict[str, Any] = {}
        for var, raw in env.items():
            if not var.startswith(prefix):
                continue
            name = var[len(prefix) :].lower()
            if name not in fields:
                if strict:
                    raise _unknown(var, var, [prefix + n.upper() for n in fields])
                continue
            if fields[name].metadata["parse"] in _STRING_PARSERS:
                data[name] = raw
                continue
            try:
                data[name] = json.loads(raw)
            except RecursionError:
                raise ConfigError(f"{var}: nests lists or tables too deeply", key=var) from None
            except ValueError:  # not JSON (or an integer too long to convert)
                if name == "tiers":
                    raise ConfigError(
                        f"{var} must be a JSON list of tier tables, e.g. "
                        '\'[{"kind": "host", "capacity_bytes": "8GiB"}]\'',
                        key=var,
                    ) from None
                data[name] = raw  # e.g. a size string; the field's parser decides
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            key = exc.fields.get("key", "")
            var = prefix + key.split(".")[0].split("[")[0].upper() if key else ""
            raise ConfigError(f"{var}: {exc.message}" if var else exc.message, key=key) from None

    # ------------------------------------------------------------------ use
    def to_dict(self) -> dict[str, Any]:
        """The plain-dict form; ``EngineConfig.from_dict(c.to_dict()) == c``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "tiers":
                out["tiers"] = [
                    {"kind": t.kind, **{g.name: getattr(t, g.name) for g in dataclasses.fields(t)}}
                    for t in self.tiers
                ]
            else:
                out[f.name] = getattr(self, f.name)
        return out

    def build_tiers(self) -> list[Tier]:
        """New, unopened tier objects, fastest first."""
        return [t.build() for t in self.tiers]

    def namespace(self, *, tp_rank: int = 0, tp_size: int = 1) -> Namespace:
        """The namespace this config describes (needs ``model_id``)."""
        if self.model_id is None:
            raise ConfigError(
                "model_id: is not set and no namespace was passed; set model_id in the config "
                "(e.g. model_id = 'llama-3-8b@rev1') or pass namespace=bsr.Namespace(...)",
                key="model_id",
            )
        salt = b"" if self.tenant is None else utf8_name(self.tenant, "tenant", error=ConfigError)
        return Namespace(self.model_id, tp_rank=tp_rank, tp_size=tp_size, salt=salt)


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes (None where the OS does not say)."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def _check_window_memory(window: int, layout: StateLayout) -> None:
    """The staging window (W x slot bytes, allocated once when the engine opens) must fit in the
    host's physical memory: a larger one can only fail (ENOMEM) or swap, so it is refused here,
    naming ``window``, before anything is allocated."""
    need = window * layout.slot_bytes
    have = host_memory_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"window: {window} staging slots of {layout.slot_bytes} bytes need {need} bytes, "
            f"more than this host's {have} bytes of memory; lower window to at most "
            f"{max(1, have // layout.slot_bytes // 2)} (half the memory) or less",
            key="window",
        )


def engine_from_config(
    config: EngineConfig,
    *,
    layout: StateLayout,
    namespace: Namespace | None = None,
    coordinator: Coordinator | None = None,
) -> RestoreEngine:
    """Build a :class:`~bsr.RestoreEngine` (and its tiers) from ``config``.

    Args:
        config: the engine config.
        layout: the model's state layout.
        namespace: the namespace; default built from ``config.model_id`` and ``config.tenant``,
            with the coordinator's rank and world size.
        coordinator: cross-rank agreement (default: single rank).

    Raises:
        ConfigError: the layout's chunk size differs from ``config.chunk_tokens``, no namespace
            can be made, or the namespace disagrees with the config's ``model_id``.
    """
    from ._engine import RestoreEngine

    if not isinstance(config, EngineConfig):
        raise ConfigError(
            f"config must be a bsr.EngineConfig (use EngineConfig.from_dict), got "
            f"{type(config).__name__}"
        )
    if not isinstance(layout, StateLayout):
        raise ConfigError(f"layout must be a StateLayout, got {type(layout).__name__}")
    if config.chunk_tokens is not None and config.chunk_tokens != layout.chunk_tokens:
        raise ConfigError(
            f"chunk_tokens: the config says {short_repr(config.chunk_tokens)} but the layout has "
            f"chunk_tokens={layout.chunk_tokens}; make them agree (or leave chunk_tokens unset "
            "to take the layout's)",
            key="chunk_tokens",
        )
    _check_window_memory(config.window, layout)
    if namespace is None:
        rank = 0 if coordinator is None else coordinator.rank
        size = 1 if coordinator is None else coordinator.world_size
        namespace = config.namespace(tp_rank=rank, tp_size=size)
    elif config.model_id is not None and namespace.model_id != config.model_id:
        raise ConfigError(
            f"model_id: the config says {config.model_id!r} but namespace.model_id is "
            f"{namespace.model_id!r}; drop one or make them agree",
            key="model_id",
        )
    return RestoreEngine(
        layout,
        config.build_tiers(),
        window=config.window,
        io_depth=config.io_depth,
        namespace=namespace,
        coordinator=coordinator,
        policy=config.policy,
        deadline_s=config.deadline_s,
        pin_staging=config.pin_staging,
        prefault_staging=config.prefault_staging,
        breaker_threshold=config.breaker_threshold,
        breaker_cooldown_s=config.breaker_cooldown_s,
    )
