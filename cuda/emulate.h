/*
 * emulate.h: runs cuda/ampx_kernels.cu on the CPU, for tests on machines without a GPU.
 *
 * Force-included (g++ -include cuda/emulate.h -DAMPX_CUDA_EMULATION -x c++) in front of the
 * kernel source, it defines the CUDA built-ins the kernels use with their documented meaning:
 * one OS thread per CUDA thread of a block (blocks run one after another), __syncthreads and
 * the warp-synchronous shuffles and votes as barriers, atomics as C11/C++ atomics. Float16 and
 * bfloat16 conversions use ampx_numerics.h's exact functions (on the GPU the hardware's
 * round-to-nearest-even conversions give the same bits except NaN payloads).
 *
 * Test-only: it checks the kernels' indexing, ownership, reductions, barriers (a barrier
 * reached by only part of a block or warp deadlocks here as it would misbehave there),
 * workspace protocol and stochastic-rounding keys; not the GPU's memory model or speed.
 */
#ifndef AMPX_CUDA_EMULATE_H
#define AMPX_CUDA_EMULATE_H

#include <pthread.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ampx_numerics.h"
#include "cuda_args.h"

using std::isinf;
using std::isnan;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

struct emu_dim3 {
    unsigned x, y, z;
};

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

namespace emu {
/* The block being run: set by the launcher (emulate_driver.cpp) before each block. */
extern thread_local emu_dim3 thread_idx;
extern emu_dim3 block_idx, grid_dim;
void sync_block();           /* all threads of the block */
void sync_warp(unsigned warp); /* the 32 threads of a warp */
extern uint64_t exchange[];  /* one slot per thread, for shuffles and votes */
} // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::sync_block(); }

inline int __syncthreads_or(int p)
{
    const unsigned t = threadIdx.x;
    emu::sync_block();
    emu::exchange[t] = p != 0;
    emu::sync_block();
    int any = 0;
    for (unsigned k = 0; k < AMPX_CU_BLOCK; k++)
        any |= (int)emu::exchange[k];
    emu::sync_block();
    return any;
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask)
{
    static_assert(sizeof(T) <= 8, "shuffle width");
    if (mask != 0xffffffffu)
        abort();
    const unsigned t = threadIdx.x, warp = t / 32, lane = t % 32;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    emu::sync_warp(warp);
    emu::exchange[t] = bits;
    emu::sync_warp(warp);
    uint64_t other = emu::exchange[warp * 32 + (lane ^ (unsigned)lane_mask)];
    emu::sync_warp(warp);
    T r;
    memcpy(&r, &other, sizeof r);
    return r;
}

inline unsigned __reduce_or_sync(unsigned mask, unsigned v)
{
    if (mask != 0xffffffffu)
        abort();
    const unsigned t = threadIdx.x, warp = t / 32;
    emu::sync_warp(warp);
    emu::exchange[t] = v;
    emu::sync_warp(warp);
    unsigned r = 0;
    for (unsigned k = 0; k < 32; k++)
        r |= (unsigned)emu::exchange[warp * 32 + k];
    emu::sync_warp(warp);
    return r;
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned *p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
/* 64-bit max / min as compare-and-swap loops (what the hardware does in one step) */
inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v)
{
    unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v)
{
    unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old > v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }

template <typename T>
inline T __ldcg(const T *p)
{
    T r;
    __atomic_load(p, &r, __ATOMIC_SEQ_CST);
    return r;
}

[[noreturn]] inline void __trap() { abort(); }

inline unsigned __float_as_uint(float f) { return ampx_f32_bits(f); }
inline float __uint_as_float(unsigned u) { return ampx_bits_f32(u); }
inline long long __double_as_longlong(double d) { return (long long)ampx_f64_bits(d); }
inline double __longlong_as_double(long long u) { return ampx_bits_f64((uint64_t)u); }
inline double __hiloint2double(int hi, int lo) { return ampx_bits_f64(((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo); }
inline int __double2loint(double d) { return (int)(uint32_t)ampx_f64_bits(d); }
inline int __double2hiint(double d) { return (int)(uint32_t)(ampx_f64_bits(d) >> 32); }
/* -ffp-contract=off keeps these single roundings */
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }

struct __half {
    uint16_t b;
};
struct __half2 {
    __half x, y;
};
struct __nv_bfloat16 {
    uint16_t b;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline float __half2float(__half h) { return ampx_f16_to_f32(h.b); }
inline __half __float2half_rn(float f) { return __half{ampx_f32_to_f16(f)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{{ampx_f32_to_f16(a)}, {ampx_f32_to_f16(b)}}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{ampx_f32_to_bf16(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return ampx_bf16_to_f32(h.b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b)
{
    return __nv_bfloat162{{ampx_f32_to_bf16(a)}, {ampx_f32_to_bf16(b)}};
}

#endif /* AMPX_CUDA_EMULATE_H */
