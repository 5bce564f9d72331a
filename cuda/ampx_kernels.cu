/*
 * ampx_kernels.cu: ampx's CUDA kernels, compiled by nvcc into ampx/_kernels.fatbin
 * (SASS for sm_80, sm_86, sm_89, sm_90 and PTX for compute_90) and loaded at
 * run time through the driver API (csrc/cuda_driver.c).
 *
 * One multi-tensor loop (run_chunks) serves the scale and cast kernels; tensor_stats,
 * whose results are rows rather than reductions, walks the same chunks (its section).
 * A launch carries up to AMPX_CU_MAX_TENSORS tensors in its __grid_constant__ parameter block;
 * each tensor is cut into chunks of AMPX_CU_CHUNK elements and each chunk is
 * the work of one block (blocks loop when the grid is capped). Within a chunk,
 * thread t owns the 16-byte vectors t, t + BLOCK, t + 2*BLOCK, ... and the
 * elements past the last full vector belong to the next owner in that order;
 * a chunk whose memory is not 16-byte aligned is read with scalar loads in the
 * very same ownership and order. So every thread sums the same elements in the
 * same order whatever the alignment, and reductions are fixed trees over
 * fixed groups: the same input gives the same bits on every run.
 *
 * Results: found_inf is set to 1.0 by any block that sees an inf/NaN input
 * (never cleared). When per-tensor flags, per-tensor norms or the total are
 * wanted, each chunk of a several-chunk tensor writes its partial to the
 * workspace and counts itself done; the block that finishes a tensor sums its
 * partials (fixed order), writes the tensor's outputs and counts the tensor
 * done; the block that finishes the last tensor sums the per-tensor values
 * (fixed order) into the total. No host synchronisation anywhere.
 *
 * Span slots (tflags set): each slot is a run of back-to-back tensors streamed as
 * one, with a span table (cuda_args.h) saying which tensors it covers. A thread
 * that met an inf/NaN input reads its elements again, looks each non-finite
 * one's tensor up there and sets that tensor's bit in tflags (note_elements);
 * the block that finishes the span copies the span's tensors' flags into
 * flags_out. Reductions and found_inf stay per slot.
 *
 * The scalar numerics (conversions, stochastic rounding bits, the scale
 * update rule) are csrc/ampx_numerics.h, shared with the CPU kernels.
 */
#ifndef AMPX_CUDA_EMULATION
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include <stdint.h>

#include <type_traits>

#include "ampx_numerics.h"
#include "cuda_args.h"
#include "cuda_driver.h"

/* ---- the host side's assumptions, checked here where cuda.h is at hand ---- */

static_assert(sizeof(ampx_cu_args) == AMPX_CU_ARGS_SIZE, "kernel argument layout");
static_assert(sizeof(ampx_cu_args) <= 4096, "kernel arguments must fit the 4 KB parameter limit");
static_assert(sizeof(ampx_cu_partial) == 16, "partial layout");
#ifndef AMPX_CUDA_EMULATION /* (tests/test_cuda.py runs these kernels on the CPU through cuda/emulate.h) */
static_assert(AMPX_CUDA_SUCCESS == CUDA_SUCCESS, "driver constant");
static_assert(AMPX_CUDA_ERROR_NO_BINARY_FOR_GPU == CUDA_ERROR_NO_BINARY_FOR_GPU, "driver constant");
static_assert(AMPX_CUDA_ERROR_NOT_INITIALIZED == CUDA_ERROR_NOT_INITIALIZED, "driver constant");
static_assert(AMPX_CU_STREAM_NON_BLOCKING == CU_STREAM_NON_BLOCKING, "driver constant");
static_assert(AMPX_CU_STREAM_CAPTURE_STATUS_NONE == CU_STREAM_CAPTURE_STATUS_NONE, "driver constant");
#define AMPX_X_CHECK_HINT(code, cu_name, text) static_assert(code == cu_name, "driver error code " #cu_name);
AMPX_CU_ERROR_HINTS(AMPX_X_CHECK_HINT)
#undef AMPX_X_CHECK_HINT
static_assert(AMPX_CU_ATTR_MULTIPROCESSOR_COUNT == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "driver constant");
static_assert(AMPX_CU_ATTR_CC_MAJOR == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "driver constant");
static_assert(AMPX_CU_ATTR_CC_MINOR == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "driver constant");
static_assert(sizeof(ampx_cu_deviceptr) == sizeof(CUdeviceptr), "driver type");
#endif
static_assert(AMPX_CU_BLOCK % 32 == 0 && AMPX_CU_BLOCK <= 1024, "block size");

#define BLOCK AMPX_CU_BLOCK
#define NWARPS (BLOCK / 32)
#define FULL_MASK 0xffffffffu

/* ---- element types -------------------------------------------------------- */

template <int DT> struct dt_info;
template <> struct dt_info<AMPX_F32> { static constexpr int size = AMPX_SIZE_F32; typedef float compute; };
template <> struct dt_info<AMPX_F16> { static constexpr int size = AMPX_SIZE_F16; typedef float compute; };
template <> struct dt_info<AMPX_BF16> { static constexpr int size = AMPX_SIZE_BF16; typedef float compute; };
template <> struct dt_info<AMPX_F64> { static constexpr int size = AMPX_SIZE_F64; typedef double compute; };

/* NB 16-byte words from 16-byte-aligned p, into registers. */
template <int NB>
__device__ __forceinline__ void raw_load(const char *p, uint4 (&raw)[NB])
{
#pragma unroll
    for (int b = 0; b < NB; b++)
        raw[b] = reinterpret_cast<const uint4 *>(p)[b];
}

/* The W elements of type DT held in raw, widened to T. */
template <int DT, int W, typename T>
__device__ __forceinline__ void decode(const uint4 (&raw)[W * dt_info<DT>::size / 16], T (&x)[W])
{
    constexpr int NB = W * dt_info<DT>::size / 16;
    static_assert(NB >= 1 && NB * 16 == W * dt_info<DT>::size, "vector width");
    const uint32_t *w = reinterpret_cast<const uint32_t *>(raw);
#pragma unroll
    for (int k = 0; k < 4 * NB; k++) {
        if (DT == AMPX_F32) {
            x[k] = (T)__uint_as_float(w[k]);
        } else if (DT == AMPX_F16) {
            x[2 * k] = (T)__half2float(__ushort_as_half((unsigned short)(w[k] & 0xffffu)));
            x[2 * k + 1] = (T)__half2float(__ushort_as_half((unsigned short)(w[k] >> 16)));
        } else if (DT == AMPX_BF16) {
            x[2 * k] = (T)__uint_as_float(w[k] << 16);
            x[2 * k + 1] = (T)__uint_as_float(w[k] & 0xffff0000u);
        } else if ((k & 1) == 0) {
            x[k / 2] = (T)__hiloint2double((int)w[k + 1], (int)w[k]);
        }
    }
}

/* W elements of type DT from 16-byte-aligned p (W * size a multiple of 16). */
template <int DT, int W, typename T>
__device__ __forceinline__ void vload(const char *p, T (&x)[W])
{
    uint4 raw[W * dt_info<DT>::size / 16];
    raw_load(p, raw);
    decode<DT, W>(raw, x);
}

/* One element of type DT at p[i], widened to its compute type. */
template <int DT>
__device__ __forceinline__ typename dt_info<DT>::compute sload(const char *p, int64_t i)
{
    if (DT == AMPX_F32)
        return reinterpret_cast<const float *>(p)[i];
    if (DT == AMPX_F16)
        return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short *>(p)[i]));
    if (DT == AMPX_BF16)
        return ampx_bf16_to_f32(reinterpret_cast<const uint16_t *>(p)[i]);
    return (typename dt_info<DT>::compute)reinterpret_cast<const double *>(p)[i];
}

/* float -> float16 / bfloat16 bits, round to nearest even, subnormals kept,
 * overflow to inf (the conversions of ampx_numerics.h, done by the hardware;
 * only NaN payloads may differ, and NaN stays NaN). Two at a time. */
template <int DT>
__device__ __forceinline__ uint32_t pack2(float a, float b)
{
    if (DT == AMPX_F16) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
}

template <int DT>
__device__ __forceinline__ uint16_t pack1(float a)
{
    return (uint16_t)(pack2<DT>(a, 0.0f) & 0xffffu);
}

/* The value a float16 / bfloat16 element stores for x, widened back. */
template <int DT>
__device__ __forceinline__ float round_to(float x)
{
    if (DT == AMPX_F16)
        return __half2float(__float2half_rn(x));
    if (DT == AMPX_BF16)
        return __bfloat162float(__float2bfloat16_rn(x));
    return x;
}

/* Stores W values of compute type into 16-byte-aligned p as DT. */
template <int DT, int W, typename T>
__device__ __forceinline__ void vstore(char *p, const T (&x)[W])
{
    constexpr int NB = W * dt_info<DT>::size / 16;
    uint4 raw[NB];
    uint32_t *w = reinterpret_cast<uint32_t *>(raw);
#pragma unroll
    for (int k = 0; k < 4 * NB; k++) {
        if (DT == AMPX_F32)
            w[k] = __float_as_uint((float)x[k]);
        else if (DT == AMPX_F16 || DT == AMPX_BF16)
            w[k] = pack2<DT>((float)x[2 * k], (float)x[2 * k + 1]);
        else if ((k & 1) == 0) {
            double d = (double)x[k / 2];
            w[k] = (uint32_t)__double2loint(d);
            w[k + 1] = (uint32_t)__double2hiint(d);
        }
    }
#pragma unroll
    for (int b = 0; b < NB; b++)
        reinterpret_cast<uint4 *>(p)[b] = raw[b];
}

template <int DT, typename T>
__device__ __forceinline__ void sstore(char *p, int64_t i, T x)
{
    if (DT == AMPX_F32)
        reinterpret_cast<float *>(p)[i] = (float)x;
    else if (DT == AMPX_F16 || DT == AMPX_BF16)
        reinterpret_cast<uint16_t *>(p)[i] = pack1<DT>((float)x);
    else
        reinterpret_cast<double *>(p)[i] = (double)x;
}

/* ---- per-thread results and the fixed-order block reduction --------------- */

struct part_t {
    double acc;     /* reduction (AMPX_REDUCE_MAXABS: NaN when a NaN was reduced) */
    unsigned flags; /* AMPX_FLAG_* */
};

__device__ __forceinline__ double combine(double a, double b, int rd)
{
    if (rd == AMPX_REDUCE_MAXABS) {
        if (isnan(a) || isnan(b))
            return __longlong_as_double(0x7ff8000000000000ll);
        return a > b ? a : b;
    }
    return a + b;
}

__device__ __forceinline__ double finish(double acc, int rd)
{
    return rd == AMPX_REDUCE_SUMSQ ? sqrt(acc) : acc;
}

struct block_smem {
    double acc[NWARPS];
    unsigned flags[NWARPS];
    int last_chunk, last_tensor;
};

/* Reduces every thread's r into thread 0's (a fixed butterfly in each warp,
 * then the warps' results in warp order). All threads must call it. */
__device__ __forceinline__ void block_reduce(part_t &r, int rd, block_smem &sm)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double acc = r.acc;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        acc = combine(acc, __shfl_xor_sync(FULL_MASK, acc, o), rd);
    unsigned fl = __reduce_or_sync(FULL_MASK, r.flags);
    __syncthreads(); /* the previous user of sm is done */
    if (lane == 0) {
        sm.acc[warp] = acc;
        sm.flags[warp] = fl;
    }
    __syncthreads();
    if (warp == 0) {
        acc = lane < NWARPS ? sm.acc[lane] : 0.0;
        fl = lane < NWARPS ? sm.flags[lane] : 0u;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            acc = combine(acc, __shfl_xor_sync(FULL_MASK, acc, o), rd);
        fl = __reduce_or_sync(FULL_MASK, fl);
    }
    r.acc = acc;
    r.flags = fl;
}

__device__ __forceinline__ float t_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double t_abs(double x) { return fabs(x); }
/* NaN never reaches these maxima: NaN is tracked apart (rn). */
__device__ __forceinline__ float t_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double t_max(double a, double b) { return fmax(a, b); }

/* Per-thread accumulation of one element's stored/reduced value v. */
template <int RD, typename T>
struct accum {
    double sum;
    T mx;
    bool rn; /* a reduced value was NaN (max alone would drop it) */
    bool hn, hi; /* an input was NaN / +-inf */
    __device__ __forceinline__ accum() : sum(0.0), mx((T)0), rn(false), hn(false), hi(false) {}
    __device__ __forceinline__ void input(T x)
    {
        hn |= isnan(x);
        hi |= isinf(x);
    }
    __device__ __forceinline__ void reduce(T v)
    {
        if (RD == AMPX_REDUCE_SUMSQ) {
            double d = (double)v;
            sum = fma(d, d, sum);
        } else if (RD == AMPX_REDUCE_SUMABS) {
            sum += fabs((double)v);
        } else if (RD == AMPX_REDUCE_MAXABS) {
            rn |= isnan(v);
            mx = t_max(mx, t_abs(v));
        }
    }
    __device__ __forceinline__ part_t result() const
    {
        part_t r;
        r.flags = (hn ? AMPX_FLAG_NAN : 0u) | (hi ? AMPX_FLAG_INF : 0u);
        if (RD == AMPX_REDUCE_MAXABS)
            r.acc = rn ? __longlong_as_double(0x7ff8000000000000ll) : (double)mx;
        else
            r.acc = sum;
        return r;
    }
};

/* ---- the multi-tensor loop, written once ---------------------------------- */

__device__ __forceinline__ double ldcg_f64(const double *p) { return __ldcg(p); }

/* Launch chunk c: its slot, its index j within the slot's tensor, that tensor's chunk count
 * nch and the chunk's first element and length (0 for an empty tensor's one chunk). */
struct chunk_t {
    int slot;
    uint32_t j, nch;
    int64_t start, len;
};

__device__ __forceinline__ chunk_t chunk_at(const ampx_cu_args &a, uint32_t c)
{
    /* the slot owning chunk c: the last with first[slot] <= c (every slot has >= 1 chunk) */
    int lo = 0, hi = (int)a.ntensors - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (a.first[mid] <= c)
            lo = mid;
        else
            hi = mid - 1;
    }
    chunk_t k;
    k.slot = lo;
    k.j = c - a.first[lo];
    k.nch = a.first[lo + 1] - a.first[lo];
    k.start = (int64_t)k.j << AMPX_CU_CHUNK_LOG2;
    int64_t len = a.numel[lo] - k.start;
    if (len > AMPX_CU_CHUNK)
        len = AMPX_CU_CHUNK;
    k.len = len < 0 ? 0 : len;
    return k;
}

/* Runs body(slot, start, len) over every chunk of the launch and publishes the
 * results as the header of this file describes. body returns this thread's
 * part of the chunk's result. */
template <class Body>
__device__ __forceinline__ void run_chunks(const ampx_cu_args &a, int rd, Body &body)
{
    __shared__ block_smem sm;
    const int tid = threadIdx.x;
    const bool with_ws = a.tcount != 0;
    float *found = reinterpret_cast<float *>(a.found_inf);
    for (uint32_t c = blockIdx.x; c < a.nchunks; c += gridDim.x) {
        const chunk_t ck = chunk_at(a, c);
        const int slot = ck.slot;
        const uint32_t j = ck.j, nch = ck.nch;
        part_t r = body(slot, ck.start, ck.len);

        if (!with_ws) {
            if (found != nullptr) {
                if (__syncthreads_or(r.flags != 0u) && tid == 0)
                    *found = 1.0f;
            }
            continue;
        }
        block_reduce(r, rd, sm);
        if (tid == 0 && found != nullptr && r.flags != 0u)
            *found = 1.0f;
        const uint32_t idx = a.index[slot];
        bool finisher = true;
        if (nch > 1) {
            ampx_cu_partial *parts = reinterpret_cast<ampx_cu_partial *>(a.partials);
            const uint32_t base = a.chunk_base + a.first[slot];
            if (tid == 0) {
                parts[base + j].acc = r.acc;
                parts[base + j].flags = r.flags;
                __threadfence();
                unsigned old = atomicAdd(reinterpret_cast<unsigned *>(a.tcount) + idx, 1u);
                sm.last_chunk = old == nch - 1u;
            }
            __syncthreads();
            finisher = sm.last_chunk != 0;
            if (finisher) {
                /* the tensor's chunks, in chunk order per thread, then the fixed tree */
                __threadfence();
                part_t t;
                t.acc = 0.0;
                t.flags = 0u;
                for (uint32_t k = tid; k < nch; k += BLOCK) {
                    t.acc = combine(t.acc, ldcg_f64(&parts[base + k].acc), rd);
                    t.flags |= __ldcg(&parts[base + k].flags);
                }
                block_reduce(t, rd, sm);
                r = t;
            }
        }
        if (finisher) {
            if (a.flags_out && a.tflags) {
                /* a span: its tensors' flags, as its chunks noted them (each fenced before
                 * its chunk was counted, and this block fenced after the count) */
                const ampx_cu_span_head *h = reinterpret_cast<const ampx_cu_span_head *>(a.src[slot]);
                const ampx_cu_span_entry *ent = reinterpret_cast<const ampx_cu_span_entry *>(h + 1);
                const unsigned *tf = reinterpret_cast<const unsigned *>(a.tflags);
                for (uint32_t k = tid; k < h->all; k += BLOCK) {
                    const uint32_t ti = ent[k].index;
                    reinterpret_cast<uint8_t *>(a.flags_out)[ti] = (uint8_t)__ldcg(&tf[ti]);
                }
            }
            if (tid == 0) {
                if (a.flags_out && !a.tflags)
                    reinterpret_cast<uint8_t *>(a.flags_out)[idx] = (uint8_t)r.flags;
                if (a.per_out)
                    reinterpret_cast<float *>(a.per_out)[idx] = (float)finish(r.acc, rd);
                if (a.total_out) {
                    reinterpret_cast<double *>(a.pt)[idx] = r.acc;
                    __threadfence();
                    unsigned old = atomicAdd(reinterpret_cast<unsigned *>(a.done), 1u);
                    sm.last_tensor = old == a.ntotal - 1u;
                }
            }
            if (a.total_out) {
                __syncthreads();
                if (sm.last_tensor) {
                    __threadfence();
                    const double *pt = reinterpret_cast<const double *>(a.pt);
                    part_t t;
                    t.acc = 0.0;
                    t.flags = 0u;
                    for (uint32_t k = tid; k < a.ntotal; k += BLOCK)
                        t.acc = combine(t.acc, ldcg_f64(&pt[k]), rd);
                    block_reduce(t, rd, sm);
                    if (tid == 0)
                        *reinterpret_cast<float *>(a.total_out) = (float)finish(t.acc, rd);
                }
            }
        }
        __syncthreads(); /* sm is reused by the next chunk */
    }
}

/* ---- scale / check / reduce ------------------------------------------------ */

/* ---- per-tensor flags inside span slots (tflags set) ----------------------------------
 * The streaming loop below is the same with or without span tables: a thread only learns
 * there whether any of its elements was non-finite (its part's flags). One that was then
 * reads its own elements of the chunk again (note_elements) and notes each non-finite one
 * under its tensor in the span table. Rare (overflow steps), and out of the loop: a call
 * (not inlined), so that the loop does not keep the chunk's pointer, length and slot live
 * for it (inlined, ptxas reloaded them in every iteration on sm_90). The second read sees
 * the values as stored; they are non-finite exactly where the inputs were, and of the same
 * kind, when the factor is a normal number of magnitude at most 1 (nothing finite
 * overflows, no inf meets a zero, even where subnormals are flushed). With another factor
 * a writing kernel notes before it writes instead: every thread reads its elements first
 * (scale < 1 only, so the extra read is rare too). */

/* The tensor a thread noted last: a thread visits its elements in increasing order, so a
 * run of non-finite values in one tensor costs one look-up and one atomic per bit. */
struct span_seen {
    int64_t lo, hi; /* its elements, as span offsets ([0, 0) at first) */
    unsigned *word; /* its flags word in tflags */
    unsigned bits;  /* the bits already set there by this thread */
};

/* Sets `bits` in tflags for the tensor holding element o of the span (an offset from the
 * span's first element), looking it up in the span table unless it is seen's. */
__device__ __forceinline__ void span_note(const ampx_cu_args &a, int slot, int64_t o, unsigned bits, span_seen &seen)
{
    if (o < seen.lo || o >= seen.hi) {
        const ampx_cu_span_head *head = reinterpret_cast<const ampx_cu_span_head *>(a.src[slot]);
        const ampx_cu_span_entry *ent = reinterpret_cast<const ampx_cu_span_entry *>(head + 1);
        const int last = (int)head->search - 1;
        int l = 0, r = last; /* the last entry starting at or before o */
        while (l < r) {
            const int mid = (l + r + 1) >> 1;
            if (ent[mid].off <= o)
                l = mid;
            else
                r = mid - 1;
        }
        seen.lo = ent[l].off;
        seen.hi = l < last ? ent[l + 1].off : (int64_t)0x7fffffffffffffffll;
        seen.word = reinterpret_cast<unsigned *>(a.tflags) + ent[l].index;
        seen.bits = 0u;
    }
    if ((seen.bits & bits) != bits) {
        atomicOr(seen.word, bits);
        __threadfence(); /* before this block counts the chunk done */
        seen.bits |= bits;
    }
}

/* Notes the non-finite values among this thread's elements of a chunk of len elements at p
 * (the loop's ownership: vectors tid, tid + BLOCK, ..., and the tail for its owner). */
template <int DT>
__device__ __noinline__ void note_elements(const ampx_cu_args &a, int slot, const char *p, int64_t len)
{
    constexpr int W = 16 / dt_info<DT>::size;
    const int tid = threadIdx.x;
    const int64_t nvec = len / W;
    const int64_t base = (int64_t)(p - reinterpret_cast<const char *>(a.ptr[slot])) / dt_info<DT>::size;
    span_seen seen = {0, 0, nullptr, 0u};
    auto one = [&](int64_t e) {
        const double x = (double)sload<DT>(const_cast<char *>(p), e);
        if (isnan(x) || isinf(x))
            span_note(a, slot, base + e, isnan(x) ? AMPX_FLAG_NAN : AMPX_FLAG_INF, seen);
    };
    for (int64_t v = tid; v < nvec; v += BLOCK)
        for (int k = 0; k < W; k++)
            one(v * W + k);
    if (tid == (int)(nvec % BLOCK))
        for (int64_t e = nvec * W; e < len; e++)
            one(e);
}

/* Whether stored values are non-finite exactly where, and as, their inputs were: the
 * factor, as each dtype's multiply takes it, is normal and at most 1 in magnitude. */
__device__ __forceinline__ bool keeps_nonfinite(float fs, double fd)
{
    return fabsf(fs) >= 1.17549435e-38f && fabsf(fs) <= 1.0f && fabs(fd) >= 2.2250738585072014e-308 &&
           fabs(fd) <= 1.0;
}

/* Calls element(x) on each of the len elements of a DT chunk at p, widened to the compute
 * type, and (WR) stores what it returns in their place. Thread tid owns vectors tid,
 * tid + BLOCK, ... (U in flight) and, when it owns the next vector, the elements past the last
 * full one; a chunk that is not 16-byte aligned is read by scalar loads in the same order. */
template <int DT, bool WR, class F>
__device__ __forceinline__ void walk_chunk(char *p, int64_t len, F &element)
{
    typedef typename dt_info<DT>::compute T;
    constexpr int W = 16 / dt_info<DT>::size;
    constexpr int U = 4; /* vectors in flight per thread */
    const int tid = threadIdx.x;
    const int64_t nvec = len / W;
    if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
        int64_t v = tid;
        for (; v + (U - 1) * BLOCK < nvec; v += U * BLOCK) {
            uint4 raw[U][1];
#pragma unroll
            for (int u = 0; u < U; u++)
                raw_load(p + (v + u * BLOCK) * 16, raw[u]);
#pragma unroll
            for (int u = 0; u < U; u++) {
                T x[W];
                decode<DT, W>(raw[u], x);
#pragma unroll
                for (int k = 0; k < W; k++)
                    x[k] = element(x[k]);
                if (WR)
                    vstore<DT, W>(p + (v + u * BLOCK) * 16, x);
            }
        }
        for (; v < nvec; v += BLOCK) {
            T x[W];
            vload<DT, W>(p + v * 16, x);
#pragma unroll
            for (int k = 0; k < W; k++)
                x[k] = element(x[k]);
            if (WR)
                vstore<DT, W>(p + v * 16, x);
        }
    } else {
        for (int64_t v = tid; v < nvec; v += BLOCK) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                T y = element(sload<DT>(p, v * W + k));
                if (WR)
                    sstore<DT>(p, v * W + k, y);
            }
        }
    }
    /* the elements past the last full vector: the next vector's owner */
    if (tid == (int)(nvec % BLOCK)) {
        for (int64_t e = nvec * W; e < len; e++) {
            T y = element(sload<DT>(p, e));
            if (WR)
                sstore<DT>(p, e, y);
        }
    }
}

/* One chunk of a DT tensor: multiply (SC), store (WR), classify, reduce (RD);
 * in a span slot of `a`, non-finite inputs are noted by tensor (span_note). */
template <int DT, int RD, bool WR, bool SC>
__device__ __forceinline__ part_t scale_chunk(const ampx_cu_args &a, int slot, char *p, int64_t len, float fs,
                                              double fd)
{
    typedef typename dt_info<DT>::compute T;
    const T s = DT == AMPX_F64 ? (T)fd : (T)fs;
    accum<RD, T> st;
    /* span slots: note before writing when the stored values would not show the inputs */
    const bool noting = a.tflags != 0, before = noting && WR && !keeps_nonfinite(fs, fd);
    if (before)
        note_elements<DT>(a, slot, p, len);

    auto element = [&](T x) -> T {
        st.input(x);
        T y = x;
        if (SC) {
            if (DT == AMPX_F64)
                y = (T)__dmul_rn((double)x, (double)s);
            else
                y = (T)__fmul_rn((float)x, (float)s);
        }
        if (RD) {
            if (SC && (DT == AMPX_F16 || DT == AMPX_BF16))
                st.reduce((T)round_to<DT>((float)y)); /* the value as stored */
            else
                st.reduce(y);
        }
        return y;
    };

    walk_chunk<DT, WR>(p, len, element);
    const part_t r = st.result();
    if (noting && !before && r.flags != 0u)
        note_elements<DT>(a, slot, p, len);
    return r;
}

/* The launch's arguments and its factor: read from device memory when the caller passed a
 * tensor (so nothing waited for the host), else the number in the arguments. */
struct with_factor {
    const ampx_cu_args &a;
    float fs;
    double fd;
    __device__ __forceinline__ with_factor(const ampx_cu_args &args) : a(args)
    {
        if (a.factor_ptr != 0) {
            fs = *reinterpret_cast<const float *>(a.factor_ptr);
            fd = (double)fs;
        } else {
            fd = a.factor;
            fs = (float)a.factor;
        }
    }
};

template <int RD, bool WR, bool SC>
struct scale_body : with_factor {
    __device__ __forceinline__ scale_body(const ampx_cu_args &args) : with_factor(args) {}
    __device__ __forceinline__ part_t operator()(int slot, int64_t start, int64_t len)
    {
        const int dt = a.dtype[slot];
        char *base = reinterpret_cast<char *>(a.ptr[slot]);
        switch (dt) {
        case AMPX_F32:
            return scale_chunk<AMPX_F32, RD, WR, SC>(a, slot, base + start * AMPX_SIZE_F32, len, fs, fd);
        case AMPX_F16:
            return scale_chunk<AMPX_F16, RD, WR, SC>(a, slot, base + start * AMPX_SIZE_F16, len, fs, fd);
        case AMPX_BF16:
            return scale_chunk<AMPX_BF16, RD, WR, SC>(a, slot, base + start * AMPX_SIZE_BF16, len, fs, fd);
        default:
            return scale_chunk<AMPX_F64, RD, WR, SC>(a, slot, base + start * AMPX_SIZE_F64, len, fs, fd);
        }
    }
};

template <int RD, bool WR, bool SC>
__device__ __forceinline__ void scale_kernel(const ampx_cu_args &a)
{
    if (a.kind != AMPX_CU_SCALE || a.reduce != (uint32_t)RD)
        __trap(); /* the host picked the wrong kernel: fail loudly, never compute garbage */
    scale_body<RD, WR, SC> body(a);
    run_chunks(a, RD, body);
}

/* One kernel per row of AMPX_SCALE_MODE_LIST (ampx_numerics.h) whose `cuda`
 * column is 1: mul_/unscale_ (r0 w1 s1), check_finite (r0 w0 s0), norm (rN w0 s0),
 * norm with a factor (rN w0 s1), unscale_norm_ (rN w1 s1). */
#define AMPX_SCALE_KERNEL(label, mode, rd, wr, sc, ck, cuda)                                                \
    AMPX_IF(cuda, extern "C" __global__ void __launch_bounds__(BLOCK)                                       \
                      AMPX_CU_SCALE_KERNEL_NAME(rd, wr, sc)(const __grid_constant__ ampx_cu_args a)         \
                  { scale_kernel<rd, (bool)wr, (bool)sc>(a); })

AMPX_SCALE_MODE_LIST(AMPX_SCALE_KERNEL)

/* ---- casts ------------------------------------------------------------------ */

/* src (S) * factor -> dst (D), as the CPU's cast_body (float arithmetic) and
 * cast_body_f64 (a float64 side: double arithmetic, then one rounding to a
 * narrow type through round-to-odd). */
template <int S, int D, bool SR>
struct cast_traits {
    static constexpr bool wide = S == AMPX_F64 || D == AMPX_F64;
    /* the value is the stored bits (exact functions of ampx_numerics.h), else the
     * compute-type value that vstore/sstore convert (float16/bfloat16 by the
     * hardware's round-to-nearest-even) */
    static constexpr bool bits = (D == AMPX_F16 || D == AMPX_BF16) && (wide || SR);
    typedef typename dt_info<S>::compute in;
    typedef typename std::conditional<bits, uint16_t, typename dt_info<D>::compute>::type out;
};

template <int D>
__device__ __forceinline__ uint16_t narrow_exact(float x)
{
    return D == AMPX_F16 ? ampx_f32_to_f16(x) : ampx_f32_to_bf16(x);
}

/* The value stored for source value x; e: the element's index in its tensor (low 32 bits). */
template <int S, int D, bool SR>
__device__ __forceinline__ typename cast_traits<S, D, SR>::out cast_value(typename cast_traits<S, D, SR>::in x,
                                                                            float fs, double fd, ampx_sr_key_t key,
                                                                            uint32_t e)
{
    if constexpr (cast_traits<S, D, SR>::wide) {
        double y;
        if constexpr (S == AMPX_F64)
            y = __dmul_rn((double)x, fd);
        else
            y = (double)__fmul_rn((float)x, fs);
        if constexpr (D == AMPX_F64) {
            return y;
        } else if constexpr (D == AMPX_F32) {
            return (float)y;
        } else {
            float odd = ampx_f64_to_f32_odd(y);
            if constexpr (SR)
                return ampx_f32_to_bf16_sr(odd, ampx_sr_bits(key, e));
            else
                return narrow_exact<D>(odd);
        }
    } else {
        float y = __fmul_rn((float)x, fs);
        if constexpr (SR)
            return ampx_f32_to_bf16_sr(y, ampx_sr_bits(key, e));
        else
            return y;
    }
}

template <int S, int D, bool SR>
__device__ __forceinline__ part_t cast_chunk(const char *s, char *d, int64_t len, float fs, double fd,
                                             ampx_sr_key_t key, uint32_t e0)
{
    typedef cast_traits<S, D, SR> tr;
    typedef typename tr::in TS;
    typedef typename tr::out TD;
    constexpr int ES = dt_info<S>::size, ED = dt_info<D>::size;
    constexpr int W = 16 / (ES < ED ? ES : ED);
    constexpr int NBMAX = W * (ES > ED ? ES : ED) / 16;
    constexpr int U = NBMAX >= 4 ? 1 : 4 / NBMAX; /* 16-byte accesses in flight: about 4 per thread */
    const int tid = threadIdx.x;
    const int64_t nvec = len / W;
    bool hn = false, hi = false;

    auto scalar = [&](int64_t e) {
        TS x = sload<S>(s, e);
        hn |= isnan(x);
        hi |= isinf(x);
        TD y = cast_value<S, D, SR>(x, fs, fd, key, e0 + (uint32_t)e);
        if constexpr (tr::bits)
            reinterpret_cast<uint16_t *>(d)[e] = y;
        else
            sstore<D>(d, e, y);
    };

    if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & 15u) == 0) {
        constexpr int NBS = W * ES / 16;
        for (int64_t v = tid; v < nvec; v += (int64_t)U * BLOCK) {
            uint4 raw[U][NBS];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (v + u * BLOCK < nvec)
                    raw_load(s + (v + u * BLOCK) * (W * ES), raw[u]);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t vu = v + u * BLOCK;
                if (vu < nvec) {
                    TS x[W];
                    decode<S, W>(raw[u], x);
                    TD y[W];
#pragma unroll
                    for (int k = 0; k < W; k++) {
                        hn |= isnan(x[k]);
                        hi |= isinf(x[k]);
                        y[k] = cast_value<S, D, SR>(x[k], fs, fd, key, e0 + (uint32_t)(vu * W + k));
                    }
                    char *q = d + vu * (W * ED);
                    if constexpr (tr::bits) {
                        static_assert(W == 8, "16-bit destination vectors hold 8 elements");
                        uint4 o;
                        o.x = (uint32_t)y[0] | ((uint32_t)y[1] << 16);
                        o.y = (uint32_t)y[2] | ((uint32_t)y[3] << 16);
                        o.z = (uint32_t)y[4] | ((uint32_t)y[5] << 16);
                        o.w = (uint32_t)y[6] | ((uint32_t)y[7] << 16);
                        *reinterpret_cast<uint4 *>(q) = o;
                    } else {
                        vstore<D, W>(q, y);
                    }
                }
            }
        }
    } else {
        for (int64_t v = tid; v < nvec; v += BLOCK)
#pragma unroll
            for (int k = 0; k < W; k++)
                scalar(v * W + k);
    }
    if (tid == (int)(nvec % BLOCK))
        for (int64_t e = nvec * W; e < len; e++)
            scalar(e);
    part_t r;
    r.acc = 0.0;
    r.flags = (hn ? AMPX_FLAG_NAN : 0u) | (hi ? AMPX_FLAG_INF : 0u);
    return r;
}

struct cast_body : with_factor {
    uint64_t seed, offset; /* stochastic rounding's key: from the device when a.rng is set */

    __device__ __forceinline__ cast_body(const ampx_cu_args &args) : with_factor(args)
    {
        const uint64_t *rng = reinterpret_cast<const uint64_t *>(a.rng);
        seed = rng != nullptr && a.stochastic ? rng[0] : a.seed;
        offset = rng != nullptr && a.stochastic ? rng[1] : a.offset;
    }

    template <int S, int D, bool SR>
    __device__ __forceinline__ part_t go(int slot, int64_t start, int64_t len)
    {
        ampx_sr_key_t key = {0u, 0u};
        if (SR)
            key = ampx_sr_key(seed, offset, a.index[slot], (uint32_t)((uint64_t)start >> 32));
        const char *s = reinterpret_cast<const char *>(a.src[slot]) + start * dt_info<S>::size;
        char *d = reinterpret_cast<char *>(a.ptr[slot]) + start * dt_info<D>::size;
        return cast_chunk<S, D, SR>(s, d, len, fs, fd, key, (uint32_t)start);
    }

    template <int S>
    __device__ __forceinline__ part_t row(int dd, int slot, int64_t start, int64_t len)
    {
        switch (dd) {
        case AMPX_F32:
            return go<S, AMPX_F32, false>(slot, start, len);
        case AMPX_F16:
            return go<S, AMPX_F16, false>(slot, start, len);
        case AMPX_BF16:
            if (a.stochastic)
                return go<S, AMPX_BF16, true>(slot, start, len);
            return go<S, AMPX_BF16, false>(slot, start, len);
        default:
            return go<S, AMPX_F64, false>(slot, start, len);
        }
    }

    __device__ __forceinline__ part_t operator()(int slot, int64_t start, int64_t len)
    {
        const int dd = a.dtype[slot];
        switch (a.src_dtype[slot]) {
        case AMPX_F32:
            return row<AMPX_F32>(dd, slot, start, len);
        case AMPX_F16:
            return row<AMPX_F16>(dd, slot, start, len);
        case AMPX_BF16:
            return row<AMPX_BF16>(dd, slot, start, len);
        default:
            return row<AMPX_F64>(dd, slot, start, len);
        }
    }
};

/* At least CAST_MIN_BLOCKS blocks per multiprocessor: caps the cast (one kernel over all 20
 * dtype pairs, sized by its widest branch) at 80 registers, from 96-100 without the bound
 * (sm_80 to sm_100), without spills (ptxas -v on every target; 4 blocks spill 450+ bytes).
 * 768 resident threads with 4 vectors in flight each keep about 48 KB per multiprocessor in
 * flight, above what HBM3 needs to reach its bandwidth. */
#define CAST_MIN_BLOCKS 3
extern "C" __global__ void __launch_bounds__(BLOCK, CAST_MIN_BLOCKS)
    ampx_k_cast(const __grid_constant__ ampx_cu_args a)
{
    if (a.kind != AMPX_CU_CAST || a.reduce != AMPX_REDUCE_NONE)
        __trap();
    cast_body body(a);
    run_chunks(a, AMPX_REDUCE_NONE, body);
}

/* ---- tensor_stats -------------------------------------------------------------- */

/* One row per tensor in ampx/stats.py's layout (AMPX_STATS_* of ampx_numerics.h), from one
 * read. A block counts its chunk into shared memory (a histogram bucket per finite non-zero
 * value by shared atomics; the specials, the largest and the smallest magnitude per thread,
 * then once per warp). A one-chunk tensor's block then writes the tensor's row itself; the
 * chunks of a longer tensor add their counts into its accumulator row (cuda_args.h) with
 * global atomics, and the block that counts the last of them writes the row. Counts, a max
 * and a min: the rows do not depend on the order in which blocks run. float16 and bfloat16
 * are counted as the float32 they widen to exactly; float64 by its own exponent, clamped to
 * the end buckets. */

/* The magnitudes compared as bits (monotonic for non-negative floats): float32's bits for the
 * float32-valued types, float64's for float64. */
template <int DT> struct stats_key { typedef uint32_t type; };
template <> struct stats_key<AMPX_F64> { typedef unsigned long long type; };

struct stats_smem {
    unsigned hist[AMPX_STATS_BUCKETS];
    unsigned special[4]; /* +inf, -inf, NaN, zero: the row's order from AMPX_STATS_POSINF */
    unsigned long long amax, amin; /* float64 bits of the chunk's largest / smallest |x|; amin ~0: none */
    int last;
};

static_assert(AMPX_STATS_NEGINF == AMPX_STATS_POSINF + 1 && AMPX_STATS_NAN == AMPX_STATS_POSINF + 2 &&
                  AMPX_STATS_ZERO == AMPX_STATS_POSINF + 3,
              "stats_smem.special follows the row's columns");

/* The bucket of a finite non-zero float32 magnitude u (bits): floor(log2) + 1 - EXP_MIN, a
 * subnormal's from its leading bit. */
__device__ __forceinline__ int stats_bucket32(uint32_t u)
{
    static_assert(AMPX_STATS_EXP_MIN == -149 && AMPX_STATS_EXP_MAX == 127, "float32's exponents");
    return u >= 0x00800000u ? (int)(u >> 23) + 23 : 32 - __clz((int)u);
}

/* The bucket of a finite non-zero float64 magnitude u (bits), clamped to the end buckets. */
__device__ __forceinline__ int stats_bucket64(unsigned long long u)
{
    const int be = (int)(u >> 52);
    const int e = be != 0 ? be - 1023 : (63 - __clzll((long long)u)) - 1074;
    if (e < AMPX_STATS_EXP_MIN)
        return 0;
    if (e > AMPX_STATS_EXP_MAX)
        return AMPX_STATS_BUCKETS - 1;
    return 1 + e - AMPX_STATS_EXP_MIN;
}

/* One thread's share of a chunk. */
template <int DT>
struct stats_thread {
    typedef typename stats_key<DT>::type K;
    K mx, mn;         /* largest / smallest finite non-zero magnitude (bits); mn all ones: none */
    unsigned pinf, ninf, nan, zero;
    unsigned *hist; /* the block's histogram */

    __device__ __forceinline__ stats_thread(unsigned *h)
        : mx(0), mn((K)~(K)0), pinf(0u), ninf(0u), nan(0u), zero(0u), hist(h)
    {
    }

    /* One element, as its float32 (or float64) value x. */
    template <typename T>
    __device__ __forceinline__ void add(T x)
    {
        K b, u, inf;
        if (DT == AMPX_F64) {
            b = (K)__double_as_longlong((double)x);
            u = b & (K)0x7fffffffffffffffull;
            inf = (K)0x7ff0000000000000ull;
        } else {
            b = (K)__float_as_uint((float)x);
            u = b & (K)0x7fffffffu;
            inf = (K)0x7f800000u;
        }
        if (u == 0) {
            zero++;
        } else if (u > inf) {
            nan++;
        } else if (u == inf) {
            ninf += b != u;
            pinf += b == u;
        } else {
            const int k = DT == AMPX_F64 ? stats_bucket64((unsigned long long)u) : stats_bucket32((uint32_t)u);
            atomicAdd(&hist[k], 1u);
            mx = u > mx ? u : mx;
            mn = u < mn ? u : mn;
        }
    }

    /* mx / mn as float64 bits (mn: ~0 for none). */
    __device__ __forceinline__ unsigned long long max_bits() const
    {
        if (DT == AMPX_F64)
            return (unsigned long long)mx;
        return (unsigned long long)__double_as_longlong((double)__uint_as_float((uint32_t)mx));
    }
    __device__ __forceinline__ unsigned long long min_bits() const
    {
        if (mn == (K)~(K)0)
            return ~0ull;
        if (DT == AMPX_F64)
            return (unsigned long long)mn;
        return (unsigned long long)__double_as_longlong((double)__uint_as_float((uint32_t)mn));
    }
};

/* Counts the len elements of a DT chunk at p into the thread's st (walk_chunk's ownership). */
template <int DT>
__device__ __forceinline__ void stats_chunk(const char *p, int64_t len, stats_thread<DT> &st)
{
    typedef typename dt_info<DT>::compute T;
    auto element = [&](T x) -> T {
        st.add(x);
        return x;
    };
    walk_chunk<DT, false>(const_cast<char *>(p), len, element);
}

__device__ __forceinline__ unsigned long long u64_max(unsigned long long a, unsigned long long b)
{
    return a > b ? a : b;
}
__device__ __forceinline__ unsigned long long u64_min(unsigned long long a, unsigned long long b)
{
    return a < b ? a : b;
}

/* Adds the thread's specials, max and min into the block's sm (once per warp). */
template <int DT>
__device__ __forceinline__ void stats_block_add(const stats_thread<DT> &st, stats_smem &sm)
{
    unsigned long long mx = st.max_bits(), mn = st.min_bits();
    unsigned sp[4] = {st.pinf, st.ninf, st.nan, st.zero}; /* the order of stats_smem.special */
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mx = u64_max(mx, __shfl_xor_sync(FULL_MASK, mx, o));
        mn = u64_min(mn, __shfl_xor_sync(FULL_MASK, mn, o));
#pragma unroll
        for (int k = 0; k < 4; k++)
            sp[k] += __shfl_xor_sync(FULL_MASK, sp[k], o);
    }
    if ((threadIdx.x & 31) == 0) {
        if (mx != 0ull)
            atomicMax(&sm.amax, mx);
        if (mn != ~0ull)
            atomicMin(&sm.amin, mn);
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (sp[k] != 0u)
                atomicAdd(&sm.special[k], sp[k]);
    }
}

/* Counts chunk ck of a DT tensor into the block's sm (zeroed). */
template <int DT>
__device__ __forceinline__ void stats_count(const ampx_cu_args &a, const chunk_t &ck, stats_smem &sm)
{
    stats_thread<DT> st(sm.hist);
    stats_chunk<DT>(reinterpret_cast<const char *>(a.ptr[ck.slot]) + ck.start * dt_info<DT>::size, ck.len, st);
    stats_block_add(st, sm);
}

/* Column k of the finished row of a one-chunk tensor of numel elements, from sm. */
__device__ __forceinline__ double stats_column(const stats_smem &sm, int k, int64_t numel)
{
    if (k == AMPX_STATS_AMAX)
        return __longlong_as_double((long long)sm.amax);
    if (k == AMPX_STATS_AMIN)
        return sm.amin == ~0ull ? __longlong_as_double(0x7ff0000000000000ll) : __longlong_as_double((long long)sm.amin);
    if (k == AMPX_STATS_NUMEL)
        return (double)numel;
    if (k < AMPX_STATS_HIST)
        return (double)sm.special[k - AMPX_STATS_POSINF];
    return (double)sm.hist[k - AMPX_STATS_HIST];
}

/* Column k of the finished row of a several-chunk tensor, from its accumulator row acc. */
__device__ __forceinline__ double stats_acc_column(const unsigned long long *acc, int k, int64_t numel)
{
    const unsigned long long v = __ldcg(&acc[k]);
    if (k == AMPX_STATS_AMAX)
        return __longlong_as_double((long long)v);
    if (k == AMPX_STATS_AMIN)
        return v == 0ull ? __longlong_as_double(0x7ff0000000000000ll) : __longlong_as_double((long long)~v);
    if (k == AMPX_STATS_NUMEL)
        return (double)numel;
    return (double)v;
}

/* Publishes the block's counts of chunk ck (in sm) as the header of this section says. */
__device__ __forceinline__ void stats_publish(const ampx_cu_args &a, const chunk_t &ck, stats_smem &sm)
{
    const int tid = threadIdx.x;
    const int64_t numel = a.numel[ck.slot];
    double *row = reinterpret_cast<double *>(a.per_out) + (int64_t)a.index[ck.slot] * AMPX_STATS_WIDTH;
    unsigned long long *acc = reinterpret_cast<unsigned long long *>(a.src[ck.slot]);
    if (acc == nullptr) { /* the tensor's only chunk */
        for (int k = tid; k < AMPX_STATS_WIDTH; k += BLOCK)
            row[k] = stats_column(sm, k, numel);
        return;
    }
    for (int k = tid; k < AMPX_STATS_BUCKETS; k += BLOCK)
        if (sm.hist[k] != 0u)
            atomicAdd(&acc[AMPX_STATS_HIST + k], (unsigned long long)sm.hist[k]);
    if (tid < 4 && sm.special[tid] != 0u)
        atomicAdd(&acc[AMPX_STATS_POSINF + tid], (unsigned long long)sm.special[tid]);
    if (tid == 0 && sm.amax != 0ull)
        atomicMax(&acc[AMPX_STATS_AMAX], sm.amax);
    if (tid == 0 && sm.amin != ~0ull)
        atomicMax(&acc[AMPX_STATS_AMIN], ~sm.amin);
    __threadfence(); /* every thread's adds, before the chunk is counted */
    __syncthreads();
    if (tid == 0)
        sm.last = atomicAdd(&acc[AMPX_STATS_NUMEL], 1ull) == (unsigned long long)ck.nch - 1ull;
    __syncthreads();
    if (sm.last) {
        __threadfence();
        for (int k = tid; k < AMPX_STATS_WIDTH; k += BLOCK)
            row[k] = stats_acc_column(acc, k, numel);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) ampx_k_tensor_stats(const __grid_constant__ ampx_cu_args a)
{
    if (a.kind != AMPX_CU_STATS || a.per_out == 0)
        __trap();
    __shared__ stats_smem sm;
    const int tid = threadIdx.x;
    for (uint32_t c = blockIdx.x; c < a.nchunks; c += gridDim.x) {
        const chunk_t ck = chunk_at(a, c);
        __syncthreads(); /* the previous chunk's sm is read */
        for (int k = tid; k < AMPX_STATS_BUCKETS; k += BLOCK)
            sm.hist[k] = 0u;
        if (tid < 4)
            sm.special[tid] = 0u;
        if (tid == 0) {
            sm.amax = 0ull;
            sm.amin = ~0ull;
        }
        __syncthreads();
        switch (a.dtype[ck.slot]) {
        case AMPX_F32:
            stats_count<AMPX_F32>(a, ck, sm);
            break;
        case AMPX_F16:
            stats_count<AMPX_F16>(a, ck, sm);
            break;
        case AMPX_BF16:
            stats_count<AMPX_BF16>(a, ck, sm);
            break;
        default:
            stats_count<AMPX_F64>(a, ck, sm);
        }
        __syncthreads();
        stats_publish(a, ck, sm);
    }
}

/* ---- the availability probe ----------------------------------------------------- */

/* Does nothing: ampx.cuda.is_available() launches it once per device and waits, so a device
 * counts as available only once code from this fatbin has run on it. */
extern "C" __global__ void ampx_k_probe() {}

/* ---- the loss-scale update ----------------------------------------------------- */

extern "C" __global__ void ampx_k_update_scale(const ampx_cu_update_args a)
{
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    int ev = ampx_update_scale(reinterpret_cast<float *>(a.scale), reinterpret_cast<int32_t *>(a.growth_tracker),
                               reinterpret_cast<int32_t *>(a.hysteresis),
                               *reinterpret_cast<const float *>(a.found_inf), a.growth_factor, a.backoff_factor,
                               a.growth_interval, a.hysteresis_max, a.consecutive, a.min_scale, a.max_scale);
    if (a.events != 0)
        *reinterpret_cast<int32_t *>(a.events) = ev;
}
