/*
 * module.c: ampx._C, the C extension behind ampx.ops: its state's life
 * (state.h), _init, the method table, the exported constants, and the small
 * process-wide settings (SIMD level, thread backend, parallel threshold).
 *
 * Written against the limited C API of Python 3.9 (one abi3 build serves
 * every later Python) and without any torch header, so one build serves
 * every torch version too. The work lives in one file per job:
 *   tensor_meta.c    one tensor's metadata, its checks and error texts; the shim's probe
 *   tensor_list.c    a list of tensors gathered, staged and copied back; sharing rules
 *   overlap.c        whether written tensors share memory (pure C)
 *   entry.c          scale_reduce, cast, update_scale: keywords, validation, dispatch
 *   entry_cpu.c      their CPU runners (the GIL released around the kernels)
 *   entry_cuda.c     their CUDA runners; the fatbin and device queries
 *   collect_grads.c  the scaler's walk over param_groups
 *
 * The functions here are private; ampx/ops.py is the public, documented API.
 * May call: every binding file's Python functions (their headers),
 * cpu_dispatch.h and threadpool.h (the settings).
 */
#include "state.h"

#include "collect_grads.h"
#include "cpu_dispatch.h"
#include "cuda_driver.h"
#include "entry.h"
#include "multi_tensor.h"
#include "tensor_meta.h"
#include "threadpool.h"

/* _init(torch.Tensor, float32, float16, bfloat16, float64, uint8, int32, torch.strided,
 *       TensorBase.dtype, TensorBase.is_cpu, TensorBase.nbytes descriptors):
 * called once by ampx/__init__.py (the dtypes in AMPX_DTYPE_LIST's order, the
 * descriptors in AMPX_HOT_ATTR_LIST's). */
_Static_assert(1 + AMPX_NUM_DTYPES + 3 + AMPX_NUM_HOT_ATTRS == 11, "_init's arguments");

static PyObject *py_init(PyObject *module, PyObject *args)
{
    mstate *st = state_of(module);
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
    for (int k = 0; k < AMPX_NUM_HOT_ATTRS; k++) {
        set_ref(&st->descr[k], o[8 + k]);
        /* Python 3.9's limited API cannot fetch slots of static types: fall
         * back to reading the attribute by name. */
        st->getter[k] = (descrgetfunc)PyType_GetSlot(Py_TYPE(o[8 + k]), Py_tp_descr_get);
        if (st->getter[k] == NULL)
            PyErr_Clear();
    }
    Py_RETURN_NONE;
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

/* Sets a non-negative int64 setting from args (format "L:name"); returns its previous value. */
static PyObject *swap_count(PyObject *args, const char *format, const char *what, int64_t *setting)
{
    long long n;
    if (!PyArg_ParseTuple(args, format, &n))
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0", what);
        return NULL;
    }
    long long prev = (long long)*setting;
    *setting = (int64_t)n;
    return PyLong_FromLongLong(prev);
}

/* set_parallel_threshold(n) -> previous n: below n elements in all, a call runs on one thread. */
static PyObject *py_set_parallel_threshold(PyObject *module, PyObject *args)
{
    (void)module;
    return swap_count(args, "L:set_parallel_threshold", "set_parallel_threshold: the threshold", &ampx_parallel_min);
}

/* set_split_max_bytes(n) -> previous n: calls of more bytes than n share their work dynamically
 * even when asked to follow torch's split (multi_tensor.h); 0 never follows it. */
static PyObject *py_set_split_max_bytes(PyObject *module, PyObject *args)
{
    (void)module;
    return swap_count(args, "L:set_split_max_bytes", "set_split_max_bytes: the limit", &ampx_split_max_bytes);
}

/* _set_span_tables_min_launches(n) -> previous n: CUDA span tables only when they save n
 * launches or more (entry_cuda.c; benchmarks). */
static PyObject *py_set_span_tables_min_launches(PyObject *module, PyObject *args)
{
    (void)module;
    return swap_count(args, "L:_set_span_tables_min_launches", "_set_span_tables_min_launches: the count",
                      &ampx_cu_span_tables_min_launches);
}

/* _set_coalesce(on) -> previous: whether back-to-back tensors run as one span (tests, benchmarks). */
static PyObject *py_set_coalesce(PyObject *module, PyObject *args)
{
    (void)module;
    int on;
    if (!PyArg_ParseTuple(args, "p:_set_coalesce", &on))
        return NULL;
    int prev = ampx_coalesce_on;
    ampx_coalesce_on = on;
    return PyBool_FromLong(prev);
}

/* _last_split() -> how the last CPU scale_reduce shared its work: 0 dynamically, 1 or 2 as torch (tests). */
static PyObject *py_last_split(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong((long)ampx_last_split);
}

/* _torch_part(split, numel, elem_size, nthreads, t) -> (begin, end): thread t's part (tests). */
static PyObject *py_torch_part(PyObject *module, PyObject *args)
{
    (void)module;
    int split, nthreads, t;
    long long numel, elem;
    if (!PyArg_ParseTuple(args, "iLLii:_torch_part", &split, &numel, &elem, &nthreads, &t))
        return NULL;
    if ((split != AMPX_SPLIT_LINES && split != AMPX_SPLIT_ELEMENTS) || numel < 0 || (elem != 2 && elem != 4 && elem != 8) ||
        nthreads < 1 || t < 0 || t >= nthreads) {
        PyErr_SetString(PyExc_ValueError, "_torch_part: split 1 or 2, numel >= 0, elem_size 2, 4 or 8, 0 <= t < nthreads");
        return NULL;
    }
    int64_t b, e;
    ampx_torch_part(split, (int64_t)numel, (size_t)elem, nthreads, t, &b, &e);
    return Py_BuildValue("(LL)", (long long)b, (long long)e);
}

/* _last_spans() -> the spans the last scale_reduce (CPU or CUDA) ran, or -1 if it ran per tensor (tests). */
static PyObject *py_last_spans(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLongLong((long long)ampx_last_spans);
}

#define KW(f) (PyCFunction)(void (*)(void))(f), METH_VARARGS | METH_KEYWORDS

static PyMethodDef methods[] = {
    {"_init", py_init, METH_VARARGS, "Hands torch's types to the extension (called by ampx)."},
    {"_enable_tensor_shim", py_enable_tensor_shim, METH_VARARGS,
     "Turns on the fast tensor read through torch's C shim if its probe passes; else says why not."},
    {"_set_tensor_shim", py_set_tensor_shim, METH_VARARGS, "Turns the fast tensor read on or off (tests)."},
    {"_tensor_shim_storage_offset", py_tensor_shim_storage_offset, METH_NOARGS,
     "Where the probe found a TensorImpl's storage pointer (prefetch aim), or -1."},
    {"_set_autograd", py_set_autograd, METH_VARARGS,
     "Hands over torch's increment_version and is_inference_mode_enabled (called by ampx.ops)."},
    {"_shim_version_counter", py_shim_version_counter, METH_O, "Address of a tensor's version counter (probe)."},
    {"_shim_bump", py_shim_bump, METH_O, "Bumps a tensor's version from C (probe)."},
    {"_shim_inference_mode", py_shim_inference_mode, METH_NOARGS, "Inference mode as C sees it (probe)."},
    {"_set_versions", py_set_versions, METH_VARARGS, "Whether C bumps version counters itself (tests)."},
    {"scale_reduce", KW(py_scale_reduce), "Scale / check / reduce kernel over a tensor list, on its device."},
    {"check_flags", py_check_flags, METH_VARARGS,
     "check_flags(tensors, flags, nthreads): check_finite's CPU kernel, positional arguments only."},
    {"check_written", py_check_written, METH_VARARGS,
     "Raises what a write into a tensor list on a device would refuse; writes nothing."},
    {"cast", KW(py_cast), "Cast kernel between two tensor lists, on their device."},
    {"update_scale", KW(py_update_scale), "One loss-scale update of the tensors, on their device."},
    {"tensor_stats", KW(py_tensor_stats), "Per-tensor statistics rows (ampx/stats.py) of a tensor list, on its device."},
    {"cuda_set_image", py_cuda_set_image, METH_O, "Hands the CUDA kernels' fatbin to the extension."},
    {"cuda_probe", py_cuda_probe, METH_O, "None if a CUDA device can run ampx's kernels, else why not."},
    {"cuda_device_info", py_cuda_device_info, METH_O,
     "(cc major, cc minor, multiprocessors, driver version) of a CUDA device; loads the kernels."},
    {"collect_grads", py_collect_grads, METH_O, "(params, grads) of param_groups whose grad is set."},
    {"simd", py_simd, METH_NOARGS, "Name of the SIMD level in use."},
    {"thread_backend", py_thread_backend, METH_NOARGS,
     "Where parallel CPU work runs: the loaded OpenMP runtime's path, or \"ampx pool\"."},
    {"simd_levels", py_simd_levels, METH_NOARGS, "SIMD levels this processor supports, best first."},
    {"set_simd", py_set_simd, METH_VARARGS, "Selects a SIMD level; returns the previous one."},
    {"_set_coalesce", py_set_coalesce, METH_VARARGS, "Turns coalescing of back-to-back tensors on or off (tests)."},
    {"_torch_part", py_torch_part, METH_VARARGS, "Thread t's part of a tensor under a split as torch's (tests)."},
    {"_last_split", py_last_split, METH_NOARGS, "Split of the last CPU scale_reduce: 0 dynamic, 1/2 as torch (tests)."},
    {"_last_spans", py_last_spans, METH_NOARGS, "Spans of the last scale_reduce, -1 if per tensor (tests)."},
    {"_set_span_tables_min_launches", py_set_span_tables_min_launches, METH_VARARGS,
     "CUDA: use span tables only when coalescing saves at least n launches; returns the previous n."},
    {"set_split_max_bytes", py_set_split_max_bytes, METH_VARARGS,
     "set_split_max_bytes(n) -> previous n: above n bytes (default 16 MiB) a call's threads share its tensors "
     "dynamically, not as torch's next kernel will (0: never as torch)."},
    {"set_parallel_threshold", py_set_parallel_threshold, METH_VARARGS,
     "Sets the element count below which kernels run single-threaded; returns the previous one."},
    {NULL, NULL, 0, NULL},
};

#undef KW

static int add_constants(PyObject *m)
{
    if (PyModule_AddIntConstant(m, "CHUNK", (long)AMPX_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "PARALLEL_MIN", (long)AMPX_PARALLEL_MIN_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "GIL_RELEASE_MIN", (long)GIL_RELEASE_MIN) < 0 ||
        PyModule_AddIntConstant(m, "MODE_SCALE", AMPX_M_SCALE) < 0 ||
        PyModule_AddIntConstant(m, "MODE_WRITE", AMPX_M_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "MODE_CHECK", AMPX_M_CHECK) < 0 ||
        PyModule_AddIntConstant(m, "MODE_REDUCE_SHIFT", AMPX_M_REDUCE_SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_INF", AMPX_FLAG_INF) < 0 ||
        PyModule_AddIntConstant(m, "STATS_WIDTH", AMPX_STATS_WIDTH) < 0 ||
        PyModule_AddIntConstant(m, "STATS_HIST", AMPX_STATS_HIST) < 0 ||
        PyModule_AddIntConstant(m, "STATS_EXP_MIN", AMPX_STATS_EXP_MIN) < 0 ||
        PyModule_AddIntConstant(m, "STATS_EXP_MAX", AMPX_STATS_EXP_MAX) < 0 ||
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
    if (PyModule_AddIntConstant(m, "REDUCE_" #name, AMPX_REDUCE_##name) < 0)                                \
        return -1;
    AMPX_REDUCE_LIST(ADD_REDUCE)
#undef ADD_REDUCE
    return 0;
}

static int exec_module(PyObject *m)
{
    mstate *st = state_of(m);
#define INTERN(name)                                                                                       \
    if ((st->s_##name = PyUnicode_InternFromString(#name)) == NULL)                                        \
        return -1;
    AMPX_STATE_NAMES(INTERN)
#undef INTERN
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
    return add_constants(m);
}

/* traverse and clear apply STATE_DO to every object of the state:
 * AMPX_STATE_OBJECTS and AMPX_STATE_NAMES (state.h). */
#define DO_ONE(f) STATE_DO(st->f);
#define DO_ARRAY(f, n)                                                                                     \
    for (int k = 0; k < (n); k++)                                                                          \
        STATE_DO(st->f[k]);
#define DO_NAME(name) STATE_DO(st->s_##name);
#define EACH_STATE_OBJECT AMPX_STATE_OBJECTS(DO_ONE, DO_ARRAY) AMPX_STATE_NAMES(DO_NAME)

static int m_traverse(PyObject *m, visitproc visit, void *arg)
{
    mstate *st = state_of(m);
    if (st == NULL)
        return 0;
#define STATE_DO Py_VISIT
    EACH_STATE_OBJECT
#undef STATE_DO
    return 0;
}

static int m_clear(PyObject *m)
{
    mstate *st = state_of(m);
    if (st == NULL)
        return 0;
#define STATE_DO Py_CLEAR
    EACH_STATE_OBJECT
#undef STATE_DO
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
