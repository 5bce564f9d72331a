/*
 * fake_libcuda.c: a stand-in for the NVIDIA driver library, for tests/test_cuda_driver.py.
 *
 * Built into a shared library that ampx opens instead of libcuda.so.1 when AMPX_LIBCUDA names
 * it. It exports the driver entry points csrc/cuda_driver.c resolves, runs no kernel, and
 * behaves as the variables below say, read at each call (so a test changes them between
 * calls, or in a forked child):
 *   FAKE_CU_INIT_RC     cuInit's result (default 0)
 *   FAKE_CU_DRIVER      cuDriverGetVersion's value (default 12090)
 *   FAKE_CU_DEVICES     the device count (default 1)
 *   FAKE_CU_CC          compute capabilities per device, "90,80" (default 90)
 *   FAKE_CU_LOAD_RC     cuModuleLoadData's result per device, "0,222" (default 0)
 *   FAKE_CU_LAUNCH_RC   cuLaunchKernel's result per device (default 0)
 *   FAKE_CU_LOAD_MS     how long cuModuleLoadData takes (default 0)
 * Like the real driver, contexts, modules and functions belong to the process that made them:
 * used in another (a forked child), they fail with CUDA_ERROR_NOT_INITIALIZED and count as a
 * stale use. fake_cu_counts() reports the calls.
 */
#define _GNU_SOURCE 1
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef struct {
    pid_t pid;
    int dev;
} handle;

static int n_init, n_load, n_launch, n_stale, n_stream_flags_bad;

/* inits, module loads, kernel launches, stale-handle uses, streams not made non-blocking */
void fake_cu_counts(int *out)
{
    out[0] = __atomic_load_n(&n_init, __ATOMIC_SEQ_CST);
    out[1] = __atomic_load_n(&n_load, __ATOMIC_SEQ_CST);
    out[2] = __atomic_load_n(&n_launch, __ATOMIC_SEQ_CST);
    out[3] = __atomic_load_n(&n_stale, __ATOMIC_SEQ_CST);
    out[4] = __atomic_load_n(&n_stream_flags_bad, __ATOMIC_SEQ_CST);
}

static int env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v != NULL && *v ? atoi(v) : dflt;
}

/* Item `dev` of a comma-separated list, else the last item, else dflt. */
static int per_device(const char *name, int dev, int dflt)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        return dflt;
    int value = atoi(v);
    for (int k = 0; k < dev; k++) {
        const char *comma = strchr(v, ',');
        if (comma == NULL)
            break;
        v = comma + 1;
        value = atoi(v);
    }
    return value;
}

static handle *new_handle(int dev)
{
    handle *h = (handle *)calloc(1, sizeof *h);
    h->pid = getpid();
    h->dev = dev;
    return h;
}

static int stale(const void *p)
{
    if (p == NULL || ((const handle *)p)->pid == getpid())
        return 0;
    __atomic_add_fetch(&n_stale, 1, __ATOMIC_SEQ_CST);
    return 1;
}

#define NOT_INITIALIZED 3
static __thread const handle *ctx_stack[16];
static __thread int ctx_depth;

CUresult cuInit(unsigned flags)
{
    (void)flags;
    __atomic_add_fetch(&n_init, 1, __ATOMIC_SEQ_CST);
    return env_int("FAKE_CU_INIT_RC", 0);
}

CUresult cuDriverGetVersion(int *v)
{
    *v = env_int("FAKE_CU_DRIVER", 12090);
    return 0;
}

CUresult cuDeviceGetCount(int *n)
{
    *n = env_int("FAKE_CU_DEVICES", 1);
    return 0;
}

CUresult cuDeviceGet(int *d, int ordinal)
{
    *d = ordinal;
    return 0;
}

CUresult cuDeviceGetAttribute(int *v, int attr, int dev)
{
    int cc = per_device("FAKE_CU_CC", dev, 90);
    *v = attr == 75 ? cc / 10 : attr == 76 ? cc % 10 : 132;
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    *ctx = new_handle(dev);
    return 0;
}

CUresult cuDevicePrimaryCtxRelease_v2(int dev)
{
    (void)dev;
    return 0;
}


CUresult cuCtxPushCurrent_v2(void *ctx)
{
    if (stale(ctx))
        return NOT_INITIALIZED;
    ctx_stack[ctx_depth++] = (const handle *)ctx;
    return 0;
}

CUresult cuCtxPopCurrent_v2(void **ctx)
{
    if (ctx_depth == 0)
        return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    *ctx = (void *)ctx_stack[--ctx_depth];
    return 0;
}

CUresult cuModuleLoadData(void **mod, const void *image)
{
    (void)image;
    if (ctx_depth == 0)
        return 201;
    int dev = ctx_stack[ctx_depth - 1]->dev;
    __atomic_add_fetch(&n_load, 1, __ATOMIC_SEQ_CST);
    int ms = env_int("FAKE_CU_LOAD_MS", 0);
    if (ms > 0) {
        struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    int rc = per_device("FAKE_CU_LOAD_RC", dev, 0);
    if (rc == 0)
        *mod = new_handle(dev);
    return rc;
}

CUresult cuModuleUnload(void *mod)
{
    (void)mod;
    return 0;
}

CUresult cuModuleGetFunction(void **fn, void *mod, const char *name)
{
    (void)name;
    if (stale(mod))
        return NOT_INITIALIZED;
    *fn = new_handle(((handle *)mod)->dev);
    return 0;
}

CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void *stream, void **params, void **extra)
{
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)smem, (void)stream, (void)params;
    (void)extra;
    if (stale(fn))
        return NOT_INITIALIZED;
    __atomic_add_fetch(&n_launch, 1, __ATOMIC_SEQ_CST);
    return per_device("FAKE_CU_LAUNCH_RC", ((handle *)fn)->dev, 0);
}

CUresult cuMemsetD32Async(uint64_t p, unsigned v, size_t n, void *stream)
{
    (void)p, (void)v, (void)n, (void)stream;
    return 0;
}

CUresult cuStreamCreate(void **stream, unsigned flags)
{
    if (flags != 1) /* CU_STREAM_NON_BLOCKING */
        __atomic_add_fetch(&n_stream_flags_bad, 1, __ATOMIC_SEQ_CST);
    *stream = new_handle(ctx_depth > 0 ? ctx_stack[ctx_depth - 1]->dev : -1);
    return 0;
}

CUresult cuStreamSynchronize(void *stream) { return stale(stream) ? NOT_INITIALIZED : 0; }

CUresult cuStreamDestroy_v2(void *stream)
{
    free(stream);
    return 0;
}

static const struct {
    int code;
    const char *name;
} names[] = {{2, "CUDA_ERROR_OUT_OF_MEMORY"}, {3, "CUDA_ERROR_NOT_INITIALIZED"}, {34, "CUDA_ERROR_STUB_LIBRARY"},
             {100, "CUDA_ERROR_NO_DEVICE"}, {200, "CUDA_ERROR_INVALID_IMAGE"}, {209, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
             {218, "CUDA_ERROR_INVALID_PTX"}, {221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"},
             {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"}, {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"},
             {804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"}};

CUresult cuGetErrorName(CUresult rc, const char **s)
{
    *s = "CUDA_ERROR_FAKE_UNNAMED";
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        if (names[k].code == rc)
            *s = names[k].name;
    return 0;
}

CUresult cuGetErrorString(CUresult rc, const char **s)
{
    (void)rc;
    *s = "the fake driver's description";
    return 0;
}
