//! Arbitrary symbols and tables through `encode_lanes` and back through `LaneDecoder`: the same
//! symbols, clean lane ends, lane lengths within the 12-bits-per-symbol bound. Body:
//! `codec_core::fuzzing::roundtrip_rans`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::roundtrip_rans(data));
