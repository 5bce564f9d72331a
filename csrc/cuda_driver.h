/*
 * cuda_driver.h: ampx's CUDA host layer, written against the CUDA *driver* API
 * opened at run time with dlopen("libcuda.so.1"). Nothing here links against
 * libcuda or libcudart and no CUDA header is needed to build it, so one build
 * of ampx imports (and runs on the CPU) on machines without a GPU or driver.
 *
 * The driver's types are re-declared below under ampx names, with the few
 * enum values ampx uses; cuda/ampx_kernels.cu (compiled by nvcc, which has
 * cuda.h) asserts that every one of them equals the driver header's.
 *
 * Pure C, no Python: csrc/module.c turns the errors into exceptions.
 */
#ifndef AMPX_CUDA_DRIVER_H
#define AMPX_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#include "ampx_numerics.h"
#include "cuda_args.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int ampx_cu_result;                     /* CUresult */
typedef int ampx_cu_device;                     /* CUdevice */
typedef struct ampx_cu_ctx_st *ampx_cu_context; /* CUcontext */
typedef struct ampx_cu_mod_st *ampx_cu_module;  /* CUmodule */
typedef struct ampx_cu_fn_st *ampx_cu_function; /* CUfunction */
typedef struct ampx_cu_stream_st *ampx_cu_stream; /* CUstream */
typedef uint64_t ampx_cu_deviceptr;             /* CUdeviceptr (same size and passing) */

/* Driver constants ampx uses (checked against cuda.h by the kernel build). */
#define AMPX_CUDA_SUCCESS 0
#define AMPX_CUDA_ERROR_NO_BINARY_FOR_GPU 209
#define AMPX_CU_ATTR_MULTIPROCESSOR_COUNT 16
#define AMPX_CU_ATTR_CC_MAJOR 75
#define AMPX_CU_ATTR_CC_MINOR 76

/* What went wrong in a driver call: the call, the error code and its name
 * (cuGetErrorName) and description (cuGetErrorString), or a message of ampx's
 * own when code is AMPX_CU_E_AMPX. */
#define AMPX_CU_E_AMPX (-1)
typedef struct {
    int code;
    char msg[400];
} ampx_cu_error;

/* The scale kernels' names in the fatbin: one for each row of
 * AMPX_SCALE_MODE_LIST (ampx_numerics.h) whose `cuda` column is 1. */
#define AMPX_CU_SCALE_KERNEL_NAME(rd, wr, sc) ampx_k_scale_r##rd##_w##wr##_s##sc
#define AMPX_CU_STR_(x) #x
#define AMPX_CU_STR(x) AMPX_CU_STR_(x)

/* The kernels of one device, loaded from the fatbin into its primary context. */
typedef struct {
    int loaded;
    int ordinal;
    ampx_cu_device dev;
    ampx_cu_context ctx; /* the device's primary context (retained for the process's life) */
    ampx_cu_module mod;
    ampx_cu_function scale[AMPX_NUM_REDUCE][2][2]; /* [reduce][write][scale]; NULL where no mode uses it */
    ampx_cu_function cast;
    ampx_cu_function update;
    int sm_count;
    int cc_major, cc_minor;
} ampx_cu_dev;

/* Hands the fatbin image to the layer (copied). Returns 0, or -1 out of memory. */
int ampx_cu_set_image(const void *data, size_t size);
int ampx_cu_have_image(void);

/* Loads libcuda and runs cuInit once. Returns 0, or -1 with a reason in err. */
int ampx_cu_driver(ampx_cu_error *err);

/* Whether device `ordinal` can run ampx's kernels, without creating a
 * context: the driver loads and initialises, the device exists, its compute
 * capability is 8.0 or newer; and, when the device's primary context is
 * already active (torch has used the device), the kernels load into it.
 * Returns 0, or -1 with the reason in err. */
int ampx_cu_probe(int ordinal, ampx_cu_error *err);

/* The loaded device `ordinal` (loading its kernels on first use). */
ampx_cu_dev *ampx_cu_device_get(int ordinal, ampx_cu_error *err);

/* The driver's version (e.g. 13000), or 0 when it is not loaded. */
int ampx_cu_driver_version(void);

/* Makes dev's context current on this thread / restores the previous one. */
int ampx_cu_push(const ampx_cu_dev *dev, ampx_cu_error *err);
int ampx_cu_pop(ampx_cu_error *err);

int ampx_cu_launch(ampx_cu_function f, unsigned grid, unsigned block, ampx_cu_stream stream, void *args,
                   const char *what, ampx_cu_error *err);
int ampx_cu_memset32(ampx_cu_deviceptr p, unsigned value, size_t count, ampx_cu_stream stream,
                     ampx_cu_error *err);

/* ---- the multi-tensor launcher (cuda_launch.c), written once for every op ---- */

/* One tensor as the launcher sees it: contiguous device memory. */
typedef struct {
    ampx_cu_deviceptr ptr; /* data; casts: the destination */
    ampx_cu_deviceptr src; /* casts: the source */
    int64_t numel;
    int dtype, src_dtype;
    uint32_t index; /* position in the caller's list */
} ampx_cu_tensor;

typedef struct {
    int kind;               /* AMPX_CU_SCALE or AMPX_CU_CAST */
    int reduce, write, scale; /* scale kernel: AMPX_REDUCE_*, store, multiply */
    int stochastic;
    uint64_t seed, offset;
    double factor;
    ampx_cu_deviceptr factor_ptr, found_inf, flags_out, per_out, total_out;
} ampx_cu_job;

/* The launcher's state across one call: launches fill one parameter block
 * with up to AMPX_CU_MAX_TENSORS tensors each, in list order. */
typedef struct {
    const ampx_cu_dev *dev;
    ampx_cu_stream stream;
    ampx_cu_function fn;
    int with_ws;
    uint32_t chunk_next; /* call-wide index of the next chunk */
    ampx_cu_args args;
} ampx_cu_launcher;

/* Workspace bytes a job needs for these tensors (0: none), and its chunk
 * count (for ampx_cu_begin). -1 when the chunks do not fit the launcher's
 * 32-bit chunk indices. */
int64_t ampx_cu_workspace_bytes(const ampx_cu_job *job, const ampx_cu_tensor *ts, int64_t n, int64_t *chunks);

/* Starts a call over n tensors of `chunks` chunks (the workspace_bytes
 * count), zeroing the workspace counters at ws (16-byte aligned device memory
 * of workspace_bytes bytes, or 0 when that is 0). Pushes and pops dev's
 * context around its driver calls, as add and flush do: the caller may run
 * torch code between them. */
int ampx_cu_begin(ampx_cu_launcher *L, const ampx_cu_dev *dev, ampx_cu_stream stream, const ampx_cu_job *job,
                  int64_t n, int64_t chunks, ampx_cu_deviceptr ws, ampx_cu_error *err);
/* Queues one tensor (the next in list order); launches when the block is full. */
int ampx_cu_add(ampx_cu_launcher *L, const ampx_cu_tensor *t, ampx_cu_error *err);
/* Launches what is queued. */
int ampx_cu_flush(ampx_cu_launcher *L, ampx_cu_error *err);

/* The loss-scale update kernel (one thread). */
int ampx_cu_update(const ampx_cu_dev *dev, ampx_cu_stream stream, const ampx_cu_update_args *a,
                   ampx_cu_error *err);

#ifdef __cplusplus
}
#endif

#endif /* AMPX_CUDA_DRIVER_H */
