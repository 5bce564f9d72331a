/* cpu_dispatch.c: see cpu_dispatch.h. */
#include "cpu_dispatch.h"

#include <string.h>

const ampx_cpu_kernels *ampx_cpu_active = &ampx_kernels_portable;

static const char *levels[4];

/* __builtin_cpu_supports also checks that the OS saves the wide registers. */
static int has_avx512(void)
{
#ifdef AMPX_HAVE_X86_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static int has_avx2(void)
{
#ifdef AMPX_HAVE_X86_KERNELS
    __builtin_cpu_init();
    /* F16C has no name in older compilers' __builtin_cpu_supports; every
     * processor with AVX2 and FMA has it. */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

void ampx_cpu_dispatch_init(void)
{
    int k = 0;
#ifdef AMPX_HAVE_X86_KERNELS
    if (has_avx512())
        levels[k++] = "avx512";
    if (has_avx2())
        levels[k++] = "avx2";
#endif
    levels[k++] = "portable";
    levels[k] = NULL;
    ampx_cpu_active = ampx_cpu_find(levels[0], &k);
}

const ampx_cpu_kernels *ampx_cpu_find(const char *name, int *supported)
{
    const ampx_cpu_kernels *table = NULL;
    int ok = 0;
    if (strcmp(name, "portable") == 0) {
        table = &ampx_kernels_portable;
        ok = 1;
    }
#ifdef AMPX_HAVE_X86_KERNELS
    else if (strcmp(name, "avx2") == 0) {
        table = &ampx_kernels_avx2;
        ok = has_avx2();
    } else if (strcmp(name, "avx512") == 0) {
        table = &ampx_kernels_avx512;
        ok = has_avx512();
    }
#endif
    else {
        *supported = -1;
        return NULL;
    }
    *supported = ok;
    return ok ? table : NULL;
}

const char *const *ampx_cpu_supported_levels(void) { return levels; }
