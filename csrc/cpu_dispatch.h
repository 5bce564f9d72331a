/*
 * cpu_dispatch.h: choosing the CPU kernel table at run time.
 *
 * The best level the processor and operating system support is chosen on
 * first use; ampx.ops lets a user (AMPX_SIMD=...) or a test force a lower one.
 */
#ifndef AMPX_CPU_DISPATCH_H
#define AMPX_CPU_DISPATCH_H

#include "cpu_kernels.h"

/* The table in use (never NULL after ampx_cpu_dispatch_init). */
extern const ampx_cpu_kernels *ampx_cpu_active;

void ampx_cpu_dispatch_init(void);

/* Looks a level up by name: returns its table, or NULL when the name is
 * unknown (*supported = -1) or the machine lacks it (*supported = 0). */
const ampx_cpu_kernels *ampx_cpu_find(const char *name, int *supported);

/* Names of the levels this machine supports, best first, NULL-terminated. */
const char *const *ampx_cpu_supported_levels(void);

#endif /* AMPX_CPU_DISPATCH_H */
