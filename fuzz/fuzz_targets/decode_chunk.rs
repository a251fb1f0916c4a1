//! Any bytes as one chunk (after a 21-byte `ChunkCase`: rows, level, token_start, ...) decoded with
//! a fixed vector profile: `Ok` or a typed error, never a panic. Body:
//! `codec_core::fuzzing::decode_chunk`.
#![no_main]
use codec_core::profile::Profile;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static PROFILE: OnceLock<Profile> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let profile = PROFILE.get_or_init(codec_core::fuzzing::chunk_profile);
    codec_core::fuzzing::decode_chunk(profile, data);
});
