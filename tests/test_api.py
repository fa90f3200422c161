"""The public facade: curated names, typed errors under one root."""

from __future__ import annotations

import inspect

import bsr
import bsr.testing


def test_all_is_sorted_and_complete() -> None:
    public = {n for n in dir(bsr) if not n.startswith("_") and n not in {"annotations"}}
    modules = {n for n in public if inspect.ismodule(getattr(bsr, n))}
    assert set(bsr.__all__) == public - modules
    assert isinstance(bsr.__all__, tuple)
    for name in bsr.__all__:
        obj = getattr(bsr, name)
        assert name in {"FORMAT_VERSION", "NULL_BLOCK"} or obj.__module__.startswith("bsr")


def test_every_error_derives_from_bsr_error() -> None:
    errors = [getattr(bsr, n) for n in bsr.__all__ if n.endswith("Error")]
    assert len(errors) >= 15
    for e in errors:
        assert issubclass(e, bsr.BsrError), e
    assert issubclass(bsr.ObjectNotFoundError, FileNotFoundError)
    assert issubclass(bsr.TokenError, TypeError)
    assert issubclass(bsr.ConfigError, ValueError)
    assert issubclass(bsr.TierTimeoutError, TimeoutError)


def test_errors_carry_structured_fields() -> None:
    err = bsr.TierIOError("boom", tier="file", key="abc")
    assert err.tier == "file" and err.fields == {"tier": "file", "key": "abc"}
    assert "tier='file'" in str(err)


def test_testing_kit_exports() -> None:
    for name in bsr.testing.__all__:
        assert hasattr(bsr.testing, name)
