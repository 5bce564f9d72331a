/* multi_tensor.c: see multi_tensor.h. */
#include "multi_tensor.h"

#include <math.h>
#include <stdlib.h>

#include "cpu_dispatch.h"
#include "threadpool.h"

int64_t ampx_parallel_min = AMPX_PARALLEL_MIN_DEFAULT;
int ampx_coalesce_on = 1;
int64_t ampx_last_spans = -1;
int64_t ampx_split_max_bytes = AMPX_SPLIT_MAX_BYTES_DEFAULT;

typedef struct {
    int64_t tensor;
    int64_t start;
    int64_t len;
} chunk_t;

typedef struct {
    const ampx_job *job;
    const ampx_tensor *ts;
    const chunk_t *chunks;
    const int64_t *task_start; /* task t covers chunks [task_start[t], task_start[t+1]) */
    ampx_partial *results;     /* one per chunk */
    ampx_scale_fn scale[AMPX_NUM_DTYPES];
    const ampx_cpu_kernels *k;
} plan_t;


void ampx_partial_combine(ampx_partial *a, const ampx_partial *b, int reduce)
{
    a->flags |= b->flags;
    if (reduce == AMPX_REDUCE_MAXABS) {
        if (isnan(a->acc) || isnan(b->acc))
            a->acc = NAN;
        else if (b->acc > a->acc)
            a->acc = b->acc;
    } else {
        a->acc += b->acc;
    }
}

static void run_chunk(const plan_t *p, int64_t c)
{
    const chunk_t *ch = &p->chunks[c];
    const ampx_tensor *t = &p->ts[ch->tensor];
    ampx_partial *r = &p->results[c];
    if (!p->job->cast) {
        p->scale[t->dtype](t->ptr + ch->start * ampx_elem_size(t->dtype), ch->len, p->job->factor, r);
        return;
    }
    ampx_sr_key_t key = {0u, 0u};
    int sr = p->job->stochastic;
    if (sr)
        key = ampx_sr_key(p->job->seed, p->job->offset, t->index, (uint32_t)(ch->start >> 32));
    ampx_cast_fn fn = p->k->cast[t->src_dtype][t->dtype][sr];
    r->acc = 0.0;
    r->flags = fn(t->src + ch->start * ampx_elem_size(t->src_dtype), t->ptr + ch->start * ampx_elem_size(t->dtype),
                  ch->len, p->job->factor, key, (uint32_t)ch->start);
}

static void run_task(void *ctx, int64_t task)
{
    const plan_t *p = (const plan_t *)ctx;
    for (int64_t c = p->task_start[task]; c < p->task_start[task + 1]; c++)
        run_chunk(p, c);
}

/* The part of a tensor of numel elements that thread t of a team of T gets
 * under split mode `split` (torch's at::parallel_for(0, range, grain, f) on
 * OpenMP: min(T, ceil(range / grain)) threads, thread t taking the t-th of
 * that many equal pieces, rounded up; a range of at most grain, or of one
 * unit, runs whole on thread 0), as elements [*b, *e). */
void ampx_torch_part(int split, int64_t numel, size_t elem, int T, int t, int64_t *b, int64_t *e)
{
    /* LINES: torch's fused optimizers (range: 64-byte lines, grain 0);
     * ELEMENTS: its elementwise ops (range: elements, grain 32768). */
    int64_t unit = split == AMPX_SPLIT_LINES ? 64 / (int64_t)elem : 1;
    int64_t grain = split == AMPX_SPLIT_LINES ? 0 : AMPX_TORCH_GRAIN;
    int64_t range = (numel + unit - 1) / unit;
    *b = *e = 0;
    if (range <= 1 || range <= grain) {
        if (t == 0)
            *e = numel;
        return;
    }
    int64_t used = grain > 0 && (range + grain - 1) / grain < T ? (range + grain - 1) / grain : T;
    int64_t per = (range + used - 1) / used;
    if (t >= used)
        return;
    *b = t * per * unit;
    *e = (t + 1) * per * unit;
    if (*b > numel)
        *b = numel;
    if (*e > numel)
        *e = numel;
}

int ampx_split_for(int split, const ampx_tensor *ts, int64_t n, int64_t total, int nthreads)
{
    if (split == AMPX_SPLIT_DYNAMIC || nthreads < 2 || nthreads > AMPX_MAX_THREADS || total < ampx_parallel_min ||
        n > AMPX_SPLIT_MAX_PAIRS / nthreads || nthreads != ampx_team_size())
        return AMPX_SPLIT_DYNAMIC;
    int64_t bytes = 0;
    for (int64_t i = 0; i < n; i++)
        bytes += ts[i].numel * (int64_t)ampx_elem_size(ts[i].dtype);
    return bytes <= ampx_split_max_bytes ? split : AMPX_SPLIT_DYNAMIC;
}

/* Chunks of each thread's parts (ampx_torch_part), as task t = thread t;
 * chunks == NULL only counts them. Returns the chunk count. */
static int64_t plan_torch_parts(int split, const ampx_tensor *ts, int64_t n, int T, chunk_t *chunks,
                                int64_t *task_start)
{
    int64_t c = 0;
    for (int t = 0; t < T; t++) {
        if (task_start != NULL)
            task_start[t] = c;
        for (int64_t i = 0; i < n; i++) {
            int64_t b, e;
            ampx_torch_part(split, ts[i].numel, ampx_elem_size(ts[i].dtype), T, t, &b, &e);
            for (int64_t s = b; s < e; s += AMPX_CHUNK) {
                if (chunks != NULL) {
                    chunks[c].tensor = i;
                    chunks[c].start = s;
                    chunks[c].len = e - s < AMPX_CHUNK ? e - s : AMPX_CHUNK;
                }
                c++;
            }
        }
    }
    if (task_start != NULL)
        task_start[T] = c;
    return c;
}

int ampx_run(const ampx_job *job, const ampx_tensor *ts, int64_t n, int nthreads,
             ampx_partial *parts)
{
    const ampx_cpu_kernels *k = ampx_cpu_active;
    int reduce = job->cast ? AMPX_REDUCE_NONE : AMPX_MODE_REDUCE(job->mode);
    int64_t nchunks = 0, total = 0;
    for (int64_t i = 0; i < n; i++) {
        nchunks += (ts[i].numel + AMPX_CHUNK - 1) / AMPX_CHUNK;
        total += ts[i].numel;
        parts[i].acc = 0.0;
        parts[i].flags = 0u;
    }
    if (nchunks == 0)
        return 0;

    /* job->split was decided by ampx_split_for; its plan has its own chunk count. */
    int follow = job->split != AMPX_SPLIT_DYNAMIC;
    if (follow)
        nchunks = plan_torch_parts(job->split, ts, n, nthreads, NULL, NULL);
    /* One allocation: chunks, their results, and task boundaries (at most
     * one task per chunk, or one per thread when following torch, plus the end). */
    size_t bytes = (size_t)nchunks * (sizeof(chunk_t) + sizeof(ampx_partial) + sizeof(int64_t)) +
                   sizeof(int64_t) * (nthreads + 2);
    char *mem = (char *)malloc(bytes);
    if (mem == NULL)
        return -1;
    plan_t p;
    p.job = job;
    p.ts = ts;
    p.k = k;
    chunk_t *chunks = (chunk_t *)mem;
    p.results = (ampx_partial *)(chunks + nchunks);
    int64_t *task_start = (int64_t *)(p.results + nchunks);
    for (int d = 0; d < AMPX_NUM_DTYPES; d++)
        p.scale[d] = job->cast ? NULL : k->scale[d][job->mode];

    if (follow) { /* each thread reads what torch's next op will give its thread */
        p.chunks = chunks;
        p.task_start = task_start;
        int64_t used = plan_torch_parts(job->split, ts, n, nthreads, chunks, task_start);
        if (ampx_parallel_static(nthreads, run_task, &p) != 0)
            for (int64_t t = 0; t < nthreads; t++)
                run_task(&p, t);
        for (int64_t u = 0; u < used; u++)
            ampx_partial_combine(&parts[chunks[u].tensor], &p.results[u], reduce);
        free(mem);
        return 0;
    }
    /* Tasks: consecutive chunks of about total / (nthreads * AMPX_TASKS_PER_THREAD)
     * elements, at least AMPX_CHUNK. Long runs of memory per task keep each
     * thread streaming through its own region; several tasks per thread let
     * the dynamic hand-out even out a slow or late thread. */
    int64_t task_min = AMPX_CHUNK;
    if (nthreads > 1) {
        int64_t even = total / ((int64_t)nthreads * AMPX_TASKS_PER_THREAD);
        if (even > task_min)
            task_min = even;
    }
    int64_t c = 0, ntasks = 0, in_task = 0;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t s = 0; s < ts[i].numel; s += AMPX_CHUNK) {
            int64_t len = ts[i].numel - s < AMPX_CHUNK ? ts[i].numel - s : AMPX_CHUNK;
            if (in_task == 0)
                task_start[ntasks++] = c;
            chunks[c].tensor = i;
            chunks[c].start = s;
            chunks[c].len = len;
            c++;
            in_task += len;
            if (in_task >= task_min)
                in_task = 0;
        }
    }
    task_start[ntasks] = nchunks;
    p.chunks = chunks;
    p.task_start = task_start;

    if (nthreads > 1 && total >= ampx_parallel_min && ntasks > 1)
        ampx_parallel_for(nthreads, ntasks, run_task, &p);
    else
        for (int64_t t = 0; t < ntasks; t++)
            run_task(&p, t);

    for (c = 0; c < nchunks; c++)
        ampx_partial_combine(&parts[chunks[c].tensor], &p.results[c], reduce);
    free(mem);
    return 0;
}
