// CRC-32C (Castagnoli, reflected, initial value and final XOR 0xFFFFFFFF, as codec_core's) of a
// byte range by one CUDA block: each thread takes the register of its own stretch of the range
// (the first thread from the initial value, the others from 0), and the stretches are combined
// by carrying each register over the bytes after it: CRC is linear, and n zero bytes multiply
// the register by x^(8n) modulo the polynomial. kvc_seal_chunks (encode.cu) appends it to the
// chunks it seals; kvc_check_chunks (chain.cu) checks the chunks a decode copied.
#pragma once

#include "kvc_kernel.cuh"

#define KVC_CRC32C_POLY 0x82F63B78u
// Threads that take a stretch (codec_cuda launches CHAIN_THREADS = 256; more would idle).
#define KVC_CRC_THREADS 256u

// What a block's threads share: the byte-wise table, x^(2^k) modulo the polynomial for
// k = 0..63, and per thread its stretch's register carried to the range's end.
struct KvcCrcShared {
    kvc_u32 table[256];
    kvc_u32 x2k[64];
    kvc_u32 part[KVC_CRC_THREADS];
};

// a * b modulo the CRC-32C polynomial, both reflected (bit 31 holds x^0).
__device__ __forceinline__ kvc_u32 kvc_crc_mul(kvc_u32 a, kvc_u32 b) {
    kvc_u32 p = 0;
    for (kvc_u32 i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) p ^= b;
        b = (b >> 1) ^ (KVC_CRC32C_POLY & (0u - (b & 1u)));
    }
    return p;
}

// x^(8n) modulo the polynomial: what n zero bytes multiply a register by.
__device__ __forceinline__ kvc_u32 kvc_crc_x8n(const kvc_u32* x2k, kvc_u64 n) {
    kvc_u32 p = 0x80000000u;
    for (kvc_u32 k = 3; n != 0 && k < 64; k++, n >>= 1)
        if (n & 1) p = kvc_crc_mul(x2k[k], p);
    return p;
}

// The threads that take a stretch.
__device__ __forceinline__ kvc_u32 kvc_crc_threads() {
    return blockDim.x < KVC_CRC_THREADS ? blockDim.x : KVC_CRC_THREADS;
}

// First phase: the table (by every thread) and the powers (by thread 0).
__device__ __forceinline__ void kvc_crc_begin(KvcCrcShared* s) {
    const kvc_u32 t = threadIdx.x, nt = kvc_crc_threads();
    if (t >= nt) return;
    for (kvc_u32 i = t; i < 256; i += nt) {
        kvc_u32 c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (KVC_CRC32C_POLY & (0u - (c & 1u)));
        s->table[i] = c;
    }
    if (t != 0) return;
    s->x2k[0] = 0x40000000u;
    for (kvc_u32 k = 1; k < 64; k++) s->x2k[k] = kvc_crc_mul(s->x2k[k - 1], s->x2k[k - 1]);
}

// A later phase: this thread's stretch of `bytes[0..len)` into its part.
__device__ __forceinline__ void kvc_crc_stretch(KvcCrcShared* s, const kvc_u8* bytes,
                                                kvc_u64 len) {
    const kvc_u32 t = threadIdx.x, nt = kvc_crc_threads();
    if (t >= nt) return;
    const kvc_u64 stretch = (len + nt - 1) / nt;
    const kvc_u64 from = t * stretch < len ? t * stretch : len;
    const kvc_u64 end = len - from > stretch ? from + stretch : len;
    kvc_u32 r = t == 0 ? 0xFFFFFFFFu : 0u;
    for (kvc_u64 j = from; j < end; j++) r = s->table[(r ^ bytes[j]) & 0xFFu] ^ (r >> 8);
    s->part[t] = kvc_crc_mul(kvc_crc_x8n(s->x2k, len - end), r);
}

// After the stretches' phase: the CRC of the range.
__device__ __forceinline__ kvc_u32 kvc_crc_sum(const KvcCrcShared* s) {
    kvc_u32 crc = 0xFFFFFFFFu;
    for (kvc_u32 t = 0; t < kvc_crc_threads(); t++) crc ^= s->part[t];
    return crc;
}
