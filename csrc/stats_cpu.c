/*
 * stats_cpu.c: the CPU runner of tensor_stats (entry.h): one float64 row of
 * AMPX_STATS_WIDTH values per tensor (the layout of ampx/stats.py, restated in
 * ampx_numerics.h), from one read of every tensor.
 *
 * The list's elements, taken end to end, are cut into tasks of about equal
 * size (at least AMPX_CHUNK elements, about AMPX_TASKS_PER_THREAD per
 * thread). A tensor that lies wholly in one task is counted by it straight
 * into its row; a tensor cut by task boundaries is counted piece by piece
 * into each task's two piece rows (its first and last tensor), which are
 * added into the tensor's row afterwards, in task order. Every value is a
 * count, a max or a min, so the rows do not depend on the thread count.
 *
 * float32, float16 and bfloat16 runs go through the SIMD table's stats
 * kernels (cpu_kernels.h); float64 through the scalar loop below. Never
 * touches Python: entry.c gathers and validates the call and releases the GIL.
 */
#include "entry.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dispatch.h"
#include "threadpool.h"

/* The most elements one kernel call counts before its uint32 counters are read out. */
#define STATS_RUN_MAX ((int64_t)1 << 30)

static void row_init(double *row, int64_t numel)
{
    memset(row, 0, AMPX_STATS_WIDTH * sizeof *row);
    row[AMPX_STATS_AMIN] = INFINITY;
    row[AMPX_STATS_NUMEL] = (double)numel;
}

static void stats32_init(ampx_stats32 *s)
{
    memset(s, 0, sizeof *s);
    s->amin1 = 0xffffffffu;
}

static double bits_value(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return (double)f;
}

/* Adds s into row and leaves s as stats32_init does, touching only the
 * exponent bytes that can be non-zero (cpu_kernels.h). */
static void stats_flush(ampx_stats32 *s, double *row)
{
    double *hist = row + AMPX_STATS_HIST;
    uint32_t zero_sub = 0u;
    const int nt = (int)s->tables;
    for (int t = 0; t < nt; t++)
        zero_sub += s->ex[t][0];
    if (s->amax > 0u) {
        uint32_t lo = (s->amin1 + 1u) >> 23, hi = s->amax >> 23;
        for (uint32_t k = lo > 1u ? lo : 1u; k <= hi; k++) {
            uint32_t c = 0u;
            for (int t = 0; t < nt; t++) {
                c += s->ex[t][k];
                s->ex[t][k] = 0u;
            }
            if (c != 0u)
                hist[k + 23] += (double)c; /* biased exponent k: e = k - 127, bucket 1 + e + 149 */
        }
        double amax = bits_value(s->amax), amin = bits_value(s->amin1 + 1u);
        if (amax > row[AMPX_STATS_AMAX])
            row[AMPX_STATS_AMAX] = amax;
        if (amin < row[AMPX_STATS_AMIN])
            row[AMPX_STATS_AMIN] = amin;
    }
    for (int k = 1; k <= 23; k++)
        hist[k] += (double)s->sub[k];
    row[AMPX_STATS_ZERO] += (double)(zero_sub - s->nsub);
    row[AMPX_STATS_POSINF] += (double)s->posinf;
    row[AMPX_STATS_NEGINF] += (double)s->neginf;
    row[AMPX_STATS_NAN] += (double)s->nan;
    for (int t = 0; t < nt; t++)
        s->ex[t][0] = s->ex[t][255] = 0u;
    memset(s->sub, 0, sizeof s->sub);
    s->nsub = s->posinf = s->neginf = s->nan = s->amax = s->tables = 0u;
    s->amin1 = 0xffffffffu;
}

/* The histogram bucket of a finite non-zero double (its floor(log2 |x|), clamped to the ends). */
static int f64_bucket(double a)
{
    int e;
    (void)frexp(a, &e); /* a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1 */
    e -= 1;
    if (e < AMPX_STATS_EXP_MIN)
        return 0;
    if (e > AMPX_STATS_EXP_MAX)
        return AMPX_STATS_BUCKETS - 1;
    return 1 + e - AMPX_STATS_EXP_MIN;
}

static void stats_f64(const double *p, int64_t n, double *row)
{
    double *hist = row + AMPX_STATS_HIST;
    double mx = row[AMPX_STATS_AMAX], mn = row[AMPX_STATS_AMIN];
    int64_t zero = 0, pinf = 0, ninf = 0, nan = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = p[i], a = fabs(x);
        if (x != x) {
            nan++;
        } else if (a == INFINITY) {
            if (x > 0)
                pinf++;
            else
                ninf++;
        } else if (a == 0.0) {
            zero++;
        } else {
            mx = a > mx ? a : mx;
            mn = a < mn ? a : mn;
            hist[f64_bucket(a)] += 1.0;
        }
    }
    row[AMPX_STATS_AMAX] = mx;
    row[AMPX_STATS_AMIN] = mn;
    row[AMPX_STATS_ZERO] += (double)zero;
    row[AMPX_STATS_POSINF] += (double)pinf;
    row[AMPX_STATS_NEGINF] += (double)ninf;
    row[AMPX_STATS_NAN] += (double)nan;
}

/* Counts elements [b, e) of tensor t into row. */
static void stats_piece(const ampx_cpu_kernels *K, const ampx_tensor *t, int64_t b, int64_t e, ampx_stats32 *s,
                        double *row)
{
    if (t->dtype == AMPX_F64) {
        stats_f64((const double *)t->ptr + b, e - b, row);
        return;
    }
    const size_t es = t->dtype == AMPX_F32 ? 4u : 2u;
    while (b < e) {
        int64_t m = e - b < STATS_RUN_MAX ? e - b : STATS_RUN_MAX;
        K->stats[t->dtype](t->ptr + (size_t)b * es, m, s);
        stats_flush(s, row);
        b += m;
    }
}

typedef struct {
    const ampx_cpu_kernels *K;
    const ampx_tensor *ts;
    int64_t n, ntasks;
    const int64_t *start;  /* n + 1: tensor i's first element in the concatenation */
    const int64_t *bound;  /* ntasks + 1: task k covers [bound[k], bound[k+1]) */
    double *rows;          /* n rows */
    double *pieces;        /* ntasks x 2 rows */
    int64_t *piece_of;     /* ntasks x 2: the tensor of each piece row, or -1 */
} stats_job;

/* The first tensor holding element g of the concatenation (a non-empty one: start[i] <= g < start[i+1]). */
static int64_t tensor_at(const stats_job *J, int64_t g)
{
    int64_t lo = 0, hi = J->n - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (J->start[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static void stats_task(void *ctx, int64_t k)
{
    const stats_job *J = (const stats_job *)ctx;
    ampx_stats32 s;
    stats32_init(&s);
    int64_t b = J->bound[k], e = J->bound[k + 1];
    int np = 0;
    for (int64_t i = b < e ? tensor_at(J, b) : J->n; i < J->n && J->start[i] < e; i++) {
        int64_t lo = J->start[i], hi = J->start[i + 1];
        if (lo == hi)
            continue;
        int64_t pb = (b > lo ? b : lo) - lo, pe = (e < hi ? e : hi) - lo;
        if (pb == 0 && pe == hi - lo) {
            /* built in cache, stored once: rows are 2.3 KB, as much as 286 float64 elements read */
            double row[AMPX_STATS_WIDTH];
            row_init(row, pe);
            stats_piece(J->K, &J->ts[i], 0, pe, &s, row);
            memcpy(J->rows + i * AMPX_STATS_WIDTH, row, sizeof row);
        } else {
            double *row = J->pieces + (2 * k + np) * AMPX_STATS_WIDTH;
            row_init(row, 0);
            J->piece_of[2 * k + np] = i;
            np++;
            stats_piece(J->K, &J->ts[i], pb, pe, &s, row);
        }
    }
}

static void row_add(double *row, const double *piece)
{
    if (piece[AMPX_STATS_AMAX] > row[AMPX_STATS_AMAX])
        row[AMPX_STATS_AMAX] = piece[AMPX_STATS_AMAX];
    if (piece[AMPX_STATS_AMIN] < row[AMPX_STATS_AMIN])
        row[AMPX_STATS_AMIN] = piece[AMPX_STATS_AMIN];
    for (int j = AMPX_STATS_POSINF; j < AMPX_STATS_WIDTH; j++)
        if (j != AMPX_STATS_NUMEL)
            row[j] += piece[j];
}

/* Task boundaries over total elements: about equal, multiples of 16 elements. */
static int64_t plan_tasks(int64_t total, int nthreads, int64_t *bound, int64_t cap)
{
    int64_t ntasks = 1;
    if (nthreads > 1 && total >= ampx_parallel_min) {
        ntasks = (int64_t)nthreads * AMPX_TASKS_PER_THREAD;
        int64_t by_size = total / AMPX_CHUNK;
        ntasks = ntasks < by_size ? ntasks : by_size;
        ntasks = ntasks < cap ? ntasks : cap;
        ntasks = ntasks > 1 ? ntasks : 1;
    }
    for (int64_t k = 0; k <= ntasks; k++)
        bound[k] = k == ntasks ? total : (total / ntasks * k) & ~(int64_t)15;
    return ntasks;
}

int cpu_tensor_stats(entry_call *c)
{
    const tlist *L = &c->L;
    const int64_t n = L->n;
    double *rows = (double *)c->stats;
    const int64_t cap = (int64_t)AMPX_MAX_THREADS * AMPX_TASKS_PER_THREAD;
    int64_t *start = (int64_t *)malloc(((size_t)n + 1u) * sizeof *start);
    int64_t *bound = (int64_t *)malloc(((size_t)cap + 1u) * sizeof *bound);
    int64_t *piece_of = (int64_t *)malloc(2u * (size_t)cap * sizeof *piece_of);
    double *pieces = NULL;
    int rc = -1;
    if (start == NULL || bound == NULL || piece_of == NULL)
        goto done;
    start[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        start[i + 1] = start[i] + L->ts[i].numel;
        if (L->ts[i].numel == 0) /* no task visits an empty tensor */
            row_init(rows + i * AMPX_STATS_WIDTH, 0);
    }
    int nthreads = c->at.nthreads < AMPX_MAX_THREADS ? c->at.nthreads : AMPX_MAX_THREADS;
    int64_t ntasks = plan_tasks(L->total, nthreads, bound, cap);
    pieces = (double *)malloc(2u * (size_t)ntasks * AMPX_STATS_WIDTH * sizeof *pieces);
    if (pieces == NULL)
        goto done;
    for (int64_t k = 0; k < 2 * ntasks; k++)
        piece_of[k] = -1;
    stats_job J = {ampx_cpu_active, L->ts, n, ntasks, start, bound, rows, pieces, piece_of};
    if (c->release_gil && L->total >= GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        ampx_parallel_for(nthreads, ntasks, stats_task, &J);
        Py_END_ALLOW_THREADS
    } else {
        ampx_parallel_for(nthreads, ntasks, stats_task, &J);
    }
    /* A cut tensor's pieces come in task order, one after another: its row starts at the first. */
    int64_t last = -1;
    for (int64_t k = 0; k < 2 * ntasks; k++) {
        int64_t i = piece_of[k];
        if (i < 0)
            continue;
        if (i != last)
            row_init(rows + i * AMPX_STATS_WIDTH, L->ts[i].numel);
        row_add(rows + i * AMPX_STATS_WIDTH, pieces + k * AMPX_STATS_WIDTH);
        last = i;
    }
    rc = 0;
done:
    if (rc < 0)
        PyErr_NoMemory();
    free(start);
    free(bound);
    free(piece_of);
    free(pieces);
    return rc;
}
