/* cuda_driver.c: see cuda_driver.h.
 *
 * Concurrency: loading the driver and a device's kernels happens under load_lock, never with
 * the GIL (callers release it), so a slow load (a PTX JIT takes seconds) stalls no other
 * thread, and two threads never load the same device twice. Readers of the loaded state take
 * the fast path with acquire loads of driver_state and ampx_cu_dev.loaded.
 *
 * Fork: a child inherits handles to the parent's contexts and modules, which the driver does
 * not carry across fork(). The pthread_atfork child handler forgets them (and the lock), so
 * the child starts from nothing: a driver call there either works afresh or fails with the
 * driver's own error and ampx's hint (spawn instead of fork), never with a stale handle.
 */
#define _GNU_SOURCE 1 /* dlopen and friends on strict C11 */
#include "cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ampx_numerics.h"

/* ---- the driver entry points ampx uses ------------------------------------ */

typedef struct {
    ampx_cu_result (*Init)(unsigned int);
    ampx_cu_result (*DriverGetVersion)(int *);
    ampx_cu_result (*DeviceGetCount)(int *);
    ampx_cu_result (*DeviceGet)(ampx_cu_device *, int);
    ampx_cu_result (*DeviceGetAttribute)(int *, int, ampx_cu_device);
    ampx_cu_result (*DevicePrimaryCtxRetain)(ampx_cu_context *, ampx_cu_device);
    ampx_cu_result (*DevicePrimaryCtxRelease)(ampx_cu_device);
    ampx_cu_result (*CtxPushCurrent)(ampx_cu_context);
    ampx_cu_result (*CtxPopCurrent)(ampx_cu_context *);
    ampx_cu_result (*ModuleLoadData)(ampx_cu_module *, const void *);
    ampx_cu_result (*ModuleUnload)(ampx_cu_module);
    ampx_cu_result (*ModuleGetFunction)(ampx_cu_function *, ampx_cu_module, const char *);
    ampx_cu_result (*LaunchKernel)(ampx_cu_function, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, ampx_cu_stream, void **, void **);
    ampx_cu_result (*MemsetD32Async)(ampx_cu_deviceptr, unsigned int, size_t, ampx_cu_stream);
    ampx_cu_result (*StreamCreate)(ampx_cu_stream *, unsigned int);
    ampx_cu_result (*StreamSynchronize)(ampx_cu_stream);
    ampx_cu_result (*StreamDestroy)(ampx_cu_stream);
    ampx_cu_result (*GetErrorName)(ampx_cu_result, const char **);
    ampx_cu_result (*GetErrorString)(ampx_cu_result, const char **);
    ampx_cu_result (*FuncLoad)(ampx_cu_function); /* optional (CUDA 12.4+) */
    ampx_cu_result (*StreamIsCapturing)(ampx_cu_stream, int *); /* optional: absent, capture is assumed */
} api_t;

/* The exported names (cuda.h maps several API names onto versioned symbols). */
#define API_SYMBOLS(X)                                                                                     \
    X(Init, "cuInit")                                                                                      \
    X(DriverGetVersion, "cuDriverGetVersion")                                                              \
    X(DeviceGetCount, "cuDeviceGetCount")                                                                  \
    X(DeviceGet, "cuDeviceGet")                                                                            \
    X(DeviceGetAttribute, "cuDeviceGetAttribute")                                                          \
    X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")                                                  \
    X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")                                             \
    X(CtxPushCurrent, "cuCtxPushCurrent_v2")                                                               \
    X(CtxPopCurrent, "cuCtxPopCurrent_v2")                                                                 \
    X(ModuleLoadData, "cuModuleLoadData")                                                                  \
    X(ModuleUnload, "cuModuleUnload")                                                                      \
    X(ModuleGetFunction, "cuModuleGetFunction")                                                            \
    X(LaunchKernel, "cuLaunchKernel")                                                                      \
    X(MemsetD32Async, "cuMemsetD32Async")                                                                  \
    X(StreamCreate, "cuStreamCreate")                                                                      \
    X(StreamSynchronize, "cuStreamSynchronize")                                                            \
    X(StreamDestroy, "cuStreamDestroy_v2")                                                                 \
    X(GetErrorName, "cuGetErrorName")                                                                      \
    X(GetErrorString, "cuGetErrorString")

static api_t api;
static void *lib_handle;
static int driver_state;          /* 0: not tried, 1: ready, -1: failed (reason in driver_error) */
static ampx_cu_error driver_error;
static int driver_version;
static int device_count;
static ampx_cu_dev *devices;      /* device_count entries, loaded lazily */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER; /* guards everything above */
static int forked_after_init;     /* this process is a fork of one whose driver was loaded */

static unsigned char *image;      /* the fatbin */
static size_t image_size;
static int image_sass_toolkit, image_ptx_toolkit; /* CUDA releases that built it (12090), or 0 */
static char image_targets[160];   /* "sm_80, sm_86, ...; PTX compute_80", or "" when unknown */

/* ---- errors ---------------------------------------------------------------- */

static void set_msg(ampx_cu_error *err, int code, const char *fmt, ...)
{
    va_list ap;
    err->code = code;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
}

/* Appends to err->msg (cut at its size). */
static void append(ampx_cu_error *err, const char *fmt, ...)
{
    size_t n = strlen(err->msg);
    if (n + 1 >= sizeof err->msg)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg + n, sizeof err->msg - n, fmt, ap);
    va_end(ap);
}

/* "what failed: CUDA_ERROR_X (the driver's description)" */
static void set_cu(ampx_cu_error *err, ampx_cu_result rc, const char *what)
{
    const char *name = NULL, *desc = NULL;
    if (api.GetErrorName == NULL || api.GetErrorName(rc, &name) != AMPX_CUDA_SUCCESS || name == NULL)
        name = "CUDA_ERROR_UNKNOWN_CODE";
    if (api.GetErrorString == NULL || api.GetErrorString(rc, &desc) != AMPX_CUDA_SUCCESS || desc == NULL)
        desc = "no description";
    set_msg(err, rc, "%s failed: %s (error %d: %s)", what, name, (int)rc, desc);
    const char *fix = NULL;
    switch (rc) {
#define AMPX_X_HINT(code, cu_name, text)                                                                   \
    case code:                                                                                             \
        fix = text;                                                                                        \
        break;
        AMPX_CU_ERROR_HINTS(AMPX_X_HINT)
#undef AMPX_X_HINT
    default:
        break;
    }
    if (rc == AMPX_CUDA_ERROR_NOT_INITIALIZED && forked_after_init)
        fix = "this process was forked from one that had used CUDA, and CUDA does not survive fork(): start "
              "it with the 'spawn' method (multiprocessing.set_start_method('spawn'))";
    if (fix != NULL)
        append(err, ". To fix: %s", fix);
}

/* The driver branch (R525...) first to support CUDA release `version` (12090), or 0. */
static int driver_branch(int version)
{
    static const int table[][2] = {{11080, 520}, {12000, 525}, {12010, 530}, {12020, 535}, {12030, 545},
                                   {12040, 550}, {12050, 555}, {12060, 560}, {12080, 570}, {12090, 575},
                                   {13000, 580}};
    for (size_t k = 0; k < sizeof table / sizeof table[0]; k++)
        if (table[k][0] >= version)
            return table[k][1];
    return 0;
}

/* "CUDA 12.9" for a cuDriverGetVersion number, with " (R575 or newer)" when `branch`. */
static void describe_release(char *out, size_t size, int version, int branch)
{
    branch = branch ? driver_branch(version) : 0;
    if (branch > 0)
        snprintf(out, size, "CUDA %d.%d (R%d or newer)", version / 1000, version % 1000 / 10, branch);
    else
        snprintf(out, size, "CUDA %d.%d", version / 1000, version % 1000 / 10);
}

/* The driver the loaded fatbin needs, as "CUDA 12.0 (R525 or newer)": its SASS toolkit's major
 * release (CUDA 12 when no image is set yet: the portable build's floor). */
static void needed_driver(char *out, size_t size)
{
    int major = image_sass_toolkit > 0 ? image_sass_toolkit / 1000 : 12;
    describe_release(out, size, major * 1000, 1);
}

/* What a failed module load means, given the fatbin's contents and toolkit and this driver:
 * for the errors a missing target or an old driver causes. */
static void explain_load_failure(ampx_cu_error *err, ampx_cu_result rc, int ordinal, int major, int minor)
{
    if (rc != 200 && rc != AMPX_CUDA_ERROR_NO_BINARY_FOR_GPU && rc != 218 && rc != 222)
        return;
    char need[96], have[96];
    describe_release(have, sizeof have, driver_version, 0);
    append(err, ". Device %d has compute capability %d.%d", ordinal, major, minor);
    if (image_targets[0] != '\0')
        append(err, "; ampx's fatbin holds %s", image_targets);
    if (image_ptx_toolkit > 0) {
        describe_release(need, sizeof need, image_ptx_toolkit, 1);
        append(err, " (SASS runs on its own and later minor versions of a compute capability; the PTX, "
               "for any other GPU, needs a driver for %s)", need);
    }
    append(err, "; this driver is for %s", have);
}

#define CU_TRY(call, what)                                                                                 \
    do {                                                                                                   \
        ampx_cu_result rc_ = (call);                                                                       \
        if (rc_ != AMPX_CUDA_SUCCESS) {                                                                    \
            set_cu(err, rc_, (what));                                                                      \
            goto fail;                                                                                     \
        }                                                                                                  \
    } while (0)

/* ---- the image --------------------------------------------------------------- */

int ampx_cu_set_image(const void *data, size_t size, int sass_toolkit, int ptx_toolkit, const char *targets)
{
    if (image != NULL)
        return 0; /* the first image stays: modules may already hold it */
    image_sass_toolkit = sass_toolkit;
    image_ptx_toolkit = ptx_toolkit;
    snprintf(image_targets, sizeof image_targets, "%s", targets != NULL ? targets : "");
    unsigned char *copy = (unsigned char *)malloc(size > 0 ? size : 1u);
    if (copy == NULL)
        return -1;
    memcpy(copy, data, size);
    image = copy;
    image_size = size;
    return 0;
}

int ampx_cu_have_image(void) { return image != NULL && image_size > 0; }

/* ---- loading the driver ------------------------------------------------------- */

/* The child of a fork forgets the parent's driver state (see the top). Runs in the child
 * only, single-threaded; frees nothing (the parent's array may be mid-update). */
static void after_fork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&load_lock, &fresh, sizeof fresh);
    forked_after_init = forked_after_init || driver_state == 1;
    memset(&api, 0, sizeof api);
    driver_state = 0;
    driver_version = 0;
    device_count = 0;
    devices = NULL;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Opens the library and resolves the entry points into api. Under load_lock. */
static int open_library(ampx_cu_error *e)
{
    const char *path = getenv("AMPX_LIBCUDA"); /* a test's stand-in driver; normally unset */
    char need[96];
    if (path == NULL || path[0] == '\0')
        path = "libcuda.so.1";
    if (lib_handle == NULL)
        lib_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib_handle == NULL) {
        const char *why = dlerror();
        set_msg(e, AMPX_CU_E_AMPX,
                "the NVIDIA driver library %s could not be loaded (%s). To fix: install the NVIDIA driver (in a "
                "container: start it with the GPUs and driver passed in, e.g. docker run --gpus all)",
                path, why != NULL ? why : "no reason given");
        return -1;
    }
#define LOAD(field, name)                                                                                  \
    *(void **)(&api.field) = dlsym(lib_handle, name);                                                      \
    if (api.field == NULL) {                                                                               \
        needed_driver(need, sizeof need);                                                                  \
        set_msg(e, AMPX_CU_E_AMPX,                                                                         \
                "the NVIDIA driver library %s has no %s: the driver is too old for ampx. To fix: update the " \
                "NVIDIA driver (to one for %s)", path, name, need);                                        \
        return -1;                                                                                         \
    }
    API_SYMBOLS(LOAD)
#undef LOAD
    /* Optional: loads a kernel fully when the driver loads modules lazily
     * (CUDA_MODULE_LOADING=LAZY, the default since 12.2), so that no kernel is
     * first loaded inside a stream capture. */
    *(void **)(&api.FuncLoad) = dlsym(lib_handle, "cuFuncLoad");
    *(void **)(&api.StreamIsCapturing) = dlsym(lib_handle, "cuStreamIsCapturing");
    return 0;
}

/* cuInit, the version, the devices. Under load_lock. */
static int init_driver(ampx_cu_error *e)
{
    ampx_cu_result rc = api.Init(0);
    if (rc != AMPX_CUDA_SUCCESS) {
        set_cu(e, rc, "cuInit");
        return -1;
    }
    if ((rc = api.DriverGetVersion(&driver_version)) != AMPX_CUDA_SUCCESS) {
        set_cu(e, rc, "cuDriverGetVersion");
        return -1;
    }
    if ((rc = api.DeviceGetCount(&device_count)) != AMPX_CUDA_SUCCESS) {
        set_cu(e, rc, "cuDeviceGetCount");
        return -1;
    }
    if (device_count <= 0) {
        set_msg(e, AMPX_CU_E_AMPX, "the NVIDIA driver sees no CUDA device. To fix: check CUDA_VISIBLE_DEVICES "
                "and nvidia-smi (in a container, start it with the GPUs passed in)");
        return -1;
    }
    devices = (ampx_cu_dev *)calloc((size_t)device_count, sizeof *devices);
    if (devices == NULL) {
        set_msg(e, AMPX_CU_E_AMPX, "out of memory");
        return -1;
    }
    return 0;
}

int ampx_cu_driver(ampx_cu_error *err)
{
    if (__atomic_load_n(&driver_state, __ATOMIC_ACQUIRE) == 1)
        return 0;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&load_lock);
    if (driver_state == 0) {
        if (open_library(&driver_error) == 0 && init_driver(&driver_error) == 0) {
            __atomic_store_n(&driver_state, 1, __ATOMIC_RELEASE);
        } else {
            /* A failed load is final for the process (as torch's own CUDA init). The
             * library stays open if it opened: symbols may have been resolved. */
            memset(&api, 0, sizeof api);
            driver_state = -1;
        }
    }
    int rc = driver_state == 1 ? 0 : -1;
    if (rc < 0)
        *err = driver_error;
    pthread_mutex_unlock(&load_lock);
    return rc;
}

int ampx_cu_driver_version(void)
{
    return __atomic_load_n(&driver_state, __ATOMIC_ACQUIRE) == 1 ? driver_version : 0;
}

static int check_ordinal(int ordinal, ampx_cu_error *err)
{
    if (ordinal < 0 || ordinal >= device_count) {
        set_msg(err, AMPX_CU_E_AMPX, "CUDA device %d does not exist (the driver sees %d). To fix: pass an index "
                "below %d, or check CUDA_VISIBLE_DEVICES", ordinal, device_count, device_count);
        return -1;
    }
    return 0;
}

/* The kernels of one device: names in cuda/ampx_kernels.cu. */
static int load_functions(ampx_cu_dev *d, ampx_cu_error *err)
{
    static const struct {
        int rd, wr, sc;
        const char *name;
    } scale_fns[] = {
#define AMPX_X_SCALE_FN(label, mode, rd, wr, sc, ck, cuda)                                                    \
    AMPX_IF(cuda, {rd, wr, sc, AMPX_CU_STR(AMPX_CU_SCALE_KERNEL_NAME(rd, wr, sc))}, )
        AMPX_SCALE_MODE_LIST(AMPX_X_SCALE_FN)
#undef AMPX_X_SCALE_FN
    };
    char what[96];
    for (size_t k = 0; k < sizeof scale_fns / sizeof scale_fns[0]; k++) {
        snprintf(what, sizeof what, "cuModuleGetFunction(%s)", scale_fns[k].name);
        CU_TRY(api.ModuleGetFunction(&d->scale[scale_fns[k].rd][scale_fns[k].wr][scale_fns[k].sc], d->mod,
                                     scale_fns[k].name),
               what);
    }
    CU_TRY(api.ModuleGetFunction(&d->cast, d->mod, "ampx_k_cast"), "cuModuleGetFunction(ampx_k_cast)");
    CU_TRY(api.ModuleGetFunction(&d->stats, d->mod, "ampx_k_tensor_stats"),
           "cuModuleGetFunction(ampx_k_tensor_stats)");
    CU_TRY(api.ModuleGetFunction(&d->update, d->mod, "ampx_k_update_scale"),
           "cuModuleGetFunction(ampx_k_update_scale)");
    CU_TRY(api.ModuleGetFunction(&d->probe, d->mod, "ampx_k_probe"), "cuModuleGetFunction(ampx_k_probe)");
    if (api.FuncLoad != NULL) {
        for (int r = 0; r < AMPX_NUM_REDUCE; r++)
            for (int w = 0; w < 2; w++)
                for (int s = 0; s < 2; s++)
                    if (d->scale[r][w][s] != NULL)
                        CU_TRY(api.FuncLoad(d->scale[r][w][s]), "cuFuncLoad");
        CU_TRY(api.FuncLoad(d->cast), "cuFuncLoad");
        CU_TRY(api.FuncLoad(d->stats), "cuFuncLoad");
        CU_TRY(api.FuncLoad(d->update), "cuFuncLoad");
        CU_TRY(api.FuncLoad(d->probe), "cuFuncLoad");
    }
    return 0;
fail:
    return -1;
}

static int read_cc(ampx_cu_device dev, int *major, int *minor, ampx_cu_error *err)
{
    CU_TRY(api.DeviceGetAttribute(major, AMPX_CU_ATTR_CC_MAJOR, dev), "cuDeviceGetAttribute(compute capability)");
    CU_TRY(api.DeviceGetAttribute(minor, AMPX_CU_ATTR_CC_MINOR, dev), "cuDeviceGetAttribute(compute capability)");
    return 0;
fail:
    return -1;
}

/* The fatbin holds SASS for 8.0 (runs on every 8.x) to 12.0 and PTX for 8.0
 * (compiled by the driver for anything newer). */
static int cc_supported(int major) { return major >= 8; }

/* Whether this driver can load the fatbin's SASS at all: a CUDA 12.x build needs a driver
 * for 12.0 or newer (minor-version compatibility), a 13.x build one for 13.0. */
static int check_driver_release(ampx_cu_error *err)
{
    int need = image_sass_toolkit / 1000 * 1000;
    if (image_sass_toolkit <= 0 || driver_version >= need)
        return 0;
    char needs[96], have[96];
    describe_release(needs, sizeof needs, need, 1);
    describe_release(have, sizeof have, driver_version, 0);
    set_msg(err, AMPX_CU_E_AMPX,
            "ampx's CUDA kernels were built with CUDA %d.%d and need a driver for %s, but this NVIDIA driver "
            "is for %s. To fix: update the NVIDIA driver, or rebuild ampx with an older toolkit (pip install "
            "nvidia-cuda-nvcc-cu12 builds kernels that run on any R525+ driver)",
            image_sass_toolkit / 1000, image_sass_toolkit % 1000 / 10, needs, have);
    return -1;
}

/* Loads device d's kernels into its primary context. Under load_lock. */
static int load_device(ampx_cu_dev *d, int ordinal, ampx_cu_error *err)
{
    int retained = 0, pushed = 0;
    ampx_cu_context popped;
    memset(d, 0, sizeof *d);
    d->ordinal = ordinal;
    if (check_driver_release(err) < 0)
        goto fail;
    CU_TRY(api.DeviceGet(&d->dev, ordinal), "cuDeviceGet");
    if (read_cc(d->dev, &d->cc_major, &d->cc_minor, err) < 0)
        goto fail;
    if (!cc_supported(d->cc_major)) {
        set_msg(err, AMPX_CU_E_AMPX,
                "CUDA device %d has compute capability %d.%d; ampx's kernels need 8.0 or newer (A100, RTX 30xx "
                "or later). To fix: run on such a GPU, or keep the tensors on the CPU", ordinal, d->cc_major,
                d->cc_minor);
        goto fail;
    }
    CU_TRY(api.DeviceGetAttribute(&d->sm_count, AMPX_CU_ATTR_MULTIPROCESSOR_COUNT, d->dev),
           "cuDeviceGetAttribute(multiprocessor count)");
    CU_TRY(api.DevicePrimaryCtxRetain(&d->ctx, d->dev), "cuDevicePrimaryCtxRetain");
    retained = 1;
    CU_TRY(api.CtxPushCurrent(d->ctx), "cuCtxPushCurrent");
    pushed = 1;
    {
        ampx_cu_result rc = api.ModuleLoadData(&d->mod, image);
        if (rc != AMPX_CUDA_SUCCESS) {
            set_cu(err, rc, "cuModuleLoadData(ampx/_kernels.fatbin)");
            explain_load_failure(err, rc, ordinal, d->cc_major, d->cc_minor);
            goto fail;
        }
    }
    if (load_functions(d, err) < 0) {
        api.ModuleUnload(d->mod);
        goto fail;
    }
    pushed = 0; /* a failed pop must not be retried below: it could pop the caller's context */
    {
        ampx_cu_result rc = api.CtxPopCurrent(&popped);
        if (rc != AMPX_CUDA_SUCCESS) {
            set_cu(err, rc, "cuCtxPopCurrent");
            api.ModuleUnload(d->mod);
            goto fail;
        }
    }
    return 0;
fail:
    if (pushed)
        api.CtxPopCurrent(&popped);
    if (retained)
        api.DevicePrimaryCtxRelease(d->dev);
    memset(d, 0, sizeof *d);
    return -1;
}

ampx_cu_dev *ampx_cu_device_get(int ordinal, ampx_cu_error *err)
{
    if (ampx_cu_driver(err) < 0 || check_ordinal(ordinal, err) < 0)
        return NULL;
    ampx_cu_dev *d = &devices[ordinal];
    if (__atomic_load_n(&d->loaded, __ATOMIC_ACQUIRE))
        return d;
    if (!ampx_cu_have_image()) {
        set_msg(err, AMPX_CU_E_AMPX, "ampx was built without its CUDA kernels (no fatbin)");
        return NULL;
    }
    pthread_mutex_lock(&load_lock);
    int ok = d->loaded || load_device(d, ordinal, err) == 0;
    if (ok)
        __atomic_store_n(&d->loaded, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&load_lock);
    return ok ? d : NULL;
}

ampx_cu_dev *ampx_cu_device_ready(int ordinal)
{
    if (__atomic_load_n(&driver_state, __ATOMIC_ACQUIRE) != 1 || ordinal < 0 || ordinal >= device_count)
        return NULL;
    ampx_cu_dev *d = &devices[ordinal];
    return __atomic_load_n(&d->loaded, __ATOMIC_ACQUIRE) ? d : NULL;
}

/* Launches the empty kernel on a stream of its own and waits for it. Under load_lock. */
static int launch_probe(ampx_cu_dev *d, ampx_cu_error *err)
{
    ampx_cu_stream s = NULL;
    ampx_cu_context popped;
    int pushed = 0, rc = -1;
    CU_TRY(api.CtxPushCurrent(d->ctx), "cuCtxPushCurrent");
    pushed = 1;
    /* Non-blocking: independent of the legacy default stream, so torch's work and captures
     * on other streams are left alone. */
    CU_TRY(api.StreamCreate(&s, AMPX_CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CU_TRY(api.LaunchKernel(d->probe, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel(ampx_k_probe)");
    CU_TRY(api.StreamSynchronize(s), "cuStreamSynchronize(ampx_k_probe)");
    rc = 0;
fail:
    if (s != NULL)
        api.StreamDestroy(s);
    if (pushed)
        api.CtxPopCurrent(&popped);
    return rc;
}

int ampx_cu_probe(int ordinal, ampx_cu_error *err)
{
    ampx_cu_dev *d = ampx_cu_device_get(ordinal, err);
    if (d == NULL)
        return -1;
    if (__atomic_load_n(&d->launched, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&load_lock);
    int ok = d->launched || launch_probe(d, err) == 0;
    if (ok)
        __atomic_store_n(&d->launched, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&load_lock);
    return ok ? 0 : -1;
}

/* ---- per-call driver operations ---------------------------------------------- */

int ampx_cu_push(const ampx_cu_dev *dev, ampx_cu_error *err)
{
    CU_TRY(api.CtxPushCurrent(dev->ctx), "cuCtxPushCurrent");
    return 0;
fail:
    return -1;
}

int ampx_cu_pop(ampx_cu_error *err)
{
    ampx_cu_context popped;
    CU_TRY(api.CtxPopCurrent(&popped), "cuCtxPopCurrent");
    return 0;
fail:
    return -1;
}

int ampx_cu_launch(ampx_cu_function f, unsigned grid, unsigned block, ampx_cu_stream stream, void *args,
                   const char *what, ampx_cu_error *err)
{
    void *params[1] = {args};
    CU_TRY(api.LaunchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, params, NULL), what);
    return 0;
fail:
    return -1;
}

int ampx_cu_memset32(ampx_cu_deviceptr p, unsigned value, size_t count, ampx_cu_stream stream, ampx_cu_error *err)
{
    CU_TRY(api.MemsetD32Async(p, value, count, stream), "cuMemsetD32Async");
    return 0;
fail:
    return -1;
}

int ampx_cu_capturing(const ampx_cu_dev *dev, ampx_cu_stream stream)
{
    ampx_cu_error err;
    int status = 1;
    if (api.StreamIsCapturing == NULL || ampx_cu_push(dev, &err) < 0)
        return 1;
    if (api.StreamIsCapturing(stream, &status) != AMPX_CUDA_SUCCESS)
        status = 1;
    ampx_cu_pop(&err);
    return status != AMPX_CU_STREAM_CAPTURE_STATUS_NONE;
}
