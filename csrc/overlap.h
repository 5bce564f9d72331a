/*
 * overlap.h: finding memory shared between the tensors of a call, over spans
 * of addresses (overlap.c).
 *
 * Pure C: no Python, no allocation that can fail the call (a sort that cannot
 * get its buffer falls back to qsort), so it may run without the GIL. The
 * binding layer (tensor_list.c) builds the spans from tensors it has read and
 * turns a found overlap into its exception.
 */
#ifndef AMPX_OVERLAP_H
#define AMPX_OVERLAP_H

#include <stddef.h>
#include <stdint.h>

/* The memory [lo, hi) of list item idx; `written` if a kernel writes it. */
typedef struct {
    uintptr_t lo, hi;
    ptrdiff_t idx;
    int written;
} ampx_span;

/* Finds two spans of s[0..m) that overlap, at least one of them written.
 * Returns 1 with the pair in *x and *y (x starting first), 0 if there is
 * none. Sorts s by start address in place. */
int ampx_find_overlap(ampx_span *s, ptrdiff_t m, ampx_span *x, ampx_span *y);

#endif /* AMPX_OVERLAP_H */
