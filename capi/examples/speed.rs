//! Rust's side of the bindings' speed comparison (`python/bench/speed.py` writes the inputs):
//! best-of-N decode of a stream into reused buffers (`Stream::open` once, then `decode_into`,
//! as `benches/examples/decode_best.rs` does), the same with the stream opened on every call
//! (what each binding call does), and encode of the decoded cache with the same profile.
//!
//! `cargo run --profile bench -p kvc-capi --example speed -- STREAM.kvc PROFILE.kvcp [N]`
use codec_core::{encode, EncodeParams, Limits, Profile, ProfileMode, Stream, TensorMut};
use std::time::Instant;

fn best(n: usize, mut f: impl FnMut()) -> f64 {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let stream = std::fs::read(&args[1]).expect("stream file");
    let profile = Profile::from_bytes(
        &std::fs::read(&args[2]).expect("profile file"),
        &Limits::DEFAULT,
    )
    .expect("profile");
    let n: usize = args.get(3).map_or(15, |s| s.parse().expect("N"));
    let s = Stream::open(&stream, Some(&profile), &Limits::DEFAULT).expect("stream");
    let mut cache = s.decode().expect("decode");
    let mib = cache.shape.total_elements() as f64 * cache.dtype().size_bytes() as f64 / 1048576.0;
    let mut into = |open_each: bool| {
        let mut ks: Vec<TensorMut<'_>> = cache.k.iter_mut().map(|t| t.as_mut()).collect();
        let mut vs: Vec<TensorMut<'_>> = cache.v.iter_mut().map(|t| t.as_mut()).collect();
        best(n, || {
            if open_each {
                let s = Stream::open(&stream, Some(&profile), &Limits::DEFAULT).unwrap();
                s.decode_into(&mut ks, &mut vs).unwrap();
            } else {
                s.decode_into(&mut ks, &mut vs).unwrap();
            }
        })
    };
    let once = into(false);
    let each = into(true);
    let level = s.header().chunks[0].level;
    let params = EncodeParams {
        chunk_tokens: s.header().chunk_tokens,
        levels: vec![level],
        ..EncodeParams::default()
    };
    let view = cache.view();
    let mut check = Vec::new();
    let enc = best(n.min(7), || {
        check = encode(&view, ProfileMode::Referenced(&profile), &params).unwrap()
    });
    // python/bench/speed.py encodes the same decoded cache and writes its bytes here.
    let reencoded = format!("{}.reencoded", args[1]);
    if let Ok(py) = std::fs::read(&reencoded) {
        assert!(
            py == check,
            "Python's encode of the decoded cache differs from Rust's"
        );
        println!(
            "python's encode of the decoded cache: the same {} bytes as rust's",
            check.len()
        );
    }
    println!(
        "rust decode_into (open once):     {:7.2} ms  {:6.1} MiB/s",
        once * 1e3,
        mib / once
    );
    println!(
        "rust decode_into (open per call): {:7.2} ms  {:6.1} MiB/s",
        each * 1e3,
        mib / each
    );
    println!(
        "rust encode (referenced):         {:7.2} ms  {:6.1} MiB/s",
        enc * 1e3,
        mib / enc
    );
}
