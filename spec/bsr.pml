/*
 * bsr.pml -- Promela model of the bsr restore request / commit protocol.
 *
 * See spec/README.md for what is modelled, what is abstracted away, how the
 * model maps to spec/request_lifecycle.json and to src/bsr, and how to run it.
 *
 * Shape: NR tensor-parallel ranks, each restoring NG state groups of the agreed
 * prefix (at most NC chunks) through its own window of W staging slots, shared
 * by that rank's reader (tier -> slot) and installer (slot -> paged cache).
 * A coordinator does agree_min over the probed prefixes and agree_all(bool)
 * over "installed" votes (agree_min over installed prefixes under the opt-in
 * truncate policy). An observer plays a reader of the reusable prefix.
 *
 * Rules the tests (tests/test_spec_spin.py) rely on:
 *  - the request states are the mtype names of the JSON "states";
 *  - state[] is assigned ONLY inside the inlines named after the JSON
 *    triggers; each such inline starts with
 *        assert(state[r] == <source> || ...)
 *    and contains exactly one  state[r] = <dest>;
 *  - state[] is initialised to the JSON "initial" state in its declaration.
 *
 * Exhaustive check (see README):
 *   spin -a bsr.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan
 */

#define NR 2            /* tensor-parallel ranks */
#define NG 2            /* state groups (allocator groups) */
#define NC 3            /* chunks of the longest prefix a rank can probe */
#define W  2            /* staging slots per rank: one window per rank engine */

#define NOPROBE 255     /* a probe (or the agree_min collective) failed */
#define IX(r, c, g) (((r) * NC + (c)) * NG + (g))   /* flat (rank, chunk, group) */

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
bit inst[NR * NC * NG];     /* (rank, chunk, group) installed and verified */
byte slots[NR];             /* staging slots in use in each rank's window */
bool cancel[NR];            /* the request asked its reader to stop */
chan staged[NR] = [W + 1] of { mtype, byte, byte };   /* kind, chunk, group */

bool policy_truncate;       /* chosen nondeterministically by init */

/* ---- coordinator ------------------------------------------------------- */
byte probed[NR];            /* each rank's probed prefix (or NOPROBE) */
byte nprobed;
byte agreed;                /* agree_min over probed[]; NOPROBE if one failed */
bool probe_done;
byte vote[NR];              /* installed prefix; 0 = nothing installed */
byte nvoted;
bool decided;
byte commit_len;            /* the prefix every rank commits; 0 = invalidate */
mtype coord_reason;         /* why commit_len is 0 */

bit dirty;                  /* something the observer must look at changed */
byte nfinished;             /* ranks that reached the end of their request */

/* ---- helpers ------------------------------------------------------------ */

/* Mark the blocks of rank r from chunk n on invalid (uses the caller's j). */
inline drop_from(r, n) {
  d_step {
    j = IX(r, n, 0);
    do
    :: j < IX(r + 1, 0, 0) -> inst[j] = 0; j++
    :: else -> break
    od;
    j = 0
  }
}

/* One (chunk, group) read into a held slot: checksum-verified or failed. */
inline read_chunk(r, c, ok) {
  if
  :: c >= probed[r] -> ok = false     /* no tier on this rank holds it */
  :: else ->
     if
     :: ok = true                     /* top tier: read and verified */
     :: ok = false;                   /* read error / corrupt: retry once */
        if
        :: ok = true                  /* lower tier copy read and verified */
        :: ok = false                 /* every copy failed */
        fi
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

inline commit(r, n) {
  assert(state[r] == Installed);
  state[r] = Committed;
  committed[r] = n;
  reason[r] = (n == agreed -> complete : truncated);
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

/* Read stage of rank r: tier -> staging slot, chunk-major, one read at a time. */
proctype Reader(byte r) {
  byte k = 0;                 /* next (chunk, group): c = k / NG, g = k % NG */
  bool ok;
  do
  :: k == agreed * NG -> staged[r] ! READ_END, 0, 0; break
  :: k < agreed * NG ->
     if
     :: cancel[r] -> staged[r] ! READ_END, 0, 0; break
     :: atomic { slots[r] < W -> slots[r]++ }           /* take a slot */
        assert(slots[r] <= W);                          /* invariant 3 */
        read_chunk(r, k / NG, ok);
        if
        :: ok -> staged[r] ! STAGED, k / NG, k % NG; k++; ok = false
        :: else ->
           slots[r]--;                                  /* give the slot back */
           staged[r] ! READ_FAIL, k / NG, k % NG; break
        fi
     fi
  od
}

/* One rank's restore request; its body is the install stage. */
proctype Rank(byte r) {
  byte c, g, j;
  byte done_chunks;           /* chunks fully installed (all groups) */
  byte target;                /* prefix this rank installed and votes for */
  mtype kind, why;            /* why = 0: no failure so far */

  /* -- Probing: metadata only, no slot held -- */
  atomic {
    if
    :: select(c : 0 .. NC); probed[r] = c; c = 0
    :: probed[r] = NOPROBE    /* the probe failed */
    fi;
    nprobed++
  }
  probe_done;                 /* agree_min */
  if
  :: agreed == NOPROBE -> invalidate(r, coordinator_failed)
  :: agreed == 0 -> probe_miss(r)      /* zero-length prefix: Committed, 0 tokens */
  :: else ->
     probe_hit(r);
     run Reader(r);
     /* -- Windowing: install staged chunks, give each slot back -- */
     do
     :: staged[r] ? kind, c, g ->
        if
        :: kind == STAGED ->
           if
           :: why == 0 ->
              if
              :: inst[IX(r, c, g)] = 1;
                 done_chunks = (g == NG - 1 -> c + 1 : done_chunks)
              :: why = install_failed; cancel[r] = true
              fi
           :: else -> skip                /* stopping: drop the staged chunk */
           fi;
           slots[r]--;                    /* slot released after install */
           c = 0; g = 0
        :: kind == READ_FAIL ->
           why = (why == 0 -> read_failed : why); c = 0; g = 0; break
        :: kind == READ_END -> break
        fi
     :: why == 0 -> why = deadline; cancel[r] = true   /* slow rank: deadline */
     od;
     kind = 0;
     if
     :: why == 0 ->
        assert(done_chunks == agreed);
        target = agreed;
        chunks_installed(r)
     :: ((why == read_failed || why == install_failed) && policy_truncate
         && done_chunks > 0) ->
        target = done_chunks;
        drop_from(r, target);             /* never a partial chunk */
        truncate(r)
     :: else -> invalidate(r, why)
     fi;
     /* -- Installed: agree_all across ranks -- */
     atomic { vote[r] = (state[r] == Installed -> target : 0); nvoted++ }
     if
     :: state[r] == Installed ->
        decided;                          /* wait for agree_all */
        target = commit_len;
        if
        :: target > 0 ->
           drop_from(r, target);
           commit(r, target)
        :: else -> invalidate(r, coord_reason)
        fi
     :: else -> skip
     fi
  fi;
  nfinished++
}

proctype Coordinator() {
  byte r;
  bool bad;
  /* agree_min over the probed prefixes */
  nprobed == NR;
  d_step {
    agreed = NC;
    r = 0;
    do
    :: r < NR ->
       if
       :: probed[r] == NOPROBE -> bad = true
       :: else -> agreed = (probed[r] < agreed -> probed[r] : agreed)
       fi;
       r++
    :: else -> break
    od;
    agreed = (bad -> NOPROBE : agreed);
    probe_done = true;
    r = 0; bad = false
  }
  if
  :: agreed == 0 || agreed == NOPROBE -> skip     /* nothing to agree on */
  :: else ->
     if
     :: nvoted == NR ->
        d_step {
          r = 0;
          if
          :: policy_truncate ->               /* agree_min over installed prefixes */
             commit_len = agreed;
             do
             :: r < NR ->
                commit_len = (vote[r] < commit_len -> vote[r] : commit_len); r++
             :: else -> break
             od
          :: else ->                          /* agree_all(bool) */
             bad = false;
             do
             :: r < NR -> bad = bad || vote[r] != agreed; r++
             :: else -> break
             od;
             commit_len = (bad -> 0 : agreed)
          fi;
          coord_reason = rank_failed;
          decided = true;
          r = 0; bad = false
        }
     :: nvoted < NR ->                        /* a slow rank: the collective times out */
        d_step {
          commit_len = 0;
          coord_reason = coordinator_failed;
          decided = true
        }
     fi
  fi
}

/* A reader of the reusable prefix (invariant 1): whenever a commit or an
 * invalidation happened, look at the longest prefix any rank exposes and
 * check every chunk of it is installed on every group of every rank. */
active proctype Observer() {
  byte j, pub;
end:
  do
  :: d_step {
       dirty -> dirty = 0;
       pub = 0; j = 0;
       do
       :: j < NR -> pub = (committed[j] > pub -> committed[j] : pub); j++
       :: else -> break
       od;
       j = 0;
       do
       :: j < NR * NC * NG ->
          assert((j / NG) % NC >= pub || inst[j]);    /* invariant 1 */
          j++
       :: else -> break
       od;
       j = 0; pub = 0
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
    run Coordinator();
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
       /* invariant 2: one outcome, the same on every rank */
       assert(state[r] == state[0] && committed[r] == committed[0]);
       /* invariants 3 and 4: every slot given back, nothing left staged */
       assert(slots[r] == 0 && empty(staged[r]));
       if
       :: agreed == 0 ->
          assert(state[r] == Committed && committed[r] == 0
                 && reason[r] == empty_prefix)
       :: state[r] == Committed && agreed != 0 && agreed != NOPROBE ->
          assert(committed[r] == agreed
                 || (policy_truncate && committed[r] > 0 && committed[r] < agreed))
       :: state[r] == Invalidated ->
          assert(committed[r] == 0);
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
