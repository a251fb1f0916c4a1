// Host shim: what the CUDA C of kernels/*.cu needs to compile as C++17 for the CPU
// (build.rs force-includes it: `-x c++ -std=c++17 -ffp-contract=off -include host_shim.h`).
//
// A grid runs on the calling thread: blocks one after another, and within a block each phase
// (see kvc_kernel.cuh) for thread 0, 1, ..., blockDim.x - 1 before the next phase starts, which is
// what the barrier between phases guarantees on the GPU. A kernel whose threads communicate only
// through shared memory across phases therefore computes the same thing here as on the device.
// The built-in indices are thread-local, so tests may run kernels on several threads at once.
#pragma once
#define KVC_HOST 1

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict

struct kvc_dim3 {
    unsigned int x, y, z;
};
inline thread_local kvc_dim3 threadIdx, blockIdx, blockDim, gridDim;

// Barriers exist only between phases: a kernel that calls __syncthreads() does not compile here.
void kvc_barrier_outside_phase() = delete;
#define __syncthreads() kvc_barrier_outside_phase()

// Round-to-nearest f32 arithmetic, never contracted: -ffp-contract=off forbids fusing a product
// into a sum, as __fmul_rn / __fadd_rn do on the device.
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }

// Blocks run one thread at a time, so an atomic operation is a plain one.
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    const unsigned int old = *p;
    *p = old + v;
    return old;
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v) {
    const unsigned int old = *p;
    *p = old | v;
    return old;
}
inline unsigned int atomicXor(unsigned int* p, unsigned int v) {
    const unsigned int old = *p;
    *p = old ^ v;
    return old;
}

// Shared memory starts each block filled with this byte, so that a kernel reading shared memory
// it did not write in an earlier phase gives a visible, deterministic wrong answer.
#define KVC_HOST_SHARED_FILL 0xA5

// Runs one phase for every thread of the current block.
template <auto Phase, class Args>
inline void kvc_host_phase(const Args& args, unsigned char* shared) {
    for (unsigned int t = 0; t < blockDim.x; t++) {
        threadIdx = kvc_dim3{t, 0, 0};
        Phase(args, shared);
    }
}

// Runs a one-dimensional grid of `grid` blocks of `block` threads with `shared_bytes` of dynamic
// shared memory each. Returns 0, or 1 if the shared memory could not be allocated or the launch
// shape is one the device would reject (no block, more than 1024 threads).
template <auto... Phases, class Args>
inline int kvc_host_run(const Args& args, uint32_t grid, uint32_t block, uint64_t shared_bytes) {
    if (block == 0 || block > 1024) return 1;
    unsigned char* shared = (unsigned char*)malloc(shared_bytes > 0 ? shared_bytes : 1);
    if (shared == nullptr) return 1;
    gridDim = kvc_dim3{grid, 1, 1};
    blockDim = kvc_dim3{block, 1, 1};
    for (uint32_t b = 0; b < grid; b++) {
        blockIdx = kvc_dim3{b, 0, 0};
        memset(shared, KVC_HOST_SHARED_FILL, shared_bytes);
        (kvc_host_phase<Phases>(args, shared), ...);
    }
    free(shared);
    return 0;
}
