"""The Promela model spec/connector.pml of the vLLM connector protocol, verified by spin.

(a) exhaustive spin runs: every assertion and end state (properties a-h), and every fair run
    ends (ltl ``terminates``);
(b) the interleavings the model is for are reachable (aborts and preemptions during loads,
    outcomes before and after ``request_finished``, blocks reused after a load, ...): the
    safety run of (a), its events instrumented, passes through each, so it is not vacuous;
(c) deliberate mutations of the model, each a broken variant of the protocol, are caught by
    the property meant to catch them;
(d) the model and src/bsr/vllm name the same methods and fields (no spin needed).

The spin tests skip when spin (or a C compiler) is not on PATH, except under CI=true, where
they fail: CI must run them. spec/README.md ("The connector model") explains the model.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from spin_check import (
    PAN_TEST_TIMEOUT_S,
    Mutation,
    PanRun,
    Tools,
    build_pan,
    mutate,
    pan,
    run_pan,
    tools,
)
from support.source import parse_file

pytestmark = pytest.mark.timeout(PAN_TEST_TIMEOUT_S)  # a hang guard (spin_check)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "spec" / "connector.pml"
SRC = ROOT / "src" / "bsr" / "vllm"
NAME = "connector.pml"

#: pan's depth limit: the deepest run is about 3,300 steps
DEPTH = "-m100000"


def _model_text() -> str:
    return MODEL.read_text()


def _tools() -> Tools:
    return tools("spec/connector.pml")


# ---------------------------------------------------------------------------------------------
# (a) exhaustive verification

# -O1: pan searches about twice as fast as at -O0 and compiles in a few seconds.
SAFETY = (["-O1", "-DSAFETY", "-DNOCLAIM"], [DEPTH])
LIVENESS = (["-O1"], ["-a", "-f", "-N", "terminates", DEPTH])


@pytest.mark.slow
def test_model_verifies_exhaustively(tmp_path: Path) -> None:
    """Every assertion (properties a-g), and the end checks of every run that ends (h); and
    every interleaving the model is meant to have is one of its runs.

    One exhaustive run of the model with its events instrumented (:func:`_instrument`: each
    probe is a step on hidden flags, so the runs, assertions and end states are the model's
    own, with more interleaving points) checks both; an event's statement that pan never
    reached (in every copy of the inline it is in) is an interleaving no run of the model has.
    """
    found = _tools()
    events = {**EVENTS, "never": NEVER}
    cflags, args = SAFETY
    pan_bin = build_pan(found, _instrument(_model_text(), events), tmp_path, cflags, NAME)
    run = run_pan(pan_bin, args)
    out = run.output
    assert run.complete, out
    assert run.errors == 0 and run.first_violation is None, out
    assert "invalid end state (" not in out, out
    assert re.search(r"invalid end states\s+\+", out), out
    assert re.search(r"assertion violations\s+\+", out), out
    table = (tmp_path / "pan.t").read_text()  # pan's transitions: one per copy of a statement
    unreached = []
    for name, ev in events.items():
        stmt = f'"ev_{name} = 1"'
        copies = len(re.findall(rf"settr\(.*{stmt}", table))
        assert copies >= 1, f"event {name}: its statement is not in pan's transitions"
        if out.count(stmt) >= copies:
            unreached.append(f"{name}: {ev.doc}")
    assert unreached == [f"never: {NEVER.doc}"], "no run of the model does:\n" + "\n".join(
        unreached
    )
    print(
        f"\nspin safety and reachability: {run.stat('states, stored')} states stored, "
        f"{run.stat('transitions')} transitions, depth {run.depth}, pan {run.seconds:.1f} s"
    )


@pytest.mark.slow
def test_every_fair_run_ends(tmp_path: Path) -> None:
    """ltl ``terminates`` (<> ended) under weak fairness: no run loops forever with a request,
    a load, a save or a block left over (a load never reported, a block never given back)."""
    found = _tools()
    cflags, args = LIVENESS
    run = pan(found, _model_text(), tmp_path, cflags, args, NAME)
    out = run.output
    assert run.complete, out
    assert run.errors == 0 and run.first_violation is None, out
    assert re.search(r"acceptance\s+cycles\s+\+ \(fairness enabled\)", out), out
    print(
        f"\nspin liveness: {run.stat('states, stored')} states stored, "
        f"{run.stat('visited')} visited, depth {run.depth}, pan {run.seconds:.1f} s"
    )


def test_model_is_big_enough_to_mean_something() -> None:
    """Two requests sharing a prefix of at least two chunks, every block of both in the pool
    (and reused), two engine steps in flight, two preemptions of a request."""
    sizes = {
        k: int(v)
        for k, v in re.findall(r"#define\s+(NREQ|NL|NB|NS|MAXPRE)\s+(\d+)\b", _model_text())
    }
    assert sizes.keys() == {"NREQ", "NL", "NB", "NS", "MAXPRE"}, sizes
    assert sizes["NREQ"] == 2 and sizes["NL"] >= 2, sizes  # the model writes [0] and [1]
    assert sizes["NB"] == sizes["NREQ"] * sizes["NL"], sizes  # room for both, blocks reused
    assert sizes["NS"] >= 2 and sizes["MAXPRE"] >= 2, sizes  # poison_only_the_loaded_blocks


# ---------------------------------------------------------------------------------------------
# (b) the interleavings are there


@dataclass(frozen=True)
class Event:
    anchor: str  # an exact line of the model: the probe goes right before it
    when: str  # a Promela condition, true when the event happens there
    doc: str
    #: extra ghost state: its declaration, and a statement to put right after an exact line
    ghost: tuple[str, str, str] | None = None


EVENTS: dict[str, Event] = {
    "abort_during_async_load": Event(
        '       :: vst[r] != Finished -> printf("MSC: R%d aborted\\n", r); finish_requests(r)',
        "vst[r] == WaitingForRemoteKVs && rst[r] != 0",
        "a request is aborted while its async load's restore runs",
    ),
    "abort_during_sync_load": Event(
        '       :: vst[r] != Finished -> printf("MSC: R%d aborted\\n", r); finish_requests(r)',
        "sync_mode && rst[r] != 0",
        "a request is aborted while its sync load runs (its step is executing)",
    ),
    "preempt_during_sync_load": Event(
        '  printf("MSC: R%d preempted\\n", r);',
        "rst[r] != 0",
        "vLLM preempts a request while its sync load runs (the next step is scheduled first)",
    ),
    "failed_outcome_after_request_finished": Event(
        "  :: !known[r] -> release_inflight(r)",
        "!ok",
        "a failed load's outcome arrives after request_finished",
    ),
    "ok_outcome_after_request_finished": Event(
        "  :: !known[r] -> release_inflight(r)",
        "ok",
        "a committed load's outcome arrives after request_finished (aborted meanwhile)",
    ),
    "request_finished_after_failed_outcome": Event(
        "  cdelay = false;\n  was = known[r];",
        "known[r] && failed[r]",
        "request_finished comes after the request's load was reported failed",
    ),
    "saved_after_its_load_committed": Event(
        '        printf("MSC: R%d SaveJob %d chunks\\n", r, n);',
        "loaded[r]",
        "a request whose load committed is saved (its chunks verified-installed)",
        ("bool loaded[NREQ];", "       wok[r] = true;", "loaded[r] = true;"),
    ),
    "two_steps_in_flight_during_load": Event(
        "       schedule(nfl);",
        "nfl == 1 && (rst[0] != 0 || rst[1] != 0)",
        "a step is scheduled while another is in flight and a load runs (batch queue)",
    ),
    "load_past_vllms_hit": Event(
        "     jpend[r] = true; ocpend[r] = true; rcpend[r] = !sync_mode;",
        "lst[r] > 0",
        "a load starts past vLLM's own prefix-cache hit",
    ),
    "deferred_while_other_loads": Event(
        "           :: !sync_mode && deferred -> ext = NONE_T                 /* deferred */",
        "true",
        "a request waits while another loads its chunks",
    ),
    "block_written_by_a_load_reused": Event(
        "     held[b] = BIT(r);",
        "lastw[b] != NOR && lastw[b] != r",
        "vLLM hands a block that one request's load wrote to the other request",
        (
            "byte lastw[NB] = NOR;",
            "          content[b] = GARB;                       /* installed, not verified yet */",
            "lastw[b] = r;",
        ),
    ),
    "allocation_while_a_save_reads": Event(
        "     held[b] = BIT(r);",
        "wsv[1 - r] == 1",
        "vLLM allocates blocks while the other request's save runs",
    ),
    "failed_sync_load_truncates": Event(
        "                       mine = true; nct[r] = k;  /* truncated at the first failed block",
        "true",
        "vLLM truncates a running request at the first block its sync load did not fill",
    ),
    "fail_policy_finishes_with_error": Event(
        "     :: HAS(errs, r) && vst[r] != Finished -> finish_requests(r)",
        "true",
        'kv_load_failure_policy="fail" ends a request with an error',
    ),
    "tainted_by_a_poisoned_block": Event(
        "     :: k < loc && HAS(poison, TB(r, k)) -> known[r] = true; tainted[r] = true",
        "true",
        "vLLM admits a request on a block a failed sync load left in its prefix cache",
    ),
    "poison_cleared_by_recompute": Event(
        "           poison = poison & ~BIT(TB(r, k)); powner[TB(r, k)] = NOR",
        "true",
        "a request that recomputed its failed sync load's blocks in place finishes",
    ),
    "poison_cleared_by_fresh_allocation": Event(
        "     :: k >= loc && HAS(poison, TB(r, k)) -> poison = poison & ~BIT(TB(r, k)); "
        "powner[TB(r, k)] = NOR",
        "true",
        "vLLM gives a poisoned block out afresh",
    ),
}


#: an event no run can have: the check must call it unreached (the method can fail)
NEVER = Event('  printf("MSC: R%d preempted\\n", r);', "false", "control: never happens")


def _instrument(text: str, events: dict[str, Event]) -> str:
    """A statement ``ev_<name> = 1`` per event, run only where and when the event happens.

    The flags are ``hidden``: outside the state vector, so they add no states (nothing reads
    them; pan's report of the statements it never reached is what counts). An assignment to a
    global is never merged into the guard before it, so it is reached only when the guard holds.
    """
    decls, probes = [], []  # probes: (offset in the original text, Promela to insert there)
    for name, ev in events.items():
        assert text.count(ev.anchor) == 1, f"event {name}: anchor found {text.count(ev.anchor)}x"
        probe = f"if :: ({ev.when}) -> ev_{name} = 1 :: else -> skip fi; "
        at = text.index(ev.anchor)
        if ev.anchor.lstrip().startswith("::"):  # an option: the probe goes after its guard
            probes.append((text.index("->", at) + len("->"), " " + probe))
        else:  # a statement: the probe goes right before it
            probes.append((at + len(ev.anchor) - len(ev.anchor.lstrip()), probe))
        decls.append(f"hidden byte ev_{name};\n")
        if ev.ghost is not None:
            decl, where, stmt = ev.ghost
            assert text.count(where) == 1, f"event {name}: ghost anchor not unique"
            decls.append(decl + "\n")
            probes.append((text.index(where) + len(where), f"\n{stmt}"))
    for at, code in sorted(probes, key=lambda p: p[0], reverse=True):
        text = text[:at] + code + text[at:]
    head = text.index("\nmtype = {")  # after the #defines
    return text[:head] + "\n" + "".join(decls) + text[head:]


# ---------------------------------------------------------------------------------------------
# (c) the checks can fail


A = r"assertion violated \(content\[b\]=="  # (a) a save read a block without verified KV
B = r"assertion violated (\s*!\(wrep\[r\]\)|\(sync_mode\|\|)"  # (b) a write after the report
C = r"assertion violated (rcpend|ocpend)\[r\]"  # (c) a second report
C_MISSING = r"assertion violated \( !\(ocpend\[r\]\)"  # (c) a load never reported
D_COUNTED = r"assertion violated \(content\[tab\["  # (d) vLLM counted unverified KV
D_OFFERED = r"assertion violated\s+!\(lfail_ever\[r\]\)"  # (d) a failed request offered a load
E = r"assertion violated \(\(\(held\[b\]>>r\)"  # (e) a save read a block vLLM took back
F = r"assertion violated \(chunk_loads\["  # (f) two loads of one chunk
G = r"assertion violated \(writer\[b\]==255\)"  # (g) two loads of one block
H = r"acceptance cycle"  # (h) a run that never ends
H_LEFT = r"assertion violated \(+ !\(known\[r\]\)&& !\(saving\[r\]\)"  # (h) left behind

ONLY_SYNC = ("    if :: sync_mode = false :: sync_mode = true fi;", "    sync_mode = true;")
FREE_AT_ONCE = ("        cdelay = true                            /*", "        cdelay = false /*")
NO_END_CHECKS = (
    (
        "       assert(!known[r] && !saving[r] && unvb[r] == 0"
        " && !wl[r] && wsv[r] == 0 && !jpend[r]);",
        "       skip;",
    ),
    (
        "    assert(inflight[0] == 0 && inflight[1] == 0 && inflight[2] == 0"
        " && pl == 0 && ps == 0);",
        "    skip;",
    ),
)

MUTATIONS: dict[str, Mutation] = {
    "save_num_computed_tokens": Mutation(
        (
            (
                "  :: was && (unverified[r] || tainted[r] || waits[r] != 0) -> skip"
                "   /* saves_skipped: unverified */",
                "  :: false -> skip",
            ),
            ("     :: n > 0 && (m & (unvb[0] | unvb[1] | poison)) != 0 -> skip", "     :: false"),
            ("     :: n > 0 && (m & (unvb[0] | unvb[1] | poison)) == 0 ->", "     :: n > 0 ->"),
            ONLY_SYNC,
        ),
        A,
        "request_finished saves num_computed_tokens as vLLM counts them, without leaving out "
        "a load not verified (yet) or failed: the store-poisoning finding of issue 24 (an abort "
        "during a failing sync load; in async mode vLLM's own assertion fires first: a request "
        "freed twice, once for its load and once for its save)",
    ),
    "failed_sync_load_not_poisoned": Mutation(
        (("        poison = poison | unvb[r]\n", "        skip\n"),),
        A,
        "the blocks of a failed sync load are forgotten at its outcome (the code before the "
        "fix): vLLM's prefix cache hands them to the next request, which is saved",
    ),
    "poison_only_the_loaded_blocks": Mutation(
        (("     :: k < (sync_mode -> NL : lend[r]) ->", "     :: k < lend[r] ->"),),
        A,
        "a failed sync load poisons only the blocks it wrote, not those its step computed over "
        "them (the code before the second fix): after two preemptions a request is readmitted "
        "on them and saved",
    ),
    "no_taint_on_admission": Mutation(
        (("  :: sync_mode -> admit(r, loc)", "  :: sync_mode -> skip"),),
        A,
        "requests admitted on a poisoned block, or on one of a sync load that then fails, are "
        "saved",
    ),
    "recompute_clears_after_readmission": Mutation(
        (("  :: known[r] && !readm[r] ->", "  :: known[r] ->"),),
        A,
        "a request's own poisoned blocks count as recomputed in place although it was "
        "preempted and readmitted on them from vLLM's cache",
    ),
    "report_before_the_writes_stop": Mutation(
        (("     :: wl[r] && wdone[r] ->\n", "     :: wl[r] && (wdone[r] || wfin[r]) ->\n"),),
        B,
        "the worker reports an aborted request's load received as soon as it is cancelled, "
        "not once its task ended: vLLM reuses the blocks while bsr may still write them",
    ),
    "sync_step_does_not_wait": Mutation(
        (
            (
                "        (wphase && (!HAS(s_load[nexec], 0) || wdone[0])"
                " && (!HAS(s_load[nexec], 1) || wdone[1]))) ->",
                "        wphase) ->",
            ),
        ),
        B,
        "a sync step goes on before its loads ended (BsrWorker._wait_sync giving up on a load "
        "that does not unwind): the forward and later steps run while bsr writes",
    ),
    "vllm_frees_blocks_of_a_loading_request": Mutation(
        (("vdelay = !frk[r]; frk[r] = false;", "vdelay = false; frk[r] = false;"),),
        B,
        "(vLLM itself) an aborted request's blocks go back at once although its load runs",
    ),
    "load_reported_twice": Mutation(
        (("        wl[r] = false; forget_load(r)              /* del self._loads[rid] */", ""),),
        C,
        "the worker keeps a reported load in self._loads and reports it again next step",
    ),
    "sync_outcome_never_reported": Mutation(
        (("           wrep[r] = !wdone[r];\n           account(r);\n", "           skip;\n"),),
        C_MISSING,
        "a sync load's outcome never reaches the scheduler (only async loads are accounted): the "
        "end checks find a load never reported",
    ),
    "failed_load_reported_finished": Mutation(
        (("        :: !wok[r] -> o_fail[s] = o_fail[s] | BIT(r)", "        :: !wok[r] -> skip"),),
        D_COUNTED,
        "a failed async load is reported received but not failed: vLLM counts its blocks as "
        "computed and caches them",
    ),
    "failed_request_offered_again": Mutation(
        (("  :: loc >= NL || (known[r] && failed[r]) -> ext = 0", "  :: loc >= NL -> ext = 0"),),
        D_OFFERED,
        "get_num_new_matched_tokens offers a request whose load failed another load",
    ),
    "blocks_freed_while_the_save_is_on_the_way": Mutation(
        (FREE_AT_ONCE,),
        H_LEFT,
        "request_finished schedules the save but lets vLLM free the blocks at once: the end "
        "checks find a save bsr still holds for a request vLLM dropped",
    ),
    "blocks_freed_while_the_save_is_on_the_way_read": Mutation(
        (FREE_AT_ONCE, *NO_END_CHECKS),
        E,
        "the same, with the end checks removed: the save reads blocks vLLM took back",
    ),
    "save_reported_before_it_read": Mutation(
        (("     :: wsv[r] == 2 && wfin[r] ->", "     :: wsv[r] != 0 && wfin[r] ->"),),
        E,
        "the worker reports a save sent (finished_sending) before it read the blocks",
    ),
    "shared_prefix_loaded_twice_at_once": Mutation(
        (("           :: !sync_mode && deferred -> ext = NONE_T", "           :: false -> skip"),),
        F,
        "no deferral: two requests sharing a prefix load its chunks at the same time",
    ),
    "load_from_token_zero": Mutation(
        (
            ("     ljs[r] = lst[r]; lje[r] = lend[r];", "     ljs[r] = 0; lje[r] = lend[r];"),
            ONLY_SYNC,
        ),
        G,
        "a sync load restores from token 0 instead of past vLLM's own hit, writing blocks vLLM "
        "shares with another request's load (in async mode (b) catches it first: a write into "
        "a block of vLLM's prefix cache)",
    ),
    "failed_load_never_reported": Mutation(
        (("     :: wl[r] && wdone[r] ->\n", "     :: wl[r] && wdone[r] && wok[r] ->\n"),),
        H,
        "the worker never reports an async load that failed: the request waits for it forever "
        "and vLLM never gets its blocks back",
        liveness=True,
    ),
    "save_never_reported": Mutation(
        (("     wfin[r] = wfin[r] && wsv[r] != 0;", "     wfin[r] = false;"),),
        H,
        "the worker forgets a finished id before its save ended: the save is never reported "
        "and its blocks never given back",
        liveness=True,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(tmp_path: Path, name: str) -> None:
    found = _tools()
    mutation = MUTATIONS[name]
    cflags, args = LIVENESS if mutation.liveness else SAFETY
    # -O0: the compile dominates, and pan stops at the first violation
    run: PanRun = pan(
        found, mutate(_model_text(), mutation), tmp_path, ["-O0", *cflags[1:]], args, NAME
    )
    assert run.errors >= 1, f"{name} ({mutation.doc}) was not caught:\n{run.output}"
    first = run.first_violation
    assert first is not None, run.output
    assert re.search(mutation.expect, first), (
        f"{name}: expected /{mutation.expect}/, pan reported: {first}"
    )


# ---------------------------------------------------------------------------------------------
# (d) the model and the code name the same things

#: connector classes whose methods and fields the model's comments name as ``Class.name``
CLASSES = (
    "BsrConnector", "BsrScheduler", "BsrWorker", "LoadJob", "SaveJob", "BsrConnectorMetadata",
    "BsrWorkerMetadata", "_Req", "_Load",
)  # fmt: skip

#: methods of BsrScheduler and BsrWorker outside the protocol the model covers, with the reason
NOT_MODELLED = {
    "set_lookup_socket": "the handshake: the lookup socket's path, once at startup",
    "_await_answer": "folded into get_num_new_matched_tokens: None first, then any answer",
    "_collect": "the same (answers taken from the socket)",
    "_drop_lookup": "lookup leases: what the worker may release, no KV",
    "_digests": "chunk digests: CID(r, i) in the model",
    "reset_cache": "lookup leases only",
    "take_stats": "stats",
    "shutdown": "engine shutdown",
    "register_kv_caches": "startup",
    "_group_specs": "startup",
    "_coordinator": "tensor parallelism (one rank in the model)",
    "build_engine": "startup",
    "wrap_tiers": "startup (the tiers build_engine gives the engine)",
    "handshake": "startup",
    "_on_lookup": "the lookup server: answers, no KV",
    "_lookup_job": "the same",
    "_lookup": "the same",
    "_skip_of": "the same (the tiers a lookup's answer tells the loads not to ask)",
    "_keep_probe": "leases",
    "_forget": "leases",
    "_restore": "RestoreEngine.restore's call: the restore task on the Loop",
    "_account_save": "stats of a save",
    "_account_written": "stats of a save",
    # window saves (bsr.vllm._windows) are NOT in the model yet: they only read blocks the
    # scheduler holds a reference on in vLLM's block pool (BlockPool.touch) until every rank
    # reported the save, and are saved under the rule of saves;
    # tests/vllm_connector/test_windows.py (the pins, against vLLM's own pool) and
    # test_window_checkpoints.py (engine level) check them. Modelling the pin (a block vLLM
    # frees but cannot reuse) is a follow-up.
    "_plan_windows": "window saves: not modelled yet (see above)",
    "start_window_saves": "window saves: not modelled yet (see above)",
    "_save_windows": "window saves: not modelled yet (see above)",
    "keys_of": "a request's keys (tokens and extras): the model's CID(r, i) names them abstractly",
    "tables": "vLLM's block ids per KV cache group as bsr's tables (the model has one group)",
    "unreachable": "a load refused before it runs: one of the failed loads the model has",
    "_offer": "the lookup's answer (policy cost may offer a shorter prefix): no KV",
    "_split": "hits by source: counts, no KV",
    "hit_sources": "the same",
    "take_events": "KV events: notices of what the tiers hold, no KV",
    "_take_relay": "the same (KV events taken with the step's stats)",
    "_take_notices": "the same",
    "_admitted": "admission: a save of fewer of the request's computed chunks (a prefix of the "
    "same save, the same blocks held)",
}


def _class_members(tree: ast.Module) -> dict[str, set[str]]:
    """For each class: its methods, properties, class-level fields and ``self.x`` attributes."""
    members: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        names = members.setdefault(node.name, set())
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(item.name)
                for sub in ast.walk(item):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                        and isinstance(sub.ctx, ast.Store)
                    ):
                        names.add(sub.attr)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
    return members


def _source_members() -> dict[str, set[str]]:
    members: dict[str, set[str]] = {}
    for path in sorted(SRC.glob("*.py")):
        for cls, names in _class_members(parse_file(path)).items():
            members.setdefault(cls, set()).update(names)
    return members


def _model_comments() -> str:
    return " ".join(re.findall(r"/\*.*?\*/", _model_text(), flags=re.S))


def test_names_in_the_model_exist_in_the_connector() -> None:
    members = _source_members()
    named = set(re.findall(rf"\b({'|'.join(CLASSES)})\.(\w+)", _model_comments()))
    assert named, "the model names no connector method"
    missing = sorted(f"{c}.{n}" for c, n in named if n not in members.get(c, set()))
    assert not missing, f"the model names what src/bsr/vllm does not have: {missing}"


def test_every_protocol_method_is_in_the_model() -> None:
    """A method added to either side of the connector shows up here until the model covers it
    (or NOT_MODELLED says why it need not)."""
    members = _source_members()
    comments = _model_comments()
    tree_methods: set[str] = set()
    for path in (SRC / "_scheduler.py", SRC / "_worker.py"):
        for node in ast.walk(parse_file(path)):
            if isinstance(node, ast.ClassDef) and node.name in ("BsrScheduler", "BsrWorker"):
                tree_methods.update(
                    f"{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and item.name != "__init__"
                )
    assert tree_methods and members
    uncovered = sorted(
        m
        for m in tree_methods
        if m.split(".")[1] not in NOT_MODELLED and not re.search(rf"\b{re.escape(m)}\b", comments)
    )
    assert not uncovered, f"connector methods the model does not name: {uncovered}"
    stale = sorted(n for n in NOT_MODELLED if not any(m.endswith(f".{n}") for m in tree_methods))
    assert not stale, f"NOT_MODELLED names methods the connector no longer has: {stale}"


#: vLLM classes the model's comments name, and their module in the vllm package
VLLM_CLASSES = {
    "Scheduler": "v1/core/sched/scheduler.py",
    "KVCacheManager": "v1/core/kv_cache_manager.py",
    "EngineCore": "v1/engine/core.py",
}


def _vllm_package() -> Path | None:
    """vLLM's package directory: importable here, or in the checkout's .venv-vllm."""
    spec = importlib.util.find_spec("vllm")
    candidates = [Path(spec.origin).parent] if spec is not None and spec.origin else []
    site = ".venv-vllm/lib/python3*/site-packages/vllm/__init__.py"
    candidates += sorted(p.parent for p in ROOT.glob(site))
    return next(
        (p for p in candidates if all((p / m).is_file() for m in VLLM_CLASSES.values())), None
    )


@pytest.mark.vllm_env
def test_vllm_names_in_the_model_exist_in_vllm() -> None:
    """The model's ``Scheduler.x``, ``KVCacheManager.x`` and ``EngineCore.x`` names are
    methods of vLLM's classes (the vLLM in .venv-vllm; skipped where none is installed)."""
    package = _vllm_package()
    if package is None:
        pytest.skip("vLLM is not installed here (make .venv-vllm/.bsr-installed)")
    comments = _model_comments()
    missing = []
    for cls, module in VLLM_CLASSES.items():
        named = set(re.findall(rf"(?<![\w.]){cls}\.(\w+)", comments))
        assert named, f"the model names no {cls} method"
        members = _class_members(parse_file(package / module)).get(cls, set())
        missing += sorted(f"{cls}.{n}" for n in named if n not in members)
    assert not missing, f"the model names what vLLM does not have: {missing}"
