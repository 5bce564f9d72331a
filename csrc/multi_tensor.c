/* multi_tensor.c: see multi_tensor.h. */
#include "multi_tensor.h"

#include <math.h>
#include <stdlib.h>

#include "cpu_dispatch.h"
#include "threadpool.h"

int64_t ampx_parallel_min = AMPX_PARALLEL_MIN_DEFAULT;
int ampx_coalesce_on = 1;
int64_t ampx_last_spans = -1;

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

void ampx_coalesce(const ampx_tensor *ts, int64_t n, ampx_tensor *spans, int64_t *first, int64_t *nspans)
{
    int64_t m = 0;
    const char *end = NULL; /* where the open span's memory ends */
    for (int64_t i = 0; i < n; i++) {
        const ampx_tensor *t = &ts[i];
        if (t->numel == 0) {
            if (m == 0)
                first[0] = 0; /* leading empties belong to the first span */
            continue;
        }
        size_t bytes = (size_t)t->numel * ampx_elem_size(t->dtype);
        ampx_tensor *open = m > 0 ? &spans[m - 1] : NULL;
        if (open != NULL && t->dtype == open->dtype && t->ptr == end) {
            open->numel += t->numel; /* ascending: starts where the span ends */
            end = t->ptr + bytes;
        } else if (open != NULL && t->dtype == open->dtype && t->ptr + bytes == open->ptr) {
            open->ptr = t->ptr; /* descending (DDP's bucket views): ends where the span starts */
            open->numel += t->numel;
        } else {
            if (m > 0)
                first[m] = i;
            else
                first[0] = 0;
            spans[m++] = *t;
            end = t->ptr + bytes;
        }
    }
    first[m] = n;
    *nspans = m;
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

    /* One allocation: chunks, their results, and task boundaries (at most
     * one task per chunk, plus the end). */
    size_t bytes = (size_t)nchunks * (sizeof(chunk_t) + sizeof(ampx_partial) + sizeof(int64_t)) +
                   sizeof(int64_t);
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
