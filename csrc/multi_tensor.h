/*
 * multi_tensor.h: the CPU multi-tensor launcher, written once for every op.
 *
 * A list of tensors is cut into chunks of AMPX_CHUNK elements (a tensor's
 * last chunk may be shorter; chunks never span tensors). Consecutive chunks
 * are grouped into tasks of at least AMPX_CHUNK elements (and about
 * AMPX_TASKS_PER_THREAD tasks per thread) so that thousands of small tensors
 * cost a few task hand-outs, and each thread streams long runs. Each
 * chunk's result lands in its own slot and the slots are combined in chunk
 * order, so reductions give the same bits whatever the thread count.
 */
#ifndef AMPX_MULTI_TENSOR_H
#define AMPX_MULTI_TENSOR_H

#include <stdint.h>

#include "cpu_kernels.h"

/* Elements per chunk: a power of two dividing 2^32 (stochastic rounding
 * keys rely on chunks not straddling a multiple of 2^32). */
#define AMPX_CHUNK ((int64_t)1 << 16)
/* Tasks handed out per thread of a job (see ampx_run). */
#define AMPX_TASKS_PER_THREAD 4
/* Below this many elements in all, a job runs on the calling thread. */
#define AMPX_PARALLEL_MIN_DEFAULT ((int64_t)1 << 18)

extern int64_t ampx_parallel_min; /* settable by tests */
extern int ampx_coalesce_on;       /* 1: runs of back-to-back tensors become spans (ampx_coalesce) */
extern int64_t ampx_last_spans;    /* spans of the last coalesced CPU call, -1 if it ran per tensor (tests) */

/* One tensor as the kernels see it: contiguous memory of numel elements. */
typedef struct {
    char *ptr;       /* data; for casts the destination */
    const char *src; /* casts only: the source */
    int64_t numel;
    int dtype;       /* dtype of ptr */
    int src_dtype;   /* casts only */
    uint32_t index;  /* position in the caller's list (stochastic rounding key) */
} ampx_tensor;

typedef struct {
    int cast;        /* 0: scale kernel with `mode`; 1: cast kernel */
    int mode;        /* AMPX_MODE_* for the scale kernel */
    double factor;   /* multiplier (1.0 for none) */
    int stochastic;  /* casts to bfloat16 only */
    uint64_t seed, offset;
} ampx_job;

/* Runs `job` over ts[0..n) with up to nthreads threads and writes tensor
 * i's combined result into parts[i]. Returns 0, or -1 if memory for the
 * plan could not be had (nothing has been touched then). Does not need the
 * GIL and must not be given Python objects. */
int ampx_run(const ampx_job *job, const ampx_tensor *ts, int64_t n, int nthreads,
             ampx_partial *parts);

/* Coalescing: consecutive tensors of ts[0..n) whose memory lies back to back
 * (same dtype, tensor k+1 starting where the span so far ends or ending
 * where it starts: views of one flat buffer in either order, such as DDP's
 * bucket views, which lie in descending addresses in parameter order,
 * FSDP's flat parameters or ampx.GradBuffer) become one span, streamed as
 * one run of chunks. Writes
 * the spans into spans[0..*nspans) and, for span s, the first tensor it
 * covers into first[s]; first[*nspans] = n. Empty tensors join the span
 * around them (they hold nothing); a list of only empty tensors gives no
 * span. A span's index is that of its first tensor. The caller gives room
 * for n spans and n + 1 firsts, and must not pass overlapping tensors (whose
 * result would depend on the order of the work) or casts (whose stochastic
 * rounding is keyed by tensor): only scale/check/reduce jobs whose results
 * are wanted for the whole list, not per tensor, may run on spans. Pure C. */
void ampx_coalesce(const ampx_tensor *ts, int64_t n, ampx_tensor *spans, int64_t *first, int64_t *nspans);

/* Combines partial b into a (in that order) for reduction kind `reduce`. */
void ampx_partial_combine(ampx_partial *a, const ampx_partial *b, int reduce);

#endif /* AMPX_MULTI_TENSOR_H */
