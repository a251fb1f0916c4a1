//! codec-cuda's kernels compiled for the host on any stream: the decode chain (its lane words
//! packed on the host or gathered from the stream's bytes) and the stepwise path accept
//! exactly what codec-core decodes, with its bits (f16 or bf16, dense or paged),
//! and fail the rest with a typed error. Input: `decode_stream_profile`'s, with two more flag
//! bits. Body: `codec_cuda::fuzzing::decode_chain`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    codec_cuda::fuzzing::decode_chain(data);
});
