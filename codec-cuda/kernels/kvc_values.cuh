// A coded block's value symbols (spec/FORMAT.md §6.4) as the decode chain leaves them after its
// symbol lane decode, for the two kernels that turn them into values: kvc_map_values
// (chain.cu), which checks the escapes and places their values, and the dequantization
// (dequant.cu), which maps the other symbols as it reads them.
//
// Value symbol g of a block (row-major over its non-sink rows and channels) has its table's
// index in the block's table list at symbol_table[index_start + g] and its table index at
// indices[index_start + g]. Table index i of a radius-R table is the value i - R; any i above
// 2R takes the block's next escape value.
#pragma once

#include "kvc_kernel.cuh"

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
