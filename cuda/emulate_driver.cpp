/*
 * emulate_driver.cpp: a stand-in for the CUDA driver that runs ampx's kernels on the CPU
 * (cuda/emulate.h), driven by the real launcher (csrc/cuda_launch.c). Test-only: built and
 * used by tests/test_cuda.py on machines without a GPU.
 *
 * Usage: emulate JOB ARENA
 *   ARENA  a file of bytes standing for device memory; it is read, the job runs on it, and it
 *          is written back. "Device pointers" are offsets into it.
 *   JOB    text:
 *     scale   reduce write scale factor factor_off found_off flags_off per_off total_off
 *             sequential grid_cap n spans
 *             (spans 1: back-to-back tensors become span slots, as csrc/entry_cuda.c makes
 *             them, with span tables when flags are wanted)
 *     cast    stochastic seed offset rng_off factor factor_off found_off flags_off grid_cap n
 *             (rng_off: {seed, offset} as two uint64 in the arena, read by the kernel; -1: none)
 *     stats   rows_off grid_cap n
 *             (tensor_stats: n rows of AMPX_STATS_WIDTH float64 at rows_off)
 *     update  scale_off tracker_off hyst_off found_off events_off growth backoff interval
 *             hysteresis consecutive min max
 *   then, for scale, cast and stats, one line per tensor: dtype src_dtype numel ptr_off src_off.
 *   Offsets of -1 mean none. grid_cap > 0 caps the grid (so blocks loop over chunks).
 * Exit status 0, or 1 with a message on stderr.
 */
#include <pthread.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "emulate.h"
extern "C" {
#include "multi_tensor.h"
}

extern "C" {
#define AMPX_X_DECLARE(label, mode, rd, wr, sc, ck, cuda)                                                   \
    AMPX_IF(cuda, void AMPX_CU_SCALE_KERNEL_NAME(rd, wr, sc)(const ampx_cu_args a);)
AMPX_SCALE_MODE_LIST(AMPX_X_DECLARE)
#undef AMPX_X_DECLARE
void ampx_k_cast(const ampx_cu_args a);
void ampx_k_tensor_stats(const ampx_cu_args a);
void ampx_k_update_scale(const ampx_cu_update_args a);
}

namespace emu {
thread_local emu_dim3 thread_idx;
emu_dim3 block_idx, grid_dim;
uint64_t exchange[AMPX_CU_BLOCK];
static pthread_barrier_t block_barrier, warp_barrier[AMPX_CU_BLOCK / 32];
void sync_block() { pthread_barrier_wait(&block_barrier); }
void sync_warp(unsigned warp) { pthread_barrier_wait(&warp_barrier[warp]); }
} // namespace emu

/* ---- the block runner: AMPX_CU_BLOCK worker threads, one block at a time ---- */

typedef void (*data_kernel)(const ampx_cu_args);
static pthread_barrier_t start_barrier, end_barrier;
static data_kernel current_kernel;
static const ampx_cu_args *current_args;
static bool quitting;

static void *worker(void *arg)
{
    emu::thread_idx = emu_dim3{(unsigned)(uintptr_t)arg, 0, 0};
    for (;;) {
        pthread_barrier_wait(&start_barrier);
        if (quitting)
            return nullptr;
        current_kernel(*current_args);
        pthread_barrier_wait(&end_barrier);
    }
}

static std::vector<pthread_t> workers;
static unsigned grid_cap;

static void start_workers()
{
    pthread_barrier_init(&emu::block_barrier, nullptr, AMPX_CU_BLOCK);
    for (unsigned w = 0; w < AMPX_CU_BLOCK / 32; w++)
        pthread_barrier_init(&emu::warp_barrier[w], nullptr, 32);
    pthread_barrier_init(&start_barrier, nullptr, AMPX_CU_BLOCK + 1);
    pthread_barrier_init(&end_barrier, nullptr, AMPX_CU_BLOCK + 1);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    workers.resize(AMPX_CU_BLOCK);
    for (unsigned t = 0; t < AMPX_CU_BLOCK; t++)
        if (pthread_create(&workers[t], &attr, worker, (void *)(uintptr_t)t) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            exit(1);
        }
}

static void stop_workers()
{
    quitting = true;
    pthread_barrier_wait(&start_barrier);
    for (pthread_t &t : workers)
        pthread_join(t, nullptr);
}

/* ---- the driver entry points cuda_launch.c calls ------------------------------ */

static unsigned char *arena; /* "device memory": pointers are arena + offset */
static int depth;

extern "C" int ampx_cu_push(const ampx_cu_dev *, ampx_cu_error *)
{
    depth++;
    return 0;
}

extern "C" int ampx_cu_pop(ampx_cu_error *err)
{
    if (--depth < 0) {
        err->code = AMPX_CU_E_AMPX;
        strcpy(err->msg, "pop without push");
        return -1;
    }
    return 0;
}

extern "C" int ampx_cu_memset32(ampx_cu_deviceptr p, unsigned value, size_t count, ampx_cu_stream,
                                ampx_cu_error *err)
{
    if (depth != 1 || (p & 3u) != 0) {
        err->code = AMPX_CU_E_AMPX;
        strcpy(err->msg, "memset outside a context or misaligned");
        return -1;
    }
    for (size_t k = 0; k < count; k++)
        memcpy((void *)(uintptr_t)(p + 4 * k), &value, 4);
    return 0;
}

extern "C" int ampx_cu_launch(ampx_cu_function f, unsigned grid, unsigned block, ampx_cu_stream, void *args,
                              const char *, ampx_cu_error *err)
{
    if (depth != 1) {
        err->code = AMPX_CU_E_AMPX;
        strcpy(err->msg, "launch outside a context");
        return -1;
    }
    if ((void *)f == (void *)&ampx_k_update_scale) {
        emu::thread_idx = emu_dim3{0, 0, 0};
        emu::block_idx = emu_dim3{0, 0, 0};
        emu::grid_dim = emu_dim3{1, 1, 1};
        ampx_k_update_scale(*(const ampx_cu_update_args *)args);
        return 0;
    }
    if (block != AMPX_CU_BLOCK || grid == 0) {
        err->code = AMPX_CU_E_AMPX;
        strcpy(err->msg, "bad launch shape");
        return -1;
    }
    if (grid_cap > 0 && grid > grid_cap)
        grid = grid_cap;
    current_kernel = (data_kernel)(void *)f;
    current_args = (const ampx_cu_args *)args;
    emu::grid_dim = emu_dim3{grid, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        emu::block_idx = emu_dim3{b, 0, 0};
        pthread_barrier_wait(&start_barrier);
        pthread_barrier_wait(&end_barrier);
    }
    return 0;
}

/* ---- the job --------------------------------------------------------------------- */

static uint64_t dptr(long long off) { return off < 0 ? 0 : (uint64_t)(uintptr_t)(arena + off); }

static int fail(const char *what)
{
    fprintf(stderr, "emulate: %s\n", what);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return fail("usage: emulate JOB ARENA");
    FILE *fa = fopen(argv[2], "rb");
    if (fa == nullptr)
        return fail("cannot open the arena");
    fseek(fa, 0, SEEK_END);
    long size = ftell(fa);
    fseek(fa, 0, SEEK_SET);
    arena = (unsigned char *)aligned_alloc(256, ((size_t)size + 255) / 256 * 256 + 256);
    if (arena == nullptr || fread(arena, 1, (size_t)size, fa) != (size_t)size)
        return fail("cannot read the arena");
    fclose(fa);
    FILE *fj = fopen(argv[1], "r");
    if (fj == nullptr)
        return fail("cannot open the job");
    char kind[16];
    if (fscanf(fj, "%15s", kind) != 1)
        return fail("bad job");

    static ampx_cu_dev dev;
#define AMPX_X_SLOT(label, mode, rd, wr, sc, ck, cuda)                                                      \
    AMPX_IF(cuda, dev.scale[rd][wr][sc] = (ampx_cu_function)(void *)&AMPX_CU_SCALE_KERNEL_NAME(rd, wr, sc);)
    AMPX_SCALE_MODE_LIST(AMPX_X_SLOT)
#undef AMPX_X_SLOT
    dev.cast = (ampx_cu_function)(void *)&ampx_k_cast;
    dev.stats = (ampx_cu_function)(void *)&ampx_k_tensor_stats;
    dev.update = (ampx_cu_function)(void *)&ampx_k_update_scale;
    ampx_cu_error err;
    memset(&err, 0, sizeof err);

    if (strcmp(kind, "update") == 0) {
        long long so, to, ho, fo, eo, interval;
        double growth, backoff, mn, mx;
        int hyst, consecutive;
        if (fscanf(fj, "%lld %lld %lld %lld %lld %lf %lf %lld %d %d %lf %lf", &so, &to, &ho, &fo, &eo, &growth,
                   &backoff, &interval, &hyst, &consecutive, &mn, &mx) != 12)
            return fail("bad update job");
        ampx_cu_update_args a;
        memset(&a, 0, sizeof a);
        a.scale = dptr(so);
        a.growth_tracker = dptr(to);
        a.hysteresis = dptr(ho);
        a.found_inf = dptr(fo);
        a.events = dptr(eo);
        a.growth_factor = growth;
        a.backoff_factor = backoff;
        a.growth_interval = interval;
        a.hysteresis_max = hyst;
        a.consecutive = consecutive;
        a.min_scale = (float)mn;
        a.max_scale = (float)mx;
        if (ampx_cu_update(&dev, nullptr, &a, &err) != 0)
            return fail(err.msg);
    } else {
        ampx_cu_job job;
        memset(&job, 0, sizeof job);
        long long factor_off = -1, found_off = -1, flags_off = -1, per_off = -1, total_off = -1;
        int sequential = 0, cap = 0, n = 0, spans = 0;
        if (strcmp(kind, "scale") == 0) {
            job.kind = AMPX_CU_SCALE;
            if (fscanf(fj, "%d %d %d %lf %lld %lld %lld %lld %lld %d %d %d %d", &job.reduce, &job.write, &job.scale,
                       &job.factor, &factor_off, &found_off, &flags_off, &per_off, &total_off, &sequential, &cap,
                       &n, &spans) != 13)
                return fail("bad scale job");
        } else if (strcmp(kind, "cast") == 0) {
            job.kind = AMPX_CU_CAST;
            unsigned long long seed, offset;
            long long rng_off;
            if (fscanf(fj, "%d %llu %llu %lld %lf %lld %lld %lld %d %d", &job.stochastic, &seed, &offset, &rng_off,
                       &job.factor, &factor_off, &found_off, &flags_off, &cap, &n) != 10)
                return fail("bad cast job");
            job.seed = seed;
            job.offset = offset;
            job.rng = dptr(rng_off);
        } else if (strcmp(kind, "stats") == 0) {
            job.kind = AMPX_CU_STATS;
            if (fscanf(fj, "%lld %d %d", &per_off, &cap, &n) != 3)
                return fail("bad stats job");
        } else {
            return fail("unknown job kind");
        }
        grid_cap = (unsigned)cap;
        job.factor_ptr = dptr(factor_off);
        job.found_inf = dptr(found_off);
        job.flags_out = dptr(flags_off);
        job.per_out = dptr(per_off);
        job.total_out = dptr(total_off);
        std::vector<ampx_cu_tensor> ts((size_t)n + 1);
        for (int i = 0; i < n; i++) {
            long long numel, po, so;
            if (fscanf(fj, "%d %d %lld %lld %lld", &ts[i].dtype, &ts[i].src_dtype, &numel, &po, &so) != 5)
                return fail("bad tensor line");
            ts[i].numel = numel;
            ts[i].ptr = dptr(po);
            ts[i].src = dptr(so);
            ts[i].index = (uint32_t)i;
        }
        std::vector<unsigned char> tables; /* "device memory" of the span tables (16-aligned below) */
        if (spans && job.per_out != 0)
            return fail("spans give no per-tensor reductions"); /* as csrc/entry_cuda.c decides */
        if (spans) {
            std::vector<ampx_tensor> at((size_t)n + 1), sp((size_t)n + 1);
            std::vector<int64_t> first((size_t)n + 1), off((size_t)n + 1);
            for (int i = 0; i < n; i++) {
                at[i].ptr = (char *)(uintptr_t)ts[i].ptr;
                at[i].numel = ts[i].numel;
                at[i].dtype = ts[i].dtype;
                at[i].index = ts[i].index;
            }
            int64_t m = 0;
            ampx_coalesce(at.data(), n, sp.data(), first.data(), &m);
            ampx_cu_deviceptr tab = 0;
            if (job.flags_out != 0 && m > 0) {
                tables.resize((size_t)ampx_cu_span_tables_bytes(n, m) + 16);
                unsigned char *host = tables.data() + (16 - (uintptr_t)tables.data() % 16) % 16;
                if (ampx_cu_span_tables(at.data(), sp.data(), first.data(), m, host, off.data()) != 0)
                    return fail("span tables");
                tab = (ampx_cu_deviceptr)(uintptr_t)host;
                job.nflags = n;
            }
            if (m > 0) {
                ampx_cu_span_slots(sp.data(), m, tab, off.data(), ts.data());
                n = (int)m;
            }
        }
        int64_t chunks = 0;
        int64_t bytes = ampx_cu_workspace_bytes(&job, ts.data(), n, &chunks);
        if (bytes < 0)
            return fail("too many chunks");
        unsigned char *ws = nullptr;
        if (bytes > 0) {
            ws = (unsigned char *)aligned_alloc(256, ((size_t)bytes + 255) / 256 * 256);
            memset(ws, 0xAB, (size_t)bytes); /* garbage: the launcher must zero what it counts on */
        }
        start_workers();
        static ampx_cu_launcher L;
        int rc = ampx_cu_begin(&L, &dev, nullptr, &job, n, chunks, (ampx_cu_deviceptr)(uintptr_t)ws, &err);
        for (int i = 0; i < n && rc == 0; i++) {
            rc = ampx_cu_add(&L, &ts[i], &err);
            if (rc == 0 && sequential)
                rc = ampx_cu_flush(&L, &err);
        }
        if (rc == 0)
            rc = ampx_cu_flush(&L, &err);
        stop_workers();
        free(ws);
        if (rc != 0)
            return fail(err.msg);
    }
    fclose(fj);
    if (depth != 0)
        return fail("unbalanced context push/pop");
    fa = fopen(argv[2], "wb");
    if (fa == nullptr || fwrite(arena, 1, (size_t)size, fa) != (size_t)size || fclose(fa) != 0)
        return fail("cannot write the arena");
    free(arena);
    return 0;
}
