"""``bsr ... | head -1``: a command whose stdout's reader has gone ends quietly with 141.

Each command runs as ``python -m bsr`` with stdout the write end of a real pipe whose read end is
already closed, so its first write (or the flush at exit) meets EPIPE, as behind a ``head`` that
has read its line and left. Before: ``bsr store ls DIR | head -1`` said "bsr store: error:
[Errno 32] Broken pipe" and exited 2; the other commands printed a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import bsr
from bsr.cli import EXIT_CLOSED_STDOUT
from support.engines import make_engine
from support.helpers import filled_cache, tokens_for, two_group_layout


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FileTier directory holding a few objects of one saved prefix."""
    layout = two_group_layout()
    root = tmp_path_factory.mktemp("closed-stdout") / "store"
    src = filled_cache(layout, 64, 8)
    n = 3 * layout.chunk_tokens

    async def main() -> None:
        async with make_engine(layout, [bsr.FileTier(root, 1 << 26)], model_id="m") as eng:
            assert (await eng.save(tokens_for(n), src, list(range(n // 8)))).ok

    anyio.run(main)
    return root


def _behind_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first write
    try:
        return subprocess.run(
            [sys.executable, "-m", "bsr", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)


COMMANDS = {
    "store ls": ["store", "ls", "{store}"],
    "store ls --json": ["store", "ls", "{store}", "--json"],
    "store stats": ["store", "stats", "{store}"],
    "store ls (two roots)": ["store", "ls", "{store}", "{store}"],
    "store verify": ["store", "verify", "{store}"],
    "store quarantine list": ["store", "quarantine", "list", "{store}"],
    "store gc --dry-run": ["store", "gc", "{store}", "--budget", "1GiB", "--dry-run"],
    "config check": ["config", "check", "{config}"],
    "spec diagram": ["spec", "diagram"],
    "--version": ["--version"],
    # argparse drops an OSError writing the help itself, then exits 0 as usual: quiet too
    "--help": ["--help"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_closed_stdout_ends_the_command_quietly(store: Path, tmp_path: Path, name: str) -> None:
    config = tmp_path / "bsr.toml"
    config.write_text('[[tiers]]\nkind = "host"\ncapacity_bytes = "1MiB"\n')
    args = [a.format(store=store, config=config) for a in COMMANDS[name]]
    p = _behind_closed_pipe(*args)
    assert p.stderr == "", p.stderr
    assert (
        p.returncode == (0 if name == "--help" else EXIT_CLOSED_STDOUT)
        and EXIT_CLOSED_STDOUT == 141
    )


def test_an_open_stdout_still_gets_everything(store: Path) -> None:
    """The same listing into a pipe that is read: every line arrives, exit 0."""
    p = subprocess.run(
        [sys.executable, "-m", "bsr", "store", "ls", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stderr == ""
    assert len(p.stdout.splitlines()) == len(list((store / "objects").glob("*/*.bsr"))) > 0


def test_a_broken_pipe_elsewhere_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A BrokenPipeError while stdout is fine (a peer's socket, say) is an error, not quiet."""
    from bsr import cli

    def broken(ns: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_cmd_spec_diagram", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["spec", "diagram"])
