"""Tier plugins found through real entry points: a package installed as a dist-info directory
on a temporary ``sys.path`` entry, as pip would leave it.

The rules under test (:mod:`bsr.tiers._registry`): a plugin never takes one of bsr's own kinds
(``host``, ``file``, ``mooncake``, ``redis``), wherever it lies on ``sys.path`` (refused with a
warning naming the package); two packages claiming one kind make it a ConfigError naming both;
a package whose metadata cannot be read is skipped with a warning; whatever a plugin's module
raises at import (``SystemExit`` included, ``KeyboardInterrupt`` excepted) is a ConfigError
naming the kind and the module, from ``register_tier``, ``tier_options`` and ``EngineConfig``.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from importlib import metadata
from pathlib import Path

import pytest

import bsr
from bsr.tiers._registry import BUILTIN_TIERS, OWN_DISTRIBUTION, RESERVED_KINDS

#: a plugin's options class: a kind whose build() says who built it
_OPTIONS = """
import dataclasses
import bsr

@dataclasses.dataclass(frozen=True)
class Options(bsr.TierOptions):
    kind = {kind!r}
    name: str = bsr.option(bsr.Check.text, "impostor")
    path: str = bsr.option(bsr.Check.text, "/nowhere")
    capacity_bytes: int = bsr.option(bsr.Check.size, 1)
    url: str = bsr.option(bsr.Check.text, "x")
    master_address: str = bsr.option(bsr.Check.text, "x")

    def build(self):
        raise RuntimeError("the impostor tier was built")
"""


def install(
    root: Path, kinds: dict[str, str], source: str = _OPTIONS, dist: str | None = None
) -> tuple[str, str]:
    """Write a module and a dist-info declaring ``kinds`` (kind -> attribute) under ``root``;
    return (distribution name, module name)."""
    module = f"bsr_test_plugin_{uuid.uuid4().hex[:10]}"
    name = dist or module.replace("_", "-")
    first = next(iter(kinds))
    (root / f"{module}.py").write_text(source.replace("{kind!r}", repr(first)))
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {module}:{attr}\n" for k, attr in kinds.items())
    (info / "entry_points.txt").write_text(f"[bsr.tiers]\n{lines}")
    return name, module


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory at the *end* of ``sys.path``: a package there comes after bsr's own
    metadata, where a last-wins lookup would let it take bsr's kinds."""
    where = tmp_path / "site"
    where.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(where)])
    importlib.invalidate_caches()
    return where


@pytest.fixture
def site_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory at the *start* of ``sys.path`` (a first-wins lookup would pick it)."""
    where = tmp_path / "site_first"
    where.mkdir()
    monkeypatch.setattr(sys, "path", [str(where), *sys.path])  # restored as it was, like `site`
    importlib.invalidate_caches()
    return where


def test_reserved_kinds_are_the_built_in_ones_and_bsrs_own_entry_points() -> None:
    own = {
        ep.name
        for ep in metadata.entry_points(group="bsr.tiers")
        if ep.dist is not None and ep.dist.metadata["Name"] == OWN_DISTRIBUTION
    }
    assert own == {"redis"}  # bsr is installed (editable or not) with its entry point
    assert set(BUILTIN_TIERS) | own == RESERVED_KINDS


@pytest.mark.parametrize("kind", sorted(RESERVED_KINDS))
@pytest.mark.parametrize("where", ["end", "start"])
def test_a_plugin_cannot_take_a_built_in_kind(
    request: pytest.FixtureRequest, kind: str, where: str
) -> None:
    """An entry point of another package named ``file`` (or ``redis``, ``host``, ``mooncake``)
    is ignored with a warning naming the package; the kind stays bsr's. Before: ``redis``
    resolved to whichever package came last on sys.path, and a ``file`` plugin was ignored
    without a word."""
    root = request.getfixturevalue("site" if where == "end" else "site_first")
    dist, module = install(root, {kind: "Options"})
    with pytest.warns(UserWarning, match=f"ignored the entry point {kind} = ") as record:
        cls = bsr.tier_options(kind)
    assert any(dist in str(w.message) and "cannot replace" in str(w.message) for w in record)
    assert cls is _OWN[kind]()
    assert module not in sys.modules  # the impostor's module was never even imported
    with pytest.warns(UserWarning, match=dist):
        config = bsr.EngineConfig.from_dict({"tiers": [_minimal(kind, root)]})
    assert type(config.tiers[0]) is cls
    with pytest.warns(UserWarning, match=dist):
        assert kind in bsr.tier_kinds()


_OWN = {
    "host": lambda: bsr.HostTierOptions,
    "file": lambda: bsr.FileTierOptions,
    "striped_file": lambda: bsr.StripedFileTierOptions,
    "redis": lambda: importlib.import_module("bsr.redis").RedisTierOptions,
    "mooncake": lambda: importlib.import_module("bsr.tiers._mooncake").MooncakeTierOptions,
}


def _minimal(kind: str, root: Path) -> dict[str, object]:
    return {
        "host": {"kind": "host", "capacity_bytes": "1MiB"},
        "file": {"kind": "file", "path": str(root / "l2"), "capacity_bytes": "1MiB"},
        "striped_file": {
            "kind": "striped_file",
            "paths": [str(root / "s0")],
            "capacity_bytes": "1MiB",
        },
        "redis": {"kind": "redis", "url": "redis://127.0.0.1:1/0"},
        "mooncake": {"kind": "mooncake", "master_address": "127.0.0.1:1"},
    }[kind]


def test_code_may_still_replace_a_built_in_kind_explicitly(site: Path) -> None:
    """The rule is about installed packages: this process's own code replaces a kind only by
    saying so (``replace=True``), and the built-in comes back when it unregisters."""
    _, module = install(site, {"bsr_test_kind": "Options"})
    importlib.import_module(module)
    cls = sys.modules[module].Options
    with pytest.raises(bsr.ConfigError, match="already registered"):
        bsr.register_tier("file", cls)
    bsr.register_tier("file", cls, replace=True)
    try:
        assert bsr.tier_options("file") is cls
    finally:
        bsr.unregister_tier("file")
    assert bsr.tier_options("file") is bsr.FileTierOptions


def test_two_packages_claiming_one_kind_is_a_config_error_naming_both(
    site: Path, site_first: Path
) -> None:
    a, _ = install(site, {"bsr_test_twice": "Options"})
    b, _ = install(site_first, {"bsr_test_twice": "Options"})
    with pytest.raises(bsr.ConfigError) as info:
        bsr.tier_options("bsr_test_twice")
    assert a in str(info.value) and b in str(info.value)
    assert info.value.fields["kind"] == "bsr_test_twice"
    with pytest.raises(bsr.ConfigError) as info:
        bsr.EngineConfig.from_dict({"tiers": [{"kind": "bsr_test_twice"}]})
    assert info.value.fields["key"] == "tiers[0].kind" and a in str(info.value)


def test_a_package_with_unreadable_entry_points_is_skipped_with_a_warning(site: Path) -> None:
    """One damaged package (an entry_points.txt importlib.metadata cannot parse) must not break
    every config: before, ``metadata.entry_points()`` raised TypeError out of tier_options (for
    ``redis`` too) and tier_kinds."""
    info = site / "damaged_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: damaged-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[bsr.tiers]\nno equals sign here\n")
    with pytest.warns(UserWarning, match="damaged_pkg-0.1.dist-info"):
        assert "redis" in bsr.tier_kinds()
    with pytest.warns(UserWarning, match="metadata cannot be read"):
        assert bsr.tier_options("redis").__name__ == "RedisTierOptions"
    with pytest.warns(UserWarning), pytest.raises(bsr.ConfigError, match="unknown tier kind"):
        bsr.tier_options("bsr_test_nowhere")


_HOSTILE = {
    "exit": "import sys\nsys.exit(3)\n",
    "exit-none": "raise SystemExit\n",
    "generator-exit": "raise GeneratorExit('odd')\n",
    "base-exception": "class Odd(BaseException):\n    pass\nraise Odd('a plugin of its own')\n",
    "getattr-exit": "def __getattr__(name):\n    raise SystemExit(f'no {name}')\n",
    "huge-message": "raise RuntimeError('x' * 10_000_000)\n",
    "unprintable": (
        "class E(Exception):\n    def __str__(self):\n        raise ValueError('no')\nraise E()\n"
    ),
}


@pytest.mark.parametrize("how", sorted(_HOSTILE))
def test_a_plugin_raising_system_exit_at_import_is_a_config_error(site: Path, how: str) -> None:
    """``sys.exit()`` (or another BaseException) in a plugin's module: a ConfigError naming the
    kind and the module from register_tier, tier_options and EngineConfig. Before, SystemExit
    escaped all three (a config naming the plugin ended the process)."""
    kind = f"bsr_test_{how.replace('-', '_')}"
    _, module = install(site, {kind: "Options"}, source=_HOSTILE[how])

    with pytest.raises(bsr.ConfigError) as info:
        bsr.register_tier(f"{kind}_by_name", f"{module}:Options")
    assert info.value.fields["kind"] == f"{kind}_by_name"
    assert info.value.fields["module"] == module and module in str(info.value)
    assert f"{kind}_by_name" not in bsr.tier_kinds()

    with pytest.raises(bsr.ConfigError) as info:
        bsr.tier_options(kind)
    assert info.value.fields["kind"] == kind and info.value.fields["module"] == module
    assert repr(kind) in str(info.value) and module in str(info.value)
    assert len(str(info.value)) < 2000  # a plugin's message cannot make ours huge

    with pytest.raises(bsr.ConfigError) as info:
        bsr.EngineConfig.from_dict({"tiers": [{"kind": kind}]})
    assert info.value.fields["key"] == "tiers[0].kind"
    assert info.value.fields["module"] == module
    assert repr(kind) in str(info.value) and module in str(info.value)


def test_keyboard_interrupt_at_plugin_import_is_not_swallowed(site: Path) -> None:
    """The user's Ctrl-C during a plugin's import still stops the program."""
    _, module = install(site, {"bsr_test_ctrl_c": "Options"}, source="raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        bsr.tier_options("bsr_test_ctrl_c")
    with pytest.raises(KeyboardInterrupt):
        bsr.register_tier("bsr_test_ctrl_c2", f"{module}:Options")


def test_a_well_behaved_plugin_still_works(site: Path) -> None:
    _, module = install(site, {"bsr_test_good": "Options"})
    cls = bsr.tier_options("bsr_test_good")
    assert cls.__module__ == module and "bsr_test_good" in bsr.tier_kinds()
    config = bsr.EngineConfig.from_dict({"tiers": [{"kind": "bsr_test_good", "name": "g"}]})
    assert type(config.tiers[0]) is cls
