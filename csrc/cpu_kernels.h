/*
 * cpu_kernels.h: the contract between the multi-tensor launcher and the CPU
 * kernels. Each SIMD level (AVX-512, AVX2, portable C) compiles the same
 * body (cpu_kernels_body.h) into one table of these functions; the launcher
 * picks a table at run time.
 *
 * A kernel works on one contiguous run of elements (a chunk) and never
 * allocates, blocks or touches Python.
 */
#ifndef AMPX_CPU_KERNELS_H
#define AMPX_CPU_KERNELS_H

#include <stdint.h>

#include "ampx_numerics.h"

/* The scale kernel's modes (AMPX_M_* bits, AMPX_SCALE_MODE_LIST) are in
 * ampx_numerics.h, shared with the CUDA kernels. */

/* What one chunk contributes: its reduction (in double) and its flags. For
 * MAXABS a chunk whose reduced values (the products) hold a NaN reports NaN. */
typedef struct {
    double acc;
    unsigned flags;
} ampx_partial;

/* Scale and/or reduce n elements at ptr (dtype fixed by the table slot).
 * With AMPX_M_SCALE the products are formed in the tensor's compute type
 * (float32 with the factor rounded to float32, or float64 with the factor
 * as given for float64 tensors) and, for float16 / bfloat16, rounded to the
 * storage type before they are stored or reduced. */
typedef void (*ampx_scale_fn)(void *ptr, int64_t n, double factor, ampx_partial *out);

/* Convert n elements from src to dst, multiplying by factor first; returns
 * the flags of the source values. Stochastic slots use key and e0 (the low
 * 32 bits of the index of the chunk's first element in its tensor). */
typedef unsigned (*ampx_cast_fn)(const void *src, void *dst, int64_t n, double factor,
                                 ampx_sr_key_t key, uint32_t e0);

/* tensor_stats' counts over runs of float32, float16 or bfloat16 values, each
 * taken as the float32 it converts to exactly, by the bits of |x|:
 *   ex[t][k]  values whose biased float32 exponent byte is k (k = 0: zeros and
 *             subnormals; 255: inf and NaN), lanes spread over four tables t
 *             (a run of equal exponents then does not wait on one counter);
 *   sub[k]    subnormals by 32 - clz(mantissa) (1..23: exponents -149..-127);
 *   nsub, posinf, neginf, nan: their counts;
 *   amax      the largest |x| bits over the finite values (0: none);
 *   amin1     the smallest |x| bits - 1 over the finite non-zero values
 *             (0xffffffff: none).
 * A kernel adds one run into *s; the caller starts from ampx_stats32_init's
 * state, reads it out (and re-initialises it) before 2^31 elements, and may
 * then rely on every ex[t][k] outside k = 0, 255 and the exponents of amax and
 * amin1 + 1 being zero (stats_flush in tensor_stats.c). */
#define AMPX_STATS_TABLES 16
typedef struct {
    uint32_t ex[AMPX_STATS_TABLES][256];
    uint32_t sub[24];
    uint32_t nsub, posinf, neginf, nan;
    uint32_t amax, amin1;
    uint32_t tables;       /* how many of the tables hold counts (the rest are zero) */
} ampx_stats32;
typedef void (*ampx_stats_fn)(const void *ptr, int64_t n, ampx_stats32 *s);

typedef struct {
    const char *name;
    ampx_stats_fn stats[AMPX_NUM_DTYPES]; /* float32, float16, bfloat16 (float64: tensor_stats.c) */
    ampx_scale_fn scale[AMPX_NUM_DTYPES][AMPX_NUM_MODES];
    ampx_cast_fn cast[AMPX_NUM_DTYPES][AMPX_NUM_DTYPES][2]; /* [src][dst][stochastic] */
} ampx_cpu_kernels;

extern const ampx_cpu_kernels ampx_kernels_portable;
#if defined(__x86_64__) || defined(_M_X64)
#define AMPX_HAVE_X86_KERNELS 1
extern const ampx_cpu_kernels ampx_kernels_avx2;
extern const ampx_cpu_kernels ampx_kernels_avx512;
#endif

#endif /* AMPX_CPU_KERNELS_H */
