// sgl's CPU helper team: the threads that share a decode step (cpu_layer.c) and a product
// (cpu_kernel.c's sgl_qlinear_into, the LM head among them) with the thread that calls.
//
// Why not an OpenMP region per call: a region ends with every thread of its team, so the
// caller waits there for a helper that the OS has not run yet, however little the helper did.
// On a shared 2-core machine (other processes; in the engine, its own Python threads) that
// wait is a scheduler timeslice: the tied head took 8 ms on two threads against 3.5 on one.
// Here the helpers are threads of their own, kept between calls: the caller publishes a job
// (blocks of work), claims blocks itself, and waits only for blocks a helper has *claimed*
// (a CAS on one job word); a helper that is not running claims nothing and delays nothing,
// and the caller leaves a session without waiting for anyone.
//
//   job = (stage << 40) | (blocks << 20) | next_block      one word: a claim is a CAS on it,
//                                                          so it cannot hit a newer job
//
// Helpers spin while a session is open, linger (spinning) for LINGER_NS after it closes (the
// head follows the decode step), then sleep on a condition variable until the next session.
// One session at a time: a second caller (another engine's step) runs alone. Which thread
// runs a block never changes its result, only the time.
#define _GNU_SOURCE
#include "cpu_team.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define JOB_BITS 20
#define JOB_MASK ((1ull << JOB_BITS) - 1)
#define TEAM_MAX 64            // threads of a session, the caller included
#define LINGER_NS 300000       // a helper's spin after a session before it sleeps

struct sgl_team {
  _Atomic uint64_t job;
  _Atomic int64_t done;  // blocks of the current job finished
  _Atomic int open;      // a session is open
  _Atomic int active;    // its threads: helpers 1 .. active - 1 take part
  // The current job (written by the caller before it publishes `job`; read by a helper only
  // after it claimed a block, and not changed until every claimed block is done).
  sgl_team_fn fn;
  const void* ctx;
  uint64_t stage;  // (the caller's, under `use`: increases across sessions)
  int created;     // helpers started (never stopped), under `use`
  pthread_mutex_t use;  // held by the session's caller
  pthread_mutex_t m;    // with cv: helpers sleep until a session opens
  pthread_cond_t cv;
};

static sgl_team team = {.use = PTHREAD_MUTEX_INITIALIZER, .m = PTHREAD_MUTEX_INITIALIZER,
                        .cv = PTHREAD_COND_INITIALIZER};

// Claims and runs blocks of the job of `stage` until none is left.
static void claim_blocks(sgl_team* t, uint64_t stage, int worker) {
  for (;;) {
    uint64_t job = atomic_load_explicit(&t->job, memory_order_acquire);
    uint64_t next = job & JOB_MASK, blocks = (job >> JOB_BITS) & JOB_MASK;
    if ((job >> (2 * JOB_BITS)) != stage || next >= blocks) return;
    if (!atomic_compare_exchange_weak_explicit(&t->job, &job, job + 1, memory_order_acq_rel,
                                               memory_order_relaxed))
      continue;
    t->fn(t->ctx, (int64_t)next, worker);
    atomic_fetch_add_explicit(&t->done, 1, memory_order_release);
  }
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int taking_part(sgl_team* t, int worker) {
  return atomic_load_explicit(&t->open, memory_order_acquire) &&
         worker < atomic_load_explicit(&t->active, memory_order_relaxed);
}

static void* helper_main(void* arg) {
  sgl_team* t = &team;
  const int worker = (int)(intptr_t)arg;
  for (;;) {
    pthread_mutex_lock(&t->m);
    while (!taking_part(t, worker)) pthread_cond_wait(&t->cv, &t->m);
    pthread_mutex_unlock(&t->m);
    int64_t linger_end = 0;
    for (;;) {
      if (taking_part(t, worker)) {
        linger_end = 0;
        uint64_t job = atomic_load_explicit(&t->job, memory_order_acquire);
        if ((job & JOB_MASK) < ((job >> JOB_BITS) & JOB_MASK)) {
          claim_blocks(t, job >> (2 * JOB_BITS), worker);
          continue;
        }
      } else if (linger_end == 0) {
        linger_end = now_ns() + LINGER_NS;
      } else if (now_ns() > linger_end) {
        break;
      }
      _mm_pause();
    }
  }
  return NULL;
}

// A forked child has none of the helpers, and may have copied a lock some thread held: it
// starts from a fresh team.
static void reset_in_child(void) {
  sgl_team* t = &team;
  atomic_store(&t->open, 0);
  atomic_store(&t->active, 0);
  t->created = 0;
  pthread_mutex_init(&t->use, NULL);
  pthread_mutex_init(&t->m, NULL);
  pthread_cond_init(&t->cv, NULL);
}

static pthread_once_t at_fork = PTHREAD_ONCE_INIT;
static void register_at_fork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

sgl_team* sgl_team_begin(int threads) {
  sgl_team* t = &team;
  if (threads <= 1) return NULL;
  pthread_once(&at_fork, register_at_fork);
  if (pthread_mutex_trylock(&t->use) != 0) return NULL;
  if (threads > TEAM_MAX) threads = TEAM_MAX;
  while (t->created < threads - 1) {
    pthread_attr_t attr;
    pthread_t thread;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attr, helper_main, (void*)(intptr_t)(t->created + 1));
    pthread_attr_destroy(&attr);
    if (failed) break;
    t->created++;
  }
  if (t->created == 0) {
    pthread_mutex_unlock(&t->use);
    return NULL;
  }
  pthread_mutex_lock(&t->m);
  atomic_store_explicit(&t->active, threads, memory_order_relaxed);
  atomic_store_explicit(&t->open, 1, memory_order_release);
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->m);
  return t;
}

int sgl_team_workers(const sgl_team* t) { return t->created + 1; }

void sgl_team_run(sgl_team* t, sgl_team_fn fn, const void* ctx, int64_t blocks) {
  if (blocks <= 0) return;
  if ((uint64_t)blocks > JOB_MASK) {  // (more than the job word counts: the caller alone)
    for (int64_t b = 0; b < blocks; b++) fn(ctx, b, 0);
    return;
  }
  t->fn = fn, t->ctx = ctx;
  t->stage = (t->stage + 1) & ((1ull << (64 - 2 * JOB_BITS)) - 1);
  atomic_store_explicit(&t->done, 0, memory_order_relaxed);  // (no helper touches it now)
  atomic_store_explicit(&t->job, (t->stage << (2 * JOB_BITS)) | ((uint64_t)blocks << JOB_BITS),
                        memory_order_release);
  claim_blocks(t, t->stage, 0);
  while (atomic_load_explicit(&t->done, memory_order_acquire) < blocks) _mm_pause();
}

void sgl_team_end(sgl_team* t) {
  atomic_store_explicit(&t->open, 0, memory_order_release);
  pthread_mutex_unlock(&t->use);
}
