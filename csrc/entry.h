/*
 * entry.h: the kernel entry points of ampx._C, one per op whatever the
 * device, and the contract between their two halves.
 *
 * entry.c parses a call's keywords and validates everything that does not
 * depend on the device's kernels (the tensors gathered on the call's device,
 * the factor, the outputs, the mode, the sharing rules) before any memory is
 * written. It then hands the validated call to the runner of the device:
 * entry_cpu.c (device -1) or entry_cuda.c (a CUDA device index). A runner
 * may raise (out of memory, a driver error, a failing copy back) but never
 * re-validates, and frees nothing it was handed: entry.c owns the lists.
 *
 * The GIL: the CPU runner releases it around each run of the launcher over
 * GIL_RELEASE_MIN elements or more (the whole list, or one tensor on the
 * sequential path) when entry.c held the call's storages (release_gil: they
 * must outlive a `t.data = ...` in another thread), which it does when the
 * references cost little beside the work (HOLD_MIN_ELEMS); the CUDA runner around its batched launches (the
 * sequential path, which calls torch between launches, keeps it). Nothing
 * else runs without it.
 */
#ifndef AMPX_ENTRY_H
#define AMPX_ENTRY_H

#include "tensor_list.h"

/* Below this many elements a CPU call keeps the GIL: releasing it costs more. */
#define GIL_RELEASE_MIN ((int64_t)1 << 14)
/* A CPU call releases the GIL only with at least this many elements per
 * storage it must hold (tlist_hold_storages): a hold costs about 0.2 us, the
 * kernels about 0.1 ns an element, so the holds stay under ~10% of the work.
 * Many small separate tensors (10,000 x 1,000) keep the GIL instead; views
 * of one buffer release it. */
#define HOLD_MIN_ELEMS ((int64_t)1 << 15)

/* Where a call runs: the keywords every entry point takes. */
typedef struct {
    const char *op;               /* the public op's name, for error messages */
    int device;                   /* -1: the CPU; else a CUDA device index */
    int nthreads;                 /* CPU: threads for the kernels */
    unsigned long long stream;    /* CUDA: the caller's stream (torch's current one) */
    PyObject *alloc;              /* CUDA: alloc(nbytes) -> a uint8 tensor on the device (borrowed) */
} entry_site;

/* A validated scale_reduce or cast. Pointers are host addresses on the CPU
 * and device addresses on CUDA; NULL where an output is not wanted. */
typedef struct {
    entry_site at;
    double factor;                /* the factor's value (1.0 when factor_ptr is set) */
    void *factor_ptr;             /* CUDA: a device scalar the kernels read; else NULL */
    void *found_inf, *flags;
    /* scale_reduce */
    int mode;                     /* a mode of AMPX_SCALE_MODE_LIST */
    int sequential;               /* one tensor at a time, in list order (tlist_sequential) */
    int release_gil;              /* CPU: the storages are held, the GIL may be released (entry.c) */
    int split;                    /* CPU: AMPX_SPLIT_* (multi_tensor.h) */
    void *per_tensor, *total;
    void *stats;                  /* tensor_stats: the float64 rows, AMPX_STATS_WIDTH per tensor */
    tlist L;
    /* cast: S holds the pairs (cast_prepare), D the destinations */
    int stochastic;
    uint64_t seed, offset;
    void *rng;                    /* CUDA: {seed, offset} as 16 bytes on the device, read by the kernel; else NULL */
    tlist S, D;
    tlist O;                      /* only holds: the outputs' storages, when the GIL is released (entry.c) */
} entry_call;

/* A validated update_scale: the tensors' addresses on the call's device. */
typedef struct {
    entry_site at;
    void *scale, *growth_tracker, *hysteresis_tracker, *found_inf, *events;
    double growth_factor, backoff_factor, min_scale, max_scale;
    long long growth_interval;
    int hysteresis, consecutive;
} entry_update;

/* The split the last CPU scale_reduce used (AMPX_SPLIT_*; tests). */
extern int ampx_last_split;
/* CUDA: span tables (per-tensor flags of coalesced views) are used when merging saves at least
 * this many launches (settable: _C._set_span_tables_min_launches; benchmarks). */
extern int64_t ampx_cu_span_tables_min_launches;

/* The runners: 0, or -1 with an exception set. */
int cpu_scale_reduce(mstate *st, entry_call *c);
int cpu_cast(mstate *st, entry_call *c);
int cpu_update_scale(const entry_update *u, int *events);
int cpu_tensor_stats(entry_call *c);
int cuda_tensor_stats(mstate *st, entry_call *c);
int cuda_scale_reduce(mstate *st, entry_call *c);
int cuda_cast(mstate *st, entry_call *c);
int cuda_update_scale(const entry_update *u);

/* The Python functions (module.c's method table). */
PyObject *py_scale_reduce(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_check_written(PyObject *module, PyObject *args);
PyObject *py_check_flags(PyObject *module, PyObject *args);
PyObject *py_cast(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_update_scale(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_tensor_stats(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_cuda_set_image(PyObject *module, PyObject *arg);
PyObject *py_cuda_probe(PyObject *module, PyObject *arg);
PyObject *py_cuda_device_info(PyObject *module, PyObject *arg);

#endif /* AMPX_ENTRY_H */
