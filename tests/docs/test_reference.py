"""The documentation site (mkdocs.yml): it builds in strict mode, and its API reference renders
every public name.

The site is built once for this module, into a temporary directory, exactly as ``make docs``
builds it (``mkdocs build --strict``: a broken link between pages, a link to a file the
repository lacks or a docstring that does not parse fails the build). The reference's names are
read from the inventory the build writes (``objects.inv``, Sphinx's format, which mkdocstrings
fills with every object it rendered) and compared with the public names: ``bsr.__all__``, the
``__all__`` of the public modules, and the classes and functions ``bsr.redis`` defines.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

import bsr
from support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]
#: the public modules whose ``__all__`` the reference must render, beside ``bsr`` itself
MODULES = ("bsr.kit", "bsr.vllm", "bsr.router", "bsr.hcache", "bsr.testing")
#: public modules that import an optional engine at the top (read without importing them)
STATIC_MODULES = {"bsr.sglang": Path(__file__).parents[2] / "src/bsr/sglang/__init__.py"}
#: the options dataclass of each tier bsr ships: every field is an entry of the reference
OPTIONS = (
    "bsr.HostTierOptions",
    "bsr.FileTierOptions",
    "bsr.StripedFileTierOptions",
    "bsr.MooncakeTierOptions",
    "bsr.redis.RedisTierOptions",
)


def inventory_names(path: Path) -> set[str]:
    """The object names of a Sphinx inventory (version 2: four header lines, then zlib)."""
    header, _, body = path.read_bytes().partition(b"# The remainder of this file is compressed")
    assert header.startswith(b"# Sphinx inventory version 2"), f"{path}: not an inventory"
    lines = zlib.decompress(body.split(b"\n", 1)[1]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.strip()}


def static_all(path: Path) -> list[str]:
    """A module's ``__all__`` (a literal list of strings), read from its source."""
    import ast

    for node in parse_file(path).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path}: no __all__")


def public_names() -> dict[str, str]:
    """Every public name, dotted (``bsr.RestoreEngine``), with what declares it public."""
    names = {f"bsr.{n}": "bsr.__all__" for n in bsr.__all__}
    for module in MODULES:
        mod = importlib.import_module(module)
        names.update({f"{module}.{n}": f"{module}.__all__" for n in mod.__all__})
    for module, path in STATIC_MODULES.items():
        names.update({f"{module}.{n}": f"{module}.__all__" for n in static_all(path)})
    redis = importlib.import_module("bsr.redis")  # no __all__: the classes and functions it defines
    for name, value in vars(redis).items():
        defined = inspect.isclass(value) or inspect.isfunction(value)
        if defined and not name.startswith("_") and value.__module__ == "bsr.redis":
            names[f"bsr.redis.{name}"] = "defined in bsr.redis"
    return names


def missing_from(rendered: set[str], expected: dict[str, str]) -> list[str]:
    """The expected names the reference does not render, each with what declares it public."""
    return sorted(f"{name} ({why})" for name, why in expected.items() if name not in rendered)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


@pytest.fixture(scope="module")
def rendered(site: Path) -> set[str]:
    return inventory_names(site / "objects.inv")


def test_the_reference_renders_every_public_name(rendered: set[str]) -> None:
    expected = public_names()
    assert len(expected) > 150  # bsr's own names and every module's were found
    missing = missing_from(rendered, expected)
    assert not missing, (
        "public names without an entry in the API reference: add a `::: <name>` line to the "
        "page of docs/reference/ where it belongs: " + ", ".join(missing)
    )


def test_a_name_left_out_of_the_reference_is_reported(rendered: set[str]) -> None:
    # the check above can fail: the same inventory less one name reports exactly that name
    expected = public_names()
    assert missing_from(rendered - {"bsr.RestoreEngine"}, expected) == [
        "bsr.RestoreEngine (bsr.__all__)"
    ]
    assert missing_from(rendered - {"bsr.vllm.BsrConnector"}, expected) == [
        "bsr.vllm.BsrConnector (bsr.vllm.__all__)"
    ]


def test_every_field_of_the_tiers_options_is_rendered(rendered: set[str]) -> None:
    missing = []
    for path in OPTIONS:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        fields = [f.name for f in dataclasses.fields(cls)]
        assert fields, f"{path} has no fields"
        missing += [f"{path}.{f}" for f in fields if f"{path}.{f}" not in rendered]
    assert not missing, f"options fields without an entry in the reference: {missing}"


def test_a_tier_shows_its_options_as_its_parameters(site: Path) -> None:
    # @takes_options: HostTier(capacity_bytes, *, name, pinned), not HostTier(options)
    page = (site / "reference" / "tiers" / "index.html").read_text()
    entry = page[page.index('id="bsr.HostTier"') :][:4000]
    for field in ("capacity_bytes", "name", "pinned"):
        assert field in entry, f"HostTier's entry does not show its parameter {field}"
    assert "options" not in entry.split("Bases")[0], "HostTier shows `options` as its parameter"


def test_the_guides_links_to_repository_files_are_copied(site: Path) -> None:
    # docs/architecture.md links ../spec/bsr.pml: the site carries the file and links to it
    assert (site / "repo" / "spec" / "bsr.pml").read_bytes() == (ROOT / "spec/bsr.pml").read_bytes()
    page = (site / "architecture" / "index.html").read_text()
    assert 'href="../repo/spec/bsr.pml"' in page


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bsr_docs_hooks", ROOT / "tools/docs/hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_link_to_a_file_the_repository_lacks_is_left_to_fail_the_build() -> None:
    # only files that exist are copied and relinked; mkdocs --strict then fails on the other
    hooks = _hooks()
    config = SimpleNamespace(docs_dir=str(ROOT / "docs"), config_file_path=str(ROOT / "mkdocs.yml"))
    text = "[a](../spec/bsr.pml) [b](../spec/no-such-file.pml) [c](tiers.md#the-seam)"
    out, found = hooks._repo_links(config, "vllm.md", text)
    assert found == {"spec/bsr.pml"}
    assert out == "[a](repo/spec/bsr.pml) [b](../spec/no-such-file.pml) [c](tiers.md#the-seam)"
    # from a page one folder down, the copy is one folder up
    out, _ = hooks._repo_links(config, "reference/x.md", "![p](../../spec/bsr.pml)")
    assert out == "![p](../repo/spec/bsr.pml)"
