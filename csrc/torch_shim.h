/*
 * torch_shim.h: reading a tensor's metadata through torch's stable C shim.
 *
 * torch exports a C ABI for code compiled apart from it (the "aoti_torch_*"
 * functions of libtorch_cpu, which AOTInductor and torch's stable-ABI
 * extensions call): a tensor's data pointer, numel, dtype, device, layout and
 * contiguity, each one plain C call. ampx looks those functions up with dlsym
 * in the libtorch torch has already loaded (nothing is linked and no torch
 * header is used) and hands them the at::Tensor that sits right after the
 * Python object header of a plain torch.Tensor. Where that Tensor sits is the
 * one layout fact assumed; it is checked at start-up against torch's own
 * `_cdata` on a set of probe tensors, and the whole fast path stays off when
 * anything disagrees (docs/DESIGN.md, "Reading tensors").
 *
 * Used only for tensors whose Python type is exactly torch.Tensor or
 * torch.nn.Parameter; every other tensor, and every tensor the fast read does
 * not fully accept, takes the Python-attribute path, which raises the errors.
 */
#ifndef AMPX_TORCH_SHIM_H
#define AMPX_TORCH_SHIM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* What the fast read learned of one tensor. */
typedef struct {
    int dtype;        /* ampx dtype code (AMPX_F32, ...), or -1 for any other dtype */
    int device_type;  /* AMPX_SHIM_CPU, AMPX_SHIM_CUDA or AMPX_SHIM_OTHER */
    int device_index; /* CUDA only */
    int contiguous;
    int64_t numel;
    char *ptr;        /* NULL when numel == 0 */
} ampx_shim_meta;

enum { AMPX_SHIM_CPU = 0, AMPX_SHIM_CUDA = 1, AMPX_SHIM_OTHER = 2 };

/* Looks the shim functions up in the already loaded library at `path`.
 * Returns NULL on success, else a static string saying why not (the fast
 * path then stays off). Touches no Python state. */
const char *ampx_shim_open(const char *path);

/* Whether the fast read is on: ampx_shim_open succeeded, the start-up probe
 * passed, and nobody turned it off since. */
int ampx_shim_enabled(void);
void ampx_shim_set_enabled(int on);
int ampx_shim_opened(void);
/* Whether the last start-up probe (tensor_meta.c's _enable_tensor_shim)
 * passed: every C route that reads a tensor through the shim's layout (the
 * fast read, the version counters) stays off while it has not. A new probe
 * clears it first, so one that fails or raises leaves those routes off. */
int ampx_shim_probed(void);
void ampx_shim_set_probed(int passed);

/* Reads tensor object t (a plain torch.Tensor or Parameter: the caller checks
 * the type). Returns 1 when every field was read and the tensor is a strided
 * tensor that the kernels can use as is (supported dtype, contiguous, a data
 * pointer when it holds elements); 0 when the caller must take the slow path.
 * Never raises; never calls into Python. */
int ampx_shim_read(PyObject *t, ampx_shim_meta *m);

/* Whether `count` elements of size es from t's first element lie inside t's
 * storage (never true of a tensor whose storage was shrunk under it with
 * untyped_storage().resize_()): 1 yes, 0 no, -1 unknown (a shim call failed). For a plain tensor
 * the start-up probe accepted. */
int ampx_shim_in_storage(PyObject *t, int64_t count, int64_t es);

/* The address of the at::Tensor inside t, as the shim functions take it. */
void *ampx_shim_handle(PyObject *t);

/* The raw word where the at::Tensor of t is assumed to sit (its TensorImpl
 * pointer): compared with torch's `_cdata` by the start-up probe. */
uintptr_t ampx_shim_impl_word(PyObject *t);

/* Records where a TensorImpl holds its storage's address (a byte offset found
 * by the start-up probe), or -1. Used only to aim prefetches. */
void ampx_shim_set_storage_offset(int offset);
int ampx_shim_storage_offset(void);

/* Searches impl's first 64 bytes for the word `storage`; returns its byte
 * offset or -1. Reads only memory inside a live TensorImpl (which is larger
 * than that: vtable, reference counts, storage, sizes and strides, ...). */
int ampx_shim_find_word(uintptr_t impl, uintptr_t storage);

/* Prefetch stages for a plain tensor t that will be read a few tensors from
 * now: reading a list of tensors is bound by memory latency when their
 * objects lie scattered (each tensor's Python object, TensorImpl and
 * StorageImpl on different pages, one dependent miss after another), and the
 * shim's calls do too much work per tensor for the processor to overlap those
 * misses on its own. Stage 1 asks for the object, stage 2 (a few tensors
 * later) for its TensorImpl, stage 3 for its StorageImpl. Prefetches never
 * fault; the stages load only words the earlier stages brought in. */
void ampx_shim_prefetch1(PyObject *t);
void ampx_shim_prefetch2(PyObject *t);
void ampx_shim_prefetch3(PyObject *t);

/* Holding a tensor's storage while the GIL is released: `t.data = other`
 * (another thread) swaps the StorageImpl inside t's own TensorImpl, so holding
 * t (or its TensorImpl) does not keep the old memory alive. A second
 * TensorImpl sharing the StorageImpl does: ampx_shim_hold_storage makes one
 * (a one-element view at the storage's start, through
 * aoti_torch__reinterpret_tensor) and returns its handle, the storage's
 * bytes in [*base, *end), or NULL when it cannot (the caller then holds it
 * from Python); ampx_shim_release deletes it (with the GIL held: it may free
 * the storage). */
void *ampx_shim_hold_storage(PyObject *t, uintptr_t *base, uintptr_t *end);
void ampx_shim_release(void *alias);
/* The StorageImpl address of plain tensor t (the probe's offset), 0 when
 * unknown: tells which consecutive tensors share one storage. */
uintptr_t ampx_shim_storage_word(PyObject *t);

/* Autograd's version counters and inference mode, from three exported C++
 * functions of libtorch/libc10 (torch::autograd::impl::version_counter and
 * bump_version, c10::InferenceMode::is_enabled), found with dlsym beside the
 * shim; each takes or returns plain pointers. They are used only once a
 * start-up probe (ampx/ops.py) saw them agree with torch's Python view on
 * probe tensors (ampx_shim_set_versions_on), only while the shim's own probe
 * stands passed (ampx_shim_probed), and only on plain tensors.
 * bump_version throws (which C cannot survive) only for an undefined tensor
 * or one with no counter (an inference tensor) outside inference mode: the
 * callers bump only tensors whose counter they saw non-null. */
int ampx_shim_versions_found(void);
int ampx_shim_versions_on(void);
void ampx_shim_set_versions_on(int on);
/* The address of the counter of the tensor whose at::Tensor is at handle (0
 * for an inference tensor, which has none). */
uintptr_t ampx_shim_version_counter(const void *handle);
/* Adds one to the version of the tensor at handle; its counter must be non-null. */
void ampx_shim_bump(const void *handle);
/* Whether torch.inference_mode() is on in the calling thread. */
int ampx_shim_inference_mode(void);

#endif /* AMPX_TORCH_SHIM_H */
