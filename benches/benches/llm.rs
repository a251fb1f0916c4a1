//! The reference runner's hot paths: prefill of 512 GPL-3 tokens, and 64 tokens continued on
//! top of a 512-token cache (what `kvc judge` runs per level). Needs the model
//! (`tools/fetch-model`); without it the bench says so and measures nothing. Longer prefills
//! (2048, 4096 tokens): `cargo run --release -p kvc-llm --example prefill_speed`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use llm::Model;
use std::hint::black_box;
use std::path::Path;

fn llm(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let Some(path) = llm::test_model(&root) else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let text = llm::test_text(&root, "GPL-3");
    let tokens = model.tokenizer().encode(&text).unwrap();
    let mut g = c.benchmark_group("llm/smollm2-135m");
    g.sample_size(10);
    g.throughput(Throughput::Elements(512));
    g.bench_function("prefill 512 tokens", |b| {
        b.iter(|| model.prefill(black_box(&tokens[..512])).unwrap())
    });
    let cache = model.prefill(&tokens[..512]).unwrap().cache;
    g.throughput(Throughput::Elements(64));
    g.bench_function("64 tokens on a 512-token cache", |b| {
        b.iter(|| {
            model
                .forward_with_cache(black_box(&cache), &tokens[512..576])
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, llm);
criterion_main!(benches);
