"""The Promela model spec/bsr.pml: verified by spin, and kept in step with the lifecycle table.

(a) exhaustive spin runs (safety, invalid end states, no infinite executions);
(b) the states and (source, trigger, dest) transitions of the model agree with
    spec/request_lifecycle.json, statically and by reachability under spin;
(c) deliberate mutations of the model are caught, so a green run means something.

The spin tests skip when spin (or a C compiler) is not on PATH, except under CI=true, where
they fail: CI must run them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from spin_check import PAN_TEST_TIMEOUT_S, Mutation, Tools, build_pan, mutate, pan, run_pan, tools

pytestmark = pytest.mark.timeout(PAN_TEST_TIMEOUT_S)  # a hang guard (spin_check)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "spec" / "bsr.pml"
TABLE = ROOT / "spec" / "request_lifecycle.json"
NAME = "bsr.pml"  # pan names the model's file in its reports (the unreached-code check reads it)

# Table transitions the model deliberately leaves out, each with the reason. Empty: the model
# exercises every transition of the table, including the opt-in `truncate` policy (init picks
# the policy nondeterministically). Add an entry here, with a reason, before dropping one.
NOT_MODELLED: dict[tuple[str, str, str], str] = {}

Triple = tuple[str, str, str]


def _tools() -> Tools:
    return tools("spec/bsr.pml")


def _model_text() -> str:
    return MODEL.read_text()


# ---------------------------------------------------------------------------------------------
# (a) exhaustive verification

# -O1: at this model size pan searches as fast as with -O2 and compiles in half the time.
VERIFY_MODES: dict[str, tuple[list[str], list[str]]] = {
    # assertions (invariants 1-4) and invalid end states, no cycle machinery
    "safety": (["-O1", "-DSAFETY"], []),
    # the full (non-SAFETY) verifier: assertions and invalid end states (deadlock)
    "full": (["-O1"], []),
    # non-progress cycles with no progress label: any cycle at all is reported, so errors: 0
    # means every execution is finite, i.e. every request terminates (invariant 5)
    "termination": (["-O1", "-DNP"], ["-l"]),
}


@pytest.mark.parametrize("mode", list(VERIFY_MODES))
def test_model_verifies_exhaustively(tmp_path: Path, mode: str) -> None:
    found = _tools()
    cflags, args = VERIFY_MODES[mode]
    run = pan(found, _model_text(), tmp_path, cflags, args, NAME)
    out = run.output
    assert "Full statespace search" in out, out
    assert "Search not completed" not in out, out
    assert not re.search(r"pan:\d+: ", out), f"pan reported a violation:\n{out}"
    assert run.errors == 0, out
    assert "invalid end state (" not in out, out
    if mode == "termination":
        assert re.search(r"non-progress cycles\s+\+", out), out
    else:
        # end-state checking was on (a never claim would switch it off)
        assert re.search(r"invalid end states\s+\+", out), out
        assert re.search(r"assertion violations\s+\+", out), out
    if mode == "safety":
        # every statement of the model is reachable (the observer's loop never exits)
        unreached = [
            line
            for line in out.splitlines()
            if re.match(r"\s*bsr\.pml:\d+, state \d+,", line) and '"-end-"' not in line
        ]
        assert not unreached, "unreached code in the model:\n" + "\n".join(unreached)
    print(
        f"\nspin {mode}: {run.stat('states, stored')} states stored, depth {run.depth}, "
        f"pan {run.seconds:.2f} s"
    )


# ---------------------------------------------------------------------------------------------
# (b) the model and the table agree


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


@dataclass(frozen=True)
class Inline:
    name: str
    params: tuple[str, ...]
    body: str
    start: int  # offset of `inline` in the comment-free text
    end: int  # offset just past the closing brace


def _inlines(code: str) -> Iterator[Inline]:
    for m in re.finditer(r"\binline\s+(\w+)\s*\(([^)]*)\)\s*\{", code):
        depth, i = 1, m.end()
        while depth:
            assert i < len(code), f"unbalanced braces in inline {m.group(1)}"
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        params = tuple(p.strip() for p in m.group(2).split(",") if p.strip())
        yield Inline(m.group(1), params, code[m.end() : i - 1], m.start(), i)


def _mtypes(code: str) -> set[str]:
    names: set[str] = set()
    for body in re.findall(r"\bmtype\s*(?::\s*\w+\s*)?=\s*\{([^}]*)\}", code):
        names.update(n.strip() for n in body.split(",") if n.strip())
    return names


def _table() -> dict[str, object]:
    data: dict[str, object] = json.loads(TABLE.read_text())
    return data


def _table_states() -> list[str]:
    states = _table()["states"]
    assert isinstance(states, list)
    return [str(s["name"]) for s in states]


def _table_triples() -> set[Triple]:
    transitions = _table()["transitions"]
    assert isinstance(transitions, list)
    triples: set[Triple] = set()
    for t in transitions:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        triples.update((str(s), str(t["trigger"]), str(t["dest"])) for s in sources)
    return triples


def _table_triggers() -> set[str]:
    return {trigger for _, trigger, _ in _table_triples()}


@dataclass(frozen=True)
class ModelSpec:
    code: str  # comment-free model text
    mtypes: set[str]
    initial: str
    triggers: dict[str, Inline]
    triples: set[Triple]


STATE_ASSIGN = re.compile(r"\bstate\s*\[[^\]]*\]\s*=(?!=)\s*(\w+)")
STATE_TEST = re.compile(r"\bstate\s*\[[^\]]*\]\s*==\s*(\w+)\b(?!\s*\[)")


def _parse_model(text: str) -> ModelSpec:
    code = _strip_comments(text)
    decl = re.search(r"\bmtype\s+state\s*\[\s*\w+\s*\]\s*=\s*(\w+)\s*;", code)
    assert decl is not None, "the model must declare `mtype state[NR] = <initial>;`"
    triggers: dict[str, Inline] = {}
    triples: set[Triple] = set()
    for inl in _inlines(code):
        dests = STATE_ASSIGN.findall(inl.body)
        if not dests:
            continue
        assert len(dests) == 1, f"inline {inl.name} changes state[] more than once: {dests}"
        first = re.match(r"\s*assert\s*\((.*?)\)\s*;", inl.body, flags=re.S)
        assert first is not None, f"inline {inl.name} must start with assert(state[r] == ...)"
        sources = STATE_TEST.findall(first.group(1))
        assert sources, f"inline {inl.name}: its first assert names no source state"
        triggers[inl.name] = inl
        triples.update((src, inl.name, dests[0]) for src in sources)
    return ModelSpec(code, _mtypes(code), decl.group(1), triggers, triples)


def test_model_states_and_transitions_match_table() -> None:
    model = _parse_model(_model_text())
    table_states = _table_states()
    table_triples = _table_triples()

    # the request states are the table's states, under the same names
    missing_states = set(table_states) - model.mtypes
    assert not missing_states, f"states of the table missing from the model: {missing_states}"
    used = set(STATE_TEST.findall(model.code)) | set(STATE_ASSIGN.findall(model.code))
    assert used <= set(table_states), f"state values not in the table: {used - set(table_states)}"
    assert model.initial == _table()["initial"]

    # state[] changes only inside the inlines named after the triggers
    assert set(model.triggers) <= _table_triggers(), (
        f"inlines that change state[] but are no trigger of the table: "
        f"{set(model.triggers) - _table_triggers()}"
    )
    outside = model.code
    for inl in sorted(model.triggers.values(), key=lambda i: i.start, reverse=True):
        outside = outside[: inl.start] + outside[inl.end :]
    outside = re.sub(r"\bmtype\s+state\s*\[\s*\w+\s*\]\s*=\s*\w+\s*;", " ", outside)
    stray = STATE_ASSIGN.findall(outside)
    assert not stray, f"state[] assigned outside the trigger inlines: {stray}"

    # every trigger inline is used by the model
    for name in model.triggers:
        assert re.search(rf"\b{name}\s*\(", outside), f"trigger inline {name} is never called"

    # (source, trigger, dest): every model transition is in the table, every table transition
    # is in the model unless explicitly allow-listed
    assert model.triples <= table_triples, (
        f"model transitions not in the table: {sorted(model.triples - table_triples)}"
    )
    assert set(NOT_MODELLED) <= table_triples, "NOT_MODELLED names transitions not in the table"
    assert not (set(NOT_MODELLED) & model.triples), "NOT_MODELLED lists modelled transitions"
    uncovered = table_triples - model.triples - set(NOT_MODELLED)
    assert not uncovered, f"table transitions the model does not have: {sorted(uncovered)}"


def test_model_is_big_enough_to_mean_something() -> None:
    """2 ranks, 2 groups, 3 chunks, a window of 2 chunk slots that the reader can fill."""
    code = _strip_comments(_model_text())
    sizes = {k: int(v) for k, v in re.findall(r"#define\s+(NR|NG|NC|W)\s+(\d+)\b", code)}
    assert sizes.keys() == {"NR", "NG", "NC", "W"}, sizes
    assert sizes["NR"] >= 2 and sizes["NG"] >= 2 and sizes["NC"] >= 3, sizes
    assert 1 <= sizes["W"] < sizes["NC"], "the window must be able to fill up"


def test_model_reasons_are_table_reasons() -> None:
    model = _parse_model(_model_text())
    reasons = _table()["reasons"]
    assert isinstance(reasons, list)
    table_reasons = {str(r["name"]) for r in reasons}
    # lower-case mtype names are reasons; states are CamelCase, messages UPPER_CASE
    model_reasons = {name for name in model.mtypes if name.islower()}
    assert model_reasons, "the model declares no reasons"
    assert model_reasons <= table_reasons, f"unknown reasons: {model_reasons - table_reasons}"
    assert "empty_prefix" in model_reasons  # a zero-length probe commits 0 tokens


def _reach_var(triple: Triple) -> str:
    src, trigger, _ = triple
    return f"reach_{trigger}_{src}"


def _instrument_for_reachability(text: str, triples: set[Triple]) -> str:
    """Set a bit for each (source, trigger) as the trigger fires; one never claim per bit."""
    model = _parse_model(text)
    out = text
    # work on the original text: find each trigger inline's opening brace there
    for name, inl in model.triggers.items():
        r = inl.params[0]
        branches = "".join(
            f"  :: state[{r}] == {src} -> {_reach_var((src, trig, dst))} = 1\n"
            for src, trig, dst in sorted(triples)
            if trig == name
        )
        probe = f"\n  if\n{branches}  :: else -> skip\n  fi;\n"
        head = re.search(rf"\binline\s+{name}\s*\([^)]*\)\s*\{{", out)
        assert head is not None
        out = out[: head.end()] + probe + out[head.end() :]
    decls = "".join(f"bit {_reach_var(t)};\n" for t in sorted(triples))
    claims = "".join(f"ltl p_{_reach_var(t)} {{ [] !{_reach_var(t)} }}\n" for t in sorted(triples))
    return decls + out + "\n" + claims


def test_every_modelled_transition_is_reachable(tmp_path: Path) -> None:
    """Exhaustively, not just textually: spin finds a run firing each (source, trigger)."""
    found = _tools()
    model = _parse_model(_model_text())
    triples = model.triples
    text = _instrument_for_reachability(_model_text(), triples)
    pan_bin = build_pan(found, text, tmp_path, ["-O0", "-DSAFETY"], NAME)
    unreachable: list[Triple] = []
    for triple in sorted(triples):
        out = run_pan(pan_bin, ["-N", f"p_{_reach_var(triple)}"]).output
        hit = re.search(rf"pan:1: assertion violated .*\b{_reach_var(triple)}\b", out)
        if not hit:
            assert "errors: 0" in out, f"unexpected pan output for {triple}:\n{out}"
            unreachable.append(triple)
    assert not unreachable, f"transitions no run of the model takes: {unreachable}"


# ---------------------------------------------------------------------------------------------
# (c) the check can fail


I1 = r"assertion violated \(\(\(\(j/2\)%3\)>=\w+\)\|\|\(inst\[j\]&&ver\[j\]\)\)"  # commit/reader
I1_OBSERVER = I1.replace(r"\w+", "pub")  # the reader process
I2 = r"assertion violated .*committed\["  # end of run: one outcome, the agreed prefix or 0
I2_BLOCKS = r"assertion violated \(inst\[j\]=="  # end of run: exactly the committed blocks valid
SAME_STATE = r"assertion violated \(state\[r\]==state\[0\]\)"  # end of run: one state everywhere
I3 = r"assertion violated \(slots\[r\]<=2\)"
I4 = r"assertion violated \(\(slots\[r\]==0\)&&\(q_len\(staged\[r\]\)==0\)\)"
DEADLOCK = r"invalid end state"

VOTE = "  agree_all(R_VOTE, (state[r] == Installed && !sync_failed), best);\n"
OWN_VOTE = "  best = ((state[r] == Installed && !sync_failed) -> 1 : 0);\n"
COMMIT_CHECK = "  assert_prefix_installed(n);         /* nothing partial becomes reusable */\n"
END_CHECKS = "nfinished == NR;"

MUTATIONS: dict[str, Mutation] = {
    "commit_without_agree_all": Mutation(
        ((VOTE, OWN_VOTE),),
        f"{I1}|{I2}",
        "an installed rank commits on its own vote, without agree_all",
    ),
    "observer_sees_early_commit": Mutation(
        ((VOTE, OWN_VOTE), (COMMIT_CHECK, ""), (END_CHECKS, "end0: false;")),
        I1_OBSERVER,
        "same, with the commit-time and end-of-run checks removed: the reader process alone "
        "catches the exposed prefix",
    ),
    "agree_all_ignores_votes": Mutation(
        (("  collective(rd, res, res)\n", "  collective(rd, 1, res)\n"),),
        f"{I1}|{I2}",
        "agree_all answers yes whatever the votes",
    ),
    "timed_out_vote_still_counts": Mutation(
        (("failed[rd] = true; done[rd] = true; res = FAILED }", "res = FAILED }"),),
        f"{I1}|{I2}|{SAME_STATE}",
        "a rank that timed out in a collective leaves its value in the round, so a later rank "
        "completes the round with it (the time-out does not fail the round for everyone)",
    ),
    "late_probe_not_agreed": Mutation(
        (("r == SLOW -> late = true; best = LATE", "r == SLOW -> late = true; best = 0"),),
        SAME_STATE,
        "a rank whose probe ran past its deadline proposes an empty prefix instead of LATE: it "
        "ends Invalidated while the others commit the empty prefix (issue 19 item 8)",
    ),
    "own_probe_instead_of_agreed_min": Mutation(
        (("target = m; probe_hit(r)", "target = NC; probe_hit(r)"),),
        I2,
        "a rank restores the prefix it probed instead of the agreed MIN",
    ),
    "forward_unverified_chunk": Mutation(
        ((":: g == NG -> staged[r] ! STAGED, c;", ":: g > 0 -> staged[r] ! STAGED, c;"),),
        I1,
        "the reader hands over a chunk when only some of its groups were read and verified",
    ),
    "truncate_keeps_blocks_past_prefix": Mutation(
        (("       drop_from(r, m);                       /* never a partial chunk */\n", ""),),
        I2_BLOCKS,
        "truncate leaves the blocks past the agreed prefix valid",
    ),
    "window_overrun": Mutation(
        (("slots[r] < W) ->", "slots[r] <= W) ->"),),
        I3,
        "the reader takes a slot when all W are in use",
    ),
    "leak_slot_on_failed_read": Mutation(
        (("slots[r]--;                                   /* give the slot back */", ""),),
        I4,
        "a failed read keeps its staging slot",
    ),
    "deadline_without_drain": Mutation(
        (("late = true; cancel[r] = true }", "late = true; cancel[r] = true; break }"),),
        I4,
        "on deadline the request stops without draining the staged chunks",
    ),
    "reader_ignores_cancel": Mutation(
        (("(c == n || cancel[r])", "(c == n)"),),
        DEADLOCK,
        "a cancelled reader never ends its stream: the request waits forever",
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(tmp_path: Path, name: str) -> None:
    found = _tools()
    mutation = MUTATIONS[name]
    # -O0: the compile dominates, and pan stops at the first violation
    run = pan(found, mutate(_model_text(), mutation), tmp_path, ["-O0", "-DSAFETY"], (), NAME)
    assert run.errors >= 1, f"{name} ({mutation.doc}) was not caught:\n{run.output}"
    first = run.first_violation
    assert first is not None, run.output
    assert re.search(mutation.expect, first), (
        f"{name}: expected /{mutation.expect}/, pan reported: {first}"
    )
