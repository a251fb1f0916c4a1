//! Any bytes given to the stream decoder give a value or a typed error: never a panic, and never
//! an allocation beyond the limits set here.
#![no_main]
use codec_core::{decode, Limits};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_layers: 64,
    max_channels: 4096,
    max_tokens: 1 << 16,
    max_chunks: 1 << 12,
    max_elements: 1 << 22,
    max_profile_bytes: 1 << 24,
};

fuzz_target!(|data: &[u8]| {
    let _ = decode(data, None, &LIMITS);
});
