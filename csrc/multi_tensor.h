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
extern int64_t ampx_last_spans;    /* spans of the last coalesced call (CPU or CUDA), -1 if it ran per tensor (tests) */
extern int64_t ampx_split_max_bytes; /* torch's split only up to this many bytes a call (settable) */

/* One tensor as the kernels see it: contiguous memory of numel elements. */
typedef struct ampx_tensor_s {
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
    int split;       /* AMPX_SPLIT_*: how threads share the work, as decided by ampx_split_for */
} ampx_job;

/* How a job's elements are shared among threads. DYNAMIC: long runs handed
 * out as threads come free (balances a late or slow thread; best when the
 * data streams from memory). LINES and ELEMENTS: each thread takes exactly
 * the part of each tensor that torch's next operation will give the thread
 * of the same number in its OpenMP team: LINES as its fused optimizers
 * (every tensor's 64-byte lines shared evenly: at::parallel_for with grain
 * 0), ELEMENTS as its elementwise ops (grain 32768: tensors of up to 32768
 * elements stay on thread 0). When the gradients fit in cache, each core
 * then finds in its own cache the lines that torch's kernel will write
 * there, instead of the other core holding copies it must give up first
 * (2-core EPYC, LoRA shapes, fused AdamW: the step after ampx's read pass
 * took ~0.5 ms longer under DYNAMIC). The parts line up with torch's only
 * when the ampx call and torch's kernel run on the same calling thread with
 * the same team size (torch's own thread count), as the scaler's do. */
#define AMPX_SPLIT_DYNAMIC 0
#define AMPX_SPLIT_LINES 1
#define AMPX_SPLIT_ELEMENTS 2
#define AMPX_NUM_SPLITS 3
#define AMPX_TORCH_GRAIN ((int64_t)32768) /* at::internal::GRAIN_SIZE */
#define AMPX_SPLIT_MAX_BYTES_DEFAULT ((int64_t)16 << 20)
/* Most (tensor, thread) pairs a followed split plans (bounds its plan's cost). */
#define AMPX_SPLIT_MAX_PAIRS ((int64_t)1 << 16)

/* The split a job asking for `split` over ts[0..n) (total elements) on
 * nthreads threads really uses: `split` only on torch's OpenMP team with
 * nthreads > 1 equal to the calling thread's team size, at most
 * AMPX_MAX_THREADS, total >= ampx_parallel_min, at most
 * ampx_split_max_bytes and AMPX_SPLIT_MAX_PAIRS; else DYNAMIC. Call with
 * the GIL held (reads settings Python may change). */
int ampx_split_for(int split, const ampx_tensor *ts, int64_t n, int64_t total, int nthreads);

/* Thread t's part of a tensor of numel elements of elem bytes under split
 * LINES or ELEMENTS with a team of T, as elements [*b, *e) (exposed for tests). */
void ampx_torch_part(int split, int64_t numel, size_t elem, int T, int t, int64_t *b, int64_t *e);

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
 * rounding is keyed by tensor): only scale/check/reduce jobs whose reductions
 * are wanted for the whole list, not per tensor, may run on spans; per-tensor
 * flags are recovered afterwards (entry_cpu.c) or through span tables
 * (cuda_launch.c). Pure C (coalesce.c). */
void ampx_coalesce(const ampx_tensor *ts, int64_t n, ampx_tensor *spans, int64_t *first, int64_t *nspans);

/* Combines partial b into a (in that order) for reduction kind `reduce`. */
void ampx_partial_combine(ampx_partial *a, const ampx_partial *b, int reduce);

#endif /* AMPX_MULTI_TENSOR_H */
