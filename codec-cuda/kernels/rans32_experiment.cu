// EXPERIMENT, not part of any format: a 32-lane rANS decoder with a 32-bit state and 16-bit
// renormalisation, to measure whether format v2's 64-bit state (rans_decode.cu) bounds the GPU
// lane decoder (issue 19, item 5; spec/FORMAT.md, appendix "Proposed: format v3 lane coder").
// v2 streams are never decoded by it; codec_cuda::experiment encodes its words from the symbols
// and tables of a v2 lane batch, so the two kernels decode the same symbols with the same tables.
//
// The coder (state x in [2^16, 2^32), 12-bit tables as in v2, words of 16 bits):
//   encode, symbols last to first, x starting at 2^16:
//     if x >= f << 20 { emit(x & 0xFFFF); x >>= 16 }    x = ((x / f) << 12) + x % f + cdf
//   then emit x & 0xFFFF and x >> 16;
//   decode reads a lane's words from its end: x = w[n-1] << 16 | w[n-2], then per symbol
//     e = table[x & 4095]; x = f * (x >> 12) + (x & 4095) - cdf;
//     if x < 2^16 and words remain: x = x << 16 | next word (one read is always enough);
//   and ends with every word read and x == 2^16.
// Everything else (blocks, table lists, shared-memory staging, checks) is rans_decode.cu's, so
// that the two kernels differ only in the state arithmetic and the word size.

#include "kvc_kernel.cuh"

// Per-lane outcome (codec_cuda::rans::LaneStatus's codes; ZERO_FINAL_WORD: fewer than 2 words).
enum KvcLane32Status : kvc_u32 {
    KVC_LANE32_OK = 0,
    KVC_LANE32_SHORT = 1,
    KVC_LANE32_TRAILING_DATA = 2,
    KVC_LANE32_BAD_FINAL_STATE = 3,
    KVC_LANE32_BAD_TABLE = 4,
    KVC_LANE32_BAD_RANGE = 5,
};

#define KVC_LANE32_L (1u << 16)

// KvcLaneBlock's layout; word counts are in 16-bit words.
struct KvcLane32Block {
    kvc_u64 word_start;
    kvc_u64 symbol_start;
    kvc_u32 n_symbols;
    kvc_u32 table_start;
    kvc_u32 table_count;
    kvc_u32 lane_len[KVC_LANES];
};

// KvcLaneDecodeArgs' layout with 16-bit words.
struct KvcLane32Args {
    const kvc_u16* words;
    kvc_u64 n_words;
    const kvc_u32* tables;
    kvc_u64 n_tables;
    const kvc_u32* table_list;
    kvc_u64 n_table_list;
    const kvc_u16* symbol_table;
    kvc_u8* symbols;
    kvc_u64 n_symbols;
    const KvcLane32Block* blocks;
    kvc_u32* status;
    kvc_u64 n_blocks;
    kvc_u64 shared_tables;
};

__device__ __forceinline__ bool kvc_lane32_tables_ok(const KvcLane32Args& a,
                                                     const KvcLane32Block& blk) {
    const kvc_u64 start = blk.table_start, count = blk.table_count;
    if (start + count > a.n_table_list) return false;
    for (kvc_u64 k = 0; k < count; k++) {
        if (a.table_list[start + k] >= a.n_tables) return false;
    }
    return true;
}

__device__ __forceinline__ bool kvc_lane32_range_ok(const KvcLane32Args& a,
                                                    const KvcLane32Block& blk) {
    kvc_u64 words = 0;
    for (kvc_u32 l = 0; l < KVC_LANES; l++) words += blk.lane_len[l];
    return blk.word_start <= a.n_words && words <= a.n_words - blk.word_start &&
           blk.symbol_start <= a.n_symbols && blk.n_symbols <= a.n_symbols - blk.symbol_start;
}

// The shared tables of the calling thread's warp (as rans_decode.cu).
__device__ __forceinline__ kvc_u32* kvc_lane32_shared(const KvcLane32Args& a,
                                                      unsigned char* shared) {
    return (kvc_u32*)shared + (kvc_u64)kvc_warp() * a.shared_tables * KVC_SLOTS;
}

// Phase 1: each warp's block's tables into its region, if they fit (as rans_decode.cu).
__device__ __forceinline__ void kvc_lane32_stage_tables(const KvcLane32Args& a,
                                                        unsigned char* shared) {
    const kvc_u64 b = kvc_warp_item();
    if (b >= a.n_blocks) return;
    const KvcLane32Block& blk = a.blocks[b];
    if (blk.table_count > a.shared_tables || !kvc_lane32_tables_ok(a, blk)) return;
    kvc_u32* dst = kvc_lane32_shared(a, shared);
    for (kvc_u32 k = 0; k < blk.table_count; k++) {
        const kvc_u32* src = a.tables + (kvc_u64)a.table_list[blk.table_start + k] * KVC_SLOTS;
        for (kvc_u32 i = kvc_warp_lane(); i < KVC_SLOTS; i += KVC_LANES) {
            dst[k * KVC_SLOTS + i] = src[i];
        }
    }
}

// Decodes lane `lane` of a checked block with the 32-bit coder above.
__device__ __forceinline__ kvc_u32 kvc_lane32_decode_lane(const KvcLane32Args& a,
                                                          const KvcLane32Block& blk,
                                                          kvc_u32 lane, const kvc_u32* shared) {
    kvc_u64 first = blk.word_start;
    for (kvc_u32 l = 0; l < lane; l++) first += blk.lane_len[l];
    const kvc_u16* w = a.words + first;
    const kvc_u32 n = blk.lane_len[lane];
    if (n < 2) return KVC_LANE32_SHORT;
    kvc_u32 x = ((kvc_u32)w[n - 1] << 16) | w[n - 2];
    kvc_u32 unread = n - 2;

    const kvc_u16* table_of = a.symbol_table + blk.symbol_start;
    kvc_u8* out = a.symbols + blk.symbol_start;
    const kvc_u32* list = a.table_list + blk.table_start;
    for (kvc_u32 p = lane; p < blk.n_symbols; p += KVC_LANES) {
        const kvc_u32 k = table_of[p];
        if (k >= blk.table_count) return KVC_LANE32_BAD_TABLE;
        const kvc_u32* t = shared != nullptr ? shared + (kvc_u64)k * KVC_SLOTS
                                             : a.tables + (kvc_u64)list[k] * KVC_SLOTS;
        const kvc_u32 e = t[x & (KVC_SLOTS - 1)];
        // (x >> 12) < 2^20 and the frequency < 2^12: the product fits 32 bits.
        x = (x >> KVC_PRECISION) * ((e >> 8) & 0xFFF) + (e >> 20);
        if (x < KVC_LANE32_L && unread > 0) {
            unread--;
            x = (x << 16) | w[unread];
        }
        out[p] = (kvc_u8)e;
    }
    if (unread != 0) return KVC_LANE32_TRAILING_DATA;
    if (x != KVC_LANE32_L) return KVC_LANE32_BAD_FINAL_STATE;
    return KVC_LANE32_OK;
}

// Phase 2: thread `lane` of a warp checks the warp's block and decodes its lane.
__device__ __forceinline__ void kvc_lane32_decode_lanes(const KvcLane32Args& a,
                                                        unsigned char* shared) {
    const kvc_u64 b = kvc_warp_item();
    const kvc_u32 lane = kvc_warp_lane();
    if (b >= a.n_blocks) return;
    const KvcLane32Block& blk = a.blocks[b];
    kvc_u32 status;
    if (!kvc_lane32_range_ok(a, blk)) {
        status = KVC_LANE32_BAD_RANGE;
    } else if (!kvc_lane32_tables_ok(a, blk)) {
        status = KVC_LANE32_BAD_TABLE;
    } else {
        const bool in_shared = blk.table_count <= a.shared_tables;
        status =
            kvc_lane32_decode_lane(a, blk, lane, in_shared ? kvc_lane32_shared(a, shared) : nullptr);
    }
    a.status[b * KVC_LANES + lane] = status;
}

KVC_KERNEL(kvc_rans32_lane_decode_experiment, KvcLane32Args, kvc_lane32_stage_tables,
           kvc_lane32_decode_lanes)

#ifdef KVC_HOST
// sizeof/offsetof as kvc_rans_lane_decode_layout reports them for the v2 kernel (the Rust side
// launches this kernel with the v2 kernel's mirrors), then KVC_LANES and KVC_PRECISION.
#include <stddef.h>
extern "C" kvc_u64 kvc_rans32_lane_decode_experiment_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcLane32Block),
        offsetof(KvcLane32Block, word_start),
        offsetof(KvcLane32Block, symbol_start),
        offsetof(KvcLane32Block, n_symbols),
        offsetof(KvcLane32Block, table_start),
        offsetof(KvcLane32Block, table_count),
        offsetof(KvcLane32Block, lane_len),
        sizeof(KvcLane32Args),
        offsetof(KvcLane32Args, words),
        offsetof(KvcLane32Args, n_words),
        offsetof(KvcLane32Args, tables),
        offsetof(KvcLane32Args, n_tables),
        offsetof(KvcLane32Args, table_list),
        offsetof(KvcLane32Args, n_table_list),
        offsetof(KvcLane32Args, symbol_table),
        offsetof(KvcLane32Args, symbols),
        offsetof(KvcLane32Args, n_symbols),
        offsetof(KvcLane32Args, blocks),
        offsetof(KvcLane32Args, status),
        offsetof(KvcLane32Args, n_blocks),
        offsetof(KvcLane32Args, shared_tables),
        KVC_LANES,
        KVC_PRECISION,
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
#endif
