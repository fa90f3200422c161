"""The real baseline: LMCache 0.5.6's whole-plan retrieve, run beside bsr's in ``--l1-ladder``.

Where it runs: a child process in ``.venv-lmcache`` (LMCache pins its own dependencies, so it
does not share bsr's environment); the bench process only starts it and reads its JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VENV = Path(".venv-lmcache")


def run_lmcache_ladder(
    opts: Any, named: Any, max_tokens: int, root: Path, console: Any
) -> dict[str, Any]:
    """LMCache's side of the ladder, or a record of why it did not run."""
    return {"status": "skipped", "message": "not implemented yet", "warnings": [], "points": []}
