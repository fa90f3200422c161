"""``bsr bench --striped`` at a few MiB: 1, 2 and 4 roots of a StripedFileTier beside fio.

The program runs for real (real StripedFileTier, engines, fio where installed) on a state of
16 objects of 512 KiB under ``tmp_path``; the checks compare its document with what is on disk
(object headers read here, independently of bsr), with its own samples (ratios from medians),
and with a root damaged after the save (the run must fail, not report a figure). No timings.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from bsr_bench.cli import build_parser, program
from bsr_bench.common.fio import fio_binary
from bsr_bench.common.stats import BenchError
from bsr_bench.striped import StripedOptions, run_striped

MIB = 1 << 20
#: the object format (src/bsr/core/_object.py): a 4 KiB header, payload_len (u64) at byte 84
MAGIC = b"BSR\x00OBJ\x01"
HEADER = 4096
PAYLOAD_LEN_AT = 8 + 2 + 2 + 16 + 32 + 16 + 8
#: kv-512k: 512 KiB chunks, one group -> 8 MiB is 16 objects
ARGS = ["--striped", "--quick", "--layout", "kv-512k", "--striped-bytes", "8MiB"]


class _Quiet:
    def print(self, *a: Any, **k: Any) -> None:
        pass


def _run(tmp: Path, *extra: str, **kw: Any) -> dict[str, Any]:
    argv = [*ARGS, "--path", str(tmp), "--json", str(tmp / "striped.json"), *extra]
    return run_striped(build_parser().parse_args(argv), console=_Quiet(), **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("striped")
    doc = _run(tmp, "--repeats", "2", "--keep")
    (base,) = tmp.glob("bsr-striped-*")
    return doc, base


def _payloads(root: Path) -> list[int]:
    """The payload length in the header of every object file under ``root``."""
    out = []
    for f in sorted(root.rglob("*.bsr")):
        head = f.read_bytes()[:HEADER]
        assert head[:8] == MAGIC, f
        (n,) = struct.unpack_from("<Q", head, PAYLOAD_LEN_AT)
        out.append(n)
    return out


def test_three_configurations_hold_and_restore_the_saved_bytes(
    run: tuple[dict[str, Any], Path],
) -> None:
    doc, base = run
    assert json.loads((base.parent / "striped.json").read_text()) == doc
    assert doc["tool"] == "bsr bench --striped"
    assert {"machine", "commit", "args"} <= set(doc)
    rows = doc["configurations"]
    assert [r["roots"] for r in rows] == [1, 2, 4]
    state = doc["state"]
    assert state["payload_bytes"] == 8 * MIB and state["objects"] == 16
    for r in rows:
        roots = [base / f"stripe-{r['roots']}" / f"root{i}" for i in range(r["roots"])]
        assert r["paths"] == [str(p) for p in roots]
        per_root = [_payloads(p) for p in roots]
        assert [len(x) for x in per_root] == r["objects_per_root"]
        assert sum(sum(x) for x in per_root) == r["bytes"] == state["payload_bytes"]
        assert r["bytes_read"] == [r["bytes"]] * 2
        assert r["verified"] is True and r["restores_verified"] == 2
    assert doc["verified"] is True


def test_scaling_follows_from_the_medians(run: tuple[dict[str, Any], Path]) -> None:
    doc, _ = run
    rows = {r["roots"]: r for r in doc["configurations"]}
    for r in rows.values():
        bw, wall = r["bandwidth_Bps"], r["restore_s"]
        assert bw["n"] == wall["n"] == 2
        assert bw["values"] == pytest.approx([r["bytes"] / s for s in wall["values"]])
        assert r["bandwidth_median_Bps"] == bw["median"]
        assert r["scaling_vs_1_root"] == pytest.approx(
            bw["median"] / rows[1]["bandwidth_Bps"]["median"]
        )
    assert rows[1]["scaling_vs_1_root"] == 1.0


def test_fio_reads_each_configuration_beside_it(run: tuple[dict[str, Any], Path]) -> None:
    doc, _ = run
    if fio_binary() is None:
        assert all(
            r["fio_median_Bps"] is None and r["bsr_vs_fio"] is None for r in doc["configurations"]
        )
        pytest.skip("fio is not installed: no fio figures to check (apt-get install fio)")
    assert doc["fio"]["available"] is True and doc["fio"]["config"] == "io_uring-1M-qd64"
    one = doc["configurations"][0]
    for r in doc["configurations"]:
        fio = r["fio_bandwidth_Bps"]
        assert r["fio_failed"] is None and fio["n"] == 2 and fio["min"] > 0
        assert r["fio_median_Bps"] == fio["median"]
        assert r["bsr_vs_fio"] == pytest.approx(r["bandwidth_median_Bps"] / fio["median"])
        assert r["fio_scaling_vs_1_root"] == pytest.approx(fio["median"] / one["fio_median_Bps"])
        assert r["fio_coverage"] == pytest.approx(1.0, abs=0.01)  # 512 KiB files, 512 KiB blocks


def test_roots_under_one_directory_are_reported_as_one_device(
    run: tuple[dict[str, Any], Path],
) -> None:
    doc, _ = run
    devices = doc["devices"]
    assert devices["shared"] is True and devices["distinct_devices"] == 1
    assert len({r["st_dev"] for r in devices["roots"]}) == 1
    assert "all 4 roots share one device" in doc["note"]
    assert "cannot add bandwidth" in doc["note"]
    assert doc["configurations"][0]["devices"]["shared"] is False  # one root shares nothing


def test_a_damaged_root_fails_the_run(tmp_path: Path) -> None:
    """A payload byte flipped in one object file after the 2-root save: the run refuses to
    report (the restore misses that object, or its bytes differ), it never reports a figure."""
    damaged: list[Path] = []

    def damage(n: int, roots: Any) -> None:
        if n != 2:
            return
        victim = next(f for r in roots for f in sorted(Path(r).rglob("*.bsr")))
        with open(victim, "r+b") as fh:
            fh.seek(HEADER + 100)
            byte = fh.read(1)
            fh.seek(HEADER + 100)
            fh.write(bytes([byte[0] ^ 0xFF]))
        damaged.append(victim)

    with pytest.raises(BenchError, match="2 roots"):
        _run(tmp_path, "--striped-roots", "2", "--no-fio", after_save=damage)
    assert damaged
    assert not (tmp_path / "striped.json").exists()


def test_flags_choose_the_program_and_its_options() -> None:
    ns = build_parser().parse_args(["--striped", "--striped-roots", "4,2"])
    assert program(ns)[0] == "--striped"
    opts = StripedOptions.from_namespace(ns)
    assert opts.roots == (1, 2, 4) and opts.state_bytes == 512 * MIB and opts.repeats == 5
    quick = StripedOptions.from_namespace(build_parser().parse_args(["--striped", "--quick"]))
    assert quick.state_bytes == 32 * MIB and quick.roots == (1, 2, 4)
    for bad in (["--striped-roots", "0"], ["--striped-roots", "x"], ["--striped-bytes", "a"]):
        with pytest.raises(BenchError):
            StripedOptions.from_namespace(build_parser().parse_args(["--striped", *bad]))
