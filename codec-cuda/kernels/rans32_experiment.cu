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
// Everything else (blocks, table lists, shared-memory staging, checks, the software-pipelined
// loop) is kvc_lanes.cuh's, which rans_decode.cu's kvc_rans_lane_decode runs with v2's coder:
// the two kernels differ only in the state arithmetic and the word size.

#include "kvc_lanes.cuh"

// The coder above for kvc_decode_lane: (x >> 12) < 2^20 times a frequency < 2^12 fits 32 bits.
struct KvcLaneCoder32 {
    typedef kvc_u32 State;
    typedef kvc_u16 Word;
    static __device__ __forceinline__ kvc_u32 word_bits() { return 16; }
    static __device__ __forceinline__ State low() { return 1u << 16; }
    static __device__ __forceinline__ State final_state() { return 1u << 16; }

    // A lane starts with two words at least (its last two are the state).
    static __device__ __forceinline__ bool starts(Word, kvc_u64 n) { return n >= 2; }
    static __device__ __forceinline__ bool starts_empty() { return false; }
};

// The v2 kernel's arguments with 16-bit words; block word counts are in 16-bit words.
typedef KvcLaneArgsOf<kvc_u16> KvcLane32Args;

KVC_KERNEL(kvc_rans32_lane_decode_experiment, KvcLane32Args, kvc_lane_stage_tables<kvc_u16>,
           kvc_lane_decode_listed<KvcLaneCoder32>)

#ifdef KVC_HOST
// The v2 kernel's layout report for this kernel's arguments (the Rust side launches it with the
// v2 kernel's mirrors, its words 16-bit).
extern "C" kvc_u64 kvc_rans32_lane_decode_experiment_layout(kvc_u64* out, kvc_u64 cap) {
    return kvc_lane_layout<kvc_u16>(out, cap);
}
#endif
