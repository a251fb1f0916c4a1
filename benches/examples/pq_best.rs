//! Best-of-N timing of the pq search on real keys and queries, for A/B comparisons on a noisy
//! machine where criterion's means drift by 10-20%, and a loop to profile:
//! `cargo run --profile bench -p kvc-benches --example pq_best -- N [rq|pq]` prints, for layer
//! 15 KV head 0 (2048 tokens, k = T/5, windows 4 + 64), the fastest mean over N rounds of one
//! search per stored query head of the layer: the score table, the fused search from a ready
//! table, and both together.
use kvc_benches::pq_keys_and_queries;
use pq_core::{score_table, search, Codebook, PqParams};
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(20);
    let p = match std::env::args().nth(2).as_deref() {
        Some("pq") => PqParams::paper(),
        _ => PqParams::default(),
    };
    let (keys, qs_all, d) = pq_keys_and_queries(15);
    let t = keys.len() / d;
    let k = (2 * t + 5) / 10;
    let cb = Codebook::train(&keys, d, &p).unwrap();
    let codes = cb.encode(&keys).unwrap();
    let qs: Vec<&[f32]> = qs_all.chunks_exact(d).collect();
    let tables: Vec<_> = qs.iter().map(|q| score_table(q, &cb).unwrap()).collect();
    let (mut table, mut fused, mut both) = (f64::MAX, f64::MAX, f64::MAX);
    let per = |t0: Instant| t0.elapsed().as_secs_f64() * 1e9 / qs.len() as f64;
    for _ in 0..n {
        let t0 = Instant::now();
        for q in &qs {
            black_box(score_table(black_box(q), &cb).unwrap());
        }
        table = table.min(per(t0));
        let t0 = Instant::now();
        for tb in &tables {
            black_box(search(black_box(&codes), tb, k, 4, 64).unwrap());
        }
        fused = fused.min(per(t0));
        let t0 = Instant::now();
        for q in &qs {
            let tb = score_table(black_box(q), &cb).unwrap();
            black_box(search(&codes, &tb, k, 4, 64).unwrap());
        }
        both = both.min(per(t0));
    }
    println!(
        "table {table:.0} ns, search {fused:.0} ns, table+search {both:.0} ns = {:.2} G token-scores/s",
        t as f64 / both
    );
}
