/*
 * entry_cuda.c: the CUDA runners of scale_reduce, cast, tensor_stats and
 * update_scale (entry.h), and the Python functions that hand the fatbin over and ask about
 * devices.
 *
 * A validated call goes through the multi-tensor launcher of cuda_launch.c on
 * the caller's stream; a workspace, when the outputs need one, comes from
 * torch's caching allocator through the call's `alloc` (a tensor this file
 * owns until the call returns: stream order keeps the memory valid for the
 * launches). Driver errors arrive as ampx_cu_error (cuda_driver.h: pure C,
 * errors cross one boundary) and become RuntimeError here, in cu_raise.
 *
 * Called by entry.c with the GIL held. Releases it while a device's kernels load (the first
 * call on a device) and around batched launches;
 * the sequential path keeps it, since it calls torch between launches (and a
 * context is never held pushed across a call into Python). May call:
 * cuda_driver.h, tensor_list.h, tensor_meta.h (get_data_ptr).
 */
#include "entry.h"

#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"
#include "tensor_meta.h"

static int cu_raise(const char *op, const ampx_cu_error *err)
{
    PyErr_Format(PyExc_RuntimeError, "%s: %s", op, err->msg);
    return -1;
}

static ampx_cu_deviceptr dptr(const void *p) { return (ampx_cu_deviceptr)(uintptr_t)p; }

/* ampx_cu_device_get with the GIL released: the first call on a device loads its kernels,
 * which can take seconds (a PTX JIT), under ampx's own lock. */
static const ampx_cu_dev *device_nogil(int ordinal, ampx_cu_error *err)
{
    const ampx_cu_dev *dev = ampx_cu_device_ready(ordinal);
    if (dev != NULL) /* the usual case: loaded already, no reason to give the GIL away */
        return dev;
    Py_BEGIN_ALLOW_THREADS
    dev = ampx_cu_device_get(ordinal, err);
    Py_END_ALLOW_THREADS
    return dev;
}

/* Calls alloc(bytes) (a torch.empty on the device), or alloc(bytes, data) (a device copy of
 * the bytearray data), and keeps the tensor in *keep (a new reference the caller drops after
 * the launches) with its data pointer, which must be 16-byte aligned, in *ptr. Returns 1, 0
 * when alloc returned None (it may, given data), -1 with an exception. */
static int device_alloc(mstate *st, const char *op, const char *what, PyObject *alloc, int64_t bytes,
                        PyObject *data, PyObject **keep, ampx_cu_deviceptr *ptr)
{
    *keep = NULL;
    *ptr = 0;
    PyObject *n = PyLong_FromLongLong((long long)bytes);
    if (n == NULL)
        return -1;
    PyObject *t = PyObject_CallFunctionObjArgs(alloc, n, data, NULL);
    Py_DECREF(n);
    if (t == NULL)
        return -1;
    if (t == Py_None && data != NULL) {
        Py_DECREF(t);
        return 0;
    }
    char *p = NULL;
    if (get_data_ptr(st, t, &p) < 0) {
        Py_DECREF(t);
        return -1;
    }
    if (((uintptr_t)p & 15u) != 0) {
        Py_DECREF(t);
        PyErr_Format(PyExc_RuntimeError, "%s: the %s allocation is not 16-byte aligned", op, what);
        return -1;
    }
    *keep = t;
    *ptr = dptr(p);
    return 1;
}

/* The call's workspace (none when bytes is 0): see device_alloc. */
static int cuda_workspace(mstate *st, const char *op, PyObject *alloc, int64_t bytes, PyObject **keep,
                          ampx_cu_deviceptr *ptr)
{
    *keep = NULL;
    *ptr = 0;
    if (bytes == 0)
        return 0;
    return device_alloc(st, op, "workspace", alloc, bytes, NULL, keep, ptr) < 0 ? -1 : 0;
}

/* What a CUDA data call holds between its preparation and its return. */
typedef struct {
    const ampx_cu_dev *dev;
    ampx_cu_tensor *cts;  /* owned */
    Py_ssize_t n;         /* entries of cts */
    int64_t chunks;
    PyObject *ws_keep;    /* owned: the workspace tensor, or NULL */
    ampx_cu_deviceptr ws;
    PyObject *tab_keep;   /* owned: the span tables' device tensor, or NULL */
    ampx_cu_launcher *Lc; /* owned: the sequential path's launcher, or NULL */
} cuda_run;

static void cuda_run_free(cuda_run *r)
{
    free(r->Lc);
    free(r->cts);
    Py_XDECREF(r->ws_keep);
    Py_XDECREF(r->tab_keep);
}

/* How cuda_tensors may merge a list: not at all, into spans (nothing per tensor wanted),
 * or into spans with span tables (per-tensor flags wanted). */
#define SPANS_NONE 0
#define SPANS_PLAIN 1
#define SPANS_FLAGS 2

/* Span tables cost a host-to-device copy from pinned memory (some tens of microseconds of
 * host time, to be measured on a GPU: benchmarks/gpu_check.py), so they are used only when
 * coalescing saves at least this many launches. */
int64_t ampx_cu_span_tables_min_launches = 4;

static int64_t launches_for(int64_t entries)
{
    return (entries + AMPX_CU_MAX_TENSORS - 1) / AMPX_CU_MAX_TENSORS;
}

/* Builds the span tables of spans[0..m) (ampx_cu_span_tables) and hands them to the device
 * through the call's alloc(nbytes, data) (a stream-ordered copy from pinned memory; None:
 * run tensor by tensor). Returns 1 with r->tab_keep and *tab set and the tables' offsets in
 * off, 0 when the call should run tensor by tensor, -1 with an exception. */
static int upload_span_tables(mstate *st, const entry_site *at, const tlist *L, const ampx_tensor *sp,
                              const int64_t *first, int64_t m, int64_t *off, cuda_run *r, ampx_cu_deviceptr *tab)
{
    int64_t bytes = ampx_cu_span_tables_bytes(L->n, m);
    PyObject *host = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)bytes);
    if (host == NULL)
        return -1;
    char *h = PyByteArray_AsString(host);
    if (h == NULL || ampx_cu_span_tables(L->ts, sp, first, m, h, off) < 0) {
        Py_DECREF(host);
        return PyErr_Occurred() ? -1 : 0;
    }
    int rc = device_alloc(st, at->op, "span tables'", at->alloc, bytes, host, &r->tab_keep, tab);
    Py_DECREF(host);
    return rc;
}

/* Merges L into spans (ampx_coalesce) as `spans` allows and it pays; fills r->cts and
 * r->n with the spans, sets job->nflags when they carry span tables. Returns 1 when it
 * did, 0 when the call should run tensor by tensor, -1 with an exception. */
static int cuda_spans(mstate *st, const entry_site *at, ampx_cu_job *job, const tlist *L, int spans, cuda_run *r)
{
    ampx_tensor *sp = (ampx_tensor *)malloc((size_t)L->n * sizeof *sp);
    int64_t *first = (int64_t *)malloc(((size_t)L->n + 1u) * sizeof *first);
    int64_t *off = (int64_t *)malloc(((size_t)L->n + 1u) * sizeof *off);
    int rc = -1;
    if (sp == NULL || first == NULL || off == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t m = 0;
    ampx_coalesce(L->ts, L->n, sp, first, &m);
    rc = 0;
    if (m == 0) /* only empty tensors: as they are */
        goto done;
    ampx_cu_deviceptr tab = 0;
    if (spans == SPANS_FLAGS) {
        /* Not inside a graph capture: its replays would copy whatever the pinned buffer then held. */
        if (launches_for(L->n) - launches_for(m) < ampx_cu_span_tables_min_launches ||
            ampx_cu_capturing(r->dev, (ampx_cu_stream)(uintptr_t)at->stream))
            goto done;
        if ((rc = upload_span_tables(st, at, L, sp, first, m, off, r, &tab)) <= 0)
            goto done;
        job->nflags = L->n;
    }
    ampx_cu_span_slots(sp, m, tab, off, r->cts);
    r->n = (Py_ssize_t)m;
    ampx_last_spans = m;
    rc = 1;
done:
    free(sp);
    free(first);
    free(off);
    return rc;
}

/* The launcher's view of a gathered list in r->cts (r->n entries): spans when `spans`
 * allows and cuda_spans finds it pays, else one entry per tensor. */
static int cuda_tensors(mstate *st, const entry_site *at, ampx_cu_job *job, const tlist *L, int spans, cuda_run *r)
{
    ampx_cu_tensor *c = (ampx_cu_tensor *)calloc(L->n > 0 ? (size_t)L->n : 1u, sizeof *c);
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->cts = c;
    r->n = L->n;
    if (spans != SPANS_NONE && L->n >= 2) {
        int rc = cuda_spans(st, at, job, L, spans, r);
        if (rc != 0)
            return rc < 0 ? -1 : 0;
    }
    for (Py_ssize_t i = 0; i < L->n; i++) {
        c[i].ptr = dptr(L->ts[i].ptr);
        c[i].src = dptr(L->ts[i].src);
        c[i].numel = L->ts[i].numel;
        c[i].dtype = L->ts[i].dtype;
        c[i].src_dtype = L->ts[i].src_dtype;
        c[i].index = L->ts[i].index;
    }
    return 0;
}

/* What every CUDA data call needs before its launches: the device (its module
 * loaded), the tensors in the launcher's form, and a workspace from torch's
 * allocator sized for them. */
static int cuda_prepare(mstate *st, const entry_site *at, ampx_cu_job *job, const tlist *L, int spans,
                        cuda_run *r)
{
    memset(r, 0, sizeof *r);
    ampx_cu_error err;
    if ((r->dev = device_nogil(at->device, &err)) == NULL)
        return cu_raise(at->op, &err);
    if (cuda_tensors(st, at, job, L, spans, r) < 0)
        return -1;
    int64_t bytes = ampx_cu_workspace_bytes(job, r->cts, r->n, &r->chunks);
    if (bytes < 0) {
        PyErr_Format(PyExc_ValueError, "%s: too many elements for one call", at->op);
        return -1;
    }
    return cuda_workspace(st, at->op, at->alloc, bytes, &r->ws_keep, &r->ws);
}

/* Every tensor in list order through one launcher, the GIL released. */
static int cuda_run_batched(const entry_site *at, const ampx_cu_job *job, const cuda_run *r, Py_ssize_t n)
{
    ampx_cu_launcher *Lc = (ampx_cu_launcher *)malloc(sizeof *Lc);
    if (Lc == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ampx_cu_error err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ampx_cu_begin(Lc, r->dev, (ampx_cu_stream)(uintptr_t)at->stream, job, (int64_t)n, r->chunks, r->ws, &err);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++)
        rc = ampx_cu_add(Lc, &r->cts[i], &err);
    if (rc == 0)
        rc = ampx_cu_flush(Lc, &err);
    Py_END_ALLOW_THREADS
    free(Lc);
    return rc < 0 ? cu_raise(at->op, &err) : 0;
}

/* The sequential path: tensor i in a launch of its own (tlist_each_staged),
 * its pointer that of its contiguous copy when it has one. */
typedef struct {
    const char *op;
    cuda_run *r;
} one_by_one;

static int launch_one(void *ctx, tlist *L, Py_ssize_t i)
{
    const one_by_one *s = (const one_by_one *)ctx;
    ampx_cu_error err;
    s->r->cts[i].ptr = dptr(L->ts[i].ptr);
    if (ampx_cu_add(s->r->Lc, &s->r->cts[i], &err) < 0 || ampx_cu_flush(s->r->Lc, &err) < 0)
        return cu_raise(s->op, &err);
    return 0;
}

/* The job fields every data call shares. */
static void job_common(ampx_cu_job *job, const entry_call *c, int kind)
{
    memset(job, 0, sizeof *job);
    job->kind = kind;
    job->factor = c->factor;
    job->factor_ptr = dptr(c->factor_ptr);
    job->found_inf = dptr(c->found_inf);
    job->flags_out = dptr(c->flags);
}

int cuda_scale_reduce(mstate *st, entry_call *c)
{
    ampx_cu_job job;
    job_common(&job, c, AMPX_CU_SCALE);
    job.reduce = AMPX_MODE_REDUCE(c->mode);
    job.write = (c->mode & AMPX_M_WRITE) ? 1 : 0;
    job.scale = (c->mode & AMPX_M_SCALE) ? 1 : 0;
    job.per_out = dptr(c->per_tensor);
    job.total_out = dptr(c->total);
    if (!(c->mode & AMPX_M_CHECK))
        job.found_inf = job.flags_out = 0;

    /* Spans when no per-tensor reduction is wanted and nothing aliases (ampx_coalesce);
     * per-tensor flags then come through span tables. */
    int spans = !ampx_coalesce_on || c->sequential || job.per_out != 0 ? SPANS_NONE
                : job.flags_out != 0                                  ? SPANS_FLAGS
                                                                      : SPANS_PLAIN;
    cuda_run r;
    ampx_last_spans = -1;
    int rc = cuda_prepare(st, &c->at, &job, &c->L, spans, &r);
    if (rc == 0 && !c->sequential) {
        rc = cuda_run_batched(&c->at, &job, &r, r.n);
    } else if (rc == 0) {
        /* As on the CPU: one launch per tensor, in list order. */
        ampx_cu_error err;
        if ((r.Lc = (ampx_cu_launcher *)malloc(sizeof *r.Lc)) == NULL) {
            PyErr_NoMemory();
            rc = -1;
        } else if (ampx_cu_begin(r.Lc, r.dev, (ampx_cu_stream)(uintptr_t)c->at.stream, &job, c->L.n, r.chunks,
                                 r.ws, &err) < 0) {
            rc = cu_raise(c->at.op, &err);
        } else {
            one_by_one s = {c->at.op, &r};
            rc = tlist_each_staged(st, &c->L, launch_one, &s);
        }
    }
    cuda_run_free(&r);
    return rc;
}

int cuda_cast(mstate *st, entry_call *c)
{
    ampx_cu_job job;
    job_common(&job, c, AMPX_CU_CAST);
    job.stochastic = c->stochastic;
    job.seed = c->seed;
    job.offset = c->offset;
    job.rng = dptr(c->rng);
    cuda_run r;
    int rc = cuda_prepare(st, &c->at, &job, &c->S, 0, &r);
    if (rc == 0)
        rc = cuda_run_batched(&c->at, &job, &r, c->S.n);
    if (rc == 0)
        rc = cast_unstage(st, &c->D);
    cuda_run_free(&r);
    return rc;
}

/* The update as a one-thread kernel: reads and writes the device tensors on
 * the stream; nothing waits. */
int cuda_update_scale(const entry_update *u)
{
    ampx_cu_update_args a;
    memset(&a, 0, sizeof a);
    a.scale = dptr(u->scale);
    a.growth_tracker = dptr(u->growth_tracker);
    a.hysteresis = dptr(u->hysteresis_tracker);
    a.found_inf = dptr(u->found_inf);
    a.events = dptr(u->events);
    a.growth_factor = u->growth_factor;
    a.backoff_factor = u->backoff_factor;
    a.growth_interval = (int64_t)u->growth_interval;
    a.hysteresis_max = (int32_t)u->hysteresis;
    a.consecutive = u->consecutive;
    a.min_scale = (float)u->min_scale;
    a.max_scale = (float)u->max_scale;
    ampx_cu_error err;
    const ampx_cu_dev *dev = device_nogil(u->at.device, &err);
    if (dev == NULL || ampx_cu_update(dev, (ampx_cu_stream)(uintptr_t)u->at.stream, &a, &err) < 0)
        return cu_raise(u->at.op, &err);
    return 0;
}

/* ---- the fatbin and the devices ---------------------------------------------- */

/* cuda_set_image((fatbin: bytes, sass_toolkit: int, ptx_toolkit: int, targets: str)): the
 * fatbin, the CUDA releases that built it and its targets in words (from ampx/_kernels.json;
 * 0 and "" when unknown), read by ampx.cuda; the first one stays. */
PyObject *py_cuda_set_image(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *fatbin = NULL;
    int sass = 0, ptx = 0;
    const char *targets = "";
    if (!PyArg_ParseTuple(arg, "Sii|s:cuda_set_image", &fatbin, &sass, &ptx, &targets))
        return NULL;
    char *data = NULL;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(fatbin, &data, &size) < 0)
        return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "cuda_set_image: the fatbin is empty");
        return NULL;
    }
    if (ampx_cu_set_image(data, (size_t)size, sass, ptx, targets) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The device index a device function was given (its one argument). */
static int device_arg(PyObject *arg, int *device)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *device = (int)v;
    return 0;
}

/* cuda_probe(device) -> None when device has loaded and run ampx's kernels, else the
 * reason (str). Without the GIL (see ampx_cu_probe). */
PyObject *py_cuda_probe(PyObject *module, PyObject *arg)
{
    ampx_cu_error err;
    int device, rc;
    if (device_arg(arg, &device) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ampx_cu_probe(device, &err);
    Py_END_ALLOW_THREADS
    return rc < 0 ? PyUnicode_FromString(err.msg) : new_ref(Py_None);
}

/* cuda_device_info(device) -> (cc_major, cc_minor, multiprocessors, driver_version); loads the kernels. */
PyObject *py_cuda_device_info(PyObject *module, PyObject *arg)
{
    ampx_cu_error err;
    int device;
    if (device_arg(arg, &device) < 0)
        return NULL;
    const ampx_cu_dev *dev = device_nogil(device, &err);
    if (dev == NULL) {
        cu_raise("ampx.cuda", &err);
        return NULL;
    }
    return Py_BuildValue("(iiii)", dev->cc_major, dev->cc_minor, dev->sm_count, ampx_cu_driver_version());
}

/* One launch per AMPX_CU_MAX_TENSORS tensors into the rows at c->stats; a workspace (the
 * accumulator rows of the tensors of more than one chunk) from alloc when one has any. */
int cuda_tensor_stats(mstate *st, entry_call *c)
{
    ampx_cu_job job;
    memset(&job, 0, sizeof job);
    job.kind = AMPX_CU_STATS;
    job.per_out = dptr(c->stats);
    cuda_run r;
    int rc = cuda_prepare(st, &c->at, &job, &c->L, SPANS_NONE, &r);
    if (rc == 0)
        rc = cuda_run_batched(&c->at, &job, &r, r.n);
    cuda_run_free(&r);
    return rc;
}
