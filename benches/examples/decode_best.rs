//! Best-of-N decode timing on `../shared/fixtures/smollm2-gpl3-2048.safetensors`, for A/B
//! comparisons on a noisy machine where criterion's means drift by 10-20%:
//! `cargo run --profile bench -p kvc-benches --example decode_best -- LEVEL N` prints the
//! fastest of N decodes into reused buffers and to a fresh owned cache (`ONLY_INTO=1` skips the
//! latter), and the time `KvCache::zeros` takes. The profile is learned from the dump itself.
//! `THREADS=N` decodes into the reused buffers on N threads (0: all cores; default 1).
use codec_core::{decode, encode, EncodeParams, Limits, ProfileMode};
use kvc_benches::{big_fixture_path, load, self_profile};
use std::time::Instant;

fn main() {
    let level: u8 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(7);
    let n: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or(20);
    let f = load(&big_fixture_path().unwrap());
    let profile = self_profile(&f);
    let params = EncodeParams {
        levels: vec![level],
        ..EncodeParams::default()
    };
    let view = f.kv.view();
    let stream = encode(&view, ProfileMode::Referenced(&profile), &params).unwrap();
    let bytes = f.kv.shape.total_elements() as f64 * 2.0;
    let mut best = f64::MAX;
    let only_into = std::env::var("ONLY_INTO").is_ok();
    let threads: usize = std::env::var("THREADS").map_or(1, |t| t.parse().unwrap());
    for _ in 0..if only_into { 0 } else { n } {
        let t = Instant::now();
        let d = decode(
            std::hint::black_box(&stream),
            Some(&profile),
            &Limits::DEFAULT,
        )
        .unwrap();
        let e = t.elapsed().as_secs_f64();
        std::hint::black_box(d);
        best = best.min(e);
    }
    let mut bz = f64::MAX;
    for _ in 0..n {
        let t = Instant::now();
        let z = codec_core::KvCache::zeros(f.kv.shape, codec_core::Dtype::F16, f.kv.meta.clone());
        std::hint::black_box(&z);
        bz = bz.min(t.elapsed().as_secs_f64());
        drop(z);
    }
    println!("zeros: best {:.2} ms", bz * 1e3);
    let st = codec_core::Stream::open(&stream, Some(&profile), &Limits::DEFAULT).unwrap();
    let mut cache = st.decode().unwrap();
    let mut best2 = f64::MAX;
    for _ in 0..n {
        let t = Instant::now();
        let mut ks: Vec<_> = cache.k.iter_mut().map(|t| t.as_mut()).collect();
        let mut vs: Vec<_> = cache.v.iter_mut().map(|t| t.as_mut()).collect();
        st.decode_range_into_threads(0..f.kv.shape.tokens, &mut ks, &mut vs, threads)
            .unwrap();
        best2 = best2.min(t.elapsed().as_secs_f64());
    }
    println!(
        "into reused buffer, {threads} thread(s): best {:.2} ms = {:.1} MiB/s",
        best2 * 1e3,
        bytes / best2 / 1048576.0
    );
    println!(
        "level {level}: best {:.2} ms = {:.1} MiB/s",
        best * 1e3,
        bytes / best / 1048576.0
    );
}
