/*
 * tensor_meta.c: one tensor's metadata, read through its Python attributes
 * (dtype, is_cpu / is_cuda, nbytes, is_contiguous(), data_ptr(), size(),
 * stride()), the device, dtype and layout checks, and their error texts.
 * Also the start-up probe that turns on the fast reader of plain tensors
 * (torch's C shim, torch_shim.c), since it compares the two readers.
 *
 * Owns nothing across calls: every reference it takes is dropped before it
 * returns. Needs the GIL throughout. May call: torch_shim.h (the probe), the
 * state (state.h). Called by tensor_list.c (gathering), entry*.c (auxiliary
 * tensors and factors) and module.c's method table (the probe functions).
 */
#include "tensor_meta.h"

#include <stdio.h>
#include <string.h>

#include "torch_shim.h"

#define X_DTYPE_NAME(code, torch_name, size) [AMPX_##code] = #torch_name,
static const char *const dtype_names[AMPX_NUM_DTYPES] = {AMPX_DTYPE_LIST(X_DTYPE_NAME)};
#undef X_DTYPE_NAME

const char *dtype_name(int code) { return dtype_names[code]; }

/* Reads hot attribute k of tensor t (new reference, NULL on error). */
static PyObject *hot_attr(mstate *st, int k, PyObject *t)
{
    if (st->getter[k] != NULL)
        return st->getter[k](st->descr[k], t, (PyObject *)Py_TYPE(t));
#define X_NAME(index, attr) k == index ? st->s_##attr:
    PyObject *name = AMPX_HOT_ATTR_LIST(X_NAME) NULL;
#undef X_NAME
    return PyObject_GetAttr(t, name);
}

PyObject *call0(PyObject *obj, PyObject *name) { return PyObject_CallMethodObjArgs(obj, name, NULL); }

int get_int64(PyObject *obj, PyObject *method, int64_t *out)
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

int take_bool(PyObject *r, int *out)
{
    if (r == NULL)
        return -1;
    int v = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (v < 0)
        return -1;
    *out = v;
    return 0;
}

static int get_bool_attr(PyObject *obj, PyObject *name, int *out) { return take_bool(PyObject_GetAttr(obj, name), out); }

#define NO_STORAGE_HINT                                                                                   \
    "has no storage of its own (a wrapper subclass such as DTensor, an mkldnn tensor, or one of "     \
    "torch's efficient zero tensors); pass a tensor with storage (for a DTensor: .to_local(); "      \
    "otherwise .to_dense() or .clone())"

/* Puts "op: arg[i]: " before the message of the exception being raised about
 * tensor arg[i] (arg alone when i < 0) when torch raised it (ampx's own messages name all three
 * already), keeping its type. Returns -1, for `return with_context(...)`. */
int add_context(const char *op, const char *arg, Py_ssize_t i)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *str = value != NULL ? PyObject_Str(value) : NULL;
    PyObject *text = str != NULL ? PyUnicode_AsUTF8String(str) : NULL; /* limited API: via bytes */
    Py_XDECREF(str);
    const char *msg = text != NULL ? PyBytes_AsString(text) : NULL;
    if (msg == NULL || strncmp(msg, op, strlen(op)) == 0) {
        PyErr_Clear();
        Py_XDECREF(text);
        PyErr_Restore(type, value, tb);
        return -1;
    }
    PyObject *redo = i >= 0 ? PyUnicode_FromFormat("%s: %s[%zd]: %s", op, arg, i, msg)
                            : PyUnicode_FromFormat("%s: %s: %s", op, arg, msg);
    Py_DECREF(text);
    if (redo == NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return -1;
    }
    PyErr_SetObject(type, redo);
    Py_DECREF(redo);
    /* the new exception's cause is the original, as `raise ... from` would make it */
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2 != NULL && value != NULL)
        PyException_SetCause(v2, value); /* steals the reference to value */
    else
        Py_XDECREF(value);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(t2, v2, tb2);
    return -1;
}

/* Raises for tensor t with a NULL data pointer: a storage shrunk to nothing
 * under it (untyped_storage().resize_(0)) or no storage of its own. */
static int null_data_error(mstate *st, PyObject *t)
{
    PyObject *s = call0(t, st->s_untyped_storage);
    int64_t nbytes = -1;
    if (s == NULL || get_int64(s, st->s_nbytes, &nbytes) < 0)
        PyErr_Clear();
    Py_XDECREF(s);
    if (nbytes == 0)
        PyErr_SetString(PyExc_RuntimeError,
                        "it holds elements but its storage holds no bytes (was the storage shrunk with "
                        "untyped_storage().resize_()?); nothing was read or written");
    else
        PyErr_Format(st->layout_error, "a %R " NO_STORAGE_HINT, (PyObject *)Py_TYPE(t));
    return -1;
}

int get_data_ptr(mstate *st, PyObject *t, char **out)
{
    PyObject *r = call0(t, st->s_data_ptr);
    if (r == NULL) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) { /* torch: "Cannot access data pointer ..." */
            PyErr_Clear();
            PyErr_Format(st->layout_error, "a %R " NO_STORAGE_HINT, (PyObject *)Py_TYPE(t));
        }
        return -1;
    }
    void *p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (p == NULL)
        return PyErr_Occurred() ? -1 : null_data_error(st, t);
    *out = (char *)p;
    return 0;
}

/* ---- devices ---------------------------------------------------------------- */

/* Raises the ValueError for tensor arg[i] of a CPU call that is not on the CPU. */
static int cpu_device_error(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t)
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

/* Fetches TensorBase.is_cuda and its getter on first use (the CUDA path's
 * hot attribute, read as the CPU path reads is_cpu). */
static int cuda_attrs(mstate *st)
{
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
    if (st->descr_is_cuda == NULL && cuda_attrs(st) < 0)
        return -1;
    PyObject *r = st->getter_is_cuda != NULL
                      ? st->getter_is_cuda(st->descr_is_cuda, t, (PyObject *)Py_TYPE(t))
                      : PyObject_GetAttr(t, st->s_is_cuda);
    int cuda = 0;
    if (take_bool(r, &cuda) < 0)
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

int tensor_device_key(mstate *st, PyObject *t, int *key)
{
    ampx_shim_meta m;
    if (ampx_shim_enabled() &&
        (Py_TYPE(t) == (PyTypeObject *)st->tensor_type || Py_TYPE(t) == (PyTypeObject *)st->param_type)) {
        /* The shim fills the device even for tensors it leaves to the slow path. */
        m.device_type = -1;
        m.device_index = -1;
        (void)ampx_shim_read(t, &m);
        if (m.device_type == AMPX_SHIM_CPU || (m.device_type == AMPX_SHIM_CUDA && m.device_index >= 0)) {
            *key = m.device_type == AMPX_SHIM_CPU ? AMPX_DEVICE_CPU : m.device_index;
            return 0;
        }
    }
    int cpu = 0;
    if (take_bool(hot_attr(st, A_IS_CPU, t), &cpu) < 0)
        return -1;
    if (cpu) {
        *key = AMPX_DEVICE_CPU;
        return 0;
    }
    int index = -1;
    if (cuda_device_of(st, t, &index) < 0)
        return -1;
    *key = index >= 0 ? index : AMPX_DEVICE_OTHER;
    return 0;
}

/* Checks that `what` (tensor t) is on CUDA device `device`; else the ValueError. */
static int check_cuda_device(mstate *st, const char *op, const char *what, PyObject *t, int device)
{
    int idx = -1;
    if (cuda_device_of(st, t, &idx) < 0)
        return -1;
    if (idx == device)
        return 0;
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

/* ---- dtype and layout -------------------------------------------------------- */

int dtype_code(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t)
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

int tensor_meta(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, int64_t es, int device,
                int64_t *numel, int *contig)
{
    if (device < 0) {
        int cpu = 0;
        if (take_bool(hot_attr(st, A_IS_CPU, t), &cpu) < 0)
            return -1;
        if (!cpu)
            return cpu_device_error(st, op, arg, i, t);
    } else {
        char what[64];
        snprintf(what, sizeof what, "%s[%zd]", arg, i);
        if (check_cuda_device(st, op, what, t, device) < 0)
            return -1;
    }
    return tensor_shape(st, op, arg, i, t, es, numel, contig);
}

/* Asked while the gather has the tensor's TensorImpl in cache: asked later,
 * in a second loop over thousands of tensors, each call was a cache miss. */
int neg_flag(mstate *st, PyObject *t, unsigned char *out)
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

/* torch strides are never negative, so element 0 is the lowest address. The
 * overlap test is a sufficient one: with the dimensions of size > 1 ordered by
 * stride, each stride must exceed the span of all smaller ones; anything else
 * (a zero stride, an interleaving as_strided view) counts as possible overlap.
 * Only the slow path (a non-contiguous tensor) pays for it. */
#define MAX_DIMS 64
int strided_extent(mstate *st, PyObject *t, int64_t es, uintptr_t *lo, uintptr_t *hi, int *overlap,
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

/* ---- storage bounds ------------------------------------------------------------ */

/* Whether [lo, hi) lies inside the storage of t, asked from Python
 * (t.untyped_storage()): 1, 0, or -1 with an exception set. */
static int in_storage_by_attributes(mstate *st, PyObject *t, uintptr_t lo, uintptr_t hi)
{
    PyObject *s = call0(t, st->s_untyped_storage);
    if (s == NULL)
        return -1;
    int64_t base = 0, nbytes = 0;
    int rc = get_int64(s, st->s_data_ptr, &base) < 0 || get_int64(s, st->s_nbytes, &nbytes) < 0 ? -1 : 0;
    Py_DECREF(s);
    if (rc < 0)
        return -1;
    return lo >= (uintptr_t)base && hi >= lo && hi - (uintptr_t)base <= (uintptr_t)nbytes;
}

int check_in_storage(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, uintptr_t lo,
                     uintptr_t hi, int64_t es)
{
    int ok = -1;
    if (ampx_shim_enabled() && tensor_is_plain(st, t))
        ok = ampx_shim_in_storage(t, (int64_t)((hi - lo) / (uintptr_t)es), es);
    if (ok < 0 && (ok = in_storage_by_attributes(st, t, lo, hi)) < 0)
        return -1;
    if (ok)
        return 0;
    char where[32] = "";
    if (i >= 0)
        snprintf(where, sizeof where, "[%zd]", i);
    PyErr_Format(PyExc_RuntimeError,
                 "%s: %s%s reaches past the end of its storage: its elements span %zu bytes, more than the "
                 "storage holds from its offset (was the storage shrunk with untyped_storage().resize_()?); "
                 "nothing was read or written",
                 op, arg, where, (size_t)(hi - lo));
    return -1;
}

/* ---- auxiliary tensors and factors ------------------------------------------ */

int aux_ptr(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype, int64_t numel,
            int device, void **ptr)
{
    *ptr = NULL;
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
    if (device >= 0) {
        if (check_cuda_device(st, op, name, o, device) < 0)
            return -1;
    } else {
        int cpu = 0;
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
    }
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
    if (numel == 0) { /* an empty output has no storage to point at */
        *ptr = p;
        return 0;
    }
    /* flags and events are uint8, the rest float32 or int32 */
    int64_t es = dtype == st->dtype_u8 ? 1 : 4;
    unsigned char neg = 0;
    if ((get_data_ptr(st, o, &p) < 0 && add_context(op, name, -1) < 0) ||
        check_in_storage(st, op, name, -1, o, (uintptr_t)p, (uintptr_t)p + (uintptr_t)(numel * es), es) < 0 ||
        neg_flag(st, o, &neg) < 0)
        return -1;
    if (neg) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has torch's negative bit set (a torch._neg_view() or .conj().imag view): its "
                     "memory holds the negated values, which ampx would read and write as they are; pass a "
                     "tensor without it (t.resolve_neg() makes one)",
                     op, name);
        return -1;
    }
    *ptr = p;
    return 0;
}

int opt_aux(mstate *st, const char *op, const char *name, PyObject *o, PyObject *dtype, int64_t numel,
            int device, void **ptr)
{
    *ptr = NULL;
    if (o == Py_None)
        return 0;
    return aux_ptr(st, op, name, o, dtype, numel, device, ptr);
}

int parse_factor(mstate *st, const char *op, const char *name, PyObject *o, int device, double *val,
                 void **ptr)
{
    *val = 1.0;
    *ptr = NULL;
    if (o == Py_None)
        return 0;
    if (PyFloat_Check(o) || PyLong_Check(o)) {
        double v = PyFloat_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) { /* an int beyond a double's range */
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "%s: %s is an integer too large for a float (%R)", op, name, o);
            }
            return -1;
        }
        *val = v;
        return 0;
    }
    if (device >= 0 && PyObject_TypeCheck(o, (PyTypeObject *)st->tensor_type)) {
        int cpu = 0;
        if (get_bool_attr(o, st->s_is_cpu, &cpu) < 0)
            return -1;
        if (!cpu) /* read by the kernels on the device, so nothing waits */
            return aux_ptr(st, op, name, o, st->dtypes[AMPX_F32], 1, device, ptr);
    }
    void *p = NULL;
    if (aux_ptr(st, op, name, o, st->dtypes[AMPX_F32], 1, -1, &p) < 0)
        return -1;
    *val = (double)*(const float *)p;
    return 0;
}

/* ---- the shim's start-up probe ----------------------------------------------- */

/* Compares the shim's reading of probe tensor t with its Python attributes.
 * Returns 1 if they agree, 0 if not, -1 with an exception set. */
static int shim_agrees(mstate *st, PyObject *t)
{
    PyObject *c = PyObject_GetAttr(t, st->s__cdata);
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
    if (code < 0 || tensor_meta(st, "probe", "t", 0, t, ampx_elem_size(code), -1, &numel, &contig) < 0)
        return -1;
    if (numel > 0 && get_data_ptr(st, t, &ptr) < 0)
        return -1;
    ampx_shim_meta m;
    int ok = ampx_shim_read(t, &m);
    if (!contig)
        return !ok; /* the shim must send it down the slow path */
    return ok && m.dtype == code && m.device_type == AMPX_SHIM_CPU && m.numel == numel && m.ptr == ptr;
}

/* Where a TensorImpl keeps its StorageImpl's address, to aim prefetches: the
 * same offset in every probe of seq that has storage, else -1. Returns -2
 * with an exception set. */
static int storage_offset(mstate *st, PyObject *seq)
{
    Py_ssize_t n = PyTuple_Size(seq);
    int off = -2;
    for (Py_ssize_t i = 0; i < n && off != -1; i++) {
        PyObject *t = PyTuple_GetItem(seq, i);
        PyObject *stg = PyObject_CallMethod(t, "untyped_storage", NULL);
        PyObject *c = stg == NULL ? NULL : PyObject_GetAttr(stg, st->s__cdata);
        Py_XDECREF(stg);
        void *sp = c == NULL ? NULL : PyLong_AsVoidPtr(c);
        Py_XDECREF(c);
        if (sp == NULL) {
            if (PyErr_Occurred())
                return -2;
            continue;
        }
        int k = ampx_shim_find_word(ampx_shim_impl_word(t), (uintptr_t)sp);
        off = off == -2 || off == k ? k : -1;
    }
    return off < 0 ? -1 : off;
}

/* _enable_tensor_shim(path, parameter_type, probes) -> None or why not.
 * Opens torch's C shim in the library at `path` (already loaded by torch)
 * and turns the fast tensor read on if it agrees with the Python attributes
 * on every probe tensor (plain CPU tensors and Parameters, contiguous or not,
 * empty or not, of each dtype, made by the caller). */
PyObject *py_enable_tensor_shim(PyObject *module, PyObject *args)
{
    mstate *st = state_of(module);
    const char *path;
    PyObject *ptype, *probes;
    if (!PyArg_ParseTuple(args, "sOO:_enable_tensor_shim", &path, &ptype, &probes))
        return NULL;
    if (state_ready(st) < 0)
        return NULL;
    int sub = PyType_Check(ptype) ? PyObject_IsSubclass(ptype, st->tensor_type) : 0;
    if (sub < 0)
        return NULL;
    if (!sub) {
        PyErr_SetString(PyExc_TypeError, "_enable_tensor_shim: parameter_type must be torch.nn.Parameter");
        return NULL;
    }
    ampx_shim_set_probed(0); /* until every probe below agrees (also turns the fast read off) */
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
    int off = storage_offset(st, seq);
    Py_DECREF(seq);
    if (off == -2)
        return NULL;
    ampx_shim_set_storage_offset(off);
    set_ref(&st->param_type, ptype);
    ampx_shim_set_probed(1);
    ampx_shim_set_enabled(1);
    Py_RETURN_NONE;
}

/* The argument of a switch(on=None) function: 1 with *on set, 0 when it
 * only asks (None), -1 with an exception set. */
static int switch_arg(PyObject *args, const char *format, int *on)
{
    PyObject *on_o = Py_None;
    if (!PyArg_ParseTuple(args, format, &on_o))
        return -1;
    if (on_o == Py_None)
        return 0;
    *on = PyObject_IsTrue(on_o);
    return *on < 0 ? -1 : 1;
}

/* Refuses (RuntimeError naming `what`, the C route) to turn on a route that
 * reads tensors through the shim's layout unless the start-up probe passed.
 * Returns 0, or -1 with the exception set. */
static int need_probe(const char *what)
{
    if (ampx_shim_probed())
        return 0;
    PyErr_Format(PyExc_RuntimeError,
                 "%s: the tensor shim did not pass its start-up probe, so this C route would read tensors "
                 "through a layout nobody checked; it stays off (ampx reads them through Python's attributes)",
                 what);
    return -1;
}

/* _set_tensor_shim(on=None) -> whether it was on; None only asks. Turning it
 * on needs a passed probe. */
PyObject *py_set_tensor_shim(PyObject *module, PyObject *args)
{
    (void)module;
    int was = ampx_shim_enabled(), on;
    int ask = switch_arg(args, "|O:_set_tensor_shim", &on);
    if (ask <= 0)
        return ask < 0 ? NULL : PyBool_FromLong(was);
    if (on && need_probe("_set_tensor_shim(True)") < 0)
        return NULL;
    ampx_shim_set_enabled(on);
    return PyBool_FromLong(was);
}

PyObject *py_tensor_shim_storage_offset(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(ampx_shim_storage_offset());
}

/* ---- autograd's version counters (torch_shim.h) --------------------------- */

/* _set_autograd(increment_version, is_inference_mode_enabled): the Python
 * functions used where C cannot bump or ask itself (ampx/ops.py). */
PyObject *py_set_autograd(PyObject *module, PyObject *args)
{
    mstate *st = state_of(module);
    PyObject *inc, *mode;
    if (!PyArg_ParseTuple(args, "OO:_set_autograd", &inc, &mode))
        return NULL;
    if (!PyCallable_Check(inc) || !PyCallable_Check(mode)) {
        PyErr_SetString(PyExc_TypeError, "_set_autograd: both arguments must be callable");
        return NULL;
    }
    set_ref(&st->increment_version, inc);
    set_ref(&st->inference_mode_fn, mode);
    Py_RETURN_NONE;
}

/* A plain tensor's at::Tensor for the version functions, or NULL with TypeError. */
static void *version_handle(mstate *st, PyObject *t)
{
    if (state_ready(st) < 0)
        return NULL;
    if (!ampx_shim_versions_found() || !ampx_shim_probed() || st->param_type == NULL ||
        (Py_TYPE(t) != (PyTypeObject *)st->tensor_type && Py_TYPE(t) != (PyTypeObject *)st->param_type)) {
        PyErr_SetString(PyExc_TypeError, "needs a plain torch.Tensor or Parameter and the probed shim");
        return NULL;
    }
    return ampx_shim_handle(t);
}

/* _shim_version_counter(t) -> the address of t's counter (0: none). Probe only. */
PyObject *py_shim_version_counter(PyObject *module, PyObject *t)
{
    void *h = version_handle(state_of(module), t);
    return h == NULL ? NULL : PyLong_FromSize_t((size_t)ampx_shim_version_counter(h));
}

/* _shim_bump(t): adds one to t's version from C. Probe only; refuses a tensor
 * without a counter (torch would throw, which C cannot catch). */
PyObject *py_shim_bump(PyObject *module, PyObject *t)
{
    void *h = version_handle(state_of(module), t);
    if (h == NULL)
        return NULL;
    if (ampx_shim_version_counter(h) == 0) {
        PyErr_SetString(PyExc_ValueError, "_shim_bump: the tensor has no version counter");
        return NULL;
    }
    ampx_shim_bump(h);
    Py_RETURN_NONE;
}

/* _shim_inference_mode() -> whether C sees torch.inference_mode() on (None: not found). */
PyObject *py_shim_inference_mode(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (!ampx_shim_versions_found())
        Py_RETURN_NONE;
    return PyBool_FromLong(ampx_shim_inference_mode());
}

/* _set_versions(on=None) -> whether C bumped counters itself; None only asks.
 * Turning it on needs the shim's passed probe (the counters are found through
 * the at::Tensor layout that probe checks) and the functions found. */
PyObject *py_set_versions(PyObject *module, PyObject *args)
{
    (void)module;
    int was = ampx_shim_versions_on(), on;
    int ask = switch_arg(args, "|O:_set_versions", &on);
    if (ask <= 0)
        return ask < 0 ? NULL : PyBool_FromLong(was);
    if (on && need_probe("_set_versions(True)") < 0)
        return NULL;
    if (on && !ampx_shim_versions_found()) {
        PyErr_SetString(PyExc_RuntimeError, "torch's version-counter functions were not found");
        return NULL;
    }
    ampx_shim_set_versions_on(on);
    return PyBool_FromLong(was);
}
