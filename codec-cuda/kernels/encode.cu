// Encoding, bit for bit codec_core's encoder: quantization (spec/FORMAT.md §7, the closed loop of
// codec_core::quant::quantize_block) and the 32-lane rANS encoder (§6.3,
// codec_core::rans::encode_lanes). Many coded blocks per launch, one CUDA block per coded block.
//
// - kvc_quantize: a block's rows (f32, sink rows first) to symbol values, its threads striding
//   over the channels; each thread walks its channel's rows in order, keeping the group's
//   reconstructed anchor (as the decoder rebuilds it) in a register. Every f32 operation is one
//   rounded operation in codec-core's order.
// - kvc_rans_lane_encode: a block's table indices to lane words, one thread per lane (32): lane
//   l encodes the symbols l, l + 32, ... last to first with the 64-bit state and 32-bit
//   renormalisation of format v2, then flushes the low and (if nonzero) the high word. Each lane
//   writes into its own slot of capacity ceil(n / 32) + 2 words and reports how many it wrote;
//   the host concatenates the lanes.

#include "kvc_kernel.cuh"

// Largest symbol magnitude (codec_core::consts::MAX_SYMBOL).
#define KVC_MAX_SYMBOL (1 << 24)

// Per-block outcome; codec_cuda::encode mirrors these values.
enum KvcEncodeStatus : kvc_u32 {
    KVC_ENCODE_OK = 0,
    // The block's ranges lie outside the launch's buffers, or its shape is invalid; nothing
    // written (the quantization), or the lane wrote nothing (the lane encoder).
    KVC_ENCODE_BAD_RANGE = 1,
    // A symbol's table index is not below the block's table count, or the symbol has frequency
    // 0 in its table; the lane stopped there.
    KVC_ENCODE_BAD_SYMBOL = 2,
};

// ----------------------------------------------------------------------------------------------
// Quantization

// The constants of one channel at the block's level (as KvcChannelConsts in dequant.cu).
struct KvcQuantConsts {
    float mean;
    float anchor_step;
    float delta_step;
    float weight;
};

// One block of a quantization launch.
struct KvcQuantBlock {
    // Index in `x` of row 0 (a sink row if any), channel 0: rows * C values.
    kvc_u64 x_start;
    // Index in `exps` of non-sink row 0, head 0 ((rows - sink_rows) * H values), if has_exps.
    kvc_u64 exp_start;
    // Index in `q` of non-sink row 0, channel 0 ((rows - sink_rows) * C values, output).
    kvc_u64 q_start;
    // Index in `consts` of channel 0 (C records).
    kvc_u64 consts_start;
    kvc_u32 rows;
    kvc_u32 sink_rows;
    // Token-group size (>= 1).
    kvc_u32 group;
    kvc_u32 has_exps;
};

struct KvcQuantArgs {
    const float* x;
    kvc_u64 n_x;
    const kvc_u8* exps;
    kvc_u64 n_exps;
    const KvcQuantConsts* consts;
    kvc_u64 n_consts;
    kvc_i32* q;
    kvc_u64 n_q;
    const KvcQuantBlock* blocks;
    kvc_u32* status;
    kvc_u64 n_blocks;
    kvc_u32 heads;
    kvc_u32 head_dim;
};

#ifdef KVC_HOST
inline float kvc_div_rn(float a, float b) { return a / b; }
#else
__device__ __forceinline__ float kvc_div_rn(float a, float b) { return __fdiv_rn(a, b); }
#endif

// EXP_MULT[e] (§7.1), as in dequant.cu.
__device__ __forceinline__ float kvc_enc_exp_mult(kvc_u32 e) {
    const kvc_u32 base = (e & 1u) ? 0x3FB504F3u : 0x3F800000u;
    return kvc_bits_f32(base + ((e & 15u) >> 1 << 23));
}

// round_half_away_from_zero(r / step), clamped to +-KVC_MAX_SYMBOL, NaN to 0 (codec-core's
// quantize: for |q| < 2^23, q - trunc(q) is exact and is compared with +-0.5).
__device__ __forceinline__ kvc_i32 kvc_quantize_one(float r, float step) {
    const float q = kvc_div_rn(r, step);
    if (q != q) return 0;
    if (q < 8388608.0f && q > -8388608.0f) {
        const kvc_i32 t = (kvc_i32)q;
        const float f = __fsub_rn(q, (float)t);
        return t + (f >= 0.5f ? 1 : 0) - (f <= -0.5f ? 1 : 0);
    }
    if (q >= (float)KVC_MAX_SYMBOL) return KVC_MAX_SYMBOL;
    if (q <= -(float)KVC_MAX_SYMBOL) return -KVC_MAX_SYMBOL;
    return (kvc_i32)q;  // 2^23 <= |q| < 2^24: already an integer
}

__device__ __forceinline__ bool kvc_quant_block_ok(const KvcQuantArgs& a, const KvcQuantBlock& b) {
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    if (c == 0 || c > 0xFFFFFFFFull || b.group == 0 || b.sink_rows > b.rows) return false;
    const kvc_u64 coded = b.rows - b.sink_rows;
    const bool x_ok = b.x_start <= a.n_x && (kvc_u64)b.rows * c <= a.n_x - b.x_start;
    const bool e_ok = !b.has_exps ||
                      (b.exp_start <= a.n_exps && coded * a.heads <= a.n_exps - b.exp_start);
    const bool q_ok = b.q_start <= a.n_q && coded * c <= a.n_q - b.q_start;
    const bool k_ok = b.consts_start <= a.n_consts && c <= a.n_consts - b.consts_start;
    return x_ok && e_ok && q_ok && k_ok;
}

// The only phase: check the block, then each thread quantizes its channels.
__device__ __forceinline__ void kvc_quantize_rows(const KvcQuantArgs& a, unsigned char*) {
    if (blockIdx.x >= a.n_blocks) return;
    const KvcQuantBlock& b = a.blocks[blockIdx.x];
    const bool ok = kvc_quant_block_ok(a, b);
    if (threadIdx.x == 0) a.status[blockIdx.x] = ok ? KVC_ENCODE_OK : KVC_ENCODE_BAD_RANGE;
    if (!ok) return;
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    for (kvc_u64 ch = threadIdx.x; ch < c; ch += blockDim.x) {
        const KvcQuantConsts k = a.consts[b.consts_start + ch];
        const kvc_u64 head = ch / a.head_dim;
        float anchor = 0.0f;
        for (kvc_u32 r = 0; r < b.rows; r++) {
            const float x = a.x[b.x_start + (kvc_u64)r * c + ch];
            float recon;
            if (r < b.sink_rows) {
                recon = x;
            } else {
                const kvc_u64 i = r - b.sink_rows;
                const float m = b.has_exps
                                    ? kvc_enc_exp_mult(a.exps[b.exp_start + i * a.heads + head])
                                    : 1.0f;
                kvc_i32 s;
                if (r % b.group == 0) {
                    const float step = __fmul_rn(k.anchor_step, m);
                    s = kvc_quantize_one(__fsub_rn(x, k.mean), step);
                    recon = __fadd_rn(k.mean, __fmul_rn((float)s, step));
                } else {
                    const float step = __fmul_rn(k.delta_step, m);
                    const float pred =
                        __fadd_rn(k.mean, __fmul_rn(k.weight, __fsub_rn(anchor, k.mean)));
                    s = kvc_quantize_one(__fsub_rn(x, pred), step);
                    recon = __fadd_rn(pred, __fmul_rn((float)s, step));
                }
                a.q[b.q_start + i * c + ch] = s;
            }
            if (r % b.group == 0) anchor = recon;
        }
    }
}

KVC_KERNEL(kvc_quantize, KvcQuantArgs, kvc_quantize_rows)

// ----------------------------------------------------------------------------------------------
// Lane encode

// One block of a lane-encode launch.
struct KvcLaneEncodeBlock {
    // Index in `symbols` and `symbol_table` of the block's symbol 0.
    kvc_u64 symbol_start;
    // Index in `words` of lane 0's slot; lane l's slot starts lane_cap * l words later.
    kvc_u64 word_start;
    kvc_u32 n_symbols;
    // Words each lane's slot holds (ceil(n_symbols / 32) + 2 suffices).
    kvc_u32 lane_cap;
    // The block's tables are table_list[table_start .. table_start + table_count].
    kvc_u32 table_start;
    kvc_u32 table_count;
};

struct KvcLaneEncodeArgs {
    const kvc_u8* symbols;
    // Per symbol, the index of its table in the block's table list.
    const kvc_u16* symbol_table;
    kvc_u64 n_symbols;
    // Encode tables, 256 entries each: entry s holds symbol s's frequency (bits 0..16) and
    // cumulative frequency (bits 16..32); frequency 0 for a symbol the table lacks.
    const kvc_u32* tables;
    kvc_u64 n_tables;
    const kvc_u32* table_list;
    kvc_u64 n_table_list;
    // Output: lane words, and per (block, lane) how many were written.
    kvc_u32* words;
    kvc_u64 n_words;
    kvc_u32* lane_len;
    const KvcLaneEncodeBlock* blocks;
    // Per (block, lane) status (output).
    kvc_u32* status;
    kvc_u64 n_blocks;
};

__device__ __forceinline__ bool kvc_enc_block_ok(const KvcLaneEncodeArgs& a,
                                                 const KvcLaneEncodeBlock& b) {
    const kvc_u64 need = ((kvc_u64)b.n_symbols + KVC_LANES - 1) / KVC_LANES + 2;
    const kvc_u64 slots = (kvc_u64)b.lane_cap * KVC_LANES;
    if (b.lane_cap < need) return false;
    if (b.symbol_start > a.n_symbols || b.n_symbols > a.n_symbols - b.symbol_start) return false;
    if (b.word_start > a.n_words || slots > a.n_words - b.word_start) return false;
    if ((kvc_u64)b.table_start + b.table_count > a.n_table_list) return false;
    for (kvc_u32 k = 0; k < b.table_count; k++) {
        if (a.table_list[b.table_start + k] >= a.n_tables) return false;
    }
    return true;
}

// The only phase: lane threadIdx.x of the block encodes its symbols.
__device__ __forceinline__ void kvc_lane_encode(const KvcLaneEncodeArgs& a, unsigned char*) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x >= KVC_LANES) return;
    const KvcLaneEncodeBlock& b = a.blocks[blockIdx.x];
    const kvc_u64 at = (kvc_u64)blockIdx.x * KVC_LANES + threadIdx.x;
    a.lane_len[at] = 0;
    if (!kvc_enc_block_ok(a, b)) {
        a.status[at] = KVC_ENCODE_BAD_RANGE;
        return;
    }
    const kvc_u32 lane = threadIdx.x;
    kvc_u32* out = a.words + b.word_start + (kvc_u64)b.lane_cap * lane;
    kvc_u32 n_out = 0;
    kvc_u64 x = 0;
    kvc_u32 status = KVC_ENCODE_OK;
    // Positions lane, lane + 32, ... below n_symbols, last first.
    if (lane < b.n_symbols) {
        for (kvc_u32 p = lane + (b.n_symbols - 1 - lane) / KVC_LANES * KVC_LANES;; p -= KVC_LANES) {
            const kvc_u64 g = b.symbol_start + p;
            const kvc_u32 t = a.symbol_table[g];
            if (t >= b.table_count) {
                status = KVC_ENCODE_BAD_SYMBOL;
                break;
            }
            const kvc_u32 e = a.tables[(kvc_u64)a.table_list[b.table_start + t] * 256u + a.symbols[g]];
            const kvc_u64 f = e & 0xFFFFu, cdf = e >> 16;
            if (f == 0) {
                status = KVC_ENCODE_BAD_SYMBOL;
                break;
            }
            if (x >= f << (64 - KVC_PRECISION)) {
                out[n_out++] = (kvc_u32)x;
                x >>= 32;
            }
            x = ((x / f) << KVC_PRECISION) | (cdf + x % f);
            if (p < KVC_LANES) break;
        }
    }
    if (status == KVC_ENCODE_OK && x != 0) {
        out[n_out++] = (kvc_u32)x;
        if (x >> 32 != 0) out[n_out++] = (kvc_u32)(x >> 32);
    }
    a.lane_len[at] = n_out;
    a.status[at] = status;
}

KVC_KERNEL(kvc_rans_lane_encode, KvcLaneEncodeArgs, kvc_lane_encode)

#ifdef KVC_HOST
#include <stddef.h>
// For the test of the Rust mirrors: sizeof and offsetof of every field of the argument structs
// in declaration order, then KVC_MAX_SYMBOL. Writes at most `cap` values; returns how many.
extern "C" kvc_u64 kvc_encode_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcQuantBlock),
        offsetof(KvcQuantBlock, x_start),
        offsetof(KvcQuantBlock, exp_start),
        offsetof(KvcQuantBlock, q_start),
        offsetof(KvcQuantBlock, consts_start),
        offsetof(KvcQuantBlock, rows),
        offsetof(KvcQuantBlock, sink_rows),
        offsetof(KvcQuantBlock, group),
        offsetof(KvcQuantBlock, has_exps),
        sizeof(KvcQuantArgs),
        offsetof(KvcQuantArgs, x),
        offsetof(KvcQuantArgs, n_x),
        offsetof(KvcQuantArgs, exps),
        offsetof(KvcQuantArgs, n_exps),
        offsetof(KvcQuantArgs, consts),
        offsetof(KvcQuantArgs, n_consts),
        offsetof(KvcQuantArgs, q),
        offsetof(KvcQuantArgs, n_q),
        offsetof(KvcQuantArgs, blocks),
        offsetof(KvcQuantArgs, status),
        offsetof(KvcQuantArgs, n_blocks),
        offsetof(KvcQuantArgs, heads),
        offsetof(KvcQuantArgs, head_dim),
        sizeof(KvcLaneEncodeBlock),
        offsetof(KvcLaneEncodeBlock, symbol_start),
        offsetof(KvcLaneEncodeBlock, word_start),
        offsetof(KvcLaneEncodeBlock, n_symbols),
        offsetof(KvcLaneEncodeBlock, lane_cap),
        offsetof(KvcLaneEncodeBlock, table_start),
        offsetof(KvcLaneEncodeBlock, table_count),
        sizeof(KvcLaneEncodeArgs),
        offsetof(KvcLaneEncodeArgs, symbols),
        offsetof(KvcLaneEncodeArgs, symbol_table),
        offsetof(KvcLaneEncodeArgs, n_symbols),
        offsetof(KvcLaneEncodeArgs, tables),
        offsetof(KvcLaneEncodeArgs, n_tables),
        offsetof(KvcLaneEncodeArgs, table_list),
        offsetof(KvcLaneEncodeArgs, n_table_list),
        offsetof(KvcLaneEncodeArgs, words),
        offsetof(KvcLaneEncodeArgs, n_words),
        offsetof(KvcLaneEncodeArgs, lane_len),
        offsetof(KvcLaneEncodeArgs, blocks),
        offsetof(KvcLaneEncodeArgs, status),
        offsetof(KvcLaneEncodeArgs, n_blocks),
        (kvc_u64)KVC_MAX_SYMBOL,
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

// The quantizer's rounding of one value, for tests against codec-core.
extern "C" kvc_i32 kvc_quantize_one_host(float r, float step) { return kvc_quantize_one(r, step); }
#endif
