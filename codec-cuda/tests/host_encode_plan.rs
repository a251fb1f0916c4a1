//! The encode chain (`kvc_encode_blocks`, `kvc_rans_lane_encode`, `kvc_place_blocks`,
//! `kvc_write_blocks`, `kvc_seal_chunks`), compiled for the host:
//! every chunk of an [`EncodePlan`] byte for byte what codec-core's `ChunkContext::encode_chunk`
//! writes, on the real fixture (f16, step exponents from its queries, three levels) and on
//! proptest caches (f32, f16, bf16; groups, sink rows, positions, outliers that escape,
//! non-finite values, with and without the importance policy, keys stored before or after the
//! rotary embedding).

use codec_core::{
    learn_profile, ChunkContext, Dtype, KvCache, KvMeta, KvShape, LearnParams, Profile, Queries,
    Rope, RopeStyle, Sample, Tensor,
};
use codec_cuda::encode_plan::{EncodePlan, Source};
use codec_cuda::CudaError;
use half::{bf16, f16};
use proptest::prelude::*;

mod common;

/// Encodes `chunks` of `cache` with the host-run chain and with codec-core; asserts every chunk
/// is the same bytes. Returns the chunks.
fn assert_chunks_match(
    ctx: &ChunkContext<'_>,
    cache: &KvCache,
    chunks: &[(u32, u32, u8)],
) -> Vec<Vec<u8>> {
    let (src, source) = common::source_of(cache);
    let mut plan = EncodePlan::new(ctx, source).unwrap();
    for &(start, end, level) in chunks {
        plan.add_chunk(start..end, level).unwrap();
    }
    let got = plan.encode_host(&src).unwrap();
    assert_eq!(got.len(), chunks.len());
    for (i, &(start, end, level)) in chunks.iter().enumerate() {
        let want = ctx.encode_chunk(&cache.view(), start..end, level).unwrap();
        assert!(
            got[i] == want,
            "chunk {i} ({start}..{end}, level {level}) differs ({} vs {} bytes)",
            got[i].len(),
            want.len()
        );
    }
    got
}

/// Per block of a chunk (layer 0 K, layer 0 V, ...): its escape count and exponent alphabet,
/// read from the block's fixed fields (spec/FORMAT.md §5.2).
fn block_fields(chunk: &[u8], layers: usize, sink_bytes: usize) -> Vec<(u32, u8)> {
    let mut at = 0;
    let mut out = Vec::new();
    for _ in 0..2 * layers {
        let u32_at = |i: usize| u32::from_le_bytes(chunk[i..i + 4].try_into().unwrap());
        let n_esc = u32_at(at);
        let words: u32 = (0..32).map(|l| u32_at(at + 4 + 4 * l)).sum();
        let n_exp = chunk[at + 132];
        out.push((n_esc, n_exp));
        at += 133 + 2 * n_exp as usize + sink_bytes + 4 * n_esc as usize + 4 * words as usize;
    }
    assert_eq!(at + 4, chunk.len(), "the blocks and the CRC fill the chunk");
    out
}

/// The real 512-token fixture (SmolLM2, 3 layers, f16, post-rotary keys), a profile learned
/// from it with its queries, the importance policy on: chunks of 96 tokens (the first with
/// sink rows) at three levels, and odd ranges.
#[test]
fn real_fixture_chunks_are_codec_cores() {
    let layers = 3usize;
    let (cache, profile) = common::fixture_cache(layers);
    assert!(profile.importance().is_some());
    let ctx = common::fixture_context(&cache, &profile);
    let shape = cache.shape;
    let chunks = common::fixture_chunks(&profile, shape.tokens);
    let got = assert_chunks_match(&ctx, &cache, &chunks);
    // The paths that matter were taken: exponent sections and escapes.
    let c = shape.channels();
    let fields: Vec<(u32, u8)> = got
        .iter()
        .zip(&chunks)
        .flat_map(|(bytes, &(start, end, _))| {
            let sink = ctx.sink_rows(start, end - start);
            block_fields(bytes, layers, sink * c * 2)
        })
        .collect();
    assert!(
        fields.iter().filter(|f| f.1 > 0).count() >= 10,
        "{fields:?}"
    );
    assert!(fields.iter().map(|f| f.0).sum::<u32>() > 100, "{fields:?}");
    // Its keys taken as stored before the rotary embedding: the policy rotates them to each
    // row's position first (NeoX and GPT-J pairings), still codec-core's chunks.
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        let rope = Rope {
            k_pre_rope: true,
            style,
            ..cache.meta.rope
        };
        let pre = ChunkContext::new(shape, Dtype::F16, 0, 8, 4, &profile, rope)
            .unwrap()
            .with_query_position(Some(u64::from(shape.tokens)));
        let got = assert_chunks_match(&pre, &cache, &chunks[..3]);
        assert!(block_fields(&got[1], layers, 0).iter().any(|f| f.1 > 0));
    }
    // Without the policy: no exponent sections, still codec-core's chunks.
    let plain = ctx.clone().with_query_position(None);
    let got = assert_chunks_match(&plain, &cache, &chunks[..3]);
    assert!(block_fields(&got[1], layers, 0).iter().all(|f| f.1 == 0));
}

/// A small random cache and how to code it.
#[derive(Clone, Debug)]
struct Case {
    shape: KvShape,
    dtype: Dtype,
    values: Vec<f32>,
    queries: Vec<f32>,
    group: u32,
    n_sink: u16,
    first_position: u64,
    importance: bool,
    chunks: Vec<(u32, u32)>,
    rope: Rope,
}

/// Rotary settings: keys stored before or after it, either pairing or none, bases and
/// position scalings.
fn rope() -> impl Strategy<Value = Rope> {
    (
        prop_oneof![
            Just(RopeStyle::NeoX),
            Just(RopeStyle::GptJ),
            Just(RopeStyle::None)
        ],
        prop_oneof![Just(10000.0f32), Just(500.0), Just(1.0e6)],
        prop_oneof![Just(1.0f32), Just(0.5), Just(4.0)],
        any::<bool>(),
    )
        .prop_map(|(style, theta, scaling, k_pre_rope)| Rope {
            theta,
            style,
            scaling,
            k_pre_rope,
        })
}

fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -3.0f32..3.0,
        1 => prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(-f32::INFINITY), Just(6.0e4f32)],
        2 => -200.0f32..200.0,
        1 => (-40i32..40).prop_map(|k| k as f32 / 8.0),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        1u32..3,
        1u32..3,
        prop_oneof![Just(2u32), Just(4), Just(8)],
        1u32..40,
    )
        .prop_flat_map(|(layers, kv_heads, head_dim, tokens)| {
            let shape = KvShape {
                layers,
                kv_heads,
                head_dim,
                tokens,
            };
            let n = 2 * (layers * tokens) as usize * shape.channels();
            let nq = (layers * tokens) as usize * shape.channels();
            (
                Just(shape),
                prop_oneof![Just(Dtype::F32), Just(Dtype::F16), Just(Dtype::Bf16)],
                proptest::collection::vec(value(), n),
                proptest::collection::vec(-2.0f32..2.0, nq),
                1u32..6,
                0u16..4,
                0u64..6,
                any::<bool>(),
                proptest::collection::vec((0..tokens, 1..=tokens), 1..4),
                rope(),
            )
        })
        .prop_map(
            |(
                shape,
                dtype,
                values,
                queries,
                group,
                n_sink,
                first_position,
                importance,
                ranges,
                rope,
            )| {
                let chunks = ranges
                    .into_iter()
                    .map(|(a, b)| (a.min(b - 1), b.max(a + 1)))
                    .collect();
                Case {
                    shape,
                    dtype,
                    values,
                    queries,
                    group,
                    n_sink,
                    first_position,
                    importance,
                    chunks,
                    rope,
                }
            },
        )
}

/// The case's cache in its dtype (values rounded to it).
fn cache_of(c: &Case) -> KvCache {
    let per = (c.shape.tokens as usize) * c.shape.channels();
    let tensor = |i: usize| {
        let x = &c.values[i * per..(i + 1) * per];
        match c.dtype {
            Dtype::F32 => Tensor::F32(x.to_vec()),
            Dtype::F16 => Tensor::F16(x.iter().map(|&v| f16::from_f32(v)).collect()),
            Dtype::Bf16 => Tensor::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect()),
        }
    };
    let layers = c.shape.layers as usize;
    KvCache {
        shape: c.shape,
        k: (0..layers).map(|l| tensor(2 * l)).collect(),
        v: (0..layers).map(|l| tensor(2 * l + 1)).collect(),
        meta: KvMeta {
            first_position: c.first_position,
            ..KvMeta::default()
        },
    }
}

/// A profile learned from the case's finite values (and its queries: the importance hints).
fn profile_of(c: &Case, cache: &KvCache) -> Profile {
    let clean = |t: &Tensor| {
        Tensor::F32(
            t.to_f32_vec()
                .iter()
                .map(|&v| if v.is_finite() { v } else { 0.0 })
                .collect(),
        )
    };
    let learn_cache = KvCache {
        shape: cache.shape,
        k: cache.k.iter().map(clean).collect(),
        v: cache.v.iter().map(clean).collect(),
        meta: cache.meta.clone(),
    };
    let per = (c.shape.tokens as usize) * c.shape.channels();
    let q: Vec<&[f32]> = c.queries.chunks(per).collect();
    let queries = Queries {
        q,
        q_heads: c.shape.kv_heads as usize,
        q_start: 0,
    };
    let sample = Sample {
        kv: learn_cache.view(),
        queries: Some(queries),
    };
    learn_profile(&[sample], &LearnParams::default()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn chunks_are_codec_cores(c in case()) {
        let cache = cache_of(&c);
        let profile = profile_of(&c, &cache);
        let end = c.first_position + u64::from(c.shape.tokens);
        let ctx = ChunkContext::new(c.shape, c.dtype, c.first_position, c.group, c.n_sink, &profile, c.rope)
            .unwrap()
            .with_query_position(c.importance.then_some(end));
        let levels = profile.levels();
        let chunks: Vec<(u32, u32, u8)> = c
            .chunks
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| (a, b, (i as u8 * 5) % levels))
            .collect();
        assert_chunks_match(&ctx, &cache, &chunks);
    }
}

/// Plans that cannot be run are typed errors, not panics: another dtype, a short stride or
/// buffer, a level or token range outside the stream.
#[test]
fn bad_plans_are_errors() {
    let c = Case {
        shape: KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            tokens: 6,
        },
        dtype: Dtype::F32,
        values: (0..48).map(|i| (i as f32 * 0.37).sin()).collect(),
        queries: (0..24).map(|i| (i as f32 * 0.11).cos()).collect(),
        group: 2,
        n_sink: 1,
        first_position: 0,
        importance: true,
        chunks: vec![],
        rope: Rope::default(),
    };
    let cache = cache_of(&c);
    let profile = profile_of(&c, &cache);
    let ctx = ChunkContext::new(c.shape, Dtype::F32, 0, 2, 1, &profile, Rope::default())
        .unwrap()
        .with_query_position(Some(6));
    let (src, source) = common::source_of(&cache);
    let is_input = |r: Result<_, CudaError>| matches!(r, Err(CudaError::Input { .. }));
    assert!(is_input(
        EncodePlan::new(
            &ctx,
            Source {
                dtype: Dtype::F16,
                ..source
            }
        )
        .map(|_| ())
    ));
    assert!(is_input(
        EncodePlan::new(
            &ctx,
            Source {
                tensor_stride: 23,
                ..source
            }
        )
        .map(|_| ())
    ));
    let mut plan = EncodePlan::new(&ctx, source).unwrap();
    assert!(is_input(plan.add_chunk(0..7, 0)));
    assert!(is_input(plan.add_chunk(3..3, 0)));
    assert!(is_input(plan.add_chunk(0..6, profile.levels())));
    plan.add_chunk(0..6, 0).unwrap();
    assert!(is_input(
        plan.encode_host(&src[..src.len() - 1]).map(|_| ())
    ));
    assert_eq!(plan.encode_host(&src).unwrap().len(), 1);
}

/// A whole stream: its frame (`codec_core::stream_frame`), every chunk coded by the chain,
/// assembled: `codec_core::encode`'s bytes, self-contained and referencing its profile (what
/// `kvc encode --gpu` does with `Gpu::encode`).
#[test]
fn streams_assembled_from_the_chain_are_codec_cores() {
    use codec_core::{assemble, encode, stream_frame, EncodeParams, ProfileMode};
    let (cache, profile) = common::fixture_cache(2);
    let params = EncodeParams {
        chunk_tokens: 200,
        levels: vec![0, 5, 9],
        ..EncodeParams::default()
    };
    for mode in [
        ProfileMode::Embedded(&profile),
        ProfileMode::Referenced(&profile),
    ] {
        let frame = stream_frame(&cache.view(), mode, &params).unwrap();
        let (src, source) = common::source_of(&cache);
        let mut plan = EncodePlan::new(&frame.context, source).unwrap();
        for e in &frame.header.chunks {
            plan.add_chunk(e.token_start..e.token_start + e.tokens, e.level)
                .unwrap();
        }
        let chunks = plan.encode_host(&src).unwrap();
        let parts: Vec<(u8, &[u8])> = (frame.header.chunks.iter().zip(&chunks))
            .map(|(e, c)| (e.level, c.as_slice()))
            .collect();
        let stream = assemble(&frame.header, &parts, &frame.profile).unwrap();
        assert!(stream == encode(&cache.view(), mode, &params).unwrap());
    }
}
