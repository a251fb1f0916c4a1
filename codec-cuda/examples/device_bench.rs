//! Best-of-N device harness: decode throughput in GB/s of f16 output (table and word uploads
//! included), encode throughput in GB/s of f16 input, and PQ scan throughput in token-scores/s,
//! on device 0.
//!
//! ```sh
//! cargo run --release -p kvc-codec-cuda --example device_bench -- [rounds] [copies]
//! ```
//!
//! The decode input is the real 512-token fixture (all 30 layers, 3 KV heads of 64), encoded
//! at one level in 128-token chunks, decoded `copies` times over (each copy a sequence of its
//! own in one dense output) per round. Reported per round's best: the whole `Gpu::decode_into`
//! (every upload, the chain of five launches, the statuses), the chain's kernels alone, the
//! stepwise path (three launches with the host's steps between them), each of its launches
//! with uploads and downloads, and those kernels alone. Encode: the middle level's blocks re-quantized and
//! re-encoded. PQ: one launch of `copies * 576` queries over the fixture's layer-0 codes
//! (causal), and a synthetic 32768-token head with 256 queries.
//!
//! Without a GPU or NVRTC it says why and exits 0. NVRTC: `KVC_NVRTC_LIB`, else
//! `target/nvrtc/13.5.37/lib`, else by name.

#[path = "../benches/support/mod.rs"]
mod support;

use std::time::Instant;

use codec_cuda::pq::PqBatch;
use pq_core::{pack, Codebook, PqParams};

fn best_of<T>(rounds: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut last = f();
    for _ in 0..rounds {
        let t = Instant::now();
        last = f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best, last)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10);
    let copies: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(16);
    let t = Instant::now();
    let gpu = match support::open_gpu() {
        Ok(g) => g,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    println!(
        "device {} ({}); kernels compiled and loaded in {:.1} ms; best of {rounds} rounds",
        gpu.ordinal(),
        gpu.arch(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let (d, profile) = support::fixture();
    let shape = d.kv.shape;

    // Decode.
    for level in [0u8, profile.levels() / 2, profile.levels() - 1] {
        let bytes = support::stream_bytes(&d.kv, &profile, level);
        let stream = support::open(&bytes);
        let plan = support::decode_plan(&stream, copies);
        let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
        let out_bytes = (plan.output().len * 2) as f64;
        let (full, r) = best_of(rounds, || gpu.decode_into(&plan, &mut out));
        r.unwrap();
        let exp_batch = plan.exponent_batch().unwrap();
        let (t_exp, exp) = best_of(rounds, || gpu.lane_decode(&exp_batch).unwrap());
        let exps = plan.exponents(&exp).unwrap();
        let sym_batch = plan.symbol_batch(&exps).unwrap();
        let (t_sym, sym) = best_of(rounds, || gpu.lane_decode(&sym_batch).unwrap());
        let dq = plan.dequant_batch(&sym, &exps).unwrap();
        let (t_dq, _) = best_of(rounds, || gpu.dequant_into(&dq, &mut out).unwrap());
        let k_exp = gpu.time_lane_decode(&exp_batch, rounds).unwrap();
        let k_sym = gpu.time_lane_decode(&sym_batch, rounds).unwrap();
        let k_dq = gpu.time_dequant(&dq, &mut out, rounds).unwrap();
        let kernels = k_exp + k_sym + k_dq;
        let k_chain = gpu.time_decode_chain(&plan, &mut out, rounds).unwrap();
        let stages = gpu
            .time_decode_chain_stages(&plan, &mut out, rounds)
            .unwrap();
        let (stepwise, r) = best_of(rounds.min(2), || gpu.decode_into_stepwise(&plan, &mut out));
        r.unwrap();
        println!(
            "decode level {level}: {} bytes x {copies} -> {:.1} MB f16: whole (chain, uploads \
             and statuses included) {:.3} ms = {:.2} GB/s; the chain's five kernels alone {:.3} ms \
             = {:.2} GB/s (each alone: exponents {:.3}, tables {:.3}, symbols {:.3}, values \
             {:.3}, dequantization {:.3} ms); stepwise (host steps between launches) {:.3} ms = {:.3} GB/s; \
             stepwise launches with uploads and downloads: exponent launch {:.3} ms, symbol \
             launch {:.3} ms, dequantization {:.3} ms; alone: {:.3} + {:.3} + {:.3} ms = {:.2} \
             GB/s (lane decode {:.2} GB/s, dequantization {:.2} GB/s of f16)",
            bytes.len(),
            out_bytes / 1e6,
            full * 1e3,
            out_bytes / full / 1e9,
            k_chain * 1e3,
            out_bytes / k_chain / 1e9,
            stages[0] * 1e3,
            stages[1] * 1e3,
            stages[2] * 1e3,
            stages[3] * 1e3,
            stages[4] * 1e3,
            stepwise * 1e3,
            out_bytes / stepwise / 1e9,
            t_exp * 1e3,
            t_sym * 1e3,
            t_dq * 1e3,
            k_exp * 1e3,
            k_sym * 1e3,
            k_dq * 1e3,
            out_bytes / kernels / 1e9,
            out_bytes / (k_exp + k_sym) / 1e9,
            out_bytes / k_dq / 1e9,
        );
    }

    // Encode: every block of the middle level's stream, `copies` times, re-quantized (with
    // its step exponents) and re-encoded (with its tables) from the cache's f16 values.
    let tensors: Vec<Vec<f32>> = (0..shape.layers as usize)
        .flat_map(|l| [d.kv.k[l].to_f32_vec(), d.kv.v[l].to_f32_vec()])
        .collect();
    let bytes = support::stream_bytes(&d.kv, &profile, profile.levels() / 2);
    let stream = support::open(&bytes);
    let (quant, enc) = support::encode_batches(&stream, &tensors, copies);
    let in_bytes =
        (copies * 2 * shape.layers as usize * shape.tokens as usize * shape.channels() * 2) as f64;
    let (tq, _) = best_of(rounds, || gpu.quantize(&quant).unwrap());
    let (te, _) = best_of(rounds, || gpu.lane_encode(&enc).unwrap());
    let kq = gpu.time_quantize(&quant, rounds).unwrap();
    let ke = gpu.time_lane_encode(&enc, rounds).unwrap();
    println!(
        "encode level {}: {:.1} MB of f16 input: with uploads and downloads quantization {:.3} ms, \
         lane encode {:.3} ms = {:.2} GB/s; kernels alone {:.3} + {:.3} ms = {:.2} GB/s \
         (quantization {:.2} GB/s, lane encode {:.2} GB/s of f16 input)",
        profile.levels() / 2,
        in_bytes / 1e6,
        tq * 1e3,
        te * 1e3,
        in_bytes / (tq + te) / 1e9,
        kq * 1e3,
        ke * 1e3,
        in_bytes / (kq + ke) / 1e9,
        in_bytes / kq / 1e9,
        in_bytes / ke / 1e9,
    );

    // PQ: the fixture's layer 0, causal, all stored query heads, `copies` times.
    let (kv_heads, dim, t) = (
        shape.kv_heads as usize,
        shape.head_dim as usize,
        shape.tokens as usize,
    );
    let queries = &d.q.as_ref().expect("the fixture has queries")[0];
    let keys = d.kv.k[0].to_f32_vec();
    let mut heads = Vec::new();
    for h in 0..kv_heads {
        let hk: Vec<f32> = (0..t)
            .flat_map(|tok| keys[(tok * kv_heads + h) * dim..][..dim].iter().copied())
            .collect();
        let cb = Codebook::train(&hk, dim, &PqParams::default()).unwrap();
        let codes = cb.encode(&hk).unwrap();
        heads.push((cb, pack(&codes, 6).unwrap()));
    }
    let mut batch = PqBatch::new(&heads[0].0).unwrap();
    let ids: Vec<_> = heads
        .iter()
        .map(|(cb, p)| batch.add_head(cb, p, t).unwrap())
        .collect();
    let (q_heads, n_q, q_start) = (d.q_heads, d.n_q(), d.q_start as usize);
    let mut scores = 0usize;
    for _ in 0..copies {
        for i in 0..n_q {
            let seen = (q_start + i + 1).min(t);
            for qh in 0..q_heads {
                let q = &queries[(i * q_heads + qh) * dim..][..dim];
                let h = qh / (q_heads / kv_heads);
                batch.add_query(ids[h], q, seen, seen / 5, 4, 64).unwrap();
                scores += seen;
            }
        }
    }
    let (tq, _) = best_of(rounds, || gpu.search(&batch).unwrap());
    let kq = gpu.time_search(&batch, rounds).unwrap();
    println!(
        "pq fixture: {} queries, {scores} token-scores: {:.3} ms = {:.2} G token-scores/s \
         (uploads included), kernel alone {:.3} ms = {:.2} G/s",
        batch.len(),
        tq * 1e3,
        scores as f64 / tq / 1e9,
        kq * 1e3,
        scores as f64 / kq / 1e9
    );

    // PQ: one long head (32768 tokens, synthetic codes), 256 queries.
    let (batch, n) = support::pq_long_batch(32768, 256, dim);
    let (tl, _) = best_of(rounds, || gpu.search(&batch).unwrap());
    let kl = gpu.time_search(&batch, rounds).unwrap();
    println!(
        "pq long: 256 queries x 32768 tokens: {:.3} ms = {:.2} G token-scores/s (uploads \
         included), kernel alone {:.3} ms = {:.2} G/s",
        tl * 1e3,
        n as f64 / tl / 1e9,
        kl * 1e3,
        n as f64 / kl / 1e9
    );
}
