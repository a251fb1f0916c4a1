//! A separate profile and a stream (`flags | profile_len u32 | profile | stream`, optionally with
//! the stream's profile hash and CRCs fixed up): parse the profile, decode the stream with it.
//! Body: `codec_core::fuzzing::decode_stream_profile`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::decode_stream_profile(data));
