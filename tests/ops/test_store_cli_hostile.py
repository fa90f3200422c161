"""``bsr store`` on a hostile or live store: nothing outside the store's own files is followed,
moved or deleted, and an object that vanishes while it is verified is not a bad one.

Each hostile layout is built with real symlinks, FIFOs and foreign files around a store a real
engine wrote, then every command that reads or changes files runs over it (``bsr.cli.main`` in
this process, and one ``python -m bsr`` per command kind).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

import bsr
from bsr.tiers import file as file_tier
from support.engines import make_engine
from support.helpers import bsr_cli, bsr_main, filled_cache, tokens_for, two_group_layout


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store with 5 objects saved by an engine; one has a flipped payload byte."""
    layout = two_group_layout()
    root = tmp_path / "store"
    n = 3 * layout.chunk_tokens

    async def main() -> None:
        async with make_engine(layout, [bsr.FileTier(root, 1 << 26)]) as eng:
            await eng.save(tokens_for(n), filled_cache(layout, 64, 8), list(range(n // 8)))

    anyio.run(main)
    flip(objects(root)[0])
    return root


def objects(root: Path) -> list[Path]:
    return sorted((root / "objects").glob("*/*.bsr"))


def flip(path: Path, offset: int = 4096 + 10) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def outside(tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    """A directory outside the store full of files someone cares about."""
    d = tmp_path / "precious"
    d.mkdir()
    files = {
        d / "thesis.pdf": b"years of work",
        d / f"{'ab' * 20}.corrupt.0123abcd": b"named like a quarantined object",
    }
    for p, body in files.items():
        p.write_bytes(body)
    return d, files


def untouched(files: dict[Path, bytes]) -> bool:
    return all(p.exists() and p.read_bytes() == body for p, body in files.items())


def test_a_symlinked_quarantine_is_refused_and_nothing_outside_changes(
    store: Path, tmp_path: Path
) -> None:
    """Before: 'quarantine purge' deleted every regular file where the link pointed, and
    'verify --quarantine' moved a bad object out of the store."""
    elsewhere, files = outside(tmp_path)
    os.rmdir(store / "quarantine")
    (store / "quarantine").symlink_to(elsewhere)
    bad = objects(store)[0]
    for args in (
        ("store", "quarantine", "purge", str(store)),
        ("store", "quarantine", "list", str(store)),
        ("store", "verify", str(store), "--quarantine"),
    ):
        p = bsr_main(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert "quarantine" in p.stderr and "symlink" in p.stderr
        assert untouched(files) and sorted(elsewhere.iterdir()) == sorted(files)
        assert bad.exists()
    # reading commands that do not need quarantine/ refuse too: the store is not as bsr left it
    assert bsr_cli("store", "stats", str(store)).returncode == 2


def test_foreign_files_in_quarantine_are_never_listed_or_purged(store: Path) -> None:
    """Before: a foreign file inside a real quarantine/ was deleted by 'purge'."""
    assert bsr_main("store", "verify", str(store), "--quarantine").returncode == 1
    q = store / "quarantine"
    (moved,) = list(q.iterdir())
    foreign = {
        q / "notes.txt": b"an operator's notes",
        q / f"{moved.name}.bak": b"a copy with a suffix",
        q / f"{'CD' * 20}.corrupt.0123abcd": b"upper case id",
    }
    for p, body in foreign.items():
        p.write_bytes(body)
    (q / f"{'ef' * 20}.corrupt.89abcdef").symlink_to(store.parent / "nowhere")
    os.mkfifo(q / f"{'12' * 20}.corrupt.89abcdef")
    listed = json.loads(bsr_main("store", "quarantine", "list", str(store), "--json").stdout)
    assert [e["path"] for e in listed] == [str(moved)]
    stats = json.loads(bsr_main("store", "stats", str(store), "--json").stdout)
    assert stats["quarantined"] == 1 and stats["junk"] == 5
    purge = bsr_cli("store", "quarantine", "purge", str(store))
    assert purge.returncode == 0 and "deleted 1 " in purge.stdout, purge.stderr
    assert not moved.exists() and untouched(foreign)
    assert (q / f"{'ef' * 20}.corrupt.89abcdef").is_symlink()


def test_symlinks_fifos_and_foreign_files_among_objects_are_never_touched(
    store: Path, tmp_path: Path
) -> None:
    real = objects(store)  # what the engine wrote
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / f"{'ab' * 20}.bsr"  # named like an object, outside the store
    target.write_bytes(real[1].read_bytes())
    (store / "objects" / "ab").symlink_to(elsewhere)  # a symlinked fan-out directory
    cd = store / "objects" / "cd"
    cd.mkdir()
    link = cd / f"{'cd' * 20}.bsr"
    link.symlink_to(target)  # a symlinked object
    fifo = cd / f"{'cd' * 19}ce.bsr"
    os.mkfifo(fifo)  # a FIFO named like one (reading it would block)
    foreign = cd / "README"
    foreign.write_bytes(b"not an object")
    ls = json.loads(bsr_main("store", "ls", str(store), "--json").stdout)
    assert sorted(o["object_id"] for o in ls) == sorted(p.name[:-4] for p in real)
    stats = json.loads(bsr_main("store", "stats", str(store), "--json").stdout)
    assert stats["objects"] == len(real) and stats["junk"] == 4
    verify = bsr_main("store", "verify", str(store), "--quarantine", "--json")
    assert verify.returncode == 1
    assert [b["object_id"] for b in json.loads(verify.stdout)["bad"]] == [real[0].name[:-4]]
    gc = bsr_main("store", "gc", str(store), "--max-bytes", "0")
    assert gc.returncode == 0, gc.stderr
    assert not any(p.exists() for p in real)  # every object of the store went
    assert target.read_bytes() == real_bytes(target) and (store / "objects" / "ab").is_symlink()
    assert link.is_symlink() and fifo.is_fifo() and foreign.read_bytes() == b"not an object"


def real_bytes(p: Path) -> bytes:
    return p.read_bytes()


def test_a_symlinked_objects_directory_is_refused(store: Path, tmp_path: Path) -> None:
    real = store / "objects"
    moved = tmp_path / "objects-elsewhere"
    real.rename(moved)
    (store / "objects").symlink_to(moved)
    before = sorted(moved.rglob("*.bsr"))
    for args in (("gc", "--max-bytes", "0"), ("verify", "--quarantine"), ("ls",)):
        p = bsr_main("store", args[0], str(store), *args[1:])
        assert p.returncode == 2 and "symlink" in p.stderr, (args, p.stderr)
    assert sorted(moved.rglob("*.bsr")) == before


# ---------------------------------------------------------------------- item 3: a live store
def test_verify_counts_an_object_evicted_meanwhile_as_gone_not_bad(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object removed between the listing and its read (a running engine evicted it) was
    reported 'BAD ... unreadable' with exit 1."""
    flip(objects(store)[0])  # the store is clean again
    assert bsr_main("store", "verify", str(store)).returncode == 0
    real_list = file_tier.list_objects
    gone: list[str] = []

    def list_then_evict(path: str | os.PathLike[str]) -> list[file_tier.ObjectInfo]:
        listed = real_list(path)
        victim = listed[2]
        victim.path.unlink()  # what an engine's eviction does, after the listing
        gone.append(victim.object_id)
        return listed

    monkeypatch.setattr(file_tier, "list_objects", list_then_evict)
    p = bsr_main("store", "verify", str(store))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "BAD" not in p.stdout and "1 vanished meanwhile" in p.stdout
    report = json.loads(bsr_main("store", "verify", str(store), "--json").stdout)
    assert report["gone"] == 1 and report["bad"] == []
    q = bsr_main("store", "verify", str(store), "--quarantine")
    assert q.returncode == 0 and list((store / "quarantine").iterdir()) == []


@pytest.mark.anyio
async def test_verify_beside_a_live_engine_that_evicts_through_a_hook(store: Path) -> None:
    """A real FileTier deletes the next object from the progress hook (between the listing and
    that object's read); the scrub reports it gone, the bad one bad, and exits accordingly."""
    listed = file_tier.list_objects(store)
    seen: list[str] = []

    async def main() -> file_tier.VerifyReport:
        async with bsr.FileTier(store, 1 << 26) as tier:

            def evict_next(o: file_tier.ObjectInfo) -> None:
                seen.append(o.object_id)
                if len(seen) == 2:  # delete object 3 through the tier, before it is read
                    oid = listed[2].object_id
                    tier._index.discard(oid)
                    tier._unlink_victims([oid])

            report = await anyio.to_thread.run_sync(
                lambda: file_tier.verify_store(store, progress=evict_next, objects=listed)
            )
            assert tier.usage().bytes <= sum(o.size for o in listed)
            return report

    report = await main()
    assert report.checked == len(listed) and report.gone == 1
    assert [b.reason for b in report.bad] == ["corrupt"]
