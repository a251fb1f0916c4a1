//! Shared helpers for the benches and examples: fixture paths and dumps (loaded by kvc-io, the
//! workspace's one loader), a self-learned profile, and the pq benches' data.

use kvc_io::{Dump, Silent};
use std::path::{Path, PathBuf};

/// The 512-token SmolLM2 sample that ships in `testdata/`.
pub fn sample_path() -> PathBuf {
    kvc_io::fixtures::sample()
}

/// The 2048-token fixture in `../shared/fixtures/`, if present.
pub fn big_fixture_path() -> Option<PathBuf> {
    kvc_io::fixtures::shared("smollm2-gpl3-2048.safetensors")
}

/// Loads a fixture dump; panics (the bench cannot run) if it is absent or malformed.
pub fn load(path: &Path) -> Dump {
    kvc_io::load_dump(path).unwrap_or_else(|e| panic!("fixture: {e}"))
}

/// A profile learned from the dump itself, with its queries (default parameters).
pub fn self_profile(d: &Dump) -> codec_core::Profile {
    kvc_io::policy::learn(&[d], &mut Silent).expect("profile")
}

/// The pq benches' data: layer `layer`'s keys of KV head 0 (2048 tokens, from the 2048-token
/// fixture when present, else the 512-token sample tiled 4 times) and the stored query heads that
/// attend to that KV head (GQA: heads `0..q_heads / kv_heads` of each stored query), flat
/// `[_, D]` (the first one is the query of the single-query benches), and `D`.
pub fn pq_keys_and_queries(layer: usize) -> (Vec<f32>, Vec<f32>, usize) {
    let f = load(&big_fixture_path().unwrap_or_else(sample_path));
    let s = f.kv.shape;
    let (h, d, t) = (s.kv_heads as usize, s.head_dim as usize, s.tokens as usize);
    let all = f.kv.k[layer].to_f32_vec();
    let mut keys = Vec::with_capacity(2048 * d);
    while keys.len() < 2048 * d {
        for tok in 0..t {
            if keys.len() == 2048 * d {
                break;
            }
            keys.extend_from_slice(&all[tok * h * d..tok * h * d + d]);
        }
    }
    let group = f.q_heads / h;
    let q = f.q.as_ref().expect("the fixture has queries");
    let qs = q[layer]
        .chunks_exact(f.q_heads * d)
        .flat_map(|q| q[..group * d].iter().copied())
        .collect();
    (keys, qs, d)
}
