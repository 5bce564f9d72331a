/*
 * overlap.c: whether written tensors share memory, over address spans.
 *
 * Pure C (overlap.h): called by tensor_list.c with the GIL held, but needs
 * none of it. Calls nothing of ampx's.
 */
#include "overlap.h"

#include <stdlib.h>
#include <string.h>

static int span_cmp(const void *a, const void *b)
{
    uintptr_t x = ((const ampx_span *)a)->lo, y = ((const ampx_span *)b)->lo;
    return x < y ? -1 : x > y;
}

#define RADIX_BITS 11

/* Sorts spans by start address with a least-significant-digit radix sort over
 * the addresses' offsets from the lowest one (a few passes of RADIX_BITS
 * bits). Returns -1, leaving s as it was, when its buffer cannot be had. */
static int radix_sort_spans(ampx_span *s, ptrdiff_t m)
{
    uintptr_t base = s[0].lo, top = s[0].lo;
    for (ptrdiff_t k = 1; k < m; k++) {
        if (s[k].lo < base)
            base = s[k].lo;
        if (s[k].lo > top)
            top = s[k].lo;
    }
    ampx_span *buf = (ampx_span *)malloc((size_t)m * sizeof *buf);
    if (buf == NULL)
        return -1;
    size_t count[1u << RADIX_BITS];
    ampx_span *from = s, *to = buf;
    const uintptr_t mask = ((uintptr_t)1 << RADIX_BITS) - 1;
    for (unsigned shift = 0; shift < 8 * sizeof(uintptr_t) && ((top - base) >> shift) != 0; shift += RADIX_BITS) {
        memset(count, 0, sizeof count);
        for (ptrdiff_t k = 0; k < m; k++)
            count[((from[k].lo - base) >> shift) & mask]++;
        size_t pos = 0;
        for (size_t b = 0; b <= mask; b++) {
            size_t c = count[b];
            count[b] = pos;
            pos += c;
        }
        for (ptrdiff_t k = 0; k < m; k++)
            to[count[((from[k].lo - base) >> shift) & mask]++] = from[k];
        ampx_span *t = from;
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
static void sort_spans(ampx_span *s, ptrdiff_t m)
{
    int asc = 1, desc = 1;
    for (ptrdiff_t k = 1; k < m && (asc || desc); k++) {
        if (s[k - 1].lo > s[k].lo)
            asc = 0;
        if (s[k - 1].lo < s[k].lo)
            desc = 0;
    }
    if (asc)
        return;
    if (desc) {
        for (ptrdiff_t a = 0, b = m - 1; a < b; a++, b--) {
            ampx_span t = s[a];
            s[a] = s[b];
            s[b] = t;
        }
        return;
    }
    if (m < 64 || radix_sort_spans(s, m) < 0)
        qsort(s, (size_t)m, sizeof *s, span_cmp);
}

int ampx_find_overlap(ampx_span *s, ptrdiff_t m, ampx_span *x, ampx_span *y)
{
    sort_spans(s, m);
    ptrdiff_t all = -1, wr = -1; /* spans reaching furthest: any, written */
    for (ptrdiff_t k = 0; k < m; k++) {
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
