//! Any bytes as a KV dump (a safetensors file) through `kvc_io`'s reader, from memory and from a
//! file: a typed error or a consistent dump that writes and reads back the same, never a panic.
//! Body: `kvc_io::fuzzing::load_dump`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvc_io::fuzzing::load_dump(data);
});
