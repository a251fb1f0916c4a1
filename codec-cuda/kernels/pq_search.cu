// PQ scoring and top-k selection (spec/PQ.md §5), bit for bit pq_core's group_score_table and
// search: for each query (or GQA group of query heads sharing a KV head) of a batch, the score
// table from the codebook, every token's score from its packed codes (§2), and the selected
// token indices, ascending: the first n_init and last n_local tokens plus the k best of the rest
// by score descending under IEEE totalOrder, NaN lowest, ties to the lower index.
//
// One CUDA block per query. The table lives in shared memory; the tokens' ranking keys (a u32
// per token, larger ranks higher, as pq_core::order) too when the launch's `key_capacity` holds
// them, else in a global scratch buffer. The k-th largest key of the rest is found exactly by
// three radix passes over the keys (digits of 11, 11 and 10 bits, histograms in shared memory;
// the first pass's histogram is counted as the keys are made). Each pass's bucket is found in two
// steps: threads sum groups of 32 bins, then one thread walks the group sums and the bins of one
// group. Then an ordered compaction writes the indices: each thread counts the tokens above and
// equal to the k-th key in its contiguous segment, the counts become offsets in three steps (per
// group of 32 threads, over the groups by one thread handing the equal tokens to the lowest
// segments first, within each group), and each thread writes its segment's tokens in order.

#include "kvc_kernel.cuh"

// Per-query outcome; codec_cuda::pq mirrors these values.
enum KvcPqStatus : kvc_u32 {
    KVC_PQ_OK = 0,
    // The query's ranges lie outside the launch's buffers; nothing written.
    KVC_PQ_BAD_RANGE = 1,
    // The launch's codebook shape is invalid (m, bits, dim), its table does not fit the launch's
    // shared memory, or the block has more threads than the kernel's segment counts hold.
    KVC_PQ_BAD_SHAPE = 2,
};

// Threads per block the shared segment counts are sized for (a launch may use fewer).
#define KVC_PQ_MAX_THREADS 1024u
// Most table entries (m * 2^bits) a launch may have, whatever its shared memory: bounds every
// product in the range checks (m <= 2^15, so T * m * bits < 2^51).
#define KVC_PQ_MAX_TABLE 65536u
// Most ranking keys a launch may keep in shared memory per query (256 KiB, more than any
// device's shared memory per block): bounds the shared memory offsets.
#define KVC_PQ_MAX_SHARED_KEYS 65536u
// Histogram bins of the largest radix digit (11 bits), and bins per group when finding a
// pass's bucket (also threads per group when turning counts into offsets).
#define KVC_PQ_BINS 2048u
#define KVC_PQ_GROUP 32u
// Per-thread counts are stored with one padding word after every 32, so that the 32 threads of
// a group walking their own runs of 32 in step touch 32 different banks.
#define KVC_PQ_PADDED_THREADS (KVC_PQ_MAX_THREADS + KVC_PQ_MAX_THREADS / KVC_PQ_GROUP)

// One query of a launch.
struct KvcPqQuery {
    // Index in `queries` of head 0's dim 0: group_heads * dim values, head after head.
    kvc_u64 query_start;
    // Index in `codewords` of book 0's codeword 0: m * 2^bits * book_dim values (spec/PQ.md
    // §4.1).
    kvc_u64 codebook_start;
    // Index in `codes` of the byte holding token 0's first code (the packing of §2 from there).
    kvc_u64 codes_start;
    // Index in `keys` of this query's `tokens` ranking keys (scratch; checked, and used when the
    // keys do not fit the launch's shared memory).
    kvc_u64 keys_start;
    // Index in `out` of the selection: min(n_init, T) + min(k, rest) + the local window.
    kvc_u64 out_start;
    // Tokens T the query sees (its codes are the first T * m of the head's).
    kvc_u32 tokens;
    // Query heads in the GQA group (>= 1); their tables are summed in head order.
    kvc_u32 group_heads;
    kvc_u32 k;
    kvc_u32 n_init;
    kvc_u32 n_local;
    kvc_u32 reserved;
};

// A launch's buffers; every count is the number of elements its pointer may be read or written.
struct KvcPqArgs {
    const float* queries;
    kvc_u64 n_queries;
    const float* codewords;
    kvc_u64 n_codewords;
    const kvc_u8* codes;
    kvc_u64 n_codes;
    kvc_u32* keys;
    kvc_u64 n_keys;
    kvc_u32* out;
    kvc_u64 n_out;
    const KvcPqQuery* items;
    kvc_u32* status;
    kvc_u64 n_items;
    // The codebook shape every query of the launch shares: key dim D, books m, bits per code b,
    // and whether the books are residual (each covers all D dims) or product (D / m each).
    kvc_u32 dim;
    kvc_u32 m;
    kvc_u32 bits;
    kvc_u32 residual;
    // Table entries (f32) the launch's dynamic shared memory holds after KvcPqShared.
    kvc_u32 table_capacity;
    // Ranking keys (u32) it holds after the table: a query of at most this many tokens keeps
    // its keys there, a longer one in `keys`.
    kvc_u32 key_capacity;
};

// Shared memory: this header, then `table_capacity` f32 table entries, then `key_capacity` u32
// ranking keys.
struct KvcPqShared {
    kvc_u32 status;
    // The k-th largest key's bits found so far (radix passes), then the key itself.
    kvc_u32 prefix;
    // Tokens still to take at or below the bucket being refined; after the passes, how many
    // tokens equal to the k-th key are taken (the lowest-indexed ones).
    kvc_u32 k_rem;
    kvc_u32 reserved;
    // Radix histograms: passes 0 and 2 count into the first, pass 1 into the second.
    kvc_u32 hist[2][KVC_PQ_BINS];
    // Per group of 32 bins: their sum.
    kvc_u32 group[KVC_PQ_BINS / KVC_PQ_GROUP];
    // Per group of 32 threads: tokens above the k-th key in their segments, then the group's
    // output offset; tokens equal to it, then how many of them the group takes.
    kvc_u32 group_above[KVC_PQ_MAX_THREADS / KVC_PQ_GROUP];
    kvc_u32 group_equal[KVC_PQ_MAX_THREADS / KVC_PQ_GROUP];
    // Per thread (padded, kvc_pq_pad): tokens above the k-th key in its segment, then its output
    // offset; tokens equal to it, then how many of them it takes.
    kvc_u32 above[KVC_PQ_PADDED_THREADS];
    kvc_u32 equal[KVC_PQ_PADDED_THREADS];
};

__device__ __forceinline__ KvcPqShared* kvc_pq_shared(unsigned char* shared) {
    return (KvcPqShared*)shared;
}

__device__ __forceinline__ float* kvc_pq_table(unsigned char* shared) {
    return (float*)(shared + sizeof(KvcPqShared));
}

// Where thread t's counts lie in `above` and `equal`.
__device__ __forceinline__ kvc_u32 kvc_pq_pad(kvc_u32 t) { return t + t / KVC_PQ_GROUP; }

// The ranking key of a score (pq_core::order::order_key): totalOrder descending as u32
// ascending, NaN as -inf.
__device__ __forceinline__ kvc_u32 kvc_pq_order_key(float s) {
    kvc_u32 b = kvc_f32_bits(s);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) b = 0xFF800000u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The query's windows: init_end, local_start, and k clamped to the rest.
struct KvcPqWindows {
    kvc_u32 init_end;
    kvc_u32 local_start;
    kvc_u32 k;
};

__device__ __forceinline__ KvcPqWindows kvc_pq_windows(const KvcPqQuery& q) {
    const kvc_u32 t = q.tokens;
    const kvc_u32 init_end = q.n_init < t ? q.n_init : t;
    kvc_u32 local_start = t - (q.n_local < t ? q.n_local : t);
    if (local_start < init_end) local_start = init_end;
    const kvc_u32 rest = local_start - init_end;
    return KvcPqWindows{init_end, local_start, q.k < rest ? q.k : rest};
}

// Whether the launch's shape is one the kernel handles (no query read yet).
__device__ __forceinline__ bool kvc_pq_shape_ok(const KvcPqArgs& a) {
    if (a.m == 0 || a.bits == 0 || a.bits > 16 || a.dim == 0 || blockDim.x > KVC_PQ_MAX_THREADS)
        return false;
    if (!a.residual && a.dim % a.m != 0) return false;
    const kvc_u64 entries = (kvc_u64)a.m << a.bits;
    return entries <= a.table_capacity && entries <= KVC_PQ_MAX_TABLE &&
           a.table_capacity <= KVC_PQ_MAX_TABLE && a.key_capacity <= KVC_PQ_MAX_SHARED_KEYS;
}

// The query's ranking keys: in shared memory after the table if they fit, else its part of the
// scratch buffer (whose range kvc_pq_range_ok checked either way).
__device__ __forceinline__ kvc_u32* kvc_pq_keys_of(const KvcPqArgs& a, const KvcPqQuery& q,
                                                   unsigned char* shared) {
    if (q.tokens <= a.key_capacity) {
        return (kvc_u32*)(shared + sizeof(KvcPqShared) + 4ull * a.table_capacity);
    }
    return a.keys + q.keys_start;
}

// Whether the query's ranges lie inside the launch's buffers, for a launch whose shape is
// checked (every product bounded as noted; bounds compared by subtraction from a count).
__device__ __forceinline__ bool kvc_pq_range_ok(const KvcPqArgs& a, const KvcPqQuery& q) {
    const kvc_u64 book_dim = a.residual ? a.dim : a.dim / a.m;
    const kvc_u64 n_cw = ((kvc_u64)a.m << a.bits) * book_dim;  // <= 2^16 * 2^32
    const kvc_u64 n_q = (kvc_u64)q.group_heads * a.dim;
    const kvc_u64 code_bits = (kvc_u64)q.tokens * a.m * a.bits;  // < 2^32 * 2^15 * 2^4
    const kvc_u64 code_bytes = (code_bits + 7) / 8;
    const KvcPqWindows w = kvc_pq_windows(q);
    const kvc_u64 n_sel = (kvc_u64)w.init_end + w.k + (q.tokens - w.local_start);
    return q.group_heads > 0 && q.query_start <= a.n_queries &&
           n_q <= a.n_queries - q.query_start && q.codebook_start <= a.n_codewords &&
           n_cw <= a.n_codewords - q.codebook_start && q.codes_start <= a.n_codes &&
           code_bytes <= a.n_codes - q.codes_start && q.keys_start <= a.n_keys &&
           q.tokens <= a.n_keys - q.keys_start && q.out_start <= a.n_out &&
           n_sel <= a.n_out - q.out_start;
}

// Phase 1: thread 0 checks the launch and the query; every thread clears the histograms.
__device__ __forceinline__ void kvc_pq_check(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    for (kvc_u32 i = threadIdx.x; i < 2u * KVC_PQ_BINS; i += blockDim.x) s->hist[0][i] = 0;
    if (threadIdx.x != 0) return;
    const KvcPqQuery& q = a.items[blockIdx.x];
    if (!kvc_pq_shape_ok(a)) {
        s->status = KVC_PQ_BAD_SHAPE;
    } else {
        s->status = kvc_pq_range_ok(a, q) ? KVC_PQ_OK : KVC_PQ_BAD_RANGE;
    }
    s->prefix = 0;
    s->k_rem = kvc_pq_windows(q).k;
}

// Phase 2: the score table (§5.1), one entry per thread at a time: the dot product of the
// query's slice with the codeword in dim order from 0.0, summed over the group's heads in head
// order (the first head's entry as is).
__device__ __forceinline__ void kvc_pq_table_phase(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items || kvc_pq_shared(shared)->status != KVC_PQ_OK) return;
    const KvcPqQuery& q = a.items[blockIdx.x];
    float* table = kvc_pq_table(shared);
    const kvc_u32 n_c = 1u << a.bits;
    const kvc_u32 book_dim = a.residual ? a.dim : a.dim / a.m;
    for (kvc_u32 e = threadIdx.x; e < a.m * n_c; e += blockDim.x) {
        const kvc_u32 j = e / n_c;
        const float* cw = a.codewords + q.codebook_start + (kvc_u64)e * book_dim;
        const kvc_u32 first = a.residual ? 0u : j * book_dim;
        float entry = 0.0f;
        for (kvc_u32 h = 0; h < q.group_heads; h++) {
            const float* x = a.queries + q.query_start + (kvc_u64)h * a.dim + first;
            float dot = 0.0f;
            for (kvc_u32 d = 0; d < book_dim; d++) dot = __fadd_rn(dot, __fmul_rn(x[d], cw[d]));
            entry = h == 0 ? dot : __fadd_rn(entry, dot);
        }
        table[e] = entry;
    }
}

// Code `i` of the packed stream starting at `codes` (§2: LSB first, b bits, no alignment);
// every byte read lies inside the checked packed length.
__device__ __forceinline__ kvc_u32 kvc_pq_code(const kvc_u8* codes, kvc_u64 i, kvc_u32 bits) {
    const kvc_u64 first = i * bits, last = first + bits - 1;
    kvc_u32 v = 0;
    for (kvc_u64 byte = last / 8;; byte--) {
        v = (v << 8) | codes[byte];
        if (byte == first / 8) break;
    }
    return (v >> (first % 8)) & ((1u << bits) - 1u);
}

// Whether the query selects among the rest at all (0 < k < rest); with k == rest every token
// of the rest is taken (k-th key 0: every key is above it, NaN's included), with k == 0 none.
__device__ __forceinline__ bool kvc_pq_selects(const KvcPqQuery& q) {
    const KvcPqWindows w = kvc_pq_windows(q);
    return w.k > 0 && w.k < w.local_start - w.init_end;
}

// Radix pass P's digit: its lowest bit and its width (11, 11, 10 bits from the top), the
// histogram it counts into, and the key bits the earlier passes fixed.
template <kvc_u32 P>
struct KvcPqDigit {
    static constexpr kvc_u32 shift = P == 0 ? 21u : (P == 1 ? 10u : 0u);
    static constexpr kvc_u32 bins = P == 2 ? 1024u : 2048u;
    static constexpr kvc_u32 hist = P == 1 ? 1u : 0u;
    static constexpr kvc_u32 fixed = P == 0 ? 0u : ~((bins << shift) - 1u);
};

// Phase 3: every token's score (§5.2: ((0.0 + table[0][c0]) + table[1][c1]) + ...) as its
// ranking key, and the histogram of radix pass 0 over the rest's keys.
__device__ __forceinline__ void kvc_pq_keys(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    if (s->status != KVC_PQ_OK) return;
    // A copy: the keys may alias the query headers, and a reference would be reread after
    // every key stored.
    const KvcPqQuery q = a.items[blockIdx.x];
    const KvcPqWindows w = kvc_pq_windows(q);
    const bool count = kvc_pq_selects(q);
    const float* table = kvc_pq_table(shared);
    kvc_u32* keys = kvc_pq_keys_of(a, q, shared);
    const kvc_u8* codes = a.codes + q.codes_start;
    const kvc_u32 n_c = 1u << a.bits;
    for (kvc_u32 t = threadIdx.x; t < q.tokens; t += blockDim.x) {
        float score = 0.0f;
        for (kvc_u32 j = 0; j < a.m; j++) {
            const kvc_u32 c = kvc_pq_code(codes, (kvc_u64)t * a.m + j, a.bits);
            score = __fadd_rn(score, table[j * n_c + c]);
        }
        const kvc_u32 key = kvc_pq_order_key(score);
        keys[t] = key;
        if (count && t >= w.init_end && t < w.local_start) {
            atomicAdd(&s->hist[0][key >> KvcPqDigit<0>::shift], 1u);
        }
    }
}

// Radix pass P (1 or 2), counting: a histogram of the rest's keys that match the prefix found
// so far.
template <kvc_u32 P>
__device__ __forceinline__ void kvc_pq_hist(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    const KvcPqQuery& q = a.items[blockIdx.x];
    if (s->status != KVC_PQ_OK || !kvc_pq_selects(q)) return;
    using D = KvcPqDigit<P>;
    const KvcPqWindows w = kvc_pq_windows(q);
    const kvc_u32* keys = kvc_pq_keys_of(a, q, shared);
    const kvc_u32 prefix = s->prefix;
    kvc_u32* hist = s->hist[D::hist];
    for (kvc_u32 t = w.init_end + threadIdx.x; t < w.local_start; t += blockDim.x) {
        const kvc_u32 key = keys[t];
        if (((key ^ prefix) & D::fixed) == 0) {
            atomicAdd(&hist[(key >> D::shift) & (D::bins - 1u)], 1u);
        }
    }
}

// Radix pass P, first step of finding its bucket: thread i < bins / 32 sums bins 32i..32i+31
// (starting at a bin that differs per thread, so that the group's threads read different
// banks). Pass 1 also clears the first histogram's bins for pass 2 (pass 0 is done with them).
template <kvc_u32 P>
__device__ __forceinline__ void kvc_pq_group_sums(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    if (s->status != KVC_PQ_OK || !kvc_pq_selects(a.items[blockIdx.x])) return;
    using D = KvcPqDigit<P>;
    const kvc_u32* hist = s->hist[D::hist];
    const kvc_u32 i = threadIdx.x;
    if (i < D::bins / KVC_PQ_GROUP) {
        kvc_u32 sum = 0;
        for (kvc_u32 j = 0; j < KVC_PQ_GROUP; j++) {
            sum += hist[i * KVC_PQ_GROUP + ((i + j) & (KVC_PQ_GROUP - 1u))];
        }
        s->group[i] = sum;
    }
    if (P == 1) {
        for (kvc_u32 b = threadIdx.x; b < KvcPqDigit<2>::bins; b += blockDim.x) s->hist[0][b] = 0;
    }
}

// Radix pass P, second step (thread 0): the bucket holding the k_rem-th largest matching key,
// from the top: the group first, then the bin within it.
template <kvc_u32 P>
__device__ __forceinline__ void kvc_pq_pick(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items || threadIdx.x != 0) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    if (s->status != KVC_PQ_OK || !kvc_pq_selects(a.items[blockIdx.x])) return;
    using D = KvcPqDigit<P>;
    const kvc_u32* hist = s->hist[D::hist];
    kvc_u32 k_rem = s->k_rem, g = D::bins / KVC_PQ_GROUP - 1u;
    // The matching keys number at least k_rem (k < rest for pass 0; each later pass counts the
    // bucket the pass before picked), so the walk stops at a group, and in it at a bin.
    while (g > 0 && s->group[g] < k_rem) k_rem -= s->group[g--];
    kvc_u32 b = g * KVC_PQ_GROUP + KVC_PQ_GROUP - 1u;
    while (b > g * KVC_PQ_GROUP && hist[b] < k_rem) k_rem -= hist[b--];
    s->prefix |= b << D::shift;
    s->k_rem = k_rem;
}

// This thread's contiguous segment of the rest: [*lo, *hi). Segments are an odd number of
// tokens long, so that in shared memory the 32 threads of a warp walking theirs in step read 32
// different banks.
__device__ __forceinline__ void kvc_pq_segment(const KvcPqWindows& w, kvc_u32* lo, kvc_u32* hi) {
    const kvc_u32 rest = w.local_start - w.init_end;
    const kvc_u32 per = ((rest + blockDim.x - 1) / blockDim.x) | 1u;
    const kvc_u64 l = (kvc_u64)threadIdx.x * per, h = l + per;
    *lo = w.init_end + (kvc_u32)(l < rest ? l : rest);
    *hi = w.init_end + (kvc_u32)(h < rest ? h : rest);
}

// The k-th key, or 0 when the whole rest is taken.
__device__ __forceinline__ kvc_u32 kvc_pq_tau(const KvcPqShared* s, const KvcPqQuery& q) {
    return kvc_pq_selects(q) ? s->prefix : 0u;
}

// Compaction, phase 1: each thread counts its segment's keys above and equal to the k-th key.
__device__ __forceinline__ void kvc_pq_count(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    if (s->status != KVC_PQ_OK) return;
    const KvcPqQuery& q = a.items[blockIdx.x];
    const KvcPqWindows w = kvc_pq_windows(q);
    kvc_u32 above = 0, equal = 0;
    if (w.k > 0) {
        const kvc_u32 tau = kvc_pq_tau(s, q);
        const kvc_u32* keys = kvc_pq_keys_of(a, q, shared);
        kvc_u32 lo, hi;
        kvc_pq_segment(w, &lo, &hi);
        for (kvc_u32 t = lo; t < hi; t++) {
            const kvc_u32 key = keys[t];
            above += key > tau;
            equal += key == tau;
        }
    }
    s->above[kvc_pq_pad(threadIdx.x)] = above;
    s->equal[kvc_pq_pad(threadIdx.x)] = equal;
}

// The threads of group i of 32: [first, end).
__device__ __forceinline__ void kvc_pq_thread_group(kvc_u32 i, kvc_u32* first, kvc_u32* end) {
    *first = i * KVC_PQ_GROUP;
    *end = *first + KVC_PQ_GROUP < blockDim.x ? *first + KVC_PQ_GROUP : blockDim.x;
}

// Compaction, phase 2: thread i < ceil(threads / 32) sums the counts of threads 32i..32i+31.
__device__ __forceinline__ void kvc_pq_group_counts(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    const kvc_u32 i = threadIdx.x;
    if (s->status != KVC_PQ_OK || i * KVC_PQ_GROUP >= blockDim.x) return;
    kvc_u32 first, end, above = 0, equal = 0;
    kvc_pq_thread_group(i, &first, &end);
    for (kvc_u32 t = first; t < end; t++) {
        above += s->above[kvc_pq_pad(t)];
        equal += s->equal[kvc_pq_pad(t)];
    }
    s->group_above[i] = above;
    s->group_equal[i] = equal;
}

// One step of handing out offsets in order: the counts (*above, *equal) of a segment or group
// become its output offset and how many of its tokens equal to the k-th key it takes (as many
// of the *quota left as it has); *offset and *quota move past it.
__device__ __forceinline__ void kvc_pq_hand_out(kvc_u32* above, kvc_u32* equal, kvc_u32* offset,
                                                kvc_u32* quota) {
    const kvc_u32 take = *equal < *quota ? *equal : *quota;
    *quota -= take;
    const kvc_u32 n = *above + take;
    *above = *offset;
    *equal = take;
    *offset += n;
}

// Compaction, phase 3 (thread 0): the k_rem tokens equal to the k-th key go to the lowest
// groups; each group's output offset is the count of the groups before it.
__device__ __forceinline__ void kvc_pq_group_offsets(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items || threadIdx.x != 0) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    if (s->status != KVC_PQ_OK) return;
    kvc_u32 quota = kvc_pq_selects(a.items[blockIdx.x]) ? s->k_rem : 0u;
    kvc_u32 offset = 0;
    for (kvc_u32 i = 0; i * KVC_PQ_GROUP < blockDim.x; i++) {
        kvc_pq_hand_out(&s->group_above[i], &s->group_equal[i], &offset, &quota);
    }
}

// Compaction, phase 4: within each group (thread i for group i), the same for its threads.
__device__ __forceinline__ void kvc_pq_offsets(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    KvcPqShared* s = kvc_pq_shared(shared);
    const kvc_u32 i = threadIdx.x;
    if (s->status != KVC_PQ_OK || i * KVC_PQ_GROUP >= blockDim.x) return;
    kvc_u32 first, end, offset = s->group_above[i], quota = s->group_equal[i];
    kvc_pq_thread_group(i, &first, &end);
    for (kvc_u32 t = first; t < end; t++) {
        kvc_pq_hand_out(&s->above[kvc_pq_pad(t)], &s->equal[kvc_pq_pad(t)], &offset, &quota);
    }
}

// Compaction, phase 5: the windows, and each thread's selected tokens in index order.
__device__ __forceinline__ void kvc_pq_emit(const KvcPqArgs& a, unsigned char* shared) {
    if (blockIdx.x >= a.n_items) return;
    const KvcPqShared* s = kvc_pq_shared(shared);
    if (threadIdx.x == 0) a.status[blockIdx.x] = s->status;
    if (s->status != KVC_PQ_OK) return;
    const KvcPqQuery q = a.items[blockIdx.x];  // a copy, as in kvc_pq_keys
    const KvcPqWindows w = kvc_pq_windows(q);
    kvc_u32* out = a.out + q.out_start;
    for (kvc_u32 t = threadIdx.x; t < w.init_end; t += blockDim.x) out[t] = t;
    const kvc_u32 local_at = w.init_end + w.k;
    for (kvc_u32 t = w.local_start + threadIdx.x; t < q.tokens; t += blockDim.x) {
        out[local_at + (t - w.local_start)] = t;
    }
    if (w.k == 0) return;
    const kvc_u32 tau = kvc_pq_tau(s, q);
    const kvc_u32* keys = kvc_pq_keys_of(a, q, shared);
    const kvc_u32 p = kvc_pq_pad(threadIdx.x);
    kvc_u32 at = w.init_end + s->above[p], equal_left = s->equal[p];
    kvc_u32 lo, hi;
    kvc_pq_segment(w, &lo, &hi);
    for (kvc_u32 t = lo; t < hi; t++) {
        const kvc_u32 key = keys[t];
        if (key > tau || (key == tau && equal_left > 0)) {
            if (key == tau) equal_left--;
            out[at++] = t;
        }
    }
}

// Dynamic shared memory: sizeof(KvcPqShared) + 4 * (table_capacity + key_capacity) bytes.
KVC_KERNEL(kvc_pq_search, KvcPqArgs, kvc_pq_check, kvc_pq_table_phase, kvc_pq_keys,
           kvc_pq_group_sums<0>, kvc_pq_pick<0>, kvc_pq_hist<1>, kvc_pq_group_sums<1>,
           kvc_pq_pick<1>, kvc_pq_hist<2>, kvc_pq_group_sums<2>, kvc_pq_pick<2>, kvc_pq_count,
           kvc_pq_group_counts, kvc_pq_group_offsets, kvc_pq_offsets, kvc_pq_emit)

#ifdef KVC_HOST
#include <stddef.h>
// For the test of the Rust mirrors: sizeof and offsetof of every field of the argument structs
// in declaration order, then sizeof(KvcPqShared). Writes at most `cap` values; returns how many
// there are.
extern "C" kvc_u64 kvc_pq_layout(kvc_u64* out, kvc_u64 cap) {
    const kvc_u64 v[] = {
        sizeof(KvcPqQuery),
        offsetof(KvcPqQuery, query_start),
        offsetof(KvcPqQuery, codebook_start),
        offsetof(KvcPqQuery, codes_start),
        offsetof(KvcPqQuery, keys_start),
        offsetof(KvcPqQuery, out_start),
        offsetof(KvcPqQuery, tokens),
        offsetof(KvcPqQuery, group_heads),
        offsetof(KvcPqQuery, k),
        offsetof(KvcPqQuery, n_init),
        offsetof(KvcPqQuery, n_local),
        sizeof(KvcPqArgs),
        offsetof(KvcPqArgs, queries),
        offsetof(KvcPqArgs, n_queries),
        offsetof(KvcPqArgs, codewords),
        offsetof(KvcPqArgs, n_codewords),
        offsetof(KvcPqArgs, codes),
        offsetof(KvcPqArgs, n_codes),
        offsetof(KvcPqArgs, keys),
        offsetof(KvcPqArgs, n_keys),
        offsetof(KvcPqArgs, out),
        offsetof(KvcPqArgs, n_out),
        offsetof(KvcPqArgs, items),
        offsetof(KvcPqArgs, status),
        offsetof(KvcPqArgs, n_items),
        offsetof(KvcPqArgs, dim),
        offsetof(KvcPqArgs, m),
        offsetof(KvcPqArgs, bits),
        offsetof(KvcPqArgs, residual),
        offsetof(KvcPqArgs, table_capacity),
        offsetof(KvcPqArgs, key_capacity),
        sizeof(KvcPqShared),
        KVC_PQ_MAX_THREADS,
    };
    const kvc_u64 n = sizeof(v) / sizeof(v[0]);
    for (kvc_u64 i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
#endif
