#![allow(dead_code)]
use codec_core::{KvCache, KvMeta, KvShape, Rope, RopeStyle, Tensor};
use half::f16;

pub const SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/smollm2-gpl3-512.safetensors"
);
pub const SAMPLE_SHA256: &str = "0552ff78125c80f58dd056836d1414aba1669a6ca87730f7b0a6175555f4c7f6";

/// Loads a fixture dump (k.{i}, v.{i} f16 [T, H, D]; q.{i} [n_q, 9, D]).
pub fn load(path: &str, max_layers: usize) -> (KvCache, Vec<Vec<f32>>, usize, u64) {
    let bytes = std::fs::read(path).expect("fixture present");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    let f16s = |name: &str| -> (Vec<f16>, Vec<usize>) {
        let t = st.tensor(name).unwrap();
        (
            t.data()
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
            t.shape().to_vec(),
        )
    };
    let mut layers = 0;
    while st.tensor(&format!("k.{layers}")).is_ok() && layers < max_layers {
        layers += 1;
    }
    let (_, shape) = f16s("k.0");
    let s = KvShape {
        layers: layers as u32,
        kv_heads: shape[1] as u32,
        head_dim: shape[2] as u32,
        tokens: shape[0] as u32,
    };
    let k = (0..layers)
        .map(|i| Tensor::F16(f16s(&format!("k.{i}")).0))
        .collect();
    let v = (0..layers)
        .map(|i| Tensor::F16(f16s(&format!("v.{i}")).0))
        .collect();
    let q = (0..layers)
        .map(|i| {
            f16s(&format!("q.{i}"))
                .0
                .iter()
                .map(|x| x.to_f32())
                .collect()
        })
        .collect();
    let q_heads = f16s("q.0").1[1];
    let q_start: u64 = meta
        .get("q_start")
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    let theta: f32 = meta
        .get("rope_theta")
        .and_then(|x| x.parse().ok())
        .unwrap_or(10000.0);
    let kv_meta = KvMeta {
        model_id: meta.get("model").cloned().unwrap_or_default(),
        rope: Rope {
            theta,
            style: RopeStyle::NeoX,
            scaling: 1.0,
            k_pre_rope: false,
        },
        first_position: 0,
    };
    (
        KvCache {
            shape: s,
            k,
            v,
            meta: kv_meta,
        },
        q,
        q_heads,
        q_start,
    )
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
