/* threadpool.c: see threadpool.h for the contract. */
#define _GNU_SOURCE
#include "threadpool.h"

#include <dlfcn.h>
#if defined(__linux__) || defined(__FreeBSD__)
#include <link.h> /* dl_iterate_phdr: finding the loaded OpenMP runtime */
#define AMPX_HAVE_PHDR 1
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- torch's own OpenMP team -------------------------------------------------
 *
 * When the process already has an OpenMP runtime loaded (torch's libgomp on
 * Linux; LLVM's libomp and Intel's libiomp5 export the same GOMP_ entry
 * points), ampx runs its tasks on that runtime's team rather than on its own
 * threads. Nothing is loaded: the runtime is found among the objects already
 * mapped and opened with RTLD_NOLOAD. The reason is the time right after a
 * torch op: the runtime's workers keep spinning for a while (OMP_WAIT_POLICY
 * unset), and a second pool's threads would share cores with them; run on the
 * team, the spinning workers pick the tasks up at once. */

typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

static pthread_once_t omp_once = PTHREAD_ONCE_INIT;
static gomp_parallel_fn omp_parallel;      /* NULL: no runtime loaded, use the pool */
typedef int (*omp_thread_num_fn)(void);
static omp_thread_num_fn omp_thread_num, omp_num_threads, omp_max_threads;
static char omp_path[512];

#ifdef AMPX_HAVE_PHDR
/* The loaded objects' search: torch's CPU library's directory, then the
 * OpenMP runtime to use. Several runtimes may be loaded (another wheel's
 * extension bringing its own libgomp, such as sentencepiece's, imported
 * before torch); torch's parallel ops run on the one beside libtorch_cpu, so
 * that one is taken, else the first loaded. */
typedef struct {
    char torch_dir[512];
    size_t torch_dir_len;
    int have_first;
} omp_search;

static const char *base_of(const char *name)
{
    const char *base = strrchr(name, '/');
    return base ? base + 1 : name;
}

static int find_torch(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    omp_search *s = (omp_search *)data;
    const char *name = info->dlpi_name;
    if (name == NULL || strncmp(base_of(name), "libtorch_cpu", 12) != 0)
        return 0;
    size_t n = (size_t)(base_of(name) - name);
    if (n < sizeof s->torch_dir) {
        memcpy(s->torch_dir, name, n);
        s->torch_dir[n] = '\0';
        s->torch_dir_len = n;
    }
    return 1;
}

static int find_omp(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    omp_search *s = (omp_search *)data;
    const char *name = info->dlpi_name;
    if (name == NULL || name[0] == '\0')
        return 0;
    const char *base = base_of(name);
    if (strncmp(base, "libgomp", 7) != 0 && strncmp(base, "libomp", 6) != 0 && strncmp(base, "libiomp5", 8) != 0)
        return 0;
    size_t n = strlen(name);
    if (n >= sizeof(omp_path))
        return 0;
    int torchs = s->torch_dir_len > 0 && (size_t)(base - name) == s->torch_dir_len &&
                 strncmp(name, s->torch_dir, s->torch_dir_len) == 0;
    if (torchs || !s->have_first) {
        memcpy(omp_path, name, n + 1);
        s->have_first = 1;
    }
    return torchs; /* torch's own: stop looking */
}
#endif

/* GNU libgomp's team does not survive fork: a forked child that enters a
 * parallel region hangs (torch's own ops too). A child therefore always uses
 * ampx's pool, which restarts its workers after fork. And when ampx has used
 * the team in the parent, the child's OpenMP thread count is set to 1, so that
 * torch's own ops run inline there instead of hanging in the team ampx started
 * (what torch's DataLoader workers do for themselves). A parent whose torch ops
 * started the team leaves its children to torch: they hang without ampx too. */
static int in_forked_child;
static atomic_int omp_team_used;
typedef void (*omp_set_threads_fn)(int);
static omp_set_threads_fn omp_set_threads;

static void omp_after_fork_child(void)
{
    in_forked_child = 1;
    omp_parallel = NULL;
    if (omp_set_threads != NULL && atomic_load(&omp_team_used))
        omp_set_threads(1);
}

/* Registered when the extension is loaded, so that a child forked before
 * ampx's first parallel call knows it too. */
__attribute__((constructor)) static void omp_register_atfork(void)
{
    pthread_atfork(NULL, NULL, omp_after_fork_child);
}

static void omp_init(void)
{
    if (in_forked_child)
        return;
    const char *env = getenv("AMPX_THREADING");
    if (env != NULL && strcmp(env, "pool") == 0)
        return; /* forced onto ampx's own pool (tests, comparisons) */
#ifdef AMPX_HAVE_PHDR
    omp_search search;
    memset(&search, 0, sizeof search);
    dl_iterate_phdr(find_torch, &search);
    dl_iterate_phdr(find_omp, &search);
    if (!search.have_first)
        return;
#else
    return; /* no portable way to list loaded objects: ampx's own pool */
#endif
    void *h = dlopen(omp_path, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL)
        return;
    /* The handle is kept: it only pins a library that is loaded already. */
    omp_parallel = (gomp_parallel_fn)dlsym(h, "GOMP_parallel");
    omp_set_threads = (omp_set_threads_fn)dlsym(h, "omp_set_num_threads");
    omp_thread_num = (omp_thread_num_fn)dlsym(h, "omp_get_thread_num");
    omp_num_threads = (omp_thread_num_fn)dlsym(h, "omp_get_num_threads");
    omp_max_threads = (omp_thread_num_fn)dlsym(h, "omp_get_max_threads");
}

typedef struct {
    ampx_task_fn fn;
    void *ctx;
    int64_t ntasks;
    atomic_int_fast64_t next;
} omp_job;

static void omp_body(void *data)
{
    omp_job *j = (omp_job *)data;
    for (;;) {
        int64_t t = (int64_t)atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (t >= j->ntasks)
            return;
        j->fn(j->ctx, t);
    }
}

typedef struct {
    ampx_task_fn fn;
    void *ctx;
    int64_t ntasks;
} omp_static_job;

/* Thread t of the team runs tasks t, t + size, ...: all of them run even
 * when the runtime gives fewer threads than asked (a nested region, a
 * thread limit). */
static void omp_static_body(void *data)
{
    omp_static_job *j = (omp_static_job *)data;
    int64_t size = omp_num_threads();
    for (int64_t t = omp_thread_num(); t < j->ntasks; t += size > 0 ? size : 1)
        j->fn(j->ctx, t);
}

int ampx_team_size(void)
{
    pthread_once(&omp_once, omp_init);
    if (omp_parallel == NULL || omp_thread_num == NULL || omp_num_threads == NULL || omp_max_threads == NULL)
        return 0;
    return omp_max_threads();
}

int ampx_parallel_static(int nthreads, ampx_task_fn fn, void *ctx)
{
    if (ampx_team_size() == 0 || nthreads < 2 || nthreads > AMPX_MAX_THREADS)
        return -1;
    omp_static_job j = {fn, ctx, nthreads};
    atomic_store(&omp_team_used, 1);
    omp_parallel(omp_static_body, &j, (unsigned)nthreads, 0u);
    return 0;
}

const char *ampx_thread_backend(void)
{
    pthread_once(&omp_once, omp_init);
    return omp_parallel != NULL ? omp_path : "ampx pool";
}

void ampx_parallel_for(int nthreads, int64_t ntasks, ampx_task_fn fn, void *ctx)
{
    if (nthreads > AMPX_MAX_THREADS)
        nthreads = AMPX_MAX_THREADS;
    int helpers = nthreads - 1;
    if ((int64_t)helpers > ntasks - 1)
        helpers = (int)(ntasks - 1);
    if (helpers > 0) {
        pthread_once(&omp_once, omp_init);
        if (omp_parallel != NULL) {
            omp_job j;
            j.fn = fn;
            j.ctx = ctx;
            j.ntasks = ntasks;
            atomic_store_explicit(&j.next, 0, memory_order_relaxed);
            atomic_store(&omp_team_used, 1);
            omp_parallel(omp_body, &j, (unsigned)(helpers + 1), 0u);
            return;
        }
    }
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
