// What the lane decoders share (rans_decode.cu, format v2; rans32_experiment.cu, an experiment
// outside the format): a launch's blocks and buffers, their checks, the staging of a block's
// tables in shared memory, and the software-pipelined loop that decodes one lane. The loop is
// generic over the coder (a state type, a word type and their constants, e.g. KvcLaneCoderV2 in
// rans_decode.cu), so that two coders decoded by it differ in their arithmetic alone.
//
// One warp per coded block (a chunk's layer K or V), one thread per lane, one or more warps per
// CUDA block (kvc_warp_item in kvc_kernel.cuh); many blocks per launch. Lane `l` of a block
// decodes the symbols at positions l, l + 32, ... of that block, each with the table its
// `symbol_table` entry names, from the lane's words read backwards. Every input is checked
// before it is used; each lane reports a KvcLaneStatus.
#pragma once

#include "kvc_kernel.cuh"

// Per-lane outcome; codec_cuda::rans::LaneStatus mirrors these values (a test reads this enum).
// On a status other than OK or the two end-of-lane checks, the lane stops where it failed and the
// rest of its symbols are not written.
enum KvcLaneStatus : kvc_u32 {
    KVC_LANE_OK = 0,
    // The lane's last word is 0 (RansError::ZeroFinalWord); nothing decoded. (A coder whose
    // start needs two words reports a shorter lane so too.)
    KVC_LANE_ZERO_FINAL_WORD = 1,
    // Words were left unread after the last symbol (RansError::TrailingData).
    KVC_LANE_TRAILING_DATA = 2,
    // The final state is not the coder's (RansError::BadFinalState).
    KVC_LANE_BAD_FINAL_STATE = 3,
    // The block's table list lies outside `table_list`, names a table that does not exist, or a
    // symbol's table index is not below the block's table count.
    KVC_LANE_BAD_TABLE = 4,
    // The block's words or symbols lie outside `words` or `symbols`.
    KVC_LANE_BAD_RANGE = 5,
};

// One coded block of a launch.
struct KvcLaneBlock {
    // Index in `words` of lane 0's first word; lane l's words follow lane l - 1's.
    kvc_u64 word_start;
    // Index in `symbol_table` and `symbols` of the block's symbol 0.
    kvc_u64 symbol_start;
    // Symbols in the block (symbol p is lane p % 32's).
    kvc_u32 n_symbols;
    // The block's tables are table_list[table_start .. table_start + table_count].
    kvc_u32 table_start;
    kvc_u32 table_count;
    // Words per lane.
    kvc_u32 lane_len[KVC_LANES];
};

// A launch's buffers, for a coder whose words are W; every count is the number of elements its
// pointer may be read or written.
template <class W>
struct KvcLaneArgsOf {
    const W* words;
    kvc_u64 n_words;
    // Packed decode tables, KVC_SLOTS entries each: entry `slot` of a table holds the slot's
    // symbol (bits 0..8), its frequency (bits 8..20) and slot - cdf (bits 20..32).
    const kvc_u32* tables;
    kvc_u64 n_tables;
    // Global table ids, read through the blocks' table ranges.
    const kvc_u32* table_list;
    kvc_u64 n_table_list;
    // Per symbol, the index of its table in its block's table range (input), and the decoded
    // symbol (output).
    const kvc_u16* symbol_table;
    kvc_u8* symbols;
    kvc_u64 n_symbols;
    // The blocks, and per (block, lane) its status (output, n_blocks * KVC_LANES).
    const KvcLaneBlock* blocks;
    kvc_u32* status;
    kvc_u64 n_blocks;
    // How many tables each warp's region of the launch's dynamic shared memory holds
    // (KVC_SLOTS * 4 bytes each). A block with at most this many tables reads them from shared
    // memory, others from `tables`.
    kvc_u64 shared_tables;
};

// Whether the block's table range lies in `table_list` and names existing tables.
template <class W>
__device__ __forceinline__ bool kvc_block_tables_ok(const KvcLaneArgsOf<W>& a,
                                                    const KvcLaneBlock& blk) {
    const kvc_u64 start = blk.table_start, count = blk.table_count;
    if (start + count > a.n_table_list) return false;
    for (kvc_u64 k = 0; k < count; k++) {
        if (a.table_list[start + k] >= a.n_tables) return false;
    }
    return true;
}

// Whether the block's tables are read from shared memory (then staged by phase 1).
template <class W>
__device__ __forceinline__ bool kvc_block_tables_shared(const KvcLaneArgsOf<W>& a,
                                                        const KvcLaneBlock& blk) {
    return blk.table_count <= a.shared_tables && kvc_block_tables_ok(a, blk);
}

// Whether the block's words and symbols lie inside the launch's buffers (no overflow: every
// bound is compared by subtraction from a count that was already checked).
template <class W>
__device__ __forceinline__ bool kvc_block_range_ok(const KvcLaneArgsOf<W>& a,
                                                   const KvcLaneBlock& blk) {
    kvc_u64 words = 0;
    for (kvc_u32 l = 0; l < KVC_LANES; l++) words += blk.lane_len[l];
    return blk.word_start <= a.n_words && words <= a.n_words - blk.word_start &&
           blk.symbol_start <= a.n_symbols && blk.n_symbols <= a.n_symbols - blk.symbol_start;
}

// The shared tables of the calling thread's warp: its region of `shared`.
template <class W>
__device__ __forceinline__ kvc_u32* kvc_lane_shared(const KvcLaneArgsOf<W>& a,
                                                    unsigned char* shared) {
    return (kvc_u32*)shared + (kvc_u64)kvc_warp() * a.shared_tables * KVC_SLOTS;
}

// Phase 1: each warp's threads copy its block's tables into the warp's region, if they fit.
template <class W>
__device__ __forceinline__ void kvc_lane_stage_tables(const KvcLaneArgsOf<W>& a,
                                                      unsigned char* shared) {
    const kvc_u64 b = kvc_warp_item();
    if (b >= a.n_blocks) return;
    const KvcLaneBlock& blk = a.blocks[b];
    if (!kvc_block_tables_shared(a, blk)) return;
    kvc_u32* dst = kvc_lane_shared(a, shared);
    for (kvc_u32 k = 0; k < blk.table_count; k++) {
        const kvc_u32* src = a.tables + (kvc_u64)a.table_list[blk.table_start + k] * KVC_SLOTS;
        for (kvc_u32 i = kvc_warp_lane(); i < KVC_SLOTS; i += KVC_LANES) {
            dst[k * KVC_SLOTS + i] = src[i];
        }
    }
}

// How the lane loop reads a table: a slot's entry in the packed form (symbol bits 0..8,
// frequency 8..20, slot - cdf 20..32). KvcPackedLookup reads tables of KVC_SLOTS such entries,
// which phase 1 may stage in shared memory; KvcCompactLookup reads the compact form
// (kvc_kernel.cuh) through the cache, 2 KiB a table instead of 16, and finds the entry with one
// more dependent load.
struct KvcPackedLookup {
    static __device__ __forceinline__ kvc_u64 stride() { return KVC_SLOTS; }
    static __device__ __forceinline__ bool staged() { return true; }
    static __device__ __forceinline__ kvc_u32 entry(const kvc_u32* t, kvc_u32 slot) {
        return t[slot];
    }
};

struct KvcCompactLookup {
    static __device__ __forceinline__ kvc_u64 stride() { return KVC_COMPACT_ENTRIES; }
    static __device__ __forceinline__ bool staged() { return false; }
    static __device__ __forceinline__ kvc_u32 entry(const kvc_u32* t, kvc_u32 slot) {
        const kvc_u32* g = t + 4u * (slot >> 6);
        const kvc_u32 lo = g[0], hi = g[1], before = g[2];
        // The starts at or before the slot within its group.
        const kvc_u32 r = slot & 63u;
        const kvc_u32 m_lo = r >= 32u ? ~0u : ~0u >> (31u - r);
        const kvc_u32 m_hi = r >= 32u ? ~0u >> (63u - r) : 0u;
        const kvc_u32 starts = (kvc_u32)(__popc(lo & m_lo) + __popc(hi & m_hi));
        // Masked: whatever the table holds, the load stays inside it.
        const kvc_u32 e = t[KVC_COMPACT_INFO + ((before + starts - 1u) & 255u)];
        return (e & 0xFFFFFu) | (slot - (e >> 20)) << 20;
    }
};

// The table-list indices of a lane's symbols p = lane, lane + 32, ... in turn, as
// `symbol_table` holds them (0 past the block's symbols).
struct KvcLaneListTables {
    const kvc_u16* table_of;
    kvc_u64 p, n;

    __device__ __forceinline__ kvc_u32 next() {
        const kvc_u32 t = p < n ? table_of[p] : 0u;
        p += KVC_LANES;
        return t;
    }
};

// Decodes lane `lane` of a checked block with coder C, its tables read by L (KvcPackedLookup
// or KvcCompactLookup) at `shared` (or in `a.tables` when null), each symbol's table-list index from `tables` (KvcLaneListTables, or any type with
// the same next(), at the lane's first symbol).
//
// C names its State and Word types and gives:
//   C::starts(last, n): whether a lane of n > 0 words whose last word is `last` may start
//     (else KVC_LANE_ZERO_FINAL_WORD); C::starts_empty(): whether a lane of none may (in state
//     0). The state starts as the last word, then the one before it, shifted in as below;
//   C::low() and C::word_bits(): after a symbol, a state below low() takes the next word (one
//     is always enough) as x = (x << word_bits()) | word while words are left;
//   C::final_state(): the state every lane must end in.
// (Functions, not static constexpr members: NVRTC gives those device storage.)
// A symbol's step is the arithmetic of spec/FORMAT.md §6.3 in LaneDecoder's order:
// x = (x >> 12) * freq + (slot - cdf), which C's State must hold without overflow.
template <class C, class L, class Tables>
__device__ __forceinline__ kvc_u32 kvc_decode_lane(const KvcLaneArgsOf<typename C::Word>& a,
                                                   const KvcLaneBlock& blk, kvc_u32 lane,
                                                   const kvc_u32* shared, Tables tables) {
    kvc_u64 first = blk.word_start;
    for (kvc_u32 l = 0; l < lane; l++) first += blk.lane_len[l];
    const typename C::Word* w = a.words + first;
    const kvc_u64 n = blk.lane_len[lane];

    // Initial state: the last word, then the one before it; read backwards from there.
    typename C::State x = 0;
    kvc_u64 unread = 0;
    if (n > 0) {
        if (!C::starts(w[n - 1], n)) return KVC_LANE_ZERO_FINAL_WORD;
        x = w[n - 1];
        if (n > 1) {
            x = (x << C::word_bits()) | w[n - 2];
            unread = n - 2;
        }
    } else if (!C::starts_empty()) {
        return KVC_LANE_ZERO_FINAL_WORD;
    }

    // Software-pipelined: a symbol's table index is loaded two steps ahead, its table id one
    // step ahead, and the next word the state may take as soon as the one before is taken, so
    // that within a step only the table entry (which needs the state) waits on memory. Every
    // load ahead stays inside the checked ranges (a table index is checked before its id is
    // read), and the symbols written and the status are those of the plain loop.
    kvc_u8* __restrict__ out = a.symbols + blk.symbol_start;
    const kvc_u32* __restrict__ list = a.table_list + blk.table_start;
    const kvc_u64 n_symbols = blk.n_symbols;
    const kvc_u32 count = blk.table_count;
    kvc_u32 k = tables.next();
    kvc_u32 k_next = tables.next();
    kvc_u32 id = k < count ? list[k] : 0u;
    typename C::Word word = unread > 0 ? w[unread - 1] : 0u;
    for (kvc_u64 p = lane; p < n_symbols; p += KVC_LANES) {
        if (k >= count) return KVC_LANE_BAD_TABLE;
        const kvc_u32* t = shared != nullptr ? shared + (kvc_u64)k * L::stride()
                                             : a.tables + (kvc_u64)id * L::stride();
        const kvc_u32 e = L::entry(t, (kvc_u32)(x & (KVC_SLOTS - 1)));
        const kvc_u32 k_after = tables.next();
        const kvc_u32 id_next = k_next < count ? list[k_next] : 0u;
        x = (x >> KVC_PRECISION) * ((e >> 8) & 0xFFF) + (e >> 20);
        if (x < C::low() && unread > 0) {
            unread--;
            x = (x << C::word_bits()) | word;
            word = unread > 0 ? w[unread - 1] : 0u;
        }
        out[p] = (kvc_u8)e;
        k = k_next;
        k_next = k_after;
        id = id_next;
    }
    if (unread != 0) return KVC_LANE_TRAILING_DATA;
    if (x != C::final_state()) return KVC_LANE_BAD_FINAL_STATE;
    return KVC_LANE_OK;
}

// Phase 2 of a lane decode kernel with coder C and lookup L: thread `lane` of a warp checks the
// warp's block and decodes its lane (its tables staged by phase 1 when L reads staged tables and
// they fit), its symbols' table-list indices from `tables(blk, lane)` (an object with
// KvcLaneListTables' next(), made once the block is checked).
template <class C, class L, class TablesOf>
__device__ __forceinline__ void kvc_lane_decode_lanes(const KvcLaneArgsOf<typename C::Word>& a,
                                                      unsigned char* shared, TablesOf tables) {
    const kvc_u64 b = kvc_warp_item();
    const kvc_u32 lane = kvc_warp_lane();
    if (b >= a.n_blocks) return;
    const KvcLaneBlock& blk = a.blocks[b];
    kvc_u32 status;
    if (!kvc_block_range_ok(a, blk)) {
        status = KVC_LANE_BAD_RANGE;
    } else if (!kvc_block_tables_ok(a, blk)) {
        status = KVC_LANE_BAD_TABLE;
    } else {
        const bool in_shared = L::staged() && blk.table_count <= a.shared_tables;
        const kvc_u32* staged = in_shared ? kvc_lane_shared(a, shared) : nullptr;
        status = kvc_decode_lane<C, L>(a, blk, lane, staged, tables(blk, lane));
    }
    a.status[b * KVC_LANES + lane] = status;
}

// Phase 2 of a kernel whose symbols' tables are listed in `symbol_table`.
template <class C, class L = KvcPackedLookup>
__device__ __forceinline__ void kvc_lane_decode_listed(const KvcLaneArgsOf<typename C::Word>& a,
                                                       unsigned char* shared) {
    kvc_lane_decode_lanes<C, L>(a, shared, [&](const KvcLaneBlock& blk, kvc_u32 lane) {
        return KvcLaneListTables{a.symbol_table + blk.symbol_start, lane, blk.n_symbols};
    });
}

#ifdef KVC_HOST
#include <stddef.h>
// For the tests of the Rust mirrors (codec_cuda::ffi): sizeof and offsetof of every field of
// KvcLaneBlock and KvcLaneArgsOf<W> as this compiler lays them out, in declaration order, then
// KVC_LANES, KVC_PRECISION and KVC_COMPACT_ENTRIES. Writes at most `cap` values; returns how
// many there are.
template <class W>
kvc_u64 kvc_lane_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcLaneBlock),
        offsetof(KvcLaneBlock, word_start),
        offsetof(KvcLaneBlock, symbol_start),
        offsetof(KvcLaneBlock, n_symbols),
        offsetof(KvcLaneBlock, table_start),
        offsetof(KvcLaneBlock, table_count),
        offsetof(KvcLaneBlock, lane_len),
        sizeof(KvcLaneArgsOf<W>),
        offsetof(KvcLaneArgsOf<W>, words),
        offsetof(KvcLaneArgsOf<W>, n_words),
        offsetof(KvcLaneArgsOf<W>, tables),
        offsetof(KvcLaneArgsOf<W>, n_tables),
        offsetof(KvcLaneArgsOf<W>, table_list),
        offsetof(KvcLaneArgsOf<W>, n_table_list),
        offsetof(KvcLaneArgsOf<W>, symbol_table),
        offsetof(KvcLaneArgsOf<W>, symbols),
        offsetof(KvcLaneArgsOf<W>, n_symbols),
        offsetof(KvcLaneArgsOf<W>, blocks),
        offsetof(KvcLaneArgsOf<W>, status),
        offsetof(KvcLaneArgsOf<W>, n_blocks),
        offsetof(KvcLaneArgsOf<W>, shared_tables),
        KVC_LANES,
        KVC_PRECISION,
        KVC_COMPACT_ENTRIES,
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
#endif
