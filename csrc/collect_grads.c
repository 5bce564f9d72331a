/*
 * collect_grads.c: collect_grads (collect_grads.h), the walk over an
 * optimizer's param_groups that ampx.GradScaler makes every step.
 *
 * Owns only the lists it builds (handed to the caller) and the references it
 * takes while iterating (dropped before it returns). Needs the GIL. May call:
 * the state (state.h) and one tensor's device read (tensor_meta.h).
 */
#include "collect_grads.h"
#include "tensor_meta.h"

static int append_int(PyObject *list, int v)
{
    PyObject *o = PyLong_FromLong(v);
    int rc = o == NULL ? -1 : PyList_Append(list, o);
    Py_XDECREF(o);
    return rc;
}

/* Where the gradients collected so far live: the first one's device key and,
 * only once a gradient elsewhere has been seen, every gradient's key. */
typedef struct {
    Py_ssize_t n;
    int first;
    PyObject *keys; /* NULL while every gradient is on `first` (owned) */
} devices_seen;

/* Notes the device of the n-th gradient g. Returns 0, or -1 with an exception set. */
static int note_device(mstate *st, devices_seen *d, PyObject *g)
{
    int key = 0;
    if (tensor_device_key(st, g, &key) < 0)
        return -1;
    if (d->n++ == 0) {
        d->first = key;
        return 0;
    }
    if (d->keys == NULL && key == d->first)
        return 0;
    if (d->keys == NULL) {
        if ((d->keys = PyList_New(0)) == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < d->n - 1; i++)
            if (append_int(d->keys, d->first) < 0)
                return -1;
    }
    return append_int(d->keys, key);
}

/* Appends (p, p.grad) for each parameter of `params` (any iterable) whose
 * grad is not None. Returns 0, or -1 with an exception set. */
static int collect_group(mstate *st, PyObject *params, PyObject *plist, PyObject *glist, devices_seen *d)
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
            rc = (PyList_Append(plist, p) < 0 || PyList_Append(glist, g) < 0 || note_device(st, d, g) < 0) ? -1 : 0;
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
    devices_seen d = {0, 0, NULL};
    if (plist == NULL || glist == NULL)
        goto error;
    if ((it = PyObject_GetIter(groups)) == NULL)
        goto error;
    while ((group = PyIter_Next(it)) != NULL) {
        PyObject *params = PyObject_GetItem(group, st->s_params);
        Py_DECREF(group);
        if (params == NULL)
            goto error;
        int rc = collect_group(st, params, plist, glist, &d);
        Py_DECREF(params);
        if (rc < 0)
            goto error;
    }
    if (PyErr_Occurred())
        goto error;
    Py_DECREF(it);
    PyObject *r = PyTuple_New(3);
    if (r == NULL) {
        Py_DECREF(plist);
        Py_DECREF(glist);
        Py_XDECREF(d.keys);
        return NULL;
    }
    PyTuple_SetItem(r, 0, plist); /* steals */
    PyTuple_SetItem(r, 1, glist);
    PyTuple_SetItem(r, 2, d.keys != NULL ? d.keys : new_ref(Py_None));
    return r;
error:
    Py_XDECREF(d.keys);
    Py_XDECREF(it);
    Py_XDECREF(plist);
    Py_XDECREF(glist);
    return NULL;
}
