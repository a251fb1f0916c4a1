//! Rotary shift of stored keys (CacheBlend moving a chunk's cache to its place): elements per
//! second on one thread, for both pairings, on one layer of the 512-token sample's keys in f32;
//! and `shift_cache` on the whole f16 sample (every layer's keys, through f32 and back).

use codec_core::{Rope, RopeStyle, Shift};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

fn rope(c: &mut Criterion) {
    let dump = kvc_io::load_dump(&kvc_io::fixtures::sample()).unwrap();
    let k = dump.kv.k[0].to_f32_vec();
    let d = dump.kv.shape.head_dim;
    let mut g = c.benchmark_group("rope/shift");
    g.throughput(Throughput::Elements(k.len() as u64));
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        let r = Rope {
            style,
            ..dump.kv.meta.rope
        };
        let shift = Shift::new(&r, d, 1536).unwrap();
        let mut x = k.clone();
        g.bench_function(format!("{style:?} one layer f32"), |b| {
            b.iter(|| shift.apply(black_box(&mut x)))
        });
    }
    let mut cache = dump.kv.clone();
    let keys = cache.k.iter().map(|t| t.len() as u64).sum();
    g.throughput(Throughput::Elements(keys));
    let mut to = 0;
    g.bench_function("shift_cache 30 layers f16", |b| {
        b.iter(|| {
            to = 1536 - to;
            codec_core::shift_cache(black_box(&mut cache), to).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, rope);
criterion_main!(benches);
