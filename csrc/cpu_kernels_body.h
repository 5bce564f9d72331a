/*
 * cpu_kernels_body.h: the CPU kernels, written once over a small vector
 * layer. Each cpu_kernels_<isa>.c defines that layer and then includes this
 * file, which emits one ampx_cpu_kernels table named AMPX_TABLE_NAME.
 *
 * The vector layer provides (VW lanes of float32):
 *   vf, vload_{f32,f16,bf16}, vstore_{f32,f16,bf16}, vround_{f16,bf16},
 *   vmul, vset1, vnan / vinf (non-zero if any lane is NaN / +-inf),
 *   vacc with vacc_init, vacc_sq, vacc_abs, vacc_max, vacc_sum, vacc_maxval,
 *   vstore_bf16_sr (stochastic rounding with ampx_sr_bits per lane).
 * Elements past the last full vector go through the scalar functions of
 * ampx_numerics.h, which are the reference the vector code must match.
 *
 * Every generated function is a specialisation of an always-inline body on
 * compile-time dtype and mode, so the inner loops carry no branches.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "cpu_kernels.h"

#define AMPX_INLINE static inline __attribute__((always_inline))

AMPX_INLINE vf vload_dt(int dt, const char *p, int64_t i)
{
    if (dt == AMPX_F32)
        return vload_f32(p + 4 * i);
    if (dt == AMPX_F16)
        return vload_f16(p + 2 * i);
    return vload_bf16(p + 2 * i);
}

AMPX_INLINE void vstore_dt(int dt, char *p, int64_t i, vf x)
{
    if (dt == AMPX_F32)
        vstore_f32(p + 4 * i, x);
    else if (dt == AMPX_F16)
        vstore_f16(p + 2 * i, x);
    else
        vstore_bf16(p + 2 * i, x);
}

AMPX_INLINE vf vround_dt(int dt, vf x)
{
    if (dt == AMPX_F16)
        return vround_f16(x);
    if (dt == AMPX_BF16)
        return vround_bf16(x);
    return x;
}

AMPX_INLINE float sload_dt(int dt, const char *p, int64_t i)
{
    if (dt == AMPX_F32)
        return ((const float *)p)[i];
    if (dt == AMPX_F16)
        return ampx_f16_to_f32(((const uint16_t *)p)[i]);
    return ampx_bf16_to_f32(((const uint16_t *)p)[i]);
}

AMPX_INLINE void sstore_dt(int dt, char *p, int64_t i, float x)
{
    if (dt == AMPX_F32)
        ((float *)p)[i] = x;
    else if (dt == AMPX_F16)
        ((uint16_t *)p)[i] = ampx_f32_to_f16(x);
    else
        ((uint16_t *)p)[i] = ampx_f32_to_bf16(x);
}

AMPX_INLINE float sround_dt(int dt, float x)
{
    if (dt == AMPX_F16)
        return ampx_f16_to_f32(ampx_f32_to_f16(x));
    if (dt == AMPX_BF16)
        return ampx_bf16_to_f32(ampx_f32_to_bf16(x));
    return x;
}

/* Folds a chunk's reduction and flags into its partial. `reduced_nan` says
 * whether a value that entered the reduction was NaN: a product can be NaN
 * (inf * 0) where no input was, and max() alone would drop it. */
AMPX_INLINE void finish_partial(int reduce, double sum, float maxabs, unsigned reduced_nan,
                                unsigned flags, ampx_partial *out)
{
    out->flags = flags;
    if (reduce == AMPX_REDUCE_MAXABS)
        out->acc = reduced_nan ? (double)NAN : (double)maxabs;
    else
        out->acc = sum;
}

/* ---- scale / check / reduce over float32, float16, bfloat16 --------------- */

/* One vector of scale_body at element i: classify, multiply, store, reduce into acc. */
AMPX_INLINE void scale_vec(int dt, int sc, int wr, int ck, int rd, char *p, int64_t i, vf vs, vacc *acc,
                           unsigned *vn, unsigned *vi, unsigned *rn)
{
    vf x = vload_dt(dt, p, i);
    if (ck) {
        *vn |= vnan(x);
        *vi |= vinf(x);
    }
    if (sc)
        x = vmul(x, vs);
    if (wr)
        vstore_dt(dt, p, i, x);
    if (rd) {
        if (sc)
            x = vround_dt(dt, x);
        if (rd == AMPX_REDUCE_SUMSQ) {
            vacc_sq(acc, x);
        } else if (rd == AMPX_REDUCE_SUMABS) {
            vacc_abs(acc, x);
        } else {
            vacc_max(acc, x);
            *rn |= vnan(x);
        }
    }
}

/* Check-only: whether every element is finite, from the bit patterns taken as integers: a
 * magnitude reaches the all-ones exponent exactly when adding the exponent's lowest bit to it
 * carries into the sign bit, so one AND, one ADD and one OR a lane, at the lane's width (plain
 * loops the compiler vectorises for each file's ISA, SSE2 included). If none does, nothing
 * needs classifying; otherwise the caller classifies as every other mode does. On 16-bit data
 * in cache, where the monitor's hooks read it, about twice as fast as classifying each vector. */
AMPX_INLINE int all_finite_bits(int dt, const char *p, int64_t n)
{
    if (dt == AMPX_F32) {
        uint32_t bad = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t a;
            memcpy(&a, p + 4 * i, 4);
            bad |= (a & 0x7fffffffu) + 0x00800000u;
        }
        return !(bad & 0x80000000u);
    }
    const uint16_t low = dt == AMPX_F16 ? 0x0400u : 0x0080u; /* the exponent's lowest bit */
    uint16_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t a;
        memcpy(&a, p + 2 * i, 2);
        bad |= (uint16_t)((a & 0x7fffu) + low);
    }
    return !(bad & 0x8000u);
}

AMPX_INLINE void scale_body(int dt, int mode, void *ptr, int64_t n, double factor,
                            ampx_partial *out)
{
    if (mode == AMPX_M_CHECK && all_finite_bits(dt, (const char *)ptr, n)) {
        finish_partial(0, 0.0, 0.0f, 0u, 0u, out);
        return;
    }
    const int sc = mode & AMPX_M_SCALE, wr = mode & AMPX_M_WRITE, ck = mode & AMPX_M_CHECK;
    const int rd = AMPX_MODE_REDUCE(mode);
    char *p = (char *)ptr;
    const float s = (float)factor;
    const vf vs = vset1(s);
    /* Two accumulators taking alternate vectors: a float64 sum's adds form a chain whose latency,
     * not memory, bounded a norm over data in cache (1M float32 hot in cache, one thread: 68 us
     * against 42 for unscale_); each accumulator holds two independent chains already. */
    vacc acc, acc2;
    vacc_init(&acc);
    vacc_init(&acc2);
    unsigned vn = 0, vi = 0, rn = 0, flags = 0;
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        scale_vec(dt, sc, wr, ck, rd, p, i, vs, &acc, &vn, &vi, &rn);
        scale_vec(dt, sc, wr, ck, rd, p, i + VW, vs, &acc2, &vn, &vi, &rn);
    }
    for (; i + VW <= n; i += VW)
        scale_vec(dt, sc, wr, ck, rd, p, i, vs, &acc, &vn, &vi, &rn);
    double sum = 0.0;
    float mx = 0.0f;
    for (; i < n; i++) {
        float x = sload_dt(dt, p, i);
        if (ck)
            flags |= ampx_classify_f32(x);
        if (sc)
            x = sround_dt(dt, x * s);
        if (wr)
            sstore_dt(dt, p, i, x);
        if (rd == AMPX_REDUCE_SUMSQ)
            sum += (double)x * (double)x;
        else if (rd == AMPX_REDUCE_SUMABS)
            sum += fabs((double)x);
        else if (rd == AMPX_REDUCE_MAXABS) {
            rn |= x != x;
            if (fabsf(x) > mx)
                mx = fabsf(x);
        }
    }
    if (vn)
        flags |= AMPX_FLAG_NAN;
    if (vi)
        flags |= AMPX_FLAG_INF;
    if (rd == AMPX_REDUCE_MAXABS) {
        float vm = vacc_maxval(&acc), vm2 = vacc_maxval(&acc2);
        if (vm2 > vm)
            vm = vm2;
        if (vm > mx)
            mx = vm;
    } else if (rd) {
        sum = (vacc_sum(&acc) + vacc_sum(&acc2)) + sum;
    }
    finish_partial(rd, sum, mx, rn, flags, out);
}

/* ---- the same over float64 (scalar; float64 gradients are rare) ----------- */

AMPX_INLINE void scale_body_f64(int mode, void *ptr, int64_t n, double factor, ampx_partial *out)
{
    const int sc = mode & AMPX_M_SCALE, wr = mode & AMPX_M_WRITE, ck = mode & AMPX_M_CHECK;
    const int rd = AMPX_MODE_REDUCE(mode);
    double *p = (double *)ptr;
    unsigned flags = 0, rn = 0;
    double sum = 0.0, mx = 0.0;
    /* The factor as given: a float32 tensor's value is exact in double, and a
     * Python number keeps its full precision, as torch's float64 ops do. */
    const double s = factor;
    for (int64_t i = 0; i < n; i++) {
        double x = p[i];
        if (ck)
            flags |= ampx_classify_f64(x);
        if (sc)
            x *= s;
        if (wr)
            p[i] = x;
        if (rd == AMPX_REDUCE_SUMSQ)
            sum += x * x;
        else if (rd == AMPX_REDUCE_SUMABS)
            sum += fabs(x);
        else if (rd == AMPX_REDUCE_MAXABS) {
            rn |= x != x;
            if (fabs(x) > mx)
                mx = fabs(x);
        }
    }
    out->flags = flags;
    if (rd == AMPX_REDUCE_MAXABS)
        out->acc = rn ? (double)NAN : mx;
    else
        out->acc = sum;
}

/* ---- casts --------------------------------------------------------------- */

AMPX_INLINE unsigned cast_body(int sdt, int ddt, int sr, const void *src, void *dst, int64_t n,
                               double factor, ampx_sr_key_t key, uint32_t e0)
{
    const char *s = (const char *)src;
    char *d = (char *)dst;
    const float f = (float)factor;
    const vf vs = vset1(f);
    unsigned vn = 0, vi = 0, flags = 0;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf x = vload_dt(sdt, s, i);
        vn |= vnan(x);
        vi |= vinf(x);
        x = vmul(x, vs);
        if (sr)
            vstore_bf16_sr(d + 2 * i, x, key, e0 + (uint32_t)i);
        else
            vstore_dt(ddt, d, i, x);
    }
    for (; i < n; i++) {
        float x = sload_dt(sdt, s, i);
        flags |= ampx_classify_f32(x);
        x *= f;
        if (sr)
            ((uint16_t *)d)[i] = ampx_f32_to_bf16_sr(x, ampx_sr_bits(key, e0 + (uint32_t)i));
        else
            sstore_dt(ddt, d, i, x);
    }
    if (vn)
        flags |= AMPX_FLAG_NAN;
    if (vi)
        flags |= AMPX_FLAG_INF;
    return flags;
}

/* Any cast with a float64 side: scalar, and without double rounding. */
AMPX_INLINE unsigned cast_body_f64(int sdt, int ddt, int sr, const void *src, void *dst,
                                   int64_t n, double factor, ampx_sr_key_t key, uint32_t e0)
{
    const char *s = (const char *)src;
    char *d = (char *)dst;
    unsigned flags = 0;
    const float f = (float)factor;
    for (int64_t i = 0; i < n; i++) {
        double x;
        if (sdt == AMPX_F64) {
            x = ((const double *)s)[i];
            flags |= ampx_classify_f64(x);
            x *= factor;
        } else {
            float y = sload_dt(sdt, s, i);
            flags |= ampx_classify_f32(y);
            x = (double)(y * f);
        }
        if (ddt == AMPX_F64) {
            ((double *)d)[i] = x;
        } else if (ddt == AMPX_F32) {
            ((float *)d)[i] = (float)x;
        } else {
            float odd = ampx_f64_to_f32_odd(x);
            if (sr)
                ((uint16_t *)d)[i] = ampx_f32_to_bf16_sr(odd, ampx_sr_bits(key, e0 + (uint32_t)i));
            else
                sstore_dt(ddt, d, i, odd);
        }
    }
    return flags;
}


/* ---- tensor_stats over float32, float16, bfloat16 (ampx_stats32) --------- */

/* Tables the counts are spread over: one per lane for 16 lanes, else 8 (measured, one thread
 * of a 2-core EPYC, 4M float32: AVX-512 0.88 / 0.77 / 0.63 ns an element with 4 / 8 / 16
 * tables, AVX2 0.71 / 0.59 / 0.83; norm() 0.57 on the same data). */
#define STATS_NT (VW >= 16 ? 16 : 8)
AMPX_STATIC_ASSERT(STATS_NT <= AMPX_STATS_TABLES, "ampx_stats32 holds the tables");

/* VW lanes of uint32 in the target's vector registers (GCC vector extensions:
 * the same code over 16, 8 or 1 lanes). */
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

AMPX_INLINE vu32 vbits(vf x)
{
    vu32 u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* What the vector pass leaves to a scalar one: subnormals, inf and NaN (rare
 * in training data: the run is then read a second time, from cache). */
AMPX_INLINE void stats_rare(uint32_t u, ampx_stats32 *s)
{
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {
        if (a > 0x7f800000u)
            s->nan++;
        else if (u >> 31)
            s->neginf++;
        else
            s->posinf++;
    } else if (a != 0u && a < 0x00800000u) {
        s->sub[32 - __builtin_clz(a)]++;
        s->nsub++;
    }
}

AMPX_INLINE uint32_t sbits_dt(int dt, const char *p, int64_t i)
{
    float x = sload_dt(dt, p, i);
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

AMPX_INLINE void stats_body(int dt, const void *ptr, int64_t n, ampx_stats32 *s)
{
    const char *p = (const char *)ptr;
    const vu32 absmask = (vu32){0} + 0x7fffffffu, infbits = (vu32){0} + 0x7f800000u;
    const vu32 one = (vu32){0} + 1u, submax = (vu32){0} + 0x007fffffu;
    vu32 vmax = (vu32){0}, vmin1 = ~(vu32){0}, rare = (vu32){0};
    uint32_t lanes[VW];
    /* A short run spreads over 2 tables: fewer to add up and clear afterwards (stats_flush). */
    const int64_t tmask = n >= 4096 ? STATS_NT - 1 : 7;
    if (s->tables < (uint32_t)tmask + 1u)
        s->tables = (uint32_t)tmask + 1u;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vu32 a = vbits(vload_dt(dt, p, i)) & absmask;
        vu32 fin = (vu32)(a < infbits);
        vu32 up = (vu32)(a > vmax) & fin;
        vmax = (a & up) | (vmax & ~up);
        vu32 c = (a - one) | ~fin; /* 0 and non-finite values: 0xffffffff, never below */
        vu32 down = (vu32)(c < vmin1);
        vmin1 = (c & down) | (vmin1 & ~down);
        rare |= ~fin | (vu32)((a - one) < submax);
        memcpy(lanes, &a, sizeof lanes);
        for (int j = 0; j < VW; j++)
            s->ex[(i + j) & tmask][lanes[j] >> 23]++;
    }
    uint32_t mx = s->amax, mn1 = s->amin1, any_rare = 0;
    uint32_t vmaxl[VW], vminl[VW], rarel[VW];
    memcpy(vmaxl, &vmax, sizeof vmaxl);
    memcpy(vminl, &vmin1, sizeof vminl);
    memcpy(rarel, &rare, sizeof rarel);
    for (int j = 0; j < VW; j++) {
        mx = vmaxl[j] > mx ? vmaxl[j] : mx;
        mn1 = vminl[j] < mn1 ? vminl[j] : mn1;
        any_rare |= rarel[j];
    }
    if (any_rare)
        for (int64_t k = 0; k < i; k++)
            stats_rare(sbits_dt(dt, p, k), s);
    for (; i < n; i++) {
        uint32_t u = sbits_dt(dt, p, i), a = u & 0x7fffffffu;
        s->ex[i & tmask][a >> 23]++;
        if (a < 0x7f800000u) {
            mx = a > mx ? a : mx;
            mn1 = a - 1u < mn1 ? a - 1u : mn1;
        }
        stats_rare(u, s);
    }
    s->amax = mx;
    s->amin1 = mn1;
}

/* ---- specialisations and the table --------------------------------------- */

static void stats_f32(const void *p, int64_t n, ampx_stats32 *s) { stats_body(AMPX_F32, p, n, s); }
static void stats_f16(const void *p, int64_t n, ampx_stats32 *s) { stats_body(AMPX_F16, p, n, s); }
static void stats_bf16(const void *p, int64_t n, ampx_stats32 *s) { stats_body(AMPX_BF16, p, n, s); }


/* One kernel per dtype for each mode of AMPX_SCALE_MODE_LIST (ampx_numerics.h). */
#define AMPX_DEF_SCALE(name, dt, m)                                                              \
    static void scale_##name##_##m(void *p, int64_t n, double f, ampx_partial *o)                \
    {                                                                                            \
        scale_body(dt, m, p, n, f, o);                                                           \
    }
#define AMPX_DEF_SCALE64(name, dt, m)                                                            \
    static void scale_##name##_##m(void *p, int64_t n, double f, ampx_partial *o)                \
    {                                                                                            \
        scale_body_f64(m, p, n, f, o);                                                           \
    }
#define AMPX_DEF_SCALE_MODE(label, m, rd, wr, sc, ck, cuda)                                      \
    AMPX_DEF_SCALE(f32, AMPX_F32, m)                                                             \
    AMPX_DEF_SCALE(f16, AMPX_F16, m) AMPX_DEF_SCALE(bf16, AMPX_BF16, m) AMPX_DEF_SCALE64(f64, AMPX_F64, m)
#define AMPX_SLOT_SCALE_MODE(label, m, rd, wr, sc, ck, cuda)                                     \
    [AMPX_F32][m] = scale_f32_##m, [AMPX_F16][m] = scale_f16_##m, [AMPX_BF16][m] = scale_bf16_##m, \
    [AMPX_F64][m] = scale_f64_##m,

AMPX_SCALE_MODE_LIST(AMPX_DEF_SCALE_MODE)

#define AMPX_DEF_CAST(sn, sdt, dn, ddt, sr, body)                                                \
    static unsigned cast_##sn##_##dn##_##sr(const void *s, void *d, int64_t n, double f,         \
                                            ampx_sr_key_t k, uint32_t e0)                        \
    {                                                                                            \
        return body(sdt, ddt, sr, s, d, n, f, k, e0);                                            \
    }
#define AMPX_CAST_ROW(X, sn, sdt, body)                                                          \
    X(sn, sdt, f32, AMPX_F32, 0, body)                                                           \
    X(sn, sdt, f16, AMPX_F16, 0, body)                                                           \
    X(sn, sdt, bf16, AMPX_BF16, 0, body) X(sn, sdt, bf16, AMPX_BF16, 1, body)                    \
        X(sn, sdt, f64, AMPX_F64, 0, cast_body_f64)

AMPX_CAST_ROW(AMPX_DEF_CAST, f32, AMPX_F32, cast_body)
AMPX_CAST_ROW(AMPX_DEF_CAST, f16, AMPX_F16, cast_body)
AMPX_CAST_ROW(AMPX_DEF_CAST, bf16, AMPX_BF16, cast_body)
AMPX_CAST_ROW(AMPX_DEF_CAST, f64, AMPX_F64, cast_body_f64)

#define AMPX_SLOT_CAST(sn, sdt, dn, ddt, sr, body) [sdt][ddt][sr] = cast_##sn##_##dn##_##sr,

const ampx_cpu_kernels AMPX_TABLE_NAME = {
    .name = AMPX_TABLE_LABEL,
    .stats = {[AMPX_F32] = stats_f32, [AMPX_F16] = stats_f16, [AMPX_BF16] = stats_bf16},
    .scale = {AMPX_SCALE_MODE_LIST(AMPX_SLOT_SCALE_MODE)},
    .cast = {AMPX_CAST_ROW(AMPX_SLOT_CAST, f32, AMPX_F32, cast_body)
                 AMPX_CAST_ROW(AMPX_SLOT_CAST, f16, AMPX_F16, cast_body)
                     AMPX_CAST_ROW(AMPX_SLOT_CAST, bf16, AMPX_BF16, cast_body)
                         AMPX_CAST_ROW(AMPX_SLOT_CAST, f64, AMPX_F64, cast_body_f64)},
};
