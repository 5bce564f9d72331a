/*
 * entry.c: the Python functions scale_reduce, cast and update_scale of
 * ampx._C, one per op whatever the device (entry.h).
 *
 * Each parses its keywords, gathers and validates every argument on the
 * call's device before any memory is written (bad input raises and leaves the
 * tensors untouched), then hands the validated call to entry_cpu.c or
 * entry_cuda.c. It owns the gathered lists and frees them on every path.
 *
 * Needs the GIL (the runners release it). May call: tensor_list.h,
 * tensor_meta.h, the runners. ampx/ops.py is the public, documented API over
 * these functions.
 */
#include "entry.h"

#include <math.h>
#include <string.h>

#include "tensor_meta.h"

/* The modes that have kernels (AMPX_SCALE_MODE_LIST); any other is refused. */
#define X_HAS_KERNEL(name, mode, rd, wr, sc, ck, cuda) [mode] = 1,
static const unsigned char has_kernel[AMPX_NUM_MODES] = {AMPX_SCALE_MODE_LIST(X_HAS_KERNEL)};
#undef X_HAS_KERNEL

/* The keywords of entry_site, which end every entry point's keyword list, and
 * their defaults: the CPU, one thread. */
#define SITE_KEYWORDS "device", "nthreads", "stream", "alloc"
#define SITE_FORMAT "iiKO"
#define SITE_ARGS(s) &(s).device, &(s).nthreads, &(s).stream, &(s).alloc

static void site_defaults(entry_site *s, const char *op)
{
    s->op = op;
    s->device = -1;
    s->nthreads = 1;
    s->stream = 0;
    s->alloc = Py_None;
}

/* The found_inf and flags outputs of a call over n tensors. */
static int check_outputs(mstate *st, entry_call *c, PyObject *found_o, PyObject *flags_o, Py_ssize_t n)
{
    const char *op = c->at.op;
    int device = c->at.device;
    if (opt_aux(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, device, &c->found_inf) < 0 ||
        opt_aux(st, op, "flags", flags_o, st->dtype_u8, n, device, &c->flags) < 0)
        return -1;
    return 0;
}

/* Right after the gather of a CPU call: decides whether it releases the GIL
 * (c->release_gil) and, if so, holds the storages of lists A and B (or NULL)
 * until they are freed, so that another thread replacing a tensor's storage
 * meanwhile frees nothing the kernels touch. Calls that run torch ops
 * (staging, tensor_list.h) hold them always: those ops release the GIL. CUDA
 * calls hold nothing: their kernels outlive the call anyway, and torch's
 * caching allocator orders reuse on the stream. */
static int runs_torch(const tlist *L)
{
    if (L->any_nc)
        return 1;
    for (Py_ssize_t i = 0; i < L->n; i++)
        if (L->neg[i])
            return 1;
    return 0;
}

static int hold_if_released(mstate *st, entry_call *c, tlist *A, tlist *B)
{
    c->release_gil = 0;
    if (c->at.device >= 0)
        return 0;
    int64_t total = A->total + (B != NULL ? B->total : 0);
    /* Staging (copies, copies back) runs torch ops, which release the GIL
     * themselves: its storages are held whatever they cost. */
    int staged = runs_torch(A) || (B != NULL && runs_torch(B));
    if (!staged) {
        if (total < GIL_RELEASE_MIN)
            return 0;
        int64_t stores = tlist_count_storages(st, A) + (B != NULL ? tlist_count_storages(st, B) : 0);
        if (total / HOLD_MIN_ELEMS < stores)
            return 0; /* keep the GIL: the holds would cost more than releasing it gains */
    }
    const char *op = c->at.op;
    if (tlist_hold_storages(st, op, B != NULL ? "src" : "tensors", A) < 0 ||
        (B != NULL && tlist_hold_storages(st, op, "dst", B) < 0))
        return -1;
    c->release_gil = 1;
    return 0;
}

/* With the GIL to be released, the outputs' storages are held too (their pointers were read
 * by check_outputs/opt_aux): another thread's `found_inf.data = ...` must not free memory the
 * call then writes. */
static int hold_outputs(mstate *st, entry_call *c, PyObject *found_o, PyObject *flags_o, PyObject *per_o,
                        PyObject *out_o)
{
    if (!c->release_gil)
        return 0;
    const char *op = c->at.op;
    if (tlist_hold_output(st, &c->O, op, "found_inf", found_o, c->found_inf) < 0 ||
        tlist_hold_output(st, &c->O, op, "flags", flags_o, c->flags) < 0 ||
        tlist_hold_output(st, &c->O, op, "per_tensor", per_o, c->per_tensor) < 0 ||
        tlist_hold_output(st, &c->O, op, "out", out_o, c->total) < 0)
        return -1;
    return 0;
}

/* scale_reduce(op, tensors, mode, *, factor=None, found_inf=None, flags=None, per_tensor=None,
 *              out=None, refuse_fp16=False, factor_name="factor", split=0, device=-1, nthreads=1,
 *              stream=0, alloc=None)
 *
 * The one entry point of unscale_, check_finite, norm, unscale_norm_ and mul_:
 * the scale kernel in `mode` over the tensors. */
/* The body of scale_reduce past its argument parsing (c: op, mode, split, site set). */
static PyObject *scale_reduce_call(mstate *st, entry_call *c, PyObject *seq, PyObject *factor_o, PyObject *found_o,
                                   PyObject *flags_o, PyObject *per_o, PyObject *out_o, int refuse_fp16,
                                   const char *factor_name)
{
    if (state_ready(st) < 0)
        return NULL;
    const char *op = c->at.op;
    if (c->mode < 0 || c->mode >= AMPX_NUM_MODES || !has_kernel[c->mode]) {
        PyErr_Format(PyExc_ValueError, "%s: no kernel for mode %d", op, c->mode);
        return NULL;
    }
    if (c->split < 0 || c->split >= AMPX_NUM_SPLITS) {
        PyErr_Format(PyExc_ValueError, "%s: split must be 0 (dynamic), 1 (as torch's fused optimizers) or 2 (as its "
                     "elementwise ops), not %d", op, c->split);
        return NULL;
    }
    const int write = c->mode & AMPX_M_WRITE, device = c->at.device;
    if (tlist_gather(st, op, "tensors", seq, write, refuse_fp16, device, 0, &c->L) < 0)
        return NULL;
    PyObject *result = NULL;
    if (hold_if_released(st, c, &c->L, NULL) < 0)
        goto done;
    if (parse_factor(st, op, factor_name, factor_o, device, &c->factor, &c->factor_ptr) < 0 ||
        check_outputs(st, c, found_o, flags_o, c->L.n) < 0 ||
        opt_aux(st, op, "per_tensor", per_o, st->dtypes[AMPX_F32], c->L.n, device, &c->per_tensor) < 0 ||
        opt_aux(st, op, "out", out_o, st->dtypes[AMPX_F32], 1, device, &c->total) < 0 ||
        hold_outputs(st, c, found_o, flags_o, per_o, out_o) < 0)
        goto done;
    if (write && tlist_sequential(&c->L, &c->sequential) < 0)
        goto done;
    if ((device < 0 ? cpu_scale_reduce(st, c) : cuda_scale_reduce(st, c)) < 0)
        goto done;
    if (write && tlist_bump_versions(st, &c->L) < 0) /* written: as torch's in-place ops */
        goto done;
    result = new_ref(Py_None);
done:
    tlist_free(&c->L);
    tlist_free(&c->O);
    return result;
}

PyObject *py_scale_reduce(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"op",          "tensors",    "mode",        "factor", "found_inf", "flags",
                         "per_tensor",  "out",        "refuse_fp16", "factor_name", "split",     SITE_KEYWORDS, NULL};
    entry_call c;
    memset(&c, 0, sizeof c);
    site_defaults(&c.at, NULL);
    PyObject *seq, *factor_o = Py_None, *found_o = Py_None, *flags_o = Py_None, *per_o = Py_None,
                   *out_o = Py_None;
    int refuse_fp16 = 0;
    const char *factor_name = "factor";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOi|$OOOOOpsi" SITE_FORMAT ":scale_reduce", kw, &c.at.op, &seq,
                                     &c.mode, &factor_o, &found_o, &flags_o, &per_o, &out_o, &refuse_fp16,
                                     &factor_name, &c.split, SITE_ARGS(c.at)))
        return NULL;
    return scale_reduce_call(state_of(module), &c, seq, factor_o, found_o, flags_o, per_o, out_o, refuse_fp16,
                             factor_name);
}

/* check_flags(tensors, flags, nthreads) -> None: check_finite's CPU kernel into `flags` (one
 * uint8 per tensor), with positional arguments only. For callers that check a few small
 * tensors many times a step (the PrecisionMonitor's hooks): scale_reduce's keyword parsing
 * builds a string per keyword and cost about 3 us of a 4 us call on one small tensor. */
PyObject *py_check_flags(PyObject *module, PyObject *args)
{
    entry_call c;
    memset(&c, 0, sizeof c);
    site_defaults(&c.at, NULL);
    PyObject *seq, *flags_o;
    if (!PyArg_ParseTuple(args, "OOi:check_flags", &seq, &flags_o, &c.at.nthreads))
        return NULL;
    c.at.op = "ampx.ops.check_finite";
    c.mode = AMPX_M_CHECK;
    return scale_reduce_call(state_of(module), &c, seq, Py_None, Py_None, flags_o, Py_None, Py_None, 0, "factor");
}

/* check_written(op, tensors, device) -> None: raises what a write into the tensors on
 * `device` (-1: the CPU) would refuse before touching them (a tensor that overlaps itself, an
 * inference tensor outside inference mode, besides what any read refuses), and writes
 * nothing. For a caller that must know before a collective that a later write will pass. */
PyObject *py_check_written(PyObject *module, PyObject *args)
{
    mstate *st = state_of(module);
    const char *op;
    PyObject *seq;
    int device;
    if (!PyArg_ParseTuple(args, "sOi:check_written", &op, &seq, &device))
        return NULL;
    if (state_ready(st) < 0)
        return NULL;
    tlist L;
    memset(&L, 0, sizeof L);
    if (tlist_gather(st, op, "tensors", seq, 1, 0, device, 0, &L) < 0)
        return NULL; /* (a failed gather frees what it took) */
    tlist_free(&L);
    Py_RETURN_NONE;
}

/* cast(op, src, dst, *, inv_scale=None, found_inf=None, flags=None, stochastic=False, seed=0,
 *      offset=0, rng=None, device=-1, nthreads=1, stream=0, alloc=None)
 *
 * dst[i] = src[i] * inv_scale, converted, for each pair. rng: 16 bytes (uint8) holding
 * stochastic rounding's {seed, offset} as two native uint64, used instead of seed and offset;
 * on the CPU read now, on CUDA read by the kernel when it runs (so a CUDA graph replays with
 * the value the tensor holds then). */
PyObject *py_cast(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"op",         "src",  "dst",    "inv_scale", "found_inf", "flags",
                         "stochastic", "seed", "offset", "rng", SITE_KEYWORDS, NULL};
    mstate *st = state_of(module);
    entry_call c;
    memset(&c, 0, sizeof c);
    site_defaults(&c.at, NULL);
    PyObject *src_o, *dst_o, *factor_o = Py_None, *found_o = Py_None, *flags_o = Py_None, *rng_o = Py_None;
    unsigned long long seed = 0, offset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO|$OOOpKKO" SITE_FORMAT ":cast", kw, &c.at.op, &src_o, &dst_o,
                                     &factor_o, &found_o, &flags_o, &c.stochastic, &seed, &offset, &rng_o,
                                     SITE_ARGS(c.at)))
        return NULL;
    if (state_ready(st) < 0)
        return NULL;
    c.seed = (uint64_t)seed;
    c.offset = (uint64_t)offset;
    const char *op = c.at.op;
    if (gather_cast_lists(st, op, src_o, dst_o, c.at.device, c.stochastic, &c.S, &c.D) < 0)
        return NULL;
    PyObject *result = NULL;
    if (hold_if_released(st, &c, &c.S, &c.D) < 0)
        goto done;
    if (parse_factor(st, op, "inv_scale", factor_o, c.at.device, &c.factor, &c.factor_ptr) < 0 ||
        check_outputs(st, &c, found_o, flags_o, c.S.n) < 0 ||
        opt_aux(st, op, "rng", rng_o, st->dtype_u8, 16, c.at.device, &c.rng) < 0 ||
        hold_outputs(st, &c, found_o, flags_o, Py_None, Py_None) < 0 || cast_prepare(st, op, &c.S, &c.D) < 0)
        goto done;
    if (c.rng != NULL && c.at.device < 0) { /* host memory: read it now */
        memcpy(&c.seed, c.rng, sizeof c.seed);
        memcpy(&c.offset, (const char *)c.rng + sizeof c.seed, sizeof c.offset);
        c.rng = NULL;
    }
    if ((c.at.device < 0 ? cpu_cast(st, &c) : cuda_cast(st, &c)) < 0)
        goto done;
    if (tlist_bump_versions(st, &c.D) < 0)
        goto done;
    result = new_ref(Py_None);
done:
    tlist_free(&c.S);
    tlist_free(&c.D);
    tlist_free(&c.O);
    return result;
}

/* update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, *,
 *              hysteresis_tracker=None, hysteresis=1, consecutive=False, min_scale=0.0,
 *              max_scale=inf, events=None, device=-1, nthreads=1, stream=0, alloc=None)
 *   -> the events (AMPX_UPD_* bits) on the CPU; None on CUDA, where they land in
 *      `events` (an int32 tensor on the device, or None)
 *
 * One loss-scale update (ampx_update_scale) of the tensors, on their device. */
PyObject *py_update_scale(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"scale",       "growth_tracker", "found_inf", "growth_factor", "backoff_factor",
                         "growth_interval", "hysteresis_tracker", "hysteresis", "consecutive", "min_scale",
                         "max_scale",   "events",         SITE_KEYWORDS, NULL};
    mstate *st = state_of(module);
    entry_update u;
    memset(&u, 0, sizeof u);
    site_defaults(&u.at, "ampx.ops.update_scale_");
    PyObject *scale_o, *tracker_o, *found_o, *hyst_o = Py_None, *events_o = Py_None;
    u.hysteresis = 1;
    u.max_scale = INFINITY;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOddL|$OipddO" SITE_FORMAT ":update_scale", kw, &scale_o,
                                     &tracker_o, &found_o, &u.growth_factor, &u.backoff_factor,
                                     &u.growth_interval, &hyst_o, &u.hysteresis, &u.consecutive, &u.min_scale,
                                     &u.max_scale, &events_o, SITE_ARGS(u.at)))
        return NULL;
    if (state_ready(st) < 0)
        return NULL;
    const char *op = u.at.op;
    const int device = u.at.device;
    if (aux_ptr(st, op, "scale", scale_o, st->dtypes[AMPX_F32], 1, device, &u.scale) < 0 ||
        aux_ptr(st, op, "growth_tracker", tracker_o, st->dtype_i32, 1, device, &u.growth_tracker) < 0 ||
        opt_aux(st, op, "hysteresis_tracker", hyst_o, st->dtype_i32, 1, device, &u.hysteresis_tracker) < 0 ||
        aux_ptr(st, op, "found_inf", found_o, st->dtypes[AMPX_F32], 1, device, &u.found_inf) < 0 ||
        opt_aux(st, op, "events", events_o, st->dtype_i32, 1, device, &u.events) < 0)
        return NULL;
    if (device >= 0) {
        if (cuda_update_scale(&u) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    int events = 0;
    if (cpu_update_scale(&u, &events) < 0)
        return NULL;
    return PyLong_FromLong(events);
}

/* tensor_stats(op, tensors, out, *, device=-1, nthreads=1, stream=0, alloc=None)
 *
 * Writes one row of AMPX_STATS_WIDTH float64 values per tensor (ampx_numerics.h) into `out`, a
 * contiguous float64 tensor of len(tensors) * AMPX_STATS_WIDTH elements on the call's device
 * that none of the tensors overlaps. Reads the tensors only. */
PyObject *py_tensor_stats(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"op", "tensors", "out", SITE_KEYWORDS, NULL};
    mstate *st = state_of(module);
    entry_call c;
    memset(&c, 0, sizeof c);
    site_defaults(&c.at, NULL);
    PyObject *seq, *out_o;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO|$" SITE_FORMAT ":tensor_stats", kw, &c.at.op, &seq, &out_o,
                                     SITE_ARGS(c.at)))
        return NULL;
    if (state_ready(st) < 0)
        return NULL;
    const char *op = c.at.op;
    if (tlist_gather(st, op, "tensors", seq, 0, 0, c.at.device, 0, &c.L) < 0)
        return NULL;
    PyObject *result = NULL;
    if (hold_if_released(st, &c, &c.L, NULL) < 0 ||
        aux_ptr(st, op, "out", out_o, st->dtypes[AMPX_F64], (int64_t)c.L.n * AMPX_STATS_WIDTH, c.at.device,
                &c.stats) < 0 ||
        (c.release_gil && tlist_hold_output(st, &c.O, op, "out", out_o, c.stats) < 0))
        goto done;
    if (c.stats != NULL) {
        uintptr_t lo = (uintptr_t)c.stats, hi = lo + (uintptr_t)c.L.n * AMPX_STATS_WIDTH * sizeof(double);
        for (Py_ssize_t i = 0; i < c.L.n; i++)
            if (c.L.ts[i].numel > 0 && c.L.lo[i] < hi && lo < c.L.hi[i]) {
                PyErr_Format(PyExc_ValueError, "%s: out overlaps tensors[%zd]; pass an output of its own", op, i);
                goto done;
            }
    }
    if (c.L.n > 0 && (c.at.device < 0 ? cpu_tensor_stats(&c) : cuda_tensor_stats(st, &c)) < 0)
        goto done;
    result = new_ref(Py_None);
done:
    tlist_free(&c.L);
    tlist_free(&c.O);
    return result;
}
