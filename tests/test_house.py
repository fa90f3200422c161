"""House rules that keep the code readable, checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from support.source import parse_file

ROOT = Path(__file__).resolve().parents[1]
#: the library (its test kit, ``bsr.testing``, included), the benchmark, the GPU validation run
#: and the tests themselves (their helpers and the programs they start included)
CHECKED = (
    ROOT / "src" / "bsr",
    ROOT / "bench" / "bsr_bench",
    ROOT / "bench" / "gpu",
    ROOT / "tests",
)
#: the longest a function may be, its signature and docstring included
MAX_FUNCTION_LINES = 80


def _functions(root: Path) -> list[tuple[int, str]]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(parse_file(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                out.append((lines, where))
    return out


def test_no_function_is_longer_than_80_lines() -> None:
    found = [f for root in CHECKED for f in _functions(root)]
    for root in CHECKED:  # the walk saw each tree's code
        assert any(where.startswith(str(root.relative_to(ROOT))) for _, where in found), root
    assert len(found) > 500
    too_long = sorted(f"{where} ({n} lines)" for n, where in found if n > MAX_FUNCTION_LINES)
    assert not too_long, "split these functions: " + "; ".join(too_long)


def test_parse_file_parses_once_more_in_a_fresh_thread(monkeypatch: Any, tmp_path: Path) -> None:
    """CPython 3.11's spurious recursion-depth SystemError (tests/support/source.py) makes
    parse_file try once more in another thread; any other error is raised."""
    import threading

    import pytest

    real = ast.parse
    caller = threading.get_ident()

    def flaky(text: str, name: str = "<unknown>") -> ast.Module:
        if threading.get_ident() == caller:
            raise SystemError("AST constructor recursion depth mismatch (before=144, after=200)")
        return real(text, name)

    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    monkeypatch.setattr(ast, "parse", flaky)
    assert isinstance(parse_file(f).body[0], ast.Assign)

    def broken(text: str, name: str = "<unknown>") -> ast.Module:
        raise SystemError("something else")

    monkeypatch.setattr(ast, "parse", broken)
    with pytest.raises(SystemError, match="something else"):
        parse_file(f)


#: the read path's classes (and the pipeline's module) at most this many lines: the data plane
#: stays a seam and a few steps (docs/architecture.md), not lanes grown as branches of one class
MAX_CLASS_LINES = {
    ("src/bsr/transfer/_pipeline.py", "WindowPipeline"): 350,
    ("src/bsr/transfer/_ladder.py", "TierLadder"): 220,
    ("src/bsr/tiers/file/_tier.py", "FileTier"): 600,
}
MAX_MODULE_LINES = {"src/bsr/transfer/_pipeline.py": 500}


def test_the_read_paths_classes_stay_within_their_sizes() -> None:
    over = []
    for (rel, name), most in MAX_CLASS_LINES.items():
        found = [
            (n.end_lineno or n.lineno) - n.lineno + 1
            for n in ast.walk(parse_file(ROOT / rel))
            if isinstance(n, ast.ClassDef) and n.name == name
        ]
        assert len(found) == 1, f"{rel}: class {name} not found (moved? update this table)"
        if found[0] > most:
            over.append(f"{rel} {name}: {found[0]} lines (at most {most})")
    for rel, most in MAX_MODULE_LINES.items():
        n = len((ROOT / rel).read_text().splitlines())
        if n > most:
            over.append(f"{rel}: {n} lines (at most {most})")
    assert not over, "split these: " + "; ".join(over)
