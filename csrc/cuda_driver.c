/* cuda_driver.c: see cuda_driver.h. */
#define _GNU_SOURCE 1 /* dlopen and friends on strict C11 */
#include "cuda_driver.h"

#include <dlfcn.h>
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
    ampx_cu_result (*DevicePrimaryCtxGetState)(ampx_cu_device, unsigned int *, int *);
    ampx_cu_result (*CtxPushCurrent)(ampx_cu_context);
    ampx_cu_result (*CtxPopCurrent)(ampx_cu_context *);
    ampx_cu_result (*ModuleLoadData)(ampx_cu_module *, const void *);
    ampx_cu_result (*ModuleUnload)(ampx_cu_module);
    ampx_cu_result (*ModuleGetFunction)(ampx_cu_function *, ampx_cu_module, const char *);
    ampx_cu_result (*LaunchKernel)(ampx_cu_function, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, ampx_cu_stream, void **, void **);
    ampx_cu_result (*MemsetD32Async)(ampx_cu_deviceptr, unsigned int, size_t, ampx_cu_stream);
    ampx_cu_result (*GetErrorName)(ampx_cu_result, const char **);
    ampx_cu_result (*GetErrorString)(ampx_cu_result, const char **);
    ampx_cu_result (*FuncLoad)(ampx_cu_function); /* optional (CUDA 12.4+) */
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
    X(DevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState")                                              \
    X(CtxPushCurrent, "cuCtxPushCurrent_v2")                                                               \
    X(CtxPopCurrent, "cuCtxPopCurrent_v2")                                                                 \
    X(ModuleLoadData, "cuModuleLoadData")                                                                  \
    X(ModuleUnload, "cuModuleUnload")                                                                      \
    X(ModuleGetFunction, "cuModuleGetFunction")                                                            \
    X(LaunchKernel, "cuLaunchKernel")                                                                      \
    X(MemsetD32Async, "cuMemsetD32Async")                                                                  \
    X(GetErrorName, "cuGetErrorName")                                                                      \
    X(GetErrorString, "cuGetErrorString")

static api_t api;
static void *lib_handle;
static int driver_state;          /* 0: not tried, 1: ready, -1: failed (reason in driver_error) */
static ampx_cu_error driver_error;
static int driver_version;
static int device_count;
static ampx_cu_dev *devices;      /* device_count entries, loaded lazily */

static unsigned char *image;      /* the fatbin */
static size_t image_size;

/* ---- errors ---------------------------------------------------------------- */

static void set_msg(ampx_cu_error *err, int code, const char *fmt, ...)
{
    va_list ap;
    err->code = code;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
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

int ampx_cu_set_image(const void *data, size_t size)
{
    if (image != NULL)
        return 0; /* the first image stays: modules may already hold it */
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

int ampx_cu_driver(ampx_cu_error *err)
{
    if (driver_state == 1)
        return 0;
    if (driver_state == -1) {
        *err = driver_error;
        return -1;
    }
    ampx_cu_error *e = &driver_error;
    lib_handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_handle == NULL) {
        const char *why = dlerror();
        set_msg(e, AMPX_CU_E_AMPX, "the NVIDIA driver library libcuda.so.1 could not be loaded (%s)",
                why != NULL ? why : "no reason given");
        goto fail;
    }
#define LOAD(field, name)                                                                                  \
    *(void **)(&api.field) = dlsym(lib_handle, name);                                                      \
    if (api.field == NULL) {                                                                               \
        set_msg(e, AMPX_CU_E_AMPX, "the NVIDIA driver library libcuda.so.1 has no %s (driver too old?)", name); \
        goto fail;                                                                                         \
    }
    API_SYMBOLS(LOAD)
#undef LOAD
    /* Optional: loads a kernel fully when the driver loads modules lazily
     * (CUDA_MODULE_LOADING=LAZY, the default since 12.2), so that no kernel is
     * first loaded inside a stream capture. */
    *(void **)(&api.FuncLoad) = dlsym(lib_handle, "cuFuncLoad");
    ampx_cu_result rc = api.Init(0);
    if (rc != AMPX_CUDA_SUCCESS) {
        set_cu(e, rc, "cuInit");
        goto fail;
    }
    if ((rc = api.DriverGetVersion(&driver_version)) != AMPX_CUDA_SUCCESS) {
        set_cu(e, rc, "cuDriverGetVersion");
        goto fail;
    }
    if ((rc = api.DeviceGetCount(&device_count)) != AMPX_CUDA_SUCCESS) {
        set_cu(e, rc, "cuDeviceGetCount");
        goto fail;
    }
    if (device_count <= 0) {
        set_msg(e, AMPX_CU_E_AMPX, "the NVIDIA driver sees no CUDA device");
        goto fail;
    }
    devices = (ampx_cu_dev *)calloc((size_t)device_count, sizeof *devices);
    if (devices == NULL) {
        set_msg(e, AMPX_CU_E_AMPX, "out of memory");
        goto fail;
    }
    driver_state = 1;
    return 0;
fail:
    /* A failed load is final for the process (as torch's own CUDA init). The
     * library stays open if it opened: symbols may have been resolved. */
    memset(&api, 0, sizeof api);
    driver_state = -1;
    *err = driver_error;
    return -1;
}

int ampx_cu_driver_version(void) { return driver_state == 1 ? driver_version : 0; }

static int check_ordinal(int ordinal, ampx_cu_error *err)
{
    if (ordinal < 0 || ordinal >= device_count) {
        set_msg(err, AMPX_CU_E_AMPX, "CUDA device %d does not exist (the driver sees %d)", ordinal, device_count);
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
    CU_TRY(api.ModuleGetFunction(&d->update, d->mod, "ampx_k_update_scale"),
           "cuModuleGetFunction(ampx_k_update_scale)");
    if (api.FuncLoad != NULL) {
        for (int r = 0; r < AMPX_NUM_REDUCE; r++)
            for (int w = 0; w < 2; w++)
                for (int s = 0; s < 2; s++)
                    if (d->scale[r][w][s] != NULL)
                        CU_TRY(api.FuncLoad(d->scale[r][w][s]), "cuFuncLoad");
        CU_TRY(api.FuncLoad(d->cast), "cuFuncLoad");
        CU_TRY(api.FuncLoad(d->update), "cuFuncLoad");
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

/* The fatbin holds SASS for 8.0 (runs on every 8.x), 8.6, 8.9, 9.0 and PTX
 * for 9.0 (compiled by the driver for anything newer). */
static int cc_supported(int major) { return major >= 8; }

ampx_cu_dev *ampx_cu_device_get(int ordinal, ampx_cu_error *err)
{
    if (ampx_cu_driver(err) < 0 || check_ordinal(ordinal, err) < 0)
        return NULL;
    ampx_cu_dev *d = &devices[ordinal];
    if (d->loaded)
        return d;
    if (!ampx_cu_have_image()) {
        set_msg(err, AMPX_CU_E_AMPX, "ampx was built without its CUDA kernels (no fatbin)");
        return NULL;
    }
    int retained = 0, pushed = 0;
    ampx_cu_context popped;
    memset(d, 0, sizeof *d);
    d->ordinal = ordinal;
    CU_TRY(api.DeviceGet(&d->dev, ordinal), "cuDeviceGet");
    if (read_cc(d->dev, &d->cc_major, &d->cc_minor, err) < 0)
        goto fail;
    if (!cc_supported(d->cc_major)) {
        set_msg(err, AMPX_CU_E_AMPX,
                "CUDA device %d has compute capability %d.%d; ampx's kernels need 8.0 or newer", ordinal,
                d->cc_major, d->cc_minor);
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
            if (rc == AMPX_CUDA_ERROR_NO_BINARY_FOR_GPU) {
                size_t n = strlen(err->msg);
                snprintf(err->msg + n, sizeof err->msg - n,
                         "; the fatbin holds sm_80, sm_86, sm_89, sm_90 and compute_90 code, device %d is %d.%d",
                         ordinal, d->cc_major, d->cc_minor);
            }
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
    d->loaded = 1;
    return d;
fail:
    if (pushed)
        api.CtxPopCurrent(&popped);
    if (retained)
        api.DevicePrimaryCtxRelease(d->dev);
    memset(d, 0, sizeof *d);
    return NULL;
}

int ampx_cu_probe(int ordinal, ampx_cu_error *err)
{
    if (ampx_cu_driver(err) < 0 || check_ordinal(ordinal, err) < 0)
        return -1;
    if (devices[ordinal].loaded)
        return 0;
    ampx_cu_device dev;
    int major = 0, minor = 0, active = 0;
    unsigned int flags = 0;
    CU_TRY(api.DeviceGet(&dev, ordinal), "cuDeviceGet");
    if (read_cc(dev, &major, &minor, err) < 0)
        return -1;
    if (!cc_supported(major)) {
        set_msg(err, AMPX_CU_E_AMPX, "CUDA device %d has compute capability %d.%d; ampx's kernels need 8.0 or newer",
                ordinal, major, minor);
        return -1;
    }
    CU_TRY(api.DevicePrimaryCtxGetState(dev, &flags, &active), "cuDevicePrimaryCtxGetState");
    if (active) /* the context exists already: loading the kernels costs nothing more */
        return ampx_cu_device_get(ordinal, err) != NULL ? 0 : -1;
    return 0;
fail:
    return -1;
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
