/*
 * cpu_kernels_portable.c: the kernels in plain C, for any processor. The
 * "vector" is one float32 lane, so every element goes through the scalar
 * reference functions of ampx_numerics.h; the compiler may still vectorise.
 * Built with the default flags of the toolchain (never -march=native).
 */
#include <math.h>

#include "ampx_numerics.h"

#define VW 1
typedef float vf;

static inline vf vload_f32(const void *p) { return *(const float *)p; }
static inline vf vload_f16(const void *p) { return ampx_f16_to_f32(*(const uint16_t *)p); }
static inline vf vload_bf16(const void *p) { return ampx_bf16_to_f32(*(const uint16_t *)p); }
static inline void vstore_f32(void *p, vf x) { *(float *)p = x; }
static inline void vstore_f16(void *p, vf x) { *(uint16_t *)p = ampx_f32_to_f16(x); }
static inline void vstore_bf16(void *p, vf x) { *(uint16_t *)p = ampx_f32_to_bf16(x); }
static inline vf vround_f16(vf x) { return ampx_f16_to_f32(ampx_f32_to_f16(x)); }
static inline vf vround_bf16(vf x) { return ampx_bf16_to_f32(ampx_f32_to_bf16(x)); }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vset1(float s) { return s; }
static inline unsigned vnan(vf x) { return ampx_classify_f32(x) == AMPX_FLAG_NAN; }
static inline unsigned vinf(vf x) { return ampx_classify_f32(x) == AMPX_FLAG_INF; }

typedef struct {
    double sum;
    float max;
} vacc;
static inline void vacc_init(vacc *a) { a->sum = 0.0; a->max = 0.0f; }
static inline void vacc_sq(vacc *a, vf x) { a->sum += (double)x * (double)x; }
static inline void vacc_abs(vacc *a, vf x) { a->sum += fabs((double)x); }
static inline void vacc_max(vacc *a, vf x)
{
    if (fabsf(x) > a->max)
        a->max = fabsf(x);
}
static inline double vacc_sum(const vacc *a) { return a->sum; }
static inline float vacc_maxval(const vacc *a) { return a->max; }

static inline void vstore_bf16_sr(void *p, vf x, ampx_sr_key_t key, uint32_t e)
{
    *(uint16_t *)p = ampx_f32_to_bf16_sr(x, ampx_sr_bits(key, e));
}

#define AMPX_TABLE_NAME ampx_kernels_portable
#define AMPX_TABLE_LABEL "portable"
#include "cpu_kernels_body.h"
