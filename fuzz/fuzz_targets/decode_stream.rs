//! Any bytes given to the stream decoder give a value or a typed error: never a panic, and never
//! an allocation beyond `codec_core::fuzzing::LIMITS`; a stream that decodes decodes a token
//! range to the same bits. Body: `codec_core::fuzzing::decode_stream`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::decode_stream(data));
