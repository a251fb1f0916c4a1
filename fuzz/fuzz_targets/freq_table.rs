//! Arbitrary frequencies through `FreqTable::new` / `from_counts` / `DecodeTable`, and lanes decoded
//! with an accepted table against the reference decoder. Body: `codec_core::fuzzing::freq_table`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| codec_core::fuzzing::freq_table(data));
