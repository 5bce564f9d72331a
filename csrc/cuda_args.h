/*
 * cuda_args.h: the kernel arguments of ampx's CUDA kernels, shared by the C
 * host code (csrc/cuda_launch.c) and nvcc (cuda/ampx_kernels.cu).
 *
 * Every launch receives one of these structs by value (a __grid_constant__
 * kernel parameter, at most 4 KB): the tensors' device pointers, sizes, dtype
 * codes and chunk table travel inside the launch itself, so nothing is copied
 * from the host to the device, nothing waits for the host, and a launch can be
 * captured into a CUDA graph as it is. Lists longer than AMPX_CU_MAX_TENSORS
 * take several launches (a tensor never spans two).
 *
 * Only fixed-width types and explicit padding: C and nvcc must agree on the
 * layout byte for byte (both files assert the size).
 */
#ifndef AMPX_CUDA_ARGS_H
#define AMPX_CUDA_ARGS_H

#include <stdint.h>

/* Elements per chunk: the unit of work of one thread block and of one
 * partial result. The same as the CPU's AMPX_CHUNK (a power of two dividing
 * 2^32, which the stochastic-rounding key relies on). */
#define AMPX_CU_CHUNK_LOG2 16
#define AMPX_CU_CHUNK ((int64_t)1 << AMPX_CU_CHUNK_LOG2)
/* Threads per block of the data kernels (the CPU emulation of the tests may
 * build with fewer; a multiple of 32 up to 1024). */
#ifndef AMPX_CU_BLOCK
#define AMPX_CU_BLOCK 256
#endif
/* Tensors per launch: as many as fit in a 4 KB parameter block. */
#define AMPX_CU_MAX_TENSORS 112
/* Grid size cap; blocks loop over the chunks beyond it. */
#define AMPX_CU_MAX_GRID 1048576u

/* What each chunk leaves in the workspace when its tensor has several chunks. */
typedef struct {
    double acc;     /* sum of squares, sum of magnitudes, or max magnitude (NaN if a NaN was reduced) */
    uint32_t flags; /* AMPX_FLAG_* of the chunk's inputs */
    uint32_t pad;
} ampx_cu_partial;

/* Kernel `kind` values of the data kernel arguments. */
#define AMPX_CU_SCALE 0
#define AMPX_CU_CAST 1
#define AMPX_CU_STATS 2 /* tensor_stats: rows at per_out; src[] each slot's accumulator row, or 0 */

typedef struct {
    /* ---- outputs and scalars (device pointers, 0 for none) ---- */
    uint64_t found_inf;  /* float: set to 1.0 when any input is inf/NaN */
    uint64_t factor_ptr; /* const float: the multiplier, read on the device; else `factor` */
    uint64_t flags_out;  /* uint8[ntotal]: per-tensor flags */
    uint64_t per_out;    /* float[ntotal]: per-tensor reductions; stats: double[ntotal][AMPX_STATS_WIDTH] */
    uint64_t total_out;  /* float: the total reduction */
    /* ---- workspace (0 when no per-tensor result is wanted) ---- */
    uint64_t tcount;     /* uint32[ntotal]: chunks finished per tensor (zeroed before the first launch) */
    uint64_t done;       /* uint32: tensors finished (zeroed with tcount) */
    uint64_t partials;   /* ampx_cu_partial[all chunks of the call] */
    uint64_t pt;         /* double[ntotal]: per-tensor reductions before the final sqrt */
    uint64_t tflags;     /* uint32[]: flags of the tensors inside span slots, by list index (zeroed
                          * with tcount), or 0; when set, every slot's src[] is its span table */
    double factor;       /* used when factor_ptr is 0 */
    uint64_t seed, offset; /* stochastic rounding */
    uint64_t rng;        /* casts: const uint64[2] {seed, offset} read on the device; else seed, offset */
    uint32_t kind;       /* AMPX_CU_SCALE / AMPX_CU_CAST (checked by the kernel) */
    uint32_t reduce;     /* AMPX_REDUCE_* */
    uint32_t check;      /* publish flags / found_inf */
    uint32_t stochastic; /* casts: stochastic rounding to bfloat16 */
    uint32_t ntotal;     /* tensors in the whole call */
    uint32_t chunk_base; /* call-wide index of this launch's first chunk */
    uint32_t nchunks;    /* chunks in this launch */
    uint32_t ntensors;   /* tensor slots used in this launch */
    /* ---- the tensors of this launch ---- */
    uint64_t ptr[AMPX_CU_MAX_TENSORS];   /* data (casts: the destination) */
    uint64_t src[AMPX_CU_MAX_TENSORS];   /* casts: the source; scale kernels with tflags: the span table;
                                          * stats: the tensor's accumulator row (0: a one-chunk tensor) */
    int64_t numel[AMPX_CU_MAX_TENSORS];
    uint32_t first[AMPX_CU_MAX_TENSORS + 1]; /* slot s owns launch chunks [first[s], first[s+1]) */
    uint32_t index[AMPX_CU_MAX_TENSORS];     /* position in the caller's list */
    uint8_t dtype[AMPX_CU_MAX_TENSORS];      /* AMPX_F32... of ptr */
    uint8_t src_dtype[AMPX_CU_MAX_TENSORS];  /* casts: of src */
} ampx_cu_args;

/* The size both compilers must agree on: a 144-byte header, 34 bytes per
 * tensor slot and the last `first` entry, rounded up to 8; under the 4 KB
 * parameter limit of every CUDA driver. */
#define AMPX_CU_ARGS_SIZE (((144 + AMPX_CU_MAX_TENSORS * 34 + 4) + 7) / 8 * 8)

/* A span table: which tensors of the caller's list a span slot (a run of back-to-back
 * tensors streamed as one) covers, so that per-tensor flags survive coalescing. In device
 * memory, 16-byte aligned: the head, then `all` entries: the `search` non-empty tensors in
 * ascending offset (they tile the span: entry k covers [off[k], off[k+1]) and the last runs
 * to the span's end), then the empty ones (in no order; their flags are 0). */
typedef struct {
    uint32_t search; /* non-empty tensors */
    uint32_t all;    /* all tensors of the span */
    uint32_t pad[2];
} ampx_cu_span_head;

typedef struct {
    int64_t off;    /* first element, counted from the span's first */
    uint32_t index; /* position in the caller's list */
    uint32_t pad;
} ampx_cu_span_entry;

/* tensor_stats' accumulator row: one per tensor of more than one chunk, in the workspace
 * (zeroed before the first launch), AMPX_STATS_WIDTH uint64 words at the row's columns:
 * AMAX the largest |x|'s float64 bits, AMIN the complement of the smallest's (0: none yet),
 * NUMEL the tensor's chunks counted so far, the rest counts. Each chunk adds its counts in;
 * the block that counts the tensor's last chunk turns the row into the float64 output row. */
#define AMPX_CU_STATS_ROW_BYTES ((int64_t)8 * AMPX_STATS_WIDTH)

/* The loss-scale update: one thread. */
typedef struct {
    uint64_t scale;          /* float */
    uint64_t growth_tracker; /* int32 */
    uint64_t hysteresis;     /* int32, or 0 */
    uint64_t found_inf;      /* float */
    uint64_t events;         /* int32, or 0: AMPX_UPD_* of this update */
    double growth_factor, backoff_factor;
    int64_t growth_interval;
    int32_t hysteresis_max;
    int32_t consecutive;
    float min_scale, max_scale;
} ampx_cu_update_args;

#endif /* AMPX_CUDA_ARGS_H */
