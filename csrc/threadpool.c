/* threadpool.c: see threadpool.h for the contract. */
#define _GNU_SOURCE
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* pool_busy is held by the one caller whose job the workers run; mu guards
 * everything below it. Workers are started on demand and never exit. */
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int nworkers;       /* workers started */
static uint64_t generation; /* bumped once per job */
static int job_want;       /* workers (by id) taking part in this job */
static int job_pending;    /* of those, how many have not finished */
static ampx_task_fn job_fn;
static void *job_ctx;
static int64_t job_ntasks;
static atomic_int_fast64_t job_next;
static uint64_t start_gen[AMPX_MAX_THREADS]; /* generation each worker was born in */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void drain(ampx_task_fn fn, void *ctx, int64_t ntasks)
{
    for (;;) {
        int64_t t = (int64_t)atomic_fetch_add_explicit(&job_next, 1, memory_order_relaxed);
        if (t >= ntasks)
            return;
        fn(ctx, t);
    }
}

static void *worker_main(void *arg)
{
    int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    /* A worker born for a job must still run it: it waits from the
     * generation before that job's, not from the current one. */
    uint64_t seen = start_gen[id];
    for (;;) {
        while (generation == seen)
            pthread_cond_wait(&wake_cv, &mu);
        seen = generation;
        if (id >= job_want)
            continue;
        ampx_task_fn fn = job_fn;
        void *ctx = job_ctx;
        int64_t ntasks = job_ntasks;
        pthread_mutex_unlock(&mu);
        drain(fn, ctx, ntasks);
        pthread_mutex_lock(&mu);
        if (--job_pending == 0)
            pthread_cond_signal(&done_cv);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: forget them. */
static void after_fork_child(void)
{
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    pool_busy = m;
    mu = m;
    wake_cv = c;
    done_cv = c;
    nworkers = 0;
    job_want = job_pending = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Starts workers until `want` exist (mu held); returns how many exist. */
static int ensure_workers(int want)
{
    while (nworkers < want) {
        pthread_t th;
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) != 0)
            break;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[nworkers] = generation;
        int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)nworkers);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break; /* run with what we have */
        nworkers++;
    }
    return nworkers < want ? nworkers : want;
}

void ampx_parallel_for(int nthreads, int64_t ntasks, ampx_task_fn fn, void *ctx)
{
    if (nthreads > AMPX_MAX_THREADS)
        nthreads = AMPX_MAX_THREADS;
    int helpers = nthreads - 1;
    if ((int64_t)helpers > ntasks - 1)
        helpers = (int)(ntasks - 1);
    if (helpers <= 0 || pthread_mutex_trylock(&pool_busy) != 0) {
        for (int64_t t = 0; t < ntasks; t++)
            fn(ctx, t);
        return;
    }
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&mu);
    helpers = ensure_workers(helpers);
    job_fn = fn;
    job_ctx = ctx;
    job_ntasks = ntasks;
    job_want = helpers;
    job_pending = helpers;
    atomic_store_explicit(&job_next, 0, memory_order_relaxed);
    generation++;
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&mu);

    drain(fn, ctx, ntasks);

    pthread_mutex_lock(&mu);
    while (job_pending > 0)
        pthread_cond_wait(&done_cv, &mu);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&pool_busy);
}
