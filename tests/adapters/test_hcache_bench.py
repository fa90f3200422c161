"""`bsr bench --hcache`: the flag is registered, bad sizes are refused, the table reads the JSON.

The measurement itself is the bench's job (it is far too heavy for a unit test); these checks keep
the entry point and the report wired.
"""

from __future__ import annotations

from typing import Any

from bsr_bench import hcache as hb
from bsr_bench.cli import build_parser, run_from_namespace


def test_flag_is_registered_and_bad_sizes_are_refused(capsys: Any) -> None:
    ns = build_parser().parse_args(["--hcache", "--quick", "--sizes", "300"])
    assert ns.hcache and ns.quick
    assert run_from_namespace(ns) == 2
    assert "bsr bench --hcache: error: sizes must be multiples of 256" in capsys.readouterr().err


def _tier(kv: float, pipelined: float) -> dict[str, Any]:
    dist = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    return {
        "kv": {"total_s": {**dist, "median": kv}, "methods": ["kv"] * 8},
        "hcache": {"total_s": {**dist, "median": 0.5}, "methods": ["hidden"] * 8},
        "planner": {"total_s": {**dist, "median": kv}, "methods": ["kv"] * 8},
        "planner_same_as": "kv",
        "planner_regret": 1.0,
        "regime": {"planner": "storage-bound"},
        "ratios": {
            "recompute_vs_hcache": 8.0,
            "kv_vs_hcache": kv / 0.5,
            "recompute_vs_planner": 4.0 / kv,
            "kv_vs_planner": 1.0,
            "best_pure_vs_planner": 1.0,
        },
        "compute_to_io": 2.5,
        "pipelining": {"sequential_vs_pipelined": pipelined},
    }


def test_table_reports_ratios_next_to_the_paper() -> None:
    dist = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    point = {
        "model": "mha",
        "tokens": 1024,
        "recompute_s": {**dist, "median": 4.0},
        "tiers": {"file": _tier(0.1, 1.37), "host": _tier(0.05, 1.02)},
        "rebuild_vs_gemm": 1.2,
    }
    capture = {
        "overhead": 0.01,
        "overhead_of_mins": 0.02,
        "step_s_plain": dist,
        "hooks_s_per_step": 1e-4,
        "overhead_direct": 1e-4,
    }
    rates = {"project_s_per_token_layer": 3e-5, "read_bytes_per_s": 1e9}
    doc: dict[str, Any] = {
        "results": [point],
        "models": {
            "mha": {
                "compute_to_io": {"file": 7.5, "host": 9.0},
                "rates": {"file": rates, "host": {**rates, "read_bytes_per_s": 4e9}},
                "decode_capture": capture,
            }
        },
        "targets": {
            "rebuild_vs_gemm": {"limit": 1.3, "worst": 1.2, "met": True},
            "planner_regret": {"limit": 1.1, "worst": None, "met": None},
        },
        "why_different": "because",
    }
    text = hb.table(doc)
    assert "mha 1024 file: 1.37x" in text and "mha 1024 host: 1.02x" in text
    assert "8.00x" in text and "0.20x" in text and "0r/0h/8kv (= kv), storage-bound" in text
    assert "mha 1024 file: 2.50" in text
    assert "file: read 1.00 GB/s, compute/IO 7.50" in text and "host: read 4.00 GB/s" in text
    assert "target rebuild_vs_gemm <= 1.3: worst 1.20" in text and "met" in text
    assert "target planner_regret <= 1.1: no point" in text
    assert "5.73x vs recompute" in text and "1.93x vs KV" in text and "+1.0%" in text


def _measured_by(monkeypatch: Any, point: Any) -> None:
    """Two tiny models whose every point is ``point`` (no model built, nothing calibrated)."""
    shape = hb.Shape(64, 2, 4, 4, 128)
    monkeypatch.setitem(hb.SHAPES, "toy", {"mha": shape, "gqa": shape})
    monkeypatch.setattr(hb, "_model", lambda spec, seed, device, dtype: None)
    monkeypatch.setattr(hb, "_calibrated", lambda model, spec, quick: (None, {}))
    monkeypatch.setattr(hb, "_point", point)
    monkeypatch.setattr(hb, "_row", lambda p: "")


def test_the_state_directory_is_made_fresh_and_removed_after(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """The run saves its states in a fresh directory inside ``--path`` (or the system's
    temporary one) and removes it after, also when a point fails: runs used to leave 290 MB
    each in /tmp. The points stand in for the measurement (it is the bench's job): each writes
    a state file where the real one saves its tiers."""
    seen: list[Any] = []

    def point(model: Any, name: str, n: int, *rest: Any) -> dict[str, Any]:
        base = rest[-1]
        (base / f"{name}-{n}.state").write_bytes(b"x" * 4096)
        seen.append(base)
        if name == "gqa":
            raise RuntimeError("a point failed")
        return {"model": name, "tokens": n}

    _measured_by(monkeypatch, point)
    store = tmp_path / "store"
    try:
        hb.run_hcache([256], 1, True, str(tmp_path / "out.json"), str(store))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failing point did not raise")
    assert seen and all(b.parent == store and b.name.startswith("bsr-hcache-") for b in seen)
    assert store.is_dir() and list(store.iterdir()) == []


def test_a_cut_run_leaves_the_points_it_measured(tmp_path: Any, monkeypatch: Any) -> None:
    """The document is written again after every point, so a run cut short (a GPU step's time
    limit) leaves the points it measured, marked incomplete; a whole run is marked complete.
    The points stand in for the measurement (the bench's job); the file is real."""
    import json

    cut_at: list[int] = [2]
    done: list[tuple[str, int]] = []

    def point(model: Any, name: str, n: int, *rest: Any) -> dict[str, Any]:
        if len(done) == cut_at[0]:
            raise KeyboardInterrupt  # the step's limit: the process is stopped here
        done.append((name, n))
        return {"model": name, "tokens": n, "compute_to_io": 2.0}

    _measured_by(monkeypatch, point)
    out = tmp_path / "out" / "hcache.json"
    try:
        hb.run_hcache([256, 512], 1, True, str(out), str(tmp_path / "store"))
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the cut did not stop the run")
    doc = json.loads(out.read_text())
    assert doc["complete"] is False
    # size by size: a cut loses the largest size, not a model
    assert [(p["model"], p["tokens"]) for p in doc["results"]] == [("mha", 256), ("gqa", 256)]
    cut_at[0], done[:] = 99, []
    doc = hb.run_hcache([256, 512], 1, True, str(out), str(tmp_path / "store"))
    again = json.loads(out.read_text())
    assert again["complete"] is True and len(again["results"]) == 4 == len(doc["results"])
    assert [p.name for p in out.parent.iterdir()] == ["hcache.json"]  # no partial file left
