//! Any bytes as an `m = 2` score table and codes (layout in `pq_core::fuzzing::pq_search`):
//! `pq_core::search` (the AVX-512 fixed-point kernel where the CPU has it) returns exactly
//! `select(scores(..))`. Body: `pq_core::fuzzing::pq_search`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    pq_core::fuzzing::pq_search(data);
});
