/* pool_for: the native kernels' parallel loops, without a barrier on late threads.
 *
 * Why not `#pragma omp parallel for`: an OpenMP region ends at a barrier that waits for
 * every thread of the team, and a static schedule gives each thread a fixed share. On a
 * machine whose cores other processes also use, one of the two threads is often off its
 * core for a scheduler time slice (~4 ms here), and every region then waits for it: a
 * decode step of ~150 regions of 10-300 us each ran 5x slower with 2 threads than with 1
 * (SmolLM2 bf16, 32 sequences, load average 4-5 on 2 cores).
 *
 * Here the calling thread publishes a job of `chunks` pieces and takes pieces itself; helper
 * threads take pieces when they are running. The caller waits only for pieces a helper has
 * already taken (it sleeps on a futex after a short spin, so its core can run the helper or
 * whoever else waits), never for a helper that has not started. On a quiet machine the
 * helpers spin between jobs and join within a microsecond or so.
 *
 * Each piece computes the same values whichever thread runs it, so results do not depend
 * on the thread count. Threads: omp_get_max_threads() of the calling thread (what
 * torch.set_num_threads sets), so the kernels keep using as many cores as PyTorch does.
 * One job at a time: a call made while another thread's job runs (or from inside a piece)
 * runs its loop inline.
 */
#include <immintrin.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

typedef void (*pool_fn)(void *ctx, int64_t lo, int64_t hi);

#define MAX_HELPERS 63
#define MAX_CHUNKS ((1 << 20) - 1)
#define HELPER_SPIN_CYCLES 400000ull /* ~100 us idle before a helper sleeps */
#define CALLER_SPIN_CYCLES 100000ull /* ~30 us before the caller sleeps on a taken piece */

/* claim word: generation (24 bits) | next piece (20) | pieces (20); a piece is taken by a
 * compare-and-swap that also checks the generation, so a slow helper never takes a piece
 * of a later job with an earlier job's view. */
#define GEN_SHIFT 40
#define NEXT_SHIFT 20
#define FIELD ((1ull << 20) - 1)

#define LINE __attribute__((aligned(64))) /* one cache line each: no false sharing */

static struct {
    LINE _Atomic uint64_t claim;
    LINE _Atomic uint32_t done; /* pieces finished in the current job (futex word) */
    _Atomic int caller_waits;   /* the caller sleeps on `done` */
    LINE _Atomic uint32_t job;  /* bumped per job (futex word the helpers sleep on) */
    _Atomic int active;         /* helpers that take part in the current job */
    LINE _Atomic int sleepers;  /* helpers asleep on `job` */
    LINE pool_fn fn;            /* the current job: written before `claim` is published */
    void *ctx;
    int64_t n, grain;
    LINE int started;
    pthread_mutex_t run, grow;
} P = {.run = PTHREAD_MUTEX_INITIALIZER, .grow = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int inside_piece;

static void futex_wait(_Atomic uint32_t *addr, uint32_t seen) {
    struct timespec limit = {0, 2000000}; /* 2 ms: a missed wake costs a little, never hangs */
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, seen, &limit, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
}

/* Take and run pieces of generation gen until none is left. */
static void take_pieces(uint64_t gen) {
    uint64_t w = atomic_load_explicit(&P.claim, memory_order_acquire);
    for (;;) {
        uint64_t next = (w >> NEXT_SHIFT) & FIELD, pieces = w & FIELD;
        if ((w >> GEN_SHIFT) != gen || next >= pieces) return;
        if (!atomic_compare_exchange_weak_explicit(&P.claim, &w, w + (1ull << NEXT_SHIFT),
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        int64_t lo = (int64_t)next * P.grain, hi = lo + P.grain < P.n ? lo + P.grain : P.n;
        inside_piece = 1;
        P.fn(P.ctx, lo, hi);
        inside_piece = 0;
        uint32_t done = atomic_fetch_add(&P.done, 1) + 1;
        if (done == pieces && atomic_load(&P.caller_waits)) futex_wake(&P.done);
        w = atomic_load_explicit(&P.claim, memory_order_acquire);
    }
}

static void *helper_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&P.job);
    for (;;) {
        uint64_t start = __rdtsc();
        uint32_t job;
        while ((job = atomic_load_explicit(&P.job, memory_order_acquire)) == seen) {
            if (__rdtsc() - start < HELPER_SPIN_CYCLES) {
                _mm_pause();
                continue;
            }
            atomic_fetch_add(&P.sleepers, 1);
            if (atomic_load(&P.job) == seen) futex_wait(&P.job, seen);
            atomic_fetch_sub(&P.sleepers, 1);
            start = __rdtsc();
        }
        seen = job;
        if (id < atomic_load(&P.active))
            take_pieces(atomic_load_explicit(&P.claim, memory_order_acquire) >> GEN_SHIFT);
    }
    return NULL;
}

static void after_fork_child(void) { /* the helpers did not survive the fork */
    P.started = 0;
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.caller_waits, 0);
    pthread_mutex_init(&P.run, NULL);
    pthread_mutex_init(&P.grow, NULL);
}

static void start_helpers(int wanted) {
    pthread_mutex_lock(&P.grow);
    if (P.started == 0) pthread_atfork(NULL, NULL, after_fork_child);
    for (; P.started < wanted; P.started++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, helper_main, (void *)(intptr_t)P.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
    }
    pthread_mutex_unlock(&P.grow);
}

/* fn(ctx, lo, hi) over [0, n) in pieces of at least `grain` items (a few microseconds of
 * work each: a piece costs two atomic operations on lines the other cores share). */
void pool_for(int64_t n, int64_t grain, pool_fn fn, void *ctx) {
    if (n <= 0) return;
    int threads = omp_get_max_threads();
    if (threads > MAX_HELPERS + 1) threads = MAX_HELPERS + 1;
    if (grain < 1) grain = 1;
    int64_t want = 8 * (int64_t)threads; /* pieces: enough for balance, few claims */
    if ((n + grain - 1) / grain > want) grain = (n + want - 1) / want;
    while ((n + grain - 1) / grain > MAX_CHUNKS) grain *= 2;
    const int64_t pieces = (n + grain - 1) / grain;
    if (threads <= 1 || pieces <= 1 || inside_piece || pthread_mutex_trylock(&P.run) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (P.started < threads - 1) start_helpers(threads - 1);
    P.fn = fn, P.ctx = ctx, P.n = n, P.grain = grain;
    atomic_store(&P.done, 0);
    atomic_store(&P.active, threads - 1);
    const uint64_t gen = ((atomic_load(&P.claim) >> GEN_SHIFT) + 1) & ((1ull << 24) - 1);
    atomic_store_explicit(&P.claim, gen << GEN_SHIFT | (uint64_t)pieces, memory_order_release);
    atomic_fetch_add(&P.job, 1);
    if (atomic_load(&P.sleepers) > 0) futex_wake(&P.job);
    take_pieces(gen);
    uint64_t start = __rdtsc();
    uint32_t done;
    while ((done = atomic_load(&P.done)) != (uint32_t)pieces) {
        if (__rdtsc() - start < CALLER_SPIN_CYCLES) {
            _mm_pause();
            continue;
        }
        atomic_store(&P.caller_waits, 1);
        if ((done = atomic_load(&P.done)) != (uint32_t)pieces) futex_wait(&P.done, done);
        atomic_store(&P.caller_waits, 0);
    }
    pthread_mutex_unlock(&P.run);
}

int pool_threads(void) { return omp_get_max_threads(); }
