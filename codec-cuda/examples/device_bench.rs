//! Best-of-N device harness: decode throughput in GB/s of f16 output (table and word uploads
//! included) and PQ scan throughput in token-scores/s, on device 0.
//!
//! ```sh
//! cargo run --release -p kvc-codec-cuda --example device_bench -- [rounds] [copies]
//! ```
//!
//! The decode input is the real 512-token fixture (all 30 layers, 3 KV heads of 64), encoded
//! at one level in 128-token chunks, decoded `copies` times over (each copy a sequence of its
//! own in one dense output) per round. Reported per round's best: the whole `Gpu::decode_into`
//! (three launches, the host's steps between them, every upload), and each launch alone with
//! its upload. Encode: the middle level's blocks re-quantized and re-encoded, in GB/s of f16
//! input. PQ: one launch of `copies * 576` queries over the fixture's layer-0 codes
//! (causal), and a synthetic 32768-token head with 256 queries.
//!
//! Without a GPU or NVRTC it says why and exits 0. NVRTC: `KVC_NVRTC_LIB`, else
//! `target/nvrtc/13.5.37/lib`, else by name.

use std::path::{Path, PathBuf};
use std::time::Instant;

use codec_core::rans::FreqTable;
use codec_core::{
    encode, learn_profile, EncodeParams, LearnParams, Limits, ProfileMode, Sample, Stream,
};
use codec_cuda::decode::DecodePlan;
use codec_cuda::encode::{EncTableId, LaneEncodeBatch, QuantBatch};
use codec_cuda::pq::PqBatch;
use codec_cuda::quant::{ChannelConsts, OutDtype, OutLayout, Output};
use codec_cuda::stream::{ChunkLanes, Destination};
use codec_cuda::Gpu;
use pq_core::{pack, Codebook, Method, PqParams};

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
    let gpu = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no GPU ({e})");
            return;
        }
    };
    let fetched = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nvrtc/13.5.37/lib");
    let dir: Option<PathBuf> = match std::env::var_os("KVC_NVRTC_LIB") {
        Some(d) => Some(PathBuf::from(d)),
        None => fetched.join("libnvrtc.so.13").is_file().then_some(fetched),
    };
    let t = Instant::now();
    if let Err(e) = gpu.load_kernels(dir.as_deref()) {
        println!("skipped: the kernels could not be loaded ({e})");
        return;
    }
    println!(
        "device {} ({}); kernels compiled and loaded in {:.1} ms; best of {rounds} rounds",
        gpu.ordinal(),
        gpu.arch(),
        t.elapsed().as_secs_f64() * 1e3
    );

    // Decode.
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/smollm2-gpl3-512.safetensors");
    let d = kvc_io::load_dump(&path).expect("fixture present");
    let cache = &d.kv;
    let sample = Sample {
        kv: cache.view(),
        queries: None,
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).expect("profile");
    let shape = cache.shape;
    let (tokens, c) = (shape.tokens, shape.channels());
    for level in [0u8, profile.levels() / 2, profile.levels() - 1] {
        let params = EncodeParams {
            chunk_tokens: 128,
            levels: vec![level],
            ..EncodeParams::default()
        };
        let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let per_copy = 2 * shape.layers as usize * tokens as usize * c;
        let output = Output {
            dtype: OutDtype::F16,
            layout: OutLayout::Dense,
            len: copies * per_copy,
        };
        let mut plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
        for i in 0..copies {
            let dest = Destination {
                base: (i * per_copy) as u64,
                ..Destination::dense(tokens, c)
            };
            plan.add_stream(&stream, dest).unwrap();
        }
        let mut out = gpu.stream().alloc_zeros::<u16>(output.len).unwrap();
        let out_bytes = (output.len * 2) as f64;
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
        println!(
            "decode level {level}: {} bytes x {copies} -> {:.1} MB f16: whole {:.3} ms = {:.2} GB/s; \
             with uploads and downloads: exponent launch {:.3} ms, symbol launch {:.3} ms, \
             dequantization {:.3} ms; kernels alone: {:.3} + {:.3} + {:.3} ms = {:.2} GB/s \
             (lane decode {:.2} GB/s, dequantization {:.2} GB/s of f16)",
            bytes.len(),
            out_bytes / 1e6,
            full * 1e3,
            out_bytes / full / 1e9,
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
        .flat_map(|l| [cache.k[l].to_f32_vec(), cache.v[l].to_f32_vec()])
        .collect();
    let params = EncodeParams {
        chunk_tokens: 128,
        levels: vec![profile.levels() / 2],
        ..EncodeParams::default()
    };
    let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let (quant, enc) = encode_batches(&stream, &tensors, copies);
    let in_bytes = (copies * 2 * shape.layers as usize * tokens as usize * c * 2) as f64;
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
        tokens as usize,
    );
    let queries = &d.q.as_ref().expect("the fixture has queries")[0];
    let keys = cache.k[0].to_f32_vec();
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
    let long = 32768usize;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let cw: Vec<f32> = (0..2 * 64 * dim)
        .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let cb = Codebook::from_parts(Method::Residual, dim, 2, 6, 1, cw).unwrap();
    let codes: Vec<u16> = (0..2 * long).map(|_| (next() % 64) as u16).collect();
    let mut batch = PqBatch::new(&cb).unwrap();
    let id = batch
        .add_head(&cb, &pack(&codes, 6).unwrap(), long)
        .unwrap();
    for i in 0..256 {
        let q: Vec<f32> = (0..dim)
            .map(|j| ((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        batch.add_query(id, &q, long, long / 5, 4, 64).unwrap();
    }
    let (tl, _) = best_of(rounds, || gpu.search(&batch).unwrap());
    let kl = gpu.time_search(&batch, rounds).unwrap();
    let n = (256 * long) as f64;
    println!(
        "pq long: 256 queries x {long} tokens: {:.3} ms = {:.2} G token-scores/s (uploads \
         included), kernel alone {:.3} ms = {:.2} G/s",
        tl * 1e3,
        n / tl / 1e9,
        kl * 1e3,
        n / kl / 1e9
    );
}

/// Every block of every chunk of `stream`, `copies` times: rows, exponents and constants for
/// the quantization kernel, table indices and tables for the lane encoder (each chunk's
/// indices and exponents decoded by the host-run kernels).
fn encode_batches(
    stream: &Stream<'_>,
    tensors: &[Vec<f32>],
    copies: usize,
) -> (QuantBatch, LaneEncodeBatch) {
    let h = stream.header();
    let c = h.shape.channels();
    let mut quant = QuantBatch::new(h.shape.kv_heads, h.shape.head_dim);
    let mut enc = LaneEncodeBatch::new();
    for chunk in 0..h.chunks.len() {
        let lanes = ChunkLanes::read(stream, chunk).unwrap();
        let exp_out = lanes.exponent_batch().unwrap().decode_host(2).unwrap();
        let exps: Vec<&[u8]> = (0..lanes.blocks.len())
            .map(|b| exp_out.symbols(b))
            .collect();
        let sym_out = lanes.symbol_batch(&exps).unwrap().decode_host(2).unwrap();
        let mult = stream.profile().level_multipliers()[usize::from(lanes.level())];
        let token_start = h.chunks[chunk].token_start as usize;
        let rows = lanes.rows();
        let mut distinct: Vec<(*const FreqTable, EncTableId)> = Vec::new();
        for _ in 0..copies {
            for (b, blk) in lanes.blocks.iter().enumerate() {
                let consts = ChannelConsts::of_block(
                    stream.profile().channel_params(blk.layer, blk.kv),
                    mult,
                );
                let start = quant.add_consts(&consts);
                let t = &tensors[blk.layer as usize * 2 + blk.kv];
                let x = &t[token_start * c..(token_start + rows) * c];
                let e = blk.exp_table.as_ref().map(|_| exps[b]);
                quant
                    .add_block(x, lanes.sink_rows() as u32, u32::from(h.group), e, start)
                    .unwrap();
                let tables: Vec<EncTableId> = lanes
                    .symbol_tables(b, exps[b])
                    .into_iter()
                    .map(
                        |t| match distinct.iter().find(|(p, _)| std::ptr::eq(*p, t)) {
                            Some(&(_, id)) => id,
                            None => {
                                let id = enc.add_table(t);
                                distinct.push((t, id));
                                id
                            }
                        },
                    )
                    .collect();
                enc.add_block(sym_out.symbols(b), &tables).unwrap();
            }
        }
    }
    (quant, enc)
}
