//! Any bytes as a profile (`flags | bytes`, optionally with the CRC fixed up): a typed error, or a
//! profile whose bytes, hash, re-parse and `from_parts` rebuild agree. Body:
//! `codec_core::fuzzing::decode_profile`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::decode_profile(data));
