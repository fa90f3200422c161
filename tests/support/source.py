"""Parsing the project's own source in tests: :func:`parse_file`.

CPython 3.11 sometimes raises ``SystemError: AST constructor recursion depth mismatch`` from
``ast.parse`` of a file it parsed a moment before (gh-106905, fixed in 3.12; seen once in
``make test``, in a worker whose earlier tests had run threads and Hypothesis): the counter it
checks is the calling thread's, so the file is parsed once more in a fresh thread. Any other
error, and the same error there, is raised.
"""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def parse_file(path: Path) -> ast.Module:
    """``ast.parse`` of ``path``'s text (named by ``path`` in a syntax error)."""
    text = path.read_text()
    try:
        return ast.parse(text, str(path))
    except SystemError as exc:
        if "recursion depth mismatch" not in str(exc):
            raise
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(ast.parse, text, str(path)).result()
