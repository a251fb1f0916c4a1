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
// - kvc_encode_blocks, kvc_place_blocks, kvc_write_blocks and kvc_seal_chunks: with
//   kvc_rans_lane_encode after the first, the encode chain from K/V in memory to sealed chunk
//   bytes (see their sections below).

#include "kvc_crc.cuh"
#include "kvc_kernel.cuh"

// A phase copies its block's record (`const Kvc...Block b = a.blocks[...]`) rather than
// referring to it: a reference's fields are loaded again after every store the phase makes.

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

// Rows a channel's walk loads at once: their loads go out together, then their arithmetic runs
// (the walk would otherwise wait on every row's loads in turn).
#define KVC_QUANT_AHEAD 4u

// What a channel's walk loads for a non-sink row ahead of its arithmetic: its step multiplier,
// and a tag handed to the row's output with its symbol value (the encode chain's table-list
// index; 0 for kvc_quantize).
struct KvcRowStep {
    float mult;
    kvc_u32 tag;
};

// Quantizes one channel down a block's rows (codec_core's closed loop, §7), keeping the
// group's reconstructed anchor (as the decoder rebuilds it) in a register: `x(r)` is row r's
// value (sink rows first, kept as they are), `step(i)` non-sink row i's KvcRowStep, and
// `out(i, v, tag)` receives its symbol value. Every f32 operation is one rounded operation in
// codec-core's order.
template <class X, class M, class O>
__device__ __forceinline__ void kvc_quantize_channel(const KvcQuantConsts k, kvc_u32 rows,
                                                     kvc_u32 sink_rows, kvc_u32 group, X x,
                                                     M step_of, O out) {
    float anchor = 0.0f;
    for (kvc_u32 r0 = 0; r0 < rows; r0 += KVC_QUANT_AHEAD) {
        float v[KVC_QUANT_AHEAD], m[KVC_QUANT_AHEAD];
        kvc_u32 tag[KVC_QUANT_AHEAD];
        for (kvc_u32 j = 0; j < KVC_QUANT_AHEAD; j++) {
            const kvc_u32 r = r0 + j;
            v[j] = r < rows ? x(r) : 0.0f;
            const KvcRowStep st =
                r < rows && r >= sink_rows ? step_of(r - sink_rows) : KvcRowStep{1.0f, 0u};
            m[j] = st.mult;
            tag[j] = st.tag;
        }
        for (kvc_u32 j = 0; j < KVC_QUANT_AHEAD && r0 + j < rows; j++) {
            const kvc_u32 r = r0 + j;
            float recon = v[j];
            if (r >= sink_rows) {
                kvc_i32 s;
                if (r % group == 0) {
                    const float step = __fmul_rn(k.anchor_step, m[j]);
                    s = kvc_quantize_one(__fsub_rn(v[j], k.mean), step);
                    recon = __fadd_rn(k.mean, __fmul_rn((float)s, step));
                } else {
                    const float step = __fmul_rn(k.delta_step, m[j]);
                    const float pred =
                        __fadd_rn(k.mean, __fmul_rn(k.weight, __fsub_rn(anchor, k.mean)));
                    s = kvc_quantize_one(__fsub_rn(v[j], pred), step);
                    recon = __fadd_rn(pred, __fmul_rn((float)s, step));
                }
                out(r - sink_rows, s, tag[j]);
            }
            if (r % group == 0) anchor = recon;
        }
    }
}

// The only phase: check the block, then each thread quantizes its channels.
__device__ __forceinline__ void kvc_quantize_rows(const KvcQuantArgs& a, unsigned char*) {
    if (blockIdx.x >= a.n_blocks) return;
    const KvcQuantBlock b = a.blocks[blockIdx.x];
    const bool ok = kvc_quant_block_ok(a, b);
    if (threadIdx.x == 0) a.status[blockIdx.x] = ok ? KVC_ENCODE_OK : KVC_ENCODE_BAD_RANGE;
    if (!ok) return;
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    for (kvc_u64 ch = threadIdx.x; ch < c; ch += blockDim.x) {
        const kvc_u64 head = ch / a.head_dim;
        kvc_quantize_channel(
            a.consts[b.consts_start + ch], b.rows, b.sink_rows, b.group,
            [&](kvc_u32 r) { return a.x[b.x_start + (kvc_u64)r * c + ch]; },
            [&](kvc_u32 i) {
                const kvc_u64 at = b.exp_start + (kvc_u64)i * a.heads + head;
                return KvcRowStep{b.has_exps ? kvc_enc_exp_mult(a.exps[at]) : 1.0f, 0u};
            },
            [&](kvc_u32 i, kvc_i32 v, kvc_u32) { a.q[b.q_start + (kvc_u64)i * c + ch] = v; });
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
    // Every entry read before deciding (no early exit), so that the loads go out together.
    bool ok = true;
    for (kvc_u32 k = 0; k < b.table_count; k++) ok &= a.table_list[b.table_start + k] < a.n_tables;
    return ok;
}

// x / f, and x % f into *rem, for a lane state x and a frequency f >= 1 with x / f < 2^52 (the
// state after renormalisation: x < f * 2^52, or f >= 2^12), without the 64-bit division the
// device emulates: q = x * (1 / f) in f64 (x, 1 / f and the product each rounded once, so
// within 1.5 of x / f), truncated, is within 2 of the quotient, and the remainder's sign and
// size put it right. Exact: the same on the host and the device whatever the roundings.
__device__ __forceinline__ kvc_u64 kvc_lane_divmod(kvc_u64 x, kvc_u32 f, kvc_u64* rem) {
#ifdef KVC_HOST
    const double inv = 1.0 / (double)f;
#else
    const double inv = __drcp_rn((double)f);
#endif
    kvc_u64 q = (kvc_u64)((double)x * inv);
    long long r = (long long)(x - q * f);
    const long long d = (long long)f;
    if (r < 0) q--, r += d;
    if (r < 0) q--, r += d;
    if (r >= d) q++, r -= d;
    if (r >= d) q++, r -= d;
    *rem = (kvc_u64)r;
    return q;
}

// A lane's symbol on its way through the encoder's pipeline: its table index in the block's
// list and its value, then its table's id (`ok` false if the index is outside the list), then
// its table entry (0, a frequency the encoder refuses, if not ok).
struct KvcLaneSymbol {
    kvc_u32 index;
    kvc_u32 value;
    kvc_u32 id;
    bool ok;
};

// The only phase: lane threadIdx.x of the block encodes its symbols, last to first. A symbol's
// three dependent loads (table index and value, table id, table entry) are issued one step
// each, three and two and one steps before the step that encodes it, so that a step waits on
// none of them: the state's arithmetic alone is serial.
__device__ __forceinline__ void kvc_lane_encode(const KvcLaneEncodeArgs& a, unsigned char*) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x >= KVC_LANES) return;
    const KvcLaneEncodeBlock b = a.blocks[blockIdx.x];
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
    // Steps 0, 1, ..., n - 1 encode positions last, last - 32, ..., lane.
    const kvc_u32 n = lane < b.n_symbols ? (b.n_symbols - 1 - lane) / KVC_LANES + 1 : 0;
    const kvc_u32 last = lane + (n == 0 ? 0 : (n - 1) * KVC_LANES);
    const kvc_u8* values = a.symbols + b.symbol_start;
    const kvc_u16* indices = a.symbol_table + b.symbol_start;
    const kvc_u32* list = a.table_list + b.table_start;
    // Stage 1 of step k: its index and value.
    auto load = [&](kvc_u32 k, KvcLaneSymbol& y) {
        if (k >= n) return;
        y.index = indices[last - k * KVC_LANES];
        y.value = values[last - k * KVC_LANES];
    };
    // Stage 2: its table's id.
    auto resolve = [&](kvc_u32 k, KvcLaneSymbol& y) {
        y.ok = k < n && y.index < b.table_count;
        if (y.ok) y.id = list[y.index];
    };
    // Stage 3: its table entry.
    auto entry = [&](const KvcLaneSymbol& y) {
        return y.ok ? a.tables[(kvc_u64)y.id * 256u + y.value] : 0u;
    };
    KvcLaneSymbol s1 = {}, s2 = {}, s3 = {};
    load(0, s1);
    resolve(0, s1);
    load(1, s2);
    kvc_u32 e = entry(s1);
    resolve(1, s2);
    load(2, s3);
    for (kvc_u32 k = 0; k < n; k++) {
        // Loads for steps k + 1, k + 2, k + 3 go out before step k's arithmetic.
        const kvc_u32 e_next = entry(s2);
        resolve(k + 2, s3);
        s2 = s3;
        load(k + 3, s3);
        const kvc_u64 f = e & 0xFFFFu, cdf = e >> 16;
        if (f == 0) {
            status = KVC_ENCODE_BAD_SYMBOL;
            break;
        }
        if (x >= f << (64 - KVC_PRECISION)) {
            out[n_out++] = (kvc_u32)x;
            x >>= 32;
        }
        kvc_u64 rem;
        const kvc_u64 q = kvc_lane_divmod(x, (kvc_u32)f, &rem);
        x = (q << KVC_PRECISION) | (cdf + rem);
        e = e_next;
    }
    if (status == KVC_ENCODE_OK && x != 0) {
        out[n_out++] = (kvc_u32)x;
        if (x >> 32 != 0) out[n_out++] = (kvc_u32)(x >> 32);
    }
    a.lane_len[at] = n_out;
    a.status[at] = status;
}

KVC_KERNEL(kvc_rans_lane_encode, KvcLaneEncodeArgs, kvc_lane_encode)

// ----------------------------------------------------------------------------------------------
// The encode chain: a chunk's blocks from K/V where a server keeps them, with no host step
//
// kvc_encode_blocks prepares every coded block of a batch for kvc_rans_lane_encode, as
// codec_core's ChunkEncoder does (spec/FORMAT.md §6, §7, §9.2), from the tensors as they lie in
// memory (f32, f16 or bf16, [T, H, D] per layer and K/V): the layer's step exponents from its K
// (§9.2; keys stored before the rotary embedding rotated first), their table (codec_core's
// FreqTable::from_counts), the quantized values, each symbol's table and index with the
// escapes in order (§6.4), and the lane encoder's block record. Three launches (below) then
// lay the blocks out and seal the chunks. One CUDA block per coded block, of any number of
// threads from 16 (the host gives a thread per channel, up to 256: codec_cuda's
// channel_threads); the K and V blocks of a layer each compute its exponents.

// Element type of the source tensors.
enum KvcSourceDtype : kvc_u32 {
    KVC_SOURCE_F32 = 0,
    KVC_SOURCE_F16 = 1,
    KVC_SOURCE_BF16 = 2,
};

// One coded block of an encode-chain launch.
struct KvcEncBlock {
    // Element index in `src` of the block's row 0 (sink rows first), channel 0.
    kvc_u64 x_start;
    // Element index in `src` of the same rows of the layer's K (for the exponents).
    kvc_u64 k_start;
    // Index in `qref` of the layer's reference queries (C values), if importance.
    kvc_u64 qref_start;
    // Index in `tau` of the layer's head 0 threshold (H values), if importance.
    kvc_u64 tau_start;
    // Index in `consts` of channel 0's constants.
    kvc_u64 consts_start;
    // Index in `map` of the (layer, K/V, level)'s map (kvc_map_entry; its entries are >= 1).
    kvc_u64 map_start;
    // Index in `symbols` and `symbol_table` of the block's symbol 0: room for (rows - sink_rows)
    // * (H + C) symbols (the exponents, if any, then the values).
    kvc_u64 sym_start;
    // Index in `q` of the block's first value ((rows - sink_rows) * C, scratch).
    kvc_u64 q_start;
    // Index in `escapes` of the block's escape values (room for (rows - sink_rows) * C).
    kvc_u64 escape_start;
    // Index of lane 0's slot in the lane encoder's words (copied to its block record).
    kvc_u64 word_start;
    // Index in `rot` of non-sink row 0's rotary pair 0 (sine, cosine), if rotate.
    kvc_u64 rot_start;
    kvc_u32 rows;
    kvc_u32 sink_rows;
    kvc_u32 group;
    // 1: step exponents from the importance policy; 0: none.
    kvc_u32 importance;
    // The block's table list: table_list[table_start] is the slot of `tables` the kernel
    // writes the exponent table to, the entries after it the level's value tables.
    kvc_u32 table_start;
    kvc_u32 table_count;
    // Words per lane slot (ceil((rows - sink_rows) * (H + C) / 32) + 2 at least).
    kvc_u32 lane_cap;
    // 1: K is stored before the rotary embedding; the exponents score it rotated to each row's
    // position, by the sines and cosines in `rot` (codec_core::rope::rotate's).
    kvc_u32 rotate;
    // The chunk the block belongs to (kvc_place_blocks checks it).
    kvc_u32 chunk;
    kvc_u32 reserved;
};

// What the kernel found per block, for the host's layout.
struct KvcEncResult {
    kvc_u32 status;
    // Exponent symbols coded before the values: (rows - sink_rows) * H, or 0.
    kvc_u32 n_e;
    kvc_u32 n_escapes;
    // The exponent table's symbols (0: no exponent section) and frequencies.
    kvc_u32 n_exp;
    kvc_u16 exp_freqs[16];
};

struct KvcEncodeArgs {
    // The source tensors, `n_src` elements of `dtype`.
    const kvc_u8* src;
    kvc_u64 n_src;
    kvc_u32 dtype;
    // Importance policy (§9.2): e = round(slope * (tau - score)) clamped to [0, max_exp].
    kvc_u32 max_exp;
    double slope;
    // 1 / sqrt(head_dim), as the host computes it.
    double inv_sqrt_d;
    const double* qref;
    kvc_u64 n_qref;
    const float* tau;
    kvc_u64 n_tau;
    // Per row of a rotated block, per rotary pair: its sine and cosine (head_dim values a row).
    const double* rot;
    kvc_u64 n_rot;
    const KvcQuantConsts* consts;
    kvc_u64 n_consts;
    const kvc_u16* map;
    kvc_u64 n_map;
    const kvc_u32* table_list;
    kvc_u64 n_table_list;
    // Per global table id, its radius (escape index 2R + 1); the exponent slots' are unused.
    const kvc_u8* radius;
    kvc_u64 n_radius;
    // Encode tables, 256 entries each (as kvc_rans_lane_encode reads them).
    kvc_u32* tables;
    kvc_u64 n_tables;
    kvc_u8* symbols;
    kvc_u16* symbol_table;
    kvc_u64 n_symbols;
    kvc_i32* q;
    kvc_u64 n_q;
    kvc_i32* escapes;
    kvc_u64 n_escapes;
    const KvcEncBlock* blocks;
    // Outputs, one per block.
    KvcEncResult* results;
    KvcLaneEncodeBlock* lane_blocks;
    kvc_u64 n_blocks;
    kvc_u32 heads;
    kvc_u32 head_dim;
    // Rotary pairing of rotated blocks: 1 NeoX (j, j + D/2), 2 GPT-J (2j, 2j + 1).
    kvc_u32 rope_style;
    kvc_u32 reserved;
};

// Escape ranks by tiles, as kvc_map_values decodes them (chain.cu).
#define KVC_ENC_TILES 4096u
// Table-list entries whose radius a block keeps in shared memory (the fixture's levels have
// 36-45 tables).
#define KVC_ENC_LIST 256u

struct KvcEncShared {
    kvc_u32 status;
    kvc_u32 tile_shift;
    kvc_u32 bad;
    kvc_u32 n_e;
    kvc_u32 n_exp;
    kvc_u32 n_escapes;
    kvc_u32 hist[16];
    kvc_u16 freqs[16];
    kvc_u32 tile[KVC_ENC_TILES];
    // Per thread: its share of the tiles' escapes, then their first rank (kvc_scan_part).
    kvc_u32 part[KVC_SCAN_THREADS];
    // Per list index below KVC_ENC_LIST: its table's radius (0xFF if outside the list).
    kvc_u8 radius[KVC_ENC_LIST];
};

#ifdef KVC_HOST
inline double kvc_round(double x) { return round(x); }
#else
__device__ __forceinline__ double kvc_round(double x) { return round(x); }
#endif

// Element i of the source, widened to f32 (exact).
__device__ __forceinline__ float kvc_src_load(const KvcEncodeArgs& a, kvc_u64 i) {
    if (a.dtype == KVC_SOURCE_F32) {
        kvc_u32 u;
#ifdef KVC_HOST
        memcpy(&u, a.src + i * 4, 4);
#else
        u = ((const kvc_u32*)a.src)[i];
#endif
        return kvc_bits_f32(u);
    }
#ifdef KVC_HOST
    kvc_u16 h;
    memcpy(&h, a.src + i * 2, 2);
#else
    const kvc_u16 h = ((const kvc_u16*)a.src)[i];
#endif
    if (a.dtype == KVC_SOURCE_BF16) return kvc_bits_f32((kvc_u32)h << 16);
    // f16: sign, exponent 5 bits, mantissa 10 bits.
    const kvc_u32 sign = (kvc_u32)(h & 0x8000u) << 16;
    const kvc_u32 e = (h >> 10) & 31u, m = h & 0x3FFu;
    if (e == 31) return kvc_bits_f32(sign | 0x7F800000u | (m << 13));
    if (e != 0) return kvc_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return kvc_bits_f32(sign);
    // Subnormal: m * 2^-24, exact in f32.
    const float v = __fmul_rn((float)m, 5.9604644775390625e-8f);
    return sign ? -v : v;
}

__device__ __forceinline__ bool kvc_enc_ok(const KvcEncodeArgs& a, const KvcEncBlock& b) {
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    if (a.dtype > KVC_SOURCE_BF16 || c == 0 || c > 0xFFFFFFFFull || b.group == 0 ||
        b.sink_rows > b.rows)
        return false;
    const kvc_u64 coded = b.rows - b.sink_rows, rc = (kvc_u64)b.rows * c, n_sym = coded * c;
    const kvc_u64 n_all = coded * a.heads + n_sym;
    if (n_all > 0xFFFFFFFFull || a.n_src > ~0ull / 4) return false;
    const kvc_u64 need = (n_all + KVC_LANES - 1) / KVC_LANES + 2;
    bool ok = b.x_start <= a.n_src && rc <= a.n_src - b.x_start && b.lane_cap >= need &&
              b.consts_start <= a.n_consts && c <= a.n_consts - b.consts_start &&
              b.map_start <= a.n_map && 32 * c <= a.n_map - b.map_start &&
              b.sym_start <= a.n_symbols && n_all <= a.n_symbols - b.sym_start &&
              b.q_start <= a.n_q && n_sym <= a.n_q - b.q_start &&
              b.escape_start <= a.n_escapes && n_sym <= a.n_escapes - b.escape_start &&
              b.table_count >= 2 && (kvc_u64)b.table_start + b.table_count <= a.n_table_list;
    if (ok && b.importance) {
        ok = a.max_exp <= 15 && b.k_start <= a.n_src && rc <= a.n_src - b.k_start &&
             b.qref_start <= a.n_qref && c <= a.n_qref - b.qref_start &&
             b.tau_start <= a.n_tau && a.heads <= a.n_tau - b.tau_start;
    }
    if (ok && b.importance && b.rotate) {
        ok = (a.rope_style == 1 || a.rope_style == 2) && a.head_dim % 2 == 0 &&
             b.rot_start <= a.n_rot && coded * a.head_dim <= a.n_rot - b.rot_start;
    }
    // The table list's range checked above: every entry read before deciding (no early exit),
    // so that the loads go out together.
    const kvc_u32 count = ok ? b.table_count : 0;
    for (kvc_u32 k = 0; k < count; k++) {
        const kvc_u32 t = a.table_list[b.table_start + k];
        ok &= k == 0 ? t < a.n_tables : t < a.n_radius && t < a.n_tables && a.radius[t] <= 127;
    }
    return ok;
}

// Phase 1: thread 0 checks the block and sizes the tiles; every thread clears the counts.
__device__ __forceinline__ void kvc_enc_check(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    for (kvc_u32 i = threadIdx.x; i < KVC_ENC_TILES; i += blockDim.x) s->tile[i] = 0;
    if (threadIdx.x < 16) s->hist[threadIdx.x] = 0;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    for (kvc_u32 k = threadIdx.x; k < KVC_ENC_LIST; k += blockDim.x) {
        kvc_u32 r = 0xFF;
        if (k > 0 && k < b.table_count && (kvc_u64)b.table_start + k < a.n_table_list) {
            const kvc_u32 t = a.table_list[b.table_start + k];
            if (t < a.n_radius) r = a.radius[t];
        }
        s->radius[k] = (kvc_u8)r;
    }
    if (threadIdx.x != 0) return;
    s->status = kvc_enc_ok(a, b) ? KVC_ENCODE_OK : KVC_ENCODE_BAD_RANGE;
    const kvc_u64 n_sym = (kvc_u64)(b.rows - (b.sink_rows <= b.rows ? b.sink_rows : b.rows)) *
                          a.heads * a.head_dim;
    kvc_u32 shift = 5;
    while (shift < 32 && ((kvc_u64)KVC_ENC_TILES << shift) < n_sym) shift++;
    s->tile_shift = shift;
    s->bad = 0;
    s->n_escapes = 0;
}

// Channel j of row i's head at `row`, widened to f64 and, if the block is rotated, rotated as
// codec_core::rope::rotate does: channel a of pair (a, b) becomes x_a c - x_b s, channel b
// x_b c + x_a s.
__device__ __forceinline__ double kvc_enc_key(const KvcEncodeArgs& a, const KvcEncBlock& b,
                                              kvc_u64 row, kvc_u32 i, kvc_u32 j) {
    const double x = (double)kvc_src_load(a, row + j);
    if (!b.rotate) return x;
    const kvc_u32 half = a.head_dim / 2;
    bool first;
    kvc_u32 pair, other;
    if (a.rope_style == 1) {
        first = j < half;
        pair = first ? j : j - half;
        other = first ? j + half : j - half;
    } else {
        first = (j & 1u) == 0;
        pair = j >> 1;
        other = first ? j + 1 : j - 1;
    }
    const double* sc = a.rot + b.rot_start + ((kvc_u64)i * half + pair) * 2;
    const double y = (double)kvc_src_load(a, row + other);
    return first ? __dsub_rn(__dmul_rn(x, sc[1]), __dmul_rn(y, sc[0]))
                 : __dadd_rn(__dmul_rn(x, sc[1]), __dmul_rn(y, sc[0]));
}

// Phase 2: each (non-sink row, head)'s step exponent (codec_core's block_exponents, in f64
// in its order), written as the block's first symbols and counted.
__device__ __forceinline__ void kvc_enc_exponents(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    if (s->status != KVC_ENCODE_OK || !b.importance) return;
    const kvc_u32 c = a.heads * a.head_dim, n = (b.rows - b.sink_rows) * a.heads;
    for (kvc_u32 p = threadIdx.x; p < n; p += blockDim.x) {
        const kvc_u32 i = p / a.heads, h = p - i * a.heads;
        const kvc_u64 row = b.k_start + (kvc_u64)(b.sink_rows + i) * c + h * a.head_dim;
        const double* q = a.qref + b.qref_start + h * a.head_dim;
        double acc = 0.0;
        for (kvc_u32 j = 0; j < a.head_dim; j++)
            acc = __dadd_rn(acc, __dmul_rn(q[j], kvc_enc_key(a, b, row, i, j)));
        const double score = __dmul_rn(acc, a.inv_sqrt_d);
        const double t = (double)a.tau[b.tau_start + h];
        const double e = kvc_round(__dmul_rn(a.slope, __dsub_rn(t, score)));
        // Rust's `e.clamp(0, max) as u8`: NaN gives 0.
        const kvc_u32 v = e > 0.0 ? (e < (double)a.max_exp ? (kvc_u32)e : a.max_exp) : 0u;
        a.symbols[b.sym_start + p] = (kvc_u8)v;
        atomicAdd(&s->hist[v], 1u);
    }
}

// codec_core's FreqTable::from_counts for counts[0..n] (2 <= n <= 16, each below 2^32): the same
// first guess, then the same seats added and exchanged (u64 products: counts < 2^32, seats
// <= 4096).
__device__ __forceinline__ void kvc_freqs_from_counts(const kvc_u32* counts, kvc_u32 n,
                                                      kvc_u16* out) {
    kvc_u64 c[16], total = 0;
    bool all_zero = true;
    for (kvc_u32 s = 0; s < n; s++) all_zero = all_zero && counts[s] == 0;
    for (kvc_u32 s = 0; s < n; s++) {
        c[s] = all_zero ? 1 : counts[s];
        total += c[s];
    }
    const kvc_u64 budget = KVC_SLOTS - n;
    kvc_u32 f[16], sum = 0;
    for (kvc_u32 s = 0; s < n; s++) {
        f[s] = 1 + (kvc_u32)(c[s] * budget / total);
        sum += f[s];
    }
    // Seat (s, k) comes before seat (t, m): priority c / (2k - 1) descending, then s, then k.
    auto before = [&](kvc_u32 s, kvc_u32 k, kvc_u32 t, kvc_u32 m) {
        const kvc_u64 lhs = c[s] * (2ull * m - 1), rhs = c[t] * (2ull * k - 1);
        return lhs > rhs || (lhs == rhs && (s < t || (s == t && k < m)));
    };
    for (;;) {
        kvc_u32 add = 0;
        for (kvc_u32 s = 1; s < n; s++)
            if (before(s, f[s] + 1, add, f[add] + 1)) add = s;
        if (sum < KVC_SLOTS) {
            f[add]++;
            sum++;
            continue;
        }
        kvc_u32 worst = 16;
        for (kvc_u32 s = 0; s < n; s++) {
            if (f[s] > 1 && !(worst < 16 && before(s, f[s], worst, f[worst]))) worst = s;
        }
        if (worst < 16 && before(add, f[add] + 1, worst, f[worst])) {
            f[add]++;
            f[worst]--;
        } else {
            break;
        }
    }
    for (kvc_u32 s = 0; s < n; s++) out[s] = (kvc_u16)f[s];
}

// Phase 3 (thread 0): the exponent alphabet and table (none if every exponent is 0, as
// codec_core drops such exponents), written to the block's exponent slot in encode form.
__device__ __forceinline__ void kvc_enc_exp_table(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    s->n_e = 0;
    s->n_exp = 0;
    if (s->status != KVC_ENCODE_OK) return;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    kvc_u32 n_exp = 0;
    for (kvc_u32 e = 0; e < 16; e++)
        if (s->hist[e] != 0) n_exp = e + 1;
    if (!b.importance || n_exp < 2) return;
    kvc_freqs_from_counts(s->hist, n_exp, s->freqs);
    kvc_u32* t = a.tables + (kvc_u64)a.table_list[b.table_start] * 256u;
    kvc_u32 cdf = 0;
    for (kvc_u32 e = 0; e < 256; e++) {
        t[e] = e < n_exp ? s->freqs[e] | cdf << 16 : 0u;
        if (e < n_exp) cdf += s->freqs[e];
    }
    s->n_exp = n_exp;
    s->n_e = (b.rows - b.sink_rows) * a.heads;
}

// Value symbol (i, ch)'s table-list index: its row kind, its channel and its head's exponent
// `e` through the map.
__device__ __forceinline__ kvc_u32 kvc_enc_list_index(const KvcEncodeArgs& a,
                                                      const KvcEncBlock& b, kvc_u32 i,
                                                      kvc_u32 ch, kvc_u32 e) {
    const kvc_u32 c = a.heads * a.head_dim;
    const kvc_u32 kind = (b.sink_rows + i) % b.group != 0;
    return a.map[b.map_start + kvc_map_entry(c, kind, e, ch)];
}

// The radius of list index li's table (of a block whose list kvc_enc_ok checked); -1 for an
// index outside the block's list.
__device__ __forceinline__ int kvc_enc_radius(const KvcEncodeArgs& a, const KvcEncBlock& b,
                                              const KvcEncShared* s, kvc_u32 li) {
    if (li == 0 || li >= b.table_count) return -1;
    if (li < KVC_ENC_LIST) return s->radius[li];
    return a.radius[a.table_list[b.table_start + li]];
}

__device__ __forceinline__ bool kvc_enc_escapes(kvc_i32 v, int r) {
    const kvc_u32 m = v < 0 ? 0u - (kvc_u32)v : (kvc_u32)v;
    return m > (kvc_u32)r;
}

// Phase 4: each thread quantizes its channels down the rows (as kvc_quantize), with the
// exponents phase 2 wrote, and maps each value as it is made, in place of a pass over the
// values in memory: its table-list index (loaded with the row's exponent, ahead of the
// arithmetic) and table index (value + R, or the escape index 2R + 1 with the escape counted
// in its tile and its value kept in `q` for phase 8, the only values stored); the exponents'
// table-list index (0) first.
__device__ __forceinline__ void kvc_enc_quantize(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    if (s->status != KVC_ENCODE_OK) return;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    const kvc_u32 c = a.heads * a.head_dim, n_e = s->n_e, shift = s->tile_shift;
    for (kvc_u32 p = threadIdx.x; p < n_e; p += blockDim.x) a.symbol_table[b.sym_start + p] = 0;
    const kvc_u8* exps = a.symbols + b.sym_start;
    for (kvc_u32 ch = threadIdx.x; ch < c; ch += blockDim.x) {
        const kvc_u32 head = ch / a.head_dim;
        kvc_quantize_channel(
            a.consts[b.consts_start + ch], b.rows, b.sink_rows, b.group,
            [&](kvc_u32 r) { return kvc_src_load(a, b.x_start + (kvc_u64)r * c + ch); },
            [&](kvc_u32 i) {
                const kvc_u32 e = n_e ? exps[(kvc_u64)i * a.heads + head] : 0u;
                // The index masked: on the device another (malformed) block may overwrite
                // these bytes meanwhile.
                const kvc_u32 li = kvc_enc_list_index(a, b, i, ch, e & 15u);
                return KvcRowStep{n_e ? kvc_enc_exp_mult(e) : 1.0f, li};
            },
            [&](kvc_u32 i, kvc_i32 v, kvc_u32 li) {
                const kvc_u64 g = (kvc_u64)i * c + ch, at = b.sym_start + n_e + g;
                const int r = kvc_enc_radius(a, b, s, li);
                a.symbol_table[at] = (kvc_u16)li;
                if (r < 0) {
                    s->bad = 1;
                } else if (kvc_enc_escapes(v, r)) {
                    a.symbols[at] = (kvc_u8)(2 * r + 1);
                    a.q[b.q_start + g] = v;
                    atomicAdd(&s->tile[g >> shift], 1u);
                } else {
                    a.symbols[at] = (kvc_u8)(v + r);
                }
            });
    }
}

// The block's tiles (a block kvc_enc_check sized).
__device__ __forceinline__ kvc_u32 kvc_enc_tiles(const KvcEncodeArgs& a, const KvcEncBlock& b,
                                                 kvc_u32 shift) {
    const kvc_u64 n_sym = (kvc_u64)(b.rows - b.sink_rows) * a.heads * a.head_dim;
    const kvc_u64 all = (n_sym + (1ull << shift) - 1) >> shift;
    return all < KVC_ENC_TILES ? (kvc_u32)all : KVC_ENC_TILES;
}

// Phase 5: each thread's share of the tiles' escapes (kvc_scan_part).
__device__ __forceinline__ void kvc_enc_rank_parts(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    if (s->status != KVC_ENCODE_OK || s->bad) return;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    kvc_scan_part(s->tile, kvc_enc_tiles(a, b, s->tile_shift), s->part);
}

// Phase 6 (thread 0): the shares' first ranks, the block's escapes.
__device__ __forceinline__ void kvc_enc_offsets(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    if (s->status != KVC_ENCODE_OK) return;
    if (s->bad) {
        s->status = KVC_ENCODE_BAD_SYMBOL;
        return;
    }
    s->n_escapes = kvc_scan_starts(s->part);
}

// Phase 7: each tile's first escape rank.
__device__ __forceinline__ void kvc_enc_rank_write(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcEncShared* s = (KvcEncShared*)shared;
    if (s->status != KVC_ENCODE_OK) return;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    kvc_scan_write(s->tile, kvc_enc_tiles(a, b, s->tile_shift), s->part);
}

// Phase 8: each escape's value at its rank, the threads striding over the tiles: a tile holding
// escapes (its first rank below the next tile's) is scanned in order by one thread, which ranks
// its escapes one after another; tiles without escapes are not read again.
__device__ __forceinline__ void kvc_enc_escape_values(const KvcEncodeArgs& a,
                                                      unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    const KvcEncShared* s = (const KvcEncShared*)shared;
    if (s->status != KVC_ENCODE_OK) return;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    const kvc_u32 n_e = s->n_e, n_sym = (b.rows - b.sink_rows) * a.heads * a.head_dim;
    const kvc_u8* idx = a.symbols + b.sym_start + n_e;
    const kvc_u16* li = a.symbol_table + b.sym_start + n_e;
    const kvc_u32 shift = s->tile_shift, tiles = kvc_enc_tiles(a, b, shift);
    for (kvc_u32 tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
        kvc_u32 rank = s->tile[tile];
        const kvc_u32 end = tile + 1 < tiles ? s->tile[tile + 1] : s->n_escapes;
        const kvc_u64 last = (kvc_u64)(tile + 1) << shift;
        const kvc_u32 stop = last < n_sym ? (kvc_u32)last : n_sym;
        for (kvc_u32 g = tile << shift; g < stop && rank < end; g++) {
            if (idx[g] != 2 * kvc_enc_radius(a, b, s, li[g]) + 1) continue;
            // rank < end <= n_escapes <= n_sym, unless another (malformed) block rewrote this
            // one's symbols meanwhile: checked.
            if (rank < n_sym) a.escapes[b.escape_start + rank] = a.q[b.q_start + g];
            rank++;
        }
    }
}

// Phase 9 (thread 0): the block's result and its lane-encode record (an empty record, which
// the lane encoder reports as a bad range, for a failed block).
__device__ __forceinline__ void kvc_enc_finish(const KvcEncodeArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    const KvcEncShared* s = (const KvcEncShared*)shared;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    KvcEncResult r;
    r.status = s->status;
    r.n_e = s->n_e;
    r.n_escapes = s->n_escapes;
    r.n_exp = s->n_exp;
    for (kvc_u32 e = 0; e < 16; e++) r.exp_freqs[e] = e < s->n_exp ? s->freqs[e] : 0;
    a.results[blockIdx.x] = r;
    KvcLaneEncodeBlock l;
    const bool ok = s->status == KVC_ENCODE_OK;
    l.symbol_start = b.sym_start;
    l.word_start = b.word_start;
    l.n_symbols = ok ? s->n_e + (b.rows - b.sink_rows) * a.heads * a.head_dim : 0;
    l.lane_cap = ok ? b.lane_cap : 0;
    l.table_start = b.table_start;
    l.table_count = ok ? b.table_count : 0;
    a.lane_blocks[blockIdx.x] = l;
}

// Dynamic shared memory: sizeof(KvcEncShared).
KVC_KERNEL(kvc_encode_blocks, KvcEncodeArgs, kvc_enc_check, kvc_enc_exponents, kvc_enc_exp_table,
           kvc_enc_quantize, kvc_enc_rank_parts, kvc_enc_offsets, kvc_enc_rank_write,
           kvc_enc_escape_values, kvc_enc_finish)

// ----------------------------------------------------------------------------------------------
// The chunks' bytes (spec/FORMAT.md §5.2), after the two launches above
//
// Three launches lay the blocks out and seal the chunks into `sealed`, packed one after another
// (a chunk's body, then its CRC-32C, little-endian; a chunk that did not end well takes no
// room), so that the host copies a batch back in one transfer and checks nothing byte by byte:
// - kvc_place_blocks, one CUDA block per chunk: each block's size (codec_core's write_block
//   layout: n_escapes, the 32 lane lengths, n_exp and the exponent table, the sink rows' stored
//   bytes, the escape values, the lane words), its offset in the chunk, the chunk's length and
//   status;
// - kvc_write_blocks, one CUDA block per coded block: the block's bytes at their place, the
//   threads writing consecutive bytes (coalesced), and the block's share of the chunk's CRC
//   (its stretches' registers carried to the chunk's end, kvc_crc.cuh) XORed into the chunk's
//   result;
// - kvc_seal_chunks, one CUDA block per chunk: the CRC after the body, and where it lies.
// A chunk's place is the sum of the sealed sizes of the chunks before it, which every CUDA block
// that needs it sums with its threads (kvc_before_part, kvc_before_sum).

// Blocks of one chunk at most (2 * codec_core's max_layers).
#define KVC_CHUNK_BLOCKS 2048u

struct KvcChunkOut {
    // Index in the encode-chain launch's blocks of the chunk's first block.
    kvc_u64 first_block;
    // Bytes the chunk's body may take (its blocks at their largest).
    kvc_u64 cap;
    kvc_u32 n_blocks;
    kvc_u32 reserved;
};

// Per chunk, from kvc_place_blocks: its status and body length (without the CRC); the XOR of
// its blocks' CRC shares (from 0, by kvc_write_blocks).
struct KvcChunkResult {
    kvc_u64 len;
    kvc_u32 status;
    kvc_u32 crc;
};

// Per chunk: where its sealed bytes lie in `sealed` and how many (body and CRC; 0 if the
// chunk is not sealed), and its status.
struct KvcSealResult {
    kvc_u64 start;
    kvc_u64 len;
    kvc_u32 status;
    kvc_u32 reserved;
};

// The three launches' arguments.
struct KvcWriteArgs {
    const kvc_u8* src;
    kvc_u64 n_src_bytes;
    // Bytes per source element (4 or 2).
    kvc_u32 elem_bytes;
    kvc_u32 heads;
    kvc_u32 head_dim;
    kvc_u32 reserved;
    // The encode chain's blocks and results, the lane encoder's outputs.
    const KvcEncBlock* blocks;
    const KvcEncResult* results;
    kvc_u64 n_blocks;
    const kvc_i32* escapes;
    kvc_u64 n_escapes;
    const kvc_u32* words;
    kvc_u64 n_words;
    // Per (block, lane): words written and status.
    const kvc_u32* lane_len;
    const kvc_u32* lane_status;
    // Per block: its first byte in its chunk's body (kvc_place_blocks).
    kvc_u64* block_at;
    const KvcChunkOut* chunks;
    KvcChunkResult* chunk_results;
    kvc_u64 n_chunks;
    kvc_u8* sealed;
    kvc_u64 n_sealed;
    KvcSealResult* seal_results;
};

__device__ __forceinline__ kvc_u8 kvc_byte_of(kvc_u32 v, kvc_u64 k) {
    return (kvc_u8)(v >> (8 * (k & 3)));
}

__device__ __forceinline__ void kvc_put_u32(kvc_u8* p, kvc_u32 v) {
    for (kvc_u32 k = 0; k < 4; k++) p[k] = kvc_byte_of(v, k);
}

// Block i's sink bytes.
__device__ __forceinline__ kvc_u64 kvc_sink_bytes(const KvcWriteArgs& a, const KvcEncBlock& b) {
    return (kvc_u64)b.sink_rows * a.heads * a.head_dim * a.elem_bytes;
}

// Bytes before a block's sink rows: n_escapes, the lane lengths, n_exp, the exponent table.
__device__ __forceinline__ kvc_u64 kvc_fields_bytes(kvc_u32 n_exp) {
    return 4 + 4 * KVC_LANES + 1 + 2 * (kvc_u64)n_exp;
}

// Whether block i's parts lie inside the buffers and every stage ended well; its size if so.
// Reads every lane before deciding (no early exit), so that the loads go out together.
__device__ __forceinline__ bool kvc_block_size(const KvcWriteArgs& a, kvc_u64 i, kvc_u64* size) {
    const KvcEncBlock& b = a.blocks[i];
    const KvcEncResult& r = a.results[i];
    kvc_u64 words = 0;
    bool ok = r.status == KVC_ENCODE_OK && r.n_exp <= 16 && r.n_exp != 1;
    for (kvc_u32 l = 0; l < KVC_LANES; l++) {
        const kvc_u32 n = a.lane_len[i * KVC_LANES + l];
        ok = ok && a.lane_status[i * KVC_LANES + l] == KVC_ENCODE_OK && n <= b.lane_cap;
        words += n;
    }
    const kvc_u64 c = (kvc_u64)a.heads * a.head_dim;
    if (!ok || c > 0xFFFFFFFFull || (b.sink_rows != 0 && c > (~0ull / 4) / b.sink_rows))
        return false;
    const kvc_u64 sink = kvc_sink_bytes(a, b);
    const kvc_u64 x = b.x_start * a.elem_bytes;
    const kvc_u64 slots = (kvc_u64)b.lane_cap * KVC_LANES;
    if (b.x_start > a.n_src_bytes / a.elem_bytes || sink > a.n_src_bytes - x) return false;
    if (b.escape_start > a.n_escapes || r.n_escapes > a.n_escapes - b.escape_start) return false;
    if (b.word_start > a.n_words || slots > a.n_words - b.word_start) return false;
    *size = kvc_fields_bytes(r.n_exp) + sink + 4 * (kvc_u64)r.n_escapes + 4 * words;
    return true;
}

// Whether chunk c's records are within the launch (its blocks inside the batch).
__device__ __forceinline__ bool kvc_chunk_ok(const KvcWriteArgs& a, kvc_u64 c) {
    const KvcChunkOut& ch = a.chunks[c];
    return (a.elem_bytes == 2 || a.elem_bytes == 4) && ch.n_blocks <= KVC_CHUNK_BLOCKS &&
           ch.first_block <= a.n_blocks && ch.n_blocks <= a.n_blocks - ch.first_block;
}

// The bytes chunk c takes in `sealed`: its body and CRC if it ended well within its room.
__device__ __forceinline__ kvc_u64 kvc_sealed_size(const KvcWriteArgs& a, kvc_u64 c) {
    const KvcChunkResult& r = a.chunk_results[c];
    const bool ok = r.status == KVC_ENCODE_OK && r.len <= a.chunks[c].cap && a.n_sealed >= 4 &&
                    r.len <= a.n_sealed - 4;
    return ok ? r.len + 4 : 0;
}

// Each thread's (saturating) sum of the sealed sizes of a share of the chunks before chunk c
// into before[t] (KVC_CRC_THREADS of them).
__device__ __forceinline__ void kvc_before_part(const KvcWriteArgs& a, kvc_u64 c,
                                                kvc_u64* before) {
    const kvc_u32 t = threadIdx.x, nt = kvc_crc_threads();
    if (t >= nt) return;
    kvc_u64 sum = 0;
    for (kvc_u64 e = t; e < c; e += nt) {
        const kvc_u64 next = sum + kvc_sealed_size(a, e);
        sum = next < sum ? ~0ull : next;
    }
    before[t] = sum;
}

// After kvc_before_part's phase: where chunk c's sealed bytes start (~0 on overflow).
__device__ __forceinline__ kvc_u64 kvc_before_sum(const kvc_u64* before) {
    kvc_u64 start = 0;
    for (kvc_u32 t = 0; t < kvc_crc_threads(); t++) {
        const kvc_u64 sum = start + before[t];
        start = sum < start ? ~0ull : sum;
    }
    return start;
}

// ---- kvc_place_blocks

struct KvcPlaceShared {
    // Per block of the chunk: its size, or ~0 if it did not end well or is not the chunk's.
    kvc_u64 size[KVC_CHUNK_BLOCKS];
};

// Phase 1: each block's size, a thread per block.
__device__ __forceinline__ void kvc_place_sizes(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_chunks || !kvc_chunk_ok(a, blockIdx.x)) return;
    KvcPlaceShared* s = (KvcPlaceShared*)shared;
    const KvcChunkOut& c = a.chunks[blockIdx.x];
    for (kvc_u32 k = threadIdx.x; k < c.n_blocks; k += blockDim.x) {
        const kvc_u64 i = c.first_block + k;
        kvc_u64 size = ~0ull;
        if (!kvc_block_size(a, i, &size) || a.blocks[i].chunk != blockIdx.x) size = ~0ull;
        s->size[k] = size;
    }
}

// Phase 2 (thread 0): each block's offset in the chunk, and the chunk's length and status.
__device__ __forceinline__ void kvc_place_offsets(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_chunks || threadIdx.x != 0) return;
    const KvcPlaceShared* s = (const KvcPlaceShared*)shared;
    KvcChunkResult r;
    r.len = 0;
    r.status = KVC_ENCODE_BAD_RANGE;
    r.crc = 0;
    if (kvc_chunk_ok(a, blockIdx.x)) {
        const KvcChunkOut& c = a.chunks[blockIdx.x];
        kvc_u64 at = 0;
        kvc_u32 k = 0;
        for (; k < c.n_blocks; k++) {
            const kvc_u64 size = s->size[k];
            if (size == ~0ull || size > c.cap || at > c.cap - size) break;
            a.block_at[c.first_block + k] = at;
            at += size;
        }
        if (k == c.n_blocks) {
            r.len = at;
            r.status = KVC_ENCODE_OK;
        }
    }
    a.chunk_results[blockIdx.x] = r;
}

// Dynamic shared memory: sizeof(KvcPlaceShared).
KVC_KERNEL(kvc_place_blocks, KvcWriteArgs, kvc_place_sizes, kvc_place_offsets)

// ---- kvc_write_blocks

struct KvcBlockShared {
    // KVC_ENCODE_OK if the block is to be written.
    kvc_u32 status;
    // The XOR of the threads' CRC shares.
    kvc_u32 crc;
    // The block's chunk, where its chunk's body starts in `sealed` and its length, the block's
    // first byte in `sealed` and its size.
    kvc_u64 chunk;
    kvc_u64 start;
    kvc_u64 len;
    kvc_u64 at;
    kvc_u64 size;
    // Bytes before the lane words: the fields, sink rows and escape values.
    kvc_u64 head;
    kvc_u64 sink;
    KvcEncResult r;
    // Per lane its length, and the words of the lanes before it (33 entries).
    kvc_u32 lane_len[KVC_LANES];
    kvc_u32 lane_first[KVC_LANES + 1];
    kvc_u32 table[256];
    kvc_u64 before[KVC_CRC_THREADS];
};

// Phase 1: the CRC table, the lane lengths; thread 0 finds the block's chunk.
__device__ __forceinline__ void kvc_wb_begin(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcBlockShared* s = (KvcBlockShared*)shared;
    kvc_crc_table(s->table);
    const kvc_u64 i = blockIdx.x;
    if (threadIdx.x < KVC_LANES) s->lane_len[threadIdx.x] = a.lane_len[i * KVC_LANES + threadIdx.x];
    if (threadIdx.x != 0) return;
    const kvc_u64 c = a.blocks[i].chunk;
    bool ok = c < a.n_chunks && kvc_chunk_ok(a, c);
    if (ok) {
        const KvcChunkOut& ch = a.chunks[c];
        ok = i >= ch.first_block && i - ch.first_block < ch.n_blocks &&
             kvc_sealed_size(a, c) != 0;
    }
    s->status = ok ? KVC_ENCODE_OK : KVC_ENCODE_BAD_RANGE;
    s->chunk = ok ? c : 0;
    s->crc = 0;
}

// Phase 2: the threads' shares of the sealed sizes before the chunk.
__device__ __forceinline__ void kvc_wb_before(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcBlockShared* s = (KvcBlockShared*)shared;
    if (s->status == KVC_ENCODE_OK) kvc_before_part(a, s->chunk, s->before);
}

// Phase 3 (thread 0): the block's place in `sealed` (inside its chunk's body, which lies
// inside `sealed`) and its parts.
__device__ __forceinline__ void kvc_wb_place(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    KvcBlockShared* s = (KvcBlockShared*)shared;
    if (s->status != KVC_ENCODE_OK) return;
    s->status = KVC_ENCODE_BAD_RANGE;
    const kvc_u64 i = blockIdx.x, start = kvc_before_sum(s->before);
    const kvc_u64 len = a.chunk_results[s->chunk].len, off = a.block_at[i];
    kvc_u64 size;
    if (!kvc_block_size(a, i, &size) || off > len || size > len - off) return;
    if (start > a.n_sealed || len + 4 > a.n_sealed - start) return;
    const KvcEncResult r = a.results[i];
    kvc_u32 words = 0;
    for (kvc_u32 l = 0; l < KVC_LANES; l++) {
        s->lane_first[l] = words;
        words += s->lane_len[l];
    }
    s->lane_first[KVC_LANES] = words;
    s->r = r;
    s->start = start;
    s->len = len;
    s->at = start + off;
    s->size = size;
    s->sink = kvc_sink_bytes(a, a.blocks[i]);
    s->head = kvc_fields_bytes(r.n_exp) + s->sink + 4 * (kvc_u64)r.n_escapes;
    s->status = KVC_ENCODE_OK;
}

// Byte j (below the lane words) of the block.
__device__ __forceinline__ kvc_u8 kvc_head_byte(const KvcWriteArgs& a, const KvcEncBlock& b,
                                                const KvcBlockShared* s, kvc_u64 j) {
    if (j < 4) return kvc_byte_of(s->r.n_escapes, j);
    j -= 4;
    if (j < 4 * KVC_LANES) return kvc_byte_of(s->lane_len[j / 4], j);
    j -= 4 * KVC_LANES;
    if (j == 0) return (kvc_u8)s->r.n_exp;
    j -= 1;
    if (j < 2 * s->r.n_exp) return kvc_byte_of(s->r.exp_freqs[j / 2], j & 1);
    j -= 2 * s->r.n_exp;
    if (j < s->sink) return a.src[b.x_start * a.elem_bytes + j];
    j -= s->sink;
    return kvc_byte_of((kvc_u32)a.escapes[b.escape_start + j / 4], j);
}

// The lane holding word w of the block's concatenated lanes.
__device__ __forceinline__ kvc_u32 kvc_lane_of(const KvcBlockShared* s, kvc_u32 w) {
    kvc_u32 lo = 0, hi = KVC_LANES - 1;
    while (lo < hi) {
        const kvc_u32 mid = (lo + hi + 1) / 2;
        if (s->lane_first[mid] <= w) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Phase 4: the block's bytes, consecutive threads on consecutive bytes, then on consecutive
// lane words.
__device__ __forceinline__ void kvc_wb_bytes(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    const KvcBlockShared* s = (const KvcBlockShared*)shared;
    if (s->status != KVC_ENCODE_OK) return;
    const KvcEncBlock b = a.blocks[blockIdx.x];
    kvc_u8* o = a.sealed + s->at;
    for (kvc_u64 j = threadIdx.x; j < s->head; j += blockDim.x) o[j] = kvc_head_byte(a, b, s, j);
    o += s->head;
    const kvc_u32 n_words = s->lane_first[KVC_LANES];
    for (kvc_u32 w = threadIdx.x; w < n_words; w += blockDim.x) {
        const kvc_u32 l = kvc_lane_of(s, w);
        const kvc_u32 v = a.words[b.word_start + (kvc_u64)b.lane_cap * l + (w - s->lane_first[l])];
        kvc_put_u32(o + 4 * (kvc_u64)w, v);
    }
}

// Phase 5: each thread's stretch of the block's bytes, its register carried to the chunk's
// end, XORed into the block's share.
__device__ __forceinline__ void kvc_wb_crc(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcBlockShared* s = (KvcBlockShared*)shared;
    const kvc_u32 t = threadIdx.x, nt = kvc_crc_threads();
    if (s->status != KVC_ENCODE_OK || t >= nt) return;
    kvc_u64 from, end;
    kvc_crc_stretch_of(t, nt, s->size, &from, &end);
    if (from == end) return;
    const kvc_u32 r = kvc_crc_bytes(s->table, 0, a.sealed + s->at + from, end - from);
    const kvc_u64 after = s->start + s->len - (s->at + end);
    atomicXor(&s->crc, kvc_crc_mul(kvc_crc_x8n(after), r));
}

// Phase 6 (thread 0): the block's share into its chunk's.
__device__ __forceinline__ void kvc_wb_finish(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    const KvcBlockShared* s = (const KvcBlockShared*)shared;
    if (s->status == KVC_ENCODE_OK) atomicXor(&a.chunk_results[s->chunk].crc, s->crc);
}

// Dynamic shared memory: sizeof(KvcBlockShared).
KVC_KERNEL(kvc_write_blocks, KvcWriteArgs, kvc_wb_begin, kvc_wb_before, kvc_wb_place,
           kvc_wb_bytes, kvc_wb_crc, kvc_wb_finish)

// ---- kvc_seal_chunks

struct KvcSealShared {
    kvc_u64 before[KVC_CRC_THREADS];
};

// Phase 1: the threads' shares of the sealed sizes before the chunk.
__device__ __forceinline__ void kvc_seal_before(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_chunks) return;
    kvc_before_part(a, blockIdx.x, ((KvcSealShared*)shared)->before);
}

// Phase 2 (thread 0): the chunk's place, its CRC (the initial value carried over the body, the
// blocks' shares, the final XOR) after the body, and its result.
__device__ __forceinline__ void kvc_seal_finish(const KvcWriteArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_chunks || threadIdx.x != 0) return;
    const kvc_u64 start = kvc_before_sum(((const KvcSealShared*)shared)->before);
    const kvc_u64 size = kvc_sealed_size(a, blockIdx.x);
    KvcSealResult r;
    r.start = start;
    r.len = 0;
    r.status = size != 0 && start <= a.n_sealed && size <= a.n_sealed - start
                   ? KVC_ENCODE_OK
                   : KVC_ENCODE_BAD_RANGE;
    r.reserved = 0;
    if (r.status == KVC_ENCODE_OK) {
        const KvcChunkResult& c = a.chunk_results[blockIdx.x];
        const kvc_u32 reg = kvc_crc_mul(kvc_crc_x8n(c.len), 0xFFFFFFFFu) ^ c.crc;
        kvc_put_u32(a.sealed + start + c.len, reg ^ 0xFFFFFFFFu);
        r.len = size;
    }
    a.seal_results[blockIdx.x] = r;
}

// Dynamic shared memory: sizeof(KvcSealShared).
KVC_KERNEL(kvc_seal_chunks, KvcWriteArgs, kvc_seal_before, kvc_seal_finish)

#ifdef KVC_HOST
// For a test: the lane encoder's quotient and remainder.
extern "C" kvc_u64 kvc_lane_divmod_test(kvc_u64 x, kvc_u32 f, kvc_u64* rem) {
    return kvc_lane_divmod(x, f, rem);
}

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

// The encode chain's structs, as kvc_encode_layout (with sizeof(KvcEncShared) after the
// first kernel's, and the shared memory of kvc_place_blocks, kvc_write_blocks and
// kvc_seal_chunks at the end).
extern "C" kvc_u64 kvc_encode_chain_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcEncBlock),
        offsetof(KvcEncBlock, x_start),
        offsetof(KvcEncBlock, k_start),
        offsetof(KvcEncBlock, qref_start),
        offsetof(KvcEncBlock, tau_start),
        offsetof(KvcEncBlock, consts_start),
        offsetof(KvcEncBlock, map_start),
        offsetof(KvcEncBlock, sym_start),
        offsetof(KvcEncBlock, q_start),
        offsetof(KvcEncBlock, escape_start),
        offsetof(KvcEncBlock, word_start),
        offsetof(KvcEncBlock, rows),
        offsetof(KvcEncBlock, sink_rows),
        offsetof(KvcEncBlock, group),
        offsetof(KvcEncBlock, importance),
        offsetof(KvcEncBlock, table_start),
        offsetof(KvcEncBlock, table_count),
        offsetof(KvcEncBlock, lane_cap),
        offsetof(KvcEncBlock, rot_start),
        offsetof(KvcEncBlock, rotate),
        offsetof(KvcEncBlock, chunk),
        sizeof(KvcEncResult),
        offsetof(KvcEncResult, status),
        offsetof(KvcEncResult, n_e),
        offsetof(KvcEncResult, n_escapes),
        offsetof(KvcEncResult, n_exp),
        offsetof(KvcEncResult, exp_freqs),
        sizeof(KvcEncodeArgs),
        offsetof(KvcEncodeArgs, src),
        offsetof(KvcEncodeArgs, n_src),
        offsetof(KvcEncodeArgs, dtype),
        offsetof(KvcEncodeArgs, max_exp),
        offsetof(KvcEncodeArgs, slope),
        offsetof(KvcEncodeArgs, inv_sqrt_d),
        offsetof(KvcEncodeArgs, qref),
        offsetof(KvcEncodeArgs, n_qref),
        offsetof(KvcEncodeArgs, tau),
        offsetof(KvcEncodeArgs, n_tau),
        offsetof(KvcEncodeArgs, rot),
        offsetof(KvcEncodeArgs, n_rot),
        offsetof(KvcEncodeArgs, consts),
        offsetof(KvcEncodeArgs, n_consts),
        offsetof(KvcEncodeArgs, map),
        offsetof(KvcEncodeArgs, n_map),
        offsetof(KvcEncodeArgs, table_list),
        offsetof(KvcEncodeArgs, n_table_list),
        offsetof(KvcEncodeArgs, radius),
        offsetof(KvcEncodeArgs, n_radius),
        offsetof(KvcEncodeArgs, tables),
        offsetof(KvcEncodeArgs, n_tables),
        offsetof(KvcEncodeArgs, symbols),
        offsetof(KvcEncodeArgs, symbol_table),
        offsetof(KvcEncodeArgs, n_symbols),
        offsetof(KvcEncodeArgs, q),
        offsetof(KvcEncodeArgs, n_q),
        offsetof(KvcEncodeArgs, escapes),
        offsetof(KvcEncodeArgs, n_escapes),
        offsetof(KvcEncodeArgs, blocks),
        offsetof(KvcEncodeArgs, results),
        offsetof(KvcEncodeArgs, lane_blocks),
        offsetof(KvcEncodeArgs, n_blocks),
        offsetof(KvcEncodeArgs, heads),
        offsetof(KvcEncodeArgs, head_dim),
        offsetof(KvcEncodeArgs, rope_style),
        sizeof(KvcEncShared),
        sizeof(KvcChunkOut),
        offsetof(KvcChunkOut, first_block),
        offsetof(KvcChunkOut, cap),
        offsetof(KvcChunkOut, n_blocks),
        sizeof(KvcChunkResult),
        offsetof(KvcChunkResult, len),
        offsetof(KvcChunkResult, status),
        offsetof(KvcChunkResult, crc),
        sizeof(KvcSealResult),
        offsetof(KvcSealResult, start),
        offsetof(KvcSealResult, len),
        offsetof(KvcSealResult, status),
        sizeof(KvcWriteArgs),
        offsetof(KvcWriteArgs, src),
        offsetof(KvcWriteArgs, n_src_bytes),
        offsetof(KvcWriteArgs, elem_bytes),
        offsetof(KvcWriteArgs, heads),
        offsetof(KvcWriteArgs, head_dim),
        offsetof(KvcWriteArgs, blocks),
        offsetof(KvcWriteArgs, results),
        offsetof(KvcWriteArgs, n_blocks),
        offsetof(KvcWriteArgs, escapes),
        offsetof(KvcWriteArgs, n_escapes),
        offsetof(KvcWriteArgs, words),
        offsetof(KvcWriteArgs, n_words),
        offsetof(KvcWriteArgs, lane_len),
        offsetof(KvcWriteArgs, lane_status),
        offsetof(KvcWriteArgs, block_at),
        offsetof(KvcWriteArgs, chunks),
        offsetof(KvcWriteArgs, chunk_results),
        offsetof(KvcWriteArgs, n_chunks),
        offsetof(KvcWriteArgs, sealed),
        offsetof(KvcWriteArgs, n_sealed),
        offsetof(KvcWriteArgs, seal_results),
        sizeof(KvcPlaceShared),
        sizeof(KvcBlockShared),
        sizeof(KvcSealShared),
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

// The quantizer's rounding of one value, for tests against codec-core.
extern "C" kvc_i32 kvc_quantize_one_host(float r, float step) { return kvc_quantize_one(r, step); }
#endif
