//! An arbitrary small cache, a profile learned from it, encode then decode: exactly the promised
//! reconstruction, within `max_encoded_len`. Body: `codec_core::fuzzing::roundtrip_codec`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::roundtrip_codec(data));
