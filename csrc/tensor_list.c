/*
 * tensor_list.c: a list of tensors gathered into kernel descriptors
 * (tensor_list.h), its staging (contiguous copies of non-contiguous or
 * negated tensors, copied back after the kernels) and its sharing rules.
 *
 * A plain tensor is read through torch's C shim when the start-up probe
 * allowed it (torch_shim.h), with prefetches aimed ahead in the list; any
 * other tensor, and any the shim declines, through tensor_meta.c.
 *
 * Needs the GIL throughout. May call: tensor_meta.h, torch_shim.h,
 * overlap.h. Called by entry.c and the device runners (entry_cpu.c,
 * entry_cuda.c).
 */
#include "tensor_list.h"

#include <stdlib.h>
#include <string.h>

#include "overlap.h"
#include "tensor_meta.h"
#include "torch_shim.h"

void tlist_free(tlist *L)
{
    if (L->tmp != NULL)
        for (Py_ssize_t i = 0; i < L->n; i++)
            Py_XDECREF(L->tmp[i]);
    for (Py_ssize_t k = 0; k < L->nholds; k++)
        ampx_shim_release(L->holds[k]);
    free(L->holds);
    Py_XDECREF(L->pyholds);
    Py_XDECREF(L->seq);
    free(L->ts); /* the block every per-tensor array lives in (tlist_alloc) */
    memset(L, 0, sizeof *L);
}

/* Copies `staged` (where a kernel wrote) back into tensor t, outside autograd
 * (through t.detach(), which keeps t's memory and negative bit): the kernels
 * bypass autograd, and a leaf that requires grad (a Parameter, or a view of
 * one) would otherwise refuse the copy after other tensors had been written. */
static int copy_back(mstate *st, PyObject *t, PyObject *staged)
{
    PyObject *d = call0(t, st->s_detach);
    if (d == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodObjArgs(d, st->s_copy_, staged, NULL);
    Py_DECREF(d);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* A contiguous copy of t (new reference) in *out, its pointer in *ptr. */
static int contiguous_copy(mstate *st, PyObject *t, PyObject **out, char **ptr)
{
    PyObject *c = call0(t, st->s_contiguous);
    if (c == NULL)
        return -1;
    if (get_data_ptr(st, c, ptr) < 0) {
        Py_DECREF(c);
        return -1;
    }
    *out = c;
    return 0;
}

/* ---- gathering ------------------------------------------------------------- */

#define is_plain tensor_is_plain

/* Prefetch distances (in tensors) of the shim's three stages (torch_shim.h). */
#define PF_OBJ 12
#define PF_IMPL 8
#define PF_STORAGE 4

/* While tensor i of L is read, asks for the memory of those to come. */
static void prefetch_ahead(mstate *st, const tlist *L, Py_ssize_t i)
{
    if (i + PF_OBJ < L->n)
        ampx_shim_prefetch1(tlist_item(L, i + PF_OBJ));
    PyObject *u;
    if (i + PF_IMPL < L->n && is_plain(st, u = tlist_item(L, i + PF_IMPL)))
        ampx_shim_prefetch2(u);
    if (i + PF_STORAGE < L->n && is_plain(st, u = tlist_item(L, i + PF_STORAGE)))
        ampx_shim_prefetch3(u);
}

/* Takes a tuple of seq's items (owned by L) and allocates L's arrays. */
static int tlist_alloc(const char *op, const char *arg, PyObject *seq, tlist *L)
{
    memset(L, 0, sizeof *L);
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a list or tuple of tensors", op, arg);
        return -1;
    }
    /* Own the tensors for the whole call: the GIL is released while kernels
     * write through their data pointers, and another thread (or Python code
     * run by .contiguous()/.copy_()) could otherwise drop the last reference. */
    if ((L->seq = PySequence_Tuple(seq)) == NULL)
        return -1;
    Py_ssize_t n = PyTuple_Size(L->seq);
    if (n < 0) {
        tlist_free(L);
        return -1;
    }
    if ((size_t)n > (size_t)UINT32_MAX) {
        tlist_free(L);
        PyErr_Format(PyExc_ValueError, "%s: %s holds more than 2^32 tensors", op, arg);
        return -1;
    }
    L->n = n;
    /* One zeroed block for every per-tensor array (pointer-sized ones first, then bytes): a
     * call over one small tensor spent a fifth of its time in eleven allocations. */
    size_t m = n > 0 ? (size_t)n : 1u;
    size_t words = sizeof(ampx_tensor) + sizeof(PyObject *) * 2 + sizeof(uintptr_t) * 4 + sizeof(uint64_t);
    if (m > (SIZE_MAX - 64) / (words + 3)) {
        tlist_free(L);
        PyErr_NoMemory();
        return -1;
    }
    char *block = (char *)calloc(m, words + 3);
    if (block == NULL) {
        tlist_free(L);
        PyErr_NoMemory();
        return -1;
    }
    L->ts = (ampx_tensor *)block;
    block += m * sizeof *L->ts;
    L->tmp = (PyObject **)block;
    block += m * sizeof *L->tmp;
    L->items = (PyObject **)block;
    block += m * sizeof *L->items;
    L->lo = (uintptr_t *)block;
    block += m * sizeof *L->lo;
    L->hi = (uintptr_t *)block;
    block += m * sizeof *L->hi;
    L->impl = (uintptr_t *)block;
    block += m * sizeof *L->impl;
    L->counter = (uintptr_t *)block;
    block += m * sizeof *L->counter;
    L->layout = (uint64_t *)block;
    block += m * sizeof *L->layout;
    L->nc = (unsigned char *)block;
    L->neg = L->nc + m;
    L->bump_py = L->neg + m;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((L->items[i] = PyTuple_GetItem(L->seq, i)) == NULL) {
            tlist_free(L);
            return -1;
        }
    return 0;
}

static int refuse_fp16_error(void)
{
    /* torch.amp.GradScaler's own words, for drop-in compatibility. */
    PyErr_SetString(PyExc_ValueError, "Attempting to unscale FP16 gradients.");
    return -1;
}

/* Reads tensor i (t) of L through its Python attributes: any tensor the shim
 * did not take. */
static int read_by_attributes(mstate *st, const char *op, const char *arg, PyObject *t, Py_ssize_t i, int write,
                              int refuse_fp16, int device, int want_neg, tlist *L)
{
    ampx_tensor *d = &L->ts[i];
    int contig = 0;
    if ((d->dtype = dtype_code(st, op, arg, i, t)) < 0)
        return -1;
    if (tensor_meta(st, op, arg, i, t, ampx_elem_size(d->dtype), device, &d->numel, &contig) < 0)
        return -1;
    if (refuse_fp16 && d->dtype == AMPX_F16)
        return refuse_fp16_error();
    L->total += d->numel;
    if (d->numel == 0)
        return 0;
    if (want_neg && neg_flag(st, t, &L->neg[i]) < 0)
        return -1;
    if (contig) {
        if (get_data_ptr(st, t, &d->ptr) < 0)
            return -1;
        L->lo[i] = (uintptr_t)d->ptr;
        L->hi[i] = L->lo[i] + (uintptr_t)(d->numel * ampx_elem_size(d->dtype));
        return check_in_storage(st, op, arg, i, t, L->lo[i], L->hi[i], ampx_elem_size(d->dtype));
    }
    L->nc[i] = 1;
    L->any_nc = 1;
    int overlap = 0;
    if (strided_extent(st, t, ampx_elem_size(d->dtype), &L->lo[i], &L->hi[i], &overlap, &L->layout[i]) < 0 ||
        check_in_storage(st, op, arg, i, t, L->lo[i], L->hi[i], ampx_elem_size(d->dtype)) < 0)
        return -1;
    if (write && overlap) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s[%zd] may have internal overlap (several of its elements can share "
                     "memory, as in an expanded view), so it cannot be written in place",
                     op, arg, i);
        return -1;
    }
    if (!write)
        return contiguous_copy(st, t, &L->tmp[i], &d->ptr);
    return 0;
}

/* ---- version counters and inference tensors -------------------------------- */

/* Whether torch.inference_mode() is on in this thread: 1, 0, or -1 with an
 * exception set. */
static int inference_mode(mstate *st)
{
    if (ampx_shim_versions_on())
        return ampx_shim_inference_mode();
    if (st->inference_mode_fn == NULL)
        return 0;
    PyObject *r = PyObject_CallObject(st->inference_mode_fn, NULL);
    if (r == NULL)
        return -1;
    int on = PyObject_IsTrue(r);
    Py_DECREF(r);
    return on;
}

static int inference_error(const char *op, const char *arg, Py_ssize_t i)
{
    /* torch's rule and advice, in ampx's form (op, argument, position). */
    PyErr_Format(PyExc_RuntimeError,
                 "%s: %s[%zd] is an inference tensor, and in-place updates to inference tensors outside "
                 "torch.inference_mode() are not allowed; make a clone to get a normal tensor, or call "
                 "this inside torch.inference_mode() (nothing was written)",
                 op, arg, i);
    return -1;
}

/* For tensor i (t) of a written list: refuses an inference tensor outside
 * inference mode (`infmode`), and notes how its counter will be bumped. */
static int note_version(mstate *st, const char *op, const char *arg, Py_ssize_t i, PyObject *t, int infmode,
                        tlist *L)
{
    if (ampx_shim_versions_on() && is_plain(st, t)) {
        uintptr_t counter = ampx_shim_version_counter(ampx_shim_handle(t));
        if (counter == 0) /* no counter: an inference tensor */
            return infmode ? 0 : inference_error(op, arg, i);
        L->impl[i] = ampx_shim_impl_word(t);
        L->counter[i] = counter;
        return 0;
    }
    int inf;
    if (take_bool(call0(t, st->s_is_inference), &inf) < 0)
        return -1;
    if (inf)
        return infmode ? 0 : inference_error(op, arg, i);
    L->bump_py[i] = 1;
    return 0;
}

/* Prefetch distance (tensors) of the bump loop: TensorImpls, out of cache
 * after the kernels streamed the data. */
#define PF_BUMP 8

int tlist_bump_versions(mstate *st, const tlist *L)
{
    Py_ssize_t npy = 0;
    const uintptr_t *hot = NULL; /* the handle bumped last, its TensorImpl in cache */
    for (Py_ssize_t i = 0; i < L->n; i++) {
        if (i + PF_BUMP < L->n && L->impl[i + PF_BUMP] != 0)
            __builtin_prefetch((const void *)L->impl[i + PF_BUMP], 0, 3);
        if (L->nc[i] || L->tmp[i] != NULL)
            continue; /* written through a staged copy: its copy back (copy_) bumped it */
        if (L->impl[i] != 0) {
            /* Views of one buffer share their counter: bumping it through the tensor bumped
             * last adds the same one without touching tensor i's TensorImpl again. */
            if (hot == NULL || L->counter[i] != L->counter[hot - L->impl])
                hot = &L->impl[i];
            ampx_shim_bump(hot); /* a copy of the at::Tensor: one pointer, the tuple keeps it alive */
        }
        npy += L->bump_py[i];
    }
    if (npy == 0 || st->increment_version == NULL)
        return 0;
    PyObject *rest = PyList_New(npy);
    if (rest == NULL)
        return -1;
    for (Py_ssize_t i = 0, k = 0; i < L->n; i++)
        if (L->bump_py[i] && !L->nc[i] && L->tmp[i] == NULL)
            PyList_SetItem(rest, k++, new_ref(tlist_item(L, i))); /* steals; cannot fail here */
    PyObject *r = PyObject_CallFunctionObjArgs(st->increment_version, rest, NULL);
    Py_DECREF(rest);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

int tlist_gather(mstate *st, const char *op, const char *arg, PyObject *seq, int write, int refuse_fp16,
                 int device, int want_neg, tlist *L)
{
    if (tlist_alloc(op, arg, seq, L) < 0)
        return -1;
    int shim = ampx_shim_enabled();
    int infmode = write ? inference_mode(st) : 0;
    if (infmode < 0)
        goto error;
    for (Py_ssize_t i = 0; i < L->n; i++) {
        PyObject *t = tlist_item(L, i);
        if (shim)
            prefetch_ahead(st, L, i);
        ampx_tensor *d = &L->ts[i];
        d->index = (uint32_t)i;
        if (!PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
            PyErr_Format(PyExc_TypeError, "%s: %s[%zd] must be a torch.Tensor, not %R", op, arg, i,
                         (PyObject *)Py_TYPE(t));
            goto error;
        }
        ampx_shim_meta m;
        if (shim && is_plain(st, t) && ampx_shim_read(t, &m) &&
            (device < 0 ? m.device_type == AMPX_SHIM_CPU
                        : m.device_type == AMPX_SHIM_CUDA && m.device_index == device)) {
            /* The fast read: a plain, contiguous tensor of a supported dtype on
             * the right device. Anything else takes the Python attributes,
             * which handle it or raise the error. */
            if (refuse_fp16 && m.dtype == AMPX_F16) {
                refuse_fp16_error();
                goto error;
            }
            d->dtype = m.dtype;
            d->numel = m.numel;
            L->total += m.numel;
            if (write && note_version(st, op, arg, i, t, infmode, L) < 0)
                goto error;
            if (m.numel == 0)
                continue;
            if (want_neg && neg_flag(st, t, &L->neg[i]) < 0)
                goto error;
            d->ptr = m.ptr;
            L->lo[i] = (uintptr_t)m.ptr;
            L->hi[i] = L->lo[i] + (uintptr_t)(m.numel * ampx_elem_size(m.dtype));
            continue;
        }
        if (read_by_attributes(st, op, arg, t, i, write, refuse_fp16, device, want_neg, L) < 0 ||
            (write && note_version(st, op, arg, i, t, infmode, L) < 0)) {
            add_context(op, arg, i);
            goto error;
        }
    }
    return 0;
error:
    tlist_free(L);
    return -1;
}

/* ---- storages held while the GIL is released ------------------------------- */

/* obj.<name>() as an address or size (0 on error, with an exception set). */
static int call_word(PyObject *obj, PyObject *name, uintptr_t *out)
{
    PyObject *r = call0(obj, name);
    if (r == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uintptr_t)v;
    return 0;
}

/* Holds the storage of tensor t from Python (t.untyped_storage()); its bytes
 * are [*base, *end). */
static int hold_from_python(mstate *st, tlist *L, PyObject *t, uintptr_t *base, uintptr_t *end)
{
    if (L->pyholds == NULL && (L->pyholds = PyList_New(0)) == NULL)
        return -1;
    PyObject *s = call0(t, st->s_untyped_storage);
    if (s == NULL)
        return -1;
    uintptr_t nbytes = 0;
    int rc = PyList_Append(L->pyholds, s);
    if (rc == 0)
        rc = call_word(s, st->s_data_ptr, base);
    if (rc == 0)
        rc = call_word(s, st->s_nbytes, &nbytes);
    Py_DECREF(s);
    *end = *base + nbytes;
    return rc;
}

/* A tensor whose memory is not inside the storage held for it: another
 * thread replaced its storage (`t.data = ...`) while the list was read (torch
 * ops and some attribute reads release the GIL). */
static int replaced_error(const char *op, const char *arg, Py_ssize_t i)
{
    PyErr_Format(PyExc_RuntimeError,
                 "%s: %s[%zd] had its storage replaced (t.data = ...) by another thread while ampx read "
                 "the list; nothing was written: do not change tensors' data while ampx works on them",
                 op, arg, i);
    return -1;
}

/* The storage of tensor i of L when known from C (0: unknown, held alone). */
static uintptr_t storage_of(mstate *st, const tlist *L, Py_ssize_t i, int shim)
{
    PyObject *t = tlist_item(L, i);
    return shim && is_plain(st, t) ? ampx_shim_storage_word(t) : 0;
}

int64_t tlist_count_storages(mstate *st, const tlist *L)
{
    int shim = ampx_shim_enabled();
    int64_t count = 0;
    uintptr_t last = 0;
    for (Py_ssize_t i = 0; i < L->n; i++) {
        if (L->ts[i].numel == 0)
            continue;
        uintptr_t s = storage_of(st, L, i, shim);
        count += s == 0 || s != last;
        last = s;
    }
    return count;
}

int tlist_hold_storages(mstate *st, const char *op, const char *arg, tlist *L)
{
    if (L->holds != NULL || L->pyholds != NULL || L->n == 0)
        return 0; /* held already, or nothing to hold */
    if ((L->holds = (void **)malloc((size_t)L->n * sizeof *L->holds)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int shim = ampx_shim_enabled();
    uintptr_t last = 0;           /* the storage held last from C (0: none known) */
    uintptr_t base = 0, end = 0;  /* the bytes of the storage held last */
    for (Py_ssize_t i = 0; i < L->n; i++) {
        PyObject *t = tlist_item(L, i);
        if (L->ts[i].numel == 0)
            continue; /* no memory touched */
        uintptr_t s = storage_of(st, L, i, shim);
        if (s == 0 || s != last) {
            void *alias = s != 0 ? ampx_shim_hold_storage(t, &base, &end) : NULL;
            if (alias != NULL) {
                L->holds[L->nholds++] = alias;
            } else if (hold_from_python(st, L, t, &base, &end) < 0) {
                return -1;
            }
            last = alias != NULL ? s : 0;
        }
        /* The kernels use the pointer read by the gather: it must lie in what is held. Staged
         * tensors are copied from (and back into) the tensor as it is then. */
        if (!L->nc[i] && L->tmp[i] == NULL && (L->lo[i] < base || L->hi[i] > end || base == 0))
            return replaced_error(op, arg, i);
    }
    return 0;
}

int tlist_hold_output(mstate *st, tlist *H, const char *op, const char *arg, PyObject *t, const void *p)
{
    if (t == Py_None || p == NULL)
        return 0;
    uintptr_t base = 0, end = 0;
    /* From Python: at most four small outputs, on calls big enough to release the GIL. */
    if (hold_from_python(st, H, t, &base, &end) < 0)
        return -1;
    if ((uintptr_t)p < base || (uintptr_t)p >= end) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: %s had its storage replaced (t.data = ...) by another thread while ampx read "
                     "it; nothing was written: do not change tensors' data while ampx works on them",
                     op, arg);
        return -1;
    }
    return 0;
}

/* ---- written lists ---------------------------------------------------------- */

int tlist_sequential(const tlist *L, int *sequential)
{
    *sequential = L->any_nc;
    if (*sequential || L->n < 2)
        return 0;
    /* Spans of the contiguous, non-empty tensors, all written. */
    ampx_span *spans = (ampx_span *)malloc((size_t)L->n * sizeof *spans);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ptrdiff_t m = 0;
    for (Py_ssize_t i = 0; i < L->n; i++) {
        if (L->ts[i].numel != 0 && !L->nc[i])
            spans[m++] = (ampx_span){L->lo[i], L->hi[i], i, 1};
    }
    ampx_span x, y;
    *sequential = ampx_find_overlap(spans, m, &x, &y);
    free(spans);
    return 0;
}

/* Brings staged copy c of tensor t up to date (t may have been written through an alias by
 * an earlier run of the same list): c.copy_(t). */
static int refresh_copy(mstate *st, PyObject *c, PyObject *t)
{
    PyObject *r = PyObject_CallMethodObjArgs(c, st->s_copy_, t, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

int tlist_each_staged(mstate *st, tlist *L, tlist_run_fn run, void *ctx)
{
    /* All or nothing: every staging copy is made (the step that can run out of memory or meet
     * a tensor whose .contiguous() raises) before the first write. */
    PyObject **copies = (PyObject **)calloc(L->n > 0 ? (size_t)L->n : 1u, sizeof *copies);
    if (copies == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < L->n && rc == 0; i++)
        if (L->nc[i])
            rc = contiguous_copy(st, tlist_item(L, i), &copies[i], &L->ts[i].ptr);
    int written = 0;
    for (Py_ssize_t i = 0; i < L->n && rc == 0; i++) {
        /* A list that shares memory is the op applied to each tensor in turn: a copy made
         * before an earlier tensor was written must see that write. */
        if (copies[i] != NULL && written)
            rc = refresh_copy(st, copies[i], tlist_item(L, i));
        if (rc == 0)
            rc = run(ctx, L, i);
        if (rc == 0 && copies[i] != NULL)
            rc = copy_back(st, tlist_item(L, i), copies[i]);
        written = 1;
    }
    for (Py_ssize_t i = 0; i < L->n; i++)
        Py_XDECREF(copies[i]);
    free(copies);
    return rc;
}

/* ---- casts ------------------------------------------------------------------- */

int gather_cast_lists(mstate *st, const char *op, PyObject *src_o, PyObject *dst_o, int device, int stochastic,
                      tlist *S, tlist *D)
{
    if (tlist_gather(st, op, "src", src_o, 0, 0, device, 1, S) < 0)
        return -1;
    if (tlist_gather(st, op, "dst", dst_o, 1, 0, device, 1, D) < 0) {
        tlist_free(S);
        return -1;
    }
    if (S->n != D->n) {
        PyErr_Format(PyExc_ValueError, "%s: src has %zd tensors but dst has %zd", op, S->n, D->n);
        goto error;
    }
    for (Py_ssize_t i = 0; i < S->n; i++) {
        if (S->ts[i].numel != D->ts[i].numel) {
            PyErr_Format(PyExc_ValueError, "%s: src[%zd] has %lld elements but dst[%zd] has %lld", op, i,
                         (long long)S->ts[i].numel, i, (long long)D->ts[i].numel);
            goto error;
        }
        if (stochastic && D->ts[i].dtype != AMPX_BF16) {
            PyErr_Format(PyExc_ValueError,
                         "%s: stochastic rounding writes bfloat16, but dst[%zd] has dtype torch.%s", op, i,
                         dtype_name(D->ts[i].dtype));
            goto error;
        }
    }
    return 0;
error:
    tlist_free(S);
    tlist_free(D);
    return -1;
}

/* A contiguous tensor holding the values of t with no negative bit (new reference). */
static PyObject *resolved_copy(mstate *st, PyObject *t)
{
    PyObject *r = call0(t, st->s_resolve_neg);
    if (r == NULL)
        return NULL;
    PyObject *c = call0(r, st->s_contiguous);
    Py_DECREF(r);
    return c;
}

/* Where a cast's kernel reads and writes. Non-contiguous destinations are
 * written through contiguous copies, copied back afterwards. The scale, check
 * and norm kernels are right on a tensor with the negative bit (scaling
 * commutes with negation; checks and norms see magnitudes), but a cast would
 * carry the stored sign over: a negated source is read through a resolved
 * copy, and a negated destination written through one (copy_ then negates). */
static int cast_staging(mstate *st, tlist *S, tlist *D)
{
    for (Py_ssize_t i = 0; i < D->n; i++)
        if (D->nc[i] && contiguous_copy(st, tlist_item(D, i), &D->tmp[i], &D->ts[i].ptr) < 0)
            return -1;
    for (Py_ssize_t i = 0; i < S->n; i++) {
        if (S->ts[i].numel == 0)
            continue;
        for (int side = 0; side < 2; side++) {
            tlist *L = side == 0 ? S : D;
            if (!L->neg[i])
                continue;
            PyObject *c = resolved_copy(st, tlist_item(L, i));
            if (c == NULL)
                return -1;
            Py_XDECREF(L->tmp[i]);
            L->tmp[i] = c;
            if (get_data_ptr(st, c, &L->ts[i].ptr) < 0)
                return -1;
        }
    }
    return 0;
}

/* The sharing rule of a cast: a destination may alias only its own source,
 * exactly (same elements, order and dtype); any other overlap with a
 * destination would make the result depend on the order of the work. Spans
 * are those of the caller's tensors, not of any contiguous copy. */
static int check_cast_sharing(const char *op, const tlist *S, const tlist *D)
{
    ampx_span *spans = (ampx_span *)malloc((size_t)(2 * S->n + 1) * sizeof *spans);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ptrdiff_t m = 0;
    for (Py_ssize_t i = 0; i < S->n; i++) {
        if (S->ts[i].numel == 0)
            continue;
        int exact_alias = S->lo[i] == D->lo[i] && S->hi[i] == D->hi[i] && S->nc[i] == D->nc[i] &&
                          S->layout[i] == D->layout[i] && S->ts[i].src_dtype == S->ts[i].dtype;
        spans[m++] = (ampx_span){D->lo[i], D->hi[i], i, 1};
        if (!exact_alias)
            spans[m++] = (ampx_span){S->lo[i], S->hi[i], i, 0};
    }
    ampx_span x, y;
    int overlap = ampx_find_overlap(spans, m, &x, &y);
    free(spans);
    if (overlap) {
        PyErr_Format(PyExc_ValueError, "%s: %s[%zd] and %s[%zd] (may) share memory; a cast needs distinct "
                     "destinations (or a destination that is exactly its own source)",
                     op, x.written ? "dst" : "src", (Py_ssize_t)x.idx, y.written ? "dst" : "src",
                     (Py_ssize_t)y.idx);
        return -1;
    }
    return 0;
}

int cast_prepare(mstate *st, const char *op, tlist *S, tlist *D)
{
    if (cast_staging(st, S, D) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < S->n; i++) {
        S->ts[i].src = S->ts[i].ptr;
        S->ts[i].src_dtype = S->ts[i].dtype;
        S->ts[i].ptr = D->ts[i].ptr;
        S->ts[i].dtype = D->ts[i].dtype;
    }
    return check_cast_sharing(op, S, D);
}

int cast_unstage(mstate *st, const tlist *D)
{
    for (Py_ssize_t i = 0; i < D->n; i++)
        if (D->tmp[i] != NULL && copy_back(st, tlist_item(D, i), D->tmp[i]) < 0)
            return -1;
    return 0;
}
