"""HCache's calibration: measured once per machine, kept in a file, reused by later processes,
measured again on ``refresh`` or when what the rates depend on changes (#49)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import bsr
from adapters.hcache_kit import build
from bsr import hcache
from bsr.hcache import _calibrate

pytest.importorskip("transformers")

KW: dict[str, Any] = dict(tokens=32, read_mib=1)


def _tier(p: str) -> bsr.FileTier:
    return bsr.FileTier(p, capacity_bytes=8 << 20)


def _forwards(model: Any) -> list[int]:
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def _fresh_process() -> None:
    """What a restarted server has: nothing calibrated in memory."""
    _calibrate._RATES.clear()


def test_rates_are_kept_in_a_file_and_reused_by_a_later_process(tmp_path: Path) -> None:
    model = build("llama", layers=2)
    calls = _forwards(model)
    first = hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, **KW)
    assert calls and first.source == "measured"
    (path,) = tmp_path.glob("hcache-rates-*.json")
    doc = json.loads(path.read_text())
    assert doc["key"] == hcache.calibration_key(model, tier_name="file", **KW)
    assert doc["rates"]["read_bytes_per_s"] == first.read_bytes_per_s
    _fresh_process()
    calls.clear()
    again = hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, **KW)
    assert again == first and not calls  # read back, nothing measured


def test_refresh_measures_again_and_rewrites_the_file(tmp_path: Path) -> None:
    model = build("llama", layers=2)
    hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, **KW)
    (path,) = tmp_path.glob("hcache-rates-*.json")
    before = json.loads(path.read_text())["measured_at"]
    calls = _forwards(model)
    _fresh_process()
    hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, refresh=True, **KW)
    assert calls
    assert json.loads(path.read_text())["measured_at"] > before


def test_what_the_rates_depend_on_names_the_file(tmp_path: Path) -> None:
    model = build("llama", layers=2)
    hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, **KW)
    hcache.calibrate(model, tier_factory=_tier, tier_name="nvme1", cache_dir=tmp_path, **KW)
    other = build("llama", layers=2).to(torch.bfloat16)
    calls = _forwards(other)
    hcache.calibrate(other, tier_factory=_tier, cache_dir=tmp_path, **KW)
    assert calls  # another dtype: measured, not read back
    assert len(list(tmp_path.glob("hcache-rates-*.json"))) == 3


@pytest.mark.parametrize("damage", ["{not json", '{"key": {}, "rates": {}}', "KEY-NEGATIVE"])
def test_a_damaged_file_is_measured_over(tmp_path: Path, damage: str) -> None:
    model = build("llama", layers=2)
    first = hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, **KW)
    (path,) = tmp_path.glob("hcache-rates-*.json")
    if damage == "KEY-NEGATIVE":  # the right key, a rate no machine has
        doc = json.loads(path.read_text())
        doc["rates"]["read_bytes_per_s"] = -1.0
        path.write_text(json.dumps(doc))
    else:
        path.write_text(damage)
    _fresh_process()
    calls = _forwards(model)
    again = hcache.calibrate(model, tier_factory=_tier, cache_dir=tmp_path, **KW)
    assert calls and again.read_bytes_per_s > 0 and again != first
    assert json.loads(path.read_text())["rates"]["read_bytes_per_s"] == again.read_bytes_per_s
