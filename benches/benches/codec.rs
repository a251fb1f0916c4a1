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
//!
//! With `../shared/fixtures/smollm2-gpl3-2048.safetensors` present, the same runs on it too.

use codec_core::{
    decode, encode_threads, thread_count, EncodeParams, Limits, Profile, ProfileMode, Stream,
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
    if let Some(p) = big_fixture_path() {
        bench_fixture(c, "smollm2-2048", &p);
    }
}

criterion_group!(benches, codec);
criterion_main!(benches);
