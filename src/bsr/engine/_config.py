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
:mod:`bsr._check`. The engine's knobs are the fields of :class:`~bsr.EngineOptions`, which
``EngineConfig`` inherits and ``RestoreEngine``'s constructor takes (see
:mod:`bsr.engine._options`); the tiers' constructors take their options classes' fields the same
way, so a config and a constructor accept exactly the same values. Tier entries are dicts with
a ``kind`` whose other keys are the fields of that kind's :class:`~bsr.TierOptions` class, found
in the tier registry (:mod:`bsr.tiers._registry`: built-in kinds ``"host"``, ``"file"``,
``"mooncake"``, kinds added with :func:`~bsr.register_tier`, and installed ``bsr.tiers`` entry
points such as ``"redis"``). This module builds nothing: ``RestoreEngine.from_config`` (its
checks in ``_from_config``) turns a config into an engine, so the config never imports the
engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Self

from .._check import Check, fs_path, option, short_repr
from .._errors import ConfigError
from ..core._keys import Namespace
from ..core._layout import utf8_name
from ..tiers._base import Tier
from ..tiers._registry import TierOptions, tier_options
from ._options import EngineOptions

#: a config file larger than this is refused before parsing (a config is a few lines)
MAX_CONFIG_BYTES = 1 << 20


def _err(key: str, message: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}: {message}, got {short_repr(value)}", key=key)


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
class EngineConfig(EngineOptions):
    """How to build a :class:`~bsr.RestoreEngine`: its tiers, its namespace's identity and its
    knobs (the fields of :class:`~bsr.EngineOptions`, inherited: ``window``, ``io_depth``,
    ``policy``, ...), validated once.

    Attributes:
        tiers: tier configs, fastest first (see the module docstring for the dict form).
        chunk_tokens: tokens per chunk; ``None`` takes the layout's. When both are given they
            must agree.
        model_id: the namespace's model id, used when no namespace is passed.
        tenant: optional tenant name; its UTF-8 bytes salt the namespace.

    Every knob is documented in :class:`~bsr.EngineOptions`, and checked by the same parser
    here (from a dict, a TOML file, the environment or direct construction) as in the engine's
    constructor.
    """

    tiers: tuple[TierOptions, ...] = option(_tiers)
    _: KW_ONLY
    chunk_tokens: int | None = option(Check.optional_positive_int, None)
    model_id: str | None = option(Check.optional_text, None)
    tenant: str | None = option(Check.optional_text, None)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str | None = None) -> Self:
        """Parse a plain dict (the ``to_dict`` form; sizes may be strings like ``"64GiB"``)."""
        return super().from_dict(data, prefix)

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
        knobs = {k: v for k, v in super().to_dict().items() if k != "tiers"}
        return {"tiers": [t.to_dict() for t in self.tiers], **knobs}

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
