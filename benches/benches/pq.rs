//! pq-core hot paths on real keys and queries (one core):
//! - `pq/train`: codebook training (k-means per book) plus encoding of one (layer, KV head) of
//!   2048 keys, for kvc's default (residual, 2 x 6 bits) and the PQCache paper's product
//!   quantization (2 x 6 bits); target <= 20 ms at the default settings.
//! - `pq/search`: one query head over 2048 tokens: score table, scores, top-k (k = T/5) with the
//!   first 4 and last 64 tokens; throughput in token-scores per second (target >= 1 G/s). Once
//!   with the layer's first stored query, once cycling through all its stored query heads.
//! - the pieces of the search alone, re-ranking a 2k short list with full keys, and code packing.
//!
//! Keys: layer 15, KV head 0 of `../shared/fixtures/smollm2-gpl3-2048.safetensors` when present,
//! else the 512-token sample's layer 15 tiled 4 times (the same shapes, less realistic clusters).
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvc_benches::pq_keys_and_queries;
use pq_core::{pack, rerank, score_table, scores, search, select, unpack, Codebook, PqParams};
use std::hint::black_box;

const LAYER: usize = 15;

fn bench(c: &mut Criterion) {
    let (keys, qs_all, d) = pq_keys_and_queries(LAYER);
    let q = qs_all[..d].to_vec();
    let t = keys.len() / d;
    let mut g = c.benchmark_group("pq/train");
    g.sample_size(10);
    for (name, p) in [
        ("rq-default", PqParams::default()),
        ("pq-paper", PqParams::paper()),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let cb = Codebook::train(black_box(&keys), d, &p).unwrap();
                cb.encode(&keys).unwrap()
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("pq/search");
    g.throughput(Throughput::Elements(t as u64));
    let k = (2 * t + 5) / 10;
    for (name, p) in [
        ("rq-default", PqParams::default()),
        ("pq-paper", PqParams::paper()),
    ] {
        let cb = Codebook::train(&keys, d, &p).unwrap();
        let codes = cb.encode(&keys).unwrap();
        g.bench_function(format!("{name}/table+scores+topk"), |b| {
            b.iter(|| {
                let table = score_table(black_box(&q), &cb).unwrap();
                let s = scores(&codes, &table).unwrap();
                select(&s, k, 4, 64).unwrap()
            })
        });
        g.bench_function(format!("{name}/table+search (fused)"), |b| {
            b.iter(|| {
                let table = score_table(black_box(&q), &cb).unwrap();
                search(&codes, &table, k, 4, 64).unwrap()
            })
        });
        // The same over the layer's real query heads of this KV head in turn: the mean cost
        // over real score distributions, not one query's.
        let qs: Vec<&[f32]> = qs_all.chunks_exact(d).collect();
        let mut next = 0usize;
        g.bench_function(
            format!("{name}/table+search (fused), all real queries"),
            |b| {
                b.iter(|| {
                    next = (next + 1) % qs.len();
                    let table = score_table(black_box(qs[next]), &cb).unwrap();
                    search(&codes, &table, k, 4, 64).unwrap()
                })
            },
        );
        g.bench_function(format!("{name}/table"), |b| {
            b.iter(|| score_table(black_box(&q), &cb).unwrap())
        });
        let table = score_table(&q, &cb).unwrap();
        g.bench_function(format!("{name}/scores"), |b| {
            b.iter(|| scores(black_box(&codes), &table).unwrap())
        });
        let s = scores(&codes, &table).unwrap();
        g.bench_function(format!("{name}/topk"), |b| {
            b.iter(|| select(black_box(&s), k, 4, 64).unwrap())
        });
    }
    g.finish();

    // Re-ranking a 2k short list (820 candidates) with full keys.
    let cb = Codebook::train(&keys, d, &PqParams::default()).unwrap();
    let codes = cb.encode(&keys).unwrap();
    let s = scores(&codes, &score_table(&q, &cb).unwrap()).unwrap();
    let short = select(&s, 2 * k, 0, 0).unwrap();
    let mut g = c.benchmark_group("pq/rerank");
    g.throughput(Throughput::Elements(short.len() as u64));
    g.bench_function("2k of 2048 keys", |b| {
        b.iter(|| rerank(black_box(&short), &keys, &q, k).unwrap())
    });
    g.finish();

    let mut g = c.benchmark_group("pq/pack");
    g.throughput(Throughput::Elements(codes.len() as u64));
    g.bench_function("pack b6", |b| {
        b.iter(|| pack(black_box(&codes), 6).unwrap())
    });
    let packed = pack(&codes, 6).unwrap();
    g.bench_function("unpack b6", |b| {
        b.iter(|| unpack(black_box(&packed), 6, codes.len()).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
