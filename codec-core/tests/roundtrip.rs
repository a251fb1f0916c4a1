//! Round trips, error bounds, corruption, profiles and determinism on real and synthetic caches.

mod common;

// The reconstruction the format promises (the reference quantizer chunk by chunk, with the
// encoder's step exponents), shared with the roundtrip_codec fuzz target.
use codec_core::fuzzing::expected_reconstruction as expected;
use codec_core::{
    decode, encode, learn_profile, BlockError, ChunkContext, DecodeError, Dtype, EncodeError,
    EncodeParams, HeaderError, KvCache, KvMeta, KvShape, LearnParams, Limits, OpenError, Profile,
    ProfileMode, Queries, Sample, Stream, Tensor,
};
use half::{bf16, f16};
use proptest::prelude::*;
use sha2::Digest;

fn learn_plain(cache: &KvCache, params: &LearnParams) -> Profile {
    learn_profile(
        &[Sample {
            kv: cache.view(),
            queries: None,
        }],
        params,
    )
    .unwrap()
}

#[test]
fn testdata_sample_is_the_pinned_fixture() {
    let bytes = std::fs::read(common::SAMPLE).unwrap();
    let hash = sha2::Sha256::digest(&bytes);
    assert_eq!(codec_core::profile::hex(&hash), common::SAMPLE_SHA256);
}

#[test]
fn real_sample_round_trip_every_level() {
    let (cache, q, q_heads, q_start) = common::load(common::SAMPLE, 4);
    let queries = Queries {
        q: q.iter().map(|l| l.as_slice()).collect(),
        q_heads,
        q_start,
    };
    let lp = LearnParams {
        chunk_tokens: 200,
        ..LearnParams::default()
    };
    let profile = learn_profile(
        &[Sample {
            kv: cache.view(),
            queries: Some(queries),
        }],
        &lp,
    )
    .unwrap();
    let mut prev_bytes = usize::MAX;
    for level in 0..profile.levels() {
        let params = EncodeParams {
            chunk_tokens: 200,
            levels: vec![level],
            ..EncodeParams::default()
        };
        let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
        let dec = decode(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
        assert_eq!(dec, expected(&cache, &profile, &params), "level {level}");
        assert!(bytes.len() < prev_bytes, "coarser levels must be smaller");
        prev_bytes = bytes.len();
        // Sink token 0 is exact.
        assert_eq!(dec.k[0].as_ref().get_f32(5), cache.k[0].as_ref().get_f32(5));
    }
}

#[test]
fn self_contained_needs_no_profile_and_referenced_does() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 2);
    let profile = learn_plain(&cache, &LearnParams::default());
    let params = EncodeParams::default();
    let embedded = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let referenced = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    assert_eq!(embedded.len(), referenced.len() + profile.as_bytes().len());
    let a = decode(&embedded, None, &Limits::DEFAULT).unwrap();
    let b = decode(&referenced, Some(&profile), &Limits::DEFAULT).unwrap();
    assert_eq!(a, b);
    assert!(matches!(
        decode(&referenced, None, &Limits::DEFAULT),
        Err(DecodeError::Open(OpenError::ProfileRequired { .. }))
    ));
    let other = learn_plain(
        &cache,
        &LearnParams {
            target_error: 0.2,
            ..LearnParams::default()
        },
    );
    assert!(matches!(
        decode(&referenced, Some(&other), &Limits::DEFAULT),
        Err(DecodeError::Open(OpenError::ProfileMismatch { .. }))
    ));
}

#[test]
fn self_contained_streams_embed_the_profile_without_hints() {
    let (cache, q, q_heads, q_start) = common::load(common::SAMPLE, 2);
    let profile = learn_profile(
        &[Sample {
            kv: cache.view(),
            queries: Some(Queries {
                q: q.iter().map(|l| l.as_slice()).collect(),
                q_heads,
                q_start,
            }),
        }],
        &LearnParams::default(),
    )
    .unwrap();
    assert!(profile.importance().is_some());
    let bare = profile.without_importance();
    assert!(bare.importance().is_none());
    assert_eq!(bare.version(), codec_core::consts::PROFILE_VERSION);
    for kv in 0..2 {
        assert_eq!(bare.channel_params(1, kv), profile.channel_params(1, kv));
    }
    let params = EncodeParams::default();
    let embedded = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let referenced = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    // Same chunks; the embedded profile is the one without hints, and the header names it.
    assert_eq!(embedded.len(), referenced.len() + bare.as_bytes().len());
    let stream = Stream::open(&embedded, None, &Limits::DEFAULT).unwrap();
    assert_eq!(stream.profile().hash(), bare.hash());
    assert_eq!(
        stream.decode().unwrap(),
        decode(&referenced, Some(&profile), &Limits::DEFAULT).unwrap()
    );
    // The stream that referenced the profile with hints does not take the one without.
    assert!(matches!(
        decode(&referenced, Some(&bare), &Limits::DEFAULT),
        Err(DecodeError::Open(OpenError::ProfileMismatch { .. }))
    ));
}

/// A profile given for a stream that embeds one is used as it is only when its bytes are the
/// embedded ones (a binding reopening its stream, chunk by chunk); any other profile is
/// ignored, and embedded bytes that are corrupt fail whatever is given.
#[test]
fn an_embedding_stream_takes_a_given_profile_only_if_it_is_the_embedded_one() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 2);
    let profile = learn_plain(&cache, &LearnParams::default());
    let params = EncodeParams::default();
    let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let parsed = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let same = parsed.profile().clone();
    let want = parsed.decode().unwrap();
    let again = Stream::open(&bytes, Some(&same), &Limits::DEFAULT).unwrap();
    assert!(
        core::ptr::eq(again.profile(), &same),
        "the given profile, not a new parse"
    );
    assert_eq!(again.decode().unwrap(), want);
    let other = learn_plain(
        &cache,
        &LearnParams {
            target_error: 0.2,
            ..LearnParams::default()
        },
    );
    let ignored = Stream::open(&bytes, Some(&other), &Limits::DEFAULT).unwrap();
    assert!(!core::ptr::eq(ignored.profile(), &other));
    assert_eq!(ignored.profile().hash(), same.hash());
    assert_eq!(ignored.decode().unwrap(), want);
    // A byte of the embedded profile flipped (its last, inside its CRC): refused, also when
    // the profile it was is given.
    let h = parsed.header();
    let mut bad = bytes.clone();
    bad[h.header_len() + h.profile_len as usize - 1] ^= 1;
    for given in [None, Some(&same)] {
        let e = Stream::open(&bad, given, &Limits::DEFAULT).unwrap_err();
        assert!(matches!(e, DecodeError::Profile(_)), "{e}");
    }
}

#[test]
fn profile_version_2_is_read_and_kept() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../spec/vectors/v2");
    let bytes = std::fs::read(dir.join("v05-every-level.kvcp")).unwrap();
    let v2 = Profile::from_bytes(&bytes, &Limits::DEFAULT).unwrap();
    assert_eq!(v2.version(), 2);
    // Re-writing keeps version 2 (and so the bytes and the hash streams name).
    let all: Vec<u8> = (0..v2.levels()).collect();
    assert_eq!(v2.with_levels(&all).as_bytes(), &bytes[..]);
    assert_eq!(v2.with_levels(&[1]).version(), 2);
    assert_eq!(v2.without_importance().version(), 2);
    // Writing the same parts as version 3 rounds the means and steps to bf16.
    let params: Vec<_> = (0..v2.layers())
        .flat_map(|l| [0, 1].map(|kv| v2.channel_params(l, kv).to_vec()))
        .flatten()
        .collect();
    let v3 = Profile::from_parts(
        v2.layers(),
        v2.kv_heads(),
        v2.head_dim(),
        v2.level_multipliers().to_vec(),
        params.clone(),
        v2.importance().cloned(),
        (0..v2.levels())
            .map(|l| v2.level_tables(l).clone())
            .collect(),
    );
    assert_eq!(v3.version(), 3);
    assert_eq!(bytes.len() - v3.as_bytes().len(), 6 * params.len());
    let r = codec_core::profile::to_bf16_value;
    let got = (0..v3.layers()).flat_map(|l| [0, 1].map(|kv| v3.channel_params(l, kv).to_vec()));
    for (a, b) in params.iter().zip(got.flatten()) {
        assert_eq!(
            [r(a.mean), r(a.delta_step), r(a.anchor_step)].map(f32::to_bits),
            [b.mean, b.delta_step, b.anchor_step].map(f32::to_bits)
        );
        assert_eq!(a.weight, b.weight);
    }
}

#[test]
fn token_ranges_decode_only_what_they_need_and_match() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 2);
    let profile = learn_plain(&cache, &LearnParams::default());
    let params = EncodeParams {
        chunk_tokens: 100,
        group: 7,
        ..EncodeParams::default()
    };
    let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    let s = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
    let full = s.decode().unwrap();
    let part = s.decode_tokens(150..333).unwrap();
    let c = full.shape.channels();
    for l in 0..2 {
        let a = full.k[l].to_f32_vec();
        assert_eq!(part.k[l].to_f32_vec(), a[150 * c..333 * c].to_vec());
    }
    assert_eq!(part.meta.first_position, 150);
    // A corrupt chunk outside the range does not matter to a range decode.
    let mut bad = bytes.clone();
    let e = s.header().chunks[4];
    bad[e.offset as usize + 10] ^= 1;
    let s2 = Stream::open(&bad, Some(&profile), &Limits::DEFAULT).unwrap();
    assert!(s2.decode_tokens(0..300).is_ok());
    assert!(matches!(
        s2.decode_tokens(0..401),
        Err(DecodeError::Block(BlockError::Crc { chunk: 4, .. }))
    ));
}

#[test]
fn a_detached_stream_attaches_to_its_own_bytes_and_profile_only() {
    let (bytes, embedded) = small_stream();
    let opened = Stream::open(&bytes, None, &Limits::DEFAULT)
        .unwrap()
        .detach();
    let again = opened.attach(&bytes, &embedded).unwrap();
    assert_eq!(
        again.decode().unwrap(),
        decode(&bytes, None, &Limits::DEFAULT).unwrap()
    );
    assert_eq!(again.header(), opened.header());
    let other_bytes =
        |r: Result<Stream<'_>, DecodeError>| matches!(r, Err(DecodeError::OtherBytes { .. }));
    // Shorter, longer, or another header of the same length.
    assert!(other_bytes(
        opened.attach(&bytes[..bytes.len() - 1], &embedded)
    ));
    let mut long = bytes.clone();
    long.push(0);
    assert!(other_bytes(opened.attach(&long, &embedded)));
    let crc_at = opened.header().header_len() - 1;
    let mut bad = bytes.clone();
    bad[crc_at] ^= 1;
    assert!(other_bytes(opened.attach(&bad, &embedded)));
    // The same header over a corrupt chunk: attached, and the chunk is refused when read.
    let e = opened.header().chunks[1];
    let mut bad = bytes.clone();
    bad[e.offset as usize + 3] ^= 1;
    let s = opened.attach(&bad, &embedded).unwrap();
    assert!(s.decode_tokens(0..e.token_start).is_ok());
    assert!(matches!(
        s.decode_tokens(0..e.token_start + 1),
        Err(DecodeError::Block(BlockError::Crc { chunk: 1, .. }))
    ));
    // Another profile (the same cache learned otherwise) is refused as open refuses it.
    let cache = decode(&bytes, None, &Limits::DEFAULT).unwrap();
    let other = learn_plain(
        &cache,
        &LearnParams {
            group: 3,
            ..LearnParams::default()
        },
    );
    assert_ne!(other.hash(), embedded.hash());
    assert!(matches!(
        opened.attach(&bytes, &other),
        Err(DecodeError::Open(OpenError::ProfileMismatch { .. }))
    ));
}

#[test]
fn decode_into_caller_buffers_of_any_dtype() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 2);
    let profile = learn_plain(&cache, &LearnParams::default());
    let bytes = encode(
        &cache.view(),
        ProfileMode::Referenced(&profile),
        &EncodeParams::default(),
    )
    .unwrap();
    let s = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
    let owned = s.decode().unwrap();
    let n = cache.shape.tensor_len();
    let mut kb: Vec<Tensor> = (0..2).map(|_| Tensor::zeros(Dtype::F32, n)).collect();
    let mut vb: Vec<Tensor> = (0..2).map(|_| Tensor::zeros(Dtype::F32, n)).collect();
    {
        let mut k: Vec<_> = kb.iter_mut().map(|t| t.as_mut()).collect();
        let mut v: Vec<_> = vb.iter_mut().map(|t| t.as_mut()).collect();
        s.decode_into(&mut k, &mut v).unwrap();
    }
    // f16 output is the f32 reconstruction rounded once.
    let f32k = kb[1].to_f32_vec();
    let f16k = owned.k[1].to_f32_vec();
    for (a, b) in f32k.iter().zip(&f16k) {
        assert_eq!(f16::from_f32(*a).to_f32(), *b);
    }
    let mut short: Vec<Tensor> = (0..2).map(|_| Tensor::zeros(Dtype::F32, n - 1)).collect();
    let mut k: Vec<_> = short.iter_mut().map(|t| t.as_mut()).collect();
    let mut v: Vec<_> = vb.iter_mut().map(|t| t.as_mut()).collect();
    assert!(matches!(
        s.decode_into(&mut k, &mut v),
        Err(DecodeError::OutputMismatch { .. })
    ));
}

/// A self-contained stream of the fixture's first 40 tokens, first layer and first KV head
/// (one head keeps the embedded profile, which every decode parses, small), in 16-token chunks.
fn small_stream() -> (Vec<u8>, Profile) {
    let (cache, _, _, _) = common::load(common::SAMPLE, 1);
    let mut c = cache;
    let (row, dim) = (c.shape.channels(), c.shape.head_dim as usize);
    c.shape.tokens = 40;
    c.shape.kv_heads = 1;
    for t in c.k.iter_mut().chain(c.v.iter_mut()) {
        if let Tensor::F16(v) = t {
            *v = v
                .chunks(row)
                .take(40)
                .flat_map(|r| &r[..dim])
                .copied()
                .collect();
        }
    }
    let profile = learn_plain(&c, &LearnParams::default());
    let bytes = encode(
        &c.view(),
        ProfileMode::Embedded(&profile),
        &EncodeParams {
            chunk_tokens: 16,
            ..EncodeParams::default()
        },
    )
    .unwrap();
    (bytes, profile)
}

#[test]
fn every_truncation_is_an_error() {
    let (bytes, _) = small_stream();
    for len in 0..bytes.len() {
        assert!(
            decode(&bytes[..len], None, &Limits::DEFAULT).is_err(),
            "prefix of {len} bytes decoded"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        decode(&long, None, &Limits::DEFAULT),
        Err(DecodeError::Header(HeaderError::TrailingBytes { .. }))
    ));
}

#[test]
fn every_single_byte_change_is_detected() {
    let (mut bytes, _) = small_stream();
    let good = decode(&bytes, None, &Limits::DEFAULT).unwrap();
    for i in 0..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            bytes[i] ^= flip;
            let decoded = decode(&bytes, None, &Limits::DEFAULT);
            bytes[i] ^= flip;
            if let Ok(d) = decoded {
                panic!(
                    "byte {i} ^ {flip:#x} went unnoticed (same output: {})",
                    d == good
                );
            }
        }
    }
}

#[test]
fn limits_are_enforced_before_decoding() {
    let (bytes, _) = small_stream();
    let tight = Limits {
        max_tokens: 39,
        ..Limits::DEFAULT
    };
    assert!(matches!(
        decode(&bytes, None, &tight),
        Err(DecodeError::Header(HeaderError::Tokens {
            got: 40,
            max: 39
        }))
    ));
    let tight = Limits {
        max_profile_bytes: 100,
        ..Limits::DEFAULT
    };
    assert!(matches!(
        decode(&bytes, None, &tight),
        Err(DecodeError::Header(HeaderError::ProfileLen {
            max: 100,
            ..
        }))
    ));
    let tight = Limits {
        max_elements: 100,
        ..Limits::DEFAULT
    };
    assert!(matches!(
        decode(&bytes, None, &tight),
        Err(DecodeError::Header(HeaderError::Elements { max: 100, .. }))
    ));
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(matches!(
        decode(&bad, None, &Limits::DEFAULT),
        Err(DecodeError::Header(HeaderError::BadMagic { .. }))
    ));
}

#[test]
fn streams_are_identical_across_runs_and_threads() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 3);
    let profile = learn_plain(&cache, &LearnParams::default());
    // A shorter last chunk (512 = 2 * 200 + 112): the stream's encoder reuses its buffers
    // across chunks of both sizes, and must give each chunk's bytes as a fresh encoder does.
    let params = EncodeParams {
        chunk_tokens: 200,
        ..EncodeParams::default()
    };
    assert_ne!(cache.shape.tokens % params.chunk_tokens, 0);
    let a = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    let b = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    assert_eq!(a, b);
    // Encode each chunk on its own thread; the chunks must equal the single-threaded stream's.
    let s = Stream::open(&a, Some(&profile), &Limits::DEFAULT).unwrap();
    let ctx = s.context();
    let view = cache.view();
    let chunks: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let hs: Vec<_> = s
            .header()
            .chunks
            .iter()
            .map(|e| {
                let (ctx, view) = (&ctx, &view);
                sc.spawn(move || {
                    ctx.encode_chunk(view, e.token_start..e.token_start + e.tokens, e.level)
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.as_slice(), s.chunk_bytes(i).unwrap());
    }
    // The profile itself is deterministic.
    assert_eq!(
        learn_plain(&cache, &LearnParams::default()).as_bytes(),
        profile.as_bytes()
    );
}

#[test]
fn profile_bytes_round_trip_and_reject_corruption() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 1);
    let p = learn_plain(&cache, &LearnParams::default());
    let q = Profile::from_bytes(p.as_bytes(), &Limits::DEFAULT).unwrap();
    assert_eq!(q.as_bytes(), p.as_bytes());
    assert_eq!(q.hash(), p.hash());
    for i in (0..p.as_bytes().len()).step_by(97) {
        let mut b = p.as_bytes().to_vec();
        b[i] ^= 0x10;
        assert!(
            Profile::from_bytes(&b, &Limits::DEFAULT).is_err(),
            "byte {i}"
        );
    }
    for len in (0..p.as_bytes().len()).step_by(101) {
        assert!(Profile::from_bytes(&p.as_bytes()[..len], &Limits::DEFAULT).is_err());
    }
}

fn synthetic(layers: u32, heads: u32, dim: u32, tokens: u32, dtype: Dtype, seed: u64) -> KvCache {
    let shape = KvShape {
        layers,
        kv_heads: heads,
        head_dim: dim,
        tokens,
    };
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 - 0.5
    };
    let n = shape.tensor_len();
    let mut make = |scale: f32| -> Tensor {
        let v: Vec<f32> = (0..n)
            .map(|i| (next() + (i % 5) as f32 * 0.1) * scale)
            .collect();
        match dtype {
            Dtype::F16 => Tensor::F16(v.iter().map(|x| f16::from_f32(*x)).collect()),
            Dtype::Bf16 => Tensor::Bf16(v.iter().map(|x| bf16::from_f32(*x)).collect()),
            Dtype::F32 => Tensor::F32(v),
        }
    };
    let k = (0..layers).map(|l| make(1.0 + l as f32)).collect();
    let v = (0..layers).map(|_| make(0.3)).collect();
    KvCache {
        shape,
        k,
        v,
        meta: KvMeta {
            model_id: "synthetic".into(),
            ..KvMeta::default()
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_shapes_round_trip_within_half_a_step(
        layers in 1u32..3, heads in 1u32..3, dim in 1u32..9, tokens in 1u32..60,
        dtype in prop_oneof![Just(Dtype::F16), Just(Dtype::Bf16), Just(Dtype::F32)],
        chunk in 1u32..40, group in 1u32..13, sink in 0u16..3, level in 0u8..12, seed in any::<u64>(),
    ) {
        let cache = synthetic(layers, heads, dim, tokens, dtype, seed);
        let lp = LearnParams { group, chunk_tokens: chunk, n_sink: sink, ..LearnParams::default() };
        let profile = learn_plain(&cache, &lp);
        let params = EncodeParams { chunk_tokens: chunk, group, n_sink: sink, levels: vec![level], ..EncodeParams::default() };
        let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
        let dec = decode(&bytes, None, &Limits::DEFAULT).unwrap();
        prop_assert_eq!(&dec, &expected(&cache, &profile, &params));
        let c = cache.shape.channels();
        let mult = profile.level_multipliers()[level as usize];
        for l in 0..layers as usize {
            for (kv, (a, b)) in [(&cache.k[l], &dec.k[l]), (&cache.v[l], &dec.v[l])].into_iter().enumerate() {
                let (a, b) = (a.to_f32_vec(), b.to_f32_vec());
                let p = profile.channel_params(l as u32, kv);
                for i in 0..a.len() {
                    let (t, ch) = (i / c, i % c);
                    let row = t % chunk as usize;
                    let bound = if (t as u64) < sink as u64 { 0.0 }
                        else if row.is_multiple_of(group as usize) { p[ch].anchor_step * mult * 0.5 }
                        else { p[ch].delta_step * mult * 0.5 };
                    // Output rounding to the dtype adds at most half an ulp of the value.
                    let ulp = match dtype { Dtype::F16 => 1e-3, Dtype::Bf16 => 8e-3, Dtype::F32 => 1e-6 } * (a[i].abs() + bound + 1e-3);
                    prop_assert!((a[i] - b[i]).abs() <= bound * 1.0001 + ulp, "t {} ch {}: {} vs {} bound {} ulp {} p {:?} mult {}", t, ch, a[i], b[i], bound, ulp, p[ch], mult);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    // Range decodes find their chunks by a binary search over the index: every range, through
    // a stream opened once or attached again, is the matching rows of the whole decode.
    #[test]
    fn every_token_range_decodes_as_the_rows_of_the_whole(
        tokens in 1u32..80, chunk in 1u32..20, a in 0u32..80, b in 0u32..80, seed in any::<u64>(),
    ) {
        let cache = synthetic(2, 1, 3, tokens, Dtype::F16, seed);
        let profile = learn_plain(&cache, &LearnParams { chunk_tokens: chunk, ..LearnParams::default() });
        let params = EncodeParams { chunk_tokens: chunk, ..EncodeParams::default() };
        let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
        let s = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
        let whole = s.decode().unwrap();
        let opened = s.detach();
        let c = whole.shape.channels();
        let (lo, hi) = (a.min(b).min(tokens), a.max(b).min(tokens));
        let chunks = opened.header().chunks.iter().map(|e| e.token_start..e.token_start + e.tokens);
        for r in chunks.chain([lo..hi, 0..tokens, tokens..tokens]) {
            let part = opened.attach(&bytes, &profile).unwrap().decode_tokens(r.clone()).unwrap();
            for l in 0..2 {
                let rows = r.start as usize * c..r.end as usize * c;
                prop_assert_eq!(part.k[l].to_f32_vec(), whole.k[l].to_f32_vec()[rows.clone()].to_vec());
                prop_assert_eq!(part.v[l].to_f32_vec(), whole.v[l].to_f32_vec()[rows].to_vec());
            }
        }
    }
}

#[test]
fn profiles_learned_on_one_token_keep_the_half_step_bound() {
    // Found by `random_shapes_round_trip_within_half_a_step` in CI: one sample token has zero
    // variance, so calibration shrank the steps to ~1e-10 while the profile stores the mean as
    // bf16 (2^-9 relative error); the residual then needed more than MAX_SYMBOL steps and was
    // clamped. The learner now floors the steps so that every sample value stays representable.
    for seed in [121_868_520_884_516_288u64, 1_156_766_327_686_065_986, 7, 99] {
        for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let cache = synthetic(1, 2, 6, 1, dtype, seed);
            let lp = LearnParams {
                group: 1,
                chunk_tokens: 1,
                n_sink: 0,
                ..LearnParams::default()
            };
            let profile = learn_plain(&cache, &lp);
            for level in 0..profile.level_multipliers().len() as u8 {
                let params = EncodeParams {
                    chunk_tokens: 1,
                    group: 1,
                    n_sink: 0,
                    levels: vec![level],
                    ..EncodeParams::default()
                };
                let bytes =
                    encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
                let dec = decode(&bytes, None, &Limits::DEFAULT).unwrap();
                let mult = profile.level_multipliers()[level as usize];
                for kv in 0..2 {
                    let (a, b) = if kv == 0 {
                        (&cache.k[0], &dec.k[0])
                    } else {
                        (&cache.v[0], &dec.v[0])
                    };
                    let (a, b) = (a.to_f32_vec(), b.to_f32_vec());
                    let p = profile.channel_params(0, kv);
                    for ch in 0..a.len() {
                        let half_step = p[ch].anchor_step * mult * 0.5;
                        let ulp = match dtype {
                            Dtype::F16 => 1e-3,
                            Dtype::Bf16 => 8e-3,
                            Dtype::F32 => 1e-6,
                        } * (a[ch].abs() + half_step + 1e-3);
                        assert!(
                            (a[ch] - b[ch]).abs() <= half_step * 1.0001 + ulp,
                            "seed {seed} {dtype:?} level {level} kv {kv} ch {ch}: {} vs {}",
                            a[ch],
                            b[ch]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn encode_rejects_a_non_finite_rope_it_could_not_decode() {
    // Found by the roundtrip_codec fuzz target: the header stores theta and scaling, decoders
    // reject non-finite ones (FORMAT.md H16), so encode must refuse them.
    let cache = synthetic(1, 1, 4, 8, Dtype::F16, 7);
    let profile = learn_plain(&cache, &LearnParams::default());
    for (theta, scaling) in [
        (f32::INFINITY, 1.0),
        (f32::NAN, 1.0),
        (1e4, f32::NEG_INFINITY),
    ] {
        let mut c = cache.clone();
        c.meta.rope.theta = theta;
        c.meta.rope.scaling = scaling;
        let r = encode(
            &c.view(),
            ProfileMode::Embedded(&profile),
            &EncodeParams::default(),
        );
        assert!(
            matches!(r, Err(codec_core::EncodeError::InvalidParam { .. })),
            "{r:?}"
        );
    }
}

#[test]
fn max_encoded_len_bounds_real_and_worst_case_streams() {
    use codec_core::max_encoded_len;
    // Real data: far below the bound (the bound allows an escape for every value).
    let (cache, _, _, _) = common::load(common::SAMPLE, 2);
    let profile = learn_plain(&cache, &LearnParams::default());
    for (level, chunk_tokens, embedded) in [(0u8, 200u32, false), (7, 1536, true), (11, 64, false)]
    {
        let params = EncodeParams {
            chunk_tokens,
            levels: vec![level],
            ..EncodeParams::default()
        };
        let mode = if embedded {
            ProfileMode::Embedded(&profile)
        } else {
            ProfileMode::Referenced(&profile)
        };
        let bytes = encode(&cache.view(), mode, &params).unwrap();
        let plen = if embedded {
            profile.as_bytes().len() as u64
        } else {
            0
        };
        let bound = max_encoded_len(
            &cache.shape,
            cache.dtype(),
            &params,
            plen,
            cache.meta.model_id.len(),
        );
        assert!(bytes.len() as u64 <= bound);
        eprintln!(
            "real sample, level {level}: {} bytes, bound {bound} ({:.1}x)",
            bytes.len(),
            (bound - plen) as f64 / (bytes.len() as u64 - plen) as f64
        );
    }

    // Worst case: values far outside the profile's tables, so nearly every value escapes and
    // codes as a rare symbol. The stream then comes close to the bound: it is tight.
    let quiet = synthetic(2, 2, 8, 90, Dtype::F32, 3);
    let profile = learn_plain(&quiet, &LearnParams::default());
    let mut loud = quiet.clone();
    let mut state = 0x1234_5678_9ABC_DEF1u64;
    for t in loud.k.iter_mut().chain(loud.v.iter_mut()) {
        if let Tensor::F32(v) = t {
            for x in v.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *x = ((state >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 2e4;
            }
        }
    }
    let params = EncodeParams {
        chunk_tokens: 32,
        levels: vec![0],
        n_sink: 0,
        ..EncodeParams::default()
    };
    let bytes = encode(&loud.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    let bound = max_encoded_len(
        &loud.shape,
        Dtype::F32,
        &params,
        0,
        loud.meta.model_id.len(),
    );
    eprintln!("worst case: {} bytes, bound {bound}", bytes.len());
    assert!(bytes.len() as u64 <= bound);
    assert!(
        bytes.len() as f64 * 1.25 >= bound as f64,
        "the bound is within 25% of a worst-case stream ({} vs {bound})",
        bytes.len()
    );
}

#[test]
fn learning_keeps_steps_finite_and_positive() {
    // Found by the roundtrip_codec fuzz target: a calibration that scales steps past f32::MAX
    // (values near f32::MAX, or a loose target) gave infinite steps and Profile::from_parts
    // panicked; so did an anchor ratio small enough to round the anchor step to 0.
    let mut big = synthetic(1, 1, 4, 20, Dtype::F32, 11);
    for t in big.k.iter_mut().chain(big.v.iter_mut()) {
        if let Tensor::F32(v) = t {
            for (i, x) in v.iter_mut().enumerate() {
                *x = if i % 3 == 0 { 1.0e37 } else { -0.8e37 };
            }
        }
    }
    let zero = KvCache {
        k: vec![Tensor::F32(vec![0.0; 80])],
        v: vec![Tensor::F32(vec![0.0; 80])],
        ..big.clone()
    };
    // Means beyond bf16's largest finite value (a version-3 profile stores them as bf16).
    let edge: Vec<f32> = (0..80)
        .map(|i| if i % 2 == 0 { f32::MAX } else { -f32::MAX })
        .collect();
    let huge = KvCache {
        k: vec![Tensor::F32(edge.clone())],
        v: vec![Tensor::F32(edge)],
        ..big.clone()
    };
    for (cache, lp) in [
        (
            &big,
            LearnParams {
                target_error: 1e6,
                ..LearnParams::default()
            },
        ),
        (
            &zero,
            LearnParams {
                anchor_ratio: 1e-44,
                ..LearnParams::default()
            },
        ),
        (&huge, LearnParams::default()),
    ] {
        let profile = learn_plain(cache, &lp);
        for kv in 0..2 {
            for p in profile.channel_params(0, kv) {
                assert!(p.mean.is_finite());
                assert!(p.delta_step.is_finite() && p.delta_step > 0.0);
                assert!(p.anchor_step.is_finite() && p.anchor_step > 0.0);
            }
        }
        let params = EncodeParams::default();
        let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
        let dec = decode(&bytes, None, &Limits::DEFAULT).unwrap();
        assert_eq!(dec.shape, cache.shape);
    }
}

#[test]
fn positions_near_u64_max_saturate() {
    // Found by the roundtrip_codec fuzz target: learning and the importance policy added token
    // offsets to `first_position` without saturating (an overflow panic in debug builds); the
    // decoder saturates (FORMAT.md §5.3).
    let mut cache = synthetic(1, 2, 4, 30, Dtype::F16, 5);
    cache.meta.first_position = u64::MAX - 5;
    cache.meta.rope.style = codec_core::RopeStyle::NeoX;
    cache.meta.rope.k_pre_rope = true;
    let q: Vec<f32> = (0..3 * 4 * 4)
        .map(|i| (i % 7) as f32 * 0.25 - 0.7)
        .collect();
    let queries = Queries {
        q: vec![&q],
        q_heads: 4,
        q_start: u64::MAX - 1,
    };
    let lp = LearnParams {
        chunk_tokens: 8,
        n_sink: 3,
        ..LearnParams::default()
    };
    let profile = learn_profile(
        &[Sample {
            kv: cache.view(),
            queries: Some(queries),
        }],
        &lp,
    )
    .unwrap();
    assert!(profile.importance().is_some());
    let params = EncodeParams {
        chunk_tokens: 8,
        n_sink: 3,
        ..EncodeParams::default()
    };
    let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
    let dec = decode(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
    assert_eq!(dec, expected(&cache, &profile, &params));
}

#[test]
fn importance_hints_stay_finite_and_queries_must_be() {
    // Found by the roundtrip_codec fuzz target: keys near f32::MAX score beyond the f32 range,
    // and the score threshold tau became infinite (Profile::from_parts panicked).
    let mut cache = synthetic(1, 1, 4, 12, Dtype::F32, 9);
    if let Tensor::F32(v) = &mut cache.k[0] {
        for (i, x) in v.iter_mut().enumerate() {
            *x = if i % 5 == 0 { -3.0e38 } else { 2.9e38 };
        }
    }
    let mut q: Vec<f32> = vec![3.0; 2 * 4 * 2];
    let learn = |q: &[f32]| {
        learn_profile(
            &[Sample {
                kv: cache.view(),
                queries: Some(Queries {
                    q: vec![q],
                    q_heads: 2,
                    q_start: 4,
                }),
            }],
            &LearnParams::default(),
        )
    };
    let profile = learn(&q).unwrap();
    let imp = profile.importance().unwrap();
    assert!(imp.tau.iter().chain(&imp.query_mean).all(|x| x.is_finite()));
    let params = EncodeParams::default();
    let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let dec = decode(&bytes, None, &Limits::DEFAULT).unwrap();
    assert_eq!(dec.shape, cache.shape);
    // Non-finite queries are an input error, not a panic.
    q[3] = f32::NAN;
    assert!(matches!(
        learn(&q),
        Err(codec_core::EncodeError::InvalidParam { .. })
    ));
}

#[test]
fn chunk_contexts_are_built_consistent() {
    let (bytes, profile) = small_stream();
    let s = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let e = s.header().chunks[0];
    let chunk = s.chunk_bytes(0).unwrap();
    let ctx = s.context();
    assert!(ctx
        .decode_chunk(chunk, 0, e.token_start, e.tokens, e.level, |_, _, _, _| {})
        .is_ok());
    let h = s.header();
    let new = |group: u32, shape: KvShape| {
        ChunkContext::new(
            shape,
            h.dtype,
            h.meta.first_position,
            group,
            h.n_sink,
            s.profile(),
            h.meta.rope,
        )
    };
    assert!(new(u32::from(h.group), h.shape).is_ok());
    assert!(matches!(
        new(0, h.shape),
        Err(EncodeError::InvalidParam { what: "group", .. })
    ));
    let mut shape = h.shape;
    shape.head_dim += 1;
    assert!(matches!(
        new(10, shape),
        Err(EncodeError::ProfileShape { .. })
    ));
    let _ = profile;
}

#[test]
fn expected_coding_error_follows_the_real_error() {
    let (cache, q, q_heads, q_start) = common::load(common::SAMPLE, 4);
    let profile = common::learn_with_queries(&cache, &q, q_heads, q_start);
    let (heads, d) = (cache.shape.kv_heads as usize, cache.shape.head_dim as usize);
    for level in [1u8, 7, 10] {
        let params = EncodeParams {
            chunk_tokens: 200,
            levels: vec![level],
            ..EncodeParams::default()
        };
        let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
        let s = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
        let (dec, err) = s.decode_with_error().unwrap();
        assert_eq!(dec, s.decode().unwrap(), "level {level}");
        assert_eq!(
            (err.tokens, err.kv_heads),
            (cache.shape.tokens, cache.shape.kv_heads)
        );
        // Per (token, head) of every block: the real squared error next to the expected one.
        let mut pairs: Vec<(f64, f64)> = Vec::new();
        let blocks =
            (cache.k.iter().zip(&dec.k).zip(&err.k)).chain(cache.v.iter().zip(&dec.v).zip(&err.v));
        for (l, ((orig, got), want)) in blocks.enumerate() {
            let (o, g) = (orig.to_f32_vec(), got.to_f32_vec());
            assert_eq!(want.len(), o.len() / d, "block {l}");
            assert!(
                want[..heads].iter().all(|&e| e == 0.0),
                "the sink token is exact"
            );
            for (i, &e) in want.iter().enumerate().skip(heads) {
                assert!(e.is_finite() && e > 0.0, "block {l} (token, head) {i}: {e}");
                let real: f64 = (0..d)
                    .map(|c| f64::from(o[i * d + c] - g[i * d + c]).powi(2))
                    .sum();
                pairs.push((real, f64::from(e)));
            }
        }
        let (real, want): (f64, f64) = pairs.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
        // Rounding to a step errs about that uniform error; at coarse steps less (many
        // residuals round to 0 and err by less than half a step). Measured: 0.995, 0.969, 0.624.
        let ratio = real / want;
        let floor = if level < 10 { 0.9 } else { 0.4 };
        assert!(
            ratio > floor && ratio < 1.1,
            "level {level}: real / expected {ratio}"
        );
        // And it ranks the tokens: those expected in the top quarter really err more than
        // those in the bottom quarter.
        pairs.sort_by(|a, b| a.1.total_cmp(&b.1));
        let q = pairs.len() / 4;
        let mean = |p: &[(f64, f64)]| p.iter().map(|x| x.0).sum::<f64>() / p.len() as f64;
        let (low, high) = (mean(&pairs[..q]), mean(&pairs[pairs.len() - q..]));
        assert!(high > 10.0 * low, "level {level}: {high} vs {low}");
    }
}

#[test]
fn chunks_of_streams_at_different_levels_assemble_into_any_mix() {
    let (cache, _, _, _) = common::load(common::SAMPLE, 3);
    let profile = learn_plain(&cache, &LearnParams::default());
    let at = |levels: Vec<u8>| EncodeParams {
        chunk_tokens: 128,
        levels,
        ..EncodeParams::default()
    };
    let view = cache.view();
    // One stream per level, as a multi-level store keeps them.
    let ladder = [1u8, 7, 10];
    let streams: Vec<Vec<u8>> = ladder
        .iter()
        .map(|&l| encode(&view, ProfileMode::Referenced(&profile), &at(vec![l])).unwrap())
        .collect();
    let headers: Vec<codec_core::Header> = streams
        .iter()
        .map(|s| codec_core::Header::parse(s, &Limits::DEFAULT).unwrap())
        .collect();
    let chunk = |level: u8, i: usize| -> &[u8] {
        let j = ladder.iter().position(|&l| l == level).unwrap();
        let e = &headers[j].chunks[i];
        &streams[j][e.offset as usize..][..e.len_bytes as usize]
    };
    for mix in [[7u8, 1, 10, 7], [10, 10, 1, 1], [1, 7, 7, 10]] {
        let parts: Vec<(u8, &[u8])> = mix
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, chunk(l, i)))
            .collect();
        let made = codec_core::assemble(&headers[2], &parts, &[]).unwrap();
        let direct = encode(&view, ProfileMode::Referenced(&profile), &at(mix.to_vec())).unwrap();
        assert_eq!(made, direct, "{mix:?}");
    }
    // Self-contained: the same chunks after an embedded profile.
    let embedded = profile.without_importance();
    let e = encode(&view, ProfileMode::Embedded(&profile), &at(vec![7])).unwrap();
    let h = codec_core::Header::parse(&e, &Limits::DEFAULT).unwrap();
    let parts: Vec<(u8, &[u8])> = (0..4).map(|i| (7u8, chunk(7, i))).collect();
    assert_eq!(
        codec_core::assemble(&h, &parts, embedded.as_bytes()).unwrap(),
        e
    );
    // A wrong chunk count or an impossible chunk is refused.
    assert!(codec_core::assemble(&h, &parts[..3], &[]).is_err());
    let short = [(7u8, &[0u8; 3][..]); 4];
    assert!(codec_core::assemble(&h, &short, &[]).is_err());
}

#[test]
fn a_profile_decoders_would_refuse_is_not_learned() {
    // Before: the learner wrote the profile, read it back under the default limits and
    // panicked ("profile parts must be valid") past 1024 layers or 65 536 channels.
    // One level: learning is quicker, the limits the same.
    let params = LearnParams {
        level_mult: vec![1.0],
        ..LearnParams::default()
    };
    let over = |layers, heads, dim| {
        let cache = synthetic(layers, heads, dim, 1, Dtype::F32, 7);
        let r = learn_profile(
            &[Sample {
                kv: cache.view(),
                queries: None,
            }],
            &params,
        );
        match r {
            Err(EncodeError::OverLimit { what, got, max }) => (what, got, max),
            other => panic!("{layers} x {heads} x {dim}: {other:?}"),
        }
    };
    assert_eq!(over(1025, 1, 2), ("layers", 1025, 1024));
    assert_eq!(over(1, 2, 32769), ("channels", 65538, 65536));
    // Within both, but 7 bytes of channel parameters for each of 1024 x 2 x 18 725 channels
    // are more than a profile's 256 MiB.
    let (what, got, max) = over(1024, 1, 18_725);
    assert_eq!((what, max), ("profile bytes", 1 << 28));
    assert!(got > max);
    let e = EncodeError::OverLimit { what, got, max };
    assert!(e
        .to_string()
        .contains("would be refused by decoders (at most 268435456)"));
    // The largest shape the limits take is learned.
    let largest = learn_plain(&synthetic(1024, 1, 2, 1, Dtype::F32, 7), &params);
    assert_eq!(largest.layers(), 1024);
    // 2^62 query heads of 4 values: the row length wrapped to 0, and `% 0` panicked.
    let cache = synthetic(1, 1, 4, 1, Dtype::F32, 7);
    let q = [0.0f32; 4];
    let r = learn_profile(
        &[Sample {
            kv: cache.view(),
            queries: Some(Queries {
                q: vec![&q],
                q_heads: 1 << 62,
                q_start: 0,
            }),
        }],
        &params,
    );
    assert!(
        matches!(r, Err(EncodeError::ShapeMismatch { what: "queries" })),
        "{r:?}"
    );
}
