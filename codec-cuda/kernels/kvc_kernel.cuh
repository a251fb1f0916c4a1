// What every codec-cuda kernel shares. Compiled two ways from the same text:
//  - for the GPU by NVRTC at run time (codec_cuda::nvrtc; this header is passed to it by name);
//  - for the host by build.rs (C++17, -ffp-contract=off, with host_shim.h force-included, which
//    defines KVC_HOST), so that tests run the kernels on the CPU and compare them bit for bit
//    with codec-core.
//
// A kernel is a list of *phases*: functions `void phase(const Args&, unsigned char* shared)`
// that every thread of a block runs, separated by barriers. KVC_KERNEL declares the GPU entry
// point (the phases with __syncthreads() between them) and the host entry point (per block, every
// thread runs a phase before any thread starts the next), from one list. Kernels do not call
// __syncthreads() themselves (the host shim rejects it), so the two orders cannot drift apart.
#pragma once

typedef unsigned char kvc_u8;
typedef unsigned short kvc_u16;
typedef unsigned int kvc_u32;
typedef unsigned long long kvc_u64;
typedef int kvc_i32;

// Mirrors of codec-core's constants (codec_core::consts); the host library reports them and a
// test compares (tests/host.rs).
#define KVC_LANES 32u
#define KVC_PRECISION 12u
#define KVC_SLOTS (1u << KVC_PRECISION)

// A rANS table in the lane decoders' compact form, KVC_COMPACT_ENTRIES words (2 KiB) instead of
// the packed form's KVC_SLOTS (16 KiB): per group of 64 slots, 4 words (the slots where a
// symbol's range starts, a 64-bit map, low word first; how many ranges start before the group;
// 0), then per rank r < 256 the r-th symbol of nonzero frequency in symbol order: the symbol
// (bits 0..8), its frequency (8..20) and cdf (20..32); 0 past the last. A slot's symbol is the
// rank of the last start at or before it. Built by kvc_expand_tables (chain.cu), read by
// KvcCompactLookup (kvc_lanes.cuh).
#define KVC_COMPACT_GROUPS (KVC_SLOTS / 64u)
#define KVC_COMPACT_INFO (4u * KVC_COMPACT_GROUPS)
#define KVC_COMPACT_ENTRIES (KVC_COMPACT_INFO + 256u)

#ifndef KVC_HOST

// Runs Phase, then each of Rest, with a barrier between consecutive phases.
template <auto Phase, auto... Rest, class Args>
__device__ __forceinline__ void kvc_phases(const Args& args, unsigned char* shared) {
    Phase(args, shared);
    if constexpr (sizeof...(Rest) > 0) {
        __syncthreads();
        kvc_phases<Rest...>(args, shared);
    }
}

// The GPU entry point `name(Args)`: its dynamic shared memory is the phases' `shared`.
#define KVC_KERNEL(name, Args, ...)                                                \
    extern "C" __global__ void name(const Args args) {                             \
        extern __shared__ unsigned char kvc_shared[];                              \
        kvc_phases<__VA_ARGS__>(args, kvc_shared);                                 \
    }

#else

// The host entry point `name_host(const Args*, grid, block, shared_bytes)`: see host_shim.h.
#define KVC_KERNEL(name, Args, ...)                                                \
    extern "C" int name##_host(const Args* args, kvc_u32 grid, kvc_u32 block,      \
                               kvc_u64 shared_bytes) {                             \
        return kvc_host_run<__VA_ARGS__>(*args, grid, block, shared_bytes);        \
    }

#endif

// The bits of an f32 and back (no conversion).
#ifdef KVC_HOST
inline kvc_u32 kvc_f32_bits(float x) {
    kvc_u32 u;
    memcpy(&u, &x, 4);
    return u;
}
inline float kvc_bits_f32(kvc_u32 u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
#else
__device__ __forceinline__ kvc_u32 kvc_f32_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float kvc_bits_f32(kvc_u32 u) { return __uint_as_float(u); }
#endif

// A (layer, K/V, level)'s table map, built on the host from the profile (spec/FORMAT.md
// §6.1; 32 * C entries): the entry that holds the table-list index of a value symbol of row
// kind `kind` (0 anchor, 1 delta), step exponent e (0-15) and channel ch, of C channels. The
// decode chain's table resolution and dequantization and the encode chain read it.
__device__ __forceinline__ kvc_u64 kvc_map_entry(kvc_u32 c, kvc_u32 kind, kvc_u32 e, kvc_u32 ch) {
    return (kvc_u64)(kind * 16u + e) * c + ch;
}

// The lane decoders give each coded block one warp (KVC_LANES threads, one per lane): a CUDA
// block of blockDim.x = KVC_LANES * w threads holds w coded blocks, warp j of CUDA block i
// decoding coded block i * w + j, and its `shared` memory is w equal regions, one per warp.
// Several warps per CUDA block let a large batch fill an SM past its limit of resident CUDA
// blocks; the coded blocks stay independent, so the output is the same for every w.
__device__ __forceinline__ kvc_u32 kvc_warp() { return threadIdx.x / KVC_LANES; }
__device__ __forceinline__ kvc_u32 kvc_warp_lane() { return threadIdx.x % KVC_LANES; }
__device__ __forceinline__ kvc_u64 kvc_warp_item() {
    return (kvc_u64)blockIdx.x * (blockDim.x / KVC_LANES) + kvc_warp();
}

// Counts in shared memory turned into exclusive running sums (an escape's tiles into each tile's
// first escape rank) by a block's threads in three phases, instead of by one thread: each
// thread sums its contiguous share of the counts (kvc_scan_part), thread 0 turns the shares'
// sums into their first ranks (kvc_scan_starts), each thread rewrites its share
// (kvc_scan_write). `part` holds KVC_SCAN_THREADS entries; sums stay below 2^32 (counts of
// symbols of one block).
#define KVC_SCAN_THREADS 256u

__device__ __forceinline__ kvc_u32 kvc_scan_threads() {
    return blockDim.x < KVC_SCAN_THREADS ? blockDim.x : KVC_SCAN_THREADS;
}

// This thread's share [*from, *end) of n counts.
__device__ __forceinline__ void kvc_scan_share(kvc_u32 n, kvc_u32* from, kvc_u32* end) {
    const kvc_u32 per = (n + kvc_scan_threads() - 1) / kvc_scan_threads();
    const kvc_u64 f = (kvc_u64)threadIdx.x * per, e = f + per;
    *from = f < n ? (kvc_u32)f : n;
    *end = e < n ? (kvc_u32)e : n;
}

__device__ __forceinline__ void kvc_scan_part(const kvc_u32* counts, kvc_u32 n, kvc_u32* part) {
    if (threadIdx.x >= kvc_scan_threads()) return;
    kvc_u32 from, end, sum = 0;
    kvc_scan_share(n, &from, &end);
    for (kvc_u32 i = from; i < end; i++) sum += counts[i];
    part[threadIdx.x] = sum;
}

// Thread 0, after kvc_scan_part's phase: each share's first rank into `part`; the total.
__device__ __forceinline__ kvc_u32 kvc_scan_starts(kvc_u32* part) {
    kvc_u32 at = 0;
    for (kvc_u32 t = 0; t < kvc_scan_threads(); t++) {
        const kvc_u32 n = part[t];
        part[t] = at;
        at += n;
    }
    return at;
}

__device__ __forceinline__ void kvc_scan_write(kvc_u32* counts, kvc_u32 n, const kvc_u32* part) {
    if (threadIdx.x >= kvc_scan_threads()) return;
    kvc_u32 from, end, at = part[threadIdx.x];
    kvc_scan_share(n, &from, &end);
    for (kvc_u32 i = from; i < end; i++) {
        const kvc_u32 c = counts[i];
        counts[i] = at;
        at += c;
    }
}
