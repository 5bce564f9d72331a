/*
 * threadpool.h: a small pool of POSIX threads for the CPU kernels.
 *
 * ampx does not use OpenMP: loading a second OpenMP runtime beside torch's
 * is a known source of oversubscription and crashes. The caller chooses the
 * thread count (the Python layer passes torch.get_num_threads()), idle
 * workers sleep on a condition variable rather than spin, and the calling
 * thread always takes part in the work.
 */
#ifndef AMPX_THREADPOOL_H
#define AMPX_THREADPOOL_H

#include <stdint.h>

/* The most threads one call uses, the caller included. */
#define AMPX_MAX_THREADS 256

typedef void (*ampx_task_fn)(void *ctx, int64_t task);

/* Runs fn(ctx, t) for every t in [0, ntasks) on up to nthreads threads and
 * returns when all have finished. Tasks are handed out in increasing order
 * but may finish in any order, so fn must write only task-owned results.
 * Safe to call from several threads at once: a call that finds the pool in
 * use runs its tasks on the calling thread. Never calls into Python. */
void ampx_parallel_for(int nthreads, int64_t ntasks, ampx_task_fn fn, void *ctx);

#endif /* AMPX_THREADPOOL_H */
