// CRC-32C (Castagnoli, reflected, initial value and final XOR 0xFFFFFFFF, as codec_core's) of a
// byte range by many threads: each takes the register of its own stretch of the range (the
// first stretch from the initial value, the others from 0), and the stretches are combined by
// carrying each register over the bytes after it: CRC is linear, and n zero bytes multiply the
// register by x^(8n) modulo the polynomial. kvc_check_chunks (chain.cu) checks the chunks a
// decode copied with one CUDA block per chunk; kvc_write_blocks and kvc_seal_chunks (encode.cu)
// sum a chunk's stretches over the CUDA blocks of its coded blocks.
#pragma once

#include "kvc_kernel.cuh"

#define KVC_CRC32C_POLY 0x82F63B78u
// Threads that take a stretch (codec_cuda launches CHAIN_THREADS = 256; more would idle).
#define KVC_CRC_THREADS 256u

// a * b modulo the CRC-32C polynomial, both reflected (bit 31 holds x^0).
__device__ constexpr kvc_u32 kvc_crc_mul(kvc_u32 a, kvc_u32 b) {
    kvc_u32 p = 0;
    for (kvc_u32 i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) p ^= b;
        b = (b >> 1) ^ (KVC_CRC32C_POLY & (0u - (b & 1u)));
    }
    return p;
}

// x^(2^k) modulo the polynomial for k = 0..63, computed by the compiler.
struct KvcCrcPowers {
    kvc_u32 x2k[64];
};

__device__ constexpr KvcCrcPowers kvc_crc_make_powers() {
    KvcCrcPowers p{};
    p.x2k[0] = 0x40000000u;
    for (kvc_u32 k = 1; k < 64; k++) p.x2k[k] = kvc_crc_mul(p.x2k[k - 1], p.x2k[k - 1]);
    return p;
}

#ifdef KVC_HOST
static constexpr KvcCrcPowers kvc_crc_powers = kvc_crc_make_powers();
#else
__constant__ KvcCrcPowers kvc_crc_powers = kvc_crc_make_powers();
#endif

// x^(8n) modulo the polynomial: what n zero bytes multiply a register by.
__device__ __forceinline__ kvc_u32 kvc_crc_x8n(kvc_u64 n) {
    kvc_u32 p = 0x80000000u;
    for (kvc_u32 k = 3; n != 0 && k < 64; k++, n >>= 1)
        if (n & 1) p = kvc_crc_mul(kvc_crc_powers.x2k[k], p);
    return p;
}

// The byte-wise table into `table` (256 entries), by the block's threads.
__device__ __forceinline__ void kvc_crc_table(kvc_u32* table) {
    for (kvc_u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        kvc_u32 c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (KVC_CRC32C_POLY & (0u - (c & 1u)));
        table[i] = c;
    }
}

// Register `r` carried over `bytes[0..n)`.
__device__ __forceinline__ kvc_u32 kvc_crc_bytes(const kvc_u32* table, kvc_u32 r,
                                                 const kvc_u8* bytes, kvc_u64 n) {
    for (kvc_u64 j = 0; j < n; j++) r = table[(r ^ bytes[j]) & 0xFFu] ^ (r >> 8);
    return r;
}

// The stretch of `len` bytes thread t of nt takes: [*from, *end).
__device__ __forceinline__ void kvc_crc_stretch_of(kvc_u32 t, kvc_u32 nt, kvc_u64 len,
                                                   kvc_u64* from, kvc_u64* end) {
    const kvc_u64 stretch = (len + nt - 1) / nt;
    *from = t * stretch < len ? t * stretch : len;
    *end = len - *from > stretch ? *from + stretch : len;
}

// What one CUDA block's threads share for the CRC of one range: the byte-wise table and per
// thread its stretch's register carried to the range's end.
struct KvcCrcShared {
    kvc_u32 table[256];
    kvc_u32 part[KVC_CRC_THREADS];
};

// The threads that take a stretch.
__device__ __forceinline__ kvc_u32 kvc_crc_threads() {
    return blockDim.x < KVC_CRC_THREADS ? blockDim.x : KVC_CRC_THREADS;
}

// First phase: the table.
__device__ __forceinline__ void kvc_crc_begin(KvcCrcShared* s) { kvc_crc_table(s->table); }

// A later phase: this thread's stretch of `bytes[0..len)` into its part.
__device__ __forceinline__ void kvc_crc_stretch(KvcCrcShared* s, const kvc_u8* bytes,
                                                kvc_u64 len) {
    const kvc_u32 t = threadIdx.x, nt = kvc_crc_threads();
    if (t >= nt) return;
    kvc_u64 from, end;
    kvc_crc_stretch_of(t, nt, len, &from, &end);
    const kvc_u32 r = kvc_crc_bytes(s->table, t == 0 ? 0xFFFFFFFFu : 0u, bytes + from, end - from);
    s->part[t] = kvc_crc_mul(kvc_crc_x8n(len - end), r);
}

// After the stretches' phase: the CRC of the range.
__device__ __forceinline__ kvc_u32 kvc_crc_sum(const KvcCrcShared* s) {
    kvc_u32 crc = 0xFFFFFFFFu;
    for (kvc_u32 t = 0; t < kvc_crc_threads(); t++) crc ^= s->part[t];
    return crc;
}
