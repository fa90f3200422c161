"""The request state machine: loaded from the spec table, strict, traced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bsr
from bsr.core._lifecycle import RequestLifecycle, load_spec, mermaid, table_edges

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_table_is_the_spec_file() -> None:
    assert load_spec() == json.loads((ROOT / "spec" / "request_lifecycle.json").read_text())


def test_enums_match_the_table() -> None:
    spec = load_spec()
    assert [s["name"] for s in spec["states"]] == [s.value for s in bsr.RequestState]
    assert {s["name"] for s in spec["states"] if s["terminal"]} == {
        s.value for s in bsr.RequestState if s.terminal
    }
    assert [r["name"] for r in spec["reasons"]] == [r.value for r in bsr.Reason]


def test_mermaid_diagram_is_not_stale() -> None:
    on_disk = (ROOT / "spec" / "request_lifecycle.mmd").read_text()
    assert on_disk == mermaid(), "regenerate with: bsr spec diagram --write"


LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 1, 64),))


def installed(n: int) -> set[tuple[int, str]]:
    return {(c, "kv") for c in range(n)}


def windowing(prefix: int = 3, policy: bsr.Policy = bsr.Policy.ALL_OR_NOTHING) -> RequestLifecycle:
    """A request in Windowing whose facts are the records of a run (nothing installed yet)."""
    life = RequestLifecycle("r")
    life.facts.layout = LAYOUT
    life.facts.policy = policy
    life.facts.prefix_chunks = prefix
    life.fire("probe_hit")
    life.facts.target_chunks = prefix
    return life


def test_happy_path() -> None:
    life = RequestLifecycle("r")
    assert life.state is bsr.RequestState.PROBING
    life.facts.layout = LAYOUT
    life.facts.prefix_chunks = 3
    life.fire("probe_hit")
    life.facts.target_chunks = 3
    life.facts.installed = installed(3)
    life.facts.agreed_chunks = 3
    life.fire("chunks_installed")
    life.facts.all_ranks_voted_yes = True
    life.fire("commit", bsr.Reason.COMPLETE)
    assert life.state is bsr.RequestState.COMMITTED and life.terminal
    assert [(t.source, t.dest) for t in life.trace] == [
        ("Probing", "Windowing"),
        ("Windowing", "Installed"),
        ("Installed", "Committed"),
    ]


def test_zero_length_probe_commits_empty() -> None:
    life = RequestLifecycle("r")
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("probe_hit")  # prefix 0: guard fails
    assert life.state is bsr.RequestState.PROBING
    life.fire("probe_miss", bsr.Reason.EMPTY_PREFIX)
    assert life.state is bsr.RequestState.COMMITTED


@pytest.mark.parametrize("trigger", ["commit", "chunks_installed", "truncate", "nonsense"])
def test_illegal_trigger_raises_and_changes_nothing(trigger: str) -> None:
    life = RequestLifecycle("r")
    with pytest.raises(bsr.IllegalTransitionError, match="not allowed in state Probing"):
        life.fire(trigger)
    assert life.state is bsr.RequestState.PROBING and life.trace == []


def test_guards_block_commit_before_every_chunk_is_installed() -> None:
    life = windowing(2)
    life.facts.agreed_chunks = 2
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("chunks_installed")
    assert life.state is bsr.RequestState.WINDOWING
    life.facts.installed = installed(2)
    life.fire("chunks_installed")
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("commit")  # other ranks have not agreed
    assert life.state is bsr.RequestState.INSTALLED


def test_guard_evaluates_the_installed_set_not_a_flag() -> None:
    """Every object but one installed: the guard computes that and rejects."""
    life = windowing(3)
    life.facts.agreed_chunks = 3
    life.facts.installed = installed(3) - {(1, "kv")}
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("chunks_installed")
    assert life.state is bsr.RequestState.WINDOWING and life.trace[-1].dest == "Windowing"


def test_guard_rejects_a_prefix_the_ranks_did_not_agree_on() -> None:
    life = windowing(3)
    life.facts.installed = installed(3)
    life.facts.agreed_chunks = 2  # another rank has less
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("chunks_installed")
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("truncate")  # all_or_nothing never truncates
    assert life.state is bsr.RequestState.WINDOWING


def test_truncate_guard_needs_the_truncate_policy_and_the_shorter_prefix() -> None:
    life = windowing(3, bsr.Policy.TRUNCATE)
    life.facts.installed = installed(2)
    life.facts.agreed_chunks = 3
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("truncate")  # agreed == target: not a truncation
    life.facts.agreed_chunks = 2
    life.fire("truncate")
    assert life.state is bsr.RequestState.INSTALLED


def test_commit_guard_rechecks_the_installed_prefix() -> None:
    life = windowing(2)
    life.facts.installed = set(installed(2))
    life.facts.agreed_chunks = 2
    life.fire("chunks_installed")
    life.facts.all_ranks_voted_yes = True
    life.facts.installed.discard((0, "kv"))  # e.g. a failed device sync cleared it
    with pytest.raises(bsr.GuardRejectedError):
        life.fire("commit")
    assert life.state is bsr.RequestState.INSTALLED


def test_terminal_states_accept_nothing() -> None:
    life = RequestLifecycle("r")
    life.invalidate(bsr.Reason.DEADLINE)
    assert life.state is bsr.RequestState.INVALIDATED and life.reason is bsr.Reason.DEADLINE
    for trig in {e.trigger for e in table_edges()}:
        with pytest.raises(bsr.IllegalTransitionError):
            life.fire(trig)
    assert life.invalidate(bsr.Reason.CANCELLED) is bsr.RequestState.INVALIDATED
    assert life.reason is bsr.Reason.DEADLINE  # the first reason stays


def test_invalidate_is_allowed_from_every_non_terminal_state() -> None:
    non_terminal = {s.value for s in bsr.RequestState if not s.terminal}
    sources = {e.source for e in table_edges() if e.trigger == "invalidate"}
    assert sources == non_terminal
