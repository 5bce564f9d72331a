/*
 * module.c: ampx._C, the C extension behind ampx.ops.
 *
 * Written against the limited C API of Python 3.9 (one abi3 build serves
 * every later Python) and without any torch header, so one build serves
 * every torch version too. A plain tensor's metadata is read through torch's
 * stable C shim when the start-up probe allows it (torch_shim.h); any other
 * tensor through its Python attributes (dtype, is_cpu, nbytes,
 * is_contiguous(), data_ptr()).
 *
 * Each entry point validates every argument before any memory is written,
 * so bad input raises a Python exception and leaves the tensors untouched.
 * Kernels then run with the GIL released (above GIL_RELEASE_MIN elements).
 *
 * The functions here are private; ampx/ops.py is the public, documented API
 * and passes its arguments positionally.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ampx_numerics.h"
#include "cpu_dispatch.h"
#include "cuda_driver.h"
#include "multi_tensor.h"
#include "threadpool.h"
#include "torch_shim.h"

/* Below this many elements a call keeps the GIL: releasing it costs more. */
#define GIL_RELEASE_MIN ((int64_t)1 << 14)

typedef struct {
    PyObject *tensor_type; /* torch.Tensor */
    PyObject *param_type;  /* torch.nn.Parameter: read through the shim too (see tlist_gather) */
    PyObject *descr_is_neg; /* TensorBase.is_neg, called on casts' tensors */
    PyObject *dtypes[AMPX_NUM_DTYPES];
    PyObject *dtype_u8, *dtype_i32;
    PyObject *strided;          /* torch.strided */
    /* Hot per-tensor attributes, read through their getset descriptors when the
     * running Python lets the limited API reach the getter (3.10+), else by
     * name: the descriptor call skips the attribute lookup on every tensor. */
    PyObject *descr[3];         /* TensorBase.dtype, .is_cpu, .nbytes */
    descrgetfunc getter[3];
    PyObject *layout_error;     /* ampx._C.LayoutError, a ValueError */
    /* The CUDA path: TensorBase.is_cuda (fetched on first use), its getter. */
    PyObject *descr_is_cuda;
    descrgetfunc getter_is_cuda;
    PyObject *s_get_device;
    PyObject *s_dtype, *s_is_cpu, *s_is_cuda, *s_device, *s_layout, *s_numel, *s_is_contiguous,
        *s_data_ptr, *s_contiguous, *s_copy_, *s_grad, *s_params, *s_size, *s_stride, *s_nbytes,
        *s_cdata, *s_resolve_neg, *s_detach;
} mstate;

/* Py_NewRef and Py_XSETREF are not in the 3.9 limited API. */
static PyObject *new_ref(PyObject *o)
{
    Py_INCREF(o);
    return o;
}

static void set_ref(PyObject **slot, PyObject *o)
{
    PyObject *old = *slot;
    Py_INCREF(o);
    *slot = o;
    Py_XDECREF(old);
}

static mstate *get_state(PyObject *module) { return (mstate *)PyModule_GetState(module); }

enum { A_DTYPE = 0, A_IS_CPU = 1, A_NBYTES = 2 };

/* Reads a hot attribute of tensor t (new reference, NULL on error). */
static PyObject *hot_attr(mstate *st, int k, PyObject *t)
{
    if (st->getter[k] != NULL)
        return st->getter[k](st->descr[k], t, (PyObject *)Py_TYPE(t));
    PyObject *name = k == A_DTYPE ? st->s_dtype : k == A_IS_CPU ? st->s_is_cpu : st->s_nbytes;
    return PyObject_GetAttr(t, name);
}

#define X_DTYPE_NAME(code, torch_name, size) [AMPX_##code] = #torch_name,
static const char *const dtype_names[AMPX_NUM_DTYPES] = {AMPX_DTYPE_LIST(X_DTYPE_NAME)};
#undef X_DTYPE_NAME

static int require_init(mstate *st)
{
    if (st->tensor_type != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "ampx._C is not initialised: import ampx, not ampx._C");
    return -1;
}

/* ---- small helpers over tensor attributes --------------------------------- */

/* Calls a no-argument method and returns a new reference (NULL on error). */
static PyObject *call0(PyObject *obj, PyObject *name) { return PyObject_CallMethodObjArgs(obj, name, NULL); }

static int get_int64(PyObject *obj, PyObject *method, int64_t *out)
{
    PyObject *r = call0(obj, method);
    if (r == NULL)
        return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int get_bool_attr(PyObject *obj, PyObject *name, int *out)
{
    PyObject *r = PyObject_GetAttr(obj, name);
    if (r == NULL)
        return -1;
    int v = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (v < 0)
        return -1;
    *out = v;
    return 0;
}

/* The data pointer of a tensor known to hold elements. A wrapper subclass
 * without storage of its own (DTensor, jagged NestedTensor, ...) reports
 * numel() > 0 but a NULL pointer: refused with LayoutError, never written. */
static int get_data_ptr(mstate *st, PyObject *t, char **out)
{
    PyObject *r = call0(t, st->s_data_ptr);
    if (r == NULL)
        return -1;
    void *p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (p == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(st->layout_error,
                         "a %R has no storage of its own (a wrapper subclass such as DTensor); "
                         "pass its local tensor (for a DTensor: .to_local())",
                         (PyObject *)Py_TYPE(t));
        return -1;
    }
    *out = (char *)p;
    return 0;
}

/* Raises the ValueError for a tensor that is not on the CPU. */
static int device_error(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t)
{
    PyObject *dev = PyObject_GetAttr(t, st->s_device);
    if (dev == NULL)
        return -1;
    int cuda = 0;
    if (get_bool_attr(t, st->s_is_cuda, &cuda) < 0) {
        Py_DECREF(dev);
        return -1;
    }
    if (cuda)
        PyErr_Format(PyExc_ValueError,
                     "%s: %s[%zd] is on %S, but this call runs on the CPU (the device of its first "
                     "tensor); the tensors of one call must all be on one device",
                     op, arg, i, dev);
    else
        PyErr_Format(PyExc_ValueError, "%s: %s[%zd] is on device %S; ampx works on CPU and CUDA tensors",
                     op, arg, i, dev);
    Py_DECREF(dev);
    return -1;
}

/* Returns the dtype code of t, or -1 (TypeError set) for an unsupported one. */
static int dtype_code(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t)
{
    PyObject *dt = hot_attr(st, A_DTYPE, t);
    if (dt == NULL)
        return -1;
    int code = -1;
    for (int k = 0; k < AMPX_NUM_DTYPES; k++)
        if (dt == st->dtypes[k])
            code = k;
    if (code < 0)
        PyErr_Format(PyExc_TypeError,
                     "%s: %s[%zd] has dtype %S; expected float32, float16, bfloat16 or float64", op,
                     arg, i, dt);
    Py_DECREF(dt);
    return code;
}

/* Returns 0 if t is strided; else raises the ValueError naming its layout.
 * With `always`, raises even for a strided tensor (its check failed). */
static int layout_error(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, int always)
{
    PyObject *layout = PyObject_GetAttr(t, st->s_layout);
    if (layout == NULL)
        return -1;
    if (layout != st->strided || always)
        PyErr_Format(st->layout_error, "%s: %s[%zd] has layout %S; ampx works on strided (dense) tensors",
                     op, arg, i, layout);
    int bad = layout != st->strided || always;
    Py_DECREF(layout);
    return bad ? -1 : 0;
}

static int tensor_shape(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, int64_t es,
                        int64_t *numel, int *contig);

/* Checks that tensor t (of element size es) is on the CPU; reads its numel and contiguity.
 * A tensor without strides (sparse, ...) is refused with a ValueError. */
static int tensor_meta(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t,
                       int64_t es, int64_t *numel, int *contig)
{
    PyObject *r = hot_attr(st, A_IS_CPU, t);
    if (r == NULL)
        return -1;
    int cpu = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (cpu < 0)
        return -1;
    if (!cpu)
        return device_error(st, op, arg, i, t);
    return tensor_shape(st, op, arg, i, t, es, numel, contig);
}

/* The numel and contiguity of tensor t (of element size es), whatever its
 * device. A tensor without strides (sparse, ...) is refused with a ValueError. */
static int tensor_shape(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, int64_t es,
                        int64_t *numel, int *contig)
{
    PyObject *r;
    /* nbytes (a getset) is numel() * element size and cheaper to read than
     * numel(); sparse tensors refuse it, and are refused here by layout. */
    if ((r = hot_attr(st, A_NBYTES, t)) == NULL) {
        PyErr_Clear();
        if (layout_error(st, op, arg, i, t, 0) < 0 || get_int64(t, st->s_numel, numel) < 0)
            return -1;
    } else {
        long long nb = PyLong_AsLongLong(r);
        Py_DECREF(r);
        if (nb == -1 && PyErr_Occurred())
            return -1;
        *numel = (int64_t)nb / es;
    }
    r = call0(t, st->s_is_contiguous);
    if (r == NULL) {
        /* Sparse CSR and other unstrided layouts have no contiguity. */
        PyErr_Clear();
        return layout_error(st, op, arg, i, t, 1);
    }
    *contig = r == Py_True;
    Py_DECREF(r);
    if (!*contig) /* the slow path: rule out sparse COO, which reports False */
        return layout_error(st, op, arg, i, t, 0);
    return 0;
}

/* ---- the CUDA path: devices ------------------------------------------------ */

/* Fetches TensorBase.is_cuda and its getter on first use (the CUDA path's
 * hot attribute, read as the CPU path reads is_cpu). */
static int cuda_attrs(mstate *st)
{
    if (st->descr_is_cuda != NULL)
        return 0;
    PyObject *d = PyObject_GetAttrString(st->tensor_type, "is_cuda");
    if (d == NULL)
        return -1;
    st->getter_is_cuda = (descrgetfunc)PyType_GetSlot(Py_TYPE(d), Py_tp_descr_get);
    if (st->getter_is_cuda == NULL)
        PyErr_Clear(); /* Python 3.9: read the attribute by name */
    st->descr_is_cuda = d;
    return 0;
}

/* The CUDA device index of tensor t, or -1 when t is not a CUDA tensor. */
static int cuda_device_of(mstate *st, PyObject *t, int *index)
{
    PyObject *r = st->getter_is_cuda != NULL
                      ? st->getter_is_cuda(st->descr_is_cuda, t, (PyObject *)Py_TYPE(t))
                      : PyObject_GetAttr(t, st->s_is_cuda);
    if (r == NULL)
        return -1;
    int cuda = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (cuda < 0)
        return -1;
    if (!cuda) {
        *index = -1;
        return 0;
    }
    int64_t v = 0;
    if (get_int64(t, st->s_get_device, &v) < 0)
        return -1;
    *index = (int)v;
    return 0;
}

/* Raises the ValueError for a tensor that is not on CUDA device `device`. */
static int cuda_device_error(mstate *st, const char *op, const char *what, PyObject *t, int device)
{
    PyObject *dev = PyObject_GetAttr(t, st->s_device);
    if (dev == NULL)
        return -1;
    PyErr_Format(PyExc_ValueError,
                 "%s: %s is on %S, but this call runs on cuda:%d (the device of its first tensor); "
                 "all the tensors of one call must be on one device",
                 op, what, dev, device);
    Py_DECREF(dev);
    return -1;
}

/* tensor_meta for a call on CUDA device `device`. */
static int tensor_meta_cuda(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t,
                            int64_t es, int device, int64_t *numel, int *contig)
{
    int idx = -1;
    if (cuda_device_of(st, t, &idx) < 0)
        return -1;
    if (idx != device) {
        char what[64];
        snprintf(what, sizeof what, "%s[%zd]", arg, i);
        return cuda_device_error(st, op, what, t, device);
    }
    return tensor_shape(st, op, arg, i, t, es, numel, contig);
}

/* Validates a small auxiliary tensor (scale, found_inf, outputs) and returns
 * its data pointer: a contiguous CPU tensor of `dtype` with `numel` elements. */
static int aux_ptr(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype,
                   int64_t numel, void **ptr)
{
    if (!PyObject_TypeCheck(o, (PyTypeObject *)st->tensor_type)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a torch.Tensor, not %R", op, name,
                     (PyObject *)Py_TYPE(o));
        return -1;
    }
    PyObject *dt = PyObject_GetAttr(o, st->s_dtype);
    if (dt == NULL)
        return -1;
    if (dt != dtype) {
        PyErr_Format(PyExc_TypeError, "%s: %s must have dtype %S, not %S", op, name, dtype, dt);
        Py_DECREF(dt);
        return -1;
    }
    Py_DECREF(dt);
    int cpu = 0, contig = 0;
    int64_t n = 0;
    if (get_bool_attr(o, st->s_is_cpu, &cpu) < 0)
        return -1;
    if (!cpu) {
        PyObject *dev = PyObject_GetAttr(o, st->s_device);
        if (dev == NULL)
            return -1;
        PyErr_Format(PyExc_ValueError, "%s: %s is on %S, but the tensors are on the CPU", op, name, dev);
        Py_DECREF(dev);
        return -1;
    }
    if (get_int64(o, st->s_numel, &n) < 0)
        return -1;
    if (n != numel) {
        PyErr_Format(PyExc_ValueError, "%s: %s must have %lld element(s), not %lld", op, name,
                     (long long)numel, (long long)n);
        return -1;
    }
    PyObject *r = call0(o, st->s_is_contiguous);
    if (r == NULL)
        return -1;
    contig = r == Py_True;
    Py_DECREF(r);
    if (!contig) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be contiguous", op, name);
        return -1;
    }
    char *p = NULL;
    if (numel > 0 && get_data_ptr(st, o, &p) < 0) /* an empty output has no storage to point at */
        return -1;
    *ptr = p;
    return 0;
}

/* None -> 1.0; a Python number; or a 1-element float32 CPU tensor. */
static int parse_factor(mstate *st, const char *op, const char *name, PyObject *o, double *out)
{
    if (o == Py_None) {
        *out = 1.0;
        return 0;
    }
    if (PyFloat_Check(o) || PyLong_Check(o)) {
        double v = PyFloat_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred())
            return -1;
        *out = v;
        return 0;
    }
    void *p = NULL;
    if (aux_ptr(st, op, name, o, st->dtypes[AMPX_F32], 1, &p) < 0)
        return -1;
    *out = (double)*(const float *)p;
    return 0;
}

/* An optional output: None -> *ptr = NULL. */
static int opt_aux(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype,
                   int64_t numel, void **ptr)
{
    *ptr = NULL;
    if (o == Py_None)
        return 0;
    return aux_ptr(st, op, name, o, dtype, numel, ptr);
}

/* The memory a strided tensor's elements span, [lo, hi), and whether two of
 * its elements may share an address. torch strides are never negative, so
 * element 0 is the lowest address. The overlap test is a sufficient one:
 * with the dimensions of size > 1 ordered by stride, each stride must exceed
 * the span of all smaller ones; anything else (a zero stride, an interleaving
 * as_strided view) counts as possible overlap. Only the slow path (a
 * non-contiguous tensor) pays for it. Returns 0, or -1 with an exception. */
#define MAX_DIMS 64
static int strided_extent(mstate *st, PyObject *t, int64_t es, uintptr_t *lo, uintptr_t *hi, int *overlap,
                          uint64_t *layout)
{
    char *ptr = NULL;
    if (get_data_ptr(st, t, &ptr) < 0)
        return -1;
    PyObject *size = call0(t, st->s_size), *stride = size == NULL ? NULL : call0(t, st->s_stride);
    int rc = -1;
    int64_t sz[MAX_DIMS], sd[MAX_DIMS];
    if (stride == NULL)
        goto done;
    Py_ssize_t nd = PyTuple_Size(size);
    if (nd < 0 || PyTuple_Size(stride) != nd)
        goto done;
    if (nd > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "tensors with more than %d dimensions are not supported", MAX_DIMS);
        goto done;
    }
    int m = 0;
    int64_t maxoff = 0;
    uint64_t h = 1469598103934665603ull; /* FNV-1a over (size, stride) pairs: a layout fingerprint */
    for (Py_ssize_t k = 0; k < nd; k++) {
        long long a = PyLong_AsLongLong(PyTuple_GetItem(size, k));
        long long b = PyLong_AsLongLong(PyTuple_GetItem(stride, k));
        if ((a == -1 || b == -1) && PyErr_Occurred())
            goto done;
        h = (h ^ (uint64_t)a) * 1099511628211ull;
        h = (h ^ (uint64_t)b) * 1099511628211ull;
        if (a <= 1)
            continue;
        maxoff += (int64_t)(a - 1) * (int64_t)b;
        /* insertion sort by stride */
        int j = m++;
        while (j > 0 && sd[j - 1] > b) {
            sz[j] = sz[j - 1];
            sd[j] = sd[j - 1];
            j--;
        }
        sz[j] = a;
        sd[j] = b;
    }
    int64_t span = 0;
    *overlap = 0;
    for (int k = 0; k < m; k++) {
        if (sd[k] <= span)
            *overlap = 1;
        span += (sz[k] - 1) * sd[k];
    }
    *lo = (uintptr_t)ptr;
    *hi = *lo + (uintptr_t)((maxoff + 1) * es);
    *layout = h;
    rc = 0;
done:
    Py_XDECREF(size);
    Py_XDECREF(stride);
    return rc;
}

/* ---- gathering a list of tensors ------------------------------------------ */

typedef struct {
    Py_ssize_t n;
    PyObject *seq;         /* owned tuple of the tensors: keeps them alive while the GIL is released */
    ampx_tensor *ts;       /* n descriptors */
    unsigned char *nc;     /* n: non-contiguous (handled through a contiguous copy) */
    unsigned char *neg;    /* n: has torch's negative bit (read for casts only; else all 0) */
    PyObject **tmp;        /* n: owned contiguous copies, or NULL */
    uintptr_t *lo, *hi;    /* n: the memory each tensor's elements span (its own, not a copy's) */
    uint64_t *layout;      /* n: fingerprint of a non-contiguous tensor's sizes and strides (else 0) */
    int any_nc;
    int64_t total;         /* elements in all */
} tlist;

/* Item i of a gathered list (a borrowed reference the tuple keeps alive). */
static PyObject *seq_item(PyObject *seq, Py_ssize_t i) { return PyTuple_GetItem(seq, i); }

static void tlist_free(tlist *L)
{
    if (L->tmp != NULL)
        for (Py_ssize_t i = 0; i < L->n; i++)
            Py_XDECREF(L->tmp[i]);
    Py_XDECREF(L->seq);
    free(L->ts);
    free(L->nc);
    free(L->neg);
    free(L->tmp);
    free(L->lo);
    free(L->hi);
    free(L->layout);
    memset(L, 0, sizeof *L);
}

/* Copies `staged` (where a kernel wrote) back into tensor t, outside autograd
 * (through t.detach(), which keeps t's memory and negative bit): the kernels
 * bypass autograd, and a leaf that requires grad (a Parameter, or a view of
 * one) would otherwise refuse the copy after other tensors had been written. */
static int copy_back(mstate *st, PyObject *t, PyObject *staged)
{
    PyObject *d = call0(t, st->s_detach);
    if (d == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodObjArgs(d, st->s_copy_, staged, NULL);
    Py_DECREF(d);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Whether tensor t has torch's negative bit set (its values are the negation
 * of what its memory holds: torch._neg_view, conj().imag of a complex tensor).
 * Asked while the gather has the tensor's TensorImpl in cache: asked later,
 * in a second loop over thousands of tensors, each call was a cache miss. */
static int neg_flag(mstate *st, PyObject *t, unsigned char *out)
{
    if (st->descr_is_neg == NULL && (st->descr_is_neg = PyObject_GetAttrString(st->tensor_type, "is_neg")) == NULL)
        return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(st->descr_is_neg, t, NULL);
    if (r == NULL)
        return -1;
    *out = (unsigned char)(r == Py_True);
    Py_DECREF(r);
    return 0;
}

/* Whether t is a plain torch.Tensor or Parameter: the tensors the shim reads. */
static int is_plain(mstate *st, PyObject *t)
{
    return Py_TYPE(t) == (PyTypeObject *)st->tensor_type || Py_TYPE(t) == (PyTypeObject *)st->param_type;
}

/* Prefetch distances (in tensors) of the shim's three stages (torch_shim.h). */
#define PF_OBJ 12
#define PF_IMPL 8
#define PF_STORAGE 4

/* While tensor i of tuple seq is read, asks for the memory of those to come. */
static void prefetch_ahead(mstate *st, PyObject *seq, Py_ssize_t i, Py_ssize_t n)
{
    if (i + PF_OBJ < n)
        ampx_shim_prefetch1(seq_item(seq, i + PF_OBJ));
    PyObject *u;
    if (i + PF_IMPL < n && is_plain(st, u = seq_item(seq, i + PF_IMPL)))
        ampx_shim_prefetch2(u);
    if (i + PF_STORAGE < n && is_plain(st, u = seq_item(seq, i + PF_STORAGE)))
        ampx_shim_prefetch3(u);
}

/* Reads every tensor of seq (a list or tuple) into L: CPU tensors (device
 * -1), or tensors of CUDA device `device`. For a list that will be written
 * (`write`), a non-contiguous tensor must not overlap itself; its copy is
 * made later, when it is processed. For a read-only list the copy is made
 * here. With `want_neg` (casts), each tensor's negative bit is recorded in
 * L->neg. On error L is freed and an exception is set. */
static int tlist_gather(mstate *st, const char *op, const char *arg, PyObject *seq, int write,
                        int refuse_fp16, int device, int want_neg, tlist *L)
{
    memset(L, 0, sizeof *L);
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a list or tuple of tensors", op, arg);
        return -1;
    }
    /* Own the tensors for the whole call: the GIL is released while kernels
     * write through their data pointers, and another thread (or Python code
     * run by .contiguous()/.copy_()) could otherwise drop the last reference. */
    PyObject *owned = PySequence_Tuple(seq);
    if (owned == NULL)
        return -1;
    Py_ssize_t n = PyTuple_Size(owned);
    if (n < 0) {
        Py_DECREF(owned);
        return -1;
    }
    if ((size_t)n > (size_t)UINT32_MAX) {
        Py_DECREF(owned);
        PyErr_Format(PyExc_ValueError, "%s: %s holds more than 2^32 tensors", op, arg);
        return -1;
    }
    L->n = n;
    L->seq = owned;
    size_t m = n > 0 ? (size_t)n : 1u;
    L->ts = (ampx_tensor *)calloc(m, sizeof *L->ts);
    L->nc = (unsigned char *)calloc(m, 1);
    L->neg = (unsigned char *)calloc(m, 1);
    L->tmp = (PyObject **)calloc(m, sizeof *L->tmp);
    L->lo = (uintptr_t *)calloc(m, sizeof *L->lo);
    L->hi = (uintptr_t *)calloc(m, sizeof *L->hi);
    L->layout = (uint64_t *)calloc(m, sizeof *L->layout);
    if (L->ts == NULL || L->nc == NULL || L->neg == NULL || L->tmp == NULL || L->lo == NULL || L->hi == NULL ||
        L->layout == NULL) {
        tlist_free(L);
        PyErr_NoMemory();
        return -1;
    }
    int shim = ampx_shim_enabled();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = seq_item(L->seq, i);
        if (t == NULL)
            goto error;
        if (shim)
            prefetch_ahead(st, L->seq, i, n);
        ampx_tensor *d = &L->ts[i];
        int contig = 0;
        d->index = (uint32_t)i;
        if (!PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
            PyErr_Format(PyExc_TypeError, "%s: %s[%zd] must be a torch.Tensor, not %R", op, arg, i,
                         (PyObject *)Py_TYPE(t));
            goto error;
        }
        ampx_shim_meta m;
        if (shim && is_plain(st, t) && ampx_shim_read(t, &m) &&
            (device < 0 ? m.device_type == AMPX_SHIM_CPU
                        : m.device_type == AMPX_SHIM_CUDA && m.device_index == device)) {
            /* The fast read: a plain, contiguous tensor of a supported dtype on
             * the right device. Anything else falls through to the Python
             * attributes below, which handle it or raise the error. */
            if (refuse_fp16 && m.dtype == AMPX_F16) {
                PyErr_SetString(PyExc_ValueError, "Attempting to unscale FP16 gradients.");
                goto error;
            }
            d->dtype = m.dtype;
            d->numel = m.numel;
            L->total += m.numel;
            if (m.numel == 0)
                continue;
            if (want_neg && neg_flag(st, t, &L->neg[i]) < 0)
                goto error;
            d->ptr = m.ptr;
            L->lo[i] = (uintptr_t)m.ptr;
            L->hi[i] = L->lo[i] + (uintptr_t)(m.numel * ampx_elem_size(m.dtype));
            continue;
        }
        if ((d->dtype = dtype_code(st, op, arg, i, t)) < 0)
            goto error;
        if (device < 0 ? tensor_meta(st, op, arg, i, t, ampx_elem_size(d->dtype), &d->numel, &contig)
                       : tensor_meta_cuda(st, op, arg, i, t, ampx_elem_size(d->dtype), device, &d->numel, &contig))
            goto error;
        if (refuse_fp16 && d->dtype == AMPX_F16) {
            /* torch.amp.GradScaler's own words, for drop-in compatibility. */
            PyErr_SetString(PyExc_ValueError, "Attempting to unscale FP16 gradients.");
            goto error;
        }
        L->total += d->numel;
        if (d->numel == 0)
            continue;
        if (want_neg && neg_flag(st, t, &L->neg[i]) < 0)
            goto error;
        if (contig) {
            if (get_data_ptr(st, t, &d->ptr) < 0)
                goto error;
            L->lo[i] = (uintptr_t)d->ptr;
            L->hi[i] = L->lo[i] + (uintptr_t)(d->numel * ampx_elem_size(d->dtype));
            continue;
        }
        L->nc[i] = 1;
        L->any_nc = 1;
        int overlap = 0;
        if (strided_extent(st, t, ampx_elem_size(d->dtype), &L->lo[i], &L->hi[i], &overlap, &L->layout[i]) < 0)
            goto error;
        if (write && overlap) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s[%zd] may have internal overlap (several of its elements can share "
                         "memory, as in an expanded view), so it cannot be written in place",
                         op, arg, i);
            goto error;
        }
        if (!write) {
            if ((L->tmp[i] = call0(t, st->s_contiguous)) == NULL)
                goto error;
            if (get_data_ptr(st, L->tmp[i], &d->ptr) < 0)
                goto error;
        }
    }
    return 0;
error:
    tlist_free(L);
    return -1;
}

/* ---- overlap between tensors ---------------------------------------------- */

typedef struct {
    uintptr_t lo, hi;
    Py_ssize_t idx;
    int written;
} span_t;

static int span_cmp(const void *a, const void *b)
{
    uintptr_t x = ((const span_t *)a)->lo, y = ((const span_t *)b)->lo;
    return x < y ? -1 : x > y;
}

#define RADIX_BITS 11

/* Sorts spans by start address with a least-significant-digit radix sort over
 * the addresses' offsets from the lowest one (a few passes of RADIX_BITS
 * bits). Returns -1, leaving s as it was, when its buffer cannot be had. */
static int radix_sort_spans(span_t *s, Py_ssize_t m)
{
    uintptr_t base = s[0].lo, top = s[0].lo;
    for (Py_ssize_t k = 1; k < m; k++) {
        if (s[k].lo < base)
            base = s[k].lo;
        if (s[k].lo > top)
            top = s[k].lo;
    }
    span_t *buf = (span_t *)malloc((size_t)m * sizeof *buf);
    if (buf == NULL)
        return -1;
    size_t count[1u << RADIX_BITS];
    span_t *from = s, *to = buf;
    const uintptr_t mask = ((uintptr_t)1 << RADIX_BITS) - 1;
    for (unsigned shift = 0; shift < 8 * sizeof(uintptr_t) && ((top - base) >> shift) != 0; shift += RADIX_BITS) {
        memset(count, 0, sizeof count);
        for (Py_ssize_t k = 0; k < m; k++)
            count[((from[k].lo - base) >> shift) & mask]++;
        size_t pos = 0;
        for (size_t b = 0; b <= mask; b++) {
            size_t c = count[b];
            count[b] = pos;
            pos += c;
        }
        for (Py_ssize_t k = 0; k < m; k++)
            to[count[((from[k].lo - base) >> shift) & mask]++] = from[k];
        span_t *t = from;
        from = to;
        to = t;
    }
    if (from != s)
        memcpy(s, from, (size_t)m * sizeof *s);
    free(buf);
    return 0;
}

/* Sorts spans by start address. Lists usually arrive in address order, or in
 * the reverse of it (autograd allocates gradients from the last layer back),
 * and both cost one look; anything else takes a radix sort (a comparison
 * sort of 10,000 spans took 0.4 ms, as long as reading the tensors). */
static void sort_spans(span_t *s, Py_ssize_t m)
{
    int asc = 1, desc = 1;
    for (Py_ssize_t k = 1; k < m && (asc || desc); k++) {
        if (s[k - 1].lo > s[k].lo)
            asc = 0;
        if (s[k - 1].lo < s[k].lo)
            desc = 0;
    }
    if (asc)
        return;
    if (desc) {
        for (Py_ssize_t a = 0, b = m - 1; a < b; a++, b--) {
            span_t t = s[a];
            s[a] = s[b];
            s[b] = t;
        }
        return;
    }
    if (m < 64 || radix_sort_spans(s, m) < 0)
        qsort(s, (size_t)m, sizeof *s, span_cmp);
}

/* Finds a pair of overlapping spans in which at least one is written.
 * Returns 1 and the pair, 0 if there is none. The spans are sorted in place. */
static int find_overlap(span_t *s, Py_ssize_t m, span_t *x, span_t *y)
{
    sort_spans(s, m);
    Py_ssize_t all = -1, wr = -1; /* spans reaching furthest: any, written */
    for (Py_ssize_t k = 0; k < m; k++) {
        if (all >= 0 && s[k].written && s[all].hi > s[k].lo) {
            *x = s[all];
            *y = s[k];
            return 1;
        }
        if (wr >= 0 && s[wr].hi > s[k].lo) {
            *x = s[wr];
            *y = s[k];
            return 1;
        }
        if (all < 0 || s[k].hi > s[all].hi)
            all = k;
        if (s[k].written && (wr < 0 || s[k].hi > s[wr].hi))
            wr = k;
    }
    return 0;
}

/* Spans of the contiguous, non-empty tensors of L, all marked written. */
static Py_ssize_t add_spans(const tlist *L, span_t *out)
{
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < L->n; i++) {
        if (L->ts[i].numel == 0 || L->nc[i])
            continue;
        out[m].lo = L->lo[i];
        out[m].hi = L->hi[i];
        out[m].idx = i;
        out[m].written = 1;
        m++;
    }
    return m;
}

/* Gathers a cast's source and destination lists (on the CPU, device -1, or on
 * CUDA device `device`) and checks that they pair up: as many tensors, the
 * same element counts, bfloat16 destinations for stochastic rounding. On
 * error both lists are freed and an exception is set. */
static int gather_cast_lists(mstate *st, const char *op, PyObject *src_o, PyObject *dst_o, int device,
                             int stochastic, tlist *S, tlist *D)
{
    if (tlist_gather(st, op, "src", src_o, 0, 0, device, 1, S) < 0)
        return -1;
    if (tlist_gather(st, op, "dst", dst_o, 1, 0, device, 1, D) < 0) {
        tlist_free(S);
        return -1;
    }
    if (S->n != D->n) {
        PyErr_Format(PyExc_ValueError, "%s: src has %zd tensors but dst has %zd", op, S->n, D->n);
        goto error;
    }
    for (Py_ssize_t i = 0; i < S->n; i++) {
        if (S->ts[i].numel != D->ts[i].numel) {
            PyErr_Format(PyExc_ValueError, "%s: src[%zd] has %lld elements but dst[%zd] has %lld", op, i,
                         (long long)S->ts[i].numel, i, (long long)D->ts[i].numel);
            goto error;
        }
        if (stochastic && D->ts[i].dtype != AMPX_BF16) {
            PyErr_Format(PyExc_ValueError,
                         "%s: stochastic rounding writes bfloat16, but dst[%zd] has dtype torch.%s", op, i,
                         dtype_names[D->ts[i].dtype]);
            goto error;
        }
    }
    return 0;
error:
    tlist_free(S);
    tlist_free(D);
    return -1;
}

/* A cast's tensors: S (sources) takes each destination's pointer and dtype, and the
 * sharing rule is checked: a destination may alias only its own source, exactly (same
 * elements, order and dtype); any other overlap with a destination would make the result
 * depend on the order of the work. Spans are those of the caller's tensors, not of any
 * contiguous copy. Returns 0, or -1 with ValueError (or MemoryError) set. */
static int pair_cast_tensors(const char *op, tlist *S, const tlist *D)
{
    for (Py_ssize_t i = 0; i < S->n; i++) {
        S->ts[i].src = S->ts[i].ptr;
        S->ts[i].src_dtype = S->ts[i].dtype;
        S->ts[i].ptr = D->ts[i].ptr;
        S->ts[i].dtype = D->ts[i].dtype;
    }
    span_t *spans = (span_t *)malloc((size_t)(2 * S->n + 1) * sizeof *spans);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < S->n; i++) {
        if (S->ts[i].numel == 0)
            continue;
        int exact_alias = S->lo[i] == D->lo[i] && S->hi[i] == D->hi[i] && S->nc[i] == D->nc[i] &&
                          S->layout[i] == D->layout[i] && S->ts[i].src_dtype == S->ts[i].dtype;
        spans[m].lo = D->lo[i];
        spans[m].hi = D->hi[i];
        spans[m].idx = i;
        spans[m].written = 1;
        m++;
        if (exact_alias)
            continue;
        spans[m].lo = S->lo[i];
        spans[m].hi = S->hi[i];
        spans[m].idx = i;
        spans[m].written = 0;
        m++;
    }
    span_t x, y;
    int overlap = find_overlap(spans, m, &x, &y);
    free(spans);
    if (overlap) {
        PyErr_Format(PyExc_ValueError, "%s: %s[%zd] and %s[%zd] (may) share memory; a cast needs distinct "
                     "destinations (or a destination that is exactly its own source)",
                     op, x.written ? "dst" : "src", x.idx, y.written ? "dst" : "src", y.idx);
        return -1;
    }
    return 0;
}

/* A contiguous tensor holding the values of t with no negative bit (new reference). */
static PyObject *resolved_copy(mstate *st, PyObject *t)
{
    PyObject *r = call0(t, st->s_resolve_neg);
    if (r == NULL)
        return NULL;
    PyObject *c = call0(r, st->s_contiguous);
    Py_DECREF(r);
    return c;
}

/* Where a cast's kernel reads and writes. Non-contiguous destinations are
 * written through contiguous copies, copied back afterwards. The scale, check
 * and norm kernels are right on a tensor with the negative bit (scaling
 * commutes with negation; checks and norms see magnitudes), but a cast would
 * carry the stored sign over: a negated source is read through a resolved
 * copy, and a negated destination written through one (copy_ then negates). */
static int cast_staging(mstate *st, tlist *S, tlist *D)
{
    for (Py_ssize_t i = 0; i < D->n; i++) {
        if (!D->nc[i])
            continue;
        if ((D->tmp[i] = call0(seq_item(D->seq, i), st->s_contiguous)) == NULL)
            return -1;
        if (get_data_ptr(st, D->tmp[i], &D->ts[i].ptr) < 0)
            return -1;
    }
    for (Py_ssize_t i = 0; i < S->n; i++) {
        if (S->ts[i].numel == 0)
            continue;
        for (int side = 0; side < 2; side++) {
            tlist *L = side == 0 ? S : D;
            if (!L->neg[i])
                continue;
            PyObject *c = resolved_copy(st, seq_item(L->seq, i));
            if (c == NULL)
                return -1;
            Py_XDECREF(L->tmp[i]);
            L->tmp[i] = c;
            if (get_data_ptr(st, c, &L->ts[i].ptr) < 0)
                return -1;
        }
    }
    return 0;
}

/* After a cast's kernel: copies each staged destination (see cast_staging)
 * back into the caller's tensor. */
static int cast_unstage(mstate *st, const tlist *D)
{
    for (Py_ssize_t i = 0; i < D->n; i++)
        if (D->tmp[i] != NULL && copy_back(st, seq_item(D->seq, i), D->tmp[i]) < 0)
            return -1;
    return 0;
}

/* ---- running a job -------------------------------------------------------- */

static int run_job(const ampx_job *job, const ampx_tensor *ts, Py_ssize_t n, int64_t total,
                   int nthreads, ampx_partial *parts)
{
    int rc;
    if (total >= GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        rc = ampx_run(job, ts, n, nthreads, parts);
        Py_END_ALLOW_THREADS
    } else {
        rc = ampx_run(job, ts, n, nthreads, parts);
    }
    if (rc < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static double finish_reduce(int reduce, double acc) { return reduce == AMPX_REDUCE_SUMSQ ? sqrt(acc) : acc; }

/* Writes the common outputs: found_inf, per-tensor flags, per-tensor and
 * total reductions. */
static void write_outputs(const ampx_partial *parts, Py_ssize_t n, int reduce, float *found_inf,
                          uint8_t *flags, float *per_tensor, float *total)
{
    ampx_partial all = {0.0, 0u};
    for (Py_ssize_t i = 0; i < n; i++) {
        ampx_partial_combine(&all, &parts[i], reduce);
        if (flags != NULL)
            flags[i] = (uint8_t)parts[i].flags;
        if (per_tensor != NULL)
            per_tensor[i] = (float)finish_reduce(reduce, parts[i].acc);
    }
    if (found_inf != NULL && all.flags != 0u)
        *found_inf = 1.0f;
    if (total != NULL)
        *total = (float)finish_reduce(reduce, all.acc);
}

/* scale_reduce(op, tensors, mode, factor, found_inf, flags, per_tensor, out, nthreads
 *              [, refuse_fp16, factor_name])
 *
 * The one entry point of unscale_, norm, unscale_norm_ and mul_: runs the
 * scale kernel in `mode` over the tensors. */
static PyObject *py_scale_reduce(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *op;
    PyObject *seq, *factor_o, *found_o, *flags_o, *per_o, *out_o;
    int mode, nthreads, refuse_fp16 = 0;
    const char *factor_name = "factor";
    if (!PyArg_ParseTuple(args, "sOiOOOOOi|ps:scale_reduce", &op, &seq, &mode, &factor_o, &found_o, &flags_o,
                          &per_o, &out_o, &nthreads, &refuse_fp16, &factor_name))
        return NULL;
    if (require_init(st) < 0)
        return NULL;
    if (mode < 0 || mode >= AMPX_NUM_MODES || ampx_cpu_active->scale[AMPX_F32][mode] == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: no kernel for mode %d", op, mode);
        return NULL;
    }
    const int write = mode & AMPX_M_WRITE, reduce = AMPX_MODE_REDUCE(mode);
    tlist L;
    if (tlist_gather(st, op, "tensors", seq, write, refuse_fp16, -1, 0, &L) < 0)
        return NULL;

    PyObject *result = NULL;
    ampx_partial *parts = NULL;
    span_t *spans = NULL;
    double factor = 1.0;
    void *found = NULL, *flags = NULL, *per = NULL, *out = NULL;
    if (parse_factor(st, op, factor_name, factor_o, &factor) < 0 ||
        opt_aux(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, &found) < 0 ||
        opt_aux(st, op, "flags", flags_o, st->dtype_u8, L.n, &flags) < 0 ||
        opt_aux(st, op, "per_tensor", per_o, st->dtypes[AMPX_F32], L.n, &per) < 0 ||
        opt_aux(st, op, "out", out_o, st->dtypes[AMPX_F32], 1, &out) < 0)
        goto done;
    parts = (ampx_partial *)calloc(L.n > 0 ? (size_t)L.n : 1u, sizeof *parts);
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    ampx_job job = {0, mode, factor, 0, 0u, 0u};

    /* Written tensors that share memory, or that need a contiguous copy, are
     * processed one at a time in list order: the result is then that of
     * applying the op to each tensor in turn, whatever the aliasing. */
    int sequential = write && L.any_nc;
    if (write && !sequential && L.n > 1) {
        spans = (span_t *)malloc((size_t)L.n * sizeof *spans);
        if (spans == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        span_t x, y;
        sequential = find_overlap(spans, add_spans(&L, spans), &x, &y);
    }
    if (!sequential) {
        if (run_job(&job, L.ts, L.n, L.total, nthreads, parts) < 0)
            goto done;
    } else {
        for (Py_ssize_t i = 0; i < L.n; i++) {
            if (L.ts[i].numel == 0)
                continue;
            PyObject *t = seq_item(L.seq, i), *c = NULL;
            if (L.nc[i]) {
                if ((c = call0(t, st->s_contiguous)) == NULL)
                    goto done;
                if (get_data_ptr(st, c, &L.ts[i].ptr) < 0) {
                    Py_DECREF(c);
                    goto done;
                }
            }
            int rc = run_job(&job, &L.ts[i], 1, L.ts[i].numel, nthreads, &parts[i]);
            if (rc == 0 && c != NULL) {
                rc = copy_back(st, t, c);
            }
            Py_XDECREF(c);
            if (rc < 0)
                goto done;
        }
    }
    write_outputs(parts, L.n, reduce, (float *)found, (uint8_t *)flags, (float *)per, (float *)out);
    result = new_ref(Py_None);
done:
    free(spans);
    free(parts);
    tlist_free(&L);
    return result;
}

/* cast(op, src, dst, factor, found_inf, flags, stochastic, seed, offset, nthreads) */
static PyObject *py_cast(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *op;
    PyObject *src_o, *dst_o, *factor_o, *found_o, *flags_o;
    int stochastic, nthreads;
    unsigned long long seed, offset;
    if (!PyArg_ParseTuple(args, "sOOOOOpKKi:cast", &op, &src_o, &dst_o, &factor_o, &found_o, &flags_o,
                          &stochastic, &seed, &offset, &nthreads))
        return NULL;
    if (require_init(st) < 0)
        return NULL;
    tlist S, D;
    if (gather_cast_lists(st, op, src_o, dst_o, -1, stochastic, &S, &D) < 0)
        return NULL;
    PyObject *result = NULL;
    ampx_partial *parts = NULL;
    double factor = 1.0;
    void *found = NULL, *flags = NULL;
    if (parse_factor(st, op, "inv_scale", factor_o, &factor) < 0 ||
        opt_aux(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, &found) < 0 ||
        opt_aux(st, op, "flags", flags_o, st->dtype_u8, S.n, &flags) < 0)
        goto done;

    if (cast_staging(st, &S, &D) < 0)
        goto done;
    if (pair_cast_tensors(op, &S, &D) < 0)
        goto done;
    parts = (ampx_partial *)calloc(S.n > 0 ? (size_t)S.n : 1u, sizeof *parts);
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    ampx_job job = {1, 0, factor, stochastic, (uint64_t)seed, (uint64_t)offset};
    if (run_job(&job, S.ts, S.n, S.total, nthreads, parts) < 0)
        goto done;
    if (cast_unstage(st, &D) < 0)
        goto done;
    write_outputs(parts, S.n, AMPX_REDUCE_NONE, (float *)found, (uint8_t *)flags, NULL, NULL);
    result = new_ref(Py_None);
done:
    free(parts);
    tlist_free(&S);
    tlist_free(&D);
    return result;
}

/* update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
 *              backoff_factor, growth_interval, hysteresis, consecutive, min_scale,
 *              max_scale) -> events (AMPX_UPD_* bits) */
static PyObject *py_update_scale(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *op = "ampx.ops.update_scale_";
    PyObject *scale_o, *tracker_o, *hyst_o, *found_o;
    double growth, backoff, min_scale, max_scale;
    long long interval;
    int hysteresis, consecutive;
    if (!PyArg_ParseTuple(args, "OOOOddLipdd:update_scale", &scale_o, &tracker_o, &hyst_o, &found_o, &growth,
                          &backoff, &interval, &hysteresis, &consecutive, &min_scale, &max_scale))
        return NULL;
    if (require_init(st) < 0)
        return NULL;
    void *scale = NULL, *tracker = NULL, *hyst = NULL, *found = NULL;
    if (aux_ptr(st, op, "scale", scale_o, st->dtypes[AMPX_F32], 1, &scale) < 0 ||
        aux_ptr(st, op, "growth_tracker", tracker_o, st->dtype_i32, 1, &tracker) < 0 ||
        opt_aux(st, op, "hysteresis_tracker", hyst_o, st->dtype_i32, 1, &hyst) < 0 ||
        aux_ptr(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, &found) < 0)
        return NULL;
    int ev = ampx_update_scale((float *)scale, (int32_t *)tracker, (int32_t *)hyst, *(const float *)found,
                               growth, backoff, (int64_t)interval, (int32_t)hysteresis, consecutive,
                               (float)min_scale, (float)max_scale);
    return PyLong_FromLong(ev);
}

/* ==== the CUDA path ==========================================================
 *
 * The same validation as the CPU entry points (tlist_gather with a device),
 * then the multi-tensor launcher of cuda_launch.c on the caller's stream. The
 * Python layer (ampx/ops.py, ampx/cuda.py) passes the device index of the
 * first tensor, the current torch stream of that device, and a callable that
 * allocates workspace bytes with torch's caching allocator on that device. */

static PyObject *cu_raise(const char *op, const ampx_cu_error *err)
{
    PyErr_Format(PyExc_RuntimeError, "%s: %s", op, err->msg);
    return NULL;
}

/* aux_ptr for a call on CUDA device `device`. */
static int aux_ptr_cuda(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype,
                        int64_t numel, int device, ampx_cu_deviceptr *ptr)
{
    *ptr = 0;
    if (!PyObject_TypeCheck(o, (PyTypeObject *)st->tensor_type)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a torch.Tensor, not %R", op, name,
                     (PyObject *)Py_TYPE(o));
        return -1;
    }
    PyObject *dt = PyObject_GetAttr(o, st->s_dtype);
    if (dt == NULL)
        return -1;
    if (dt != dtype) {
        PyErr_Format(PyExc_TypeError, "%s: %s must have dtype %S, not %S", op, name, dtype, dt);
        Py_DECREF(dt);
        return -1;
    }
    Py_DECREF(dt);
    int idx = -1;
    if (cuda_device_of(st, o, &idx) < 0)
        return -1;
    if (idx != device)
        return cuda_device_error(st, op, name, o, device);
    int64_t n = 0;
    if (get_int64(o, st->s_numel, &n) < 0)
        return -1;
    if (n != numel) {
        PyErr_Format(PyExc_ValueError, "%s: %s must have %lld element(s), not %lld", op, name,
                     (long long)numel, (long long)n);
        return -1;
    }
    PyObject *r = call0(o, st->s_is_contiguous);
    if (r == NULL)
        return -1;
    int contig = r == Py_True;
    Py_DECREF(r);
    if (!contig) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be contiguous", op, name);
        return -1;
    }
    char *p = NULL;
    if (numel > 0 && get_data_ptr(st, o, &p) < 0)
        return -1;
    *ptr = (ampx_cu_deviceptr)(uintptr_t)p;
    return 0;
}

static int opt_aux_cuda(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype,
                        int64_t numel, int device, ampx_cu_deviceptr *ptr)
{
    *ptr = 0;
    if (o == Py_None)
        return 0;
    return aux_ptr_cuda(st, op, name, o, dtype, numel, device, ptr);
}

/* A factor for a CUDA call: None -> 1.0; a Python number; a 1-element
 * float32 tensor on the call's device (read by the kernels on the device, so
 * nothing waits); or a 1-element float32 CPU tensor (its value, read now). */
static int parse_factor_cuda(mstate *st, const char *op, const char *name, PyObject *o, int device,
                             double *val, ampx_cu_deviceptr *ptr)
{
    *val = 1.0;
    *ptr = 0;
    if (o == Py_None || PyFloat_Check(o) || PyLong_Check(o))
        return parse_factor(st, op, name, o, val);
    if (PyObject_TypeCheck(o, (PyTypeObject *)st->tensor_type)) {
        int cpu = 0;
        if (get_bool_attr(o, st->s_is_cpu, &cpu) < 0)
            return -1;
        if (cpu)
            return parse_factor(st, op, name, o, val);
    }
    return aux_ptr_cuda(st, op, name, o, st->dtypes[AMPX_F32], 1, device, ptr);
}

/* Calls alloc(bytes) (a torch.empty on the device) and keeps the tensor. */
static int cuda_workspace(mstate *st, const char *op, PyObject *alloc, int64_t bytes, PyObject **keep,
                          ampx_cu_deviceptr *ptr)
{
    *keep = NULL;
    *ptr = 0;
    if (bytes == 0)
        return 0;
    PyObject *n = PyLong_FromLongLong((long long)bytes);
    if (n == NULL)
        return -1;
    PyObject *t = PyObject_CallFunctionObjArgs(alloc, n, NULL);
    Py_DECREF(n);
    if (t == NULL)
        return -1;
    char *p = NULL;
    if (get_data_ptr(st, t, &p) < 0) {
        Py_DECREF(t);
        return -1;
    }
    if (((uintptr_t)p & 15u) != 0) {
        Py_DECREF(t);
        PyErr_Format(PyExc_RuntimeError, "%s: the workspace allocation is not 16-byte aligned", op);
        return -1;
    }
    *keep = t;
    *ptr = (ampx_cu_deviceptr)(uintptr_t)p;
    return 0;
}

/* The launcher's view of a gathered list. */
static ampx_cu_tensor *cuda_tensors(const tlist *L)
{
    ampx_cu_tensor *c = (ampx_cu_tensor *)calloc(L->n > 0 ? (size_t)L->n : 1u, sizeof *c);
    if (c == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < L->n; i++) {
        c[i].ptr = (ampx_cu_deviceptr)(uintptr_t)L->ts[i].ptr;
        c[i].src = (ampx_cu_deviceptr)(uintptr_t)L->ts[i].src;
        c[i].numel = L->ts[i].numel;
        c[i].dtype = L->ts[i].dtype;
        c[i].src_dtype = L->ts[i].src_dtype;
        c[i].index = L->ts[i].index;
    }
    return c;
}

/* What every CUDA data call needs before its launches: the device (its module
 * loaded), the tensors in the launcher's form, and a workspace from torch's
 * allocator sized for them. Returns the device, or NULL with an exception set;
 * the caller frees *cts and releases *ws_keep. */
static const ampx_cu_dev *cuda_prepare(mstate *st, const char *op, int device, PyObject *alloc,
                                       const ampx_cu_job *job, const tlist *L, ampx_cu_tensor **cts,
                                       int64_t *chunks, PyObject **ws_keep, ampx_cu_deviceptr *ws)
{
    ampx_cu_error err;
    const ampx_cu_dev *dev = ampx_cu_device_get(device, &err);
    if (dev == NULL) {
        cu_raise(op, &err);
        return NULL;
    }
    if ((*cts = cuda_tensors(L)) == NULL)
        return NULL;
    int64_t bytes = ampx_cu_workspace_bytes(job, *cts, L->n, chunks);
    if (bytes < 0) {
        PyErr_Format(PyExc_ValueError, "%s: too many elements for one call", op);
        return NULL;
    }
    if (cuda_workspace(st, op, alloc, bytes, ws_keep, ws) < 0)
        return NULL;
    return dev;
}

/* Every tensor in list order through one launcher, the GIL released. */
static int cuda_run_batched(const char *op, const ampx_cu_dev *dev, unsigned long long stream,
                            const ampx_cu_job *job, const ampx_cu_tensor *cts, Py_ssize_t n, int64_t chunks,
                            ampx_cu_deviceptr ws)
{
    ampx_cu_launcher *Lc = (ampx_cu_launcher *)malloc(sizeof *Lc);
    if (Lc == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ampx_cu_error err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ampx_cu_begin(Lc, dev, (ampx_cu_stream)(uintptr_t)stream, job, (int64_t)n, chunks, ws, &err);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++)
        rc = ampx_cu_add(Lc, &cts[i], &err);
    if (rc == 0)
        rc = ampx_cu_flush(Lc, &err);
    Py_END_ALLOW_THREADS
    free(Lc);
    if (rc < 0) {
        cu_raise(op, &err);
        return -1;
    }
    return 0;
}

/* cuda_scale_reduce(op, tensors, mode, factor, found_inf, flags, per_tensor, out, device, stream,
 *                   alloc[, refuse_fp16, factor_name])
 *
 * scale_reduce on the tensors of CUDA device `device`, on `stream`. */
static PyObject *py_cuda_scale_reduce(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *op;
    PyObject *seq, *factor_o, *found_o, *flags_o, *per_o, *out_o, *alloc;
    int mode, device, refuse_fp16 = 0;
    unsigned long long stream;
    const char *factor_name = "factor";
    if (!PyArg_ParseTuple(args, "sOiOOOOOiKO|ps:cuda_scale_reduce", &op, &seq, &mode, &factor_o, &found_o,
                          &flags_o, &per_o, &out_o, &device, &stream, &alloc, &refuse_fp16, &factor_name))
        return NULL;
    if (require_init(st) < 0 || cuda_attrs(st) < 0)
        return NULL;
    if (mode < 0 || mode >= AMPX_NUM_MODES || ampx_cpu_active->scale[AMPX_F32][mode] == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: no kernel for mode %d", op, mode);
        return NULL;
    }
    const int write = mode & AMPX_M_WRITE, reduce = AMPX_MODE_REDUCE(mode);
    tlist L;
    if (tlist_gather(st, op, "tensors", seq, write, refuse_fp16, device, 0, &L) < 0)
        return NULL;

    PyObject *result = NULL, *ws_keep = NULL;
    span_t *spans = NULL;
    ampx_cu_tensor *cts = NULL;
    ampx_cu_launcher *Lc = NULL;
    ampx_cu_job job;
    memset(&job, 0, sizeof job);
    job.kind = AMPX_CU_SCALE;
    job.reduce = reduce;
    job.write = write ? 1 : 0;
    job.scale = (mode & AMPX_M_SCALE) ? 1 : 0;
    if (parse_factor_cuda(st, op, factor_name, factor_o, device, &job.factor, &job.factor_ptr) < 0 ||
        opt_aux_cuda(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, device, &job.found_inf) < 0 ||
        opt_aux_cuda(st, op, "flags", flags_o, st->dtype_u8, L.n, device, &job.flags_out) < 0 ||
        opt_aux_cuda(st, op, "per_tensor", per_o, st->dtypes[AMPX_F32], L.n, device, &job.per_out) < 0 ||
        opt_aux_cuda(st, op, "out", out_o, st->dtypes[AMPX_F32], 1, device, &job.total_out) < 0)
        goto done;
    if (!(mode & AMPX_M_CHECK))
        job.found_inf = job.flags_out = 0;

    /* As on the CPU: written tensors that share memory, or that need a
     * contiguous copy, are processed one launch each, in list order. */
    int sequential = write && L.any_nc;
    if (write && !sequential && L.n > 1) {
        spans = (span_t *)malloc((size_t)L.n * sizeof *spans);
        if (spans == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        span_t x, y;
        sequential = find_overlap(spans, add_spans(&L, spans), &x, &y);
    }
    ampx_cu_error err;
    int64_t chunks = 0;
    ampx_cu_deviceptr ws = 0;
    const ampx_cu_dev *dev = cuda_prepare(st, op, device, alloc, &job, &L, &cts, &chunks, &ws_keep, &ws);
    if (dev == NULL)
        goto done;
    if (!sequential) {
        if (cuda_run_batched(op, dev, stream, &job, cts, L.n, chunks, ws) < 0)
            goto done;
    } else {
        if ((Lc = (ampx_cu_launcher *)malloc(sizeof *Lc)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (ampx_cu_begin(Lc, dev, (ampx_cu_stream)(uintptr_t)stream, &job, L.n, chunks, ws, &err) < 0) {
            cu_raise(op, &err);
            goto done;
        }
        for (Py_ssize_t i = 0; i < L.n; i++) {
            PyObject *t = seq_item(L.seq, i), *c = NULL;
            if (L.nc[i]) {
                char *p = NULL;
                if ((c = call0(t, st->s_contiguous)) == NULL)
                    goto done;
                if (get_data_ptr(st, c, &p) < 0) {
                    Py_DECREF(c);
                    goto done;
                }
                cts[i].ptr = (ampx_cu_deviceptr)(uintptr_t)p;
            }
            if (ampx_cu_add(Lc, &cts[i], &err) < 0 || ampx_cu_flush(Lc, &err) < 0) {
                Py_XDECREF(c);
                cu_raise(op, &err);
                goto done;
            }
            if (c != NULL) {
                int rc = copy_back(st, t, c);
                Py_DECREF(c);
                if (rc < 0)
                    goto done;
            }
        }
    }
    result = new_ref(Py_None);
done:
    free(Lc);
    free(cts);
    free(spans);
    Py_XDECREF(ws_keep);
    tlist_free(&L);
    return result;
}

/* cuda_cast(op, src, dst, factor, found_inf, flags, stochastic, seed, offset, device, stream, alloc) */
static PyObject *py_cuda_cast(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *op;
    PyObject *src_o, *dst_o, *factor_o, *found_o, *flags_o, *alloc;
    int stochastic, device;
    unsigned long long seed, offset, stream;
    if (!PyArg_ParseTuple(args, "sOOOOOpKKiKO:cuda_cast", &op, &src_o, &dst_o, &factor_o, &found_o, &flags_o,
                          &stochastic, &seed, &offset, &device, &stream, &alloc))
        return NULL;
    if (require_init(st) < 0 || cuda_attrs(st) < 0)
        return NULL;
    tlist S, D;
    if (gather_cast_lists(st, op, src_o, dst_o, device, stochastic, &S, &D) < 0)
        return NULL;
    PyObject *result = NULL, *ws_keep = NULL;
    ampx_cu_tensor *cts = NULL;
    ampx_cu_job job;
    memset(&job, 0, sizeof job);
    job.kind = AMPX_CU_CAST;
    job.stochastic = stochastic;
    job.seed = (uint64_t)seed;
    job.offset = (uint64_t)offset;
    if (parse_factor_cuda(st, op, "inv_scale", factor_o, device, &job.factor, &job.factor_ptr) < 0 ||
        opt_aux_cuda(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, device, &job.found_inf) < 0 ||
        opt_aux_cuda(st, op, "flags", flags_o, st->dtype_u8, S.n, device, &job.flags_out) < 0)
        goto done;

    if (cast_staging(st, &S, &D) < 0)
        goto done;
    /* The sharing rules of the CPU path. */
    if (pair_cast_tensors(op, &S, &D) < 0)
        goto done;
    int64_t chunks = 0;
    ampx_cu_deviceptr ws = 0;
    const ampx_cu_dev *dev = cuda_prepare(st, op, device, alloc, &job, &S, &cts, &chunks, &ws_keep, &ws);
    if (dev == NULL)
        goto done;
    if (cuda_run_batched(op, dev, stream, &job, cts, S.n, chunks, ws) < 0)
        goto done;
    if (cast_unstage(st, &D) < 0)
        goto done;
    result = new_ref(Py_None);
done:
    free(cts);
    Py_XDECREF(ws_keep);
    tlist_free(&S);
    tlist_free(&D);
    return result;
}

/* cuda_update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
 *                   backoff_factor, growth_interval, hysteresis, consecutive, min_scale,
 *                   max_scale, events, device, stream)
 * The update as a one-thread kernel: reads and writes the device tensors on
 * the stream; the events land in `events` (an int32 device tensor, or None). */
static PyObject *py_cuda_update_scale(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *op = "ampx.ops.update_scale_";
    PyObject *scale_o, *tracker_o, *hyst_o, *found_o, *events_o;
    double growth, backoff, min_scale, max_scale;
    long long interval;
    int hysteresis, consecutive, device;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOOddLipddOiK:cuda_update_scale", &scale_o, &tracker_o, &hyst_o, &found_o,
                          &growth, &backoff, &interval, &hysteresis, &consecutive, &min_scale, &max_scale,
                          &events_o, &device, &stream))
        return NULL;
    if (require_init(st) < 0 || cuda_attrs(st) < 0)
        return NULL;
    ampx_cu_update_args a;
    memset(&a, 0, sizeof a);
    if (aux_ptr_cuda(st, op, "scale", scale_o, st->dtypes[AMPX_F32], 1, device, &a.scale) < 0 ||
        aux_ptr_cuda(st, op, "growth_tracker", tracker_o, st->dtype_i32, 1, device, &a.growth_tracker) < 0 ||
        opt_aux_cuda(st, op, "hysteresis_tracker", hyst_o, st->dtype_i32, 1, device, &a.hysteresis) < 0 ||
        aux_ptr_cuda(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, device, &a.found_inf) < 0 ||
        opt_aux_cuda(st, op, "events", events_o, st->dtype_i32, 1, device, &a.events) < 0)
        return NULL;
    a.growth_factor = growth;
    a.backoff_factor = backoff;
    a.growth_interval = (int64_t)interval;
    a.hysteresis_max = (int32_t)hysteresis;
    a.consecutive = consecutive;
    a.min_scale = (float)min_scale;
    a.max_scale = (float)max_scale;
    ampx_cu_error err;
    const ampx_cu_dev *dev = ampx_cu_device_get(device, &err);
    if (dev == NULL)
        return cu_raise(op, &err);
    if (ampx_cu_update(dev, (ampx_cu_stream)(uintptr_t)stream, &a, &err) < 0)
        return cu_raise(op, &err);
    Py_RETURN_NONE;
}

/* cuda_set_image(bytes): the fatbin (read by ampx.cuda); the first one stays. */
static PyObject *py_cuda_set_image(PyObject *module, PyObject *arg)
{
    (void)module;
    char *data = NULL;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(arg, &data, &size) < 0)
        return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "cuda_set_image: the fatbin is empty");
        return NULL;
    }
    if (ampx_cu_set_image(data, (size_t)size) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* cuda_probe(device) -> None when device can run ampx's kernels, else the reason (str). */
static PyObject *py_cuda_probe(PyObject *module, PyObject *args)
{
    (void)module;
    int device;
    if (!PyArg_ParseTuple(args, "i:cuda_probe", &device))
        return NULL;
    ampx_cu_error err;
    if (ampx_cu_probe(device, &err) < 0)
        return PyUnicode_FromString(err.msg);
    Py_RETURN_NONE;
}

/* cuda_device_info(device) -> (cc_major, cc_minor, multiprocessors, driver_version); loads the kernels. */
static PyObject *py_cuda_device_info(PyObject *module, PyObject *args)
{
    (void)module;
    int device;
    if (!PyArg_ParseTuple(args, "i:cuda_device_info", &device))
        return NULL;
    ampx_cu_error err;
    const ampx_cu_dev *dev = ampx_cu_device_get(device, &err);
    if (dev == NULL)
        return cu_raise("ampx.cuda", &err);
    return Py_BuildValue("(iiii)", dev->cc_major, dev->cc_minor, dev->sm_count, ampx_cu_driver_version());
}

/* _init(torch.Tensor, float32, float16, bfloat16, float64, uint8, int32, torch.strided,
 *       TensorBase.dtype, TensorBase.is_cpu, TensorBase.nbytes descriptors):
 * called once by ampx/__init__.py. */
static PyObject *py_init(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    PyObject *o[11];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO:_init", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                          &o[8], &o[9], &o[10]))
        return NULL;
    if (!PyType_Check(o[0])) {
        PyErr_SetString(PyExc_TypeError, "_init: the first argument must be torch.Tensor");
        return NULL;
    }
    set_ref(&st->tensor_type, o[0]);
    for (int k = 0; k < AMPX_NUM_DTYPES; k++)
        set_ref(&st->dtypes[k], o[1 + k]);
    set_ref(&st->dtype_u8, o[5]);
    set_ref(&st->dtype_i32, o[6]);
    set_ref(&st->strided, o[7]);
    for (int k = 0; k < 3; k++) {
        set_ref(&st->descr[k], o[8 + k]);
        /* Python 3.9's limited API cannot fetch slots of static types: fall
         * back to reading the attribute by name. */
        st->getter[k] = (descrgetfunc)PyType_GetSlot(Py_TYPE(o[8 + k]), Py_tp_descr_get);
        if (st->getter[k] == NULL)
            PyErr_Clear();
    }
    Py_RETURN_NONE;
}

/* Compares the shim's reading of probe tensor t with its Python attributes.
 * Returns 1 if they agree, 0 if not, -1 with an exception set. */
static int shim_agrees(mstate *st, PyObject *t)
{
    PyObject *c = PyObject_GetAttr(t, st->s_cdata);
    if (c == NULL)
        return -1;
    void *impl = PyLong_AsVoidPtr(c);
    Py_DECREF(c);
    if (impl == NULL && PyErr_Occurred())
        return -1;
    /* First the word the at::Tensor is assumed to be: only if it is torch's
     * TensorImpl pointer may the shim be handed its address. */
    if (impl == NULL || ampx_shim_impl_word(t) != (uintptr_t)impl)
        return 0;
    int code = dtype_code(st, "probe", "t", 0, t), contig = 0;
    int64_t numel = 0;
    char *ptr = NULL;
    if (code < 0 || tensor_meta(st, "probe", "t", 0, t, ampx_elem_size(code), &numel, &contig) < 0)
        return -1;
    if (numel > 0 && get_data_ptr(st, t, &ptr) < 0)
        return -1;
    ampx_shim_meta m;
    int ok = ampx_shim_read(t, &m);
    if (!contig)
        return !ok; /* the shim must send it down the slow path */
    return ok && m.dtype == code && m.device_type == AMPX_SHIM_CPU && m.numel == numel && m.ptr == ptr;
}

/* _enable_tensor_shim(path, parameter_type, probes) -> None or why not.
 * Opens torch's C shim in the library at `path` (already loaded by torch)
 * and turns the fast tensor read on if it agrees with the Python attributes
 * on every probe tensor (plain CPU tensors and Parameters, contiguous or not,
 * empty or not, of each dtype, made by the caller). */
static PyObject *py_enable_tensor_shim(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    const char *path;
    PyObject *ptype, *probes;
    if (!PyArg_ParseTuple(args, "sOO:_enable_tensor_shim", &path, &ptype, &probes))
        return NULL;
    if (require_init(st) < 0)
        return NULL;
    int sub = PyType_Check(ptype) ? PyObject_IsSubclass(ptype, st->tensor_type) : 0;
    if (sub < 0)
        return NULL;
    if (!sub) {
        PyErr_SetString(PyExc_TypeError, "_enable_tensor_shim: parameter_type must be torch.nn.Parameter");
        return NULL;
    }
    ampx_shim_set_enabled(0);
    const char *why = ampx_shim_open(path);
    if (why != NULL)
        return PyUnicode_FromString(why);
    PyObject *seq = PySequence_Tuple(probes);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_Size(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GetItem(seq, i);
        if (Py_TYPE(t) != (PyTypeObject *)st->tensor_type && Py_TYPE(t) != (PyTypeObject *)ptype) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_TypeError, "_enable_tensor_shim: probes must be plain tensors or Parameters");
            return NULL;
        }
        int ok = shim_agrees(st, t);
        if (ok <= 0) {
            Py_DECREF(seq);
            return ok < 0 ? NULL : PyUnicode_FromFormat("probe %zd: the shim disagrees with the tensor's attributes", i);
        }
    }
    /* Where a TensorImpl keeps its StorageImpl's address, to aim prefetches:
     * the same offset in every probe that has storage, or none. */
    int off = -2;
    for (Py_ssize_t i = 0; i < n && off != -1; i++) {
        PyObject *t = PyTuple_GetItem(seq, i);
        PyObject *stg = PyObject_CallMethod(t, "untyped_storage", NULL);
        PyObject *c = stg == NULL ? NULL : PyObject_GetAttr(stg, st->s_cdata);
        Py_XDECREF(stg);
        void *sp = c == NULL ? NULL : PyLong_AsVoidPtr(c);
        Py_XDECREF(c);
        if (sp == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(seq);
                return NULL;
            }
            continue;
        }
        int k = ampx_shim_find_word(ampx_shim_impl_word(t), (uintptr_t)sp);
        off = off == -2 || off == k ? k : -1;
    }
    ampx_shim_set_storage_offset(off < 0 ? -1 : off);
    Py_DECREF(seq);
    set_ref(&st->param_type, ptype);
    ampx_shim_set_enabled(1);
    Py_RETURN_NONE;
}

/* _set_tensor_shim(on=None) -> whether it was on; None only asks. Turning it
 * on needs a passed probe. */
static PyObject *py_set_tensor_shim(PyObject *module, PyObject *args)
{
    mstate *st = get_state(module);
    PyObject *on_o = Py_None;
    if (!PyArg_ParseTuple(args, "|O:_set_tensor_shim", &on_o))
        return NULL;
    int was = ampx_shim_enabled();
    if (on_o == Py_None)
        return PyBool_FromLong(was);
    int on = PyObject_IsTrue(on_o);
    if (on < 0)
        return NULL;
    if (on && (!ampx_shim_opened() || st->param_type == NULL)) {
        PyErr_SetString(PyExc_RuntimeError, "the tensor shim did not pass its start-up probe");
        return NULL;
    }
    ampx_shim_set_enabled(on);
    return PyBool_FromLong(was);
}

static PyObject *py_tensor_shim_storage_offset(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(ampx_shim_storage_offset());
}

/* Appends (p, p.grad) for each parameter of `params` (any iterable) whose
 * grad is not None. Returns 0, or -1 with an exception set. */
static int collect_group(mstate *st, PyObject *params, PyObject *plist, PyObject *glist)
{
    PyObject *it = PyObject_GetIter(params);
    if (it == NULL)
        return -1;
    PyObject *p;
    while ((p = PyIter_Next(it)) != NULL) {
        if (!PyObject_TypeCheck(p, (PyTypeObject *)st->tensor_type)) {
            /* torch's words: "... got int" (the type's __name__). */
            PyObject *tname = PyObject_GetAttrString((PyObject *)Py_TYPE(p), "__name__");
            if (tname != NULL) {
                PyErr_Format(PyExc_AssertionError, "expected param to be torch.Tensor, got %S", tname);
                Py_DECREF(tname);
            }
            Py_DECREF(p);
            Py_DECREF(it);
            return -1;
        }
        PyObject *g = PyObject_GetAttr(p, st->s_grad);
        int rc = g == NULL ? -1 : 0;
        if (rc == 0 && g != Py_None)
            rc = (PyList_Append(plist, p) < 0 || PyList_Append(glist, g) < 0) ? -1 : 0;
        Py_XDECREF(g);
        Py_DECREF(p);
        if (rc < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* collect_grads(param_groups) -> (params, grads): the parameters of an
 * optimizer's param_groups whose .grad is set, in order, and those grads.
 * The scaler's per-step walk over its parameters, done in C. */
static PyObject *py_collect_grads(PyObject *module, PyObject *groups)
{
    mstate *st = get_state(module);
    if (require_init(st) < 0)
        return NULL;
    PyObject *plist = PyList_New(0), *glist = PyList_New(0), *it = NULL, *group;
    if (plist == NULL || glist == NULL)
        goto error;
    if ((it = PyObject_GetIter(groups)) == NULL)
        goto error;
    while ((group = PyIter_Next(it)) != NULL) {
        PyObject *params = PyObject_GetItem(group, st->s_params);
        Py_DECREF(group);
        if (params == NULL)
            goto error;
        int rc = collect_group(st, params, plist, glist);
        Py_DECREF(params);
        if (rc < 0)
            goto error;
    }
    if (PyErr_Occurred())
        goto error;
    Py_DECREF(it);
    PyObject *r = PyTuple_New(2);
    if (r == NULL) {
        Py_DECREF(plist);
        Py_DECREF(glist);
        return NULL;
    }
    PyTuple_SetItem(r, 0, plist); /* steals */
    PyTuple_SetItem(r, 1, glist);
    return r;
error:
    Py_XDECREF(it);
    Py_XDECREF(plist);
    Py_XDECREF(glist);
    return NULL;
}

static PyObject *py_simd(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyUnicode_FromString(ampx_cpu_active->name);
}

static PyObject *py_thread_backend(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyUnicode_FromString(ampx_thread_backend());
}

static PyObject *py_simd_levels(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    const char *const *lv = ampx_cpu_supported_levels();
    PyObject *t = PyList_New(0);
    if (t == NULL)
        return NULL;
    for (int k = 0; lv[k] != NULL; k++) {
        PyObject *s = PyUnicode_FromString(lv[k]);
        if (s == NULL || PyList_Append(t, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(t);
            return NULL;
        }
        Py_DECREF(s);
    }
    return t;
}

/* set_simd(name) -> previous name */
static PyObject *py_set_simd(PyObject *module, PyObject *args)
{
    (void)module;
    const char *name;
    if (!PyArg_ParseTuple(args, "s:set_simd", &name))
        return NULL;
    int supported = 0;
    const ampx_cpu_kernels *k = ampx_cpu_find(name, &supported);
    if (k == NULL) {
        if (supported < 0)
            PyErr_Format(PyExc_ValueError, "unknown SIMD level '%s'; expected avx512, avx2 or portable", name);
        else
            PyErr_Format(PyExc_ValueError, "this processor does not support the '%s' SIMD level", name);
        return NULL;
    }
    PyObject *prev = PyUnicode_FromString(ampx_cpu_active->name);
    if (prev != NULL)
        ampx_cpu_active = k;
    return prev;
}

/* set_parallel_threshold(n) -> previous n: below n elements in all, a call runs on one thread. */
static PyObject *py_set_parallel_threshold(PyObject *module, PyObject *args)
{
    (void)module;
    long long n;
    if (!PyArg_ParseTuple(args, "L:set_parallel_threshold", &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "set_parallel_threshold: the threshold must be >= 0");
        return NULL;
    }
    long long prev = (long long)ampx_parallel_min;
    ampx_parallel_min = (int64_t)n;
    return PyLong_FromLongLong(prev);
}

static PyMethodDef methods[] = {
    {"_init", py_init, METH_VARARGS, "Hands torch's types to the extension (called by ampx)."},
    {"_enable_tensor_shim", py_enable_tensor_shim, METH_VARARGS,
     "Turns on the fast tensor read through torch's C shim if its probe passes; else says why not."},
    {"_set_tensor_shim", py_set_tensor_shim, METH_VARARGS, "Turns the fast tensor read on or off (tests)."},
    {"_tensor_shim_storage_offset", py_tensor_shim_storage_offset, METH_NOARGS,
     "Where the probe found a TensorImpl's storage pointer (prefetch aim), or -1."},
    {"scale_reduce", py_scale_reduce, METH_VARARGS, "Scale / check / reduce kernel over a tensor list."},
    {"cast", py_cast, METH_VARARGS, "Cast kernel between two tensor lists."},
    {"update_scale", py_update_scale, METH_VARARGS, "One loss-scale update on CPU tensors."},
    {"cuda_scale_reduce", py_cuda_scale_reduce, METH_VARARGS, "scale_reduce on CUDA tensors."},
    {"cuda_cast", py_cuda_cast, METH_VARARGS, "cast on CUDA tensors."},
    {"cuda_update_scale", py_cuda_update_scale, METH_VARARGS, "One loss-scale update as a CUDA kernel."},
    {"cuda_set_image", py_cuda_set_image, METH_O, "Hands the CUDA kernels' fatbin to the extension."},
    {"cuda_probe", py_cuda_probe, METH_VARARGS, "None if a CUDA device can run ampx's kernels, else why not."},
    {"cuda_device_info", py_cuda_device_info, METH_VARARGS,
     "(cc major, cc minor, multiprocessors, driver version) of a CUDA device; loads the kernels."},
    {"collect_grads", py_collect_grads, METH_O, "(params, grads) of param_groups whose grad is set."},
    {"simd", py_simd, METH_NOARGS, "Name of the SIMD level in use."},
    {"thread_backend", py_thread_backend, METH_NOARGS,
     "Where parallel CPU work runs: the loaded OpenMP runtime's path, or \"ampx pool\"."},
    {"simd_levels", py_simd_levels, METH_NOARGS, "SIMD levels this processor supports, best first."},
    {"set_simd", py_set_simd, METH_VARARGS, "Selects a SIMD level; returns the previous one."},
    {"set_parallel_threshold", py_set_parallel_threshold, METH_VARARGS,
     "Sets the element count below which kernels run single-threaded; returns the previous one."},
    {NULL, NULL, 0, NULL},
};

static int intern(PyObject **slot, const char *s)
{
    *slot = PyUnicode_InternFromString(s);
    return *slot == NULL ? -1 : 0;
}

static int exec_module(PyObject *m)
{
    mstate *st = get_state(m);
    if (intern(&st->s_dtype, "dtype") < 0 || intern(&st->s_is_cpu, "is_cpu") < 0 ||
        intern(&st->s_is_cuda, "is_cuda") < 0 || intern(&st->s_device, "device") < 0 ||
        intern(&st->s_layout, "layout") < 0 || intern(&st->s_numel, "numel") < 0 ||
        intern(&st->s_is_contiguous, "is_contiguous") < 0 || intern(&st->s_data_ptr, "data_ptr") < 0 ||
        intern(&st->s_contiguous, "contiguous") < 0 || intern(&st->s_copy_, "copy_") < 0 ||
        intern(&st->s_grad, "grad") < 0 || intern(&st->s_params, "params") < 0 ||
        intern(&st->s_size, "size") < 0 || intern(&st->s_stride, "stride") < 0 ||
        intern(&st->s_nbytes, "nbytes") < 0 || intern(&st->s_get_device, "get_device") < 0 ||
        intern(&st->s_cdata, "_cdata") < 0 || intern(&st->s_resolve_neg, "resolve_neg") < 0 ||
        intern(&st->s_detach, "detach") < 0)
        return -1;
    st->layout_error = PyErr_NewExceptionWithDoc(
        "ampx._C.LayoutError",
        "A tensor the kernels cannot read directly: sparse, or a wrapper without storage (DTensor).",
        PyExc_ValueError, NULL);
    if (st->layout_error == NULL)
        return -1;
    Py_INCREF(st->layout_error);
    if (PyModule_AddObject(m, "LayoutError", st->layout_error) < 0) {
        Py_DECREF(st->layout_error);
        return -1;
    }
    ampx_cpu_dispatch_init();
    if (PyModule_AddIntConstant(m, "CHUNK", (long)AMPX_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "PARALLEL_MIN", (long)AMPX_PARALLEL_MIN_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "GIL_RELEASE_MIN", (long)GIL_RELEASE_MIN) < 0 ||
        PyModule_AddIntConstant(m, "MODE_SCALE", AMPX_M_SCALE) < 0 ||
        PyModule_AddIntConstant(m, "MODE_WRITE", AMPX_M_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "MODE_CHECK", AMPX_M_CHECK) < 0 ||
        PyModule_AddIntConstant(m, "MODE_REDUCE_SHIFT", AMPX_M_REDUCE_SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_INF", AMPX_FLAG_INF) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_NAN", AMPX_FLAG_NAN) < 0 ||
        PyModule_AddIntConstant(m, "UPD_BACKOFF", AMPX_UPD_BACKOFF) < 0 ||
        PyModule_AddIntConstant(m, "UPD_GROWTH", AMPX_UPD_GROWTH) < 0 ||
        PyModule_AddIntConstant(m, "UPD_HYSTERESIS", AMPX_UPD_HYSTERESIS) < 0 ||
        PyModule_AddIntConstant(m, "UPD_AT_MIN", AMPX_UPD_AT_MIN) < 0 ||
        PyModule_AddIntConstant(m, "CUDA_CHUNK", (long)AMPX_CU_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "CUDA_BLOCK", (long)AMPX_CU_BLOCK) < 0 ||
        PyModule_AddIntConstant(m, "CUDA_MAX_TENSORS", (long)AMPX_CU_MAX_TENSORS) < 0)
        return -1;
#define ADD_REDUCE(name, code)                                                                             \
    if (PyModule_AddIntConstant(m, "REDUCE_" #name, AMPX_REDUCE_##name) < 0)                                  \
        return -1;
    AMPX_REDUCE_LIST(ADD_REDUCE)
#undef ADD_REDUCE
    return 0;
}

#define STATE_OBJECTS(X)                                                                                   \
    X(tensor_type) X(dtypes[0]) X(dtypes[1]) X(dtypes[2]) X(dtypes[3]) X(dtype_u8) X(dtype_i32)            \
        X(strided) X(layout_error) X(s_dtype) X(s_is_cpu) X(s_is_cuda) X(s_device) X(s_layout) X(s_numel)         \
            X(s_is_contiguous) X(s_data_ptr) X(s_contiguous) X(s_copy_) X(s_grad) X(s_params) X(s_size) X(s_stride) X(s_nbytes) X(descr[0]) X(descr[1]) X(descr[2]) \
                X(descr_is_cuda) X(s_get_device) X(param_type) X(descr_is_neg) X(s_cdata) X(s_resolve_neg) X(s_detach)

static int m_traverse(PyObject *m, visitproc visit, void *arg)
{
    mstate *st = get_state(m);
    if (st == NULL)
        return 0;
#define VISIT(f) Py_VISIT(st->f);
    STATE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int m_clear(PyObject *m)
{
    mstate *st = get_state(m);
    if (st == NULL)
        return 0;
#define CLEAR(f) Py_CLEAR(st->f);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void m_free(void *m) { m_clear((PyObject *)m); }

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, (void *)exec_module},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "ampx._C",
    "ampx's C kernels (private: use ampx.ops).",
    sizeof(mstate),
    methods,
    slots,
    m_traverse,
    m_clear,
    m_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&moduledef); }
