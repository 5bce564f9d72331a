/*
 * entry_cpu.c: the CPU runners of scale_reduce, cast and update_scale
 * (entry.h): a validated call run through the multi-tensor launcher
 * (multi_tensor.h) on torch's OpenMP team or ampx's pool, its per-chunk
 * results combined into the outputs.
 *
 * Called by entry.c with the GIL held, the call validated. Releases the GIL
 * around the kernels of a call of GIL_RELEASE_MIN elements or more (the
 * gathered lists own their tensors, so none can die meanwhile). May call:
 * multi_tensor.h, tensor_list.h (the sequential path, a cast's copy back).
 */
#include "entry.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int ampx_last_split = AMPX_SPLIT_DYNAMIC;

/* Runs job over ts[0..n) (total elements in all), releasing the GIL when
 * `release` (the call's storages are held: entry.c) and total is worth it;
 * -1 with MemoryError when the launcher cannot get its plan. */
static int run_job(const ampx_job *job, const ampx_tensor *ts, Py_ssize_t n, int64_t total, int release,
                   int nthreads, ampx_partial *parts)
{
    int rc;
    if (release && total >= GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        rc = ampx_run(job, ts, n, nthreads, parts);
        Py_END_ALLOW_THREADS
    } else {
        rc = ampx_run(job, ts, n, nthreads, parts);
    }
    if (rc < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static double finish_reduce(int reduce, double acc) { return reduce == AMPX_REDUCE_SUMSQ ? sqrt(acc) : acc; }

/* Writes the outputs a call asked for: found_inf, per-tensor flags,
 * per-tensor and total reductions. */
static void write_outputs(const entry_call *c, const ampx_partial *parts, Py_ssize_t n, int reduce)
{
    float *found_inf = (float *)c->found_inf, *per_tensor = (float *)c->per_tensor, *total = (float *)c->total;
    uint8_t *flags = (uint8_t *)c->flags;
    ampx_partial all = {0.0, 0u};
    for (Py_ssize_t i = 0; i < n; i++) {
        ampx_partial_combine(&all, &parts[i], reduce);
        if (flags != NULL)
            flags[i] = (uint8_t)parts[i].flags;
        if (per_tensor != NULL)
            per_tensor[i] = (float)finish_reduce(reduce, parts[i].acc);
    }
    if (found_inf != NULL && all.flags != 0u)
        *found_inf = 1.0f;
    if (total != NULL)
        *total = (float)finish_reduce(reduce, all.acc);
}

static ampx_partial *new_parts(Py_ssize_t n)
{
    ampx_partial *parts = (ampx_partial *)calloc(n > 0 ? (size_t)n : 1u, sizeof *parts);
    if (parts == NULL)
        PyErr_NoMemory();
    return parts;
}

/* The sequential path: one tensor's job (tlist_each_staged). */
typedef struct {
    const ampx_job *job;
    int release, nthreads;
    ampx_partial *parts;
} one_by_one;

static int run_one(void *ctx, tlist *L, Py_ssize_t i)
{
    const one_by_one *s = (const one_by_one *)ctx;
    if (L->ts[i].numel == 0)
        return 0;
    return run_job(s->job, &L->ts[i], 1, L->ts[i].numel, s->release, s->nthreads, &s->parts[i]);
}

/* ---- coalesced spans ------------------------------------------------------ */

/* Whether per-tensor flags can be told apart after a coalesced run. A read
 * leaves the inputs in place, so they can be checked again. A write keeps
 * them recognisable when the factor is finite, non-zero and at most 1 in
 * magnitude (as the kernels round it): an output is then inf exactly where
 * its input was inf and NaN exactly where its input was NaN (nothing finite
 * overflows, nothing infinite meets a zero). */
static int flags_recoverable(const entry_call *c)
{
    if (!(c->mode & AMPX_M_WRITE))
        return 1;
    if (!(c->mode & AMPX_M_SCALE))
        return 1;
    double f = fabs(c->factor);
    float f32 = fabsf((float)c->factor);
    return f > 0.0 && f <= 1.0 && f32 > 0.0f && f32 <= 1.0f;
}

/* The flags of tensors [a, b) of L, found again by a check-only run of each
 * (after a span holding them reported a non-finite value: overflow steps
 * only, so the extra read is rare). */
static int recheck_flags(const entry_call *c, Py_ssize_t a, Py_ssize_t b, uint8_t *flags)
{
    const tlist *L = &c->L;
    ampx_job job = {0, AMPX_M_CHECK, 1.0, 0, 0u, 0u, AMPX_SPLIT_DYNAMIC};
    for (Py_ssize_t i = a; i < b; i++) {
        ampx_partial part = {0.0, 0u};
        const ampx_tensor *t = &L->ts[i];
        if (t->numel > 0 && run_job(&job, t, 1, t->numel, c->release_gil, c->at.nthreads, &part) < 0)
            return -1;
        flags[i] = (uint8_t)part.flags;
    }
    return 0;
}

/* Runs c over the spans of L (ampx_coalesce) when that pays and the outputs
 * allow it: no per-tensor reductions, and flags only where they can be told
 * apart afterwards. Returns 1 when it ran (outputs written), 0 when the
 * caller should run tensor by tensor, -1 with an exception set. */
static int try_spans(entry_call *c)
{
    const tlist *L = &c->L;
    if (!ampx_coalesce_on || L->n < 2 || c->per_tensor != NULL || (c->flags != NULL && !flags_recoverable(c)))
        return 0;
    ampx_tensor *spans = (ampx_tensor *)malloc((size_t)L->n * sizeof *spans);
    int64_t *first = (int64_t *)malloc(((size_t)L->n + 1u) * sizeof *first);
    ampx_partial *parts = new_parts(L->n);
    int rc = -1;
    if (spans == NULL || first == NULL || parts == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    int64_t m = 0;
    ampx_coalesce(L->ts, L->n, spans, first, &m);
    rc = 0;
    if (m * 2 > L->n) /* little to merge: per tensor costs the same and keeps the usual bits */
        goto done;
    ampx_job job = {0, c->mode, c->factor, 0, 0u, 0u, AMPX_SPLIT_DYNAMIC};
    if ((rc = run_job(&job, spans, m, L->total, c->release_gil, c->at.nthreads, parts)) < 0)
        goto done;
    uint8_t *flags = (uint8_t *)c->flags;
    if (flags != NULL)
        memset(flags, 0, (size_t)L->n);
    for (int64_t s = 0; s < m && rc == 0; s++)
        if (flags != NULL && parts[s].flags != 0u)
            rc = recheck_flags(c, first[s], first[s + 1], flags);
    if (rc == 0) {
        entry_call totals = *c;
        totals.flags = NULL; /* written above, per tensor */
        write_outputs(&totals, parts, m, AMPX_MODE_REDUCE(c->mode));
        ampx_last_spans = m;
        rc = 1;
    }
done:
    free(spans);
    free(first);
    free(parts);
    return rc;
}

int cpu_scale_reduce(mstate *st, entry_call *c)
{
    tlist *L = &c->L;
    ampx_last_spans = -1;
    /* Decided once, here, with the GIL held (multi_tensor.h). Following torch's
     * split is per tensor: spans would merge what it keeps apart. */
    int split = c->sequential ? AMPX_SPLIT_DYNAMIC : ampx_split_for(c->split, L->ts, L->n, L->total, c->at.nthreads);
    ampx_last_split = split;
    if (!c->sequential && split == AMPX_SPLIT_DYNAMIC) {
        int done = try_spans(c);
        if (done != 0)
            return done < 0 ? -1 : 0;
    }
    ampx_partial *parts = new_parts(L->n);
    if (parts == NULL)
        return -1;
    ampx_job job = {0, c->mode, c->factor, 0, 0u, 0u, split};
    int rc;
    if (!c->sequential) {
        rc = run_job(&job, L->ts, L->n, L->total, c->release_gil, c->at.nthreads, parts);
    } else {
        one_by_one s = {&job, c->release_gil, c->at.nthreads, parts};
        rc = tlist_each_staged(st, L, run_one, &s);
    }
    if (rc == 0)
        write_outputs(c, parts, L->n, AMPX_MODE_REDUCE(c->mode));
    free(parts);
    return rc;
}

int cpu_cast(mstate *st, entry_call *c)
{
    ampx_partial *parts = new_parts(c->S.n);
    if (parts == NULL)
        return -1;
    ampx_job job = {1, 0, c->factor, c->stochastic, c->seed, c->offset, AMPX_SPLIT_DYNAMIC};
    int rc = run_job(&job, c->S.ts, c->S.n, c->S.total, c->release_gil, c->at.nthreads, parts);
    if (rc == 0)
        rc = cast_unstage(st, &c->D);
    if (rc == 0)
        write_outputs(c, parts, c->S.n, AMPX_REDUCE_NONE);
    free(parts);
    return rc;
}

int cpu_update_scale(const entry_update *u, int *events)
{
    *events = ampx_update_scale((float *)u->scale, (int32_t *)u->growth_tracker, (int32_t *)u->hysteresis_tracker,
                                *(const float *)u->found_inf, u->growth_factor, u->backoff_factor,
                                (int64_t)u->growth_interval, (int32_t)u->hysteresis, u->consecutive,
                                (float)u->min_scale, (float)u->max_scale);
    if (u->events != NULL)
        *(int32_t *)u->events = (int32_t)*events;
    return 0;
}
