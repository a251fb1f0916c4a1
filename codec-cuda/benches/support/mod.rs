//! What the benches (`benches/device.rs`, `benches/host.rs`) and the best-of-N harness
//! (`examples/device_bench.rs`) share: opening device 0 with the kernels loaded, the real
//! fixture's streams, decode plans and encode batches, the encode chain's context and source,
//! and a long PQ head.
#![allow(dead_code)] // each user takes a part

use std::path::{Path, PathBuf};

#[path = "../../tests/common/mod.rs"]
mod common;

use codec_core::{
    encode, learn_profile, ChunkContext, Dtype, EncodeParams, KvCache, LearnParams, Limits,
    Profile, ProfileMode, Sample, Stream,
};
use codec_cuda::decode::DecodePlan;
use codec_cuda::encode::{LaneEncodeBatch, QuantBatch};
use codec_cuda::encode_plan::{EncodePlan, Source};
use codec_cuda::pq::{HeadId, PqBatch};
use codec_cuda::quant::{OutDtype, OutLayout, Output};
use codec_cuda::Destination;
use codec_cuda::Gpu;
use pq_core::{pack, Codebook, Method};

/// Device 0 with the kernels loaded (NVRTC from `KVC_NVRTC_LIB`, else
/// `target/nvrtc/13.5.37/lib`, else by name), or why not.
pub fn open_gpu() -> Result<Gpu, String> {
    let gpu = Gpu::new(0).map_err(|e| format!("no GPU ({e})"))?;
    let fetched = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nvrtc/13.5.37/lib");
    let dir: Option<PathBuf> = match std::env::var_os("KVC_NVRTC_LIB") {
        Some(d) => Some(PathBuf::from(d)),
        None => fetched.join("libnvrtc.so.13").is_file().then_some(fetched),
    };
    gpu.load_kernels(dir.as_deref())
        .map_err(|e| format!("the kernels could not be loaded ({e})"))?;
    Ok(gpu)
}

/// The real 512-token fixture (all 30 layers) and a profile learned from its keys and values.
pub fn fixture() -> (kvc_io::Dump, Profile) {
    let d = kvc_io::load_dump(&kvc_io::fixtures::sample()).expect("fixture present");
    let sample = Sample {
        kv: d.kv.view(),
        queries: None,
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).expect("profile");
    (d, profile)
}

/// `cache` encoded at `level` in 128-token chunks, its profile embedded.
pub fn stream_bytes(cache: &KvCache, profile: &Profile, level: u8) -> Vec<u8> {
    let params = EncodeParams {
        chunk_tokens: 128,
        levels: vec![level],
        ..EncodeParams::default()
    };
    encode(&cache.view(), ProfileMode::Embedded(profile), &params).expect("encode")
}

/// A plan decoding `stream` `copies` times, each copy a sequence of its own in one dense f16
/// output.
pub fn decode_plan<'s>(stream: &'s Stream<'s>, copies: usize) -> DecodePlan<'s> {
    decode_plan_of(&vec![stream; copies])
}

/// A plan decoding each of `streams` (of one shape) as a sequence of its own, in order, in one
/// dense f16 output.
pub fn decode_plan_of<'s>(streams: &[&'s Stream<'s>]) -> DecodePlan<'s> {
    decode_plan_threads(streams, 1)
}

/// [`decode_plan_of`], the chunks checked on `threads` threads (`DecodePlan::add_streams`).
pub fn decode_plan_threads<'s>(streams: &[&'s Stream<'s>], threads: usize) -> DecodePlan<'s> {
    decode_plan_with(streams, threads, false)
}

/// [`decode_plan_threads`], with `crc_at_decode` the chunks' CRCs left to the decode
/// (`DecodePlan::set_crc_at_decode`).
pub fn decode_plan_with<'s>(
    streams: &[&'s Stream<'s>],
    threads: usize,
    crc_at_decode: bool,
) -> DecodePlan<'s> {
    let shape = streams[0].header().shape;
    let (tokens, c) = (shape.tokens, shape.channels());
    let per_copy = 2 * shape.layers as usize * tokens as usize * c;
    let output = Output {
        dtype: OutDtype::F16,
        layout: OutLayout::Dense,
        len: streams.len() * per_copy,
    };
    let mut plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
    plan.set_crc_at_decode(crc_at_decode);
    let dests: Vec<_> = (streams.iter().enumerate())
        .map(|(i, &stream)| {
            let dest = Destination {
                base: (i * per_copy) as u64,
                ..Destination::dense(tokens, c)
            };
            (stream, dest)
        })
        .collect();
    plan.add_streams(&dests, threads).expect("plan");
    plan
}

/// Every block of every chunk of `stream`, `copies` times: rows (from `tensors`, per layer K
/// then V, `[T, C]`), exponents and constants for the quantization kernel, table indices and
/// tables for the lane encoder (the tests' `encode_case`).
pub fn encode_batches(
    stream: &Stream<'_>,
    tensors: &[Vec<f32>],
    copies: usize,
) -> (QuantBatch, LaneEncodeBatch) {
    let case = common::encode_case(stream, tensors, copies);
    (case.quant, case.enc)
}

/// One head of `tokens` synthetic codes (residual, m = 2, b = 6, key dim `dim`) and `queries`
/// queries over all of it (k = T/5, windows 4 + 64): the batch and its token-scores.
pub fn pq_long_batch(
    tokens: usize,
    queries: usize,
    dim: usize,
    room: usize,
) -> (PqBatch, HeadId, usize) {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let cw: Vec<f32> = (0..2 * 64 * dim)
        .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let cb = Codebook::from_parts(Method::Residual, dim, 2, 6, 1, cw).expect("codebook");
    let codes: Vec<u16> = (0..2 * tokens).map(|_| (next() % 64) as u16).collect();
    let mut batch = PqBatch::new(&cb).expect("batch");
    let id = batch
        .add_head_with_room(&cb, &pack(&codes, 6).expect("pack"), tokens, room)
        .expect("head");
    for i in 0..queries {
        let q: Vec<f32> = (0..dim)
            .map(|j| ((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        batch
            .add_query(id, &q, tokens, tokens / 5, 4, 64)
            .expect("query");
    }
    (batch, id, queries * tokens)
}

/// Opens a stream of `bytes` (profile embedded).
pub fn open(bytes: &[u8]) -> Stream<'_> {
    Stream::open(bytes, None, &Limits::DEFAULT).expect("stream")
}

/// A profile learned from the fixture with its queries (the importance policy's hints).
pub fn profile_with_queries(d: &kvc_io::Dump) -> Profile {
    let q = d.q.as_ref().expect("the fixture has queries");
    let queries = codec_core::Queries {
        q: q.iter().map(Vec::as_slice).collect(),
        q_heads: d.q_heads,
        q_start: d.q_start,
    };
    let sample = Sample {
        kv: d.kv.view(),
        queries: Some(queries),
    };
    learn_profile(&[sample], &LearnParams::default()).expect("profile")
}

/// The fixture's coding context as `kvc encode` codes it (default group and sink tokens, the
/// importance policy on).
pub fn encode_context<'p>(d: &kvc_io::Dump, profile: &'p Profile) -> ChunkContext<'p> {
    let (shape, meta, p) = (d.kv.shape, &d.kv.meta, EncodeParams::default());
    let first = meta.first_position;
    ChunkContext::new(
        shape,
        Dtype::F16,
        first,
        p.group,
        p.n_sink,
        profile,
        meta.rope,
    )
    .expect("context")
    .with_query_position(Some(first + u64::from(shape.tokens)))
}

/// A plan of `copies` times the fixture's 128-token chunks at `level`; the chunks' ranges.
pub fn encode_plan<'c, 'p>(
    ctx: &'c ChunkContext<'p>,
    source: Source,
    level: u8,
    copies: usize,
) -> (EncodePlan<'c, 'p>, Vec<std::ops::Range<u32>>) {
    let tokens = ctx.shape().tokens;
    let chunks: Vec<_> = (0..tokens.div_ceil(128))
        .map(|c| c * 128..((c + 1) * 128).min(tokens))
        .collect();
    let mut plan = EncodePlan::new(ctx, source).expect("plan");
    for _ in 0..copies {
        for r in &chunks {
            plan.add_chunk(r.clone(), level).expect("chunk");
        }
    }
    (plan, chunks)
}
