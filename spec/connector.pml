/*
 * connector.pml -- Promela model of the BsrConnector protocol inside vLLM:
 * vLLM's scheduler and worker, the connector's two sides, bsr's restores and
 * saves, with aborts, preemptions, failures and block reuse.
 *
 * spec/README.md ("The connector model") has the table from model steps to
 * connector methods, what is abstracted away, the state counts and how to
 * run it; tests/proof/test_connector_spin.py verifies it, its mutations and
 * its names against src/bsr/vllm.
 *
 * Shape: NREQ = 2 requests whose prompts share their first chunk (and, if
 * init picks same_prompt, their second), NL = 2 chunks stored (one chunk =
 * one vLLM block here), NB = 4 vLLM blocks, up to NS = 2 engine steps in
 * flight (vLLM's batch queue under async scheduling). Processes:
 *  - init: vLLM's EngineCore loop: Scheduler.schedule with the connector's
 *    scheduler-side hooks and build_connector_meta, then, once the worker ran
 *    the step, Scheduler.update_from_output; at the end, the end checks;
 *  - Worker: the worker process, one engine step at a time, in order
 *    (start_load_kv, the forward, wait_for_save, get_finished);
 *  - Loop: bsr's event loop in the worker: restore tasks (write the load's
 *    blocks, then commit or fail; fail or be cancelled at any point) and save
 *    tasks (read the request's blocks);
 *  - Env: the clients: request 0 arrives, then request 1; each may be aborted
 *    at any time after it arrives, or never.
 * init also picks the load mode (async, the default, or sync) and vLLM's
 * kv_load_failure_policy (recompute or fail): one run covers all of them.
 *
 * Ghost state: content[b] is the chunk whose correct KV block b holds (computed
 * by a forward over correct KV, or installed by a committed restore), GARB if
 * none (a reallocated block's stale bytes, a restore's writes before its
 * commit, a forward over garbage).
 *
 * Properties (assertions; the README's table has where each is checked):
 *  (a) a block is saved only if it holds computed or verified-installed KV;
 *  (b) bsr never writes a block after it reported the load back, and an
 *      async load writes only blocks vLLM still gives its request, outside
 *      vLLM's prefix cache;
 *  (c) every load ends in exactly one outcome, every async load in exactly one
 *      finished_recving (an aborted one too: vLLM frees its blocks then);
 *  (d) a failed load is never counted as cached: what vLLM counts as computed
 *      after an async load is verified; a request whose load failed is never
 *      offered a load again;
 *  (e) a save reads only blocks vLLM still holds for its request;
 *  (f) two loads never fetch one chunk at once; (g) nor write one block;
 *  (h) every run ends: all requests finished, every block given back, nothing
 *      left in either side (end checks in init; ltl `terminates` under weak
 *      fairness).
 *
 * Rules the tests rely on:
 *  - a comment naming a connector method or field writes it `Class.name`
 *    (BsrScheduler, BsrWorker, BsrConnector, LoadJob, SaveJob, _Req, _Load,
 *    BsrConnectorMetadata, BsrWorkerMetadata); the test checks each exists,
 *    and that every protocol method of BsrScheduler and BsrWorker is named;
 *  - the mutation tests edit exact lines (MUTATIONS in the test): change one
 *    and the test says which anchor it lost.
 *
 * Exhaustive checks (README):
 *   spin -a connector.pml
 *   gcc -O1 -DSAFETY -DNOCLAIM -o pan pan.c && ./pan -m100000   assertions, end states
 *   gcc -O1 -o pan pan.c && ./pan -a -f -m100000                every fair run ends
 * (-m100000: the deepest run is about 3,300 steps, past pan's default limit)
 */

#define NREQ 2          /* requests (much of the model writes [0] and [1]) */
#define NL   2          /* chunks of a prompt that bsr stores (chunk = block) */
#define NB   4          /* vLLM's KV blocks: NREQ * NL, so allocation never fails */
#define NS   2          /* engine steps in flight (vLLM's batch queue) */
#define MAXPRE 2        /* preemptions of a request (a second one is needed to be
                         * readmitted on blocks computed over a failed sync load) */

#define NOB   255       /* no block */
#define NOH   255       /* not in vLLM's prefix cache */
#define GARB  254       /* content: no chunk's KV */
#define NOR   255       /* no request */
#define NOANS 255       /* the lookup is not answered */
#define NONE_T 255      /* get_num_new_matched_tokens answers None */

#define BIT(x)    (1 << (x))
#define HAS(m, x) ((((m) >> (x)) & 1) == 1)
#define TB(r, i)  tab[(r) * NL + (i)]
#define SI(s, r)  ((s) * NREQ + (r))
#define CB(s, r, i) s_cb[((s) * NREQ + (r)) * NL + (i)]
/* Which chunk (chained digest) chunk i of request r's prompt is: chunk 0 is
 * shared; chunk 1 too if the prompts are the same, else each has its own. */
#define NCID (NL + 1)
#define CID(r, i) (((i) == 0 || same_prompt) -> (i) : (i) + (r))

/* vLLM's RequestStatus (Absent: not arrived yet) */
mtype = { Absent, Waiting, WaitingForRemoteKVs, Running, Preempted, Finished };

/* ---- configuration, picked by init -------------------------------------- */
bool sync_mode;             /* bsr_connector load="sync" (else "async") */
bool policy_fail;           /* kv_load_failure_policy="fail" (else "recompute") */
bool same_prompt;           /* the prompts are the same (else they share chunk 0) */

/* ---- vLLM: KV blocks ------------------------------------------------------ */
byte held[NB];              /* requests holding the block (bitmask); 0: free */
byte hsh[NB] = NOH;         /* in the prefix cache as the KV of this chunk */
byte content[NB] = GARB;    /* ghost, see above */

/* ---- vLLM: requests ------------------------------------------------------- */
mtype vst[NREQ] = Absent;   /* status */
byte nct[NREQ];             /* num_computed_tokens, in chunks */
byte tab[NREQ * NL] = NOB;  /* block table */
bool frk[NREQ];             /* in finished_recving_kv_req_ids */
bool ffk[NREQ];             /* in failed_recving_kv_req_ids */
bool gone[NREQ];            /* finished and its blocks freed (out of requests) */
byte fin_ids;               /* finished_req_ids for the next step */
byte npre[NREQ];            /* preemptions so far */
bool dec[NREQ];             /* its decode step was scheduled */
byte rfirst;                /* 1: both run and request 1 is first in running */

/* ---- the steps in flight, oldest first: scheduler output (to the worker)
 *      and model runner output (back) --------------------------------------- */
byte nfl;                   /* steps in flight */
byte nexec;                 /* ... that the worker ran (outputs ready) */
bool wphase;                /* the worker waits for its step's sync loads */
bool stopped;               /* the engine shut down */
bool wstopped;              /* ... and the worker */
byte s_load[NS];            /* BsrConnectorMetadata.loads (requests) */
byte s_save[NS];            /* BsrConnectorMetadata.saves */
byte s_fin[NS];             /* finished_req_ids */
byte s_sched[NS];           /* requests scheduled */
byte s_comp[NS];            /* ... whose forward computes chunks */
byte s_dec[NS];             /* ... whose decode step it is */
byte s_from[NS * NREQ];     /* the first chunk computed */
byte s_cb[NS * NREQ * NL];  /* the block table the forward writes */
byte o_recv[NS];            /* finished_recving */
byte o_fail[NS];            /* failed_recving */
byte o_send[NS];            /* finished_sending */
byte o_inv[NS];             /* invalid_block_ids (blocks) */
byte o_oc[NS];              /* BsrWorkerMetadata.loads: requests ... */
byte o_ok[NS];              /* ... and whether each load was ok */

/* ---- BsrScheduler: one _Req per request (popped by request_finished) ------ */
bool known[NREQ];           /* in self._reqs */
bool asked[NREQ];           /* a lookup was sent */
byte hit[NREQ] = NOANS;     /* _Req.hit */
bool used[NREQ];            /* _Req.used */
byte lst[NREQ];             /* _Req.start: vLLM's own hit at the promise */
byte lend[NREQ];            /* _Req.end */
bool loading[NREQ];         /* _Req.loading */
bool failed[NREQ];          /* _Req.failed */
bool unverified[NREQ];      /* _Req.unverified */
bool tainted[NREQ];         /* _Req.tainted */
byte waits[NREQ];           /* _Req.waits_on (requests) */
bool readm[NREQ];           /* _Req.readmitted */
byte unvb[NREQ];            /* self._unverified_blocks: the blocks its load writes */
byte poison;                /* self._poisoned: blocks ... */
byte powner[NB] = NOR;      /* ... and whose failed sync load wrote them */
byte inflight[NCID];        /* self._inflight: chunk -> loading request + 1 */
bool saving[NREQ];          /* self._saving */
byte pl;                    /* self._loads (requests) */
byte ps;                    /* self._saves (requests) */
/* the jobs (a request has at most one load and one save on the way) */
byte ljs[NREQ];             /* LoadJob.start_tokens */
byte lje[NREQ];             /* LoadJob.end_tokens */
byte ljb[NREQ * NL];        /* LoadJob.block_ids */
byte psn[NREQ];             /* SaveJob: chunks */
byte psb[NREQ * NL];        /* SaveJob.block_ids */

/* ---- BsrWorker ------------------------------------------------------------ */
bool wl[NREQ];              /* self._loads: an async load not reported yet */
bool wdone[NREQ];           /* _Load.done: its task ended */
bool wok[NREQ];             /* _Load.ok */
byte rst[NREQ];             /* its restore task: 0 none, 1 started, 2 wrote its blocks */
byte wsv[NREQ];             /* self._saves: 0 none, 1 running, 2 done (its future) */
bool svrun[NREQ];           /* its save task has not read the blocks yet */
bool wfin[NREQ];            /* self._finished */
byte load_errors;           /* self._load_errors (blocks) */
byte oc;                    /* self._outcomes: requests ... */
byte ocok;                  /* ... and whether each load was ok */

/* ---- ghosts for the properties -------------------------------------------- */
bool ocpend[NREQ];          /* a load of r whose outcome is not reported yet */
bool rcpend[NREQ];          /* an async load of r not reported finished_recving yet */
bool wrep[NREQ];            /* r's load was reported back while its task ran on */
bool lfail_ever[NREQ];      /* a load of r was reported failed */
bool jpend[NREQ];           /* a load of r was made; the worker has not started it */
byte chunk_loads[NCID];     /* loads in flight that fetch the chunk */
byte writer[NB] = NOR;      /* the load that may write the block */
bool ended;                 /* the run ended and passed the end checks */

/* ========================================================================== */
/* vLLM's KV cache manager                                                     */

/* KVCacheManager.free: the request gives its blocks back; cached ones stay in
 * the prefix cache (a free block out of it holds nothing anybody reads) */
inline free_blocks(r) {
  k = 0;
  do
  :: k < NL ->
     if
     :: TB(r, k) != NOB ->
        held[TB(r, k)] = held[TB(r, k)] & ~BIT(r);
        if
        :: held[TB(r, k)] == 0 && hsh[TB(r, k)] == NOH -> content[TB(r, k)] = GARB
        :: else -> skip
        fi;
        TB(r, k) = NOB
     :: else -> skip
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

/* KVCacheManager.cache_blocks: the request's blocks [0, n) enter the cache */
inline cache_upto(r, n) {
  k = 0;
  do
  :: k < n ->
     if
     :: hsh[TB(r, k)] == NOH -> hsh[TB(r, k)] = CID(r, k)
     :: else -> skip
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

/* KVCacheManager.get_computed_blocks: the longest cached prefix (hb[i]: the
 * block found for chunk i) */
inline local_hit(r, loc) {
  loc = 0;
  do
  :: loc < NL ->
     b = 0;
     do
     :: b < NB && hsh[b] != CID(r, loc) -> b++
     :: else -> break
     od;
     if
     :: b < NB -> hb[loc] = b; loc++
     :: else -> break
     fi
  :: else -> break
  od;
  b = 0
}

/* KVCacheManager.allocate_slots: touch the hit blocks, take free ones for the
 * rest (NB >= NREQ * NL: there is always room; memory pressure is what
 * preemption stands for). Which free block: the lowest one out of the cache,
 * or the lowest cached one, evicted (vLLM's free queue order is not
 * modelled; block ids are interchangeable). */
inline allocate(r, loc) {
  i = 0;
  do
  :: i < loc -> TB(r, i) = hb[i]; held[hb[i]] = held[hb[i]] | BIT(r); hb[i] = 0; i++
  :: else -> break
  od;
  do
  :: i < NL ->
     b = 0;
     do
     :: b < NB && !(held[b] == 0 && hsh[b] == NOH) -> b++
     :: else -> break
     od;
     m = 0;
     do
     :: m < NB && !(held[m] == 0 && hsh[m] != NOH) -> m++
     :: else -> break
     od;
     if
     :: b < NB -> skip
     :: m < NB -> b = m                        /* evict a cached block */
     fi;
     m = 0;
     hsh[b] = NOH;
     content[b] = GARB;                        /* stale bytes */
     held[b] = BIT(r);
     TB(r, i) = b;
     i++
  :: else -> break
  od;
  i = 0; b = 0
}

/* ========================================================================== */
/* BsrScheduler (src/bsr/vllm/_scheduler.py), in vLLM's EngineCore             */

/* BsrScheduler._release_inflight */
inline release_inflight(r) {
  k = 0;
  do
  :: k < NCID -> if :: inflight[k] == r + 1 -> inflight[k] = 0 :: else -> skip fi; k++
  :: else -> break
  od;
  k = 0
}

/* BsrScheduler._loading_elsewhere: another request loads one of chunks [loc, end) */
inline loading_elsewhere(r, loc, end, res) {
  res = false;
  k = loc;
  do
  :: k < end ->
     if
     :: inflight[CID(r, k)] != 0 && inflight[CID(r, k)] != r + 1 -> res = true
     :: else -> skip
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

/* BsrScheduler.get_num_new_matched_tokens: ext = NONE_T ("ask again later"), or
 * the chunks bsr loads past vLLM's own hit loc. A lookup is answered None
 * first, then (_await_answer, _collect) with any prefix: 0 also stands for a
 * late answer taken as a miss. */
inline get_num_new_matched_tokens(r, loc, ext) {
  if
  :: loc >= NL || (known[r] && failed[r]) -> ext = 0
  :: else ->
     known[r] = true;
     ext = 0;
     if
     :: hit[r] != NOANS && !used[r] -> skip                        /* answered */
     :: else ->
        if
        :: !asked[r] || used[r] ->                                 /* send it */
           asked[r] = true; used[r] = false; hit[r] = NOANS; ext = NONE_T
        :: else -> select(j : 0 .. NL); hit[r] = j; j = 0          /* the answer is in */
        fi
     fi;
     if
     :: ext == NONE_T -> skip
     :: else ->
        if
        :: hit[r] <= loc -> ext = 0
        :: else ->
           loading_elsewhere(r, loc, hit[r], deferred);
           if
           :: !sync_mode && deferred -> ext = NONE_T                 /* deferred */
           :: else -> lst[r] = loc; lend[r] = hit[r]; ext = hit[r] - loc
           fi;
           deferred = false
        fi
     fi
  fi
}

/* BsrScheduler._admit (sync mode): the blocks vLLM admits a request with.
 * Those past vLLM's own hit are fresh: whatever a failed load left in them is
 * gone. A hit block that a failed sync load wrote taints the request; one that
 * a sync load not known good yet writes makes it wait on that load. */
inline admit(r, loc) {
  k = 0;
  do
  :: k < NL ->
     if
     :: k >= loc && HAS(poison, TB(r, k)) -> poison = poison & ~BIT(TB(r, k)); powner[TB(r, k)] = NOR
     :: k < loc && HAS(poison, TB(r, k)) -> known[r] = true; tainted[r] = true
     :: else -> skip
     fi;
     if
     :: k < loc && HAS(unvb[1 - r], TB(r, k)) -> known[r] = true; waits[r] = waits[r] | BIT(1 - r)
     :: else -> skip
     fi;
     k++
  :: else -> break
  od;
  k = 0;
  if
  :: known[r] && failed[r] -> readm[r] = true
  :: else -> skip
  fi
}

/* BsrScheduler.update_state_after_alloc: the promise becomes a LoadJob */
inline update_state_after_alloc(r, ext, loc) {
  if
  :: sync_mode -> admit(r, loc)
  :: else -> skip
  fi;
  if
  :: ext == 0 || !known[r] || hit[r] == NOANS -> skip
  :: else ->
     assert(!lfail_ever[r]);                  /* (d) never offered a load again */
     assert(!jpend[r] && !wl[r]);             /* one load of a request at a time */
     lend[r] = lst[r] + ext;
     ljs[r] = lst[r]; lje[r] = lend[r];
     unvb[r] = 0;
     k = 0;
     do
     :: k < lend[r] -> ljb[r * NL + k] = TB(r, k); k++
     :: else -> break
     od;
     /* self._unverified_blocks: the blocks the load writes and, sync mode, those its step
      * computes over them (vLLM caches them all in that step) */
     k = lst[r];
     do
     :: k < (sync_mode -> NL : lend[r]) -> unvb[r] = unvb[r] | BIT(TB(r, k)); k++
     :: else -> break
     od;
     k = 0;
     pl = pl | BIT(r);
     used[r] = true; loading[r] = true; unverified[r] = true;
     hit[r] = NOANS;                          /* a used answer is never read again */
     if
     :: !sync_mode ->
        k = lst[r];
        do
        :: k < lend[r] ->
           if :: inflight[CID(r, k)] == 0 -> inflight[CID(r, k)] = r + 1 :: else -> skip fi;
           k++
        :: else -> break
        od;
        k = 0
     :: else -> skip
     fi;
     jpend[r] = true; ocpend[r] = true; rcpend[r] = !sync_mode;
     printf("MSC: R%d LoadJob chunks [%d,%d)\n", r, ljs[r], lje[r])
  fi
}

/* BsrScheduler.build_connector_meta: the step's loads, saves and finished
 * requests; a request scheduled after its load frees its chunks for others */
inline build_connector_meta(s) {
  s_load[s] = pl; pl = 0;
  s_save[s] = ps; ps = 0;
  s_fin[s] = fin_ids; fin_ids = 0;
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(s_sched[s], r) && known[r] && !loading[r] -> release_inflight(r)
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0
}

/* BsrScheduler._outcome (from BsrScheduler.update_connector_output) */
inline outcome(r, ok) {
  if
  :: sync_mode ->
     if
     :: !ok ->                                /* vLLM's cache may hand them out as they are */
        k = 0;
        do
        :: k < NB -> if :: HAS(unvb[r], k) -> powner[k] = r :: else -> skip fi; k++
        :: else -> break
        od;
        k = 0;
        poison = poison | unvb[r]
     :: else -> skip
     fi;
     if
     :: HAS(waits[1 - r], r) -> waits[1 - r] = waits[1 - r] & ~BIT(r); tainted[1 - r] = tainted[1 - r] || !ok
     :: else -> skip
     fi
  :: else -> skip
  fi;
  unvb[r] = 0;
  if
  :: !known[r] -> release_inflight(r)
  :: else ->
     loading[r] = false; unverified[r] = false;
     if
     :: !ok ->
        failed[r] = true; release_inflight(r);
        asked[r] = false; hit[r] = NOANS; used[r] = false   /* never looked up again */
     :: else -> skip
     fi
  fi
}

/* BsrScheduler.request_finished: cdelay = hold the blocks for a save */
inline request_finished(r, cdelay) {
  cdelay = false;
  was = known[r];
  if
  :: known[r] && !readm[r] ->       /* its own failed sync load's blocks, computed again in place */
     k = 0;
     do
     :: k < nct[r] ->
        if
        :: HAS(poison, TB(r, k)) && powner[TB(r, k)] == r ->
           poison = poison & ~BIT(TB(r, k)); powner[TB(r, k)] = NOR
        :: else -> skip
        fi;
        k++
     :: else -> break
     od;
     k = 0
  :: else -> skip
  fi;
  if
  :: known[r] ->                                 /* self._reqs.pop, _drop_lookup */
     known[r] = false; asked[r] = false; hit[r] = NOANS; used[r] = false;
     if
     :: !loading[r] -> release_inflight(r)
     :: else -> skip
     fi
  :: else -> skip
  fi;
  if
  :: was && (unverified[r] || tainted[r] || waits[r] != 0) -> skip   /* saves_skipped: unverified */
  :: else ->
     n = nct[r];                                 /* computed full chunks */
     m = 0; k = 0;
     do
     :: k < n -> m = m | BIT(TB(r, k)); k++
     :: else -> break
     od;
     k = 0;
     if
     :: n == 0 -> skip
     :: n > 0 && (m & (unvb[0] | unvb[1] | poison)) != 0 -> skip     /* shares unverified blocks */
     :: n > 0 && (m & (unvb[0] | unvb[1] | poison)) == 0 ->
        psn[r] = n;
        k = 0;
        do
        :: k < n -> psb[r * NL + k] = TB(r, k); k++
        :: else -> break
        od;
        k = 0;
        ps = ps | BIT(r); saving[r] = true;
        printf("MSC: R%d SaveJob %d chunks\n", r, n);
        cdelay = true                            /* hold the blocks until saved */
     fi;
     n = 0; m = 0
  fi;
  was = false;
  /* the popped _Req is gone */
  loading[r] = false; unverified[r] = false; failed[r] = false;
  tainted[r] = false; waits[r] = 0; readm[r] = false
}

/* ========================================================================== */
/* vLLM's Scheduler (vllm/v1/core/sched/scheduler.py)                          */

/* Scheduler._free_request, the request's status now finished */
inline free_request(r, vdelay) {
  vst[r] = Finished;
  rfirst = 0;
  printf("MSC: R%d finished\n", r);
  fin_ids = fin_ids | BIT(r);
  request_finished(r, cdelay);
  nct[r] = 0; dec[r] = false; npre[r] = 0; lfail_ever[r] = false;   /* read no more */
  if
  :: !(vdelay || cdelay) -> free_blocks(r); gone[r] = true
  :: else -> skip                                /* delay_free_blocks */
  fi;
  cdelay = false
}

/* Scheduler.finish_requests (an abort, or an error): a request waiting for its
 * load keeps its blocks until the load is reported */
inline finish_requests(r) {
  vdelay = false;
  if
  :: vst[r] == WaitingForRemoteKVs -> vdelay = !frk[r]; frk[r] = false; ffk[r] = false
  :: else -> skip
  fi;
  free_request(r, vdelay);
  vdelay = false
}

/* Scheduler._preempt_request */
inline preempt(r) {
  printf("MSC: R%d preempted\n", r);
  rfirst = 0;
  free_blocks(r);
  nct[r] = 0;
  vst[r] = Preempted;
  npre[r]++;
  dec[r] = false
}

/* Scheduler._update_waiting_for_remote_kv */
inline update_waiting_for_remote_kv(r) {
  if
  :: ffk[r] ->
     assert(nct[r] == 0);                         /* (d) nothing of a failed load counts */
     free_blocks(r);
     ffk[r] = false
  :: else ->
     k = 0;
     do                                           /* (d) what counts as computed is verified */
     :: k < nct[r] -> assert(content[TB(r, k)] == CID(r, k)); k++
     :: else -> break
     od;
     k = 0;
     cache_upto(r, nct[r])
  fi;
  frk[r] = false;
  vst[r] = (npre[r] > 0 -> Preempted : Waiting)
}

/* a request scheduled to compute chunks [from, NL) and its last prompt token */
inline sched_run(r, s, from) {
  printf("MSC: R%d runs from chunk %d\n", r, from);
  if                                              /* appended to self.running */
  :: vst[r] != Running -> rfirst = (vst[1 - r] == Running -> 1 - r : 0)
  :: else -> skip
  fi;
  vst[r] = Running;
  s_sched[s] = s_sched[s] | BIT(r);
  if
  :: from < NL ->
     s_comp[s] = s_comp[s] | BIT(r); s_from[SI(s, r)] = from;
     k = 0;
     do
     :: k < NL -> CB(s, r, k) = TB(r, k); k++
     :: else -> break
     od;
     k = 0
  :: else -> skip
  fi;
  nct[r] = NL;
  cache_upto(r, NL)                               /* allocate_slots caches them now */
}

/* Scheduler.schedule (then build_connector_meta): one engine step */
inline schedule(s) {
  preempted = false;
  /* the running requests: preempted, or scheduled */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: vst[r] == Running && npre[r] < MAXPRE -> preempt(r); preempted = true
     :: vst[r] == Running && nct[r] < NL -> sched_run(r, s, nct[r])        /* recompute */
     :: vst[r] == Running && nct[r] == NL && !dec[r] ->
        dec[r] = true; s_sched[s] = s_sched[s] | BIT(r); s_dec[s] = s_dec[s] | BIT(r)
     :: vst[r] != Running || (nct[r] == NL && dec[r]) -> skip
     fi;
     r++
  :: else -> break
  od;
  /* the waiting requests, unless this step preempted one */
  r = 0;
  do
  :: r < NREQ && !preempted ->
     if
     :: vst[r] == WaitingForRemoteKVs && frk[r] -> update_waiting_for_remote_kv(r)
     :: else -> skip
     fi;
     if
     :: (vst[r] == Waiting || vst[r] == Preempted) && nct[r] > 0 -> sched_run(r, s, nct[r])
     :: (vst[r] == Waiting || vst[r] == Preempted) && nct[r] == 0 ->
        local_hit(r, loc);
        get_num_new_matched_tokens(r, loc, ext);
        if
        :: ext == NONE_T -> skip                  /* skip_request: asked again next step */
        :: else ->
           allocate(r, loc);
           update_state_after_alloc(r, ext, loc);
           if
           :: !sync_mode && ext > 0 ->
              vst[r] = WaitingForRemoteKVs; nct[r] = loc + ext;
              printf("MSC: R%d waits for its load\n", r)
           :: else -> sched_run(r, s, loc + ext)
           fi
        fi;
        lst[r] = 0; lend[r] = 0;                 /* read by the steps above only */
        loc = 0; ext = 0
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0; preempted = false;
  build_connector_meta(s)
}

/* Scheduler.update_from_output, for the oldest step in flight */
inline update_from_output(s) {
  errs = 0; skipm = 0;
  /* _handle_failed_recving */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(o_fail[s], r) && vst[r] == WaitingForRemoteKVs ->
        if
        :: policy_fail -> errs = errs | BIT(r)
        :: else -> nct[r] = 0; ffk[r] = true
        fi
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  /* _handle_invalid_blocks: _update_requests_with_invalid_blocks over the
   * running requests, in the order of self.running */
  if
  :: o_inv[s] != 0 ->
     mk = 0;
     j = 0;
     do
     :: j < NREQ ->
        r = (vst[rfirst] == Running -> rfirst : 1 - rfirst);
        r = (j == 0 -> r : 1 - r);
        if
        :: vst[r] == Running ->
           n = (HAS(s_comp[s], r) -> s_from[SI(s, r)] : nct[r]);   /* computed before the step */
           aff = false; mine = false;
           k = 0;
           do
           :: k < n ->
              if
              :: HAS(o_inv[s], TB(r, k)) ->
                 aff = true;
                 if
                 :: HAS(mk, TB(r, k)) -> skip     /* another request recomputes it */
                 :: else ->
                    mk = mk | BIT(TB(r, k));
                    if
                    :: !mine ->
                       mine = true; nct[r] = k;  /* truncated at the first failed block */
                       if
                       :: policy_fail ->         /* it and what follows leave the cache */
                          m = k;
                          do
                          :: m < NL -> hsh[TB(r, m)] = NOH; m++
                          :: else -> break
                          od;
                          m = 0
                       :: else -> skip
                       fi
                    :: else -> skip
                    fi
                 fi
              :: else -> skip
              fi;
              k++
           :: else -> break
           od;
           k = 0;
           if
           :: aff ->
              if
              :: !mine -> nct[r] = n
              :: else -> skip
              fi;
              dec[r] = false;
              skipm = skipm | BIT(r);
              if
              :: policy_fail -> errs = errs | BIT(r)
              :: else -> skip
              fi
           :: else -> skip
           fi;
           aff = false; mine = false; n = 0
        :: else -> skip
        fi;
        j++
     :: else -> break
     od;
     j = 0; r = 0; mk = 0
  :: else -> skip
  fi;
  skipm = skipm | errs;
  /* the step's requests: one may stop here (after its decode step it does) */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(s_sched[s], r) && !HAS(skipm, r) && (vst[r] == Running || vst[r] == Preempted) ->
        if
        :: vst[r] == Running && HAS(s_dec[s], r) -> free_request(r, false)
        :: free_request(r, false)
        :: !(vst[r] == Running && HAS(s_dec[s], r)) -> skip
        fi
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  /* kv_load_failure_policy="fail": finish_requests(FINISHED_ERROR) */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(errs, r) && vst[r] != Finished -> finish_requests(r)
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  /* _update_from_kv_xfer_finished: the connector first (BsrScheduler.update_connector_output) */
  r = 0;
  do
  :: r < NREQ ->
     if :: HAS(o_send[s], r) -> saving[r] = false :: else -> skip fi;
     if :: HAS(o_oc[s], r) -> outcome(r, HAS(o_ok[s], r)) :: else -> skip fi;
     r++
  :: else -> break
  od;
  /* then finished_recving and finished_sending */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(o_recv[s], r) ->
        assert(!gone[r]);                        /* vLLM asserts it is in self.requests */
        if
        :: vst[r] == WaitingForRemoteKVs -> frk[r] = true
        :: else -> assert(vst[r] == Finished); free_blocks(r); gone[r] = true
        fi
     :: else -> skip
     fi;
     if
     :: HAS(o_send[s], r) ->
        assert(!gone[r] && vst[r] == Finished);
        free_blocks(r); gone[r] = true
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0; errs = 0; skipm = 0
}

/* the oldest step's output is processed: the next step becomes the oldest */
inline shift() {
  s_load[0] = s_load[1]; s_save[0] = s_save[1]; s_fin[0] = s_fin[1];
  s_sched[0] = s_sched[1]; s_comp[0] = s_comp[1]; s_dec[0] = s_dec[1];
  o_recv[0] = o_recv[1]; o_fail[0] = o_fail[1]; o_send[0] = o_send[1];
  o_inv[0] = o_inv[1]; o_oc[0] = o_oc[1]; o_ok[0] = o_ok[1];
  s_load[1] = 0; s_save[1] = 0; s_fin[1] = 0; s_sched[1] = 0; s_comp[1] = 0; s_dec[1] = 0;
  o_recv[1] = 0; o_fail[1] = 0; o_send[1] = 0; o_inv[1] = 0; o_oc[1] = 0; o_ok[1] = 0;
  k = 0;
  do
  :: k < NREQ * NL -> s_cb[k] = s_cb[NREQ * NL + k]; s_cb[NREQ * NL + k] = 0; k++
  :: else -> break
  od;
  k = 0;
  do
  :: k < NREQ -> s_from[k] = s_from[NREQ + k]; s_from[NREQ + k] = 0; k++
  :: else -> break
  od;
  k = 0
}

/* ========================================================================== */
/* BsrWorker (src/bsr/vllm/_worker.py) and bsr's tasks, in the worker process  */

/* a task of request r on the loop ends: _Load.done, nothing more is written */
inline restore_end() {
  j = ljs[r];
  do
  :: j < lje[r] -> chunk_loads[CID(r, j)]--; writer[ljb[r * NL + j]] = NOR; j++
  :: else -> break
  od;
  j = 0;
  rst[r] = 0;
  wdone[r] = true;
  wrep[r] = false
}

/* bsr's event loop (the connector's LoopThread): one task advances at a time.
 *  - A restore (BsrWorker._run_load -> RestoreEngine.restore) writes the blocks
 *    past vLLM's own hit (one step: a failure after one block or after two
 *    leaves the same), then commits; or it fails or is cancelled
 *    (BsrWorker._cancel) at any point: a read error, the deadline, an abort.
 *  - A save (BsrWorker._save_one) reads the request's blocks. */
proctype Loop() {
  byte r, j, b;
end:
  do
  :: atomic {
       (rst[0] == 1 || rst[1] == 1) ->
       if :: rst[0] == 1 -> r = 0 :: rst[1] == 1 -> r = 1 fi;
       j = ljs[r];
       do
       :: j < lje[r] ->
          b = ljb[r * NL + j];
          assert(!wrep[r]);                                         /* (b) */
          assert(sync_mode || (HAS(held[b], r) && hsh[b] == NOH));  /* (b) */
          content[b] = GARB;                       /* installed, not verified yet */
          j++
       :: else -> break
       od;
       rst[r] = 2;
       printf("MSC: R%d restore writes its blocks\n", r);
       r = 0; j = 0; b = 0
     }
  :: atomic {
       (rst[0] == 2 || rst[1] == 2) ->             /* RestoreResult.committed */
       if :: rst[0] == 2 -> r = 0 :: rst[1] == 2 -> r = 1 fi;
       j = ljs[r];
       do
       :: j < lje[r] -> content[ljb[r * NL + j]] = CID(r, j); j++
       :: else -> break
       od;
       wok[r] = true;
       printf("MSC: R%d restore commits\n", r);
       restore_end();
       r = 0
     }
  :: atomic {
       (rst[0] != 0 || rst[1] != 0) ->             /* failed or cancelled */
       if :: rst[0] != 0 -> r = 0 :: rst[1] != 0 -> r = 1 fi;
       printf("MSC: R%d restore fails\n", r);
       restore_end();
       r = 0
     }
  :: atomic {
       (svrun[0] || svrun[1]) ->
       if :: svrun[0] -> r = 0 :: svrun[1] -> r = 1 fi;
       j = 0;
       do
       :: j < psn[r] ->
          b = psb[r * NL + j];
          assert(HAS(held[b], r));                 /* (e) still the request's block */
          assert(content[b] == CID(r, j));         /* (a) computed or verified-installed */
          j++
       :: else -> break
       od;
       svrun[r] = false; psn[r] = 0; psb[r * NL] = 0; psb[r * NL + 1] = 0;
       wsv[r] = (wsv[r] == 1 -> 2 : wsv[r]);       /* its future is done (if still kept) */
       printf("MSC: R%d save reads its blocks\n", r);
       r = 0; j = 0; b = 0
     }
  od
}

/* BsrWorker._account: the load's outcome, for the scheduler */
inline account(r) {
  oc = oc | BIT(r);
  ocok = (wok[r] -> ocok | BIT(r) : ocok & ~BIT(r));
  assert(ocpend[r]);                               /* (c) one outcome per load */
  ocpend[r] = false;
  lfail_ever[r] = lfail_ever[r] || !wok[r]
}

/* the load was reported (and its task ended): the worker forgets it */
inline forget_load(r) {
  if
  :: wdone[r] ->
     wok[r] = false; wdone[r] = false;
     ljb[r * NL] = 0; ljb[r * NL + 1] = 0; ljs[r] = 0; lje[r] = 0
  :: else -> skip
  fi
}

/* BsrConnector.start_load_kv -> BsrWorker.start_load: the step's loads start */
inline start_load(s) {
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(s_load[s], r) ->
        jpend[r] = false; wdone[r] = false; wok[r] = false; wrep[r] = false;
        wl[r] = !sync_mode;
        i = ljs[r];
        do
        :: i < lje[r] ->
           b = ljb[r * NL + i];
           assert(writer[b] == NOR);              /* (g) */
           writer[b] = r;
           assert(chunk_loads[CID(r, i)] == 0);   /* (f) */
           chunk_loads[CID(r, i)]++;
           i++
        :: else -> break
        od;
        i = 0; b = 0;
        rst[r] = 1                                 /* the task starts on the loop */
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0
}

/* the worker's step s once its sync loads ended: their outcomes, the forward,
 * the async loads, the saves, and the report */
inline step_rest(s) {
  if
  :: sync_mode ->                                  /* BsrWorker.start_load, after BsrWorker._wait_sync */
     r = 0;
     do
     :: r < NREQ ->
        if
        :: HAS(s_load[s], r) ->
           wrep[r] = !wdone[r];
           account(r);
           if
           :: !wok[r] ->                           /* every block bsr was to fill */
              i = ljs[r];
              do
              :: i < lje[r] -> load_errors = load_errors | BIT(ljb[r * NL + i]); i++
              :: else -> break
              od;
              i = 0
           :: else -> skip
           fi;
           forget_load(r)
        :: else -> skip
        fi;
        r++
     :: else -> break
     od;
     r = 0
  :: else -> skip
  fi;
  /* the forward: each computed chunk's KV, correct only over correct KV */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(s_comp[s], r) ->
        i = s_from[SI(s, r)];
        do
        :: i < NL ->
           ok = true; b = 0;
           do
           :: b < i -> ok = ok && (content[CB(s, r, b)] == CID(r, b)); b++
           :: else -> break
           od;
           content[CB(s, r, i)] = (ok -> CID(r, i) : GARB);
           i++
        :: else -> break
        od;
        i = 0; b = 0; ok = false
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0;
  /* async mode: start_load_kv comes after the forward */
  if
  :: !sync_mode -> start_load(s)
  :: else -> skip
  fi;
  /* BsrConnector.wait_for_save -> BsrWorker.start_saves */
  r = 0;
  do
  :: r < NREQ ->
     if
     :: HAS(s_save[s], r) -> wsv[r] = 1; svrun[r] = true   /* the task starts on the loop */
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0;
  /* BsrConnector.get_finished -> BsrWorker.transfer_results: the finished
   * requests (a load of one still running is cancelled: the restore may stop
   * at any point anyway), the loads whose task ended, the saves done */
  do
  :: r < NREQ ->
     if :: HAS(s_fin[s], r) -> wfin[r] = true :: else -> skip fi;
     r++
  :: else -> break
  od;
  r = 0;
  do
  :: r < NREQ ->
     if
     :: wl[r] && wdone[r] ->
        o_recv[s] = o_recv[s] | BIT(r);
        wrep[r] = !wdone[r];
        assert(rcpend[r]);                         /* (c) one finished_recving per load */
        rcpend[r] = false;
        account(r);
        if
        :: !wok[r] -> o_fail[s] = o_fail[s] | BIT(r)
        :: else -> skip
        fi;
        wl[r] = false; forget_load(r)              /* del self._loads[rid] */
     :: else -> skip
     fi;
     r++
  :: else -> break
  od;
  r = 0;
  do
  :: r < NREQ ->
     if
     :: wsv[r] == 2 && wfin[r] ->
        wsv[r] = 0; wfin[r] = false; o_send[s] = o_send[s] | BIT(r)
     :: else -> skip
     fi;
     /* self._finished keeps a finished id 64 steps for a save still to come;
      * a save comes in the step of its finished id, so the model keeps it only
      * while the save runs (a later save would never be reported: its blocks
      * would never be given back, which the end checks) */
     wfin[r] = wfin[r] && wsv[r] != 0;
     r++
  :: else -> break
  od;
  r = 0;
  /* BsrConnector.get_block_ids_with_load_errors -> BsrWorker.load_errors;
   * BsrConnector.build_connector_worker_meta -> BsrWorker.worker_meta */
  o_inv[s] = load_errors; load_errors = 0;
  o_oc[s] = oc; o_ok[s] = ocok & oc; oc = 0; ocok = 0;
  printf("MSC: worker ran a step\n");
  nexec++
}

/* the worker process: the steps in flight, one at a time, in order */
proctype Worker() {
  byte r, i, b;
  bool ok;
  do
  :: atomic {
       /* sync mode: start_load_kv before the forward */
       nexec < nfl && !wphase && sync_mode && s_load[nexec] != 0 ->
       start_load(nexec);
       wphase = true
     }
  :: atomic {
       nexec < nfl &&
       ((!wphase && !(sync_mode && s_load[nexec] != 0)) ||
        (wphase && (!HAS(s_load[nexec], 0) || wdone[0]) && (!HAS(s_load[nexec], 1) || wdone[1]))) ->
       wphase = false;
       step_rest(nexec)
     }
  :: atomic { stopped -> wstopped = true; break }
  od
}

/* ========================================================================== */
/* the clients, and vLLM's EngineCore                                          */

/* Request 0 arrives, then request 1 (in index order: they are symmetric);
 * each may be aborted at any time after (EngineCore.abort_requests), or not. */
proctype Env() {
  byte r, k, i, j, b, n, m;
  bool was, cdelay, vdelay;
  byte settled;                                    /* aborted, or never will be */
  do
  :: atomic { vst[0] == Absent -> vst[0] = Waiting; printf("MSC: R0 arrives\n") }
  :: atomic { vst[0] != Absent && vst[1] == Absent -> vst[1] = Waiting; printf("MSC: R1 arrives\n") }
  :: atomic {
       (vst[0] != Absent && !HAS(settled, 0)) || (vst[1] != Absent && !HAS(settled, 1)) ->
       if
       :: vst[0] != Absent && !HAS(settled, 0) -> r = 0
       :: vst[1] != Absent && !HAS(settled, 1) -> r = 1
       fi;
       settled = settled | BIT(r);
       if
       :: vst[r] != Finished -> printf("MSC: R%d aborted\n", r); finish_requests(r)
       :: skip                                     /* never aborted */
       fi;
       r = 0
     }
  :: atomic { settled == 3 -> break }
  od
}

/* vLLM's EngineCore busy loop: schedule a step while fewer than NS are in
 * flight, or process the oldest step's output once the worker ran it (the
 * Env's arrivals and aborts come in between: _process_input_queue, and
 * _process_aborts_queue before update_from_output). Then the end checks. */
init {
  byte r, i, j, k, b, m, n, mk, loc, ext, errs, skipm;
  byte hb[NL];
  bool preempted, deferred, was, cdelay, vdelay, aff, mine;
  atomic {
    if :: sync_mode = false :: sync_mode = true fi;
    if :: policy_fail = false :: policy_fail = true fi;
    if :: same_prompt = false :: same_prompt = true fi;
    printf("MSC: sync %d, policy fail %d, same prompt %d\n", sync_mode, policy_fail, same_prompt);
    run Worker();
    run Loop();
    run Env()
  }
  do
  :: atomic {
       nfl < NS && ((vst[0] != Absent && !gone[0]) || (vst[1] != Absent && !gone[1])) ->
       schedule(nfl);
       printf("MSC: step scheduled\n");
       nfl++
     }
  :: atomic {
       nexec > 0 ->
       printf("MSC: step output: recv %d failed %d sent %d invalid %d\n", o_recv[0], o_fail[0], o_send[0], o_inv[0]);
       update_from_output(0);
       shift();
       nfl--; nexec--
     }
  :: atomic { nfl == 0 && gone[0] && gone[1] -> stopped = true; break }
  od;
  /* every bsr task ended (a deadlock here is an invalid end state) */
  (wstopped && rst[0] == 0 && rst[1] == 0 && !svrun[0] && !svrun[1]);
  d_step {
    r = 0;
    do
    :: r < NREQ ->
       assert(vst[r] == Finished && gone[r]);
       assert(!ocpend[r] && !rcpend[r]);           /* (c) every load reported */
       /* (h) nothing left behind on either side */
       assert(!known[r] && !saving[r] && unvb[r] == 0 && !wl[r] && wsv[r] == 0 && !jpend[r]);
       r++
    :: else -> break
    od;
    b = 0;
    do
    :: b < NB -> assert(held[b] == 0 && writer[b] == NOR); b++   /* (h) blocks given back */
    :: else -> break
    od;
    assert(inflight[0] == 0 && inflight[1] == 0 && inflight[2] == 0 && pl == 0 && ps == 0);
    ended = true
  }
}

/* (h) every fair run ends */
ltl terminates { <> ended }
