/*
 * bsr.pml -- Promela model of the bsr restore request / commit protocol.
 *
 * See spec/README.md for what is modelled, what is abstracted away, how the
 * model maps to spec/request_lifecycle.json and to src/bsr, and how to run it.
 *
 * Shape: NR tensor-parallel ranks, each restoring NG state groups of the agreed
 * prefix (at most NC chunks) through its own window of W staging slots, shared
 * by that rank's reader (tier -> slot) and installer (slot -> paged cache).
 * Each rank follows RestoreEngine.restore: probe, agree_min over the probed
 * prefixes, window, agree_min over the installed prefixes, Windowing ->
 * Installed, agree_all(bool), commit or invalidate. The coordinator is the
 * collective rounds (like InProcessGroup: the last rank to arrive completes a
 * round; a waiting rank may time out). An observer plays a reader of the
 * reusable prefix. Faults: failed reads (one retry from a lower tier), an
 * asynchronous copy failing at synchronize, the deadline of one rank (in
 * probing or windowing), collective time-outs, and every interleaving.
 *
 * Rules the tests (tests/proof/test_spec_spin.py) rely on:
 *  - the request states are the mtype names of the JSON "states";
 *  - state[] is assigned ONLY inside the inlines named after the JSON
 *    triggers; each such inline starts with
 *        assert(state[r] == <source> || ...)
 *    and contains exactly one  state[r] = <dest>;
 *  - state[] is initialised to the JSON "initial" state in its declaration;
 *  - the mutation tests edit a few exact lines (see MUTATIONS in the test):
 *    change one of those lines and the test says which anchor it lost.
 *
 * Exhaustive checks (see README; each a few seconds at most):
 *   spin -a bsr.pml
 *   gcc -O2 -DSAFETY -o pan pan.c && ./pan      assertions + invalid end states
 *   gcc -O2 -o pan pan.c && ./pan               the same, full (non-SAFETY) verifier
 *   gcc -O2 -DNP -o pan pan.c && ./pan -l       no cycles at all: every run ends
 */

#define NR 2            /* tensor-parallel ranks */
#define NG 2            /* state groups (allocator groups) */
#define NC 3            /* chunks of the longest prefix a rank can probe */
#define W  2            /* staging slots per rank: one window per rank engine */
#define SLOW (NR - 1)   /* the rank whose deadline may expire (ranks are symmetric) */

#define IX(r, c, g) (((r) * NC + (c)) * NG + (g))   /* flat (rank, chunk, group) */

/* Collective rounds, in the order every rank calls them (as the engine does). */
#define R_PROBE 0       /* agree_min over the probed prefixes */
#define R_INST  1       /* agree_min over the installed prefixes */
#define R_VOTE  2       /* agree_all over "this rank is Installed" */
#define NROUNDS 3
#define FAILED 255      /* a collective's result on a rank: CoordinatorError */
#define LATE (-1)       /* a probe proposal: this rank ran out of time (below every prefix) */

/* Request states: exactly the names of the JSON "states". */
mtype = { Probing, Windowing, Installed, Committed, Invalidated };
/* Reasons: a subset of the JSON "reasons". */
mtype = { empty_prefix, complete, truncated, read_failed, install_failed,
          deadline, rank_failed, coordinator_failed };
/* Reader -> installer messages of one rank (the bounded stream). */
mtype = { STAGED, READ_END, READ_FAIL };

/* ---- per-rank request state ------------------------------------------- */
mtype state[NR] = Probing;  /* the request lifecycle state of each rank */
mtype reason[NR];           /* set when a terminal state is reached */
byte committed[NR];         /* committed (reusable) prefix, in chunks */
bit inst[NR * NC * NG];     /* (rank, chunk, group) installed in the paged cache */
bit ver[NR * NC * NG];      /* ghost: (rank, chunk, group) was read and verified */
byte slots[NR];             /* staging slots in use in each rank's window */
bool cancel[NR];            /* the request asked its reader to stop */
chan staged[NR] = [W + 1] of { mtype, byte };   /* kind, chunk */

bool policy_truncate;       /* chosen nondeterministically by init */

/* ---- the coordinator: one record per collective round ----------------- */
byte arrived[NROUNDS];      /* ranks that put their value into the round */
short acc[NROUNDS];         /* MIN of the values put in so far (LATE is negative) */
bool done[NROUNDS];         /* the round has its result, or has failed */
bool failed[NROUNDS];       /* the round failed: every rank gets FAILED */

bit dirty;                  /* something the observer must look at changed */
byte nfinished;             /* ranks that reached the end of their request */

/* ---- the coordinator ---------------------------------------------------- */

/* One rank's call of a collective: put v into round rd; the last rank to
 * arrive completes the round (MIN of all values). While the round is
 * incomplete the wait may time out (a rank is too slow); a time-out fails the
 * round for every rank, including those arriving later, so that no rank can
 * get a result that counted the vote of a rank which gave up. */
inline collective(rd, v, res) {
  atomic {
    acc[rd] = ((arrived[rd] == 0 || v < acc[rd]) -> v : acc[rd]);
    arrived[rd]++;
    done[rd] = (done[rd] || arrived[rd] == NR)
  }
  if
  :: atomic { done[rd] -> res = (failed[rd] -> FAILED : acc[rd]) }
  :: atomic { !done[rd] ->                            /* time-out */
       failed[rd] = true; done[rd] = true; res = FAILED }
  fi
}

inline agree_min(rd, v, res) {
  collective(rd, v, res)
}

/* AND over the ranks, as MIN over 0/1 (like TorchDistributedCoordinator);
 * res holds the vote going in and the result coming out. */
inline agree_all(rd, b, res) {
  res = ((b) -> 1 : 0);
  collective(rd, res, res)
}

/* ---- helpers ------------------------------------------------------------ */

/* Forget chunks [from, to) of rank r: blocks invalid, staged data gone
 * (uses the caller's j). */
inline forget(r, from, to) {
  d_step {
    j = IX(r, from, 0);
    do
    :: j < IX(r, to, 0) -> inst[j] = 0; ver[j] = 0; j++
    :: else -> break
    od;
    j = 0
  }
}

/* Mark the blocks of rank r from chunk n on invalid. */
inline drop_from(r, n) {
  forget(r, n, NC)
}

/* Invariant 1: the first n chunks are installed and verified on every group
 * of every rank (uses the caller's j). */
inline assert_prefix_installed(n) {
  d_step {
    j = 0;
    do
    :: j < NR * NC * NG ->
       assert((j / NG) % NC >= n || (inst[j] && ver[j]));   /* invariant 1 */
       j++
    :: else -> break
    od;
    j = 0
  }
}

/* One (chunk, group) read into its region of a held slot: verified or failed. */
inline read_chunk(ok) {
  if
  :: ok = true                        /* top tier: read and verified */
  :: ok = false;                      /* read error / corrupt: retry once */
     if
     :: ok = true                     /* lower tier copy read and verified */
     :: ok = false                    /* every copy failed */
     fi
  fi
}

/* ---- the JSON triggers: the ONLY places where state[] changes ---------- */

inline probe_hit(r) {
  assert(state[r] == Probing);
  state[r] = Windowing
}

inline probe_miss(r) {
  assert(state[r] == Probing);
  state[r] = Committed;
  committed[r] = 0;
  reason[r] = empty_prefix
}

inline chunks_installed(r) {
  assert(state[r] == Windowing);
  state[r] = Installed
}

inline truncate(r) {
  assert(state[r] == Windowing);
  state[r] = Installed
}

inline commit(r, n, target) {
  assert(state[r] == Installed);
  assert_prefix_installed(n);         /* nothing partial becomes reusable */
  state[r] = Committed;
  committed[r] = n;
  reason[r] = (n == target -> complete : truncated);
  dirty = 1
}

inline invalidate(r, rsn) {
  assert(state[r] == Probing || state[r] == Windowing || state[r] == Installed);
  state[r] = Invalidated;
  reason[r] = rsn;
  drop_from(r, 0);            /* every touched block is reported invalid */
  dirty = 1
}

/* ---- processes ---------------------------------------------------------- */

/* Read stage of rank r for an agreed prefix of n chunks: tier -> staging slot,
 * one chunk per slot (a region per group, as in the engine), chunks in order,
 * one at a time. Taking a slot, reading every group of the chunk (each with its
 * one retry) and handing the slot to the install stage is one atomic step; the
 * slot stays held until the chunk is installed. */
proctype Reader(byte r; byte n) {
  byte c = 0;                 /* next chunk */
  byte g, j;
  bool ok;
  do
  :: atomic { (c == n || cancel[r]) -> staged[r] ! READ_END, 0; c = 0 };
     break
  :: atomic {
       (c < n && !cancel[r] && slots[r] < W) ->
       slots[r]++;                                      /* take a slot */
       assert(slots[r] <= W);                           /* invariant 3 */
       g = 0;
       do
       :: g < NG ->
          read_chunk(ok);
          if
          :: ok -> ver[IX(r, c, g)] = 1; g++
          :: else -> break
          fi
       :: else -> break
       od;
       if
       :: g == NG -> staged[r] ! STAGED, c; c++; g = 0; ok = false
       :: else ->
          forget(r, c, c + 1);                          /* the slot's data is gone */
          slots[r]--;                                   /* give the slot back */
          staged[r] ! READ_FAIL, c; break
       fi
     }
  od
}

/* One rank's restore request, in the engine's order: probe + agree_min,
 * window (its body is the install stage), agree_min over what was installed,
 * Windowing -> Installed, agree_all, then commit or invalidate. */
proctype Rank(byte r) {
  byte c, j;
  byte target;                /* the agreed probed prefix (chunks) */
  byte done_chunks;           /* chunks fully installed (all groups), in order */
  short best;                 /* this rank's proposal to a collective (or LATE) */
  short m;                    /* a collective's result (or FAILED, or LATE) */
  bool late;                  /* this rank's deadline expired */
  bool sync_failed;           /* an asynchronous copy failed at synchronize */
  mtype kind, why;            /* why: read_failed, or 0 */

  /* -- Probing: metadata only, no slot held -- */
  atomic {
    if
    :: select(best : 0 .. NC)
    :: r == SLOW -> late = true; best = LATE   /* the probe ran past the deadline */
    fi
  }
  agree_min(R_PROBE, best, m);
  atomic {
    best = 0;
    if
    :: m == FAILED -> invalidate(r, coordinator_failed); goto finish
    :: m != FAILED && (late || m == LATE) ->   /* this rank or another ran out of time */
       invalidate(r, (late -> deadline : rank_failed)); goto finish
    :: m == 0 && !late ->     /* zero-length prefix: Committed, 0 tokens */
       probe_miss(r); goto finish
    :: m != FAILED && m > 0 && !late ->
       target = m; probe_hit(r); run Reader(r, target)
    fi;
    m = 0
  }
  /* -- Windowing: install staged chunks, give each slot back -- */
  do
  :: atomic {
       staged[r] ? kind, c ->
       if
       :: kind == STAGED ->
          if
          :: (why == 0 && !late) ->           /* copy every group into the cache */
             d_step {
               j = IX(r, c, 0);
               do
               :: j < IX(r, c + 1, 0) -> inst[j] = 1; j++
               :: else -> break
               od;
               j = 0
             };
             done_chunks = c + 1              /* chunks arrive in order */
          :: else -> forget(r, c, c + 1)      /* stopping: drop the staged chunk */
          fi;
          slots[r]--;                         /* slot given back after install */
          kind = 0; c = 0
       :: kind == READ_FAIL ->
          why = read_failed; kind = 0; c = 0; break
       :: kind == READ_END -> kind = 0; break
       fi
     }
  :: atomic { (r == SLOW && !late) -> late = true; cancel[r] = true }  /* deadline */
  od;
  /* -- agree on what every rank can commit -- */
  best = (late -> 0 : (policy_truncate -> done_chunks
                       : (done_chunks == target -> target : 0)));
  agree_min(R_INST, best, m);
  atomic {
    best = 0;
    if
    :: m == FAILED -> invalidate(r, coordinator_failed); goto finish
    :: m != FAILED && m == target ->
       assert(done_chunks == target);
       chunks_installed(r)
    :: m != FAILED && m > 0 && m < target ->
       assert(policy_truncate && done_chunks >= m);
       drop_from(r, m);                       /* never a partial chunk */
       truncate(r)
    :: m == 0 -> skip                         /* stays in Windowing: votes no */
    fi
  }
  /* -- the install stage's copies complete (pipeline.synchronize): an
   *    asynchronous copy can fail only now, after the agreement -- */
  if
  :: skip
  :: atomic {
       state[r] == Installed ->
       sync_failed = true;
       drop_from(r, 0);                       /* its blocks are not good */
       dirty = 1
     }
  fi;
  /* -- agree_all, then commit or invalidate -- */
  agree_all(R_VOTE, (state[r] == Installed && !sync_failed), best);
  atomic {
    if
    :: best == FAILED -> invalidate(r, coordinator_failed)
    :: best == 1 -> commit(r, m, target)       /* every rank voted yes */
    :: else ->
       why = (late -> deadline : (sync_failed -> install_failed
              : (why != 0 -> why : rank_failed)));
       invalidate(r, why)
    fi;
    best = 0; m = 0; why = 0; done_chunks = 0; late = false; sync_failed = false
  }
finish:
  nfinished++
}

/* A reader of the reusable prefix (invariant 1): whenever a commit or an
 * invalidation happened, look at the longest prefix any rank exposes and
 * check every chunk of it is installed on every group of every rank. */
active proctype Observer() {
  byte j, pub;
end:
  do
  :: atomic {
       dirty -> dirty = 0;
       d_step {
         pub = 0; j = 0;
         do
         :: j < NR -> pub = (committed[j] > pub -> committed[j] : pub); j++
         :: else -> break
         od;
         j = 0
       }
       assert_prefix_installed(pub);
       pub = 0
     }
  od
}

init {
  byte r, j;
  atomic {
    if
    :: policy_truncate = false
    :: policy_truncate = true
    fi;
    r = 0;
    do
    :: r < NR -> run Rank(r); r++
    :: else -> break
    od;
    r = 0
  }
  nfinished == NR;            /* deadlock here = invalid end state */
  d_step {
    r = 0;
    do
    :: r < NR ->
       /* termination: every rank ends in a terminal state */
       assert(state[r] == Committed || state[r] == Invalidated);
       /* invariant 2: one reusable prefix, the same on every rank */
       assert(committed[r] == committed[0]);
       assert(committed[0] == 0 || state[r] == Committed);
       /* every failure is agreed, the deadline included: one state on every rank */
       assert(state[r] == state[0]);
       /* invariants 3 and 4: every slot given back, nothing left staged */
       assert(slots[r] == 0 && empty(staged[r]));
       if
       :: state[r] == Committed && committed[r] == 0 ->
          /* only a zero-length agreed probe commits nothing */
          assert(reason[r] == empty_prefix && !failed[R_PROBE] && acc[R_PROBE] == 0)
       :: state[r] == Committed && committed[r] > 0 ->
          /* the whole agreed prefix, or (truncate only) a shorter one */
          assert(committed[r] == acc[R_PROBE]
                 || (policy_truncate && committed[r] < acc[R_PROBE]));
          /* exactly the committed chunks stay valid, every group of them */
          j = IX(r, 0, 0);
          do
          :: j < IX(r + 1, 0, 0) ->
             assert(inst[j] == ((j / NG) % NC < committed[r])); j++
          :: else -> break
          od
       :: state[r] == Invalidated ->
          j = IX(r, 0, 0);
          do
          :: j < IX(r + 1, 0, 0) -> assert(inst[j] == 0); j++
          :: else -> break
          od
       :: else -> assert(false)
       fi;
       r++
    :: else -> break
    od
  }
}
