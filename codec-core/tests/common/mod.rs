#![allow(dead_code)]
use codec_core::KvCache;

pub const SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/smollm2-gpl3-512.safetensors"
);
pub const SAMPLE_SHA256: &str = "0552ff78125c80f58dd056836d1414aba1669a6ca87730f7b0a6175555f4c7f6";

/// Loads a fixture dump with the workspace's one loader (`kvc_io::load_dump`), keeping its first
/// `max_layers` layers: the cache, the queries per layer `[n_q, q_heads, D]`, the query heads and
/// the first query's position.
pub fn load(path: &str, max_layers: usize) -> (KvCache, Vec<Vec<f32>>, usize, u64) {
    let mut d = kvc_io::load_dump(std::path::Path::new(path)).expect("fixture present");
    d.keep_layers(max_layers);
    let q = d.q.expect("the fixture has queries");
    (d.kv, q, d.q_heads, d.q_start)
}

/// A profile learned with the default parameters from `cache` and its queries (as [`load`]
/// returns them), so that streams coded with it carry step exponents.
pub fn learn_with_queries(
    cache: &KvCache,
    q: &[Vec<f32>],
    q_heads: usize,
    q_start: u64,
) -> codec_core::Profile {
    let queries = codec_core::Queries {
        q: q.iter().map(Vec::as_slice).collect(),
        q_heads,
        q_start,
    };
    let sample = codec_core::Sample {
        kv: cache.view(),
        queries: Some(queries),
    };
    codec_core::learn_profile(&[sample], &codec_core::LearnParams::default()).unwrap()
}

/// CRC-32C, bitwise, exactly as spec/FORMAT.md §3.4 writes it (an independent oracle for the
/// crate's table-driven one).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = (crc >> 1) ^ if crc & 1 != 0 { 0x82F6_3B78 } else { 0 };
        }
    }
    crc ^ 0xFFFF_FFFF
}
