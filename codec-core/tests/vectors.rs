//! Golden vectors (`spec/vectors/`): every valid stream decodes to exactly its stored output, and
//! every invalid one is rejected with the error kind the manifest names.
//!
//! `golden_vectors` walks the folder; it never regenerates anything, so a change to the decoder
//! that changes any output byte fails it. The vectors were written by `write_vectors` below
//! (`cargo test --release -p kvc-codec-core --test vectors -- --ignored write_vectors`), which
//! encodes seeded synthetic caches and a slice of the real 512-token sample. Rewriting them is a
//! format version change (spec/FORMAT.md §2): do it only together with a version bump. The
//! encoder and learner may change without one (they did since the vectors were written, and
//! `write_vectors` now writes other valid streams): the stored bytes are what pins the format.

mod common;

use common::crc32c;

use codec_core::container::Header;
use codec_core::{
    decode, encode, learn_profile, DecodeError, Dtype, EncodeParams, KvCache, KvMeta, KvShape,
    LearnParams, Limits, Profile, ProfileMode, Queries, Rope, RopeStyle, Sample, Tensor,
};
use half::{bf16, f16};
use serde_json::{json, Value};
use sha2::Digest;
use std::path::{Path, PathBuf};

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../spec/vectors")
}

/// The decoded tensors as the manifest's output files hold them: per layer K then V, each
/// `[T, H, D]` row-major, little-endian, in the stream's dtype.
fn output_bytes(c: &KvCache) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in c.k.iter().zip(&c.v) {
        for t in [k, v] {
            match t {
                Tensor::F16(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Tensor::Bf16(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Tensor::F32(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
            }
        }
    }
    out
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
        Dtype::F32 => "f32",
    }
}

fn limits_json(l: &Limits) -> Value {
    let d = Limits::DEFAULT;
    let mut m = serde_json::Map::new();
    let mut put = |name: &str, v: u64, dv: u64| {
        if v != dv {
            m.insert(name.into(), json!(v));
        }
    };
    put("max_layers", l.max_layers.into(), d.max_layers.into());
    put("max_channels", l.max_channels.into(), d.max_channels.into());
    put("max_tokens", l.max_tokens.into(), d.max_tokens.into());
    put("max_chunks", l.max_chunks.into(), d.max_chunks.into());
    put("max_elements", l.max_elements, d.max_elements);
    put(
        "max_profile_bytes",
        l.max_profile_bytes,
        d.max_profile_bytes,
    );
    if m.is_empty() {
        Value::Null
    } else {
        Value::Object(m)
    }
}

fn limits_from_json(v: &Value) -> Limits {
    let mut l = Limits::DEFAULT;
    if let Some(m) = v.as_object() {
        for (k, x) in m {
            let x = x.as_u64().expect("limit is an integer");
            match k.as_str() {
                "max_layers" => l.max_layers = x as u32,
                "max_channels" => l.max_channels = x as u32,
                "max_tokens" => l.max_tokens = x as u32,
                "max_chunks" => l.max_chunks = x as u32,
                "max_elements" => l.max_elements = x,
                "max_profile_bytes" => l.max_profile_bytes = x,
                other => panic!("unknown limit {other}"),
            }
        }
    }
    l
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn sha256(b: &[u8]) -> [u8; 32] {
    sha2::Sha256::digest(b).into()
}

#[test]
fn golden_vectors() {
    check_vectors(&vectors_dir());
}

/// The vectors written with profile version 2 (FORMAT.md §4.2), before version 3: decoders
/// still read them.
#[test]
fn golden_vectors_profile_v2() {
    check_vectors(&vectors_dir().join("v2"));
}

/// Chunks need not all have `chunk_tokens` tokens (FORMAT.md §3.3, §8.3): the vector whose
/// chunks hold 64, 64 and 32 tokens, its header saying up to 100 a chunk, decodes to the same
/// bytes; saying up to 63, it is refused (H28). Until 2026-11-29 codec-core refused the first
/// too, which the reference decoder, written from the spec, accepts
/// (`spec/reference/against_rust.py` found it on fuzz inputs).
#[test]
fn chunks_shorter_than_chunk_tokens_decode() {
    let dir = vectors_dir();
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let stream = read("v04-chunk-remainder.kvc");
    let profile = Profile::from_bytes(&read("v04-chunk-remainder.kvcp"), &Limits::DEFAULT).unwrap();
    let with_chunk_tokens = |n: u32| {
        let mut s = stream.clone();
        assert_eq!(s[48..52], 64u32.to_le_bytes(), "v04's chunk_tokens");
        s[48..52].copy_from_slice(&n.to_le_bytes());
        fix_header_crc(&mut s);
        decode(&s, Some(&profile), &Limits::DEFAULT)
    };
    let got = with_chunk_tokens(100).expect("chunks of 64, 64 and 32 tokens, up to 100 each");
    assert!(output_bytes(&got) == read("v04-chunk-remainder.out"));
    let err = with_chunk_tokens(63).expect_err("a chunk of 64 tokens, up to 63 each");
    assert_eq!(err.check(), Some("H28"), "{err}");
}

fn check_vectors(dir: &Path) {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest"))
            .expect("manifest is JSON");
    let read = |name: &Value| std::fs::read(dir.join(name.as_str().unwrap())).unwrap();
    let valid = manifest["valid"].as_array().unwrap();
    let invalid = manifest["invalid"].as_array().unwrap();
    assert!(valid.len() >= 16, "{} valid vectors", valid.len());
    assert!(invalid.len() >= 12, "{} invalid vectors", invalid.len());
    for v in valid {
        let name = v["name"].as_str().unwrap();
        let stream = read(&v["stream"]);
        let profile = (!v["profile"].is_null())
            .then(|| Profile::from_bytes(&read(&v["profile"]), &Limits::DEFAULT).unwrap());
        let limits = limits_from_json(&v["limits"]);
        let got = decode(&stream, profile.as_ref(), &limits)
            .unwrap_or_else(|e| panic!("valid vector {name}: {e}"));
        assert_eq!(
            dtype_name(got.dtype()),
            v["dtype"].as_str().unwrap(),
            "{name}"
        );
        let s = got.shape;
        assert_eq!(
            [s.layers, s.kv_heads, s.head_dim, s.tokens].map(u64::from),
            ["layers", "kv_heads", "head_dim", "tokens"].map(|k| v[k].as_u64().unwrap()),
            "{name}: shape"
        );
        let out = output_bytes(&got);
        let want = read(&v["output"]);
        assert_eq!(hex(&sha256(&want)), v["output_sha256"].as_str().unwrap());
        assert!(out == want, "valid vector {name}: decoded bytes differ");
    }
    for v in invalid {
        let name = v["name"].as_str().unwrap();
        let stream = read(&v["stream"]);
        let limits = limits_from_json(&v["limits"]);
        let res = match v["profile"].is_null() {
            true => decode(&stream, None, &limits),
            false => Profile::from_bytes(&read(&v["profile"]), &limits)
                .map_err(DecodeError::from)
                .and_then(|p| decode(&stream, Some(&p), &limits)),
        };
        match res {
            Ok(_) => panic!("invalid vector {name} decoded"),
            Err(e) => {
                assert_eq!(e.kind(), v["error"].as_str().unwrap(), "{name}: {e}");
                assert_eq!(e.to_string(), v["message"].as_str().unwrap(), "{name}");
                assert!(e.check().is_some(), "{name}: {e:?} names no spec check");
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Generation.

/// SplitMix64: a seeded, portable source of test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Approximately normal (sum of 4 uniforms), exact in every libm.
    fn normal(&mut self) -> f64 {
        (0..4).map(|_| self.unit()).sum::<f64>() * 1.732_050_8 - 2.0 * 1.732_050_8
    }
}

/// A synthetic cache: per-channel means and scales, tokens correlated with their predecessor, a
/// few outliers (which exercise escapes), one large-magnitude first token (an attention sink).
fn synthetic(shape: KvShape, dtype: Dtype, meta: KvMeta, seed: u64) -> KvCache {
    let mut rng = Rng(seed);
    let c = shape.channels();
    let mut make = |scale: f64| -> Tensor {
        let mean: Vec<f64> = (0..c).map(|_| rng.normal() * scale).collect();
        let sd: Vec<f64> = (0..c).map(|_| (0.2 + rng.unit() * 1.5) * scale).collect();
        let mut prev = vec![0f64; c];
        let mut x = Vec::with_capacity(shape.tensor_len());
        for t in 0..shape.tokens {
            for ch in 0..c {
                prev[ch] = 0.85 * prev[ch] + 0.5 * rng.normal();
                let mut v = mean[ch] + sd[ch] * prev[ch];
                if rng.unit() < 0.004 {
                    v += 40.0 * sd[ch] * if rng.unit() < 0.5 { -1.0 } else { 1.0 };
                }
                if t == 0 {
                    v *= 6.0;
                }
                x.push(v as f32);
            }
        }
        match dtype {
            Dtype::F16 => Tensor::F16(x.iter().map(|&v| f16::from_f32(v)).collect()),
            Dtype::Bf16 => Tensor::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect()),
            Dtype::F32 => Tensor::F32(x),
        }
    };
    let k = (0..shape.layers).map(|_| make(1.0)).collect();
    let v = (0..shape.layers).map(|_| make(0.3)).collect();
    KvCache { shape, k, v, meta }
}

fn shape(layers: u32, kv_heads: u32, head_dim: u32, tokens: u32) -> KvShape {
    KvShape {
        layers,
        kv_heads,
        head_dim,
        tokens,
    }
}

fn meta(style: RopeStyle, first_position: u64) -> KvMeta {
    KvMeta {
        model_id: "kvc golden vector".into(),
        rope: Rope {
            theta: 10000.0,
            style,
            scaling: 1.0,
            k_pre_rope: false,
        },
        first_position,
    }
}

/// The first `tokens` tokens of `c`.
fn prefix(c: &KvCache, tokens: u32) -> KvCache {
    let n = tokens as usize * c.shape.channels();
    let cut = |t: &Tensor| match t {
        Tensor::F16(x) => Tensor::F16(x[..n].to_vec()),
        Tensor::Bf16(x) => Tensor::Bf16(x[..n].to_vec()),
        Tensor::F32(x) => Tensor::F32(x[..n].to_vec()),
    };
    KvCache {
        shape: KvShape { tokens, ..c.shape },
        k: c.k.iter().map(cut).collect(),
        v: c.v.iter().map(cut).collect(),
        meta: c.meta.clone(),
    }
}

fn learn(c: &KvCache, queries: Option<(&[Vec<f32>], usize, u64)>) -> Profile {
    let params = LearnParams {
        chunk_tokens: 64,
        ..LearnParams::default()
    };
    let q = queries.map(|(q, q_heads, q_start)| Queries {
        q: q.iter().map(|l| l.as_slice()).collect(),
        q_heads,
        q_start,
    });
    learn_profile(
        &[Sample {
            kv: c.view(),
            queries: q,
        }],
        &params,
    )
    .unwrap()
}

/// Synthetic queries for `c`: per layer `[n_q, 2 * kv_heads, D]`, each a noisy copy of a
/// per-head direction, so that the profile gets importance hints.
fn synthetic_queries(c: &KvCache, n_q: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng(seed);
    let (qh, d) = (2 * c.shape.kv_heads as usize, c.shape.head_dim as usize);
    (0..c.shape.layers)
        .map(|_| {
            let dir: Vec<f64> = (0..qh * d).map(|_| rng.normal() * 2.0).collect();
            (0..n_q * qh * d)
                .map(|i| (dir[i % (qh * d)] + rng.normal()) as f32)
                .collect()
        })
        .collect()
}

struct Valid {
    name: &'static str,
    description: String,
    stream: Vec<u8>,
    profile: Option<Vec<u8>>,
    limits: Limits,
}

struct Invalid {
    name: &'static str,
    description: String,
    stream: Vec<u8>,
    profile: Option<Vec<u8>>,
    limits: Limits,
}

fn params(chunk_tokens: u32, group: u32, n_sink: u16, levels: &[u8]) -> EncodeParams {
    EncodeParams {
        chunk_tokens,
        group,
        n_sink,
        levels: levels.to_vec(),
        token_importance: true,
    }
}

fn header_len(s: &[u8]) -> usize {
    u32::from_le_bytes(s[8..12].try_into().unwrap()) as usize
}

fn fix_header_crc(s: &mut [u8]) {
    let hl = header_len(s);
    let c = crc32c(&s[..hl - 4]);
    s[hl - 4..hl].copy_from_slice(&c.to_le_bytes());
}

fn fix_trailing_crc(b: &mut [u8]) {
    let n = b.len() - 4;
    let c = crc32c(&b[..n]);
    b[n..].copy_from_slice(&c.to_le_bytes());
}

/// Offset of chunk index entry `i` in a stream.
fn entry_at(s: &[u8], i: usize) -> usize {
    let m = u16::from_le_bytes([s[100], s[101]]) as usize;
    102 + m + 24 * i
}

/// Byte range of chunk `i`.
fn chunk_range(s: &[u8], i: usize) -> std::ops::Range<usize> {
    let e = entry_at(s, i);
    let off = u64::from_le_bytes(s[e..e + 8].try_into().unwrap()) as usize;
    let len = u32::from_le_bytes(s[e + 8..e + 12].try_into().unwrap()) as usize;
    off..off + len
}

/// Replaces a stream's embedded profile by `p` (fixing lengths, offsets, hash and CRC).
fn with_embedded(s: &[u8], p: &[u8]) -> Vec<u8> {
    let mut h = Header::parse(s, &Limits::DEFAULT).unwrap();
    let hl = h.header_len();
    let rest = &s[hl + h.profile_len as usize..];
    h.profile_len = p.len() as u64;
    h.profile_hash = sha256(p);
    let mut out = h.to_bytes();
    out.extend_from_slice(p);
    out.extend_from_slice(rest);
    out
}

/// Replaces chunk `i` of a stream by `chunk` (fixing the index and the header CRC).
fn with_chunk(s: &[u8], i: usize, chunk: &[u8]) -> Vec<u8> {
    let mut h = Header::parse(s, &Limits::DEFAULT).unwrap();
    let body = h.header_len() + h.profile_len as usize;
    let mut rest = Vec::new();
    for j in 0..h.chunks.len() {
        if j == i {
            rest.extend_from_slice(chunk);
        } else {
            rest.extend_from_slice(&s[chunk_range(s, j)]);
        }
    }
    h.chunks[i].len_bytes = chunk.len() as u32;
    let mut out = h.to_bytes();
    out.extend_from_slice(&s[h.header_len()..body]);
    out.extend_from_slice(&rest);
    out
}

/// Bytes per channel-parameter record of a profile (by its version, FORMAT.md §4.2).
fn record_len(p: &[u8]) -> usize {
    if u16::from_le_bytes([p[4], p[5]]) >= 3 {
        7
    } else {
        13
    }
}

/// Offset of the first channel record's `delta_step` in a profile.
fn first_step_at(p: &[u8]) -> usize {
    24 + 4 * p[20] as usize + record_len(p) / 3
}

/// Offset of level 0's first table's first frequency in a profile.
fn first_freq_at(p: &[u8]) -> usize {
    let u32at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().unwrap()) as usize;
    let (l, h, d) = (u32at(8), u32at(12), u32at(16));
    let c = h * d;
    let n_levels = p[20] as usize;
    let hints = if p[21] & 1 != 0 {
        12 + 4 * (l * c + l * h)
    } else {
        0
    };
    24 + 4 * n_levels + record_len(p) * 2 * l * c + hints + 2 + 1
}

/// The caches and profiles most vectors are cut from: a synthetic f16 cache, a profile learned
/// from it, and one learned with synthetic queries (importance hints).
struct Sources {
    big: KvCache,
    prof: Profile,
    prof_q: Profile,
}

fn build() -> (Vec<Valid>, Vec<Invalid>) {
    let big = synthetic(shape(2, 2, 8, 160), Dtype::F16, meta(RopeStyle::NeoX, 0), 1);
    let q = synthetic_queries(&big, 16, 77);
    let src = Sources {
        prof: learn(&big, None),
        prof_q: learn(&big, Some((&q, 4, 144))),
        big,
    };
    let mut valid = Vec::new();
    layout_vectors(&src, &mut valid);
    sink_dtype_vectors(&src, &mut valid);
    hint_real_vectors(&src, &mut valid);
    // Invalid streams, mutations of a valid one, self-contained (`base`) or referenced.
    let base = enc(&src.big, &src.prof, true, &params(64, 10, 1, &[7]));
    let mut invalid = Vec::new();
    stream_mutations(&base, &mut invalid);
    profile_mutations(&src, &base, &mut invalid);
    let v = &mut invalid;
    let d = Limits::DEFAULT;
    let mut s = base.to_vec();
    s[12] = 3;
    fix_header_crc(&mut s);
    bad(
        v,
        "bad-dtype",
        "dtype code 3, header CRC recomputed",
        s,
        None,
        d,
    );
    (valid, invalid)
}

/// `c` encoded against `p`, embedded or referenced, with `ep`.
fn enc(c: &KvCache, p: &Profile, embedded: bool, ep: &EncodeParams) -> Vec<u8> {
    let mode = if embedded {
        ProfileMode::Embedded(p)
    } else {
        ProfileMode::Referenced(p)
    };
    encode(&c.view(), mode, ep).unwrap()
}

fn add(
    v: &mut Vec<Valid>,
    name: &'static str,
    description: String,
    stream: Vec<u8>,
    profile: Option<&Profile>,
) {
    v.push(Valid {
        name,
        description,
        stream,
        profile: profile.map(|p| p.as_bytes().to_vec()),
        limits: Limits::DEFAULT,
    })
}

fn bad(
    v: &mut Vec<Invalid>,
    name: &'static str,
    description: &str,
    stream: Vec<u8>,
    profile: Option<Vec<u8>>,
    limits: Limits,
) {
    v.push(Invalid {
        name,
        description: description.into(),
        stream,
        profile,
        limits,
    })
}

/// Tokens, groups, chunks and levels.
fn layout_vectors(src: &Sources, v: &mut Vec<Valid>) {
    let (big, prof) = (&src.big, &src.prof);
    let n_levels = prof.levels();
    let one = prefix(big, 1);
    add(
        v,
        "one-token",
        "f16, L=2 H=2 D=8, a single token (a sink row, stored raw); self-contained".into(),
        enc(&one, prof, true, &params(64, 10, 1, &[7])),
        None,
    );
    let one_ns = prefix(big, 1);
    add(
        v,
        "one-token-no-sink",
        "f16, a single token with n_sink = 0: one anchor row coded with the tables; referenced"
            .into(),
        enc(&one_ns, prof, false, &params(64, 10, 0, &[3])),
        Some(prof),
    );
    let rem = prefix(big, 27);
    add(
        v,
        "group-remainder",
        "f16, T=27 with G=10: two full groups and a 7-row remainder group; self-contained".into(),
        enc(&rem, prof, true, &params(64, 10, 1, &[5])),
        None,
    );
    add(
        v,
        "chunk-remainder",
        "f16, T=160 in chunks of 64: chunks of 64, 64 and 32 tokens; referenced".into(),
        enc(big, prof, false, &params(64, 10, 1, &[7])),
        Some(prof),
    );
    let every: Vec<u8> = (0..n_levels).collect();
    let t_every = 13 * n_levels as u32;
    add(
        v,
        "every-level",
        format!(
            "f16, T={t_every} in {n_levels} chunks of 13 tokens, chunk i at level i: every level of the profile; referenced"
        ),
        enc(&prefix(big, t_every), prof, false, &params(13, 10, 1, &every)),
        Some(prof),
    );
    add(
        v,
        "finest-level",
        "f16, T=100, level 0 (the finest) in one chunk; self-contained".into(),
        enc(&prefix(big, 100), prof, true, &params(128, 10, 1, &[0])),
        None,
    );
    add(
        v,
        "coarsest-level",
        format!(
            "f16, T=100, level {} (the coarsest) in one chunk; self-contained",
            n_levels - 1
        ),
        enc(
            &prefix(big, 100),
            prof,
            true,
            &params(128, 10, 1, &[n_levels - 1]),
        ),
        None,
    );
    add(
        v,
        "group-1",
        "f16, T=40, G=1: every row an anchor row; referenced".into(),
        enc(&prefix(big, 40), prof, false, &params(64, 1, 1, &[6])),
        Some(prof),
    );
    add(
        v,
        "group-larger-than-chunk",
        "f16, T=50 in chunks of 16 with G=100: every chunk is one partial group (one anchor row, the rest delta rows); referenced".into(),
        enc(&prefix(big, 50), prof, false, &params(16, 100, 1, &[4])),
        Some(prof),
    );
}

/// Sinks and positions, dtypes and metadata.
fn sink_dtype_vectors(src: &Sources, v: &mut Vec<Valid>) {
    let (big, prof) = (&src.big, &src.prof);
    let mut shifted = prefix(big, 60);
    shifted.meta.first_position = 3;
    add(
        v,
        "sinks-first-position",
        "f16, T=60, first_position 3 and n_sink 5: stream tokens 0 and 1 are sinks (positions 3, 4); chunks of 32; referenced".into(),
        enc(&shifted, prof, false, &params(32, 10, 5, &[7])),
        Some(prof),
    );
    let mut late = prefix(big, 30);
    late.meta.first_position = 1_000_000;
    add(
        v,
        "no-sinks-late-position",
        "f16, T=30, first_position 1000000, n_sink 4: no sink rows; self-contained".into(),
        enc(&late, prof, true, &params(64, 10, 4, &[8])),
        None,
    );
    let mut all_sink = prefix(big, 12);
    all_sink.meta.first_position = 0;
    add(
        v,
        "all-sinks",
        "f16, T=12, n_sink 100: every row is a sink row (stored raw); referenced".into(),
        enc(&all_sink, prof, false, &params(64, 10, 100, &[7])),
        Some(prof),
    );

    // Dtypes and metadata.
    for (name, dtype, desc) in [
        (
            "bf16-source",
            Dtype::Bf16,
            "bf16 source and output, L=2 H=2 D=8, T=70 in chunks of 32 (GPT-J rotary metadata, K pre-RoPE); self-contained",
        ),
        (
            "f32-source",
            Dtype::F32,
            "f32 source and output, L=2 H=2 D=8, T=70 in chunks of 32 (GPT-J rotary metadata, K pre-RoPE); self-contained",
        ),
    ] {
        let mut m = meta(RopeStyle::GptJ, 0);
        m.rope.k_pre_rope = true;
        m.rope.theta = 500000.0;
        m.model_id = "modèle-ß/κ (UTF-8 id)".into();
        let c = synthetic(shape(2, 2, 8, 70), dtype, m, 2 + dtype as u64);
        let p = learn(&c, None);
        add(v, name, desc.into(), enc(&c, &p, true, &params(32, 10, 1, &[6])), None);
    }
    let wide = synthetic(shape(1, 3, 16, 45), Dtype::F32, meta(RopeStyle::None, 0), 9);
    let wide_p = learn(&wide, None);
    add(
        v,
        "f32-one-layer-uniform",
        "f32, L=1 H=3 D=16, T=45, rope none, no importance hints: uniform steps; referenced".into(),
        enc(&wide, &wide_p, false, &params(20, 8, 1, &[2])),
        Some(&wide_p),
    );
}

/// Importance hints and step exponents (synthetic queries), the real fixture, no tokens.
fn hint_real_vectors(src: &Sources, v: &mut Vec<Valid>) {
    let (big, prof, prof_q) = (&src.big, &src.prof, &src.prof_q);
    add(
        v,
        "step-exponents",
        "f16, T=160 in chunks of 64 with a profile that carries importance hints: blocks carry step exponents; self-contained".into(),
        enc(big, prof_q, true, &params(64, 10, 1, &[7])),
        None,
    );
    let mut uni = params(64, 10, 1, &[7]);
    uni.token_importance = false;
    add(
        v,
        "hints-uniform-steps",
        "f16, T=160, profile with importance hints but encoded with uniform steps (n_exp = 0 in every block); referenced".into(),
        enc(big, prof_q, false, &uni),
        Some(prof_q),
    );

    // A slice of the real fixture: 3 layers of SmolLM2 at tokens 0..160, profile learned from the
    // whole 512-token sample (those 3 layers, with its queries).
    let (real, rq, q_heads, q_start) = common::load(common::SAMPLE, 3);
    let real_p = learn(&real, Some((&rq, q_heads, q_start)));
    let real_slice = prefix(&real, 160);
    add(
        v,
        "smollm2-slice",
        "real SmolLM2-135M cache (testdata/smollm2-gpl3-512, layers 0..3, tokens 0..160, f16, H=3 D=64), chunks of 64, default level 7, step exponents from the profile's hints; referenced".into(),
        enc(&real_slice, &real_p, false, &params(64, 10, 1, &[7])),
        Some(&real_p),
    );
    add(
        v,
        "smollm2-slice-self-contained",
        "the same real slice at level 2, tokens 0..96, self-contained".into(),
        enc(&prefix(&real, 96), &real_p, true, &params(96, 10, 1, &[2])),
        None,
    );
    let empty = prefix(big, 0);
    add(
        v,
        "zero-tokens",
        "f16, T=0: no chunks, only the header and the embedded profile; self-contained".into(),
        enc(&empty, prof, true, &params(64, 10, 1, &[7])),
        None,
    );
}

/// The stream's own bytes damaged: cut short, its header, its lanes, its index, its limits.
fn stream_mutations(base: &[u8], v: &mut Vec<Invalid>) {
    let d = Limits::DEFAULT;
    bad(v, "empty", "zero bytes", Vec::new(), None, d);
    bad(
        v,
        "truncated-header",
        "the first 60 bytes of a valid stream",
        base[..60].to_vec(),
        None,
        d,
    );
    bad(
        v,
        "truncated-last-chunk",
        "a valid self-contained stream without its last 5 bytes",
        base[..base.len() - 5].to_vec(),
        None,
        d,
    );
    let mut s = base.to_vec();
    s[3] = b'X';
    bad(v, "bad-magic", "magic \"KVCX\"", s, None, d);
    let mut s = base.to_vec();
    s[4] = 1;
    fix_header_crc(&mut s);
    bad(
        v,
        "version-1",
        "stream version 1 (header CRC recomputed)",
        s,
        None,
        d,
    );
    let mut s = base.to_vec();
    s[28] ^= 0x01;
    bad(
        v,
        "header-crc",
        "one bit of the token count flipped, header CRC not updated",
        s,
        None,
        d,
    );
    lane_mutations(base, v);
    index_and_limit_mutations(base, v);
}

/// Block (0, K) of chunk 1's lane 0 damaged.
fn lane_mutations(base: &[u8], v: &mut Vec<Invalid>) {
    let d = Limits::DEFAULT;
    // Block (0, K) of chunk 1 (no sink rows): where lane 0's words start, and how many it has.
    let r = chunk_range(base, 1);
    let u32at = |o: usize| u32::from_le_bytes(base[o..o + 4].try_into().unwrap()) as usize;
    let (n_esc, lane0, n_exp) = (
        u32at(r.start),
        u32at(r.start + 4),
        base[r.start + 4 + 128] as usize,
    );
    let words = r.start + 4 + 128 + 1 + 2 * n_exp + 4 * n_esc;
    assert!(lane0 > 0);
    let mut s = base.to_vec();
    s[words + 4 * (lane0 - 1)..words + 4 * lane0].fill(0);
    fix_trailing_crc(&mut s[r.clone()]);
    bad(
        v,
        "lane-zero-final-word",
        "chunk 1, block (0, K): lane 0's last word (the first one decoded) set to 0, chunk CRC recomputed",
        s,
        None,
        d,
    );
    let mut chunk = base[r.clone()].to_vec();
    let rel = words - r.start;
    chunk[4..8].copy_from_slice(&(lane0 as u32 + 1).to_le_bytes());
    chunk.splice(rel..rel, 0x1234_5678u32.to_le_bytes());
    fix_trailing_crc(&mut chunk);
    bad(
        v,
        "lane-trailing-word",
        "chunk 1, block (0, K): an extra word 0x12345678 inserted before lane 0's words and counted in lane_len[0]; the lane decoder refills from it and the lane does not end in state 0 (chunk CRC, length and header recomputed)",
        with_chunk(base, 1, &chunk),
        None,
        d,
    );
}

/// The header's reserved byte, the chunk index, bytes after the chunks, and limits.
fn index_and_limit_mutations(base: &[u8], v: &mut Vec<Invalid>) {
    let d = Limits::DEFAULT;
    let mut s = base.to_vec();
    s[15] = 1;
    fix_header_crc(&mut s);
    bad(
        v,
        "header-reserved",
        "the header's reserved byte (offset 15) set to 1, CRC recomputed",
        s,
        None,
        d,
    );
    let mut s = base.to_vec();
    let e = entry_at(&s, 0);
    s[e + 20] = 200;
    fix_header_crc(&mut s);
    bad(
        v,
        "unknown-level",
        "chunk 0 at level 200 (the profile has 12), header CRC recomputed",
        s,
        None,
        d,
    );
    let mut s = base.to_vec();
    let e = entry_at(&s, 2);
    let len = u32::from_le_bytes(s[e + 8..e + 12].try_into().unwrap());
    s[e + 8..e + 12].copy_from_slice(&(len + 1000).to_le_bytes());
    fix_header_crc(&mut s);
    bad(
        v,
        "chunk-past-input",
        "the last chunk's len_bytes 1000 larger than the bytes present, header CRC recomputed",
        s,
        None,
        d,
    );
    let mut s = base.to_vec();
    s.extend_from_slice(&[0, 0, 0]);
    bad(
        v,
        "trailing-bytes",
        "three zero bytes after the last chunk",
        s,
        None,
        d,
    );
    let mut s = base.to_vec();
    s[16..20].copy_from_slice(&5000u32.to_le_bytes());
    fix_header_crc(&mut s);
    bad(
        v,
        "layers-past-limit",
        "layers = 5000, past the default max_layers 1024 (header CRC recomputed)",
        s,
        None,
        d,
    );
    bad(
        v,
        "tokens-past-caller-limit",
        "a valid stream of 160 tokens decoded with max_tokens = 100",
        base.to_vec(),
        None,
        Limits {
            max_tokens: 100,
            ..d
        },
    );
    bad(
        v,
        "elements-past-caller-limit",
        "a valid stream (2*2*160*16 = 10240 elements) decoded with max_elements = 10000",
        base.to_vec(),
        None,
        Limits {
            max_elements: 10000,
            ..d
        },
    );
}

/// Profiles missing, wrong or damaged, referenced or embedded.
fn profile_mutations(src: &Sources, base: &[u8], v: &mut Vec<Invalid>) {
    let d = Limits::DEFAULT;
    let (big, prof, prof_q) = (&src.big, &src.prof, &src.prof_q);
    let prof_bytes = prof.as_bytes().to_vec();
    let refd = enc(big, prof, false, &params(64, 10, 1, &[7]));
    bad(
        v,
        "profile-required",
        "a stream that references its profile, decoded without one",
        refd.clone(),
        None,
        d,
    );
    bad(
        v,
        "wrong-profile",
        "a stream that references one profile, decoded with another of the same shape",
        refd.clone(),
        Some(prof_q.as_bytes().to_vec()),
        d,
    );
    let mut p = prof_bytes.clone();
    let at = p.len() / 2;
    p[at] ^= 0x01;
    bad(
        v,
        "profile-crc",
        "a referenced stream with its profile file corrupted by one bit (profile CRC mismatch)",
        refd.clone(),
        Some(p),
        d,
    );
    let mut p = prof_bytes.clone();
    let at = first_freq_at(&p);
    p[at] = p[at].wrapping_add(1);
    fix_trailing_crc(&mut p);
    bad(
        v,
        "malformed-table",
        "embedded profile whose first table's frequencies sum to 4097 (profile CRC, hash and header CRC recomputed)",
        with_embedded(base, &p),
        None,
        d,
    );
    let mut p = prof_bytes.clone();
    let at = first_step_at(&p);
    p[at..at + 2].copy_from_slice(&[0, 0]);
    fix_trailing_crc(&mut p);
    bad(
        v,
        "zero-step",
        "embedded profile whose first channel's delta_step is bf16 +0 (profile CRC, hash and header CRC recomputed)",
        with_embedded(base, &p),
        None,
        d,
    );
    let mut p = prof_bytes.clone();
    p[4] = 4;
    fix_trailing_crc(&mut p);
    bad(
        v,
        "profile-version-4",
        "embedded profile of version 4 (profile CRC, hash and header CRC recomputed)",
        with_embedded(base, &p),
        None,
        d,
    );
    let other = synthetic(shape(2, 2, 4, 40), Dtype::F16, meta(RopeStyle::NeoX, 0), 5);
    let other_p = learn(&other, None);
    bad(
        v,
        "profile-shape",
        "embedded profile of another shape (head_dim 4, not 8), hash and header CRC recomputed",
        with_embedded(base, other_p.as_bytes()),
        None,
        d,
    );
}

/// Writes `spec/vectors/`. Run by hand; see the module docs.
#[test]
#[ignore]
fn write_vectors() {
    let dir = vectors_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let (valid, invalid) = build();
    let mut vj = Vec::new();
    let mut ij = Vec::new();
    for (i, v) in valid.iter().enumerate() {
        let stem = format!("v{:02}-{}", i + 1, v.name);
        let prof = v.profile.as_ref().map(|p| {
            let f = format!("{stem}.kvcp");
            std::fs::write(dir.join(&f), p).unwrap();
            f
        });
        let profile = v
            .profile
            .as_ref()
            .map(|p| Profile::from_bytes(p, &Limits::DEFAULT).unwrap());
        let got = decode(&v.stream, profile.as_ref(), &v.limits).unwrap();
        let out = output_bytes(&got);
        std::fs::write(dir.join(format!("{stem}.kvc")), &v.stream).unwrap();
        std::fs::write(dir.join(format!("{stem}.out")), &out).unwrap();
        let s = got.shape;
        vj.push(json!({
            "name": v.name,
            "description": v.description,
            "stream": format!("{stem}.kvc"),
            "profile": prof,
            "limits": limits_json(&v.limits),
            "dtype": dtype_name(got.dtype()),
            "layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "tokens": s.tokens,
            "output": format!("{stem}.out"),
            "output_sha256": hex(&sha256(&out)),
        }));
    }
    for (i, v) in invalid.iter().enumerate() {
        let stem = format!("x{:02}-{}", i + 1, v.name);
        let prof = v.profile.as_ref().map(|p| {
            let f = format!("{stem}.kvcp");
            std::fs::write(dir.join(&f), p).unwrap();
            f
        });
        std::fs::write(dir.join(format!("{stem}.kvc")), &v.stream).unwrap();
        let res = match &v.profile {
            None => decode(&v.stream, None, &v.limits),
            Some(p) => Profile::from_bytes(p, &v.limits)
                .map_err(DecodeError::from)
                .and_then(|p| decode(&v.stream, Some(&p), &v.limits)),
        };
        let Err(err) = res else {
            panic!("invalid vector {} decodes", v.name)
        };
        ij.push(json!({
            "name": v.name,
            "description": v.description,
            "stream": format!("{stem}.kvc"),
            "profile": prof,
            "limits": limits_json(&v.limits),
            "error": err.kind(),
            "message": err.to_string(),
        }));
    }
    let m = json!({
        "format": "kvc stream version 2, profile version 3 (spec/FORMAT.md)",
        "output_layout": "per layer i = 0..L-1: K then V, each [T, H, D] row-major, little-endian, in the stream's dtype",
        "valid": vj,
        "invalid": ij,
    });
    let mut text = serde_json::to_string_pretty(&m).unwrap();
    text.push('\n');
    std::fs::write(dir.join("manifest.json"), text).unwrap();
}
