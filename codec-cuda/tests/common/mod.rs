//! What the host-kernel tests share: codec-core's lane decoder as the reference, and the
//! comparison of a decoded block with it.
#![allow(dead_code)] // each test binary uses a part

use std::path::{Path, PathBuf};

use codec_core::consts::LANES;
use codec_core::rans::{DecodeTable, FreqTable, LaneDecoder, RansError};
use codec_core::{ChunkContext, Dtype, KvCache, Limits, Profile, Stream, Tensor};
use codec_cuda::decode::DecodePlan;
use codec_cuda::encode_plan::Source;
use codec_cuda::quant::{OutDtype, OutLayout, Output};
use codec_cuda::rans::{LaneDecoded, LaneStatus};
use codec_cuda::Destination;

/// codec-core's decode of one block: its symbols (as far as it got) and its outcome.
pub fn reference(
    words: &[u32],
    lane_len: [usize; LANES],
    tables: &[&FreqTable],
) -> (Vec<u8>, Result<(), RansError>) {
    // One DecodeTable per distinct table (they are 5-21 KiB each).
    let mut distinct: Vec<(&FreqTable, DecodeTable)> = Vec::new();
    let mut index = Vec::with_capacity(tables.len());
    for &t in tables {
        let i = match distinct.iter().position(|(d, _)| std::ptr::eq(*d, t)) {
            Some(i) => i,
            None => {
                distinct.push((t, DecodeTable::new(t)));
                distinct.len() - 1
            }
        };
        index.push(i);
    }
    let per_symbol: Vec<&DecodeTable> = index.iter().map(|&i| &distinct[i].1).collect();
    let mut out = vec![0u8; tables.len()];
    match LaneDecoder::from_concatenated(words, lane_len) {
        Err(e) => (out, Err(e)),
        Ok(mut dec) => {
            let decoded = dec.decode(0, &per_symbol, &mut out);
            assert_eq!(decoded, Ok(()), "reference decode of a whole block");
            (out, dec.finish())
        }
    }
}

/// Block `b` of `got`, as codec-core reports a block: `Err` with codec-core's error of the
/// deciding lane; a status codec-core has no error for is a test failure.
pub fn outcome(got: &LaneDecoded, b: usize) -> Result<(), RansError> {
    got.outcome(b).map_err(|f| {
        f.status
            .rans_error(f.lane)
            .unwrap_or_else(|| panic!("block {b}: lane {} has status {:?}", f.lane, f.status))
    })
}

/// Asserts that block `b` of `got` matches codec-core's decode of the same words and tables
/// bit for bit: same outcome, and same symbols unless a lane's last word is 0 (then codec-core
/// decodes nothing).
pub fn assert_matches_reference(
    got: &LaneDecoded,
    b: usize,
    words: &[u32],
    lane_len: [usize; LANES],
    tables: &[&FreqTable],
) {
    let (want_symbols, want) = reference(words, lane_len, tables);
    assert_eq!(outcome(got, b), want, "block {b}: outcome");
    if !matches!(want, Err(RansError::ZeroFinalWord { .. })) {
        assert!(got.symbols(b) == want_symbols, "block {b}: symbols differ");
    }
    assert!(got
        .status(b)
        .iter()
        .all(|s| !matches!(s, LaneStatus::Unknown(_))));
}

pub fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../spec/vectors")
}

/// The golden streams' bytes and profiles, by name (all 20 or more of them), and one more:
/// the stream whose chunks hold 64, 64 and 32 tokens with 100 as its header's `chunk_tokens`
/// (chunks need not all have `chunk_tokens` tokens, FORMAT.md §3.3), named by its vector's
/// file and the change (its output is the vector's).
pub fn golden() -> Vec<(String, Vec<u8>, Option<Profile>)> {
    let mut names: Vec<String> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('v') && n.ends_with(".kvc"))
        .collect();
    names.sort();
    assert!(names.len() >= 20, "golden vectors found: {names:?}");
    let mut streams: Vec<_> = names
        .into_iter()
        .map(|name| {
            let (bytes, profile) = read_vector(&name);
            (name, bytes, profile)
        })
        .collect();
    let (mut short, profile) = read_vector("v04-chunk-remainder.kvc");
    short[48..52].copy_from_slice(&100u32.to_le_bytes());
    codec_core::fuzzing::fix_stream_crcs(&mut short);
    streams.push((
        "v04-chunk-remainder.kvc with chunk_tokens 100".into(),
        short,
        profile,
    ));
    streams
}

/// The stream file `name` of the golden vectors and its profile (`.kvcp` beside it), if it
/// has one.
pub fn read_vector(name: &str) -> (Vec<u8>, Option<Profile>) {
    let path = vectors_dir().join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let profile = std::fs::read(path.with_extension("kvcp"))
        .ok()
        .map(|p| Profile::from_bytes(&p, &Limits::DEFAULT).expect("golden profile"));
    (bytes, profile)
}

/// codec-core's decode of `stream` into `dtype` buffers: per layer K then V, each `[T, H, D]`,
/// as bits (the fuzz harness's oracle).
pub fn codec_core_tensors(stream: &Stream<'_>, dtype: OutDtype) -> Vec<Vec<u16>> {
    codec_cuda::fuzzing::codec_core_bits(stream, dtype).expect("codec-core decodes the stream")
}

/// A permutation of `0..n` from a seed (xorshift, Fisher-Yates).
pub fn permutation(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        p.swap(i, (s % (i as u64 + 1)) as usize);
    }
    p
}

/// Every block of every chunk of `stream`, `copies` times, as encode-kernel inputs: its rows
/// (from `tensors`, per layer K then V, `[T, C]` f32), step exponents and constants in a
/// quantization batch, its table indices and tables in a lane-encode batch; and what
/// codec-core's encoder wrote: each block's symbol values and lanes (each chunk decoded by the
/// host-run kernels). The tests take one copy, the benches (`benches/support`) several.
pub struct EncodeCase {
    pub quant: codec_cuda::encode::QuantBatch,
    pub enc: codec_cuda::encode::LaneEncodeBatch,
    pub values: Vec<Vec<i32>>,
    pub lanes: Vec<Vec<Vec<u32>>>,
}

pub fn encode_case(stream: &Stream<'_>, tensors: &[Vec<f32>], copies: usize) -> EncodeCase {
    use codec_cuda::encode::{EncTableId, LaneEncodeBatch, QuantBatch};
    use codec_cuda::quant::ChannelConsts;
    use codec_cuda::stream::ChunkLanes;
    let h = stream.header();
    let c = h.shape.channels();
    let mut quant = QuantBatch::new(h.shape.kv_heads, h.shape.head_dim);
    let mut enc = LaneEncodeBatch::new();
    let (mut values, mut lanes_out) = (Vec::new(), Vec::new());
    for chunk in 0..h.chunks.len() {
        let lanes = ChunkLanes::read(stream, chunk).unwrap();
        // Tables by address, per chunk: a chunk's exponent tables live as long as `lanes`.
        let mut distinct: Vec<(*const FreqTable, EncTableId)> = Vec::new();
        let exp_out = lanes.exponent_batch().unwrap().decode_host(2).unwrap();
        let exps: Vec<&[u8]> = (0..lanes.blocks.len())
            .map(|b| exp_out.symbols(b))
            .collect();
        let sym_out = lanes.symbol_batch(&exps).unwrap().decode_host(2).unwrap();
        let mult = stream.profile().level_multipliers()[usize::from(lanes.level())];
        let token_start = h.chunks[chunk].token_start as usize;
        let rows = lanes.rows();
        for (b, blk) in (0..copies).flat_map(|_| lanes.blocks.iter().enumerate()) {
            let consts =
                ChannelConsts::of_block(stream.profile().channel_params(blk.layer, blk.kv), mult);
            let start = quant.add_consts(&consts);
            let t = &tensors[blk.layer as usize * 2 + blk.kv];
            let x = &t[token_start * c..(token_start + rows) * c];
            let e = blk.exp_table.as_ref().map(|_| exps[b]);
            quant
                .add_block(x, lanes.sink_rows() as u32, u32::from(h.group), e, start)
                .unwrap();
            let tables: Vec<EncTableId> = lanes
                .symbol_tables(b, exps[b])
                .into_iter()
                .map(
                    |t| match distinct.iter().find(|(p, _)| std::ptr::eq(*p, t)) {
                        Some(&(_, id)) => id,
                        None => {
                            let id = enc.add_table(t);
                            distinct.push((t, id));
                            id
                        }
                    },
                )
                .collect();
            enc.add_block(sym_out.symbols(b), &tables).unwrap();
            values.push(lanes.symbol_values(b, sym_out.symbols(b), exps[b]).unwrap());
            let (words, mut at) = (blk.words.to_vec(), 0);
            lanes_out.push(
                blk.lane_len
                    .iter()
                    .map(|&n| {
                        at += n;
                        words[at - n..at].to_vec()
                    })
                    .collect(),
            );
        }
    }
    EncodeCase {
        quant,
        enc,
        values,
        lanes: lanes_out,
    }
}

/// A plan decoding each of `streams` (of one shape) into dense f16 tensors of its own, one
/// after another in one output.
pub fn dense_plan<'s>(streams: &[&'s Stream<'s>]) -> DecodePlan<'s> {
    dense_plan_with(streams, false).expect("a plan of intact streams")
}

/// [`dense_plan`], with `crc_at_decode` the chunks' CRCs left to the decode; the error of the
/// first chunk refused.
pub fn dense_plan_with<'s>(
    streams: &[&'s Stream<'s>],
    crc_at_decode: bool,
) -> Result<DecodePlan<'s>, codec_cuda::CudaError> {
    let shape = streams[0].header().shape;
    let per_stream = 2 * shape.layers as usize * shape.tensor_len();
    let output = Output {
        dtype: OutDtype::F16,
        layout: OutLayout::Dense,
        len: streams.len() * per_stream,
    };
    let mut plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
    plan.set_crc_at_decode(crc_at_decode);
    for (i, stream) in streams.iter().enumerate() {
        let dest = Destination {
            base: (i * per_stream) as u64,
            ..Destination::dense(shape.tokens, shape.channels())
        };
        plan.add_stream(stream, dest)?;
    }
    Ok(plan)
}

/// `cache` with its tokens in reverse order (every tensor's rows): a second source of the
/// same layout and other contents.
pub fn tokens_reversed(cache: &KvCache) -> KvCache {
    let c = cache.shape.channels();
    let reverse = |t: &Tensor| match t {
        Tensor::F32(x) => Tensor::F32(x.chunks(c).rev().flatten().copied().collect()),
        Tensor::F16(x) => Tensor::F16(x.chunks(c).rev().flatten().copied().collect()),
        Tensor::Bf16(x) => Tensor::Bf16(x.chunks(c).rev().flatten().copied().collect()),
    };
    KvCache {
        shape: cache.shape,
        k: cache.k.iter().map(reverse).collect(),
        v: cache.v.iter().map(reverse).collect(),
        meta: cache.meta.clone(),
    }
}

/// The real 512-token fixture's first `layers` layers encoded by codec-core with step
/// exponents (token importance from its queries) at three levels in 96-token chunks, and the
/// cache's tensors (per layer K then V, `[T, C]` f32).
pub fn fixture_stream(layers: usize) -> (Vec<u8>, Vec<Vec<f32>>) {
    use codec_core::{encode, EncodeParams, ProfileMode};
    let (cache, profile) = fixture_cache(layers);
    let layers = cache.shape.layers as usize;
    let some: Vec<u8> = (0..profile.levels()).step_by(3).take(3).collect();
    let chunks = cache.shape.tokens.div_ceil(96) as usize;
    let params = EncodeParams {
        chunk_tokens: 96,
        levels: some.iter().copied().cycle().take(chunks).collect(),
        token_importance: true,
        ..EncodeParams::default()
    };
    let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let tensors = (0..layers)
        .flat_map(|l| [cache.k[l].to_f32_vec(), cache.v[l].to_f32_vec()])
        .collect();
    (bytes, tensors)
}

/// The cache's tensors in one buffer (layer 0 K, layer 0 V, ...) as little-endian bytes, and
/// their source description.
pub fn source_of(cache: &KvCache) -> (Vec<u8>, Source) {
    Source::of_view(&cache.view())
}

/// The real 512-token fixture's first `layers` layers (f16, post-rotary keys) and a profile
/// learned from them with their queries (the importance hints).
pub fn fixture_cache(layers: usize) -> (KvCache, Profile) {
    use codec_core::{learn_profile, LearnParams, Queries, Sample};
    let mut d = kvc_io::load_dump(&kvc_io::fixtures::sample()).expect("fixture present");
    d.keep_layers(layers);
    let q = d.q.as_ref().expect("the fixture has queries");
    let queries = Queries {
        q: q.iter().map(Vec::as_slice).collect(),
        q_heads: d.q_heads,
        q_start: d.q_start,
    };
    let sample = Sample {
        kv: d.kv.view(),
        queries: Some(queries),
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
    (d.kv, profile)
}

/// The fixture's coding context: groups of 8, 4 sink tokens, the importance policy on (the
/// queries after the last token).
pub fn fixture_context<'p>(cache: &KvCache, profile: &'p Profile) -> ChunkContext<'p> {
    let (shape, meta) = (cache.shape, &cache.meta);
    assert!(!meta.rope.k_pre_rope);
    let first = meta.first_position;
    ChunkContext::new(shape, Dtype::F16, first, 8, 4, profile, meta.rope)
        .unwrap()
        .with_query_position(Some(first + u64::from(shape.tokens)))
}

/// Chunks of 96 of `tokens` tokens (the first with sink rows) at three of the profile's levels,
/// and odd ranges: `(start, end, level)`.
pub fn fixture_chunks(profile: &Profile, tokens: u32) -> Vec<(u32, u32, u8)> {
    let levels: Vec<u8> = (0..profile.levels()).step_by(3).take(3).collect();
    let level = |i: u32| levels[i as usize % levels.len()];
    let mut chunks: Vec<(u32, u32, u8)> = (0..tokens.div_ceil(96))
        .map(|i| (i * 96, ((i + 1) * 96).min(tokens), level(i)))
        .collect();
    chunks.extend([(1, 2, 0), (3, 50, levels[1]), (500, 512, levels[2])]);
    chunks
}

/// f32 bit patterns for narrowing tests: every 4099th one and every one within `spread` of an
/// edge, each with both signs.
pub fn f32_patterns(edges: &[u32], spread: u32) -> impl Iterator<Item = u32> + '_ {
    let near = move |b: u32| b.saturating_sub(spread)..b.saturating_add(spread);
    (0..=u32::MAX)
        .step_by(4099)
        .chain(edges.iter().flat_map(move |&b| near(b)))
        .flat_map(|b| [b, b | 0x8000_0000])
}
