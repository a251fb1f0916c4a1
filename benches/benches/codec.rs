//! End-to-end codec throughput on a real cache: `encode` (f16 in) and `decode` (f16 out) of the
//! 512-token SmolLM2 sample in `testdata/` (30 layers, 3 KV heads x 64, 5.9 M elements), with a
//! profile learned from the sample itself, at level 7 (the default) and level 1 (near-lossless),
//! decoding both to a fresh owned cache (`decode`) and into reused buffers (`decode_into`).
//! Throughput is reported in bytes of f16 (2 bytes per element), as the targets are stated.
//!
//! Encoding and decoding into reused buffers run on 1 and 2 threads and on every core
//! (`threads1`, `threads2`, `threads_all`; the last is left out where it is 2).
//!
//! `open/`: a self-contained stream's profile parsed, and the stream decoded from its bytes.
//! `chunk_of_16384/`: one chunk of 16 384 decoded, the stream opened each time or attached.
//! `small_chunks/`: one chunk of the sample's 30 layers decoded, chunks of 1, 16 and 128 tokens:
//! what a chunk costs beside its elements (its 60 blocks' setup).
//!
//! With `../shared/fixtures/smollm2-gpl3-2048.safetensors` present, the same runs on it too.

use codec_core::{
    decode, encode_threads, learn_profile, thread_count, Dtype, EncodeParams, KvShape, LearnParams,
    Limits, Profile, ProfileMode, Sample, Stream, Tensor,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvc_benches::{big_fixture_path, load, sample_path, self_profile};
use std::hint::black_box;
use std::path::Path;

fn bench_fixture(c: &mut Criterion, name: &str, path: &Path) {
    let f = load(path);
    let profile = self_profile(&f);
    let bytes = f.kv.shape.total_elements() * 2;
    let mut g = c.benchmark_group(format!("codec/{name}"));
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(10);
    for level in [7u8, 1] {
        let params = EncodeParams {
            levels: vec![level],
            ..EncodeParams::default()
        };
        let view = f.kv.view();
        let mode = ProfileMode::Referenced(&profile);
        for (t, label) in thread_counts() {
            g.bench_function(format!("encode/level{level}/{label}"), |b| {
                b.iter(|| encode_threads(black_box(&view), mode, &params, t).unwrap())
            });
        }
        let stream = encode_threads(&view, mode, &params, 0).unwrap();
        g.bench_function(format!("decode/level{level}"), |b| {
            b.iter(|| decode(black_box(&stream), Some(&profile), &Limits::DEFAULT).unwrap())
        });
        // The same decode into a caller's buffers, reused between iterations (as a server
        // decodes into its KV pages): what the decoder itself costs, without the operating
        // system's first touch of a fresh 2-bytes-per-element allocation that `decode` pays.
        let st = Stream::open(&stream, Some(&profile), &Limits::DEFAULT).unwrap();
        let mut out = st.decode().unwrap();
        let tokens = f.kv.shape.tokens;
        for (t, label) in thread_counts() {
            g.bench_function(format!("decode_into/level{level}/{label}"), |b| {
                b.iter(|| {
                    let mut k: Vec<_> = out.k.iter_mut().map(|t| t.as_mut()).collect();
                    let mut v: Vec<_> = out.v.iter_mut().map(|t| t.as_mut()).collect();
                    let st = black_box(&st);
                    st.decode_range_into_threads(0..tokens, &mut k, &mut v, t)
                        .unwrap()
                })
            });
        }
    }
    g.finish();
}

/// What a self-contained stream costs before its first element: its embedded profile parsed
/// and hashed (`Profile::from_bytes`, in `Stream::open`), and its whole decode from bytes, which
/// builds the decode lookups of the level it uses (as a binding's `decode(bytes)` does).
fn bench_open(c: &mut Criterion, name: &str, path: &Path) {
    let f = load(path);
    let profile = self_profile(&f);
    let mut g = c.benchmark_group(format!("open/{name}"));
    g.sample_size(20);
    g.bench_function("profile_from_bytes", |b| {
        b.iter(|| Profile::from_bytes(black_box(profile.as_bytes()), &Limits::DEFAULT).unwrap())
    });
    let params = EncodeParams::default();
    let mode = ProfileMode::Embedded(&profile);
    let stream = encode_threads(&f.kv.view(), mode, &params, 0).unwrap();
    g.throughput(Throughput::Bytes(f.kv.shape.total_elements() * 2));
    g.bench_function("decode_self_contained", |b| {
        b.iter(|| decode(black_box(&stream), None, &Limits::DEFAULT).unwrap())
    });
    g.finish();
}

/// One chunk of a stream of many decoded into a reused buffer, as a binding's handle decodes
/// chunk by chunk: the stream opened for each decode (its whole index parsed and checked) or
/// opened once and attached again ([`codec_core::DetachedStream`]). The fixture's first
/// layer and KV head, repeated to 16 384 tokens, in one-token chunks.
fn bench_chunk_of_many(c: &mut Criterion, path: &Path) {
    let f = load(path);
    let mut kv = f.kv.clone();
    let (tokens, dim) = (16_384usize, kv.shape.head_dim as usize);
    let row = kv.shape.channels();
    let first_head = |t: &Tensor| -> Tensor {
        let values = t.to_f32_vec();
        let rows = values.chunks(row).flat_map(|r| r[..dim].iter().copied());
        Tensor::F32(rows.cycle().take(tokens * dim).collect())
    };
    kv.k = vec![first_head(&kv.k[0])];
    kv.v = vec![first_head(&kv.v[0])];
    kv.shape = KvShape {
        layers: 1,
        kv_heads: 1,
        head_dim: dim as u32,
        tokens: tokens as u32,
    };
    let sample = Sample {
        kv: kv.view(),
        queries: None,
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
    let params = EncodeParams {
        chunk_tokens: 1,
        ..EncodeParams::default()
    };
    let bytes = encode_threads(&kv.view(), ProfileMode::Referenced(&profile), &params, 0).unwrap();
    let opened = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT)
        .unwrap()
        .detach();
    let mut out = [
        Tensor::zeros(Dtype::F32, dim),
        Tensor::zeros(Dtype::F32, dim),
    ];
    let mut g = c.benchmark_group("chunk_of_16384");
    g.sample_size(20);
    let mut next = 0u32;
    let mut one_chunk = |s: Stream<'_>| {
        next = (next + 7919) % tokens as u32;
        let [k, v] = &mut out;
        let (mut k, mut v) = ([k.as_mut()], [v.as_mut()]);
        s.decode_range_into(next..next + 1, &mut k, &mut v).unwrap()
    };
    g.bench_function("open_each_time", |b| {
        b.iter(|| {
            one_chunk(Stream::open(black_box(&bytes), Some(&profile), &Limits::DEFAULT).unwrap())
        })
    });
    g.bench_function("attached", |b| {
        b.iter(|| one_chunk(opened.attach(black_box(&bytes), &profile).unwrap()))
    });
    g.finish();
}

/// One chunk of the whole sample (every layer) decoded into reused buffers on one thread, for
/// chunks of 1, 16 and 128 tokens (level 7, the stream attached): the per-block setup (tables,
/// constants, lane decoder) against the elements, which the throughput counts (f16 bytes).
fn bench_small_chunks(c: &mut Criterion, path: &Path) {
    let f = load(path);
    let profile = self_profile(&f);
    let shape = f.kv.shape;
    let mut g = c.benchmark_group("small_chunks");
    g.sample_size(20);
    for tokens in [1u32, 16, 128] {
        let params = EncodeParams {
            chunk_tokens: tokens,
            ..EncodeParams::default()
        };
        let mode = ProfileMode::Referenced(&profile);
        let bytes = encode_threads(&f.kv.view(), mode, &params, 0).unwrap();
        let st = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT).unwrap();
        let n = shape.channels() * tokens as usize;
        let new = || -> Vec<Tensor> {
            (0..shape.layers)
                .map(|_| Tensor::zeros(Dtype::F16, n))
                .collect()
        };
        let (mut k, mut v) = (new(), new());
        let chunks = shape.tokens / tokens;
        let mut next = 0u32;
        g.throughput(Throughput::Bytes(
            2 * u64::from(shape.layers) * 2 * n as u64,
        ));
        g.bench_function(format!("tokens{tokens}"), |b| {
            b.iter(|| {
                next = (next + 7) % chunks;
                let mut k: Vec<_> = k.iter_mut().map(|t| t.as_mut()).collect();
                let mut v: Vec<_> = v.iter_mut().map(|t| t.as_mut()).collect();
                let range = next * tokens..(next + 1) * tokens;
                black_box(&st)
                    .decode_range_into_threads(range, &mut k, &mut v, 1)
                    .unwrap()
            })
        });
    }
    g.finish();
}

/// 1 and 2 threads, and every core where that is more than 2.
fn thread_counts() -> Vec<(usize, &'static str)> {
    let mut t = vec![(1, "threads1"), (2, "threads2")];
    if thread_count(0) > 2 {
        t.push((0, "threads_all"));
    }
    t
}

fn codec(c: &mut Criterion) {
    bench_fixture(c, "smollm2-512", &sample_path());
    bench_open(c, "smollm2-512", &sample_path());
    bench_chunk_of_many(c, &sample_path());
    bench_small_chunks(c, &sample_path());
    if let Some(p) = big_fixture_path() {
        bench_fixture(c, "smollm2-2048", &p);
    }
}

criterion_group!(benches, codec);
criterion_main!(benches);
