"""Every snippet of the README and the docs runs, or says why it cannot.

The pages are ``README.md``, ``docs/*.md`` and ``bench/README.md``. Their fenced blocks are
checked by language:

- ``python``: run as a script in a fresh interpreter (this checkout's ``src`` first on the path),
  in an empty temporary directory, and must exit 0;
- ``toml``: an engine config, read by ``bsr.EngineConfig.from_toml``;
- ``bash`` / ``sh`` / ``shell``: every ``bsr ...`` (or ``python -m bsr ...``) command is parsed by
  the CLI's own parser (``bsr bench ...`` by the bench's), without running it, and
  ``bsr <command> --help`` exits 0 for every command named; every ``make TARGET`` names a rule
  of the Makefile.

A block that cannot run here (it needs a GPU, vLLM, a cluster or a client of the reader's own)
has a marker on the line before its fence, with the reason::

    <!-- snippet: skip needs a Mooncake cluster -->

A marker without a reason, of another kind, or not followed by a fence is an error. Relative
links of the pages must name files of the repository, and their ``#anchors`` headings there.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md")
FENCE = re.compile(r"^(\s*)```([\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
SHELLS = {"bash", "sh", "shell"}
#: one snippet's run; a bound so a hung snippet fails instead of hanging the suite
RUN_LIMIT_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and why it is skipped (if it is)."""

    page: Path
    line: int
    lang: str
    text: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_page(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``page``, and the problems of its snippet markers."""
    lines = page.read_text("utf-8").split("\n")
    blocks: list[Block] = []
    problems: list[str] = []
    marker: tuple[int, str] | None = None  # (line, text) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            if marker is not None:
                problems.append(f"{page.name}:{marker[0]}: marker not followed by a fence")
            marker = (i + 1, m.group(1))
            i += 1
            continue
        f = FENCE.match(lines[i])
        if not f:
            if lines[i].strip() and marker is not None:
                problems.append(f"{page.name}:{marker[0]}: marker not followed by a fence")
                marker = None
            i += 1
            continue
        indent, lang, start = f.group(1), f.group(2), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        skip = None
        if marker is not None:
            kind, _, reason = marker[1].partition(" ")
            if kind != "skip":
                problems.append(f"{page.name}:{marker[0]}: unknown marker {kind!r} (use skip)")
            else:
                if not reason.strip():
                    problems.append(f"{page.name}:{marker[0]}: 'skip' needs a reason")
                skip = reason.strip() or "?"
            marker = None
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", skip))
        i += 1
    if marker is not None:
        problems.append(f"{page.name}:{marker[0]}: marker not followed by a fence")
    return blocks, problems


def all_blocks(*langs: str) -> list[Block]:
    return [b for p in PAGES for b in parse_page(p)[0] if b.lang in langs]


def as_param(block: Block) -> object:
    marks = [pytest.mark.skip(reason=f"{block.where}: {block.skip}")] if block.skip else []
    return pytest.param(block, id=block.where, marks=marks)


# --------------------------------------------------------------------- markers and links
def test_every_marker_has_a_reason_and_a_block() -> None:
    problems = [p for page in PAGES for p in parse_page(page)[1]]
    assert not problems, "\n".join(problems)


def test_the_parser_finds_blocks_markers_and_their_problems(tmp_path: Path) -> None:
    """The checks below see what the pages hold: a marker binds the fence after it only."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- snippet: skip needs a GPU -->\n```python\nimport cuda\n```\n\n"
        "```python\nprint(1)\n```\n<!-- snippet: skip -->\n```bash\nbsr demo\n```\n"
        "<!-- snippet: later x -->\n```toml\n```\n<!-- snippet: skip dangling -->\ntext\n",
        "utf-8",
    )
    blocks, problems = parse_page(page)
    assert [(b.line, b.lang, b.skip) for b in blocks] == [
        (2, "python", "needs a GPU"),
        (6, "python", None),
        (10, "bash", "?"),
        (14, "toml", None),
    ]
    assert blocks[1].text == "print(1)\n"
    assert problems == [
        "page.md:9: 'skip' needs a reason",
        "page.md:13: unknown marker 'later' (use skip)",
        "page.md:16: marker not followed by a fence",
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in page.read_text("utf-8").split("\n"):
        if FENCE.match(line) or line.strip() == "```":
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        s = slug(line.lstrip("#"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_and_headings_that_exist(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text("utf-8"), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            shown = dest.relative_to(ROOT) if ROOT in dest.parents else dest
            bad.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------- python and toml
@pytest.mark.parametrize("block", [as_param(b) for b in all_blocks("python")])
def test_python_snippet_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.text, "utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=RUN_LIMIT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {RUN_LIMIT_S} s")
    assert done.returncode == 0, (
        f"{block.where} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", [as_param(b) for b in all_blocks("toml")])
def test_toml_snippet_is_an_engine_config(block: Block, tmp_path: Path) -> None:
    import bsr

    path = tmp_path / "bsr.toml"
    path.write_text(block.text, "utf-8")
    config = bsr.EngineConfig.from_toml(path)
    assert config.tiers, f"{block.where}: a config without tiers"


# --------------------------------------------------------------------- shell
def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block, as argv lists: lines joined at a trailing
    backslash or an open quote, comments dropped, split at ``&&``, ``||``, ``;`` and ``|``."""
    lines: list[str] = []
    cur: list[str] = []
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "\\" and text[i + 1 : i + 2] == "\n":
            i += 2
            continue
        elif c == "#" and (not cur or cur[-1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "\n":
            lines.append("".join(cur))
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    lines.append("".join(cur))
    out = []
    for line in lines:
        argv: list[str] = []
        for word in shlex.split(line):
            if word.endswith(";") and word != ";":  # "400GiB;" ends a command too
                argv.append(word[:-1])
                word = ";"
            if word in ("&&", "||", ";", "|"):
                out.append(argv)
                argv = []
            else:
                argv.append(word)
        out.append(argv)
    return [a for a in out if a]


def bsr_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``bsr`` (or ``python -m bsr``), or None for another command."""
    while argv and re.fullmatch(r"\w+=.*", argv[0]):
        argv = argv[1:]  # VAR=value prefixes
    if argv and Path(argv[0]).name == "bsr":
        return argv[1:]
    if len(argv) > 2 and Path(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "bsr"]:
        return argv[3:]
    return None


def subcommands(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """The chain of subcommands ``args`` names (``store gc``), by the parser's own tables."""
    chain: list[str] = []
    for word in args:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        chain.append(word)
        parser = subs[0].choices[word]
    return chain


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and its subcommands refusing abbreviated flags: a page spells them out."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)
    return parser


def parse_bsr(args: list[str]) -> str | None:
    """Parse a ``bsr`` command line as the CLI would, running nothing: None, or the error."""
    from bsr.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if args[:1] == ["bench"]:
                from bsr_bench.cli import build_parser as bench_parser

                strict(bench_parser()).parse_args(args[1:])
            else:
                strict(build_parser()).parse_args(args)
    except SystemExit as exc:
        said = err.getvalue().strip().splitlines()
        return None if exc.code == 0 else (said[-1] if said else f"exit {exc.code}")
    return None


BSR_LINES = [
    pytest.param(args, id=f"{b.where}: bsr {' '.join(args)}"[:120])
    for b in all_blocks(*SHELLS)
    if not b.skip
    for argv in shell_commands(b.text)
    if (args := bsr_args(argv)) is not None
]


@pytest.mark.parametrize("args", BSR_LINES)
def test_bsr_command_line_parses(args: list[str]) -> None:
    error = parse_bsr(args)
    assert error is None, error


def test_every_bsr_command_named_has_working_help() -> None:
    from bsr.cli import build_parser

    chains = {tuple(subcommands(build_parser(), args)) for args in (p.values[0] for p in BSR_LINES)}
    assert ("demo",) in chains  # the README's first thing to try
    failed = []
    for chain in sorted(chains):
        done = subprocess.run(
            [sys.executable, "-m", "bsr", *chain, "--help"], capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=RUN_LIMIT_S,
        )  # fmt: skip
        if done.returncode != 0:
            failed.append(f"bsr {' '.join(chain)} --help: exit {done.returncode}\n{done.stderr}")
    assert not failed, "\n".join(failed)


def make_rules() -> set[str]:
    """The Makefile's rule names, with its own ``NAME ?= value`` variables expanded."""
    text = (ROOT / "Makefile").read_text("utf-8")
    names = dict(re.findall(r"^(\w+)\s*[?:]?=\s*(\S*)\s*$", text, re.M))
    rules = re.findall(r"^([\w.$()/-]+):", text, re.M)
    return {re.sub(r"\$\((\w+)\)", lambda m: names.get(m.group(1), m.group(0)), r) for r in rules}


def test_make_targets_named_exist() -> None:
    rules = make_rules()
    assert {"test", "bench", ".venv-vllm/.bsr-installed"} <= rules
    missing = [
        f"{b.where}: make {t}"
        for b in all_blocks(*SHELLS)
        if not b.skip
        for argv in shell_commands(b.text)
        if argv[0] == "make"
        for t in argv[1:]
        if not t.startswith("-") and "=" not in t and t not in rules
    ]
    assert not missing, "\n".join(missing)


def test_shell_commands_are_split_as_a_shell_would() -> None:
    text = (
        "make setup && make lint   # a comment with 'quotes\n"
        "bsr store gc /nvme/bsr \\\n  --max-bytes 400GiB; bsr demo\n"
        'vllm serve M --cfg \'{"a": 1,\n  "b": "#x"}\'\n'
    )
    assert shell_commands(text) == [
        ["make", "setup"],
        ["make", "lint"],
        ["bsr", "store", "gc", "/nvme/bsr", "--max-bytes", "400GiB"],
        ["bsr", "demo"],
        ["vllm", "serve", "M", "--cfg", '{"a": 1,\n  "b": "#x"}'],
    ]
    assert bsr_args(["python", "-m", "bsr", "demo"]) == ["demo"]
    assert bsr_args([".venv/bin/bsr", "bench", "--quick"]) == ["bench", "--quick"]
    assert bsr_args(["vllm", "serve"]) is None
    assert parse_bsr(["demo", "--tokens", "1024"]) is None
    assert "invalid int value" in (parse_bsr(["demo", "--tokens", "many"]) or "")
    assert parse_bsr(["no-such-command"]) is not None
    assert "unrecognized arguments: --token" in (parse_bsr(["demo", "--token", "8"]) or "")
