/*
 * collect_grads.h: the scaler's per-step walk over an optimizer's parameter
 * groups, in C (collect_grads.c).
 */
#ifndef AMPX_COLLECT_GRADS_H
#define AMPX_COLLECT_GRADS_H

#include "state.h"

/* collect_grads(param_groups) -> (params, grads, devices): the parameters of
 * param_groups whose .grad is set, in order, those grads, and None when every
 * grad is on one device, else a list of each grad's device key (a CUDA index,
 * -1 for the CPU, -2 for any other device): the scaler splits its pass by
 * device from this, so a list is never sent down twice. New references,
 * owned by the caller. Needs the GIL; raises what torch would for a
 * non-tensor parameter. */
PyObject *py_collect_grads(PyObject *module, PyObject *groups);

#endif /* AMPX_COLLECT_GRADS_H */
