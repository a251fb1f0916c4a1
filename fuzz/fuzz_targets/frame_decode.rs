//! Any bytes as a sequence of wire-protocol frames (`spec/STREAM.md` §4), under the default and
//! small limits: each a message that re-encodes to its bytes, or a typed error, never a panic.
//! Body: `kvc_net::fuzzing::frame_decode`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvc_net::fuzzing::frame_decode(data);
});
