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

typedef struct {
    const char *name;
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
