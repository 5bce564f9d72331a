/*
 * collect_grads.c: collect_grads (collect_grads.h), the walk over an
 * optimizer's param_groups that ampx.GradScaler makes every step.
 *
 * Owns only the lists it builds (handed to the caller) and the references it
 * takes while iterating (dropped before it returns). Needs the GIL. May call:
 * the state (state.h) only.
 */
#include "collect_grads.h"

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

PyObject *py_collect_grads(PyObject *module, PyObject *groups)
{
    mstate *st = state_of(module);
    if (state_ready(st) < 0)
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
