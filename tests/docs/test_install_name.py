"""Every install line the project writes names its PyPI distribution, ``bsr-kv``.

The name ``bsr`` on PyPI belongs to an unrelated project (README says so), so a
``pip install bsr[...]`` in a guide or a docstring installs someone else's code. Found in
docs/sglang.md and ``bsr.sglang``'s docstring.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: ``pip install`` of the bare name ``bsr`` (quoted or not, with or without extras)
WRONG = re.compile(r"""pip install\s+['"]?bsr(?![-\w])""")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for top in ("src", "bench", "examples"):
        files += sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def wrong_installs(text: str) -> list[str]:
    """The lines of ``text`` that install the bare name (the README's own warning excepted:
    it quotes the wrong command to warn against it)."""
    return [
        ln.strip() for ln in text.splitlines() if WRONG.search(ln) and "unrelated project" not in ln
    ]


def test_install_lines_name_bsr_kv() -> None:
    bad = {
        str(f.relative_to(ROOT)): hits
        for f in _sources()
        if (hits := wrong_installs(f.read_text(errors="replace")))
    }
    assert not bad, f"install bsr-kv, not the unrelated 'bsr': {bad}"


def test_the_check_sees_the_wrong_name() -> None:
    assert wrong_installs('pip install "bsr[sglang]"') == ['pip install "bsr[sglang]"']
    assert wrong_installs("(``pip install bsr[sglang]``)") != []
    assert wrong_installs("pip install bsr") == ["pip install bsr"]
    assert wrong_installs("pip install 'bsr-kv[vllm]'") == []
    assert wrong_installs("pip install bsr_bench") == []
