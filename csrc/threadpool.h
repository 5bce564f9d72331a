/*
 * threadpool.h: a small pool of POSIX threads for the CPU kernels.
 *
 * ampx never loads an OpenMP runtime (a second one beside torch's is a known
 * source of oversubscription and crashes). When torch's runtime is already
 * loaded, tasks run on its team through its GOMP_parallel entry point, so
 * ampx and torch share one set of threads (see threadpool.c). Otherwise, or
 * with AMPX_THREADING=pool, they run on a small pool of POSIX threads whose
 * idle workers sleep on a condition variable. The caller chooses the thread
 * count (the Python layer passes torch.get_num_threads()), and the calling
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

/* Runs fn(ctx, t) for t in [0, nthreads) on torch's OpenMP team, task t on
 * the team's thread t (numbered as torch's at::parallel_for numbers them;
 * a smaller team than asked runs the rest round-robin). -1, nothing run,
 * when the work does not run on torch's team (ampx_team_size() == 0). */
int ampx_parallel_static(int nthreads, ampx_task_fn fn, void *ctx);

/* The team size torch's parallel ops would use on the calling thread
 * (omp_get_max_threads: torch.set_num_threads sets it), or 0 when parallel
 * work does not run on torch's OpenMP team (ampx's pool, a forked child). */
int ampx_team_size(void);

/* Where tasks run: the path of the OpenMP runtime in use, or "ampx pool". */
const char *ampx_thread_backend(void);

#endif /* AMPX_THREADPOOL_H */
