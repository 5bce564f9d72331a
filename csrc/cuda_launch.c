/*
 * cuda_launch.c: the CUDA multi-tensor launcher, written once for every op.
 *
 * The tensors of a call are packed in list order into kernel parameter blocks
 * (ampx_cu_args, passed by value, under 4 KB): up to AMPX_CU_MAX_TENSORS
 * tensors per launch, each with its device pointer, size, dtype and the range
 * of the launch's chunks it owns; one block per chunk of AMPX_CU_CHUNK
 * elements. All launches of a call and the one memset of its workspace
 * counters go to the caller's stream, so the call never waits for the host
 * and can be captured into a CUDA graph.
 *
 * Workspace (only when per-tensor flags, per-tensor reductions or the total
 * are wanted), at ws:
 *   uint32 tflags[nflags] (pad to 16)  span slots only (job->nflags): their tensors' flags
 *   uint32 tcount[n], uint32 done      zeroed, with tflags, by one memset before the launches
 *   (pad to 16) ampx_cu_partial[P]     one per chunk of the call (P chunks)
 *   double pt[n]                       per-tensor reductions, for the total
 * Every tensor then has at least one chunk (an empty one has one of length 0),
 * so every tensor's outputs are written.
 *
 * A stats job (tensor_stats) always has outputs, its rows; its workspace is one
 * accumulator row (cuda_args.h) per tensor of more than one chunk, zeroed by one
 * memset, handed to the kernel as that tensor's src.
 */
#include <stdlib.h>
#include <string.h>

#include "ampx_numerics.h"
#include "cuda_driver.h"
#include "multi_tensor.h"

/* The layout nvcc asserts too (cuda/ampx_kernels.cu): the C side's must be the same. */
AMPX_STATIC_ASSERT(sizeof(ampx_cu_args) == AMPX_CU_ARGS_SIZE && sizeof(ampx_cu_args) <= 4096,
                   "kernel argument layout");
AMPX_STATIC_ASSERT(sizeof(ampx_cu_span_head) == 16 && sizeof(ampx_cu_span_entry) == 16, "span table layout");

static int64_t chunks_of(int64_t numel, int with_ws)
{
    int64_t c = (numel + AMPX_CU_CHUNK - 1) >> AMPX_CU_CHUNK_LOG2;
    return c == 0 && with_ws ? 1 : c;
}

static int wants_ws(const ampx_cu_job *job)
{
    return job->kind == AMPX_CU_STATS || job->flags_out != 0 || job->per_out != 0 || job->total_out != 0;
}

static int64_t align16(int64_t b) { return (b + 15) & ~(int64_t)15; }

/* The workspace's leading tflags words, rounded up to 16 bytes. */
static int64_t tflags_bytes(const ampx_cu_job *job) { return job->nflags > 0 ? align16(4 * job->nflags) : 0; }

int64_t ampx_cu_workspace_bytes(const ampx_cu_job *job, const ampx_cu_tensor *ts, int64_t n, int64_t *chunks)
{
    *chunks = 0;
    if (!wants_ws(job) || n == 0)
        return 0;
    if (job->kind == AMPX_CU_STATS) {
        int64_t rows = 0;
        for (int64_t i = 0; i < n; i++)
            rows += chunks_of(ts[i].numel, 1) > 1;
        *chunks = rows;
        return AMPX_CU_STATS_ROW_BYTES * rows;
    }
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        c += chunks_of(ts[i].numel, 1);
        if (c >= (int64_t)UINT32_MAX)
            return -1;
    }
    *chunks = c;
    return tflags_bytes(job) + align16(4 * (n + 1)) + 16 * c + 8 * n;
}

/* ---- span tables ---- */

int64_t ampx_cu_span_tables_bytes(int64_t n, int64_t m)
{
    return (int64_t)sizeof(ampx_cu_span_head) * m + (int64_t)sizeof(ampx_cu_span_entry) * n;
}

static int entry_cmp(const void *a, const void *b)
{
    int64_t x = ((const ampx_cu_span_entry *)a)->off, y = ((const ampx_cu_span_entry *)b)->off;
    return x < y ? -1 : x > y;
}

int ampx_cu_span_tables(const ampx_tensor *ts, const ampx_tensor *spans, const int64_t *first, int64_t m,
                        void *host, int64_t *off)
{
    char *at = (char *)host;
    for (int64_t s = 0; s < m; s++) {
        ampx_cu_span_head *h = (ampx_cu_span_head *)at;
        ampx_cu_span_entry *e = (ampx_cu_span_entry *)(h + 1);
        const int64_t count = first[s + 1] - first[s];
        if (count > (int64_t)UINT32_MAX)
            return -1;
        const int64_t es = ampx_elem_size(spans[s].dtype);
        uint32_t k = 0, empties = 0;
        for (int64_t i = first[s]; i < first[s + 1]; i++) {
            const ampx_tensor *t = &ts[i];
            /* empties go last, from the end of the table backwards */
            ampx_cu_span_entry *d = t->numel > 0 ? &e[k++] : &e[count - 1 - empties++];
            memset(d, 0, sizeof *d);
            d->off = t->numel > 0 ? (int64_t)(t->ptr - spans[s].ptr) / es : 0;
            d->index = t->index;
        }
        /* in list order a span grows at either end (ampx_coalesce): order by offset */
        qsort(e, k, sizeof *e, entry_cmp);
        memset(h, 0, sizeof *h);
        h->search = k;
        h->all = (uint32_t)count;
        off[s] = (int64_t)(at - (char *)host);
        at += sizeof *h + (size_t)count * sizeof *e;
    }
    return 0;
}

void ampx_cu_span_slots(const ampx_tensor *spans, int64_t m, ampx_cu_deviceptr tables, const int64_t *off,
                        ampx_cu_tensor *out)
{
    for (int64_t s = 0; s < m; s++) {
        memset(&out[s], 0, sizeof out[s]);
        out[s].ptr = (ampx_cu_deviceptr)(uintptr_t)spans[s].ptr;
        out[s].numel = spans[s].numel;
        out[s].dtype = spans[s].dtype;
        out[s].index = (uint32_t)s;
        out[s].src = tables != 0 ? tables + (ampx_cu_deviceptr)off[s] : 0;
    }
}

static ampx_cu_function pick(const ampx_cu_dev *dev, const ampx_cu_job *job)
{
    if (job->kind == AMPX_CU_CAST)
        return dev->cast;
    if (job->kind == AMPX_CU_STATS)
        return dev->stats;
    if (job->reduce < 0 || job->reduce >= AMPX_NUM_REDUCE)
        return NULL;
    return dev->scale[job->reduce][job->write ? 1 : 0][job->scale ? 1 : 0];
}

/* A stats job's start: its rows, and its accumulator rows (`rows` of them at ws) zeroed. */
static int stats_begin(ampx_cu_launcher *L, const ampx_cu_job *job, int64_t rows, ampx_cu_deviceptr ws,
                       ampx_cu_error *err)
{
    L->args.per_out = job->per_out;
    L->acc_next = ws;
    if (rows == 0)
        return 0;
    if (ampx_cu_push(L->dev, err) < 0)
        return -1;
    int rc = ampx_cu_memset32(ws, 0u, (size_t)(AMPX_CU_STATS_ROW_BYTES / 4 * rows), L->stream, err);
    ampx_cu_error ignored;
    if (ampx_cu_pop(rc < 0 ? &ignored : err) < 0 && rc == 0)
        rc = -1;
    return rc;
}

int ampx_cu_begin(ampx_cu_launcher *L, const ampx_cu_dev *dev, ampx_cu_stream stream, const ampx_cu_job *job,
                  int64_t n, int64_t chunks, ampx_cu_deviceptr ws, ampx_cu_error *err)
{
    memset(L, 0, sizeof *L);
    L->dev = dev;
    L->stream = stream;
    L->fn = pick(dev, job);
    if (L->fn == NULL) {
        err->code = AMPX_CU_E_AMPX;
        strcpy(err->msg, "no CUDA kernel for this mode");
        return -1;
    }
    if (n > (int64_t)UINT32_MAX - 1) {
        err->code = AMPX_CU_E_AMPX;
        strcpy(err->msg, "too many tensors for one call");
        return -1;
    }
    ampx_cu_args *a = &L->args;
    a->kind = (uint32_t)job->kind;
    a->reduce = job->kind != AMPX_CU_SCALE ? AMPX_REDUCE_NONE : (uint32_t)job->reduce;
    a->check = job->found_inf != 0 || job->flags_out != 0;
    a->stochastic = (uint32_t)job->stochastic;
    a->seed = job->seed;
    a->offset = job->offset;
    a->rng = job->rng;
    a->factor = job->factor;
    a->factor_ptr = job->factor_ptr;
    a->found_inf = job->found_inf;
    a->ntotal = (uint32_t)n;
    L->with_ws = wants_ws(job);
    if (!L->with_ws)
        return 0;
    if (job->kind == AMPX_CU_STATS)
        return stats_begin(L, job, chunks, ws, err);
    a->flags_out = job->flags_out;
    a->per_out = job->reduce != AMPX_REDUCE_NONE ? job->per_out : 0;
    a->total_out = job->reduce != AMPX_REDUCE_NONE ? job->total_out : 0;
    if (n == 0) {
        /* nothing to launch: the total of nothing is 0 */
        if (a->total_out == 0)
            return 0;
        if (ampx_cu_push(dev, err) < 0)
            return -1;
        int rc = ampx_cu_memset32(a->total_out, 0u, 1, stream, err);
        ampx_cu_error ignored;
        if (ampx_cu_pop(rc < 0 ? &ignored : err) < 0 && rc == 0)
            rc = -1;
        return rc;
    }
    const int64_t lead = tflags_bytes(job);
    a->tflags = lead > 0 && a->flags_out != 0 ? ws : 0;
    a->tcount = ws + (ampx_cu_deviceptr)lead;
    a->done = a->tcount + 4 * (ampx_cu_deviceptr)n;
    a->partials = a->tcount + (ampx_cu_deviceptr)align16(4 * (n + 1));
    a->pt = a->partials + 16 * (ampx_cu_deviceptr)chunks;
    if (ampx_cu_push(dev, err) < 0)
        return -1;
    int rc = ampx_cu_memset32(ws, 0u, (size_t)(lead / 4 + n + 1), stream, err);
    ampx_cu_error ignored;
    if (ampx_cu_pop(rc < 0 ? &ignored : err) < 0 && rc == 0)
        rc = -1;
    return rc;
}

int ampx_cu_flush(ampx_cu_launcher *L, ampx_cu_error *err)
{
    ampx_cu_args *a = &L->args;
    if (a->ntensors == 0)
        return 0;
    unsigned grid = a->nchunks < AMPX_CU_MAX_GRID ? a->nchunks : AMPX_CU_MAX_GRID;
    int rc = ampx_cu_push(L->dev, err);
    if (rc == 0) {
        rc = ampx_cu_launch(L->fn, grid, AMPX_CU_BLOCK, L->stream, a, "cuLaunchKernel", err);
        ampx_cu_error ignored;
        if (ampx_cu_pop(rc < 0 ? &ignored : err) < 0 && rc == 0)
            rc = -1;
    }
    a->chunk_base += a->nchunks;
    a->nchunks = 0;
    a->ntensors = 0;
    return rc;
}

int ampx_cu_add(ampx_cu_launcher *L, const ampx_cu_tensor *t, ampx_cu_error *err)
{
    int64_t nch = chunks_of(t->numel, L->with_ws);
    if (nch == 0)
        return 0; /* an empty tensor has nothing to do unless it has outputs */
    ampx_cu_args *a = &L->args;
    if (a->ntensors == AMPX_CU_MAX_TENSORS || (int64_t)a->nchunks + nch > (int64_t)UINT32_MAX - 1 ||
        (int64_t)a->chunk_base + a->nchunks + nch > (int64_t)UINT32_MAX - 1) {
        if (ampx_cu_flush(L, err) < 0)
            return -1;
        if ((int64_t)a->chunk_base + nch > (int64_t)UINT32_MAX - 1) {
            err->code = AMPX_CU_E_AMPX;
            strcpy(err->msg, "too many chunks for one call");
            return -1;
        }
    }
    uint32_t s = a->ntensors++;
    a->ptr[s] = t->ptr;
    a->src[s] = t->src;
    if (a->kind == AMPX_CU_STATS) {
        a->src[s] = nch > 1 ? L->acc_next : 0;
        L->acc_next += nch > 1 ? (ampx_cu_deviceptr)AMPX_CU_STATS_ROW_BYTES : 0;
    }
    a->numel[s] = t->numel;
    a->dtype[s] = (uint8_t)t->dtype;
    a->src_dtype[s] = (uint8_t)t->src_dtype;
    a->index[s] = t->index;
    a->first[s] = a->nchunks;
    a->nchunks += (uint32_t)nch;
    a->first[s + 1] = a->nchunks;
    return 0;
}

int ampx_cu_update(const ampx_cu_dev *dev, ampx_cu_stream stream, const ampx_cu_update_args *a,
                   ampx_cu_error *err)
{
    ampx_cu_update_args copy = *a;
    if (ampx_cu_push(dev, err) < 0)
        return -1;
    int rc = ampx_cu_launch(dev->update, 1, 1, stream, &copy, "cuLaunchKernel(update_scale)", err);
    ampx_cu_error ignored;
    if (ampx_cu_pop(rc < 0 ? &ignored : err) < 0 && rc == 0)
        rc = -1;
    return rc;
}
