/*
 * tensor_meta.h: reading one tensor's metadata through its Python attributes,
 * and the checks and error texts that go with it (tensor_meta.c).
 *
 * Every function here needs the GIL, returns 0 (or a value) on success and
 * -1 with a Python exception set on failure, and borrows its arguments:
 * nothing it returns is owned by the caller except where it says "new
 * reference".
 *
 * Devices: `device` is -1 for a call on the CPU, else the index of the CUDA
 * device the call runs on. A tensor elsewhere is a ValueError naming the
 * argument, its position and both devices.
 */
#ifndef AMPX_TENSOR_META_H
#define AMPX_TENSOR_META_H

#include <stdint.h>

#include "state.h"

/* Device keys of tensor_device_key: a CUDA device's index, or one of these. */
enum { AMPX_DEVICE_CPU = -1, AMPX_DEVICE_OTHER = -2 };

/* Where tensor t lives, as a device key (meta, XLA, ... are AMPX_DEVICE_OTHER):
 * through the torch C shim for plain tensors, else the attributes. */
int tensor_device_key(mstate *st, PyObject *t, int *key);

/* Calls obj.<name>() (new reference, NULL on error). */
PyObject *call0(PyObject *obj, PyObject *name);
/* The truth of r, a new reference it consumes (NULL: an error already set), into *out; -1 on error. */
int take_bool(PyObject *r, int *out);

/* obj.<method>() as an int64. */
int get_int64(PyObject *obj, PyObject *method, int64_t *out);

/* Whether t is a plain torch.Tensor or Parameter: the tensors the shim reads. */
static inline int tensor_is_plain(mstate *st, PyObject *t)
{
    return Py_TYPE(t) == (PyTypeObject *)st->tensor_type || Py_TYPE(t) == (PyTypeObject *)st->param_type;
}

/* Checks that the bytes [lo, hi) that tensor t's elements span (element size
 * es, lo its first element) lie inside t's storage, before any kernel or copy
 * touches them: a storage shrunk under its tensor (untyped_storage().resize_())
 * holds fewer bytes than the tensor's shape says. Raises RuntimeError naming
 * arg[i] (arg alone when i < 0). */
int check_in_storage(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, uintptr_t lo,
                     uintptr_t hi, int64_t es);

/* Puts "op: arg[i]: " ("op: arg: " when i < 0) before the message of the
 * exception being raised, unless it names op already; keeps its type and
 * chains the original as its cause. Returns -1. */
int add_context(const char *op, const char *arg, Py_ssize_t i);

/* The data pointer of a tensor known to hold elements; a NULL one (a wrapper
 * subclass without storage of its own, such as DTensor) is a LayoutError. */
int get_data_ptr(mstate *st, PyObject *t, char **out);

/* "float32", ... for an AMPX_DTYPE_LIST code. */
const char *dtype_name(int code);

/* The dtype code of t, or -1 with TypeError for an unsupported dtype. */
int dtype_code(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t);

/* Checks that arg[i] (tensor t, element size es) is on `device` and strided;
 * reads its numel and whether it is contiguous. Raises for any other device
 * or layout (sparse, ...). */
int tensor_meta(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, int64_t es, int device,
                int64_t *numel, int *contig);

/* Whether t has torch's negative bit (its values are the negation of what its
 * memory holds: torch._neg_view, conj().imag). */
int neg_flag(mstate *st, PyObject *t, unsigned char *out);

/* The memory a non-contiguous strided tensor's elements span, [lo, hi),
 * whether two of its elements may share an address (a sufficient test), and
 * a fingerprint of its sizes and strides. */
int strided_extent(mstate *st, PyObject *t, int64_t es, uintptr_t *lo, uintptr_t *hi, int *overlap,
                   uint64_t *layout);

/* A small auxiliary tensor (scale, found_inf, an output) named `name`: a
 * torch.Tensor of `dtype` on `device` with `numel` elements, contiguous.
 * *ptr is its data pointer (a host or device address; NULL when empty). */
int aux_ptr(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype, int64_t numel,
            int device, void **ptr);
/* aux_ptr for an optional one: None gives *ptr = NULL. */
int opt_aux(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype, int64_t numel,
            int device, void **ptr);

/* A factor: None (1.0), a Python number, or a 1-element float32 tensor. A CPU
 * tensor is read now; on a CUDA call a tensor on its device is left for the
 * kernels to read: *ptr is its address (else NULL) and *val is 1.0. */
int parse_factor(mstate *st, const char *op, const char *name, PyObject *o, int device, double *val,
                 void **ptr);

/* The Python functions of the shim's start-up probe (module.c's table). */
PyObject *py_enable_tensor_shim(PyObject *module, PyObject *args);
PyObject *py_set_tensor_shim(PyObject *module, PyObject *args);
PyObject *py_tensor_shim_storage_offset(PyObject *module, PyObject *unused);

/* Version counters and inference mode (torch_shim.h): the Python functions
 * ops.py hands over and its start-up probe's helpers. */
PyObject *py_set_autograd(PyObject *module, PyObject *args);
PyObject *py_shim_version_counter(PyObject *module, PyObject *t);
PyObject *py_shim_bump(PyObject *module, PyObject *t);
PyObject *py_shim_inference_mode(PyObject *module, PyObject *unused);
PyObject *py_set_versions(PyObject *module, PyObject *args);

#endif /* AMPX_TENSOR_META_H */
