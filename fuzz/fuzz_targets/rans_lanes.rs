//! Arbitrary lane words through `LaneDecoder::new` / `decode` / `finish` with fixed tables: never a
//! panic, and the same symbols and errors as a plain reference decoder. Body:
//! `codec_core::fuzzing::rans_lanes`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::rans_lanes(data));
