"""``bsr store`` on a real FileTier directory written by a real engine save.

The main paths run ``python -m bsr`` in a subprocess; the rest call the same ``main(argv)`` in
process (each subprocess pays for importing torch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest

import bsr
from support.engines import make_engine
from support.helpers import bsr_cli, bsr_main, filled_cache, tokens_for, two_group_layout


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, bsr.SaveResult, bsr.SaveResult]:
    """Two namespaces saved into one FileTier directory: 3 chunks of model a, 2 of model b."""
    layout = two_group_layout()
    root = tmp_path / "store"
    src = filled_cache(layout, 64, 8)
    saves = []

    async def main() -> None:
        for model, chunks in (("a", 3), ("b", 2)):
            n = chunks * layout.chunk_tokens
            eng = make_engine(layout, [bsr.FileTier(root, 1 << 26)], model_id=model)
            async with eng:
                saves.append(await eng.save(tokens_for(n), src, list(range(n // 8))))

    anyio.run(main)
    return root, saves[0], saves[1]


def _has_marker_kind() -> bool:
    from bsr.tiers.file import _tier as _file

    return hasattr(_file, "MARKER_KIND")


def _objects(root: Path) -> list[Path]:
    return sorted((root / "objects").glob("*/*.bsr"))


def test_stats_and_ls(store: tuple[Path, bsr.SaveResult, bsr.SaveResult]) -> None:
    root, a, b = store
    written = a.objects_written["file"] + b.objects_written["file"]
    p = bsr_cli("store", "stats", str(root), "--json")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["objects"] == written == len(_objects(root))
    assert st["bytes"] == sum(f.stat().st_size for f in _objects(root))
    assert st["payload_bytes"] == sum(a.bytes_written.values()) + sum(b.bytes_written.values())
    per = sorted((n["objects"], n["groups"]) for n in st["namespaces"])
    # 3 kv chunks + the 2 swa chunks the window needs; 2 kv + 2 swa
    assert per == [(4, {"kv": 2, "swa": 2}), (5, {"kv": 3, "swa": 2})]
    text = bsr_main("store", "stats", str(root))
    assert text.returncode == 0 and f"objects    {written} " in text.stdout
    ls = bsr_main("store", "ls", str(root))
    assert ls.returncode == 0
    lines = ls.stdout.splitlines()
    assert len(lines) == written
    assert {ln.split()[0] for ln in lines} == {f.name[:-4] for f in _objects(root)}


def test_verify_finds_a_damaged_byte_and_quarantines_it(
    store: tuple[Path, bsr.SaveResult, bsr.SaveResult],
) -> None:
    root = store[0]
    clean = bsr_main("store", "verify", str(root))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "clean" in clean.stdout
    victim = _objects(root)[1]
    with open(victim, "r+b") as fh:  # flip one payload byte, the header stays intact
        fh.seek(4096 + 100)
        byte = fh.read(1)
        fh.seek(4096 + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    bad = bsr_cli("store", "verify", str(root), "--json")
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert [(b["object_id"], b["reason"]) for b in report["bad"]] == [(victim.name[:-4], "corrupt")]
    assert victim.exists()  # reported only
    moved = bsr_main("store", "verify", str(root), "--quarantine")
    assert moved.returncode == 1 and "BAD" in moved.stdout
    assert not victim.exists()
    q = bsr_main("store", "quarantine", "list", str(root), "--json")
    entries = json.loads(q.stdout)
    assert [(e["object_id"], e["reason"]) for e in entries] == [(victim.name[:-4], "corrupt")]
    assert bsr_main("store", "verify", str(root)).returncode == 0  # the rest is clean
    purge = bsr_main("store", "quarantine", "purge", str(root))
    assert purge.returncode == 0 and "deleted 1 " in purge.stdout
    assert list((root / "quarantine").iterdir()) == []


def test_verify_finds_truncation_and_a_bad_header(
    store: tuple[Path, bsr.SaveResult, bsr.SaveResult],
) -> None:
    root = store[0]
    first, second = _objects(root)[:2]
    os.truncate(first, first.stat().st_size - 4096)
    with open(second, "r+b") as fh:
        fh.seek(40)  # inside the key digest: caught by the header checksum
        fh.write(b"\x00\x01")
    report = json.loads(bsr_main("store", "verify", str(root), "--json").stdout)
    assert sorted(b["reason"] for b in report["bad"]) == ["corrupt", "truncated"]


def test_gc_evicts_oldest_first(store: tuple[Path, bsr.SaveResult, bsr.SaveResult]) -> None:
    root = store[0]
    objs = _objects(root)
    for i, f in enumerate(objs):  # a known age order
        os.utime(f, (1_000_000 + i, 1_000_000 + i))
    size = objs[0].stat().st_size
    keep = sum(f.stat().st_size for f in objs[-3:])
    dry = bsr_main("store", "gc", str(root), "--max-bytes", str(keep), "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout
    assert _objects(root) == objs
    p = bsr_main("store", "gc", str(root), "--max-bytes", str(keep), "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["remaining_bytes"] <= keep and report["freed_bytes"] >= size
    assert _objects(root) == objs[-3:]


@pytest.mark.anyio
async def test_an_engine_reads_what_gc_left(
    store: tuple[Path, bsr.SaveResult, bsr.SaveResult], tmp_path: Path
) -> None:
    root = store[0]
    assert bsr_main("store", "gc", str(root), "--max-bytes", "0").returncode == 0
    assert _objects(root) == []
    layout = two_group_layout()

    async with make_engine(layout, [bsr.FileTier(root, 1 << 26)], model_id="a") as eng:
        probe = await eng.lookup(tokens_for(3 * layout.chunk_tokens))
        assert probe.prefix_tokens == 0


def test_usage_and_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    for i, args in enumerate(
        (
            ("store", "stats", str(tmp_path / "plain")),
            ("store", "verify", str(tmp_path / "missing")),
            ("store", "gc", str(tmp_path / "plain"), "--max-bytes", "1GiB"),
            ("store", "quarantine", "purge", str(tmp_path / "plain")),
        )
    ):
        p = bsr_cli(*args) if i == 0 else bsr_main(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert "not a" in p.stderr and "FileTier" in p.stderr
    assert (tmp_path / "plain" / "notes.txt").exists()
    other = tmp_path / "other"
    (other / "objects").mkdir(parents=True)
    (other / ".bsr-tier").write_text('{"kind": "something.Else", "version": 1}')
    assert bsr_main("store", "ls", str(other)).returncode == (2 if _has_marker_kind() else 0)
    assert bsr_main("store").returncode == 2
    assert bsr_main("store", "gc", str(tmp_path)).returncode == 2  # --max-bytes missing
    bad_size = bsr_main("store", "gc", str(tmp_path), "--max-bytes", "lots")
    assert bad_size.returncode == 2 and "--max-bytes" in bad_size.stderr


def test_python_m_bsr_works() -> None:
    p = bsr_cli("--version")
    assert p.returncode == 0 and p.stdout.startswith("bsr ")
    h = bsr_main("store", "--help")
    assert h.returncode == 0 and "verify" in h.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty")
def test_verify_shows_a_progress_bar_on_a_tty(
    store: tuple[Path, bsr.SaveResult, bsr.SaveResult],
) -> None:
    pytest.importorskip("rich")
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI with a terminal on stdout and stderr
        os.execv(sys.executable, [sys.executable, "-m", "bsr", "store", "verify", str(store[0])])
    out = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    text = out.decode(errors="replace")
    assert "━" in text and "kB" in text  # rich's bar and byte counter
    assert "clean" in text
    plain = bsr_main("store", "verify", str(store[0]))  # not a TTY: no bar
    assert "━" not in plain.stdout + plain.stderr
