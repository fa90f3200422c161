"""EngineConfig: one typed, validated description of a RestoreEngine and its tiers.

Where it runs: wherever an engine is built from configuration (a server's startup code, the
``bsr`` CLI, the vLLM connector). Pure parsing and validation, no I/O except reading a TOML file.

How it works: :meth:`EngineConfig.from_dict` is the one parser. :meth:`~EngineConfig.from_toml`
reads a file (a ``[bsr]`` table, or the top level) and :meth:`~EngineConfig.from_env` reads
``BSR_*`` environment variables, and both hand a plain dict to ``from_dict``. Every key is
checked by a small parser named in the field's metadata; an unknown key is an error with a
close-match suggestion, and every error is a :class:`~bsr.ConfigError` naming the dotted key
(``tiers[1].capacity_bytes``) and what to write instead. Every option, of the engine and of
each tier kind, is an ``option(...)`` field checked by one parser of the vocabulary in
:mod:`bsr._check`; the engine's and the tiers' constructors use the same parsers, so a config
and a constructor accept exactly the same values. Tier entries are dicts with a ``kind`` whose
other keys are the fields of that kind's :class:`~bsr.TierOptions` class, found in the tier
registry (:mod:`bsr.tiers._registry`: built-in kinds ``"host"``, ``"file"``, ``"mooncake"``,
kinds added with :func:`~bsr.register_tier`, and installed ``bsr.tiers`` entry points such as
``"redis"``). This module builds nothing: ``RestoreEngine.from_config`` (in ``_engine``) turns a
config into an engine, so the config never imports the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._check import Check, check_options, fs_path, option, parse_options, positive_int, short_repr
from .._errors import ConfigError
from ..core._keys import Namespace
from ..core._layout import StateLayout, utf8_name
from ..core._options import Promote
from ..core._results import Policy
from ..tiers._base import Tier
from ..tiers._registry import TierOptions, tier_options

#: a config file larger than this is refused before parsing (a config is a few lines)
MAX_CONFIG_BYTES = 1 << 20
#: a sliding-window group's window checkpoints, in chunks (see ``EngineConfig``): the bench's
#: hybrid section measures bytes stored and read against the hits each interval keeps
DEFAULT_WINDOW_CHECKPOINT_CHUNKS = 4
#: the largest window (W) a config accepts: more slots than a 16M-token request has 256-token
#: chunks cannot be used; the engine also checks W x slot bytes against the host's memory
MAX_WINDOW = 1 << 16


def _err(key: str, message: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}: {message}, got {short_repr(value)}", key=key)


def check_window(value: Any, key: str) -> int:
    """W: a positive int, at most :data:`MAX_WINDOW`."""
    return positive_int(value, key, maximum=MAX_WINDOW, key=key)


# --------------------------------------------------------------------- tiers
def _tier(value: Any, key: str) -> TierOptions:
    if isinstance(value, TierOptions):
        return value
    if not isinstance(value, Mapping):
        raise _err(key, 'must be a table/dict such as {"kind": "file", "path": ...}', value)
    kind = value.get("kind")
    if not isinstance(kind, str):
        raise _err(f"{key}.kind", "must name a tier kind such as 'host' or 'file'", kind)
    try:
        cls = tier_options(kind)
    except ConfigError as exc:  # keeps what it names (a plugin's kind and module)
        fields = {**exc.fields, "key": f"{key}.kind"}
        raise ConfigError(f"{key}.kind: {exc.message}", **fields) from exc.__cause__
    return cls.from_dict({k: v for k, v in value.items() if k != "kind"}, f"{key}.")


def _tiers(value: Any, key: str) -> tuple[TierOptions, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _err(key, "must be a list of tier tables, fastest first", value)
    if not value:
        raise ConfigError(f"{key} must name at least one tier, fastest first", key=key)
    tiers = tuple(_tier(t, f"{key}[{i}]") for i, t in enumerate(value))
    seen: dict[str, int] = {}
    for i, t in enumerate(tiers):
        name = getattr(t, "name", None)
        if not isinstance(name, str):
            raise ConfigError(
                f"{key}[{i}]: the {t.kind!r} options have no name field; every tier kind needs "
                "one (engines need unique tier names)",
                key=f"{key}[{i}]",
            )
        if name in seen:
            raise ConfigError(
                f"{key}[{i}].name: {name!r} is already the name of {key}[{seen[name]}]; "
                "give every tier its own name",
                key=f"{key}[{i}].name",
            )
        seen[name] = i
    return tiers


# --------------------------------------------------------------------- the config
@dataclass(frozen=True)
class EngineConfig:
    """How to build a :class:`~bsr.RestoreEngine` (tiers and knobs), validated once.

    Attributes:
        tiers: tier configs, fastest first (see the module docstring for the dict form).
        window: W, the number of staging slots.
        io_depth: reads in flight per restore (``1 <= io_depth <= window``).
        memory_workers: worker threads one restore uses at once to verify and copy chunks into
            a host cache when no thread waits on a read: chunks whose first holder is a
            memory-speed tier (a HostTier), or whose first holder is one FileTier reading
            through io_uring, where each thread keeps a read in flight per slot it holds (at
            most ``io_depth``). That work is bound by memory bandwidth, not by a device's
            queue: on a small host a second thread adds CPU and little speed, so the default is
            1; raise it where cores and memory bandwidth are spare and restore wall time matters
            more than CPU.
        chunk_tokens: tokens per chunk; ``None`` takes the layout's. When both are given they
            must agree.
        policy: default commit policy, ``"all_or_nothing"``, ``"truncate"`` or ``"cost"``.
        deadline_s: default per-restore deadline in seconds (``None``: none).
        breaker_threshold: consecutive tier failures that trip its breaker (``None``: never).
        breaker_cooldown_s: how long a tripped tier is skipped.
        pin_staging: pinned staging memory when CUDA is available.
        prefault_staging: touch the staging window at open.
        model_id: the namespace's model id, used when no namespace is passed.
        tenant: optional tenant name; its UTF-8 bytes salt the namespace.
        window_checkpoint_chunks: a sliding-window group's *window checkpoints*: a save asked
            for them (``save(..., window_checkpoints=True)``; the vLLM connector always is) also
            stores the group's window at every this-many-th chunk boundary, so a later prompt
            sharing only the first ``j`` chunks restores up to the last checkpoint at or below
            ``j``; ``None``: only the window at the end of each saved prefix.
        shield_timeout_s: the bound on the calls bsr makes for its own sake: moving a corrupt
            object out of its tier, waiting for device copies that still read staging slots,
            closing a tier (see ``RestoreEngine``).
        staging_budget_bytes: host staging the engine may use (an int or ``"512MiB"``). The
            window must fit in it (else a ConfigError when the engine is built); a whole-plan
            restore whose plan exceeds it ends Invalidated (``staging_budget``). ``None``: no
            budget.
        promote: when a restore's hits read from a tier below the host tier (the first tier,
            when it is a ``"host"`` tier) are copied into it, after the restore committed and
            off its path: ``"never"`` (default), ``"second_hit"`` or ``"always"``.
        warm_budget_bytes: the bytes that warms and promotions in flight may write into the
            host tier together (an int or ``"2GiB"``); ``None``: a quarter of its capacity.
        warm_concurrency: warms and promotions running at once (another warm is refused as
            ``"busy"``).

    Every ``*_s`` option, of the engine and of each tier kind, is at most
    :data:`bsr._check.MAX_SECONDS` (2,147,483 s, about 24.8 days: the longest timeout a socket
    or ``poll()`` takes); a larger value, infinity or NaN is a ConfigError naming its key.
    """

    tiers: tuple[TierOptions, ...] = option(_tiers)
    window: int = option(check_window, 8)
    io_depth: int = option(Check.positive_int, 4)
    memory_workers: int = option(Check.positive_int, 1)
    chunk_tokens: int | None = option(Check.optional_positive_int, None)
    policy: str = option(Check.one_of(*(p.value for p in Policy)), "all_or_nothing")
    deadline_s: float | None = option(Check.optional_seconds, None)
    breaker_threshold: int | None = option(Check.optional_positive_int, 3)
    breaker_cooldown_s: float = option(Check.non_negative_seconds, 5.0)
    pin_staging: bool = option(Check.flag, True)
    prefault_staging: bool = option(Check.flag, True)
    model_id: str | None = option(Check.optional_text, None)
    tenant: str | None = option(Check.optional_text, None)
    window_checkpoint_chunks: int | None = option(
        Check.optional_positive_int, DEFAULT_WINDOW_CHECKPOINT_CHUNKS
    )
    shield_timeout_s: float = option(Check.seconds, 5.0)
    staging_budget_bytes: int | None = option(Check.optional_size, None)
    promote: str = option(Check.one_of(*(p.value for p in Promote)), "never")
    warm_budget_bytes: int | None = option(Check.optional_size, None)
    warm_concurrency: int = option(Check.positive_int, 2)

    def __post_init__(self) -> None:
        check_options(self)  # direct construction is checked exactly like from_dict
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
        return cls(**parse_options(cls, data))

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
                    known = [prefix + n.upper() for n in fields]
                    raise ConfigError(
                        f"unknown variable {var!r}; known variables: {', '.join(known)}", key=var
                    )
                continue
            if fields[name].metadata["string"]:
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
                out["tiers"] = [t.to_dict() for t in self.tiers]
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


def check_window_memory(window: int, layout: StateLayout) -> None:
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
