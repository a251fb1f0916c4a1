//! Shared loaders for the benches.

use codec_core::{KvCache, KvMeta, KvShape, Rope, RopeStyle, Tensor};
use half::f16;
use std::path::{Path, PathBuf};

/// The 512-token SmolLM2 sample that ships in `testdata/`.
pub fn sample_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/smollm2-gpl3-512.safetensors")
}

/// The 2048-token fixture in `../shared/fixtures/`, if present.
pub fn big_fixture_path() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/smollm2-gpl3-2048.safetensors");
    p.exists().then_some(p)
}

/// A fixture dump: the cache (f16) and per layer its queries `[n_q, q_heads, D]` as f32.
#[derive(Debug)]
pub struct Fixture {
    /// The cache.
    pub kv: KvCache,
    /// Queries per layer.
    pub q: Vec<Vec<f32>>,
    /// Query heads.
    pub q_heads: usize,
    /// Cache index of the first query.
    pub q_start: u64,
}

impl Fixture {
    /// A profile learned from this dump itself, with its queries (default parameters).
    pub fn self_profile(&self) -> codec_core::Profile {
        codec_core::learn_profile(
            &[codec_core::Sample {
                kv: self.kv.view(),
                queries: Some(codec_core::Queries {
                    q: self.q.iter().map(|l| l.as_slice()).collect(),
                    q_heads: self.q_heads,
                    q_start: self.q_start,
                }),
            }],
            &codec_core::LearnParams::default(),
        )
        .expect("profile")
    }
}

/// Loads a fixture dump (`k.{i}`, `v.{i}` f16 `[T, H, D]`, `q.{i}` f16 `[n_q, q_heads, D]`).
pub fn load(path: &Path) -> Fixture {
    let bytes = std::fs::read(path).expect("fixture present");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("metadata");
    let meta = meta.metadata().clone().unwrap_or_default();
    let f16s = |name: &str| -> (Vec<f16>, Vec<usize>) {
        let t = st.tensor(name).expect("tensor");
        let v = t
            .data()
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        (v, t.shape().to_vec())
    };
    let mut layers = 0;
    while st.tensor(&format!("k.{layers}")).is_ok() {
        layers += 1;
    }
    let shape = f16s("k.0").1;
    let kv = KvCache {
        shape: KvShape {
            layers,
            kv_heads: shape[1] as u32,
            head_dim: shape[2] as u32,
            tokens: shape[0] as u32,
        },
        k: (0..layers)
            .map(|i| Tensor::F16(f16s(&format!("k.{i}")).0))
            .collect(),
        v: (0..layers)
            .map(|i| Tensor::F16(f16s(&format!("v.{i}")).0))
            .collect(),
        meta: KvMeta {
            model_id: meta.get("model").cloned().unwrap_or_default(),
            rope: Rope {
                theta: meta
                    .get("rope_theta")
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(10000.0),
                style: RopeStyle::NeoX,
                scaling: 1.0,
                k_pre_rope: false,
            },
            first_position: 0,
        },
    };
    let q = (0..layers)
        .map(|i| {
            f16s(&format!("q.{i}"))
                .0
                .iter()
                .map(|x| x.to_f32())
                .collect()
        })
        .collect();
    Fixture {
        kv,
        q,
        q_heads: f16s("q.0").1[1],
        q_start: meta
            .get("q_start")
            .and_then(|x| x.parse().ok())
            .unwrap_or(0),
    }
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
    let qs = f.q[layer]
        .chunks_exact(f.q_heads * d)
        .flat_map(|q| q[..group * d].iter().copied())
        .collect();
    (keys, qs, d)
}
