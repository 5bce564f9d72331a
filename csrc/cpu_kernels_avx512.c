/*
 * cpu_kernels_avx512.c: the kernels over 16 float32 lanes with AVX-512
 * (F, BW, VL, DQ) and F16C. setup.py compiles this file alone with the
 * matching -m flags; it is only called after cpu_dispatch.c has seen those
 * features (and the operating system's support for their registers).
 *
 * bfloat16 rounding uses integer arithmetic rather than AVX512_BF16's
 * vcvtneps2bf16, which treats subnormal inputs as zero.
 */
#include <immintrin.h>
#include <math.h>

#include "ampx_numerics.h"

#define VW 16
typedef __m512 vf;

#define F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline vf vload_f32(const void *p) { return _mm512_loadu_ps(p); }
static inline vf vload_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vload_bf16(const void *p)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline void vstore_f32(void *p, vf x) { _mm512_storeu_ps(p, x); }
static inline void vstore_f16(void *p, vf x) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, F16_ROUND)); }

static inline __m512i bf16_bits(vf x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}
static inline void vstore_bf16(void *p, vf x) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits(x))); }
static inline vf vround_bf16(vf x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
static inline vf vround_f16(vf x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, F16_ROUND)); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vset1(float s) { return _mm512_set1_ps(s); }
static inline unsigned vnan(vf x) { return (unsigned)_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
static inline unsigned vinf(vf x)
{
    return (unsigned)_mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
}

typedef struct {
    __m512d s0, s1;
    __m512 m;
} vacc;
static inline void vacc_init(vacc *a)
{
    a->s0 = a->s1 = _mm512_setzero_pd();
    a->m = _mm512_setzero_ps();
}
static inline __m512d lo_pd(vf x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
static inline __m512d hi_pd(vf x)
{
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
static inline void vacc_sq(vacc *a, vf x)
{
    __m512d lo = lo_pd(x), hi = hi_pd(x);
    a->s0 = _mm512_fmadd_pd(lo, lo, a->s0);
    a->s1 = _mm512_fmadd_pd(hi, hi, a->s1);
}
static inline void vacc_abs(vacc *a, vf x)
{
    x = _mm512_abs_ps(x);
    a->s0 = _mm512_add_pd(a->s0, lo_pd(x));
    a->s1 = _mm512_add_pd(a->s1, hi_pd(x));
}
static inline void vacc_max(vacc *a, vf x) { a->m = _mm512_max_ps(a->m, _mm512_abs_ps(x)); }
static inline double vacc_sum(const vacc *a)
{
    double t[8];
    _mm512_storeu_pd(t, _mm512_add_pd(a->s0, a->s1));
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
static inline float vacc_maxval(const vacc *a)
{
    float t[16], m = 0.0f;
    _mm512_storeu_ps(t, a->m);
    for (int k = 0; k < 16; k++)
        m = t[k] > m ? t[k] : m;
    return m;
}

static inline __m512i vmix32(__m512i x)
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x7feb352du));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return x;
}
static inline void vstore_bf16_sr(void *p, vf x, ampx_sr_key_t key, uint32_t e)
{
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)e), lanes);
    __m512i rnd = vmix32(_mm512_xor_si512(vmix32(_mm512_xor_si512(idx, _mm512_set1_epi32((int)key.a))),
                                          _mm512_set1_epi32((int)key.b)));
    __m512i u = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(rnd, _mm512_set1_epi32(0xffff))), 16);
    __m512i expmask = _mm512_set1_epi32(0x7f800000);
    __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, expmask), expmask);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, special, hi);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

#define AMPX_TABLE_NAME ampx_kernels_avx512
#define AMPX_TABLE_LABEL "avx512"
#include "cpu_kernels_body.h"
