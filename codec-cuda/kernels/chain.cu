// The two steps between a chunk's launches, on the device, so that a batch of chunks decodes in
// one chain of launches with no host round trip (codec_cuda::decode), and the step before them
// when the streams were copied to the device as they are:
//
// - kvc_gather_words (before the first launch, for a plan uploaded from page-locked host memory
//   the streams lie in: Gpu::upload_plan_from): every coded block's lane words and escape
//   values, stored little-endian at any byte offset of the copied bytes, into the chain's word
//   and escape arrays (the escapes would otherwise cross PCIe twice: in the copied chunks and
//   packed).
// - kvc_expand_tables (before the first launch, in every upload): each rANS table the chain's
//   lane decoders read, from its frequencies (2 bytes a symbol, as the upload carries them) into
//   the lane decoders' packed form (KVC_SLOTS entries of 4 bytes: symbol, frequency, slot - cdf)
//   or their compact form (kvc_kernel.cuh).
//   A block's exponent table is a table of its own: packed on the host, every coded block's
//   would cross PCIe as 16 KiB, more than its lane words.
// - kvc_check_chunks (beside it, for a plan whose chunks' CRCs are checked at decode): each
//   chunk's CRC-32C (C1) in the copied bytes, against the CRC stored after it (kvc_crc.cuh).
// - kvc_resolve_tables (between the exponent and the symbol lane decode; spec/FORMAT.md §6.1):
//   every value symbol's table, as an index into its block's table list, from the row kind, the
//   channel and the step exponent the first launch decoded, through a per-(layer, K/V, level)
//   map of 2 x 16 x C entries the host builds once from the profile. Only in the five-launch
//   chain: the fused chain's launches find each symbol's table themselves (kvc_values.cuh).
// - kvc_map_values (between the symbol lane decode and the dequantization; §6.4): table index i
//   of a radius-R table is the value i - R, and any i above 2R takes the block's next escape
//   value (checks B7, B9), ranked by per-tile escape counts (see KvcValueShared);
//   kvc_map_escapes writes only the escapes' values, for a dequantization that maps the rest
//   itself (kvc_values.cuh).
// - kvc_chain_verdict (after the last launch): one word, 0 when every status of the chain says
//   it decoded, so that a chain that did reads back that word instead of all its statuses.
//
// One CUDA block per coded block (the verdict: a grid of threads striding over the statuses);
// every range is checked before use.

#include "kvc_crc.cuh"
#include "kvc_kernel.cuh"
#include "kvc_values.cuh"

#define KVC_MAX_SYMBOL_VALUE (1 << 24)

// Per-block outcome; codec_cuda::decode mirrors these values.
enum KvcChainStatus : kvc_u32 {
    KVC_CHAIN_OK = 0,
    // The block's ranges lie outside the launch's buffers; nothing written.
    KVC_CHAIN_BAD_RANGE = 1,
    // An escape without a value, an escape value out of range (B7) or values left over (B9).
    KVC_CHAIN_BAD_ESCAPES = 2,
    // A chunk whose bytes do not have the CRC stored after them (C1).
    KVC_CHAIN_BAD_CRC = 3,
    // A table's frequencies are not those of a rANS table (kvc_expand_tables).
    KVC_CHAIN_BAD_TABLE = 4,
};

// ----------------------------------------------------------------------------------------------
// Word gather

struct KvcGatherPart {
    // Byte offset in `raw` of the part's first word.
    kvc_u64 src;
    // Index in its destination (`words` or `escapes`) of the part's first word.
    kvc_u64 dst;
    kvc_u64 n_words;
};

struct KvcGatherArgs {
    const kvc_u8* raw;
    kvc_u64 n_raw;
    kvc_u32* words;
    kvc_u64 n_words;
    // The escape values (i32, written as their bits).
    kvc_u32* escapes;
    kvc_u64 n_escapes;
    const KvcGatherPart* parts;
    kvc_u32* status;
    kvc_u64 n_parts;
    // Parts below this index go to `words`, the others to `escapes`.
    kvc_u64 n_word_parts;
};

__device__ __forceinline__ bool kvc_gather_ok(const KvcGatherPart& p, kvc_u64 n_raw,
                                              kvc_u64 n_dst) {
    return p.n_words <= n_dst && p.dst <= n_dst - p.n_words && p.src <= n_raw &&
           p.n_words <= (n_raw - p.src) / 4;
}

// One CUDA block per part. The words are assembled from bytes (a part may start at any byte),
// so the host run computes exactly what the device does; a warp still reads 128 consecutive
// bytes per load.
__device__ __forceinline__ void kvc_gather(const KvcGatherArgs& a, unsigned char*) {
    if (blockIdx.x >= a.n_parts) return;
    const KvcGatherPart p = a.parts[blockIdx.x];
    const bool to_words = blockIdx.x < a.n_word_parts;
    const bool ok = kvc_gather_ok(p, a.n_raw, to_words ? a.n_words : a.n_escapes);
    if (threadIdx.x == 0) a.status[blockIdx.x] = ok ? KVC_CHAIN_OK : KVC_CHAIN_BAD_RANGE;
    if (!ok) return;
    const kvc_u8* __restrict__ src = a.raw + p.src;
    kvc_u32* __restrict__ dst = (to_words ? a.words : a.escapes) + p.dst;
    for (kvc_u64 w = threadIdx.x; w < p.n_words; w += blockDim.x) {
        const kvc_u8* b = src + 4 * w;
        dst[w] = (kvc_u32)b[0] | (kvc_u32)b[1] << 8 | (kvc_u32)b[2] << 16 | (kvc_u32)b[3] << 24;
    }
}

KVC_KERNEL(kvc_gather_words, KvcGatherArgs, kvc_gather)

// ----------------------------------------------------------------------------------------------
// Table expansion

// One table of a launch: its frequencies freqs[freq_start .. freq_start + n_freqs] (symbol s's
// at s), into packed table `table` of `tables`.
struct KvcTableFreqs {
    kvc_u64 freq_start;
    kvc_u32 n_freqs;
    kvc_u32 table;
};

struct KvcExpandArgs {
    const kvc_u16* freqs;
    kvc_u64 n_freqs;
    // n_tables tables of KVC_SLOTS entries each (packed) or KVC_COMPACT_ENTRIES (compact).
    kvc_u32* tables;
    kvc_u64 n_tables;
    const KvcTableFreqs* items;
    kvc_u32* status;
    kvc_u64 n_items;
    // 0: the packed form; 1: the compact form.
    kvc_u32 compact;
    kvc_u32 reserved;
};

// Symbols a table has at most (symbols are bytes).
#define KVC_TABLE_SYMBOLS 256u

// Shared memory: the item's status, its symbols' cumulative frequencies (cdf[s] the sum of the
// frequencies below s; cdf[n] = KVC_SLOTS when the status is OK) and how many symbols below s
// have a nonzero frequency (ranked[s]; ranked[n] in all).
struct KvcExpandShared {
    kvc_u32 status;
    kvc_u32 cdf[KVC_TABLE_SYMBOLS + 1];
    kvc_u32 ranked[KVC_TABLE_SYMBOLS + 1];
};

// Phase 1 (thread 0): the item's ranges and frequencies checked (1 to 256 of them, each below
// KVC_SLOTS, summing to KVC_SLOTS, as codec_core::rans::FreqTable holds them) and their
// cumulative sums; the item's status.
__device__ __forceinline__ void kvc_expand_check(const KvcExpandArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items || threadIdx.x != 0) return;
    KvcExpandShared* s = (KvcExpandShared*)shared;
    const KvcTableFreqs t = a.items[blockIdx.x];
    kvc_u32 status = KVC_CHAIN_BAD_RANGE;
    const bool in_range = t.freq_start <= a.n_freqs && t.n_freqs <= a.n_freqs - t.freq_start &&
                          t.n_freqs >= 1 && t.n_freqs <= KVC_TABLE_SYMBOLS &&
                          t.table < a.n_tables;
    if (in_range) {
        kvc_u32 cdf = 0, ranked = 0;
        bool each_ok = true;
        for (kvc_u32 i = 0; i < t.n_freqs; i++) {
            const kvc_u32 f = a.freqs[t.freq_start + i];
            s->cdf[i] = cdf;
            s->ranked[i] = ranked;
            each_ok = each_ok && f < KVC_SLOTS;
            cdf += f;
            ranked += f > 0;
        }
        s->cdf[t.n_freqs] = cdf;
        s->ranked[t.n_freqs] = ranked;
        status = each_ok && cdf == KVC_SLOTS ? KVC_CHAIN_OK : KVC_CHAIN_BAD_TABLE;
    }
    s->status = status;
    a.status[blockIdx.x] = status;
}

// The last of the n symbols whose `at` is at most v, by bisection (`at` ascending, at[0] <= v <
// at[n]): for `cdf`, the symbol whose range holds slot v (a symbol of frequency 0 starts where
// the next one does); for `ranked`, the symbol of rank v (v below ranked[n]).
__device__ __forceinline__ kvc_u32 kvc_expand_last_at(const kvc_u32* at, kvc_u32 n, kvc_u32 v) {
    kvc_u32 lo = 0, hi = n;
    while (hi - lo > 1) {
        const kvc_u32 mid = (lo + hi) / 2;
        if (at[mid] <= v) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// The packed form: each thread's slots i = threadIdx.x, + blockDim.x, ...; consecutive threads
// write consecutive entries.
__device__ __forceinline__ void kvc_expand_packed(const KvcExpandShared* s, kvc_u32 n,
                                                  kvc_u32* __restrict__ out) {
    for (kvc_u32 i = threadIdx.x; i < KVC_SLOTS; i += blockDim.x) {
        const kvc_u32 sym = kvc_expand_last_at(s->cdf, n, i);
        const kvc_u32 freq = s->cdf[sym + 1] - s->cdf[sym];
        out[i] = sym | freq << 8 | (i - s->cdf[sym]) << 20;
    }
}

// The compact form (kvc_kernel.cuh): work item j < KVC_COMPACT_GROUPS writes group j's 4
// words, the others rank j - KVC_COMPACT_GROUPS's entry.
__device__ __forceinline__ void kvc_expand_compact(const KvcExpandShared* s, kvc_u32 n,
                                                   kvc_u32* __restrict__ out) {
    const kvc_u32 items = KVC_COMPACT_GROUPS + (KVC_COMPACT_ENTRIES - KVC_COMPACT_INFO);
    for (kvc_u32 j = threadIdx.x; j < items; j += blockDim.x) {
        if (j < KVC_COMPACT_GROUPS) {
            kvc_u32 bits[2] = {0, 0};
            for (kvc_u32 k = 0; k < 64; k++) {
                const kvc_u32 i = j * 64 + k;
                const kvc_u32 sym = kvc_expand_last_at(s->cdf, n, i);
                if (s->cdf[sym] == i) bits[k / 32] |= 1u << (k % 32);
            }
            // The ranges starting before the group: those of the symbols before the one
            // holding its first slot, and that one's if it starts earlier.
            const kvc_u32 first = kvc_expand_last_at(s->cdf, n, j * 64);
            const kvc_u32 before = s->ranked[first] + (s->cdf[first] < j * 64 ? 1u : 0u);
            kvc_u32* g = out + 4 * j;
            g[0] = bits[0];
            g[1] = bits[1];
            g[2] = before;
            g[3] = 0;
        } else {
            const kvc_u32 r = j - KVC_COMPACT_GROUPS;
            kvc_u32 e = 0;
            if (r < s->ranked[n]) {
                const kvc_u32 sym = kvc_expand_last_at(s->ranked, n, r);
                const kvc_u32 freq = s->cdf[sym + 1] - s->cdf[sym];
                e = sym | freq << 8 | s->cdf[sym] << 20;
            }
            out[KVC_COMPACT_INFO + r] = e;
        }
    }
}

// Phase 2: the item's table in the launch's form.
__device__ __forceinline__ void kvc_expand_slots(const KvcExpandArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    const KvcExpandShared* s = (const KvcExpandShared*)shared;
    if (s->status != KVC_CHAIN_OK) return;
    const KvcTableFreqs t = a.items[blockIdx.x];
    if (a.compact) {
        kvc_expand_compact(s, t.n_freqs, a.tables + (kvc_u64)t.table * KVC_COMPACT_ENTRIES);
    } else {
        kvc_expand_packed(s, t.n_freqs, a.tables + (kvc_u64)t.table * KVC_SLOTS);
    }
}

// One CUDA block per table. Dynamic shared memory: sizeof(KvcExpandShared).
KVC_KERNEL(kvc_expand_tables, KvcExpandArgs, kvc_expand_check, kvc_expand_slots)

// ----------------------------------------------------------------------------------------------
// Chunk check

// A chunk whose CRC (C1) a decode checks on the device, in the bytes copied there.
struct KvcChunkCheck {
    // Byte offset in `raw` of the chunk's first byte.
    kvc_u64 src;
    // Bytes the CRC covers: the chunk without its CRC.
    kvc_u64 len;
    // The CRC stored after them.
    kvc_u32 crc;
    kvc_u32 reserved;
};

struct KvcCheckArgs {
    const kvc_u8* raw;
    kvc_u64 n_raw;
    const KvcChunkCheck* checks;
    kvc_u32* status;
    kvc_u64 n_checks;
};

__device__ __forceinline__ bool kvc_check_ok(const KvcCheckArgs& a, const KvcChunkCheck& c) {
    return c.src <= a.n_raw && c.len <= a.n_raw - c.src;
}

// Phase 1: the CRC table.
__device__ __forceinline__ void kvc_check_begin(const KvcCheckArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_checks) return;
    kvc_crc_begin((KvcCrcShared*)shared);
}

// Phase 2: each thread's stretch of the chunk.
__device__ __forceinline__ void kvc_check_stretch(const KvcCheckArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_checks) return;
    const KvcChunkCheck c = a.checks[blockIdx.x];
    if (!kvc_check_ok(a, c)) return;
    kvc_crc_stretch((KvcCrcShared*)shared, a.raw + c.src, c.len);
}

// Phase 3 (thread 0): the chunk's status.
__device__ __forceinline__ void kvc_check_status(const KvcCheckArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_checks || threadIdx.x != 0) return;
    const KvcChunkCheck c = a.checks[blockIdx.x];
    kvc_u32 status = KVC_CHAIN_BAD_RANGE;
    if (kvc_check_ok(a, c)) {
        const kvc_u32 crc = kvc_crc_sum((const KvcCrcShared*)shared);
        status = crc == c.crc ? KVC_CHAIN_OK : KVC_CHAIN_BAD_CRC;
    }
    a.status[blockIdx.x] = status;
}

// One CUDA block per chunk. Dynamic shared memory: sizeof(KvcCrcShared).
KVC_KERNEL(kvc_check_chunks, KvcCheckArgs, kvc_check_begin, kvc_check_stretch, kvc_check_status)

// ----------------------------------------------------------------------------------------------
// Table resolution

struct KvcResolveArgs {
    kvc_u16* symbol_table;
    kvc_u64 n_symbol_table;
    // The blocks are maps.resolve.
    KvcTableMaps maps;
    kvc_u32* status;
    kvc_u64 n_blocks;
};

__device__ __forceinline__ bool kvc_resolve_ok(const KvcResolveArgs& a, const KvcResolveBlock& b) {
    const kvc_u64 n = (kvc_u64)b.n_e + b.n_sym;
    return kvc_maps_ok(a.maps, b) && b.symbol_start <= a.n_symbol_table &&
           n <= a.n_symbol_table - b.symbol_start;
}

__device__ __forceinline__ void kvc_resolve(const KvcResolveArgs& a, unsigned char*) {
    if (blockIdx.x >= a.n_blocks) return;
    // A copy: `out` may alias the blocks, and a reference would be reread after every store.
    const KvcResolveBlock b = a.maps.resolve[blockIdx.x];
    const bool ok = kvc_resolve_ok(a, b);
    if (threadIdx.x == 0) a.status[blockIdx.x] = ok ? KVC_CHAIN_OK : KVC_CHAIN_BAD_RANGE;
    if (!ok) return;
    kvc_u16* __restrict__ out = a.symbol_table + b.symbol_start;
    // The exponents use the exponent table, list index 0.
    for (kvc_u32 p = threadIdx.x; p < b.n_e; p += blockDim.x) out[p] = 0;
    KvcTableWalk tables = kvc_table_walk(a.maps, b, threadIdx.x, blockDim.x);
    for (kvc_u64 g = threadIdx.x; g < b.n_sym; g += blockDim.x) out[b.n_e + g] = tables.next();
}

KVC_KERNEL(kvc_resolve_tables, KvcResolveArgs, kvc_resolve)

// ----------------------------------------------------------------------------------------------
// Values and escapes

struct KvcValueArgs {
    const kvc_u8* indices;
    // Each value symbol's table-list index (kvc_map_values; kvc_map_escapes finds it through
    // the block's table map instead, below).
    const kvc_u16* symbol_table;
    kvc_u64 n_indices;
    const kvc_u32* table_list;
    kvc_u64 n_table_list;
    // Per global table id, its radius R (escape index 2R + 1).
    const kvc_u8* radius;
    kvc_u64 n_radius;
    const kvc_i32* escapes;
    kvc_u64 n_escapes;
    kvc_i32* q;
    kvc_u64 n_q;
    const KvcValueBlock* blocks;
    kvc_u32* status;
    kvc_u64 n_blocks;
    // kvc_map_escapes: where the symbols find their tables (one resolve record per block).
    KvcTableMaps maps;
};

// Escapes are counted per tile of 2^tile_shift (>= 32) consecutive symbols (at most KVC_VALUE_TILES
// tiles); a value symbol's escape rank is its tile's first rank plus the escapes before it in
// its tile. Escapes are rare (well under 1% of symbols), so the threads stride over the symbols
// in order (coalesced), and only the tiles that hold escapes are read a second time.
#define KVC_VALUE_TILES 4096u
struct KvcValueShared {
    kvc_u32 status;
    kvc_u32 tile_shift;
    // Set (to 1) by any thread that finds a bad table-list index, or a bad escape value.
    kvc_u32 bad_range;
    kvc_u32 bad_escape;
    // Per tile: escapes in it, then the rank of its first escape.
    kvc_u32 tile[KVC_VALUE_TILES];
    // Per thread: its share of the tiles' escapes, then their first rank (kvc_scan_part).
    kvc_u32 part[KVC_SCAN_THREADS];
    // Per entry of the block's table list (if it has at most KVC_VALUE_LIST): its table's
    // radius.
    kvc_u8 radius[KVC_VALUE_LIST];
};

__device__ __forceinline__ bool kvc_values_ok(const KvcValueArgs& a, const KvcValueBlock& b) {
    if (b.index_start > a.n_indices || b.n_sym > a.n_indices - b.index_start) return false;
    if (b.list_start > a.n_table_list || b.list_len > a.n_table_list - b.list_start) return false;
    if (b.escape_start > a.n_escapes || b.n_escapes > a.n_escapes - b.escape_start) return false;
    if (b.q_start > a.n_q || b.n_sym > a.n_q - b.q_start) return false;
    for (kvc_u32 k = 0; k < b.list_len; k++) {
        if (a.table_list[b.list_start + k] >= a.n_radius) return false;
    }
    return true;
}

// The radius of the table at index t of the block's list, from the staged radii if the list is
// short enough; -1 if t is out of range.
__device__ __forceinline__ int kvc_list_radius(const KvcValueArgs& a, const KvcValueBlock& b,
                                               const KvcValueShared* s, kvc_u32 t) {
    return kvc_list_radius_of(a.table_list + b.list_start, a.radius, s->radius, b.list_len, t);
}

// Where a thread finds its value symbols' table-list indices: in `symbol_table`, or
// (FromMap, kvc_map_escapes) through the block's table map, walking the symbols it visits.
template <bool FromMap>
struct KvcValueTables {
    const kvc_u16* tables;
    KvcTableWalk walk;

    // The table-list index of value symbol g, the one the thread visits now; then on to the
    // next.
    __device__ __forceinline__ kvc_u32 at(kvc_u64 g) {
        if constexpr (FromMap) {
            return walk.next();
        } else {
            return tables[g];
        }
    }
};

// The tables of a thread that visits the block's value symbols g, g + stride, ... (a checked
// block).
template <bool FromMap>
__device__ __forceinline__ KvcValueTables<FromMap> kvc_value_tables(const KvcValueArgs& a,
                                                                    const KvcValueBlock& b,
                                                                    kvc_u32 g, kvc_u32 stride) {
    KvcValueTables<FromMap> v = {};
    if constexpr (FromMap) {
        v.walk = kvc_table_walk(a.maps, a.maps.resolve[blockIdx.x], g, stride);
    } else {
        v.tables = a.symbol_table + b.index_start;
    }
    return v;
}

// Whether a kvc_map_escapes block's resolve record lies in the launch's buffers and describes
// the same value symbols (the walks stay in its rows).
__device__ __forceinline__ bool kvc_values_map_ok(const KvcValueArgs& a, const KvcValueBlock& b) {
    const KvcResolveBlock& r = a.maps.resolve[blockIdx.x];
    return r.n_sym == b.n_sym && kvc_maps_ok(a.maps, r);
}

// Phase 1: thread 0 checks the block and sizes the tiles; every thread clears the tile counts.
template <bool FromMap>
__device__ __forceinline__ void kvc_values_check(const KvcValueArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    for (kvc_u32 i = threadIdx.x; i < KVC_VALUE_TILES; i += blockDim.x) s->tile[i] = 0;
    if (threadIdx.x != 0) return;
    const KvcValueBlock& b = a.blocks[blockIdx.x];
    const bool ok = kvc_values_ok(a, b) && (!FromMap || kvc_values_map_ok(a, b));
    s->status = ok ? KVC_CHAIN_OK : KVC_CHAIN_BAD_RANGE;
    // Tiles of 32 symbols where 4096 of them cover the block (an escape rescans 16 symbols on
    // average; escape-heavy fine levels made 256-symbol tiles the chain's slowest launch).
    kvc_u32 shift = 5;
    while (shift < 32 && ((kvc_u64)KVC_VALUE_TILES << shift) < b.n_sym) shift++;
    s->tile_shift = shift;
    s->bad_range = 0;
    s->bad_escape = 0;
}

// Phase 2: the block's radii staged, if its table list is short enough (phase 1 checked it).
__device__ __forceinline__ void kvc_values_stage(const KvcValueArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    if (s->status != KVC_CHAIN_OK) return;
    const KvcValueBlock b = a.blocks[blockIdx.x];
    if (b.list_len > KVC_VALUE_LIST) return;
    for (kvc_u32 k = threadIdx.x; k < b.list_len; k += blockDim.x) {
        s->radius[k] = a.radius[a.table_list[b.list_start + k]];
    }
}

// Symbols a thread of the value mapping loads at once (KVC_VALUES_AHEAD strides of the block's
// threads apart): their loads go out together, then their values are written; one symbol's
// loads at a time left too few bytes in flight to fill the memory system.
#define KVC_VALUES_AHEAD 4u

// Phase 3: the threads stride over the symbols: a value is written (kvc_map_values only), an
// escape counted in its tile. (The block is a copy and `q` is not read here, so that the
// compiler need not reload the block's fields after every store.) kvc_map_escapes (FromMap)
// writes only the escapes' values and finds the symbols' tables through the table map.
template <bool FromMap>
__device__ __forceinline__ void kvc_values_direct(const KvcValueArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    if (s->status != KVC_CHAIN_OK) return;
    const KvcValueBlock b = a.blocks[blockIdx.x];
    const kvc_u32 shift = s->tile_shift, stride = blockDim.x;
    KvcValueTables<FromMap> tables = kvc_value_tables<FromMap>(a, b, threadIdx.x, stride);
    const kvc_u8* __restrict__ indices = a.indices + b.index_start;
    kvc_i32* __restrict__ q = a.q + b.q_start;
    bool bad = false;
    for (kvc_u64 g0 = threadIdx.x; g0 < b.n_sym; g0 += (kvc_u64)KVC_VALUES_AHEAD * stride) {
        kvc_u32 t[KVC_VALUES_AHEAD];
        int i[KVC_VALUES_AHEAD];
        for (kvc_u32 j = 0; j < KVC_VALUES_AHEAD; j++) {
            const kvc_u64 g = g0 + (kvc_u64)j * stride;
            t[j] = g < b.n_sym ? tables.at(g) : 0u;
            i[j] = g < b.n_sym ? indices[g] : 0;
        }
        for (kvc_u32 j = 0; j < KVC_VALUES_AHEAD; j++) {
            const kvc_u64 g = g0 + (kvc_u64)j * stride;
            if (g >= b.n_sym) break;
            const int r = kvc_list_radius(a, b, s, t[j]);
            if (r < 0) {
                bad = true;
            } else if (kvc_index_escapes(i[j], r)) {
                atomicAdd(&s->tile[g >> shift], 1u);
            } else if (!FromMap) {
                q[g] = i[j] - r;
            }
        }
    }
    if (bad) s->bad_range = 1;
}

// The block's tiles (a block kvc_values_check sized).
__device__ __forceinline__ kvc_u32 kvc_value_tiles(const KvcValueBlock& b, kvc_u32 shift) {
    const kvc_u64 all = ((kvc_u64)b.n_sym + (1ull << shift) - 1) >> shift;
    return all < KVC_VALUE_TILES ? (kvc_u32)all : KVC_VALUE_TILES;
}

// Phase 4: each thread's share of the tiles' escapes (kvc_scan_part).
__device__ __forceinline__ void kvc_values_rank_parts(const KvcValueArgs& a,
                                                      unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    if (s->status != KVC_CHAIN_OK || s->bad_range) return;
    const KvcValueBlock b = a.blocks[blockIdx.x];
    kvc_scan_part(s->tile, kvc_value_tiles(b, s->tile_shift), s->part);
}

// Phase 5 (thread 0): the shares' first ranks; every escape used exactly once (B7, B9).
__device__ __forceinline__ void kvc_values_offsets(const KvcValueArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    if (s->status != KVC_CHAIN_OK) return;
    if (s->bad_range) {
        s->status = KVC_CHAIN_BAD_RANGE;
        return;
    }
    if (kvc_scan_starts(s->part) != a.blocks[blockIdx.x].n_escapes) {
        s->status = KVC_CHAIN_BAD_ESCAPES;
    }
}

// Phase 6: each tile's first escape rank.
__device__ __forceinline__ void kvc_values_rank_write(const KvcValueArgs& a,
                                                      unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    if (s->status != KVC_CHAIN_OK) return;
    const KvcValueBlock b = a.blocks[blockIdx.x];
    kvc_scan_write(s->tile, kvc_value_tiles(b, s->tile_shift), s->part);
}

// Phase 7: each escape's value, the threads striding over the tiles: a tile holding escapes
// (its first rank below the next tile's) is scanned in order by one thread, which gives its
// escapes their ranks one after another. Tiles without escapes, most of them, are not read again.
template <bool FromMap>
__device__ __forceinline__ void kvc_values_escapes_phase(const KvcValueArgs& a,
                                                         unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks) return;
    KvcValueShared* s = (KvcValueShared*)shared;
    if (s->status != KVC_CHAIN_OK) return;
    const KvcValueBlock b = a.blocks[blockIdx.x];
    const kvc_u32 shift = s->tile_shift, tiles = kvc_value_tiles(b, shift);
    for (kvc_u32 tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
        // Phase 5 checked that the ranks add up to n_escapes: rank < end <= n_escapes.
        kvc_u32 rank = s->tile[tile];
        const kvc_u32 end = tile + 1 < tiles ? s->tile[tile + 1] : b.n_escapes;
        const kvc_u64 last = (kvc_u64)(tile + 1) << shift;
        const kvc_u32 stop = last < b.n_sym ? (kvc_u32)last : b.n_sym;
        if (rank >= end) continue;
        KvcValueTables<FromMap> tables = kvc_value_tables<FromMap>(a, b, tile << shift, 1);
        for (kvc_u32 g = tile << shift; g < stop && rank < end; g++) {
            const int r = kvc_list_radius(a, b, s, tables.at(g));
            if (!kvc_index_escapes(a.indices[b.index_start + g], r)) continue;
            const kvc_i32 v = a.escapes[b.escape_start + rank++];
            const kvc_u32 m = v < 0 ? 0u - (kvc_u32)v : (kvc_u32)v;
            if (m <= (kvc_u32)r || m > (kvc_u32)KVC_MAX_SYMBOL_VALUE) s->bad_escape = 1;
            a.q[b.q_start + g] = v;
        }
    }
}

// Phase 8 (thread 0): the block's status.
__device__ __forceinline__ void kvc_values_status(const KvcValueArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_blocks || threadIdx.x != 0) return;
    const KvcValueShared* s = (const KvcValueShared*)shared;
    kvc_u32 status = s->status;
    if (status == KVC_CHAIN_OK && s->bad_escape) status = KVC_CHAIN_BAD_ESCAPES;
    a.status[blockIdx.x] = status;
}

// Dynamic shared memory: sizeof(KvcValueShared).
// kvc_map_escapes: kvc_map_values writing only the escapes' values (the dequantization maps the
// other symbols as it reads them; kvc_values.cuh), each symbol's table found through its
// block's table map rather than read from `symbol_table`.
KVC_KERNEL(kvc_map_values, KvcValueArgs, kvc_values_check<false>, kvc_values_stage,
           kvc_values_direct<false>, kvc_values_rank_parts, kvc_values_offsets,
           kvc_values_rank_write, kvc_values_escapes_phase<false>, kvc_values_status)
KVC_KERNEL(kvc_map_escapes, KvcValueArgs, kvc_values_check<true>, kvc_values_stage,
           kvc_values_direct<true>, kvc_values_rank_parts, kvc_values_offsets,
           kvc_values_rank_write, kvc_values_escapes_phase<true>, kvc_values_status)

// ----------------------------------------------------------------------------------------------
// Chain verdict

struct KvcVerdictArgs {
    // A chain's statuses, one after another.
    const kvc_u32* status;
    kvc_u64 n_status;
    // The first n_lenient pass below lenient_below (the exponent lanes', whose end checks do
    // not fail a prefix); every other passes at 0 only.
    kvc_u64 n_lenient;
    kvc_u32 lenient_below;
    kvc_u32 reserved;
    // Zero before the launch; 1 after it if any status fails.
    kvc_u32* verdict;
};

// Each thread strides over the statuses; one that saw a failing one marks the verdict.
__device__ __forceinline__ void kvc_verdict(const KvcVerdictArgs& a, unsigned char*) {
    const kvc_u64 stride = (kvc_u64)gridDim.x * blockDim.x;
    bool bad = false;
    for (kvc_u64 i = (kvc_u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n_status; i += stride) {
        const kvc_u32 s = a.status[i];
        bad |= i < a.n_lenient ? s >= a.lenient_below : s != 0u;
    }
    if (bad) atomicOr(a.verdict, 1u);
}

// Any grid; no shared memory.
KVC_KERNEL(kvc_chain_verdict, KvcVerdictArgs, kvc_verdict)

#ifdef KVC_HOST
#include <stddef.h>
// For the test of the Rust mirrors: sizeof and offsetof of every field of the argument structs
// in declaration order, with sizeof(KvcValueShared) after the value mapping's and
// sizeof(KvcCrcShared) after the chunk check's. Writes at most `cap` values.
extern "C" kvc_u64 kvc_chain_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcResolveBlock),
        offsetof(KvcResolveBlock, symbol_start),
        offsetof(KvcResolveBlock, exp_start),
        offsetof(KvcResolveBlock, map_start),
        offsetof(KvcResolveBlock, n_e),
        offsetof(KvcResolveBlock, n_sym),
        offsetof(KvcResolveBlock, sink_rows),
        offsetof(KvcResolveBlock, group),
        offsetof(KvcResolveBlock, has_exps),
        sizeof(KvcResolveArgs),
        offsetof(KvcResolveArgs, symbol_table),
        offsetof(KvcResolveArgs, n_symbol_table),
        offsetof(KvcResolveArgs, maps),
        offsetof(KvcResolveArgs, status),
        offsetof(KvcResolveArgs, n_blocks),
        sizeof(KvcValueBlock),
        offsetof(KvcValueBlock, index_start),
        offsetof(KvcValueBlock, list_start),
        offsetof(KvcValueBlock, escape_start),
        offsetof(KvcValueBlock, q_start),
        offsetof(KvcValueBlock, n_sym),
        offsetof(KvcValueBlock, n_escapes),
        offsetof(KvcValueBlock, list_len),
        sizeof(KvcValueArgs),
        offsetof(KvcValueArgs, indices),
        offsetof(KvcValueArgs, symbol_table),
        offsetof(KvcValueArgs, n_indices),
        offsetof(KvcValueArgs, table_list),
        offsetof(KvcValueArgs, n_table_list),
        offsetof(KvcValueArgs, radius),
        offsetof(KvcValueArgs, n_radius),
        offsetof(KvcValueArgs, escapes),
        offsetof(KvcValueArgs, n_escapes),
        offsetof(KvcValueArgs, q),
        offsetof(KvcValueArgs, n_q),
        offsetof(KvcValueArgs, blocks),
        offsetof(KvcValueArgs, status),
        offsetof(KvcValueArgs, n_blocks),
        offsetof(KvcValueArgs, maps),
        sizeof(KvcValueShared),
        sizeof(KvcGatherPart),
        offsetof(KvcGatherPart, src),
        offsetof(KvcGatherPart, dst),
        offsetof(KvcGatherPart, n_words),
        sizeof(KvcGatherArgs),
        offsetof(KvcGatherArgs, raw),
        offsetof(KvcGatherArgs, n_raw),
        offsetof(KvcGatherArgs, words),
        offsetof(KvcGatherArgs, n_words),
        offsetof(KvcGatherArgs, escapes),
        offsetof(KvcGatherArgs, n_escapes),
        offsetof(KvcGatherArgs, parts),
        offsetof(KvcGatherArgs, status),
        offsetof(KvcGatherArgs, n_parts),
        offsetof(KvcGatherArgs, n_word_parts),
        sizeof(KvcChunkCheck),
        offsetof(KvcChunkCheck, src),
        offsetof(KvcChunkCheck, len),
        offsetof(KvcChunkCheck, crc),
        offsetof(KvcChunkCheck, reserved),
        sizeof(KvcCheckArgs),
        offsetof(KvcCheckArgs, raw),
        offsetof(KvcCheckArgs, n_raw),
        offsetof(KvcCheckArgs, checks),
        offsetof(KvcCheckArgs, status),
        offsetof(KvcCheckArgs, n_checks),
        sizeof(KvcCrcShared),
        sizeof(KvcVerdictArgs),
        offsetof(KvcVerdictArgs, status),
        offsetof(KvcVerdictArgs, n_status),
        offsetof(KvcVerdictArgs, n_lenient),
        offsetof(KvcVerdictArgs, lenient_below),
        offsetof(KvcVerdictArgs, reserved),
        offsetof(KvcVerdictArgs, verdict),
        sizeof(KvcTableFreqs),
        offsetof(KvcTableFreqs, freq_start),
        offsetof(KvcTableFreqs, n_freqs),
        offsetof(KvcTableFreqs, table),
        sizeof(KvcExpandArgs),
        offsetof(KvcExpandArgs, freqs),
        offsetof(KvcExpandArgs, n_freqs),
        offsetof(KvcExpandArgs, tables),
        offsetof(KvcExpandArgs, n_tables),
        offsetof(KvcExpandArgs, items),
        offsetof(KvcExpandArgs, status),
        offsetof(KvcExpandArgs, n_items),
        offsetof(KvcExpandArgs, compact),
        offsetof(KvcExpandArgs, reserved),
        sizeof(KvcExpandShared),
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
#endif
