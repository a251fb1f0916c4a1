// A coded block's value symbols (spec/FORMAT.md §6.1, §6.4) as the decode chain leaves them
// after its symbol lane decode, for the kernels that find their tables and turn them into
// values: kvc_resolve_tables, kvc_map_values and kvc_map_escapes (chain.cu), which check the
// escapes and place their values, and the dequantization (dequant.cu), which maps the other
// symbols as it reads them.
//
// Value symbol g of a block (row-major over its non-sink rows and channels) has its table's
// index in the block's table list at symbol_table[index_start + g] (which kvc_resolve_tables
// writes from the block's table map, and kvc_map_escapes and the dequantization find there
// again) and its table index at indices[index_start + g]. Table index i of a radius-R table is
// the value i - R; any i above 2R takes the block's next escape value.
#pragma once

#include "kvc_kernel.cuh"

// A coded block's record for the table resolution (kvc_resolve_tables, chain.cu), which also
// tells the kernels that find a value symbol's table themselves (kvc_map_escapes, the
// dequantization that maps values) where the block's exponents and table map lie: value symbol
// g's table-list index is map[map_start + kvc_map_entry(C, kind, e, ch)] for its row's kind,
// its row's exponent of its channel's head (& 15; 0 without exponents) and its channel.
struct KvcResolveBlock {
    // Index in `symbol_table` of the block's symbol 0 (the exponents, then the values).
    kvc_u64 symbol_start;
    // Index in `exps` of the block's exponent 0 ((rows - sink) * H of them), if has_exps.
    kvc_u64 exp_start;
    // Index in `map` of the block's map (kvc_map_entry).
    kvc_u64 map_start;
    kvc_u32 n_e;
    kvc_u32 n_sym;
    kvc_u32 sink_rows;
    kvc_u32 group;
    kvc_u32 has_exps;
    kvc_u32 reserved;
};

// Whether a block's value symbols are whole rows of C = heads * head_dim channels, its group is
// 1 to 2^31 (C and the group at most 2^31, so that the walks' sums below stay in 32 bits; a
// stream's group is at most 1024, H18), and its exponents and table map lie inside `n_exps` and
// `n_map` entries.
__device__ __forceinline__ bool kvc_resolve_shape_ok(const KvcResolveBlock& b, kvc_u32 heads,
                                                     kvc_u32 head_dim, kvc_u64 n_exps,
                                                     kvc_u64 n_map) {
    const kvc_u64 c = (kvc_u64)heads * head_dim;
    if (c == 0 || c > (1ull << 31) || b.group == 0 || b.group > (1u << 31)) return false;
    if (b.n_sym % c != 0) return false;
    const kvc_u64 rows = b.n_sym / c;
    const bool e_ok = !b.has_exps || (b.exp_start <= n_exps && rows * heads <= n_exps - b.exp_start);
    return e_ok && b.map_start <= n_map && 32 * c <= n_map - b.map_start;
}

// A thread's walk over a checked block's value symbols g, g + stride, g + 2 * stride, ...:
// symbol g's row i (after the sink rows), head, dim d in the head and row phase
// (sink_rows + i) % group, carried from one symbol to the next instead of divided out (division
// is slow on the device). Every sum stays in 32 bits while g < n_sym (C <= 2^31).
struct KvcSymbolWalk {
    kvc_u32 i, head, d, phase;
    kvc_u32 step_rows, step_head, step_d, step_phase;
};

__device__ __forceinline__ KvcSymbolWalk kvc_walk_from(const KvcResolveBlock& b, kvc_u32 heads,
                                                       kvc_u32 head_dim, kvc_u32 g,
                                                       kvc_u32 stride) {
    const kvc_u32 c = heads * head_dim;
    KvcSymbolWalk w;
    w.i = g / c;
    const kvc_u32 ch = g - w.i * c;
    w.head = ch / head_dim;
    w.d = ch - w.head * head_dim;
    // (In 64 bits: the sum may pass 2^32.)
    w.phase = (kvc_u32)(((kvc_u64)b.sink_rows + w.i) % b.group);
    w.step_rows = stride / c;
    const kvc_u32 step_ch = stride - w.step_rows * c;
    w.step_head = step_ch / head_dim;
    w.step_d = step_ch - w.step_head * head_dim;
    w.step_phase = w.step_rows % b.group;
    return w;
}

// The walk's next symbol (g + stride).
__device__ __forceinline__ void kvc_walk_next(KvcSymbolWalk& w, kvc_u32 heads, kvc_u32 head_dim,
                                              kvc_u32 group) {
    w.i += w.step_rows;
    w.phase += w.step_phase;
    w.d += w.step_d;
    w.head += w.step_head;
    if (w.d >= head_dim) {
        w.d -= head_dim;
        w.head++;
    }
    if (w.head >= heads) {
        w.head -= heads;
        w.i++;
        w.phase++;
    }
    if (w.phase >= group) w.phase -= group;
}

// The table-list index of the walk's symbol: through the block's map (`map` at its start) by
// its row kind, its row's exponent of its head (`exps` at the block's first; none without) and
// its channel, as kvc_resolve_tables finds it.
__device__ __forceinline__ kvc_u32 kvc_walk_table(const KvcSymbolWalk& w, const kvc_u16* map,
                                                  const kvc_u8* exps, kvc_u32 heads,
                                                  kvc_u32 head_dim) {
    const kvc_u32 e = exps != nullptr ? exps[(kvc_u64)w.i * heads + w.head] & 15u : 0u;
    const kvc_u32 kind = w.phase != 0 ? 1u : 0u;
    return map[kvc_map_entry(heads * head_dim, kind, e, w.head * head_dim + w.d)];
}

// Where a launch that finds value symbols' tables itself reads them (kvc_resolve_tables,
// kvc_map_escapes, kvc_rans_lane_decode_mapped): per block its resolve record, the decoded
// exponents, the table maps, and every block's row shape.
struct KvcTableMaps {
    // One record per block of the launch.
    const KvcResolveBlock* resolve;
    const kvc_u8* exps;
    kvc_u64 n_exps;
    const kvc_u16* map;
    kvc_u64 n_map;
    kvc_u32 heads;
    kvc_u32 head_dim;
};

// Whether record r's value symbols are whole rows and its exponents and table map lie in the
// maps' buffers (kvc_resolve_shape_ok).
__device__ __forceinline__ bool kvc_maps_ok(const KvcTableMaps& m, const KvcResolveBlock& r) {
    return kvc_resolve_shape_ok(r, m.heads, m.head_dim, m.n_exps, m.n_map);
}

// A thread's walk over a checked record's value symbols g, g + stride, ..., giving each one's
// table-list index in turn, as kvc_resolve_tables finds it.
struct KvcTableWalk {
    const kvc_u16* map;
    const kvc_u8* exps;
    kvc_u32 heads, head_dim, group;
    KvcSymbolWalk w;

    __device__ __forceinline__ kvc_u32 next() {
        const kvc_u32 t = kvc_walk_table(w, map, exps, heads, head_dim);
        kvc_walk_next(w, heads, head_dim, group);
        return t;
    }
};

// Record r's walk (kvc_maps_ok) from value symbol g.
__device__ __forceinline__ KvcTableWalk kvc_table_walk(const KvcTableMaps& m,
                                                       const KvcResolveBlock& r, kvc_u32 g,
                                                       kvc_u32 stride) {
    KvcTableWalk t;
    t.map = m.map + r.map_start;
    t.exps = r.has_exps ? m.exps + r.exp_start : nullptr;
    t.heads = m.heads;
    t.head_dim = m.head_dim;
    t.group = r.group;
    t.w = kvc_walk_from(r, m.heads, m.head_dim, g, stride);
    return t;
}

struct KvcValueBlock {
    // Index in `indices` and `symbol_table` of the block's first value symbol.
    kvc_u64 index_start;
    // Index in `table_list` of the block's table list.
    kvc_u64 list_start;
    // Index in `escapes` of the block's escape values.
    kvc_u64 escape_start;
    // Index in `q` of the block's first value (kvc_map_values writes it).
    kvc_u64 q_start;
    kvc_u32 n_sym;
    kvc_u32 n_escapes;
    kvc_u32 list_len;
    kvc_u32 reserved;
};

// A block's table list of at most this many tables has its radii staged in shared memory.
#define KVC_VALUE_LIST 4096u

// The radius of the table at index t of a block's list of `list_len` tables (its ids checked
// below the radius array's length): from `staged` (the list's radii, if it has at most
// KVC_VALUE_LIST) or through the list; -1 if t lies outside the list.
__device__ __forceinline__ int kvc_list_radius_of(const kvc_u32* list, const kvc_u8* radius,
                                                  const kvc_u8* staged, kvc_u32 list_len,
                                                  kvc_u32 t) {
    if (t >= list_len) return -1;
    if (list_len <= KVC_VALUE_LIST) return staged[t];
    return radius[list[t]];
}

// Whether table index i of a table of radius r (kvc_list_radius_of) takes an escape value;
// a symbol outside its list counts as one (its block fails kvc_map_values' checks).
__device__ __forceinline__ bool kvc_index_escapes(int i, int r) { return r < 0 || i > 2 * r; }
