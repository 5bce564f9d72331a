/*
 * collect_grads.h: the scaler's per-step walk over an optimizer's parameter
 * groups, in C (collect_grads.c).
 */
#ifndef AMPX_COLLECT_GRADS_H
#define AMPX_COLLECT_GRADS_H

#include "state.h"

/* collect_grads(param_groups) -> (params, grads): the parameters of
 * param_groups whose .grad is set, in order, and those grads (two new lists,
 * owned by the caller). Needs the GIL; raises what torch would for a
 * non-tensor parameter. */
PyObject *py_collect_grads(PyObject *module, PyObject *groups);

#endif /* AMPX_COLLECT_GRADS_H */
