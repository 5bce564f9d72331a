/*
 * coalesce.c: runs of back-to-back tensors as spans (ampx_coalesce, declared in
 * multi_tensor.h). Pure C with no other dependency, so that the CPU launcher, the CUDA
 * entry points and the kernels' CPU emulation (tests/test_cuda.py) share it.
 */
#include "multi_tensor.h"

void ampx_coalesce(const ampx_tensor *ts, int64_t n, ampx_tensor *spans, int64_t *first, int64_t *nspans)
{
    int64_t m = 0;
    const char *end = NULL; /* where the open span's memory ends */
    for (int64_t i = 0; i < n; i++) {
        const ampx_tensor *t = &ts[i];
        if (t->numel == 0) {
            if (m == 0)
                first[0] = 0; /* leading empties belong to the first span */
            continue;
        }
        size_t bytes = (size_t)t->numel * ampx_elem_size(t->dtype);
        ampx_tensor *open = m > 0 ? &spans[m - 1] : NULL;
        if (open != NULL && t->dtype == open->dtype && t->ptr == end) {
            open->numel += t->numel; /* ascending: starts where the span ends */
            end = t->ptr + bytes;
        } else if (open != NULL && t->dtype == open->dtype && t->ptr + bytes == open->ptr) {
            open->ptr = t->ptr; /* descending (DDP's bucket views): ends where the span starts */
            open->numel += t->numel;
        } else {
            if (m > 0)
                first[m] = i;
            else
                first[0] = 0;
            spans[m++] = *t;
            end = t->ptr + bytes;
        }
    }
    first[m] = n;
    *nspans = m;
}
