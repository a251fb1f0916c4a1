// Dequantization (spec/FORMAT.md §7), bit for bit codec_core's reconstruction: a coded block's
// symbol values, step exponents, sink rows and channel constants to f16 or bf16 rows, written
// densely ([T, H, D] per tensor) or into pages as vLLM keeps them ([num_pages, page_size, H, D]
// per tensor, token t in page pages[t / page_size], slot t % page_size).
//
// One CUDA block per coded block (a chunk's layer K or V; many chunks and layers per launch), its
// threads striding over the channels; each thread walks its channel's rows in order, keeping the
// group's reconstructed anchor in a register (the closed loop of §7.2: a delta row predicts from
// the anchor as the decoder rebuilt it, before narrowing). Every f32 operation is one rounded
// operation in the spec's order (__fmul_rn / __fadd_rn / __fsub_rn on the device,
// -ffp-contract=off on the host).
//
// The symbol values come from `q` (the values given), or, in a decode chain, from the value
// symbols themselves (kvc_values.cuh): the dequantization maps each table index through its
// table's radius as it reads it (the table's index in the block's list from the block's table
// map, by the row kind, the exponent and the channel, as kvc_resolve_tables found it), and only
// an escape's value is read from `q`, where kvc_map_escapes (chain.cu) placed it. That spares
// the chain writing every value (4 bytes a symbol) and reading it back here, for 1 byte a
// symbol read here instead.

#include "kvc_kernel.cuh"
#include "kvc_values.cuh"

// Per-block outcome; codec_cuda::quant mirrors these values.
enum KvcDequantStatus : kvc_u32 {
    KVC_DEQUANT_OK = 0,
    // The block's ranges lie outside the launch's buffers, or its shape is invalid (no group,
    // more sink rows than rows); nothing written.
    KVC_DEQUANT_BAD_RANGE = 1,
    // Paged output: a row's page-table entry lies outside `pages`, or its page outside `out`;
    // nothing written.
    KVC_DEQUANT_BAD_PAGE = 2,
};

// Output element types (one entry point each).
enum KvcOutDtype : kvc_u32 {
    KVC_OUT_F16 = 0,
    KVC_OUT_BF16 = 1,
};

// The constants of one channel of one (layer, K/V) at the block's level (§7.1).
struct KvcChannelConsts {
    float mean;
    // anchor_step * level multiplier, delta_step * level multiplier (each one rounding).
    float anchor_step;
    float delta_step;
    // weight / 16.
    float weight;
};

// One coded block of a launch.
struct KvcDequantBlock {
    // Index in `q` of the symbol of non-sink row 0, channel 0 ((rows - sink_rows) * C values).
    kvc_u64 q_start;
    // Index in `exps` of the exponent of non-sink row 0, head 0 ((rows - sink_rows) * H values),
    // if has_exps.
    kvc_u64 exp_start;
    // Index in `sink` of sink row 0, channel 0 (sink_rows * C values, widened to f32).
    kvc_u64 sink_start;
    // Index in `out` of the tensor's element 0: token t, channel c is element
    // out_start + t * C + c (dense), or out_start + (pages[page_start + t / page_size] * page_size
    // + t % page_size) * C + c (paged).
    kvc_u64 out_start;
    // Index in `pages` of the sequence's page table (paged output only).
    kvc_u64 page_start;
    // Index in `consts` of channel 0 (C records).
    kvc_u64 consts_start;
    kvc_u32 rows;
    kvc_u32 sink_rows;
    // Token-group size G (>= 1): row r is an anchor row if r % G == 0.
    kvc_u32 group;
    // Whether the block has step exponents (otherwise every exponent is 0).
    kvc_u32 has_exps;
    // The sequence position of row 0 (the chunk's first token).
    kvc_u32 token_start;
    kvc_u32 reserved;
};

// A launch's value symbols, when it maps them (n_values > 0): block b's are those of
// values[b], its escapes' values at its places in `q` (q_start + g for value symbol g), its
// table map where resolve[b] says.
struct KvcDequantValues {
    const KvcValueBlock* values;
    const KvcResolveBlock* resolve;
    kvc_u64 n_values;
    const kvc_u8* indices;
    kvc_u64 n_indices;
    // The chain's table maps (kvc_map_entry).
    const kvc_u16* map;
    kvc_u64 n_map;
    const kvc_u32* table_list;
    kvc_u64 n_table_list;
    // Per global table id, its radius.
    const kvc_u8* radius;
    kvc_u64 n_radius;
};

// A launch's buffers; every count is the number of elements its pointer may be read or written.
struct KvcDequantArgs {
    const kvc_i32* q;
    kvc_u64 n_q;
    const kvc_u8* exps;
    kvc_u64 n_exps;
    const float* sink;
    kvc_u64 n_sink;
    const KvcChannelConsts* consts;
    kvc_u64 n_consts;
    // f16 or bf16 bits, as the entry point writes.
    kvc_u16* out;
    kvc_u64 n_out;
    // Page tables (paged output), page ids.
    const kvc_u32* pages;
    kvc_u64 n_pages;
    const KvcDequantBlock* blocks;
    kvc_u32* status;
    kvc_u64 n_blocks;
    // Every block's row shape: C = heads * head_dim channels.
    kvc_u32 heads;
    kvc_u32 head_dim;
    // Tokens per page; 0 for dense output.
    kvc_u32 page_size;
    kvc_u32 reserved;
    KvcDequantValues mapped;
};

// EXP_MULT[e] (§7.1): 2^(e/2), odd e from f32(sqrt 2) = 0x3FB504F3; only the exponent field
// changes, so the bits are built directly.
__device__ __forceinline__ float kvc_exp_mult(kvc_u32 e) {
    const kvc_u32 base = (e & 1u) ? 0x3FB504F3u : 0x3F800000u;
    return kvc_bits_f32(base + ((e & 15u) >> 1 << 23));
}

// f32 to f16 bits, IEEE roundTiesToEven (§1.2); NaN as the reference narrows it.
__device__ __forceinline__ kvc_u16 kvc_f32_to_f16(float x) {
    const kvc_u32 u = kvc_f32_bits(x);
    const kvc_u32 sign = (u >> 16) & 0x8000u;
    const kvc_u32 a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (kvc_u16)(sign | 0x7E00u | ((a & 0x7FFFFFu) >> 13));
    // 65520 and above (infinity included) round to infinity.
    if (a >= 0x477FF000u) return (kvc_u16)(sign | 0x7C00u);
    if (a >= 0x38800000u) {
        // Normal: rebias the exponent (127 -> 15), round the low 13 fraction bits to even;
        // a carry moves into the exponent, as it should.
        const kvc_u32 m = a - (112u << 23);
        return (kvc_u16)(sign | ((m + 0x0FFFu + ((m >> 13) & 1u)) >> 13));
    }
    // Subnormal (or 2^-14 after rounding): the significand in units of 2^-24, rounded to even.
    const kvc_u32 e = a >> 23;
    if (e < 102u) return (kvc_u16)sign;  // below 2^-25: rounds to 0
    const kvc_u32 mant = (a & 0x7FFFFFu) | 0x800000u;
    const kvc_u32 shift = 126u - e;  // 14 ..= 24
    const kvc_u32 q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return (kvc_u16)(sign | (q + ((rem > half) | ((rem == half) & (q & 1u)))));
}

// f32 to bf16 bits, IEEE roundTiesToEven (§1.2): (u + 0x7FFF + lsb) >> 16 on u32 (which carries
// into the exponent and on to infinity as it should); NaN as the reference narrows it.
__device__ __forceinline__ kvc_u16 kvc_f32_to_bf16(float x) {
    const kvc_u32 u = kvc_f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (kvc_u16)((u >> 16) | 0x0040u);
    return (kvc_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <kvc_u32 Dtype>
__device__ __forceinline__ kvc_u16 kvc_narrow(float x) {
    if constexpr (Dtype == KVC_OUT_BF16) {
        return kvc_f32_to_bf16(x);
    } else {
        return kvc_f32_to_f16(x);
    }
}

// Whether block `bi` of a launch that maps its values reads its value symbols (`coded` of
// them), table map and table list inside the launch's buffers (C channels); true for a launch
// given its values.
__device__ __forceinline__ bool kvc_dequant_values_ok(const KvcDequantArgs& a, kvc_u64 bi,
                                                      kvc_u64 coded, kvc_u64 c) {
    const KvcDequantValues& m = a.mapped;
    if (m.n_values == 0) return true;
    if (bi >= m.n_values) return false;
    const KvcValueBlock& v = m.values[bi];
    const kvc_u64 map_start = m.resolve[bi].map_start;
    return v.index_start <= m.n_indices && coded <= m.n_indices - v.index_start &&
           map_start <= m.n_map && 32 * c <= m.n_map - map_start &&
           v.list_start <= m.n_table_list && v.list_len <= m.n_table_list - v.list_start;
}

// Whether the block's ranges lie inside the launch's buffers (no overflow: C is checked to fit
// 32 bits, so every product is of two 32-bit values; every bound is compared by subtraction
// from a count or by division).
__device__ __forceinline__ bool kvc_dequant_block_ok(const KvcDequantArgs& a,
                                                     const KvcDequantBlock& b,
                                                     kvc_u64 bi) {
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    if (c == 0 || c > 0xFFFFFFFFull || b.group == 0 || b.sink_rows > b.rows) return false;
    const kvc_u64 coded = b.rows - b.sink_rows;
    const bool q_ok = b.q_start <= a.n_q && coded * c <= a.n_q - b.q_start;
    const bool e_ok = !b.has_exps ||
                      (b.exp_start <= a.n_exps && coded * a.heads <= a.n_exps - b.exp_start);
    const bool s_ok = b.sink_start <= a.n_sink && b.sink_rows * c <= a.n_sink - b.sink_start;
    // Dense: rows token_start .. token_start + rows of the tensor. Paged: the page-table entries
    // the rows use; each row's page is checked by kvc_dequant_pages_ok.
    const kvc_u64 end_token = (kvc_u64)b.token_start + b.rows;
    bool o_ok = b.out_start <= a.n_out;
    if (a.page_size == 0) {
        o_ok = o_ok && end_token <= (a.n_out - b.out_start) / c;
    } else if (b.rows > 0) {
        const kvc_u64 last_entry = (end_token - 1) / a.page_size;
        o_ok = o_ok && b.page_start <= a.n_pages && last_entry < a.n_pages - b.page_start;
    }
    const bool k_ok = b.consts_start <= a.n_consts && c <= a.n_consts - b.consts_start;
    return q_ok && e_ok && s_ok && o_ok && k_ok && kvc_dequant_values_ok(a, bi, coded * c, c);
}

// Index in `out` of row r's channel 0 (a checked block; for paged output, checked pages).
__device__ __forceinline__ kvc_u64 kvc_row_start(const KvcDequantArgs& a, const KvcDequantBlock& b,
                                                 kvc_u64 c, kvc_u32 r) {
    const kvc_u64 t = (kvc_u64)b.token_start + r;
    if (a.page_size == 0) return b.out_start + t * c;
    const kvc_u64 page = a.pages[b.page_start + t / a.page_size];
    return b.out_start + (page * a.page_size + t % a.page_size) * c;
}

// Rows a channel's walk loads at once: their loads go out together, then their arithmetic runs
// (the walk would otherwise wait on every row's load in turn).
#define KVC_DEQUANT_AHEAD 4u

// Where a checked block that maps its values finds them (kvc_values.cuh); `indices` is null
// when the values are given in `q`.
struct KvcDequantMap {
    // The block's value symbols' table indices, and its table map.
    const kvc_u8* indices;
    const kvc_u16* map;
    // The block's table list, the radii of all tables, the list's radii staged (if short).
    const kvc_u32* list;
    const kvc_u8* radius;
    const kvc_u8* staged;
    kvc_u32 list_len;
};

// The value of value symbol g of a block that maps its values (table list index t, table
// index i): i - R for a radius-R table, else the escape's value kvc_map_escapes placed in `q`.
__device__ __forceinline__ float kvc_mapped_value(const KvcDequantArgs& a,
                                                  const KvcDequantBlock& b,
                                                  const KvcDequantMap& m, kvc_u32 t, int i,
                                                  kvc_u64 g) {
    const int r = kvc_list_radius_of(m.list, m.radius, m.staged, m.list_len, t);
    if (!kvc_index_escapes(i, r)) return (float)(i - r);
    return (float)a.q[b.q_start + g];  // |q| <= 2^24: exact
}

// Channel `ch` of every row of a checked block (§7.2), narrowed to the output dtype (§7.3).
template <kvc_u32 Dtype>
__device__ __forceinline__ void kvc_dequant_channel(const KvcDequantArgs& a,
                                                    const KvcDequantBlock& b,
                                                    const KvcDequantMap& m, kvc_u64 ch) {
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    const KvcChannelConsts k = a.consts[b.consts_start + ch];
    const kvc_u64 head = ch / a.head_dim;
    float anchor = 0.0f;
    for (kvc_u32 r0 = 0; r0 < b.rows; r0 += KVC_DEQUANT_AHEAD) {
        // A sink row's stored value, or a coded row's symbol value (or its value symbol) and
        // step exponent.
        float v[KVC_DEQUANT_AHEAD];
        kvc_u32 e[KVC_DEQUANT_AHEAD];
        int ix[KVC_DEQUANT_AHEAD];
        for (kvc_u32 j = 0; j < KVC_DEQUANT_AHEAD; j++) {
            const kvc_u32 r = r0 + j;
            v[j] = 0.0f;
            e[j] = 0;
            ix[j] = 0;
            if (r >= b.rows) continue;
            if (r < b.sink_rows) {
                v[j] = a.sink[b.sink_start + r * c + ch];
                continue;
            }
            const kvc_u64 i = r - b.sink_rows, g = i * c + ch;
            if (m.indices) {
                ix[j] = m.indices[g];
            } else {
                v[j] = (float)a.q[b.q_start + g];  // |q| <= 2^24: exact
            }
            if (b.has_exps) e[j] = a.exps[b.exp_start + i * a.heads + head];
        }
        for (kvc_u32 j = 0; j < KVC_DEQUANT_AHEAD && r0 + j < b.rows; j++) {
            const kvc_u32 r = r0 + j;
            float x = v[j];
            if (r >= b.sink_rows) {
                if (m.indices) {
                    const kvc_u64 g = (kvc_u64)(r - b.sink_rows) * c + ch;
                    const kvc_u32 kind = r % b.group != 0;
                    const kvc_u32 t = m.map[kvc_map_entry((kvc_u32)c, kind, e[j] & 15u, (kvc_u32)ch)];
                    v[j] = kvc_mapped_value(a, b, m, t, ix[j], g);
                }
                const float mult = b.has_exps ? kvc_exp_mult(e[j]) : 1.0f;
                if (r % b.group == 0) {
                    x = __fadd_rn(k.mean, __fmul_rn(v[j], __fmul_rn(k.anchor_step, mult)));
                } else {
                    const float pred =
                        __fadd_rn(k.mean, __fmul_rn(k.weight, __fsub_rn(anchor, k.mean)));
                    x = __fadd_rn(pred, __fmul_rn(v[j], __fmul_rn(k.delta_step, mult)));
                }
            }
            if (r % b.group == 0) anchor = x;
            a.out[kvc_row_start(a, b, c, r) + ch] = kvc_narrow<Dtype>(x);
        }
    }
}

// The block's verdict and its table list's radii, in shared memory across the phases.
struct KvcDequantShared {
    kvc_u32 status;
    // Set (to 1) by any thread that finds a table id of the block's list outside `radius`.
    kvc_u32 bad_list;
    // The radii of the block's table list, when it maps its values and the list has at most
    // KVC_VALUE_LIST tables.
    kvc_u8 radius[KVC_VALUE_LIST];
};

// Phase 1: thread 0 checks the block's ranges.
__device__ __forceinline__ void kvc_dequant_check(const KvcDequantArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    KvcDequantShared* s = (KvcDequantShared*)shared;
    const bool ok = kvc_dequant_block_ok(a, a.blocks[blockIdx.x], blockIdx.x);
    s->status = ok ? KVC_DEQUANT_OK : KVC_DEQUANT_BAD_RANGE;
    s->bad_list = 0;
}

// Phase 2 (paged output): the threads check the rows' pages, striding over the rows. A failing
// thread writes KVC_DEQUANT_BAD_PAGE; every writer writes that same value.
__device__ __forceinline__ void kvc_dequant_pages_ok(const KvcDequantArgs& a,
                                                     unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || a.page_size == 0) return;
    KvcDequantShared* s = (KvcDequantShared*)shared;
    if (s->status != KVC_DEQUANT_OK) return;
    const KvcDequantBlock& b = a.blocks[blockIdx.x];
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    // Rows of C elements the output holds after out_start (C >= 1 in a checked block).
    const kvc_u64 out_rows = (a.n_out - b.out_start) / c;
    for (kvc_u32 r = threadIdx.x; r < b.rows; r += blockDim.x) {
        const kvc_u64 t = (kvc_u64)b.token_start + r;
        const kvc_u64 page = a.pages[b.page_start + t / a.page_size];
        if (page * a.page_size + t % a.page_size >= out_rows) s->status = KVC_DEQUANT_BAD_PAGE;
    }
}

// Phase 3 (a launch that maps its values): the threads stage the radii of the block's table
// list, striding over it, and check its table ids.
__device__ __forceinline__ void kvc_dequant_stage(const KvcDequantArgs& a, unsigned char* shared) {
    const KvcDequantValues& m = a.mapped;
    if (blockIdx.x >= a.n_blocks || m.n_values == 0) return;
    KvcDequantShared* s = (KvcDequantShared*)shared;
    if (s->status != KVC_DEQUANT_OK) return;
    const KvcValueBlock& v = m.values[blockIdx.x];
    const kvc_u32* list = m.table_list + v.list_start;
    bool bad = false;
    for (kvc_u32 k = threadIdx.x; k < v.list_len; k += blockDim.x) {
        const kvc_u32 id = list[k];
        if (id >= m.n_radius) {
            bad = true;
        } else if (v.list_len <= KVC_VALUE_LIST) {
            s->radius[k] = m.radius[id];
        }
    }
    if (bad) s->bad_list = 1;
}

// Where block b (checked, its list staged) finds its values.
__device__ __forceinline__ KvcDequantMap kvc_dequant_map(const KvcDequantArgs& a,
                                                         const KvcDequantShared* s) {
    KvcDequantMap map = {};
    const KvcDequantValues& m = a.mapped;
    if (m.n_values == 0) return map;
    const KvcValueBlock v = m.values[blockIdx.x];
    map.indices = m.indices + v.index_start;
    map.map = m.map + m.resolve[blockIdx.x].map_start;
    map.list = m.table_list + v.list_start;
    map.radius = m.radius;
    map.staged = s->radius;
    map.list_len = v.list_len;
    return map;
}

// Phase 4: the status, then each thread reconstructs its channels.
template <kvc_u32 Dtype>
__device__ __forceinline__ void kvc_dequant_rows(const KvcDequantArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    const KvcDequantShared* s = (const KvcDequantShared*)shared;
    kvc_u32 status = s->status;
    if (status == KVC_DEQUANT_OK && s->bad_list) status = KVC_DEQUANT_BAD_RANGE;
    if (threadIdx.x == 0) a.status[blockIdx.x] = status;
    if (status != KVC_DEQUANT_OK) return;
    // A copy: the walks' stores to `out` would otherwise reload the record after every row.
    const KvcDequantBlock b = a.blocks[blockIdx.x];
    const KvcDequantMap map = kvc_dequant_map(a, s);
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    for (kvc_u64 ch = threadIdx.x; ch < c; ch += blockDim.x) {
        kvc_dequant_channel<Dtype>(a, b, map, ch);
    }
}

// Dynamic shared memory: sizeof(KvcDequantShared) bytes.
KVC_KERNEL(kvc_dequant_f16, KvcDequantArgs, kvc_dequant_check, kvc_dequant_pages_ok,
           kvc_dequant_stage, kvc_dequant_rows<KVC_OUT_F16>)
KVC_KERNEL(kvc_dequant_bf16, KvcDequantArgs, kvc_dequant_check, kvc_dequant_pages_ok,
           kvc_dequant_stage, kvc_dequant_rows<KVC_OUT_BF16>)

#ifdef KVC_HOST
#include <stddef.h>
// For the test of the Rust mirrors: sizeof and offsetof of every field of the argument structs
// in declaration order. Writes at most `cap` values; returns how many there are.
extern "C" kvc_u64 kvc_dequant_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcChannelConsts),
        offsetof(KvcChannelConsts, mean),
        offsetof(KvcChannelConsts, anchor_step),
        offsetof(KvcChannelConsts, delta_step),
        offsetof(KvcChannelConsts, weight),
        sizeof(KvcDequantBlock),
        offsetof(KvcDequantBlock, q_start),
        offsetof(KvcDequantBlock, exp_start),
        offsetof(KvcDequantBlock, sink_start),
        offsetof(KvcDequantBlock, out_start),
        offsetof(KvcDequantBlock, consts_start),
        offsetof(KvcDequantBlock, rows),
        offsetof(KvcDequantBlock, sink_rows),
        offsetof(KvcDequantBlock, group),
        offsetof(KvcDequantBlock, has_exps),
        offsetof(KvcDequantBlock, token_start),
        offsetof(KvcDequantBlock, page_start),
        sizeof(KvcDequantArgs),
        offsetof(KvcDequantArgs, q),
        offsetof(KvcDequantArgs, n_q),
        offsetof(KvcDequantArgs, exps),
        offsetof(KvcDequantArgs, n_exps),
        offsetof(KvcDequantArgs, sink),
        offsetof(KvcDequantArgs, n_sink),
        offsetof(KvcDequantArgs, consts),
        offsetof(KvcDequantArgs, n_consts),
        offsetof(KvcDequantArgs, out),
        offsetof(KvcDequantArgs, n_out),
        offsetof(KvcDequantArgs, pages),
        offsetof(KvcDequantArgs, n_pages),
        offsetof(KvcDequantArgs, blocks),
        offsetof(KvcDequantArgs, status),
        offsetof(KvcDequantArgs, n_blocks),
        offsetof(KvcDequantArgs, heads),
        offsetof(KvcDequantArgs, head_dim),
        offsetof(KvcDequantArgs, page_size),
        offsetof(KvcDequantArgs, mapped),
        sizeof(KvcDequantValues),
        offsetof(KvcDequantValues, values),
        offsetof(KvcDequantValues, resolve),
        offsetof(KvcDequantValues, n_values),
        offsetof(KvcDequantValues, indices),
        offsetof(KvcDequantValues, n_indices),
        offsetof(KvcDequantValues, map),
        offsetof(KvcDequantValues, n_map),
        offsetof(KvcDequantValues, table_list),
        offsetof(KvcDequantValues, n_table_list),
        offsetof(KvcDequantValues, radius),
        offsetof(KvcDequantValues, n_radius),
        sizeof(KvcDequantShared),
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

// The kernel's f32 -> f16 narrowing, for an exhaustive-ish test against the half crate.
extern "C" kvc_u16 kvc_f32_to_f16_host(float x) { return kvc_f32_to_f16(x); }
extern "C" kvc_u16 kvc_f32_to_bf16_host(float x) { return kvc_f32_to_bf16(x); }
#endif
