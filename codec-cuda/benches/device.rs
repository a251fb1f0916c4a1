//! Criterion benches of the kernels on device 0 (`cargo bench -p kvc-codec-cuda --bench
//! device`): decode (the whole `Gpu::decode_into` of the real fixture, every upload included,
//! and the three kernels alone) in bytes of f16 output, encode (quantization and lane encode
//! kernels alone; the encode chain from device memory, whole and its launches alone) in bytes
//! of f16 input, PQ search (with uploads and alone) in token-scores.
//! Without a GPU or NVRTC they print why and measure nothing.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use codec_cuda::encode_plan::Source;
use criterion::{Criterion, Throughput};

fn main() {
    let mut gpu = match support::open_gpu() {
        Ok(g) => g,
        Err(why) => {
            println!("codec-cuda device benches skipped: {why}");
            return;
        }
    };
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let (d, profile) = support::fixture();
    let bytes = support::stream_bytes(&d.kv, &profile, profile.levels() / 2);
    let stream = support::open(&bytes);
    let copies = 4;
    let plan = support::decode_plan(&stream, copies);
    let out_len = plan.output().len;
    let mut out = gpu.stream().alloc_zeros::<u16>(out_len).expect("output");
    let exp_batch = plan.exponent_batch().unwrap();
    let exp = gpu.lane_decode(&exp_batch).unwrap();
    let exps = plan.exponents(&exp).unwrap();
    let sym_batch = plan.symbol_batch(&exps).unwrap();
    let sym = gpu.lane_decode(&sym_batch).unwrap();
    let dq = plan.dequant_batch(&sym, &exps).unwrap();

    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Bytes(out_len as u64 * 2));
    g.bench_function("whole, uploads included", |b| {
        b.iter(|| gpu.decode_into(&plan, &mut out).unwrap())
    });
    for (name, fused) in [
        ("fused chain's kernels alone", true),
        ("five-launch chain's kernels alone", false),
    ] {
        gpu.set_decode_chain_fused(fused);
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let s: f64 = (0..iters)
                    .map(|_| gpu.time_decode_chain(&plan, &mut out, 1).unwrap())
                    .sum();
                Duration::from_secs_f64(s)
            })
        });
    }
    gpu.set_decode_chain_fused(true);
    g.bench_function("stepwise kernels alone", |b| {
        b.iter_custom(|iters| {
            let mut s = 0.0;
            for _ in 0..iters {
                s += gpu.time_lane_decode(&exp_batch, 1).unwrap();
                s += gpu.time_lane_decode(&sym_batch, 1).unwrap();
                s += gpu.time_dequant(&dq, &mut out, 1).unwrap();
            }
            Duration::from_secs_f64(s)
        })
    });
    g.finish();

    let tensors: Vec<Vec<f32>> = (0..d.kv.shape.layers as usize)
        .flat_map(|l| [d.kv.k[l].to_f32_vec(), d.kv.v[l].to_f32_vec()])
        .collect();
    let (quant, enc) = support::encode_batches(&stream, &tensors, copies);
    let mut g = c.benchmark_group("encode");
    g.throughput(Throughput::Bytes(out_len as u64 * 2));
    g.bench_function("kernels alone", |b| {
        b.iter_custom(|iters| {
            let mut s = 0.0;
            for _ in 0..iters {
                s += gpu.time_quantize(&quant, 1).unwrap();
                s += gpu.time_lane_encode(&enc, 1).unwrap();
            }
            Duration::from_secs_f64(s)
        })
    });
    g.finish();

    let profile_q = support::profile_with_queries(&d);
    let ctx = support::encode_context(&d, &profile_q);
    let (src, source) = Source::of_view(&d.kv.view());
    let (plan, _) = support::encode_plan(&ctx, source, profile_q.levels() / 2, copies);
    let dev_src = gpu.upload(&src).expect("upload");
    let mut g = c.benchmark_group("encode chain from device memory");
    g.throughput(Throughput::Bytes((copies * src.len()) as u64));
    g.bench_function("whole Gpu::encode", |b| {
        b.iter(|| gpu.encode(&plan, &dev_src).unwrap())
    });
    let mut up = gpu.upload_encode_plan(&plan).unwrap();
    g.bench_function("Gpu::encode_uploaded (a plan uploaded once)", |b| {
        b.iter(|| gpu.encode_uploaded(&mut up, &dev_src).unwrap())
    });
    g.bench_function("five launches alone", |b| {
        b.iter_custom(|iters| {
            let s: f64 = (0..iters)
                .map(|_| gpu.time_encode(&plan, &dev_src, 1).unwrap().launches)
                .sum();
            Duration::from_secs_f64(s)
        })
    });
    g.finish();

    let (pq, _, scores) = support::pq_long_batch(32768, 256, 64, 0);
    let mut g = c.benchmark_group("pq search, 256 queries x 32768 tokens");
    g.throughput(Throughput::Elements(scores as u64));
    g.bench_function("uploads included", |b| b.iter(|| gpu.search(&pq).unwrap()));
    g.bench_function("kernel alone", |b| {
        b.iter_custom(|iters| {
            let s: f64 = (0..iters).map(|_| gpu.time_search(&pq, 1).unwrap()).sum();
            Duration::from_secs_f64(s)
        })
    });
    gpu.set_pq_shared_keys(0);
    g.bench_function("kernel alone, ranking keys in device memory", |b| {
        b.iter_custom(|iters| {
            let s: f64 = (0..iters).map(|_| gpu.time_search(&pq, 1).unwrap()).sum();
            Duration::from_secs_f64(s)
        })
    });
    gpu.set_pq_shared_keys(u32::MAX);
    g.finish();
    c.final_summary();
}
