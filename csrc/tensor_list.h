/*
 * tensor_list.h: gathering a list of tensors into kernel descriptors, and
 * what lists need around their kernels: contiguous copies of non-contiguous
 * tensors (staging) and copying them back, the sharing rules between written
 * tensors, the pairing of a cast's two lists (tensor_list.c).
 *
 * Every function needs the GIL and returns 0 (or a count) on success, -1 with
 * a Python exception set on failure.
 *
 * Ownership: a tlist owns a tuple of its tensors (so none dies while kernels
 * write through their pointers with the GIL released), every staged copy in
 * tmp[], and the storages it holds (tlist_hold_storages); tlist_free drops them all and may be called on a zeroed or freed
 * list. On failure tlist_gather and gather_cast_lists leave their lists freed.
 */
#ifndef AMPX_TENSOR_LIST_H
#define AMPX_TENSOR_LIST_H

#include <stdint.h>

#include "multi_tensor.h"
#include "state.h"

typedef struct {
    Py_ssize_t n;
    PyObject *seq;         /* owned tuple of the tensors: keeps them alive while the GIL is released */
    PyObject **items;      /* n borrowed references: seq's items, read once (the limited API has no
                              macro for them, and each PyTuple_GetItem call costs a few ns a tensor) */
    ampx_tensor *ts;       /* n descriptors (ptr NULL for a written non-contiguous tensor until staged) */
    unsigned char *nc;     /* n: non-contiguous (handled through a contiguous copy) */
    unsigned char *neg;    /* n: has torch's negative bit (read for casts only; else all 0) */
    PyObject **tmp;        /* n: owned contiguous copies, or NULL */
    uintptr_t *lo, *hi;    /* n: the memory each tensor's elements span (its own, not a copy's) */
    uint64_t *layout;      /* n: fingerprint of a non-contiguous tensor's sizes and strides (else 0) */
    uintptr_t *impl;       /* n, written lists: the at::Tensor word (TensorImpl address) of a tensor
                              whose counter C bumps itself (tlist_bump_versions), else 0 */
    uintptr_t *counter;    /* n, written lists: the address of the version counter bumped from C */
    unsigned char *bump_py;/* n, written lists: bumped through Python (state's increment_version) */
    void **holds;          /* owned aliases keeping storages alive (tlist_hold_storages), nholds of them */
    Py_ssize_t nholds;
    PyObject *pyholds;     /* owned list of storages held from Python, or NULL */
    int any_nc;
    int64_t total;         /* elements in all */
} tlist;

/* Item i of a gathered list (a borrowed reference the tuple keeps alive). */
static inline PyObject *tlist_item(const tlist *L, Py_ssize_t i) { return L->items[i]; }

void tlist_free(tlist *L);

/* Reads every tensor of seq (a list or tuple; argument `arg` of `op`) into L:
 * tensors on `device` (-1: the CPU, else a CUDA device index), of a supported
 * dtype, strided. A written list (`write`) may not hold a tensor that overlaps
 * itself; its non-contiguous tensors are staged later (tlist_each_staged). A
 * read-only list gets contiguous copies of them here. `refuse_fp16` raises
 * torch's "Attempting to unscale FP16 gradients."; `want_neg` records each
 * tensor's negative bit in L->neg. A written list may hold an inference
 * tensor only inside torch.inference_mode() (torch's rule for in-place
 * updates); its version counters are noted for tlist_bump_versions. */
int tlist_gather(mstate *st, const char *op, const char *arg, PyObject *seq, int write, int refuse_fp16,
                 int device, int want_neg, tlist *L);

/* After a written list's kernels succeeded: adds one to each written
 * tensor's version counter, as torch's in-place ops do (inference tensors,
 * allowed inside torch.inference_mode() only, have none). Plain tensors are
 * bumped from C (torch_shim.h), the others through the state's
 * increment_version. */
int tlist_bump_versions(mstate *st, const tlist *L);

/* Before work that releases the GIL: keeps the storage of every tensor of L
 * (argument `arg` of `op`) alive until tlist_free, even if another thread
 * replaces a tensor's storage (`t.data = ...`) meanwhile; the kernels then
 * touch memory that stays valid (the replaced storage simply no longer backs
 * the tensor). Consecutive tensors sharing a storage (views of one buffer)
 * cost one reference. Plain tensors are held from C (torch_shim.h), others
 * through t.untyped_storage(). Checks that each pointer the gather read lies
 * in the storage now held (a replacement while the list was read raises
 * RuntimeError; nothing has been written then). Resizing a storage in place
 * (untyped_storage().resize_) during the call is not covered: torch's own
 * kernels are not safe from it either. */
int tlist_hold_storages(mstate *st, const char *op, const char *arg, tlist *L);
/* Holds the storage of one output tensor t (found_inf, flags, per_tensor, out: `arg`) whose data
 * pointer p was read, in H (a zeroed tlist used only as a holder; tlist_free drops the hold),
 * so that a GIL-released call never writes into a storage another thread freed. None or a NULL
 * p holds nothing. Raises RuntimeError when p no longer lies in t's storage (replaced meanwhile). */
int tlist_hold_output(mstate *st, tlist *H, const char *op, const char *arg, PyObject *t, const void *p);

/* How many references tlist_hold_storages would take: the runs of
 * consecutive non-empty tensors sharing one storage. */
int64_t tlist_count_storages(mstate *st, const tlist *L);

/* Whether a written list must be processed one tensor at a time, in list
 * order (it has a non-contiguous tensor, or two of its tensors share memory):
 * the result is then that of applying the op to each tensor in turn. */
int tlist_sequential(const tlist *L, int *sequential);

/* Runs the kernel of each tensor of L in list order through run(ctx, L, i),
 * which may release the GIL. Every non-contiguous tensor is first copied into
 * a contiguous one (L->ts[i].ptr then points at the copy), all of them before
 * the first run, so a failing copy (out of memory, a raising .contiguous())
 * leaves every tensor unwritten; each copy is refreshed just before its run
 * (an alias may have been written) and copied back after it. run returns 0,
 * or -1 with an exception set (which stops the loop). */
typedef int (*tlist_run_fn)(void *ctx, tlist *L, Py_ssize_t i);
int tlist_each_staged(mstate *st, tlist *L, tlist_run_fn run, void *ctx);

/* A cast's lists, gathered on `device` and checked to pair up: as many
 * tensors, the same element counts, bfloat16 destinations for stochastic
 * rounding. */
int gather_cast_lists(mstate *st, const char *op, PyObject *src_o, PyObject *dst_o, int device, int stochastic,
                      tlist *S, tlist *D);

/* Before a cast's kernel: non-contiguous destinations and negated tensors get
 * contiguous, resolved copies (owned by S->tmp / D->tmp); then S takes each
 * destination's pointer and dtype (its own become src), and the sharing rule
 * is checked: a destination may alias only its own source, exactly. */
int cast_prepare(mstate *st, const char *op, tlist *S, tlist *D);

/* After a cast's kernel: copies each staged destination back into the
 * caller's tensor. */
int cast_unstage(mstate *st, const tlist *D);

#endif /* AMPX_TENSOR_LIST_H */
