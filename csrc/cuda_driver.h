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
#define AMPX_CUDA_ERROR_NOT_INITIALIZED 3
#define AMPX_CUDA_ERROR_NO_BINARY_FOR_GPU 209
#define AMPX_CU_STREAM_NON_BLOCKING 1
#define AMPX_CU_STREAM_CAPTURE_STATUS_NONE 0

/* A kernel fault (often not ampx's: a torch index out of range, a freed tensor) poisons the
 * context, and the next driver call of anyone reports it. */
#define AMPX_CU_STICKY_FIX                                                                                 \
    "a kernel faulted on this device (an earlier one, possibly not ampx's: errors are reported by "       \
    "the next CUDA call) and the CUDA context cannot be used any more: restart the process, and rerun "   \
    "with CUDA_LAUNCH_BLOCKING=1 to see which kernel it was"

/* The driver errors a user can cause or fix, each with what to do about it (code, cuda.h
 * name, fix). The kernel build asserts every code against cuda.h. Errors that need more
 * context (the fatbin's toolkit against the driver's, a fork) get more in cuda_driver.c. */
#define AMPX_CU_ERROR_HINTS(X)                                                                             \
    X(2, CUDA_ERROR_OUT_OF_MEMORY,                                                                         \
      "free GPU memory (drop tensors, torch.cuda.empty_cache()), use a smaller batch, or check "           \
      "nvidia-smi for other processes on the device")                                                     \
    X(3, CUDA_ERROR_NOT_INITIALIZED,                                                                       \
      "the driver could not start; if this process was forked from one that had used CUDA, start it "      \
      "with the 'spawn' method instead (multiprocessing.set_start_method('spawn'))")                      \
    X(34, CUDA_ERROR_STUB_LIBRARY,                                                                         \
      "the libcuda.so.1 loaded is the CUDA toolkit's stub, not the driver: take the toolkit's stubs "      \
      "directory out of LD_LIBRARY_PATH")                                                                 \
    X(46, CUDA_ERROR_DEVICE_UNAVAILABLE,                                                                   \
      "the device is taken (exclusive-process compute mode with another process on it) or being reset: "  \
      "check nvidia-smi")                                                                                 \
    X(100, CUDA_ERROR_NO_DEVICE,                                                                           \
      "no GPU is visible to this process: check CUDA_VISIBLE_DEVICES and nvidia-smi (in a container, "     \
      "start it with the GPUs passed in, e.g. docker run --gpus all)")                                    \
    X(101, CUDA_ERROR_INVALID_DEVICE, "no such device here: check CUDA_VISIBLE_DEVICES")                   \
    X(200, CUDA_ERROR_INVALID_IMAGE,                                                                       \
      "the driver cannot read ampx/_kernels.fatbin: reinstall ampx if the file is damaged, else update "   \
      "the NVIDIA driver")                                                                                \
    X(209, CUDA_ERROR_NO_BINARY_FOR_GPU,                                                                   \
      "the fatbin has no code this GPU and driver can run: update the NVIDIA driver, or rebuild ampx "     \
      "with a CUDA toolkit that knows this GPU")                                                          \
    X(218, CUDA_ERROR_INVALID_PTX,                                                                         \
      "the driver's PTX compiler refused ampx's PTX: update the NVIDIA driver")                          \
    X(221, CUDA_ERROR_JIT_COMPILER_NOT_FOUND,                                                              \
      "the driver's PTX compiler (libnvidia-ptxjitcompiler.so.1) is missing: install the whole NVIDIA "    \
      "driver (in a container: NVIDIA_DRIVER_CAPABILITIES must include compute)")                         \
    X(222, CUDA_ERROR_UNSUPPORTED_PTX_VERSION,                                                             \
      "ampx's PTX is newer than this driver: update the NVIDIA driver")                                  \
    X(500, CUDA_ERROR_NOT_FOUND,                                                                           \
      "a kernel is missing from ampx/_kernels.fatbin, which comes from another ampx build: reinstall ampx") \
    X(700, CUDA_ERROR_ILLEGAL_ADDRESS, AMPX_CU_STICKY_FIX)                                                 \
    X(710, CUDA_ERROR_ASSERT, AMPX_CU_STICKY_FIX)                                                          \
    X(719, CUDA_ERROR_LAUNCH_FAILED, AMPX_CU_STICKY_FIX)                                                   \
    X(803, CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,                                                              \
      "libcuda.so.1 and the loaded kernel module are different driver versions (updated without a "       \
      "reboot, or a forward-compatibility package): reboot, or load the libcuda.so.1 that matches")        \
    X(804, CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,                                                      \
      "the CUDA forward-compatibility package does not support this GPU: remove it from "                 \
      "LD_LIBRARY_PATH and update the driver instead")                                                    \
    X(900, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,                                                          \
      "called during CUDA graph capture: run one eager step (or ampx.cuda.device_info(device)) before "    \
      "capturing, so that ampx loads its kernels first")                                                  \
    X(901, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,                                                          \
      "a CUDA graph capture was broken by an operation that is not allowed inside one; see the first "     \
      "error of the capture")                                                                            \
    X(906, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,                                                             \
      "called during CUDA graph capture: run one eager step (or ampx.cuda.device_info(device)) before "    \
      "capturing, so that ampx loads its kernels first")
#define AMPX_CU_ATTR_MULTIPROCESSOR_COUNT 16
#define AMPX_CU_ATTR_CC_MAJOR 75
#define AMPX_CU_ATTR_CC_MINOR 76

/* What went wrong in a driver call: the call, the error code and its name
 * (cuGetErrorName) and description (cuGetErrorString), or a message of ampx's
 * own when code is AMPX_CU_E_AMPX. */
#define AMPX_CU_E_AMPX (-1)
typedef struct {
    int code;
    char msg[1024];
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
    ampx_cu_function stats; /* tensor_stats */
    ampx_cu_function update;
    ampx_cu_function probe; /* an empty kernel: launched once to prove the device runs ampx's code */
    int launched;           /* the probe kernel ran to completion on this device */
    int sm_count;
    int cc_major, cc_minor;
} ampx_cu_dev;

/* Hands the fatbin image to the layer (copied), with the CUDA releases that built its SASS
 * and its PTX (cuDriverGetVersion numbers such as 12090; 0 when unknown) and its targets in
 * words (copied; "" when unknown), used to say which driver is needed. Returns 0, or -1 out
 * of memory. */
int ampx_cu_set_image(const void *data, size_t size, int sass_toolkit, int ptx_toolkit, const char *targets);
int ampx_cu_have_image(void);

/* Loads the driver library (libcuda.so.1, or $AMPX_LIBCUDA: a test's stand-in) and runs
 * cuInit once per process (once again in a forked child: see the atfork handler). Returns 0,
 * or -1 with a reason in err. Thread-safe; call it without the GIL. */
int ampx_cu_driver(ampx_cu_error *err);

/* Whether device `ordinal` runs ampx's kernels: the driver is new enough for the fatbin, the
 * kernels load into the device's primary context (creating it, as torch's first use would),
 * and an empty kernel launched on its own stream completes. A success is kept; a failure is
 * tried again at the next call. Returns 0, or -1 with the reason in err. Without the GIL. */
int ampx_cu_probe(int ordinal, ampx_cu_error *err);

/* The loaded device `ordinal`, loading its kernels on first use: once per device, under
 * ampx's own lock (other threads, and Python with the GIL released, go on meanwhile).
 * Without the GIL: loading may JIT-compile PTX for seconds. */
ampx_cu_dev *ampx_cu_device_get(int ordinal, ampx_cu_error *err);
/* Device `ordinal` if its kernels are loaded already, else NULL: never loads, never blocks. */
ampx_cu_dev *ampx_cu_device_ready(int ordinal);

/* The driver's version (e.g. 13000), or 0 when it is not loaded. */
int ampx_cu_driver_version(void);

/* Makes dev's context current on this thread / restores the previous one. */
int ampx_cu_push(const ampx_cu_dev *dev, ampx_cu_error *err);
int ampx_cu_pop(ampx_cu_error *err);

int ampx_cu_launch(ampx_cu_function f, unsigned grid, unsigned block, ampx_cu_stream stream, void *args,
                   const char *what, ampx_cu_error *err);
/* Whether `stream` of dev may be capturing a CUDA graph: 1 when it is, and when the driver
 * cannot say (no cuStreamIsCapturing, or it failed); 0 when it is not. */
int ampx_cu_capturing(const ampx_cu_dev *dev, ampx_cu_stream stream);
int ampx_cu_memset32(ampx_cu_deviceptr p, unsigned value, size_t count, ampx_cu_stream stream,
                     ampx_cu_error *err);

/* ---- the multi-tensor launcher (cuda_launch.c), written once for every op ---- */

/* One tensor as the launcher sees it: contiguous device memory. */
typedef struct ampx_cu_tensor_s {
    ampx_cu_deviceptr ptr; /* data; casts: the destination */
    ampx_cu_deviceptr src; /* casts: the source */
    int64_t numel;
    int dtype, src_dtype;
    uint32_t index; /* position in the caller's list */
} ampx_cu_tensor;

typedef struct {
    int kind;               /* AMPX_CU_SCALE, AMPX_CU_CAST or AMPX_CU_STATS (rows: per_out) */
    int reduce, write, scale; /* scale kernel: AMPX_REDUCE_*, store, multiply */
    int stochastic;
    uint64_t seed, offset;
    ampx_cu_deviceptr rng; /* casts: {seed, offset} on the device (a CUDA graph replays its current value), or 0 */
    double factor;
    ampx_cu_deviceptr factor_ptr, found_inf, flags_out, per_out, total_out;
    int64_t nflags; /* scale jobs over span slots with flags_out: the tensors of the caller's list
                     * (each slot's src is then its span table, ampx_cu_span_tables); else 0 */
} ampx_cu_job;

/* The launcher's state across one call: launches fill one parameter block
 * with up to AMPX_CU_MAX_TENSORS tensors each, in list order. */
typedef struct {
    const ampx_cu_dev *dev;
    ampx_cu_stream stream;
    ampx_cu_function fn;
    int with_ws;
    uint32_t chunk_next; /* call-wide index of the next chunk */
    ampx_cu_deviceptr acc_next; /* stats jobs: the next tensor's accumulator row in the workspace */
    ampx_cu_args args;
} ampx_cu_launcher;

/* Span tables (cuda_args.h) for the spans[0..m) that ampx_coalesce made of ts[0..n) (their
 * device pointers as ptr): ampx_cu_span_tables_bytes(n, m) bytes at `host` (16-byte aligned),
 * span s's table at host + off[s]. Pure C; the caller copies them to the device. */
struct ampx_tensor_s;
int64_t ampx_cu_span_tables_bytes(int64_t n, int64_t m);
int ampx_cu_span_tables(const struct ampx_tensor_s *ts, const struct ampx_tensor_s *spans, const int64_t *first,
                        int64_t m, void *host, int64_t *off);
/* The launcher's entries for spans[0..m), numbered 0..m-1; with tables (their device
 * address, 0 for none) each entry's src is its span's table, tables + off[s]. */
struct ampx_cu_tensor_s;
void ampx_cu_span_slots(const struct ampx_tensor_s *spans, int64_t m, ampx_cu_deviceptr tables, const int64_t *off,
                        struct ampx_cu_tensor_s *out);

/* Workspace bytes a job needs for these tensors (0: none), and its chunk
 * count (for ampx_cu_begin; a stats job: its accumulator rows, one per tensor of
 * more than one chunk). -1 when the chunks do not fit the launcher's 32-bit chunk
 * indices. */
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
