// rANS lane decode (spec/FORMAT.md §6.3), bit for bit codec_core::rans::LaneDecoder: format
// v2's coder (a 64-bit state, 32-bit words) in the lane decoders' shared machinery
// (kvc_lanes.cuh: one warp per coded block, one thread per lane).
//
// kvc_rans_lane_decode_mapped (the decode chain's symbol launch) finds a value symbol's table
// through its block's table map instead (kvc_values.cuh), as kvc_resolve_tables would have
// written it to `symbol_table`, so that the chain needs no table resolution launch.
//
// The `_compact` entries read tables in the compact form (2 KiB a table, kvc_kernel.cuh) in
// place of the packed one (16 KiB): the same symbols and statuses.

#include "kvc_lanes.cuh"
#include "kvc_values.cuh"

// Format v2's lane coder for kvc_decode_lane: a 64-bit state, kept in [2^32, 2^64) while words
// remain and 0 at the end of a lane; 32-bit words; (x >> 12) < 2^52 times a frequency < 2^12
// does not overflow.
struct KvcLaneCoderV2 {
    typedef kvc_u64 State;
    typedef kvc_u32 Word;
    static __device__ __forceinline__ kvc_u32 word_bits() { return 32; }
    static __device__ __forceinline__ State low() { return 1ull << 32; }
    static __device__ __forceinline__ State final_state() { return 0; }

    // A lane starts at a nonzero last word, or empty (in state 0).
    static __device__ __forceinline__ bool starts(Word last, kvc_u64) { return last != 0; }
    static __device__ __forceinline__ bool starts_empty() { return true; }
};

// The v2 lane decoder's arguments (codec_cuda::ffi mirrors them).
typedef KvcLaneArgsOf<kvc_u32> KvcLaneDecodeArgs;

// A lane's table-list indices (as KvcLaneListTables gives them) through the block's table map
// (kvc_values.cuh): list index 0 for the block's exponent symbols (its first n_e), the map's
// entry for its value symbols, walked from the lane's first one.
struct KvcLaneMapTables {
    kvc_u64 p, n, n_e;
    KvcTableWalk walk;

    __device__ __forceinline__ kvc_u32 next() {
        const kvc_u32 t = p < n && p >= n_e ? walk.next() : 0u;
        p += KVC_LANES;
        return t;
    }
};

// The tables of lane `lane` of a block of n symbols whose resolve record r (kvc_maps_ok)
// describes them. (The walk of a lane without value symbols is never used.)
__device__ __forceinline__ KvcLaneMapTables kvc_lane_map_tables(const KvcTableMaps& maps,
                                                                const KvcResolveBlock& r,
                                                                kvc_u32 lane, kvc_u64 n) {
    const kvc_u64 n_e = r.n_e;
    // The lane's first value symbol: its first position at or past n_e.
    const kvc_u64 first =
        lane >= n_e ? lane : lane + (n_e - lane + KVC_LANES - 1) / KVC_LANES * KVC_LANES;
    return {lane, n, n_e, kvc_table_walk(maps, r, (kvc_u32)(first - n_e), KVC_LANES)};
}

KVC_KERNEL(kvc_rans_lane_decode, KvcLaneDecodeArgs, kvc_lane_stage_tables<kvc_u32>,
           kvc_lane_decode_listed<KvcLaneCoderV2>)

// kvc_rans_lane_decode_mapped's arguments: a lane decode's, and where its value symbols find
// their tables (one resolve record per block; `lanes.symbol_table` is not read).
struct KvcLaneMappedArgs {
    KvcLaneDecodeArgs lanes;
    KvcTableMaps maps;
};

__device__ __forceinline__ void kvc_lane_stage_mapped(const KvcLaneMappedArgs& a,
                                                      unsigned char* shared) {
    kvc_lane_stage_tables(a.lanes, shared);
}

// Phase 2 of the mapped decode (tables read by L): a block whose resolve record does not
// describe its symbols or reaches past the exponents or the maps is KVC_LANE_BAD_RANGE; the
// others' value symbols find their tables through the block's table map.
template <class L>
__device__ __forceinline__ void kvc_lane_decode_mapped(const KvcLaneMappedArgs& a,
                                                       unsigned char* shared) {
    const kvc_u64 b = kvc_warp_item();
    if (b >= a.lanes.n_blocks) return;
    const KvcResolveBlock& r = a.maps.resolve[b];
    const bool ok = (kvc_u64)r.n_e + r.n_sym == a.lanes.blocks[b].n_symbols &&
                    kvc_maps_ok(a.maps, r);
    if (!ok) {
        a.lanes.status[b * KVC_LANES + kvc_warp_lane()] = KVC_LANE_BAD_RANGE;
        return;
    }
    kvc_lane_decode_lanes<KvcLaneCoderV2, L>(
        a.lanes, shared, [&](const KvcLaneBlock& blk, kvc_u32 lane) {
            return kvc_lane_map_tables(a.maps, a.maps.resolve[b], lane, blk.n_symbols);
        });
}

KVC_KERNEL(kvc_rans_lane_decode_mapped, KvcLaneMappedArgs, kvc_lane_stage_mapped,
           kvc_lane_decode_mapped<KvcPackedLookup>)

// The two entries over tables in the compact form (kvc_kernel.cuh), read through the cache
// (none staged: a launch's `shared_tables` is not used).
KVC_KERNEL(kvc_rans_lane_decode_compact, KvcLaneDecodeArgs,
           kvc_lane_decode_listed<KvcLaneCoderV2, KvcCompactLookup>)
KVC_KERNEL(kvc_rans_lane_decode_mapped_compact, KvcLaneMappedArgs,
           kvc_lane_decode_mapped<KvcCompactLookup>)

#ifdef KVC_HOST
#include <stddef.h>
// For the test of the Rust mirrors (codec_cuda::ffi): kvc_lane_layout (kvc_lanes.cuh) of this
// kernel's arguments.
extern "C" kvc_u64 kvc_rans_lane_decode_layout(kvc_u64* out, kvc_u64 cap) {
    return kvc_lane_layout<kvc_u32>(out, cap);
}

// The same for kvc_rans_lane_decode_mapped's arguments and KvcTableMaps (kvc_values.cuh).
extern "C" kvc_u64 kvc_rans_lane_mapped_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcLaneMappedArgs),
        offsetof(KvcLaneMappedArgs, lanes),
        offsetof(KvcLaneMappedArgs, maps),
        sizeof(KvcTableMaps),
        offsetof(KvcTableMaps, resolve),
        offsetof(KvcTableMaps, exps),
        offsetof(KvcTableMaps, n_exps),
        offsetof(KvcTableMaps, map),
        offsetof(KvcTableMaps, n_map),
        offsetof(KvcTableMaps, heads),
        offsetof(KvcTableMaps, head_dim),
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
#endif
