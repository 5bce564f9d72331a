/*
 * state.h: ampx._C's module state, its accessor, and the reference helpers
 * every file of the binding layer shares.
 *
 * Owns: the state struct (torch's types and dtypes handed over by _init, the
 * getset descriptors of the hot tensor attributes, the interned names,
 * LayoutError). Each object field is named once, in AMPX_STATE_OBJECTS or
 * AMPX_STATE_NAMES: the struct, module.c's traverse and clear and its
 * interning are generated from those lists.
 *
 * References: the state owns one strong reference to every object field
 * (module.c's m_clear drops them). Functions handed an mstate borrow it; it
 * lives as long as the module, which every caller of an entry point holds.
 *
 * Included by the binding layer only (module.c, tensor_meta.c,
 * tensor_list.c, entry*.c, collect_grads.c). The pure-C files (overlap.c,
 * multi_tensor.c, cuda_*.c, torch_shim.c ...) never include it nor Python.h.
 */
#ifndef AMPX_STATE_H
#define AMPX_STATE_H

#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ampx_numerics.h"

/* The hot per-tensor attributes, read through their getset descriptors when
 * the running Python lets the limited API reach the getter (3.10+), else by
 * name: X(index name, attribute). _init receives their descriptors in this
 * order (ampx/__init__.py). */
#define AMPX_HOT_ATTR_LIST(X) X(A_DTYPE, dtype) X(A_IS_CPU, is_cpu) X(A_NBYTES, nbytes)

#define AMPX_X_HOT_INDEX(index, attr) index,
enum { AMPX_HOT_ATTR_LIST(AMPX_X_HOT_INDEX) AMPX_NUM_HOT_ATTRS };
#undef AMPX_X_HOT_INDEX

/* Interned names of attributes and methods: X(name) is the field s_<name>,
 * holding the string "name". */
#define AMPX_STATE_NAMES(X)                                                                                \
    X(dtype) X(is_cpu) X(is_cuda) X(device) X(layout) X(numel) X(is_contiguous) X(data_ptr) X(contiguous) \
    X(copy_) X(grad) X(params) X(size) X(stride) X(nbytes) X(get_device) X(_cdata) X(resolve_neg)         \
    X(detach) X(is_inference) X(untyped_storage)

/* The other objects the state owns: X(field) for one, A(field, n) for an array. */
#define AMPX_STATE_OBJECTS(X, A)                                                                           \
    X(tensor_type)              /* torch.Tensor */                                                         \
    X(param_type)               /* torch.nn.Parameter, read through the shim too; set by its probe */     \
    A(dtypes, AMPX_NUM_DTYPES)  /* torch's dtype for each AMPX_DTYPE_LIST code */                         \
    X(dtype_u8) X(dtype_i32)    /* torch.uint8, torch.int32: flags, trackers, events */                   \
    X(strided)                  /* torch.strided */                                                        \
    A(descr, AMPX_NUM_HOT_ATTRS) /* TensorBase's getset descriptors of the hot attributes */              \
    X(descr_is_cuda)            /* TensorBase.is_cuda, fetched on the first CUDA call */                  \
    X(descr_is_neg)             /* TensorBase.is_neg, fetched on the first cast */                        \
    X(layout_error)             /* ampx._C.LayoutError, a ValueError */                                   \
    X(increment_version)        /* bumps a list's version counters (torch._C._increment_version) */      \
    X(inference_mode_fn)        /* torch.is_inference_mode_enabled */

typedef struct {
#define AMPX_X_FIELD(f) PyObject *f;
#define AMPX_X_ARRAY(f, n) PyObject *f[n];
#define AMPX_X_NAME(name) PyObject *s_##name;
    AMPX_STATE_OBJECTS(AMPX_X_FIELD, AMPX_X_ARRAY)
    AMPX_STATE_NAMES(AMPX_X_NAME)
#undef AMPX_X_FIELD
#undef AMPX_X_ARRAY
#undef AMPX_X_NAME
    /* Not objects: the getters of descr[] and descr_is_cuda, NULL where the
     * limited API cannot reach them (Python 3.9: read by name instead). */
    descrgetfunc getter[AMPX_NUM_HOT_ATTRS];
    descrgetfunc getter_is_cuda;
} mstate;

static inline mstate *state_of(PyObject *module) { return (mstate *)PyModule_GetState(module); }

/* 0 once _init has run; else -1 with RuntimeError set. Every entry point that
 * reads tensors calls it first. */
static inline int state_ready(mstate *st)
{
    if (st->tensor_type != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "ampx._C is not initialised: import ampx, not ampx._C");
    return -1;
}

/* Py_NewRef and Py_XSETREF are not in the 3.9 limited API. */
static inline PyObject *new_ref(PyObject *o)
{
    Py_INCREF(o);
    return o;
}

static inline void set_ref(PyObject **slot, PyObject *o)
{
    PyObject *old = *slot;
    Py_INCREF(o);
    *slot = o;
    Py_XDECREF(old);
}

#endif /* AMPX_STATE_H */
