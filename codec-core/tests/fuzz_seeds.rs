//! Writes the fuzz seed corpora `fuzz/seeds/<target>/gen-*` from the golden vectors
//! (`spec/vectors/`, via their manifest) and from small seeded synthetic caches. Ignored by
//! default; run it after a change to a harness's input layout or to the vectors:
//!
//! ```text
//! cargo test --release -p kvc-codec-core --test fuzz_seeds -- --ignored
//! ```
//!
//! It deletes every `gen-*` file of each seed directory first and leaves other files (hand-made
//! seeds) alone. The output is deterministic.

use codec_core::container::Header;
use codec_core::fuzzing::{
    chunk_input, chunk_profile, fixed_tables, freq_table_input, rans_lanes_input,
    stream_profile_input, ChunkCase, Target, PROFILE_FIX_CRC, STREAM_PROFILE_FIX_CRCS,
    STREAM_PROFILE_FIX_HASH,
};
use codec_core::rans::{encode_lanes, FreqTable, LANES};
use codec_core::{
    encode, learn_profile, ChunkContext, Dtype, EncodeParams, KvCache, KvMeta, KvShape,
    LearnParams, Limits, Profile, ProfileMode, Queries, Rope, RopeStyle, Sample, Stream, Tensor,
};
use half::{bf16, f16};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A deterministic pseudo-random stream (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Roughly normal, mean 0, standard deviation 1.
    fn normal(&mut self) -> f32 {
        (0..4)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
            .sum::<f32>()
            * 1.732
            - 3.464
    }
}

/// A synthetic cache: per-channel offsets and scales, smooth along tokens, a few outliers.
fn synthetic(shape: KvShape, dtype: Dtype, first_position: u64, seed: u64) -> KvCache {
    let mut rng = Rng(seed | 1);
    let c = shape.channels();
    let mut tensor = || {
        let off: Vec<f32> = (0..c).map(|_| rng.normal() * 0.5).collect();
        let scale: Vec<f32> = (0..c)
            .map(|_| 0.1 + (rng.next() % 100) as f32 / 50.0)
            .collect();
        let mut prev = vec![0f32; c];
        let vals: Vec<f32> = (0..shape.tensor_len())
            .map(|i| {
                let ch = i % c;
                let mut x = 0.7 * prev[ch] + 0.3 * rng.normal();
                if rng.next().is_multiple_of(97) {
                    x *= 20.0;
                }
                prev[ch] = x;
                off[ch] + scale[ch] * x
            })
            .collect();
        match dtype {
            Dtype::F16 => Tensor::F16(vals.iter().map(|&x| f16::from_f32(x)).collect()),
            Dtype::Bf16 => Tensor::Bf16(vals.iter().map(|&x| bf16::from_f32(x)).collect()),
            Dtype::F32 => Tensor::F32(vals),
        }
    };
    let k = (0..shape.layers).map(|_| tensor()).collect();
    let v = (0..shape.layers).map(|_| tensor()).collect();
    KvCache {
        shape,
        k,
        v,
        meta: KvMeta {
            model_id: "fuzz-seed".into(),
            rope: Rope {
                theta: 10000.0,
                style: RopeStyle::NeoX,
                scaling: 1.0,
                k_pre_rope: false,
            },
            first_position,
        },
    }
}

/// Queries for `cache`: `n_q` rows of `2 * kv_heads` heads per layer.
fn queries(cache: &KvCache, n_q: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng(seed | 1);
    let per = n_q * 2 * cache.shape.channels();
    (0..cache.shape.layers)
        .map(|_| (0..per).map(|_| rng.normal()).collect())
        .collect()
}

fn learn(cache: &KvCache, q: Option<&[Vec<f32>]>, levels: &[f32], chunk_tokens: u32) -> Profile {
    let queries = q.map(|q| Queries {
        q: q.iter().map(Vec::as_slice).collect(),
        q_heads: 2 * cache.shape.kv_heads as usize,
        q_start: u64::from(cache.shape.tokens / 2),
    });
    learn_profile(
        &[Sample {
            kv: cache.view(),
            queries,
        }],
        &LearnParams {
            level_mult: levels.to_vec(),
            chunk_tokens,
            calibration_rounds: 2,
            ..LearnParams::default()
        },
    )
    .unwrap()
}

/// The seeds of one run: target name -> (file name -> bytes).
#[derive(Default)]
struct Seeds(BTreeMap<&'static str, BTreeMap<String, Vec<u8>>>);

impl Seeds {
    fn add(&mut self, target: Target, name: impl Into<String>, bytes: Vec<u8>) {
        let name = format!("gen-{}", name.into());
        let prev = self
            .0
            .entry(target.name())
            .or_default()
            .insert(name.clone(), bytes);
        assert!(prev.is_none(), "duplicate seed {name}");
    }
}

/// One valid vector, decoded.
struct Vector {
    name: String,
    stream: Vec<u8>,
    profile_file: Option<Vec<u8>>,
    header: Header,
    profile: Profile,
    cache: KvCache,
}

fn valid_vectors() -> Vec<Vector> {
    let dir = root().join("spec/vectors");
    let manifest: Value = serde_json::from_slice(&read(&dir.join("manifest.json"))).unwrap();
    let mut out = Vec::new();
    for v in manifest["valid"].as_array().unwrap() {
        let stream = read(&dir.join(v["stream"].as_str().unwrap()));
        let profile_file = v["profile"].as_str().map(|p| read(&dir.join(p)));
        let supplied = profile_file
            .as_ref()
            .map(|b| Profile::from_bytes(b, &Limits::DEFAULT).unwrap());
        let s = Stream::open(&stream, supplied.as_ref(), &Limits::DEFAULT).unwrap();
        let (header, profile, cache) =
            (s.header().clone(), s.profile().clone(), s.decode().unwrap());
        out.push(Vector {
            name: v["name"].as_str().unwrap().to_string(),
            stream,
            profile_file,
            header,
            profile,
            cache,
        });
    }
    out
}

/// `v` re-encoded with a profile holding only the levels its chunks use (a much smaller
/// profile): `(reduced profile, params)`.
fn reduced(v: &Vector) -> (Profile, EncodeParams) {
    let mut used: Vec<u8> = v.header.chunks.iter().map(|e| e.level).collect();
    used.sort_unstable();
    used.dedup();
    if used.is_empty() {
        used.push(0);
    }
    let p = v.profile.with_levels(&used);
    let levels = if v.header.chunks.is_empty() {
        vec![0]
    } else {
        v.header
            .chunks
            .iter()
            .map(|e| used.iter().position(|&l| l == e.level).unwrap() as u8)
            .collect()
    };
    let params = EncodeParams {
        chunk_tokens: v.header.chunk_tokens,
        group: u32::from(v.header.group),
        n_sink: v.header.n_sink,
        levels,
        token_importance: true,
    };
    (p, params)
}

fn case_of(h: &Header, i: usize) -> ChunkCase {
    let e = h.chunks[i];
    ChunkCase {
        keep_crc: false,
        level: e.level,
        rows: e.tokens,
        token_start: e.token_start,
        dtype: h.dtype,
        group: u32::from(h.group),
        n_sink: h.n_sink,
        first_position: h.meta.first_position,
    }
}

fn chunk_of<'a>(stream: &'a [u8], h: &Header, i: usize) -> &'a [u8] {
    let e = h.chunks[i];
    &stream[e.offset as usize..e.offset as usize + e.len_bytes as usize]
}

fn stream_seeds(seeds: &mut Seeds, vectors: &[Vector]) {
    let dir = root().join("spec/vectors");
    // Small vector streams as they are (valid and invalid).
    for name in [
        "v02-one-token-no-sink.kvc",
        "v04-chunk-remainder.kvc",
        "v08-group-1.kvc",
        "v10-sinks-first-position.kvc",
        "v12-all-sinks.kvc",
        "v15-f32-one-layer-uniform.kvc",
        "v17-hints-uniform-steps.kvc",
        "x01-empty.kvc",
        "x02-truncated-header.kvc",
    ] {
        seeds.add(Target::DecodeStream, name, read(&dir.join(name)));
    }
    // Every valid vector, self-contained with only the levels it uses.
    for v in vectors {
        let (p, params) = reduced(v);
        let s = encode(&v.cache.view(), ProfileMode::Embedded(&p), &params).unwrap();
        seeds.add(Target::DecodeStream, format!("{}-embedded.kvc", v.name), s);
        let s = encode(&v.cache.view(), ProfileMode::Referenced(&p), &params).unwrap();
        let input = stream_profile_input(
            STREAM_PROFILE_FIX_HASH | STREAM_PROFILE_FIX_CRCS,
            p.as_bytes(),
            &s,
        );
        seeds.add(
            Target::DecodeStreamProfile,
            format!("{}.bin", v.name),
            input,
        );
    }
    // Two vector pairs as they are, no fix-ups.
    for v in vectors
        .iter()
        .filter(|v| v.name == "chunk-remainder" || v.name == "f32-one-layer-uniform")
    {
        let input = stream_profile_input(0, v.profile_file.as_ref().unwrap(), &v.stream);
        seeds.add(
            Target::DecodeStreamProfile,
            format!("{}-raw.bin", v.name),
            input,
        );
    }
}

fn profile_seeds(seeds: &mut Seeds, vectors: &[Vector]) {
    let mut seen = Vec::new();
    for v in vectors {
        if seen.contains(&v.profile.hash()) {
            continue;
        }
        seen.push(v.profile.hash());
        let last = v.profile.levels() - 1;
        for level in [0, last] {
            let p = v.profile.with_levels(&[level]);
            let mut b = vec![0u8];
            b.extend_from_slice(p.as_bytes());
            seeds.add(
                Target::DecodeProfile,
                format!("{}-level{level}.kvcp", v.name),
                b,
            );
        }
    }
    // Synthetic small profiles, with and without importance hints.
    for (i, (shape, with_q)) in [
        ((1, 1, 1, 12), false),
        ((1, 1, 2, 30), true),
        ((2, 2, 4, 40), true),
        ((1, 3, 3, 25), false),
    ]
    .into_iter()
    .enumerate()
    {
        let (layers, kv_heads, head_dim, tokens) = shape;
        let shape = KvShape {
            layers,
            kv_heads,
            head_dim,
            tokens,
        };
        let cache = synthetic(shape, Dtype::F16, 0, 100 + i as u64);
        let q = queries(&cache, 3, 200 + i as u64);
        let p = learn(&cache, with_q.then_some(&q[..]), &[0.5, 2.0], 16);
        let mut b = vec![0u8];
        b.extend_from_slice(p.as_bytes());
        seeds.add(
            Target::DecodeProfile,
            format!("synthetic-{i}.kvcp"),
            b.clone(),
        );
        // The same with a field changed and the CRC fixed up by the harness.
        b[1 + 30] ^= 0x40;
        b[0] = PROFILE_FIX_CRC;
        seeds.add(
            Target::DecodeProfile,
            format!("synthetic-{i}-flipped.kvcp"),
            b,
        );
    }
}

/// Asserts that `chunk` decodes with `profile` as `decode_chunk` will decode it.
fn assert_decodes(profile: &Profile, case: &ChunkCase, chunk: &[u8]) {
    let ctx = case.context(profile);
    ctx.decode_chunk(
        chunk,
        0,
        case.token_start,
        case.rows,
        case.level,
        |_, _, _, _| {},
    )
    .expect("seed chunk decodes");
}

fn chunk_seeds(seeds: &mut Seeds, vectors: &[Vector]) {
    let profile = chunk_profile();
    // Chunks of the vectors coded with the chunk profile (v16 with step exponents, v17 without),
    // and a few of other vectors (other tables: decode errors, but the block layout is real).
    for v in vectors {
        let own = v.profile.hash() == profile.hash();
        let other = matches!(
            v.name.as_str(),
            "sinks-first-position" | "all-sinks" | "bf16-source" | "f32-source"
        );
        if !own && !other {
            continue;
        }
        let n = if own { v.header.chunks.len() } else { 1 };
        for i in 0..n {
            if own {
                assert_decodes(
                    &profile,
                    &case_of(&v.header, i),
                    chunk_of(&v.stream, &v.header, i),
                );
            }
            let input = chunk_input(&case_of(&v.header, i), chunk_of(&v.stream, &v.header, i));
            seeds.add(
                Target::DecodeChunk,
                format!("{}-chunk{i}.bin", v.name),
                input,
            );
        }
    }
    // Synthetic chunks coded with the chunk profile at several levels, dtypes and sink layouts,
    // with step exponents (the profile has importance hints).
    let shape = KvShape {
        layers: profile.layers(),
        kv_heads: profile.kv_heads(),
        head_dim: profile.head_dim(),
        tokens: 40,
    };
    for (i, (dtype, level, first_position, n_sink, group, rows)) in [
        (Dtype::F16, 0u8, 0u64, 1u16, 10u32, 40u32),
        (Dtype::Bf16, 5, 0, 4, 3, 17),
        (Dtype::F32, 11, 2, 5, 1, 9),
        (Dtype::F16, 7, 100, 1, 64, 33),
        (Dtype::F16, 3, 0, 64, 10, 12),
    ]
    .into_iter()
    .enumerate()
    {
        let cache = synthetic(shape, dtype, first_position, 300 + i as u64);
        let ctx = ChunkContext::new(
            shape,
            dtype,
            first_position,
            group,
            n_sink,
            &profile,
            cache.meta.rope,
        )
        .unwrap()
        .with_query_position(Some(first_position + u64::from(shape.tokens)));
        let token_start = shape.tokens - rows;
        let chunk = ctx
            .encode_chunk(&cache.view(), token_start..shape.tokens, level)
            .unwrap();
        let case = ChunkCase {
            keep_crc: false,
            level,
            rows,
            token_start,
            dtype,
            group,
            n_sink,
            first_position,
        };
        assert_decodes(&profile, &case, &chunk);
        seeds.add(
            Target::DecodeChunk,
            format!("synthetic-{i}.bin"),
            chunk_input(&case, &chunk),
        );
    }
}

fn random_symbols(rng: &mut Rng, n: usize, tables: &[&FreqTable]) -> Vec<u8> {
    (0..n)
        .map(|g| {
            // Symbols roughly by their frequency: pick a slot, find its symbol.
            let t = tables[g % tables.len()];
            let slot = (rng.next() % 4096) as u32;
            (0..t.len()).find(|&s| slot < t.cdf(s) + t.freq(s)).unwrap() as u8
        })
        .collect()
}

fn rans_seeds(seeds: &mut Seeds) {
    let mut rng = Rng(0x5EED);
    // rans_lanes: valid lanes for the fixed tables.
    let fixed = fixed_tables();
    for (i, (n, selectors, segments)) in [
        (0u16, &[0u8][..], [0u8; 4]),
        (1, &[5], [1, 0, 0, 0]),
        (31, &[0, 1, 2], [3, 7, 0, 1]),
        (33, &[6], [32, 1, 0, 0]),
        (100, &[1, 2, 3, 4, 5, 6, 7, 0], [5, 64, 3, 0]),
        (1000, &[7, 3], [0; 4]),
        (2500, &[0, 0, 0, 5], [200, 17, 33, 0]),
    ]
    .into_iter()
    .enumerate()
    {
        let k = selectors.len();
        let per: Vec<&FreqTable> = (0..n as usize)
            .map(|g| &fixed[usize::from(selectors[g % k]) % fixed.len()])
            .collect();
        let symbols = random_symbols(&mut rng, n as usize, &per);
        let lanes = encode_lanes(&symbols, |g| per[g]);
        assert!(
            lanes.iter().all(|l| l.len() < 64),
            "lane lengths fit the layout"
        );
        let input = rans_lanes_input(n, selectors, segments, &lanes);
        seeds.add(Target::RansLanes, format!("valid-{i}.bin"), input);
    }

    // freq_table: tables of the chunk profile (real radii and shapes), with valid lanes, and
    // the error cases.
    let profile = chunk_profile();
    let mut picked: Vec<Vec<u16>> = Vec::new();
    for level in [0, 6, 11] {
        let t = &profile.level_tables(level).tables;
        for i in [0, t.len() / 2, t.len() - 1] {
            picked.push(t[i].freqs.freqs().to_vec());
        }
    }
    for (i, freqs) in picked.iter().enumerate() {
        let t = FreqTable::new(freqs).unwrap();
        let n = 200 + 97 * i;
        let per = vec![&t; n];
        let symbols = random_symbols(&mut rng, n, &per);
        let lanes = encode_lanes(&symbols, |_| &t);
        let input = freq_table_input(0, freqs, n as u16, [0, 9, 40, 1], &lanes);
        seeds.add(Target::FreqTable, format!("profile-table-{i}.bin"), input);
    }
    let empty: [Vec<u32>; LANES] = Default::default();
    for (name, mode, freqs) in [
        ("one-symbol", 0u8, vec![4096u16]),
        ("zero-frequency", 0, vec![4000, 0, 96]),
        ("bad-sum", 0, vec![1000, 1000]),
        ("too-many", 1, vec![1u16; 257]),
        ("normalised-256", 1, vec![3u16; 256]),
        ("counts-shifted", 0x51, vec![1, 0, 7, 65535, 2]),
    ] {
        let input = freq_table_input(mode, &freqs, 0, [0; 4], &empty);
        seeds.add(Target::FreqTable, format!("{name}.bin"), input);
    }

    // roundtrip_rans: the layout is mostly self-describing; a few shapes of input.
    let cases: [(&str, Vec<u8>); 4] = [
        ("empty", vec![]),
        ("one-table", vec![0, 0, 0, 1, 255, 0x10, 0x00, 0, 0, 0, 0]),
        (
            "skewed-tables",
            [
                vec![2, 254, 1],
                (0..=255u8).collect(),
                vec![3, 0, 9, 9, 1, 0],
                vec![0x00, 0x08, 7, 0, 64, 0],
            ]
            .concat(),
        ),
        (
            "many-tables",
            (0..600u32).map(|i| (i * 37 % 251) as u8).collect(),
        ),
    ];
    for (name, bytes) in cases {
        seeds.add(Target::RoundtripRans, format!("{name}.bin"), bytes);
    }
}

fn roundtrip_codec_seeds(seeds: &mut Seeds) {
    // Header bytes of roundtrip_codec (see its documentation): shape, dtype/rope, flags,
    // chunk_tokens, group, n_sink, then per flags. A short input lets the pseudo-random stream
    // fill the values.
    let cases: [(&str, Vec<u8>); 10] = [
        (
            "f16-basic",
            vec![1, 1, 7, 40, 3, 0x00, 15, 9, 1, 0, 1, 128, 0, 0, 0, 1],
        ),
        (
            "bf16-embedded",
            vec![0, 2, 15, 80, 4, 0x01, 30, 5, 2, 1, 1, 100, 0],
        ),
        (
            "f32-importance",
            vec![2, 2, 3, 64, 5, 0x06, 20, 7, 1, 0, 2, 120, 140, 1],
        ),
        (
            "queries-custom",
            vec![1, 0, 9, 33, 3, 0x0E, 10, 3, 4, 2, 2, 120, 150, 0, 0, 1],
        ),
        (
            "per-chunk-levels",
            vec![0, 1, 1, 70, 0, 0x12, 9, 4, 0, 3, 3, 90, 130, 170, 0, 1, 2],
        ),
        (
            "late-position",
            vec![
                1, 1, 7, 20, 3, 0x40, 7, 2, 5, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xF0,
            ],
        ),
        ("max-position", vec![0, 0, 3, 10, 9, 0x66, 4, 2, 9, 7, 1, 1]),
        (
            "raw-rope",
            vec![
                0, 1, 3, 9, 2, 0x80, 4, 2, 1, 0, 0, 0x80, 0x7F, 0, 0, 0x80, 0x3F, 1, 128, 0,
            ],
        ),
        (
            "group-1024-one-chunk",
            vec![1, 1, 5, 80, 1, 0x03, 255, 255, 0, 0, 1, 128, 0],
        ),
        (
            "zero-tokens",
            vec![2, 2, 15, 0, 6, 0x01, 5, 5, 1, 0, 1, 128, 0],
        ),
    ];
    for (name, bytes) in cases {
        seeds.add(Target::RoundtripCodec, format!("{name}.bin"), bytes);
    }
    // Values from a vector's decoded output (f16 bytes read as value bytes).
    let out = read(&root().join("spec/vectors/v03-group-remainder.out"));
    let mut bytes = vec![1, 1, 7, 27, 3, 0x00, 15, 9, 1, 0, 1, 128, 0, 0, 0, 1];
    bytes.extend_from_slice(&out[..out.len().min(2048)]);
    seeds.add(Target::RoundtripCodec, "vector-values.bin", bytes);
}

#[test]
#[ignore = "writes fuzz/seeds; run by hand (see the module documentation)"]
fn write_fuzz_seeds() {
    let vectors = valid_vectors();
    let mut seeds = Seeds::default();
    stream_seeds(&mut seeds, &vectors);
    profile_seeds(&mut seeds, &vectors);
    chunk_seeds(&mut seeds, &vectors);
    rans_seeds(&mut seeds);
    roundtrip_codec_seeds(&mut seeds);
    let harness = codec_core::fuzzing::Harness::new();
    let mut total = 0;
    for target in Target::ALL {
        let dir = root().join("fuzz/seeds").join(target.name());
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap().to_string_lossy().starts_with("gen-") {
                std::fs::remove_file(p).unwrap();
            }
        }
        let files = seeds.0.get(target.name()).cloned().unwrap_or_default();
        assert!(!files.is_empty(), "no seeds for {}", target.name());
        for (name, bytes) in files {
            harness.run(target, &bytes);
            total += bytes.len();
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
    assert!(
        total < 2 << 20,
        "seeds total {total} bytes: keep them under 2 MiB"
    );
    println!("wrote {total} bytes of seeds");
}
