"""The paper-scale benches at tiny sizes: ``--l1-ladder``, ``--tp 2`` and the LMCache baseline.

Each test runs the real thing (real FileTier, real engines, real gloo processes, LMCache when its
venv exists) on states of a few KiB and checks the document against schema.json and against an
independent model of what the ladder must show.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bsr_bench.cli import build_parser
from bsr_bench.common.layouts import resolve_layout
from bsr_bench.common.stats import BenchError
from bsr_bench.paper.ladder import bsr_window, run_ladder, summarize
from bsr_bench.paper.lmcache import venv_python
from bsr_bench.paper.options import LadderOptions, parse_budgets, resolve_ladder
from bsr_bench.paper.scale import ChunkedState, Destination, DestinationKind
from bsr_bench.paper.tp import resolve_tp, run_tp

# 2 layers x 64 B per token, 16-token chunks: 2 KiB payload per chunk, 4 KiB slot (aligned)
TINY = json.dumps(
    {
        "name": "tiny",
        "chunk_tokens": 16,
        "groups": [
            {"name": "kv", "num_layers": 2, "token_bytes": 64},
            {"name": "idx", "num_layers": 2, "token_bytes": 8},
        ],
    }
)
KIB = 1024


def _ladder_opts(tmp_path: Path, **kw: Any) -> LadderOptions:
    base: dict[str, Any] = {
        "layout": TINY,
        "sizes": (64, 256),
        "budgets": (2 * KIB, 16 * KIB, 32 * KIB, 1024 * KIB),
        "max_window": 4,
        "io_depth": 2,
        "path": str(tmp_path),
        "keep": False,
        "destination": "memory",
        "direct_io": False,
        "lmcache": "off",
        "seed": 3,
        "json": str(tmp_path / "ladder.json"),
        "plots": str(tmp_path / "plots"),
        "no_plots": True,
        "quick": True,
    }
    base.update(kw)
    return LadderOptions(**base)


class _Quiet:
    def print(self, *a: Any, **k: Any) -> None:
        pass


def _model_first_budget(points: list[dict[str, Any]], tokens: int, need: int) -> int | None:
    """Independent model: the smallest budget of the run that is >= what the strategy stages."""
    budgets = sorted({p["budget_bytes"] for p in points})
    return next((b for b in budgets if b >= need), None)


@pytest.mark.slow
@pytest.mark.parametrize("destination", ["memory", "file"])
def test_ladder_document_and_invariants(tmp_path: Path, destination: str) -> None:
    opts = _ladder_opts(tmp_path, destination=destination)
    doc = run_ladder(opts, console=_Quiet())
    on_disk = json.loads(Path(opts.json).read_text())
    assert on_disk["tool"] == "bsr bench --l1-ladder"
    assert doc["destination"]["kind"] == destination
    slot = doc["layout"]["slot_bytes"]
    ct = doc["layout"]["chunk_tokens"]
    points = doc["points"]
    assert len(points) == 2 * len(opts.sizes) * len(opts.budgets)
    for p in points:
        chunks = p["tokens"] // ct
        plan = chunks * slot
        if p["strategy"] == "bsr":
            w = bsr_window(p["budget_bytes"], slot, opts.max_window)
            if w == 0:  # not even one slot fits: refused when the engine is built
                assert p["outcome"] == "config_error" and p["committed_tokens"] == 0
            else:  # RWS == W x slot for every BSR success (every size here has >= W chunks)
                assert p["outcome"] == "committed" and p["committed_tokens"] == p["tokens"]
                assert p["rws_peak_bytes"] == w * slot == p["window"] * slot
                assert p["verified"]["ok"]
        else:
            if plan > p["budget_bytes"]:  # below its budget: clean failure, no partial prefix
                assert p["outcome"] in ("invalidated", "config_error")
                assert p["committed_tokens"] == 0 and p["rws_peak_bytes"] == 0
                if p["outcome"] == "invalidated":
                    assert p["reason"] == "staging_budget"
            else:
                assert p["outcome"] == "committed" and p["rws_peak_bytes"] == plan
                assert p["verified"]["ok"] and p["verified"]["chunks_checked"] >= 1
    inv = doc["summary"]["invariants"]
    assert inv["bsr_rws_equals_w_x_slot"]["holds"]
    assert inv["whole_plan_fails_cleanly"]["holds"]
    for row in doc["summary"]["states"]:
        plan = row["tokens"] // ct * slot
        assert row["whole_plan"]["first_full_reuse_budget_bytes"] == _model_first_budget(
            points, row["tokens"], plan
        )
        assert row["bsr"]["first_full_reuse_budget_bytes"] == _model_first_budget(
            points, row["tokens"], slot
        )
    assert doc["lmcache"]["status"] == "off"
    from bsr_bench.paper.ladder_report import ladder_markdown, ladder_plot

    (png,) = ladder_plot(doc, tmp_path / "plots")
    assert Path(png).stat().st_size > 1000
    table = ladder_markdown(doc)
    assert table.count("\n| 64 |") == 2 and "| 256 |" in table  # summary row + grid row


def test_summary_flags_a_broken_invariant() -> None:
    """The invariants can fail: a partial whole-plan prefix or an RWS off W x slot is caught."""
    named = resolve_layout(TINY)
    slot = named.layout.slot_bytes
    good = {
        "tokens": 64,
        "budget_bytes": 8 * KIB,
        "strategy": "bsr",
        "window": 2,
        "outcome": "committed",
        "reason": "complete",
        "committed_tokens": 64,
        "rws_peak_bytes": 2 * slot,
    }
    wp = {
        "tokens": 64,
        "budget_bytes": 8 * KIB,
        "strategy": "whole_plan",
        "window": None,
        "outcome": "invalidated",
        "reason": "staging_budget",
        "committed_tokens": 0,
        "rws_peak_bytes": 0,
    }
    inv = summarize([good, wp], named)["invariants"]
    assert inv["bsr_rws_equals_w_x_slot"]["holds"] and inv["whole_plan_fails_cleanly"]["holds"]
    inv = summarize([{**good, "rws_peak_bytes": slot}, {**wp, "committed_tokens": 16}], named)[
        "invariants"
    ]
    assert not inv["bsr_rws_equals_w_x_slot"]["holds"]
    assert not inv["whole_plan_fails_cleanly"]["holds"]


def test_parse_budgets() -> None:
    assert parse_budgets("0.25,1") == (1 << 28, 1 << 30)
    assert parse_budgets("64MiB, 4096B,1GiB") == (4096, 64 << 20, 1 << 30)
    for bad in ("", "x", "0", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_budgets(bad)


def test_cli_flags_resolve() -> None:
    ns = build_parser().parse_args(
        ["--l1-ladder", "--ladder-sizes", "512,1024", "--ladder-budgets", "1MiB,2MiB"]
    )
    opts = resolve_ladder(ns)
    assert opts.sizes == (512, 1024) and opts.budgets == (1 << 20, 2 << 20)
    assert opts.layout == "dsv4-flash" and opts.max_window == 32
    with pytest.raises(BenchError, match="--ladder-sizes"):
        resolve_ladder(build_parser().parse_args(["--l1-ladder", "--ladder-sizes", "a"]))
    with pytest.raises(BenchError, match="at least 2 ranks"):
        resolve_tp(build_parser().parse_args(["--tp", "1"]))


@pytest.mark.anyio
async def test_chunked_state_digests_detect_a_wrong_destination(tmp_path: Path) -> None:
    named = resolve_layout(TINY)
    state = ChunkedState(named, tmp_path, 128, seed=1, ring_chunks=3, direct_io=False)
    dest = Destination(named, state.num_blocks, DestinationKind.FILE, tmp_path / "dst")
    save = await state.save(dest.fresh())  # the bench's own save path
    assert save["chunks"] == 8 and len(set(state.digests)) == 8  # random, distinct chunks
    cache = dest.fresh()  # all zeros: nothing restored yet
    assert not state.verify(cache, 128)["ok"]
    from bsr import RestoreEngine

    async with RestoreEngine(
        named.layout, [state.tier()], window=2, io_depth=2, namespace=state.namespace
    ) as eng:
        res = await eng.restore(state.tokens, cache, state.identity_ids())
        assert res.committed and res.committed_tokens == 128
    assert state.verify(cache, 128) == {
        "chunks_checked": 8,
        "chunks": 8,
        "mismatched": [],
        "ok": True,
    }
    cache.tensor("idx")[1, 5, 3, 7] ^= 0xFF  # one byte of block 5 = chunk 5 (one block a chunk)
    assert state.verify(cache, 128)["mismatched"] == [5]
    dest.close()
    assert not (tmp_path / "dst" / "kv.bin").exists()


def test_lmcache_absent_is_a_labelled_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bsr_bench.paper.lmcache as lb

    monkeypatch.setattr(lb, "venv_python", lambda root=None: tmp_path / "none" / "bin" / "python")
    named = resolve_layout(TINY)
    opts = _ladder_opts(tmp_path, lmcache="auto")
    out = lb.run_lmcache_ladder(opts, named, 256, tmp_path, _Quiet())
    assert out["status"] == "skipped" and "stands in" in out["message"]
    with pytest.raises(BenchError, match="lmcache-venv"):
        lb.run_lmcache_ladder(
            _ladder_opts(tmp_path, lmcache="require"), named, 256, tmp_path, _Quiet()
        )


@pytest.mark.skipif(not venv_python().exists(), reason="no .venv-lmcache (make lmcache-venv)")
def test_lmcache_ladder_real(tmp_path: Path) -> None:
    """LMCache 0.5.6 on CPU: full reuse only once L1 holds the whole plan; below, it blocks."""
    lay = json.dumps(
        {
            "name": "lm",
            "chunk_tokens": 256,
            "groups": [{"name": "kv", "num_layers": 4, "token_bytes": 256}],
        }
    )  # 256 KiB per chunk
    opts = _ladder_opts(
        tmp_path,
        layout=lay,
        sizes=(512, 2048),
        budgets=(768 * KIB, 4096 * KIB),
        lmcache="require",
    )
    doc = run_ladder(opts, console=_Quiet())
    lm = {(p["tokens"], p["budget_bytes"]): p for p in doc["points"] if p["strategy"] == "lmcache"}
    assert doc["lmcache"]["status"] == "ok" and doc["lmcache"]["version"] == "0.5.6"
    assert lm[(512, 768 * KIB)]["outcome"] == "committed"  # 512 KiB plan fits 768 KiB of L1
    assert lm[(2048, 768 * KIB)]["outcome"] == "failed"  # 2 MiB does not: LMCache blocks
    assert "under pressure" in lm[(2048, 768 * KIB)]["message"]
    assert lm[(2048, 4096 * KIB)]["outcome"] == "committed"


def test_tp2_agreement_and_fault(tmp_path: Path) -> None:
    ns = build_parser().parse_args(
        [
            "--tp",
            "2",
            "--quick",
            "--layout",
            TINY,
            "--ladder-sizes",
            "128",
            "-W",
            "2",
            "--path",
            str(tmp_path),
            "--json",
            str(tmp_path / "tp.json"),
        ]
    )
    opts = resolve_tp(ns)
    doc = run_tp(opts, console=_Quiet())
    assert json.loads((tmp_path / "tp.json").read_text())["tool"] == "bsr bench --tp"
    slot = doc["layout"]["slot_bytes"]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        assert r["rws_peak_bytes"] == 2 * slot
        assert r["committed_tokens"] == [128] * opts.repeats
        assert all(s["verified"]["ok"] for s in r["agreed"])
    assert doc["fault"]["failing_rank"] == 1
    for f in doc["fault"]["ranks"]:
        assert f["state"] == "Invalidated" and f["committed_tokens"] == 0
    assert all(v["holds"] for v in doc["invariants"].values())
    assert isinstance(doc["agreement"]["overhead_s_max"], float)


def test_ssd_concurrency_row(tmp_path: Path) -> None:
    """The SSD row at a tiny size: every depth restores the same state byte-exact, RWS stays
    W x slot at every depth, the ratios follow from the medians, fio sits beside each point."""
    from bsr_bench.common.fio import fio_binary
    from bsr_bench.paper.ssd import run_ssd

    ns = build_parser().parse_args(
        [
            "--ssd-concurrency",
            "--layout",
            TINY,
            "--ladder-sizes",
            "256",
            "--ssd-depths",
            "1,4",
            "-W",
            "4",
            "--repeats",
            "2",
            "--path",
            str(tmp_path),
            "--destination",
            "file",
            "--json",
            str(tmp_path / "ssd.json"),
        ]
    )
    doc = run_ssd(ns, console=_Quiet())
    assert json.loads((tmp_path / "ssd.json").read_text())["tool"] == "bsr bench --ssd-concurrency"
    rows = {r["reads_in_flight"]: r for r in doc["points"]}
    assert list(rows) == ["1", "4", "default"]
    assert rows["1"]["read_depth"] == 1 and rows["1"]["io_depth"] == 1
    assert rows["4"]["read_depth"] == 4 and rows["4"]["io_depth"] == 4
    slot = doc["slot_bytes"]
    assert all(r["rws_peak_bytes"] == 4 * slot for r in rows.values())
    assert doc["rws_equals_w_x_slot"] is True
    assert all(r["ttft_s"]["n"] == 2 for r in rows.values())
    assert set(doc["verified"]) == {"1", "4", "default"}
    assert all(v["ok"] for v in doc["verified"].values())
    one, default = rows["1"]["ttft_s"]["median"], rows["default"]["ttft_s"]["median"]
    assert doc["ratios"]["ttft_1_vs_default"] == pytest.approx(one / default)
    assert doc["target"]["value"] == doc["ratios"]["ttft_1_vs_default"]
    assert doc["target"]["met"] == (doc["target"]["value"] >= 2.0)
    if fio_binary() is None:
        assert all(r["fio_bandwidth_Bps"] is None for r in rows.values())
    else:
        assert all(r["fio_bandwidth_Bps"] and r["fio_bandwidth_Bps"] > 0 for r in rows.values())
        assert doc["ratios"]["fio_default_vs_1"] == pytest.approx(
            rows["default"]["fio_bandwidth_Bps"] / rows["1"]["fio_bandwidth_Bps"]
        )
