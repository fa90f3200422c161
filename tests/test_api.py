"""The public facade: curated names, typed errors under one root."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import bsr
import bsr.testing
from support.source import parse_file


def _declared_names() -> set[str]:
    """What bsr/__init__.py declares public, read from its source (not from ``__all__``): the
    names imported ``as`` themselves, at the top and in the TYPE_CHECKING block, and any name
    assigned there (an alias, ``Old = New``: the 0.2 ones are gone), less modules."""
    tree = parse_file(Path(bsr.__file__))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module not in (None, "__future__", "typing"):
            names |= {a.asname for a in node.names if a.asname}
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:  # an alias: Old = New
                if isinstance(stmt, ast.Assign):
                    names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return names - {"kit"}


def test_all_is_sorted_and_complete() -> None:
    """Found when ``__all__`` became generated: ``NULL_BLOCK`` (public since 0.3, in the lazy
    table and the docs) was missing from the hand-written tuple, so ``from bsr import *`` lacked
    it, and the tuple was not sorted; the old test derived the public names from ``dir(bsr)``,
    which is itself built from ``__all__``."""
    assert isinstance(bsr.__all__, tuple)
    assert list(bsr.__all__) == sorted(bsr.__all__)
    assert len(set(bsr.__all__)) == len(bsr.__all__)
    assert set(bsr.__all__) == _declared_names()
    assert "NULL_BLOCK" in bsr.__all__
    for name in bsr.__all__:
        obj = getattr(bsr, name)
        assert not inspect.ismodule(obj)
        assert name in {"FORMAT_VERSION", "NULL_BLOCK"} or obj.__module__.startswith("bsr")
    star: dict[str, object] = {}
    exec("from bsr import *", star)
    assert set(bsr.__all__) <= set(star)
    public = {n for n in dir(bsr) if not n.startswith("_")}
    assert set(bsr.__all__) <= public


def test_the_lazy_table_names_each_public_name_once_where_it_lives() -> None:
    """The facade's lazy table listed ``NULL_BLOCK`` under ``core._keys`` (which has none) as
    well as under ``transfer._tables``; it worked only because the later entry won."""
    import importlib

    seen: dict[str, str] = {}
    for module, names in bsr._LAZY.items():
        for name in names:
            assert name not in seen, f"{name} is listed under {seen[name]} and {module}"
            seen[name] = module
            assert name in vars(importlib.import_module(module, "bsr")), (name, module)


def test_every_error_derives_from_bsr_error() -> None:
    errors = [getattr(bsr, n) for n in bsr.__all__ if n.endswith("Error")]
    assert len(errors) >= 15
    for e in errors:
        assert issubclass(e, bsr.BsrError), e
    assert issubclass(bsr.ObjectNotFoundError, FileNotFoundError)
    assert issubclass(bsr.TokenError, TypeError)
    assert issubclass(bsr.ConfigError, ValueError)
    assert issubclass(bsr.TierTimeoutError, TimeoutError)


def test_errors_carry_structured_fields() -> None:
    err = bsr.TierIOError("boom", tier="file", key="abc")
    assert err.tier == "file" and err.fields == {"tier": "file", "key": "abc"}
    assert "tier='file'" in str(err)


def test_testing_kit_exports() -> None:
    for name in bsr.testing.__all__:
        assert hasattr(bsr.testing, name)
