/*
 * torch_shim.c: the fast read of a tensor's metadata (see torch_shim.h).
 */
#define Py_LIMITED_API 0x03090000
#include "torch_shim.h"

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include "ampx_numerics.h"

#if defined(__linux__) || defined(__FreeBSD__) || defined(__APPLE__)
#include <dlfcn.h>
#define AMPX_HAVE_DLOPEN 1
#endif

/* The shim's calls return 0 (AOTI_TORCH_SUCCESS) or 1 and write through their
 * last argument; its constant functions return torch's enum values. */
typedef int32_t (*shim_i32_fn)(void);
typedef int32_t (*shim_ptr_fn)(void *, void **);
typedef int32_t (*shim_i64_fn)(void *, int64_t *);
typedef int32_t (*shim_get_i32_fn)(void *, int32_t *);
typedef int32_t (*shim_bool_fn)(void *, bool *);
typedef int32_t (*shim_reinterpret_fn)(void *, int64_t, const int64_t *, const int64_t *, int64_t, void **);
typedef int32_t (*shim_delete_fn)(void *);

static struct {
    int opened, enabled, probed;
    shim_ptr_fn data_ptr;
    shim_i64_fn numel;
    shim_get_i32_fn dtype, device_type, device_index, layout;
    shim_bool_fn contiguous;
    int32_t dt[AMPX_NUM_DTYPES]; /* torch's dtype value for each ampx code */
    int32_t cpu, cuda, strided;
    int storage_offset; /* byte offset of the StorageImpl pointer in a TensorImpl, or -1 */
    /* autograd's version counters (optional: exported C++ functions, see torch_shim.h) */
    const void *(*version_counter)(const void *);
    void (*bump_version)(const void *);
    bool (*inference_mode)(void);
    int versions_on;
    /* holding a storage (optional) */
    shim_reinterpret_fn reinterpret;
    shim_delete_fn delete_tensor;
    shim_i64_fn storage_offset_of, storage_size;
} S = {.storage_offset = -1};

int ampx_shim_enabled(void) { return S.enabled; }
int ampx_shim_opened(void) { return S.opened; }
void ampx_shim_set_enabled(int on) { S.enabled = on && S.opened && S.probed; }
int ampx_shim_probed(void) { return S.opened && S.probed; }
void ampx_shim_set_probed(int passed)
{
    S.probed = passed;
    if (!passed)
        S.enabled = 0;
}

/* Looks up names[0..n) in h into the function-pointer fields slots[0..n)
 * (each the size of a pointer): all of them, or none when one is missing. */
static void look_up_all(void *h, const char *const *names, void *const *slots, int n)
{
#ifdef AMPX_HAVE_DLOPEN
    void *found[8];
    for (int k = 0; k < n; k++)
        if ((found[k] = dlsym(h, names[k])) == NULL)
            return;
    for (int k = 0; k < n; k++)
        memcpy(slots[k], &found[k], sizeof found[k]);
#else
    (void)h, (void)names, (void)slots, (void)n;
#endif
}

/* The functions that hold a storage (torch_shim.h); any missing leaves holds
 * to Python. */
static void open_holds(void *h)
{
    static const char *const names[] = {"aoti_torch__reinterpret_tensor", "aoti_torch_delete_tensor_object"};
    void *const slots[] = {&S.reinterpret, &S.delete_tensor};
    look_up_all(h, names, slots, 2);
}

/* The version-counter functions (torch_shim.h); any missing leaves them off.
 * Itanium-mangled names of functions taking `const at::Tensor&`, which is the
 * address of an at::Tensor: what ampx_shim_handle returns. The last is in
 * libc10, a dependency that dlsym searches too. */
static void open_versions(void *h)
{
    static const char *const names[] = {"_ZN5torch8autograd4impl15version_counterERKN2at6TensorE",
                                        "_ZN5torch8autograd4impl12bump_versionERKN2at6TensorE",
                                        "_ZN3c1013InferenceMode10is_enabledEv"};
    void *const slots[] = {(void *)&S.version_counter, (void *)&S.bump_version, (void *)&S.inference_mode};
    look_up_all(h, names, slots, 3);
}

int ampx_shim_versions_found(void) { return S.opened && S.version_counter != NULL; }
/* (Stored apart from the probe's verdict: a failed re-probe turns the route
 * off, and a passing one brings back what was chosen.) */
int ampx_shim_versions_on(void) { return S.versions_on && ampx_shim_probed(); }
void ampx_shim_set_versions_on(int on) { S.versions_on = on && ampx_shim_versions_found() && ampx_shim_probed(); }

uintptr_t ampx_shim_version_counter(const void *handle)
{
    /* version_counter() returns the TensorImpl's VariableVersion, whose one
     * member is the intrusive pointer to the counter: null for an inference
     * tensor. */
    uintptr_t w;
    memcpy(&w, S.version_counter(handle), sizeof w);
    return w;
}

void ampx_shim_bump(const void *handle) { S.bump_version(handle); }

int ampx_shim_inference_mode(void) { return S.inference_mode() ? 1 : 0; }

void *ampx_shim_hold_storage(PyObject *t, uintptr_t *base, uintptr_t *end)
{
    if (S.reinterpret == NULL)
        return NULL;
    /* A one-element view at the storage's start: a new TensorImpl (torch's
     * _reinterpret_tensor) sharing t's StorageImpl, whose data pointer is the
     * storage's first byte. */
    void *h = ampx_shim_handle(t), *alias = NULL, *p = NULL;
    int64_t off = 0, nbytes = 0;
    const int64_t size = 1, stride = 1;
    if (S.storage_offset_of(h, &off) != 0 || S.reinterpret(h, 1, &size, &stride, -off, &alias) != 0)
        return NULL;
    if (S.storage_size(alias, &nbytes) != 0 || nbytes < 0 || (nbytes > 0 && S.data_ptr(alias, &p) != 0)) {
        S.delete_tensor(alias);
        return NULL;
    }
    *base = (uintptr_t)p;
    *end = *base + (uintptr_t)nbytes;
    return alias;
}

void ampx_shim_release(void *alias)
{
    if (alias != NULL)
        S.delete_tensor(alias);
}

uintptr_t ampx_shim_storage_word(PyObject *t)
{
    if (S.storage_offset < 0)
        return 0;
    uintptr_t impl = ampx_shim_impl_word(t), storage;
    memcpy(&storage, (const char *)impl + S.storage_offset, sizeof storage);
    return storage;
}

const char *ampx_shim_open(const char *path)
{
#ifndef AMPX_HAVE_DLOPEN
    (void)path;
    return "no dlopen on this platform";
#else
    if (S.opened)
        return NULL;
    /* RTLD_NOLOAD: only a library that torch has loaded already. The handle
     * is kept: it pins a library that stays loaded anyway. */
    void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL)
        return "torch's library is not loaded at the expected path";
#define SYM(field, type, name)                                                                     \
    do {                                                                                           \
        void *p_ = dlsym(h, name);                                                                 \
        if (p_ == NULL)                                                                            \
            return "this torch lacks the shim function " name;                                    \
        memcpy(&field, &p_, sizeof field);                                                         \
    } while (0)
    shim_i32_fn dt_f32, dt_f16, dt_bf16, dt_f64, cpu, cuda, strided;
    SYM(S.data_ptr, shim_ptr_fn, "aoti_torch_get_data_ptr");
    SYM(S.numel, shim_i64_fn, "aoti_torch_get_numel");
    SYM(S.dtype, shim_get_i32_fn, "aoti_torch_get_dtype");
    SYM(S.device_type, shim_get_i32_fn, "aoti_torch_get_device_type");
    SYM(S.device_index, shim_get_i32_fn, "aoti_torch_get_device_index");
    SYM(S.layout, shim_get_i32_fn, "aoti_torch_get_layout");
    SYM(S.contiguous, shim_bool_fn, "aoti_torch_is_contiguous");
    SYM(S.storage_offset_of, shim_i64_fn, "aoti_torch_get_storage_offset");
    SYM(S.storage_size, shim_i64_fn, "aoti_torch_get_storage_size");
    SYM(dt_f32, shim_i32_fn, "aoti_torch_dtype_float32");
    SYM(dt_f16, shim_i32_fn, "aoti_torch_dtype_float16");
    SYM(dt_bf16, shim_i32_fn, "aoti_torch_dtype_bfloat16");
    SYM(dt_f64, shim_i32_fn, "aoti_torch_dtype_float64");
    SYM(cpu, shim_i32_fn, "aoti_torch_device_type_cpu");
    SYM(cuda, shim_i32_fn, "aoti_torch_device_type_cuda");
    SYM(strided, shim_i32_fn, "aoti_torch_layout_strided");
#undef SYM
    S.dt[AMPX_F32] = dt_f32();
    S.dt[AMPX_F16] = dt_f16();
    S.dt[AMPX_BF16] = dt_bf16();
    S.dt[AMPX_F64] = dt_f64();
    S.cpu = cpu();
    S.cuda = cuda();
    S.strided = strided();
    S.opened = 1;
    open_versions(h);
    open_holds(h);
    return NULL;
#endif
}

/* A plain torch.Tensor is a Python object header followed by its at::Tensor,
 * itself one pointer to the TensorImpl (torch 2.10 and later; before, a
 * MaybeOwned<Tensor> stood there, which the start-up probe rejects). */
void *ampx_shim_handle(PyObject *t) { return (char *)t + sizeof(PyObject); }

uintptr_t ampx_shim_impl_word(PyObject *t)
{
    uintptr_t w;
    memcpy(&w, ampx_shim_handle(t), sizeof w);
    return w;
}

int ampx_shim_read(PyObject *t, ampx_shim_meta *m)
{
    void *h = ampx_shim_handle(t);
    int32_t v = 0, dev = 0;
    bool contig = false;
    /* Order matters: the layout first (contiguity is undefined for sparse
     * tensors), the device before the data pointer (a meta tensor has none),
     * and the data pointer last. A failed call only sends the tensor down the
     * slow path, which then raises the proper error. */
    if (S.layout(h, &v) != 0 || v != S.strided)
        return 0;
    if (S.dtype(h, &v) != 0)
        return 0;
    m->dtype = -1;
    for (int k = 0; k < AMPX_NUM_DTYPES; k++)
        if (v == S.dt[k])
            m->dtype = k;
    if (m->dtype < 0)
        return 0;
    if (S.device_type(h, &dev) != 0)
        return 0;
    m->device_index = -1;
    if (dev == S.cpu)
        m->device_type = AMPX_SHIM_CPU;
    else if (dev == S.cuda) {
        m->device_type = AMPX_SHIM_CUDA;
        if (S.device_index(h, &v) != 0)
            return 0;
        m->device_index = v;
    } else
        return 0;
    if (S.contiguous(h, &contig) != 0 || !contig)
        return 0;
    m->contiguous = 1;
    if (S.numel(h, &m->numel) != 0 || m->numel < 0)
        return 0;
    m->ptr = NULL;
    if (m->numel == 0)
        return 1;
    void *p = NULL;
    if (S.data_ptr(h, &p) != 0 || p == NULL || ampx_shim_in_storage(t, m->numel, ampx_elem_size(m->dtype)) != 1)
        return 0;
    m->ptr = (char *)p;
    return 1;
}

int ampx_shim_in_storage(PyObject *t, int64_t count, int64_t es)
{
    void *h = ampx_shim_handle(t);
    int64_t off = 0, nbytes = 0;
    if (S.storage_offset_of(h, &off) != 0 || S.storage_size(h, &nbytes) != 0)
        return -1;
    /* off * es and count * es stay below nbytes here, so neither can overflow. */
    return off >= 0 && nbytes >= 0 && off <= nbytes / es && count <= (nbytes - off * es) / es;
}

void ampx_shim_set_storage_offset(int offset) { S.storage_offset = offset; }
int ampx_shim_storage_offset(void) { return S.storage_offset; }

int ampx_shim_find_word(uintptr_t impl, uintptr_t storage)
{
    for (int k = 0; k < 64; k += (int)sizeof(uintptr_t)) {
        uintptr_t w;
        memcpy(&w, (const char *)impl + k, sizeof w);
        if (w == storage)
            return k;
    }
    return -1;
}

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#else
#define PREFETCH(p) ((void)(p))
#endif

void ampx_shim_prefetch1(PyObject *t) { PREFETCH(t); }

void ampx_shim_prefetch2(PyObject *t)
{
    const char *impl = (const char *)ampx_shim_impl_word(t);
    for (int l = 0; l < 4; l++)
        PREFETCH(impl + 64 * l);
}

void ampx_shim_prefetch3(PyObject *t)
{
    uintptr_t storage = ampx_shim_storage_word(t);
    if (storage == 0)
        return;
    PREFETCH(storage);
    PREFETCH(storage + 64);
}
