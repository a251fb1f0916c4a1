//! codec-cuda's encode kernels compiled for the host on a small cache derived from the input:
//! the stream assembled around the chain's chunks is the one codec-core writes, byte for byte.
//! Input: `roundtrip_codec`'s. Body: `codec_cuda::fuzzing::encode_chain`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    codec_cuda::fuzzing::encode_chain(data);
});
