//! Best-of-15 timing of codebook training plus encoding for one (layer, KV head) of 2048 real
//! keys (layer 15, KV head 0 of `../shared/fixtures/smollm2-gpl3-2048.safetensors`, else the
//! 512-token sample tiled), kvc's default (residual) and the paper's PQ, with a hash of the codes
//! so that two builds can be checked to train the same codebooks:
//! `cargo run --profile bench -p kvc-benches --example train_best`.
use kvc_benches::pq_keys_and_queries;
use pq_core::{Codebook, PqParams};
use std::time::Instant;

fn main() {
    let (keys, _, d) = pq_keys_and_queries(15);
    for (name, p) in [("rq", PqParams::default()), ("pq", PqParams::paper())] {
        let mut best = f64::MAX;
        let mut h = 0u64;
        for _ in 0..15 {
            let t = Instant::now();
            let cb = Codebook::train(std::hint::black_box(&keys), d, &p).unwrap();
            let codes = cb.encode(&keys).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            h = codes
                .iter()
                .fold(h, |a, &c| a.wrapping_mul(31).wrapping_add(u64::from(c)));
        }
        println!("{name}: best {:.2} ms, codes hash {h:x}", best * 1e3);
    }
}
