/*
 * cpu_kernels_avx2.c: the kernels over 8 float32 lanes with AVX2, FMA and
 * F16C. setup.py compiles this file alone with -mavx2 -mfma -mf16c; it is
 * only called after cpu_dispatch.c has seen those features at run time.
 */
#include <immintrin.h>
#include <math.h>

#include "ampx_numerics.h"

#define VW 8
typedef __m256 vf;

static inline vf vload_f32(const void *p) { return _mm256_loadu_ps((const float *)p); }
static inline vf vload_f16(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vload_bf16(const void *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline void vstore_f32(void *p, vf x) { _mm256_storeu_ps((float *)p, x); }
static inline void vstore_f16(void *p, vf x)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* bfloat16 bits (round to nearest even, NaN quieted) in the low half of each 32-bit lane. */
static inline __m256i bf16_bits(vf x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256i q = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan));
}
static inline void store_bits16(void *p, __m256i w)
{
    /* The lanes hold values below 2^16, so unsigned saturation is exact. */
    __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}
static inline void vstore_bf16(void *p, vf x) { store_bits16(p, bf16_bits(x)); }
static inline vf vround_bf16(vf x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
static inline vf vround_f16(vf x)
{
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vset1(float s) { return _mm256_set1_ps(s); }
static inline vf vabs(vf x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline unsigned vnan(vf x) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
static inline unsigned vinf(vf x)
{
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(vabs(x), _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
}

/* Squares and magnitudes accumulate in double: 2 x 4 lanes. */
typedef struct {
    __m256d s0, s1;
    __m256 m;
} vacc;
static inline void vacc_init(vacc *a)
{
    a->s0 = a->s1 = _mm256_setzero_pd();
    a->m = _mm256_setzero_ps();
}
static inline void vacc_sq(vacc *a, vf x)
{
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    a->s0 = _mm256_fmadd_pd(lo, lo, a->s0);
    a->s1 = _mm256_fmadd_pd(hi, hi, a->s1);
}
static inline void vacc_abs(vacc *a, vf x)
{
    x = vabs(x);
    a->s0 = _mm256_add_pd(a->s0, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    a->s1 = _mm256_add_pd(a->s1, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}
static inline void vacc_max(vacc *a, vf x) { a->m = _mm256_max_ps(a->m, vabs(x)); }
static inline double vacc_sum(const vacc *a)
{
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(a->s0, a->s1));
    return (t[0] + t[1]) + (t[2] + t[3]);
}
static inline float vacc_maxval(const vacc *a)
{
    float t[8], m = 0.0f;
    _mm256_storeu_ps(t, a->m);
    for (int k = 0; k < 8; k++)
        m = t[k] > m ? t[k] : m;
    return m;
}

static inline __m256i vmix32(__m256i x)
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x7feb352du));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return x;
}
static inline void vstore_bf16_sr(void *p, vf x, ampx_sr_key_t key, uint32_t e)
{
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)e), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i rnd = vmix32(_mm256_xor_si256(vmix32(_mm256_xor_si256(idx, _mm256_set1_epi32((int)key.a))),
                                          _mm256_set1_epi32((int)key.b)));
    __m256i u = _mm256_castps_si256(x);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(rnd, _mm256_set1_epi32(0xffff))), 16);
    /* inf and NaN keep their upper half; NaN is quieted. */
    __m256i expmask = _mm256_set1_epi32(0x7f800000);
    __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(u, expmask), expmask);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256i keep = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(hi),
        _mm256_castsi256_ps(_mm256_or_si256(hi, _mm256_set1_epi32(0x40))), nan));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(keep),
                                             _mm256_castsi256_ps(special)));
    store_bits16(p, r);
}

#define AMPX_TABLE_NAME ampx_kernels_avx2
#define AMPX_TABLE_LABEL "avx2"
#include "cpu_kernels_body.h"
