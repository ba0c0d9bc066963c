/* The threads the CPU kernels share: a job is cut into chunks, and whichever thread is free takes the next one,
   the caller too. The caller never waits for a helper that has not started: if the operating system has parked
   every helper (another process wants the cores), the caller takes every chunk itself, and the product costs
   what it costs on one thread. It waits only for a chunk a helper has already taken, a few microseconds of work.

   OpenMP's `parallel for` (what these kernels used before) gives each thread its share up front and waits at the
   end for all of them: on a 2-core machine with one other busy process, a decode step of a hundred products
   waited a scheduler slice (milliseconds) again and again, and one thread was faster than two.

   The chunks are dealt in as many runs as there are threads, each thread starting at the front of its own run:
   a thread reads one stretch of memory front to back, as the hardware prefetcher likes it (chunks dealt one by
   one to alternate threads cut every thread's reads into short pieces: two threads read int8 weights slower
   than one). A thread done with its run takes chunks from the front of the others'.

   One job at a time: each run's next chunk is one 64-bit word (the job's number, the run's end, its next chunk),
   taken by compare-and-swap, so a helper that wakes late can never take a chunk of a later job. Helpers spin a
   little after a job (the next product of a decode step follows within microseconds), then sleep on a futex
   until the next one. A second caller while a job runs (two Python threads decoding at once) computes its own
   job alone. */

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#define MAX_THREADS 64
#define SPIN_NS 100000 /* how long an idle helper spins before it sleeps: 0.1 ms */
#define LATE_NS 100000     /* 0.1 ms: a chunk is a few microseconds of work */
#define ABSENT_NS 200000   /* 0.2 ms: more than an idle core takes to wake (a virtual machine's too) */
#define ABSENT_JOBS 3
#define FIRST_SOLO 32      /* jobs: about a decode step of GPT-2 124M at batch 1 */
#define MAX_SOLO 4096
#define CLEAN_JOBS 1024

/* Each word the threads write on a cache line of its own: a line written by one core and read by another moves
   between them, and words sharing a line would move it for each other. */
#define LINE __attribute__((aligned(64)))
struct run {
  LINE _Atomic uint64_t next; /* job number << 32 | end << 16 | next chunk */
};
static struct {
  struct run runs[MAX_THREADS];
  LINE _Atomic int done;        /* chunks of the current job finished */
  LINE _Atomic uint32_t posted; /* the last job's number: the word idle helpers wait on */
  _Atomic int sleeping;         /* helpers asleep on `posted` */
  _Atomic int threads;          /* the current job's threads: runs 0 .. threads - 1 */
  _Atomic int held;             /* tests: helpers take no chunk (as if the system had parked them) */
  pool_task task;
  const void* args;
  uint32_t jobs;
  int started;
  int solo;     /* jobs left to run on the caller alone */
  int solo_len; /* how many it was last time (0: no trouble lately) */
  int absent;   /* jobs in a row the helpers missed */
  int clean;    /* jobs run together without trouble since the last */
} pool;
static pthread_mutex_t submit = PTHREAD_MUTEX_INITIALIZER;

static uint64_t now_ns(void)
{
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* The next chunk of run `r` of job `job`, or -1 when the run has none left (or the job is over). */
static int claim(int r, uint32_t job)
{
  _Atomic uint64_t* next = &pool.runs[r].next;
  uint64_t w = atomic_load_explicit(next, memory_order_acquire);
  for (;;) {
    const int chunk = (int)(w & 0xFFFF), end = (int)((w >> 16) & 0xFFFF);
    if ((uint32_t)(w >> 32) != job || chunk >= end) return -1;
    if (atomic_compare_exchange_weak_explicit(next, &w, w + 1, memory_order_acq_rel, memory_order_acquire))
      return chunk;
  }
}

/* Thread `me` takes chunks of job `job`, from its own run, then from the others', until none is left. The task
   and its arguments are read after a chunk is taken: the job cannot end before that chunk is done, so they are
   still the job's. */
static int work(int me, uint32_t job, int threads)
{
  int done = 0;
  for (int i = 0; i < threads; i++)
    for (int r = (me + i) % threads, chunk; (chunk = claim(r, job)) >= 0; done++) pool.task(pool.args, chunk);
  if (done) atomic_fetch_add_explicit(&pool.done, done, memory_order_release); /* once: the line moves once */
  return done;
}

static void* helper(void* arg)
{
  const int me = (int)(intptr_t)arg; /* run `me`: the caller's is run 0 */
  uint32_t seen = atomic_load(&pool.posted);
  for (;;) {
    uint32_t job;
    const uint64_t since = now_ns();
    for (int spins = 0; (job = atomic_load_explicit(&pool.posted, memory_order_acquire)) == seen; spins++) {
      _mm_pause();
      if (spins % 64 || now_ns() - since < SPIN_NS) continue;
      atomic_fetch_add(&pool.sleeping, 1);
      if (atomic_load(&pool.posted) == seen) syscall(SYS_futex, &pool.posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      atomic_fetch_sub(&pool.sleeping, 1);
    }
    seen = job;
    while (atomic_load_explicit(&pool.held, memory_order_relaxed)) _mm_pause();
    const int threads = atomic_load_explicit(&pool.threads, memory_order_relaxed);
    if (me < threads) work(me, job, threads);
  }
  return NULL;
}

/* In a child process made by fork the helpers do not exist: start new ones when they are wanted. */
static void forget_helpers(void) { pool.started = 0; }

void pool_run(int threads, int chunks, pool_task task, const void* args)
{
  if (threads > chunks) threads = chunks;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  const int alone = threads <= 1 || chunks > 0xFFFF || pthread_mutex_trylock(&submit) != 0;
  if (alone || pool.solo > 0) {
    if (!alone) pool.solo--, pthread_mutex_unlock(&submit);
    for (int c = 0; c < chunks; c++) task(args, c);
    return;
  }
  if (pool.started == 0) pthread_atfork(NULL, NULL, forget_helpers);
  while (pool.started < threads - 1) {
    pthread_t t;
    if (pthread_create(&t, NULL, helper, (void*)(intptr_t)(pool.started + 1)) != 0) break; /* fewer: still right */
    pthread_detach(t);
    pool.started++;
  }
  pool.task = task, pool.args = args;
  atomic_store(&pool.done, 0);
  atomic_store(&pool.threads, threads);
  const uint32_t job = ++pool.jobs;
  for (int r = 0; r < threads; r++) { /* run r: chunks [r * chunks / threads, (r + 1) * chunks / threads) */
    const uint64_t start = (uint64_t)r * chunks / threads, end = (uint64_t)(r + 1) * chunks / threads;
    atomic_store_explicit(&pool.runs[r].next, (uint64_t)job << 32 | end << 16 | start, memory_order_release);
  }
  const uint64_t posted_at = now_ns();
  atomic_store(&pool.posted, job);
  if (atomic_load(&pool.sleeping) > 0) syscall(SYS_futex, &pool.posted, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
  const int mine = work(0, job, threads);
  const uint64_t worked_until = now_ns();
  /* only chunks helpers are running are left: a few microseconds, unless one was parked mid-chunk */
  for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++)
    if (spins < 4096) _mm_pause();
    else sched_yield();
  /* A helper that kept the caller waiting LATE_NS for a chunk it had taken, or took no chunk in ABSENT_JOBS jobs
     in a row while the caller worked ABSENT_NS, was not given a core: other work wants the cores (or, on a
     virtual machine, the host took the helper's). The next jobs run on the caller alone, its helpers asleep and
     not competing with it for a core: FIRST_SOLO jobs, twice as many each time the trouble comes back right
     after (up to MAX_SOLO: a busy machine stays busy), FIRST_SOLO again after CLEAN_JOBS jobs without it (a
     hiccup costs little). */
  const int late = now_ns() - worked_until > LATE_NS;
  pool.absent = mine == chunks && worked_until - posted_at > ABSENT_NS ? pool.absent + 1 : 0;
  if (late || pool.absent >= ABSENT_JOBS) {
    pool.solo_len = pool.solo_len == 0 ? FIRST_SOLO : pool.solo_len < MAX_SOLO ? 2 * pool.solo_len : MAX_SOLO;
    pool.solo = pool.solo_len, pool.absent = 0, pool.clean = 0;
  } else if (++pool.clean >= CLEAN_JOBS) {
    pool.solo_len = 0, pool.clean = 0;
  }
  pthread_mutex_unlock(&submit);
}

void pool_hold_helpers(int held) { atomic_store(&pool.held, held); }
