//! Best-of-N device harness: decode throughput in GB/s of f16 output (table and word uploads
//! included), encode throughput in GB/s of f16 input, and PQ scan throughput in token-scores/s,
//! on device 0.
//!
//! ```sh
//! cargo run --profile bench -p kvc-codec-cuda --example device_bench -- [rounds] [copies] [sections]
//! ```
//!
//! The decode input is the real 512-token fixture (all 30 layers, 3 KV heads of 64), encoded
//! at one level in 128-token chunks, decoded `copies` times over (each copy a sequence of its
//! own in one dense output) per round. Reported per round's best: the whole `Gpu::decode_into`
//! (the chain built, packed into pinned memory and uploaded in one copy, five launches, the
//! statuses), its upload alone (`Gpu::upload_plan`, its packing by the default threads and by
//! one), the same decode from the streams in page-locked memory (`Gpu::decode_from`, each copy
//! a stream of its own there), the same by 1 to 8 host threads at once, each with its own
//! `Gpu::fork` and share of the copies (and of 4x as many), in pieces (4x and 16x as many
//! too; pieces growing from a small first one, `Gpu::set_decode_first_piece_blocks`; the
//! device's memory pool keeping freed memory, `Gpu::set_pool_release_threshold`), the
//! decode of a plan uploaded once (`Gpu::decode_uploaded_into`), the chain's kernels alone
//! and each of them; then the symbol lane decode of format v2 (64-bit state, 32-bit words) against the 32-bit-state experiment
//! (`codec_cuda::experiment`, 16-bit words) on the same symbols and tables, kernels alone, and
//! by launch shape (tables in shared memory, coded blocks per CUDA block). Then how the middle
//! level's decode grows with the batch (`copies`, 4x and 8x as many). The fixture's profile
//! above is learned without its queries (no step exponents); the whole decode in pieces runs
//! again with one learned with them (`kvc profile`'s default), whose coded blocks each have
//! an exponent table. With compact tables (`Gpu::set_lane_tables_compact`) too: each level's
//! plan uploaded once and its chain's kernels, and the pieces with step exponents at 4x the
//! copies.
//! Encode: the middle level's blocks re-quantized and re-encoded by the two kernels from
//! host-built batches, then the encode chain (`Gpu::encode`) from the cache in device memory:
//! `copies` times its four 128-token chunks, the importance policy on (a profile learned with
//! the fixture's queries), checked once against codec-core's chunks, whole (the chunks copied
//! into vectors, or handed over: `Gpu::encode_with`) and in pieces of 960 to 120 coded blocks
//! (`Gpu::set_encode_piece_blocks`); then a batch 4x as large, whole and in pieces of 1920
//! and 3840 blocks. PQ: one launch of
//! `copies * 576` queries over the fixture's layer-0 codes (causal), and a synthetic
//! 32768-token head with 256 queries.
//!
//! The third argument names the sections to run, in the order of `SECTIONS` (default all
//! but `threads`): `early` (page-locked host memory to the device in 1, 2 and 4 copies at
//! once; the whole decode from page-locked memory at the defaults, each piece's bytes copied
//! after or before its chain is built, `Gpu::set_decode_copy_early`, and before with a
//! first piece of 256 blocks),
//! `exponents` (the decodes with step exponents), `inflight` (the whole
//! decode from page-locked memory in pieces by pieces in flight, piece size and chain),
//! `decode` (the three levels' decodes and lane decodes), `scaling`, `encode`, `pq`; `threads` runs the two halves of
//! `decode_from` (upload, launches) on 1 to 8 host threads at once, apart, for the middle
//! level.
//!
//! Without a GPU or NVRTC it says why and exits 0. NVRTC: `KVC_NVRTC_LIB`, else
//! `target/nvrtc/13.5.37/lib`, else by name.

#[path = "../benches/support/mod.rs"]
mod support;

use std::time::Instant;

use codec_core::{KvCache, Profile, Stream};
use codec_cuda::decode::DecodePlan;
use codec_cuda::encode_plan::Source;
use codec_cuda::experiment::Lane32Batch;
use codec_cuda::pq::PqBatch;
use codec_cuda::{Gpu, HostBuffer, LaneShape, DEFAULT_LANE_SHARED_TABLES};
use cudarc::driver::CudaSlice;
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

/// The parts of the harness, in the order they run; the third argument picks some
/// (`decode,pq`; default: all but `threads`), so that a short lend measures what it must.
const SECTIONS: [&str; 8] = [
    "early",
    "exponents",
    "inflight",
    "decode",
    "scaling",
    "encode",
    "pq",
    "threads",
];

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10);
    let copies: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(16);
    let picked = args.next().unwrap_or_else(|| SECTIONS[..7].join(","));
    let picked: Vec<&str> = picked.split(',').collect();
    if let Some(bad) = picked.iter().find(|p| !SECTIONS.contains(p)) {
        println!(
            "unknown section {bad:?}: the sections are {}",
            SECTIONS.join(", ")
        );
        std::process::exit(2);
    }
    let t = Instant::now();
    let mut gpu = match support::open_gpu() {
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
    let rc = (rounds, copies);
    for section in picked {
        let t = Instant::now();
        match section {
            "early" => bench_copy_early(&mut gpu, &d.kv, &profile, rc),
            "exponents" => bench_decode_exponents(&mut gpu, &d, rc),
            "inflight" => bench_pieces_in_flight(&mut gpu, &d, &profile, rc),
            "decode" => {
                for level in [0u8, profile.levels() / 2, profile.levels() - 1] {
                    bench_decode(&mut gpu, &d.kv, &profile, level, rc);
                }
            }
            "scaling" => bench_decode_scaling(&mut gpu, &d.kv, &profile, rc),
            "encode" => {
                bench_encode_kernels(&gpu, &d, &profile, rc);
                bench_encode_chain(&mut gpu, &d, profile.levels() / 2, rc);
            }
            "pq" => bench_pq(&mut gpu, &d, rc),
            _ => bench_threads_apart(&gpu, &d.kv, &profile, rc),
        }
        println!("(section {section}: {:.1} s)", t.elapsed().as_secs_f64());
    }
}

/// The encode kernels from host-built batches: every block of the middle level's stream,
/// `copies` times, re-quantized (with its step exponents) and re-encoded (with its tables) from
/// the cache's f16 values.
fn bench_encode_kernels(
    gpu: &Gpu,
    d: &kvc_io::Dump,
    profile: &Profile,
    (rounds, copies): (usize, usize),
) {
    let shape = d.kv.shape;
    let tensors: Vec<Vec<f32>> = (0..shape.layers as usize)
        .flat_map(|l| [d.kv.k[l].to_f32_vec(), d.kv.v[l].to_f32_vec()])
        .collect();
    let bytes = support::stream_bytes(&d.kv, profile, profile.levels() / 2);
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
}

/// PQ search: the fixture's layer 0 (causal, every stored query head, `copies` times), then
/// one long synthetic head (32768 tokens) with 256 queries, its keys in shared memory and in
/// device memory.
fn bench_pq(gpu: &mut Gpu, d: &kvc_io::Dump, (rounds, copies): (usize, usize)) {
    let shape = d.kv.shape;
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
    let rq = resident_search(gpu, &batch, rounds);
    println!(
        "pq fixture: {} queries, {scores} token-scores: {:.3} ms = {:.2} G token-scores/s \
         (uploads included), codes resident and the queries uploaded {:.3} ms = {:.2} G/s, \
         kernel alone {:.3} ms = {:.2} G/s",
        batch.len(),
        tq * 1e3,
        scores as f64 / tq / 1e9,
        rq * 1e3,
        scores as f64 / rq / 1e9,
        kq * 1e3,
        scores as f64 / kq / 1e9
    );

    // PQ: one long head (32768 tokens, synthetic codes), 256 queries.
    let (batch, _, n) = support::pq_long_batch(32768, 256, dim, 0);
    let (tl, _) = best_of(rounds, || gpu.search(&batch).unwrap());
    let kl = gpu.time_search(&batch, rounds).unwrap();
    let rl = resident_search(gpu, &batch, rounds);
    gpu.set_pq_shared_keys(0);
    let kg = gpu.time_search(&batch, rounds).unwrap();
    gpu.set_pq_shared_keys(u32::MAX);
    println!(
        "pq long: 256 queries x 32768 tokens: {:.3} ms = {:.2} G token-scores/s (uploads \
         included), codes resident and the queries uploaded {:.3} ms = {:.2} G/s, kernel \
         alone {:.3} ms = {:.2} G/s; keys in device memory instead of shared: {:.3} ms = \
         {:.2} G/s",
        tl * 1e3,
        n as f64 / tl / 1e9,
        rl * 1e3,
        n as f64 / rl / 1e9,
        kl * 1e3,
        n as f64 / kl / 1e9,
        kg * 1e3,
        n as f64 / kg / 1e9
    );
    bench_pq_steps(gpu, dim, rounds);
}

/// Decode steps over one head of 32768 tokens and 256 queries that follow it, uploaded once:
/// each step appends one token's codes (`Gpu::append_pq`) and searches with new query values
/// (`Gpu::search_uploaded`), against the search alone; checked against the host batch after
/// the same appends.
fn bench_pq_steps(gpu: &Gpu, dim: usize, rounds: usize) {
    let steps = rounds.max(1) * 4;
    let (mut batch, head, _) = support::pq_long_batch(32768, 256, dim, steps);
    let mut up = gpu.upload_pq(&batch).unwrap();
    let values: Vec<f32> = (0..up.query_values())
        .map(|i| ((i * 7 % 23) as f32 - 11.0) / 5.0)
        .collect();
    let (alone, _) = best_of(rounds, || gpu.search_uploaded(&mut up, &values).unwrap());
    let (mut step_best, mut append_best) = (f64::INFINITY, f64::INFINITY);
    let mut got = None;
    for step in 0..steps {
        let codes = [(step * 7 % 64) as u16, (step * 11 % 64) as u16];
        let t = Instant::now();
        gpu.append_pq(&mut up, head, &codes).unwrap();
        let appended = t.elapsed().as_secs_f64();
        got = Some(gpu.search_uploaded(&mut up, &values).unwrap());
        step_best = step_best.min(t.elapsed().as_secs_f64());
        append_best = append_best.min(appended);
        batch.append_tokens(head, &codes).unwrap();
    }
    batch.set_query_values(&values).unwrap();
    let (got, want) = (got.unwrap(), batch.search_host().unwrap());
    assert!(
        (0..want.len()).all(|i| got.tokens(i) == want.tokens(i)),
        "PQ after appends differs"
    );
    println!(
        "pq decode steps: 256 queries over one head of 32768 tokens, uploaded once: a step \
         (one token's codes appended, then the search with new query values) {:.3} ms, of \
         which the append call {:.3} ms; the search alone {:.3} ms",
        step_best * 1e3,
        append_best * 1e3,
        alone * 1e3
    );
}

/// The best time of `rounds` searches of `batch` uploaded once (`Gpu::upload_pq`), each with
/// new query values (`Gpu::search_uploaded`: a decode step's upload, launch and download),
/// checked once against a whole search of the batch with those values.
fn resident_search(gpu: &Gpu, batch: &PqBatch, rounds: usize) -> f64 {
    let mut up = gpu.upload_pq(batch).unwrap();
    let values: Vec<f32> = (0..up.query_values())
        .map(|i| ((i * 7 % 23) as f32 - 11.0) / 5.0)
        .collect();
    let (t, got) = best_of(rounds, || gpu.search_uploaded(&mut up, &values).unwrap());
    let mut with = batch.clone();
    with.set_query_values(&values).unwrap();
    let want = gpu.search(&with).unwrap();
    assert!(
        (0..want.len()).all(|i| got.tokens(i) == want.tokens(i)),
        "resident PQ differs"
    );
    t
}

/// The decode figures of the fixture at `level`, `copies` times in one plan, best of `rounds`.
fn bench_decode(
    gpu: &mut Gpu,
    kv: &KvCache,
    profile: &Profile,
    level: u8,
    (rounds, copies): (usize, usize),
) {
    let bytes = support::stream_bytes(kv, profile, level);
    let stream = support::open(&bytes);
    let plan = support::decode_plan(&stream, copies);
    let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
    let out_bytes = (plan.output().len * 2) as f64;
    let gbs = |t: f64| out_bytes / t / 1e9;
    let (whole, r) = best_of(rounds, || gpu.decode_into(&plan, &mut out));
    r.unwrap();
    let want = gpu.stream().clone_dtoh(&out).unwrap();
    let upload = gpu.time_upload_plan(&plan, None, rounds).unwrap();
    gpu.set_upload_threads(1);
    let upload_one = gpu.time_upload_plan(&plan, None, rounds).unwrap();
    gpu.set_upload_threads(0);
    let up = gpu.upload_plan(&plan).unwrap();
    let (reused, r) = best_of(rounds, || gpu.decode_uploaded_into(&up, &mut out));
    r.unwrap();
    let k_chain = gpu.time_decode_chain(&plan, &mut out, rounds).unwrap();
    let st = gpu
        .time_decode_chain_stages(&plan, &mut out, rounds)
        .unwrap();
    println!(
        "decode level {level}: {} bytes x {copies} -> {:.1} MB f16: whole decode_into {:.3} ms = \
         {:.2} GB/s (of which upload_plan {:.3} ms: chain built {:.3}, packed and copied from \
         pinned memory {:.3} (written by one thread: {:.3}), statuses read {:.3} ms); plan \
         uploaded once, decode_uploaded_into {:.3} ms = {:.2} GB/s; the chain's kernels \
         alone {:.3} ms = {:.2} GB/s (each alone: {}, the dequantization at {:.1} GB/s)",
        bytes.len(),
        out_bytes / 1e6,
        whole * 1e3,
        gbs(whole),
        upload[0] * 1e3,
        upload[1] * 1e3,
        upload[2] * 1e3,
        upload_one[2] * 1e3,
        upload[3] * 1e3,
        reused * 1e3,
        gbs(reused),
        k_chain * 1e3,
        gbs(k_chain),
        stage_times(&st),
        gbs(st[4]),
    );
    for variant in [FUSED, COMPACT_TABLES] {
        bench_chain_variant(gpu, (&plan, &mut out), rounds, &want, variant);
    }
    bench_decode_from(gpu, &bytes, (rounds, copies), &want);
    let one_copy = &want[..want.len() / copies];
    for n in [copies, 4 * copies] {
        bench_decode_threads(gpu, &bytes, (rounds, n), one_copy);
    }
    for n in [copies, 4 * copies, 16 * copies] {
        bench_decode_pieces(gpu, &bytes, (rounds, n), one_copy);
    }
    bench_lane_decode(gpu, &plan, level, rounds);
}

/// The whole decode with a profile learned with the fixture's queries (step exponents on, as
/// `kvc profile` learns them; each layer's K and V blocks have an exponent table, which the
/// device expands from its frequencies): the middle and last levels, `copies` and 4x as many
/// streams in pieces (`bench_decode_pieces`), against one copy decoded by `decode_into`.
fn bench_decode_exponents(gpu: &mut Gpu, d: &kvc_io::Dump, (rounds, copies): (usize, usize)) {
    let profile = support::profile_with_queries(d);
    for level in [profile.levels() / 2, profile.levels() - 1] {
        let bytes = support::stream_bytes(&d.kv, &profile, level);
        let stream = support::open(&bytes);
        let plan = support::decode_plan(&stream, 1);
        let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
        let (whole, r) = best_of(rounds, || gpu.decode_into(&plan, &mut out));
        r.unwrap();
        let want = gpu.stream().clone_dtoh(&out).unwrap();
        println!(
            "decode with step exponents, level {level}: {} bytes a copy; one copy decode_into              {:.3} ms",
            bytes.len(),
            whole * 1e3
        );
        for n in [copies, 4 * copies] {
            bench_decode_pieces(gpu, &bytes, (rounds, n), &want);
        }
        println!("  the same with compact tables:");
        gpu.set_lane_tables_compact(true);
        bench_decode_pieces(gpu, &bytes, (rounds, 4 * copies), &want);
        gpu.set_lane_tables_compact(false);
    }
}

/// A chain other than the default, set by `set(gpu, true)` and undone by `set(gpu, false)`,
/// named `label`: the decode of `plan` uploaded once and the chain's kernels, to set beside
/// `bench_decode`'s figures; the output checked against `want`.
type ChainVariant = (&'static str, fn(&mut Gpu, bool));

/// The fused chain (`Gpu::set_decode_chain_fused(true)`).
const FUSED: ChainVariant = (
    "the fused chain (no table resolution, only the escapes' values written)",
    |gpu, on| gpu.set_decode_chain_fused(on),
);

/// Compact tables (`Gpu::set_lane_tables_compact`: 2 KiB a table, one more dependent load a
/// symbol).
const COMPACT_TABLES: ChainVariant = ("compact tables", |gpu, on| gpu.set_lane_tables_compact(on));

/// `variant` of `plan`'s chain (see [`ChainVariant`]).
fn bench_chain_variant(
    gpu: &mut Gpu,
    (plan, out): (&DecodePlan<'_>, &mut CudaSlice<u16>),
    rounds: usize,
    want: &[u16],
    (label, set): ChainVariant,
) {
    let gbs = |t: f64| (plan.output().len * 2) as f64 / t / 1e9;
    set(gpu, true);
    let up = gpu.upload_plan(plan).unwrap();
    let (reused, r) = best_of(rounds, || gpu.decode_uploaded_into(&up, out));
    r.unwrap();
    drop(up);
    let got = gpu.stream().clone_dtoh(&*out).unwrap();
    assert!(got == want, "{label}: the output differs");
    let k_chain = gpu.time_decode_chain(plan, out, rounds).unwrap();
    let st = gpu.time_decode_chain_stages(plan, out, rounds).unwrap();
    set(gpu, false);
    println!(
        "  {label}: plan uploaded once {:.3} ms = {:.2} GB/s; its kernels alone {:.3} ms = \
         {:.2} GB/s (each alone: {})",
        reused * 1e3,
        gbs(reused),
        k_chain * 1e3,
        gbs(k_chain),
        stage_times(&st),
    );
}

/// A chain's launch times (`Gpu::time_decode_chain_stages`, seconds) as printed.
fn stage_times(st: &[f64; 5]) -> String {
    let names = ["exponents", "tables", "symbols", "values", "dequantization"];
    let each: Vec<String> = (names.iter().zip(st))
        .map(|(n, t)| format!("{n} {:.3}", t * 1e3))
        .collect();
    format!("{} ms", each.join(", "))
}

/// `copies` copies of the stream `bytes` back to back in page-locked memory.
fn page_locked_copies(gpu: &Gpu, bytes: &[u8], copies: usize) -> HostBuffer {
    let mut host = gpu.host_buffer(bytes.len() * copies).unwrap();
    for copy in host.as_mut_slice().unwrap().chunks_exact_mut(bytes.len()) {
        copy.copy_from_slice(bytes);
    }
    host
}

/// The copy ceiling ([`bench_pcie`]), then `decode_from` at the defaults with each piece's
/// bytes copied once its chain is built and before (`Gpu::set_decode_copy_early`), and before
/// with a first piece of 256 blocks growing to the rest (`set_decode_first_piece_blocks`,
/// which gained at 32 streams and lost elsewhere when copied once built): the three levels,
/// `copies`, 4x and 16x as many streams, every output checked; then when each of the first
/// pieces' steps happened, copied once built and early, at the last level with 4x the
/// streams.
fn bench_copy_early(
    gpu: &mut Gpu,
    kv: &KvCache,
    profile: &Profile,
    (rounds, copies): (usize, usize),
) {
    bench_pcie(gpu, rounds);
    for level in [0u8, profile.levels() / 2, profile.levels() - 1] {
        let bytes = support::stream_bytes(kv, profile, level);
        let one = support::open(&bytes);
        let one_copy = gpu.decode(&support::decode_plan(&one, 1)).unwrap();
        for n in [copies, 4 * copies, 16 * copies] {
            with_copies(gpu, &bytes, n, |gpu, mut c| {
                let gbs = |t: f64| (one_copy.len() * 2 * n) as f64 / t / 1e9;
                let mut line = Vec::new();
                let mut timelines = Vec::new();
                for (early, first) in [(false, 0), (true, 0), (true, 256)] {
                    gpu.set_decode_copy_early(early);
                    gpu.set_decode_first_piece_blocks(first);
                    let (t, ok) = best_decode_from(gpu, &mut c, rounds, &one_copy);
                    line.push(format!(
                        "copied {}{}: {:.3} ms = {:.2} GB/s (bits ok: {ok})",
                        if early { "early" } else { "once built" },
                        if first > 0 { ", first piece 256" } else { "" },
                        t * 1e3,
                        gbs(t)
                    ));
                    if level == profile.levels() - 1 && n == 4 * copies && first == 0 {
                        timelines.push(first_pieces(gpu, &mut c));
                    }
                }
                gpu.set_decode_copy_early(false);
                gpu.set_decode_first_piece_blocks(0);
                println!(
                    "copy early, level {level}, {n} streams -> {:.1} MB f16, decode_from at \
                     the defaults: {}{}",
                    (one_copy.len() * 2 * n) as f64 / 1e6,
                    line.join(", "),
                    timelines.concat()
                );
            });
        }
    }
}

/// Page-locked host memory to the device: 256 MiB in one copy on one stream, and split into
/// 2 and 4 parts each on a stream of its own (copied at once, on as many of the device's copy
/// engines as it gives them), best of `rounds`: the ceiling of a decode's uploads.
fn bench_pcie(gpu: &Gpu, rounds: usize) {
    const LEN: usize = 256 << 20;
    let host = gpu.host_buffer(LEN).unwrap();
    let src = host.as_slice().unwrap();
    let ctx = gpu.stream().context().clone();
    let mut line = Vec::new();
    for parts in [1, 2, 4] {
        let part = LEN / parts;
        let streams: Vec<_> = (0..parts).map(|_| ctx.new_stream().unwrap()).collect();
        // A buffer each: copies into parts of one would wait for one another.
        let mut dsts: Vec<_> = (streams.iter())
            .map(|s| s.alloc_zeros::<u8>(part).unwrap())
            .collect();
        streams.iter().for_each(|s| s.synchronize().unwrap());
        let (t, ()) = best_of(rounds, || {
            for (i, (s, to)) in streams.iter().zip(&mut dsts).enumerate() {
                s.memcpy_htod(&src[i * part..(i + 1) * part], to).unwrap();
            }
            streams.iter().for_each(|s| s.synchronize().unwrap());
        });
        line.push(format!("{parts} at once {:.1} GB/s", LEN as f64 / t / 1e9));
    }
    println!("page-locked host to device, 256 MiB: {}", line.join(", "));
}

/// `n` copies of the stream `bytes` in page-locked memory, a plan decoding them (each copy a
/// stream of its own, their CRCs checked at decode) and an output for it, handed to `f`.
fn with_copies<R>(
    gpu: &mut Gpu,
    bytes: &[u8],
    n: usize,
    f: impl FnOnce(&mut Gpu, Copies<'_>) -> R,
) -> R {
    let host = page_locked_copies(gpu, bytes, n);
    let raw = host.as_slice().unwrap();
    let streams: Vec<_> = raw.chunks_exact(bytes.len()).map(support::open).collect();
    let refs: Vec<_> = streams.iter().collect();
    let plan = support::decode_plan_with(&refs, 0, true);
    let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
    let copies = Copies {
        host: &host,
        plan: &plan,
        out: &mut out,
    };
    f(gpu, copies)
}

/// Copies of a stream in page-locked memory, a plan decoding them and its output
/// ([`with_copies`]).
struct Copies<'a> {
    host: &'a HostBuffer,
    plan: &'a DecodePlan<'a>,
    out: &'a mut CudaSlice<u16>,
}

/// The best of `rounds` `decode_from`s of `c`, and whether the output is `one_copy` over
/// and over.
fn best_decode_from(gpu: &Gpu, c: &mut Copies<'_>, rounds: usize, one_copy: &[u16]) -> (f64, bool) {
    gpu.stream().memset_zeros(c.out).unwrap();
    let (t, r) = best_of(rounds, || gpu.decode_from(c.plan, c.host, c.out));
    let got = gpu.stream().clone_dtoh(c.out).unwrap();
    let ok = r.is_ok() && got.chunks_exact(one_copy.len()).all(|g| g == one_copy);
    (t, ok)
}

/// When the first three pieces' steps happened in `decode_from` of `plan` (the last of five
/// runs), as a line's tail.
fn first_pieces(gpu: &Gpu, c: &mut Copies<'_>) -> String {
    let mut timeline = Ok(Vec::new());
    for _ in 0..5 {
        timeline = gpu.time_decode_pieces(c.plan, Some(c.host), c.out);
    }
    match timeline {
        Ok(p) => format!(
            "; first pieces (ms): {}",
            p.iter()
                .take(3)
                .map(piece_steps)
                .collect::<Vec<_>>()
                .join("; ")
        ),
        Err(e) => format!("; not timed ({e})"),
    }
}

/// A piece's steps in ms from a decode's start: on the host, its chain taken from the
/// builder, its upload queued, its launches queued; on the device, its copy and launches.
fn piece_steps(t: &codec_cuda::PieceTimes) -> String {
    format!(
        "host {:.2}/{:.2}/{:.2}, copy {:.2}-{:.2}, launches {:.2}-{:.2}",
        t[0], t[1], t[2], t[3], t[4], t[5], t[6]
    )
}

/// `copies` copies of the stream `bytes` decoded on one handle in pieces of 0 (whole), 4096,
/// 2048, 1024 and 512 coded blocks (`Gpu::set_decode_piece_blocks`): `decode_from` from
/// page-locked memory (the plan built before, its CRCs checked on the device) and
/// `decode_into` (words packed, CRCs checked as the plan was built); every output checked
/// against `one_copy`. Then, at the fastest piece size, the plan built and `decode_from`
/// together.
fn bench_decode_pieces(
    gpu: &mut Gpu,
    bytes: &[u8],
    (rounds, copies): (usize, usize),
    one_copy: &[u16],
) {
    let host = page_locked_copies(gpu, bytes, copies);
    let raw = host.as_slice().unwrap();
    let streams: Vec<_> = raw.chunks_exact(bytes.len()).map(support::open).collect();
    let refs: Vec<_> = streams.iter().collect();
    let [packed, at_decode] = [false, true].map(|crc| support::decode_plan_with(&refs, 0, crc));
    let copied = at_decode.bytes_copied_from(raw).unwrap();
    let mut out = gpu
        .stream()
        .alloc_zeros::<u16>(one_copy.len() * copies)
        .unwrap();
    let gbs = |t: f64| (one_copy.len() * 2 * copies) as f64 / t / 1e9;
    let mut line = Vec::new();
    let mut best = (f64::INFINITY, 0);
    for piece_blocks in [0, 4096, 2048, 1024, 512] {
        gpu.set_decode_piece_blocks(piece_blocks);
        let mut ok = true;
        let mut time = |decode: &mut dyn FnMut(&mut CudaSlice<u16>) -> Result<(), _>| {
            gpu.stream().memset_zeros(&mut out).unwrap();
            let (t, r) = best_of(rounds, || decode(&mut out));
            let got = gpu.stream().clone_dtoh(&out).unwrap();
            ok &= r.is_ok() && got.chunks_exact(one_copy.len()).all(|c| c == one_copy);
            t
        };
        let from = time(&mut |out| gpu.decode_from(&at_decode, &host, out));
        let into = time(&mut |out| gpu.decode_into(&packed, out));
        if from < best.0 {
            best = (from, piece_blocks);
        }
        line.push(format!(
            "{piece_blocks}: decode_from {:.3} ms = {:.2} GB/s, decode_into {:.3} ms = {:.2} \
             GB/s (bits ok: {ok})",
            from * 1e3,
            gbs(from),
            into * 1e3,
            gbs(into)
        ));
    }
    // decode_from with pieces growing from a small first one, then with the device's memory
    // pool keeping what each call frees (its uploads, statuses and words mapped once).
    let mut from = |gpu: &mut Gpu, (piece_blocks, first): (usize, usize)| {
        gpu.set_decode_piece_blocks(piece_blocks);
        gpu.set_decode_first_piece_blocks(first);
        let (t, r) = best_of(rounds, || gpu.decode_from(&at_decode, &host, &mut out));
        let got = gpu.stream().clone_dtoh(&out).unwrap();
        let ok = r.is_ok() && got.chunks_exact(one_copy.len()).all(|c| c == one_copy);
        gpu.set_decode_first_piece_blocks(0);
        format!(
            "{piece_blocks} from {first}: {:.3} ms = {:.2} GB/s (bits ok: {ok})",
            t * 1e3,
            gbs(t)
        )
    };
    let ramps = [(4096, 256), (4096, 1024), (2048, 256), (2048, 512)];
    let ramped: Vec<_> = ramps.iter().map(|&p| from(gpu, p)).collect();
    gpu.set_pool_release_threshold(u64::MAX).unwrap();
    let kept: Vec<_> = [(0, 0), (4096, 0), (2048, 0), (4096, 256), (2048, 256)]
        .iter()
        .map(|&p| from(gpu, p))
        .collect();
    gpu.set_pool_release_threshold(0).unwrap();
    gpu.set_decode_piece_blocks(best.1);
    let (together, r) = best_of(rounds, || {
        let plan = support::decode_plan_with(&refs, 0, true);
        gpu.decode_from(&plan, &host, &mut out)
    });
    r.unwrap();
    // When each piece's steps happened in decode_from at 1024 blocks a piece (the last of
    // `rounds` runs).
    gpu.set_decode_piece_blocks(1024);
    let mut timeline = Ok(Vec::new());
    for _ in 0..rounds {
        timeline = gpu.time_decode_pieces(&at_decode, Some(&host), &mut out);
    }
    gpu.set_decode_piece_blocks(codec_cuda::DEFAULT_PIECE_BLOCKS);
    let timeline = match timeline {
        Ok(pieces) => pieces
            .iter()
            .map(piece_steps)
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) => format!("not timed ({e})"),
    };
    println!(
        "decode in pieces on one handle, {copies} streams of {} bytes -> {:.1} MB f16 \
         (decode_from copies {:.1} MB whole), by blocks a piece: {}; decode_from in pieces \
         growing from a first: {}; the pool keeping freed memory: {}; plan built and decode_from together at {}: {:.3} ms = {:.2} GB/s; \
         decode_from at 1024 blocks a piece, each piece's steps in ms from its start (host: \
         chain ready/upload queued/launches queued; device): {}",
        bytes.len(),
        (one_copy.len() * 2 * copies) as f64 / 1e6,
        copied as f64 / 1e6,
        line.join("; "),
        ramped.join(", "),
        kept.join(", "),
        best.1,
        together * 1e3,
        gbs(together),
        timeline
    );
}

/// `decode_from` in pieces of 1024, 2048 and 4096 coded blocks with 2, 3, 4, 6 and 8 pieces'
/// launches at once (`Gpu::set_decode_pieces_in_flight`), the
/// chain fused and in five launches, the device's pool keeping freed memory: 4x and 16x
/// `copies` streams at the last level, the middle level and the middle level with step
/// exponents; every output checked. Then when each piece's steps happened with the most
/// pieces in flight at 1024 blocks a piece, for the first case.
fn bench_pieces_in_flight(
    gpu: &mut Gpu,
    d: &kvc_io::Dump,
    profile: &Profile,
    (rounds, copies): (usize, usize),
) {
    let with_queries = support::profile_with_queries(d);
    let cases = [
        ("", profile, profile.levels() - 1),
        ("", profile, profile.levels() / 2),
        (
            " with step exponents",
            &with_queries,
            with_queries.levels() / 2,
        ),
    ];
    gpu.set_pool_release_threshold(u64::MAX).unwrap();
    let mut timeline = None;
    for (label, profile, level) in cases {
        let bytes = support::stream_bytes(&d.kv, profile, level);
        let one = support::open(&bytes);
        let plan = support::decode_plan(&one, 1);
        let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
        gpu.decode_into(&plan, &mut out).unwrap();
        let one_copy = gpu.stream().clone_dtoh(&out).unwrap();
        for n in [4 * copies, 16 * copies] {
            with_copies(gpu, &bytes, n, |gpu, mut c| {
                let gbs = |t: f64| (one_copy.len() * 2 * n) as f64 / t / 1e9;
                let mut ok = true;
                for fused in [true, false] {
                    gpu.set_decode_chain_fused(fused);
                    let mut line = Vec::new();
                    for in_flight in [2, 3, 4, 6, 8] {
                        gpu.set_decode_pieces_in_flight(in_flight);
                        let mut sizes = Vec::new();
                        for piece_blocks in [1024, 2048, 4096] {
                            gpu.set_decode_piece_blocks(piece_blocks);
                            let (t, bits) = best_decode_from(gpu, &mut c, rounds, &one_copy);
                            ok &= bits;
                            sizes.push(format!("{piece_blocks} {:.2}", gbs(t)));
                        }
                        line.push(format!("{in_flight} in flight: {}", sizes.join(", ")));
                    }
                    println!(
                        "pieces in flight, level {level}{label}, {n} streams -> {:.1} MB f16, \
                         {} chain, GB/s by blocks a piece: {} (bits ok: {ok})",
                        (one_copy.len() * 2 * n) as f64 / 1e6,
                        if fused { "fused" } else { "five-launch" },
                        line.join("; ")
                    );
                }
                if timeline.is_none() {
                    gpu.set_decode_pieces_in_flight(codec_cuda::MAX_PIECES_IN_FLIGHT);
                    gpu.set_decode_piece_blocks(1024);
                    let t = gpu.time_decode_pieces(c.plan, Some(c.host), c.out);
                    timeline = Some(t.map(|pieces| {
                        let step = |t: &codec_cuda::PieceTimes| {
                            format!(
                                "copy {:.2}-{:.2}, launches {:.2}-{:.2}",
                                t[3], t[4], t[5], t[6]
                            )
                        };
                        pieces.iter().map(step).collect::<Vec<_>>().join("; ")
                    }));
                }
            });
        }
    }
    gpu.set_decode_chain_fused(false);
    gpu.set_decode_pieces_in_flight(codec_cuda::DEFAULT_PIECES_IN_FLIGHT);
    gpu.set_decode_piece_blocks(codec_cuda::DEFAULT_PIECE_BLOCKS);
    gpu.set_pool_release_threshold(0).unwrap();
    if let Some(t) = timeline {
        let t = t.unwrap_or_else(|e| format!("not timed ({e})"));
        println!(
            "pieces in flight: the first case at 1024 blocks a piece, {} in flight, the \
             five-launch chain, each piece on the device in ms from the start: {t}",
            codec_cuda::MAX_PIECES_IN_FLIGHT
        );
    }
}

/// For `n` host threads: a handle forked from `gpu` each (packing uploads on its share of the
/// cores) and a page-locked buffer holding `per` copies of the stream `bytes`.
fn forked_shares(gpu: &Gpu, bytes: &[u8], n: usize, per: usize) -> Vec<(Gpu, HostBuffer)> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    (0..n)
        .map(|_| {
            let mut g = gpu.fork().unwrap();
            g.set_upload_threads((cores / n).max(1));
            let host = page_locked_copies(&g, bytes, per);
            (g, host)
        })
        .collect()
}

/// The streams of each share, opened where they lie (each `len` bytes).
fn open_shares(shares: &[(Gpu, HostBuffer)], len: usize) -> Vec<Vec<Stream<'_>>> {
    (shares.iter())
        .map(|(_, h)| {
            let raw = h.as_slice().unwrap();
            raw.chunks_exact(len).map(support::open).collect()
        })
        .collect()
}

/// Each place's largest value over `times` (the slowest thread's).
fn slowest<const N: usize>(times: impl IntoIterator<Item = [f64; N]>) -> [f64; N] {
    times.into_iter().fold([0.0; N], |mut m, t| {
        m.iter_mut().zip(t).for_each(|(m, t)| *m = m.max(t));
        m
    })
}

/// `copies` copies of the stream `bytes` decoded by 1 to 8 host threads at once, each with a
/// handle of its own (`Gpu::fork`: its own CUDA stream, staging and scratch) and its share of
/// the copies in a page-locked buffer of its own, as a server decodes the requests it received:
/// per thread, the plan built (on that thread) from its streams (opened before, as for
/// `decode_from` above), `decode_from` into an output of its own. Timed from the threads'
/// start to the last one's end; every output checked against `one_copy` (one copy's f16, as
/// `decode_into` gave it); the slowest thread's plan and decode of the last round beside it.
fn bench_decode_threads(
    gpu: &Gpu,
    bytes: &[u8],
    (rounds, copies): (usize, usize),
    one_copy: &[u16],
) {
    for crc_at_decode in [false, true] {
        bench_decode_threads_with(gpu, bytes, (rounds, copies), one_copy, crc_at_decode);
    }
}

/// [`bench_decode_threads`], the plans' CRCs checked at decode (on the device) or not.
fn bench_decode_threads_with(
    gpu: &Gpu,
    bytes: &[u8],
    (rounds, copies): (usize, usize),
    one_copy: &[u16],
    crc_at_decode: bool,
) {
    let mut line = Vec::new();
    for n in [1usize, 2, 4, 8].into_iter().filter(|n| copies % n == 0) {
        let per = copies / n;
        let hosts = forked_shares(gpu, bytes, n, per);
        let streams = open_shares(&hosts, bytes.len());
        let mut outs: Vec<_> = hosts
            .iter()
            .map(|(g, _)| g.stream().alloc_zeros::<u16>(one_copy.len() * per).unwrap())
            .collect();
        let (t, ok) = best_of(rounds, || {
            std::thread::scope(|s| {
                let threads: Vec<_> = (hosts.iter().zip(&streams).zip(outs.iter_mut()))
                    .map(|(((g, host), streams), out)| {
                        s.spawn(move || {
                            let t = Instant::now();
                            let refs: Vec<_> = streams.iter().collect();
                            let plan = support::decode_plan_with(&refs, 1, crc_at_decode);
                            let planned = t.elapsed().as_secs_f64();
                            g.decode_from(&plan, host, out).ok()?;
                            Some([planned, t.elapsed().as_secs_f64() - planned])
                        })
                    })
                    .collect();
                let times: Option<Vec<[f64; 2]>> =
                    threads.into_iter().map(|t| t.join().unwrap()).collect();
                times.map(slowest)
            })
        });
        let same = ok.is_some()
            && hosts.iter().zip(&outs).all(|((g, _), out)| {
                let got = g.stream().clone_dtoh(out).unwrap();
                got.chunks_exact(one_copy.len()).all(|c| c == one_copy)
            });
        let gbs = (one_copy.len() * 2 * copies) as f64 / t / 1e9;
        let differ = if same {
            ""
        } else {
            " (NOT the bits of decode_into)"
        };
        let [plan, decode] = ok.unwrap_or_default();
        line.push(format!(
            "{n}: {:.3} ms = {gbs:.2} GB/s{differ} (last round's slowest thread: plan {:.3} ms, \
             decode_from {:.3} ms)",
            t * 1e3,
            plan * 1e3,
            decode * 1e3
        ));
    }
    let crc = if crc_at_decode {
        ", CRCs on the device"
    } else {
        ""
    };
    println!(
        "decode on host threads, each with its own Gpu::fork, {copies} streams of {} bytes in \
         page-locked memory -> {:.1} MB f16 (plan built{crc}, decode_from): {}",
        bytes.len(),
        (one_copy.len() * 2 * copies) as f64 / 1e6,
        line.join("; ")
    );
}

/// The same decode with `copies` copies of the stream `bytes` back to back in page-locked
/// memory, as a server would receive them: `Gpu::decode_from` (the bytes copied to the device
/// as they are, the words gathered there); `want`, the output `decode_into` gave.
fn bench_decode_from(gpu: &Gpu, bytes: &[u8], (rounds, copies): (usize, usize), want: &[u16]) {
    let host = page_locked_copies(gpu, bytes, copies);
    let raw = host.as_slice().unwrap();
    let streams: Vec<_> = raw.chunks_exact(bytes.len()).map(support::open).collect();
    let refs: Vec<_> = streams.iter().collect();
    // The plan built (every chunk's CRC checked, its blocks read) on one thread and on the
    // default threads.
    let (plan_one, _) = best_of(rounds, || support::decode_plan_threads(&refs, 1));
    let (plan_all, plan) = best_of(rounds, || support::decode_plan_threads(&refs, 0));
    let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
    let gbs = |t: f64| (plan.output().len * 2) as f64 / t / 1e9;
    let (whole, r) = best_of(rounds, || gpu.decode_from(&plan, &host, &mut out));
    r.unwrap();
    let same = gpu.stream().clone_dtoh(&out).unwrap() == want;
    let upload = gpu.time_upload_plan(&plan, Some(&host), rounds).unwrap();
    // From the bytes to the output: the plan built (default threads), then decode_from; and
    // the same with the chunks' CRCs checked on the device.
    let from_bytes = [false, true].map(|crc_at_decode| {
        let (t, r) = best_of(rounds, || {
            let plan = support::decode_plan_with(&refs, 0, crc_at_decode);
            gpu.decode_from(&plan, &host, &mut out)
        });
        r.unwrap();
        t
    });
    let crc_plan = support::decode_plan_with(&refs, 0, true);
    let same_crc = gpu.decode_vec_from(&crc_plan, &host).unwrap() == want;
    println!(
        "decode from page-locked memory, {copies} streams of {} bytes: whole decode_from {:.3} \
         ms = {:.2} GB/s (of which upload_plan_from {:.3} ms: chain built {:.3}, bytes copied \
         as they are with the rest packed, words gathered, chunks checked {:.3}, statuses \
         read {:.3} ms); \
         bits as decode_into's: {same}; the plan built before it (add_streams) {:.3} ms on one \
         thread, {:.3} ms on the default threads; plan and decode_from together {:.3} ms = \
         {:.2} GB/s, with the CRCs checked on the device {:.3} ms = {:.2} GB/s (bits as \
         decode_into's: {same_crc})",
        bytes.len(),
        whole * 1e3,
        gbs(whole),
        upload[0] * 1e3,
        upload[1] * 1e3,
        upload[2] * 1e3,
        upload[3] * 1e3,
        plan_one * 1e3,
        plan_all * 1e3,
        from_bytes[0] * 1e3,
        gbs(from_bytes[0]),
        from_bytes[1] * 1e3,
        gbs(from_bytes[1]),
    );
}

/// The two halves of `decode_from` on host threads apart, each thread with its own
/// `Gpu::fork`, page-locked buffer and plan (built before) of its share of `copies` streams
/// of the middle level (`forked_shares`): the uploads alone (`Gpu::time_upload_plan` on every
/// thread at once: the wall time, the slowest thread's chain build, copy and gather,
/// allocation), then the uploaded plans' chains of launches (`decode_uploaded_into` on every
/// thread at once).
fn bench_threads_apart(
    gpu: &Gpu,
    kv: &KvCache,
    profile: &Profile,
    (rounds, copies): (usize, usize),
) {
    let bytes = support::stream_bytes(kv, profile, profile.levels() / 2);
    let out_len = support::decode_plan(&support::open(&bytes), 1).output().len;
    for n in [1usize, 2, 4, 8].into_iter().filter(|n| copies % n == 0) {
        let per = copies / n;
        let hosts = forked_shares(gpu, &bytes, n, per);
        let streams = open_shares(&hosts, bytes.len());
        let plans: Vec<_> = streams
            .iter()
            .map(|s| support::decode_plan_of(&s.iter().collect::<Vec<_>>()))
            .collect();
        let (upload, parts) = best_of(rounds, || {
            std::thread::scope(|s| {
                let threads: Vec<_> = (hosts.iter().zip(&plans))
                    .map(|((g, host), plan)| {
                        s.spawn(move || g.time_upload_plan(plan, Some(host), 1).unwrap())
                    })
                    .collect();
                slowest(threads.into_iter().map(|t| t.join().unwrap()))
            })
        });
        let ups: Vec<_> = (hosts.iter().zip(&plans))
            .map(|((g, host), plan)| g.upload_plan_from(plan, host).unwrap())
            .collect();
        let mut outs: Vec<_> = hosts
            .iter()
            .map(|(g, _)| g.stream().alloc_zeros::<u16>(out_len * per).unwrap())
            .collect();
        let (launched, ok) = best_of(rounds, || {
            std::thread::scope(|s| {
                let threads: Vec<_> = (hosts.iter().zip(&ups).zip(outs.iter_mut()))
                    .map(|(((g, _), up), out)| {
                        s.spawn(move || g.decode_uploaded_into(up, out).is_ok())
                    })
                    .collect();
                threads.into_iter().all(|t| t.join().unwrap())
            })
        });
        let gbs = |t: f64| (out_len * 2 * copies) as f64 / t / 1e9;
        println!(
            "{n} threads apart, {copies} streams of {} bytes -> {:.1} MB f16: uploads at once \
             {:.3} ms = {:.2} GB/s (slowest thread: whole {:.3}, chain built {:.3}, copied and \
             gathered {:.3}, statuses read {:.3} ms); uploaded chains at once {:.3} ms = {:.2} \
             GB/s (all ok: {ok})",
            bytes.len(),
            (out_len * 2 * copies) as f64 / 1e6,
            upload * 1e3,
            gbs(upload),
            parts[0] * 1e3,
            parts[1] * 1e3,
            parts[2] * 1e3,
            parts[3] * 1e3,
            launched * 1e3,
            gbs(launched),
        );
    }
}

/// The symbol launch of `plan` alone: format v2 against the 32-bit-state experiment on the
/// same symbols and tables, then by launch shape (tables staged in shared memory, coded
/// blocks per CUDA block).
fn bench_lane_decode(gpu: &mut Gpu, plan: &DecodePlan<'_>, level: u8, rounds: usize) {
    let gbs = |t: f64| (plan.output().len * 2) as f64 / t / 1e9;
    let exp = gpu.lane_decode(&plan.exponent_batch().unwrap()).unwrap();
    let exps = plan.exponents(&exp).unwrap();
    let sym_batch = plan.symbol_batch(&exps).unwrap();
    let sym = gpu.lane_decode(&sym_batch).unwrap();
    let b32 = Lane32Batch::encode(&sym_batch, &sym).unwrap();
    let dec32 = gpu.lane32_decode_experiment(&b32).unwrap();
    let blocks = sym_batch.blocks();
    let same =
        (0..blocks.len()).all(|b| dec32.outcome(b).is_ok() && dec32.symbols(b) == sym.symbols(b));
    let n_sym: f64 = blocks.iter().map(|b| f64::from(b.n_symbols)).sum();
    let k64 = gpu.time_lane_decode(&sym_batch, rounds).unwrap();
    let k32 = gpu.time_lane32_decode_experiment(&b32, rounds).unwrap();
    println!(
        "lane decode level {level}, {:.1} M symbols in {} blocks: v2 (64-bit state, 32-bit words, \
         {} payload bytes) {:.3} ms = {:.2} G symbols/s = {:.2} GB/s of f16; 32-bit-state \
         experiment (16-bit words, {} payload bytes, {:+.3}%) {:.3} ms = {:.2} G symbols/s = \
         {:.2} GB/s of f16 ({:.2}x); same symbols, every lane OK: {same}",
        n_sym / 1e6,
        blocks.len(),
        sym_batch.payload_bytes(),
        k64 * 1e3,
        n_sym / k64 / 1e9,
        gbs(k64),
        b32.payload_bytes(),
        (b32.payload_bytes() as f64 / sym_batch.payload_bytes() as f64 - 1.0) * 100.0,
        k32 * 1e3,
        n_sym / k32 / 1e9,
        gbs(k32),
        k64 / k32,
    );
    // Tables staged in shared memory per lane-decode block (the default is none): fewer
    // tables let more blocks share an SM; blocks with more tables read them through the cache.
    let mut sweep = Vec::new();
    for t in [0u32, 1, 2, 4, 8] {
        gpu.set_lane_shared_tables(t).unwrap();
        let v2 = gpu.time_lane_decode(&sym_batch, rounds).unwrap();
        let v3 = gpu.time_lane32_decode_experiment(&b32, rounds).unwrap();
        sweep.push(format!(
            "{t}: v2 {:.3} ms, 32-bit {:.3} ms",
            v2 * 1e3,
            v3 * 1e3
        ));
    }
    gpu.set_lane_shared_tables(DEFAULT_LANE_SHARED_TABLES)
        .unwrap();
    println!(
        "lane decode level {level} by tables in shared memory: {}",
        sweep.join("; ")
    );
    // Coded blocks (warps) per CUDA block: more let an SM hold more warps than its limit of
    // resident CUDA blocks (32 on an H100) allows.
    let mut sweep = Vec::new();
    for w in [1u32, 2, 4, 8] {
        gpu.set_lane_warps(w).unwrap();
        let t = gpu.time_lane_decode(&sym_batch, rounds).unwrap();
        sweep.push(format!("{w}: {:.3} ms", t * 1e3));
    }
    gpu.set_lane_warps(LaneShape::DEFAULT.warps()).unwrap();
    println!(
        "lane decode level {level} by blocks per CUDA block: {}",
        sweep.join("; ")
    );
}

/// How decode throughput grows with the batch: the middle level's plan with `copies`, 4x and
/// 8x as many copies, uploaded once; its chain's kernels alone with 1 and 4 coded blocks per
/// lane-decode CUDA block. (A batch too small to fill the device leaves each lane's chain of
/// dependent loads exposed.)
fn bench_decode_scaling(
    gpu: &mut Gpu,
    kv: &KvCache,
    profile: &Profile,
    (rounds, copies): (usize, usize),
) {
    let level = profile.levels() / 2;
    let bytes = support::stream_bytes(kv, profile, level);
    let stream = support::open(&bytes);
    for n in [copies, 4 * copies, 8 * copies] {
        let plan = support::decode_plan(&stream, n);
        let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
        let gbs = |t: f64| (plan.output().len * 2) as f64 / t / 1e9;
        let up = gpu.upload_plan(&plan).unwrap();
        let (reused, r) = best_of(rounds, || gpu.decode_uploaded_into(&up, &mut out));
        r.unwrap();
        drop(up);
        let mut kernels = Vec::new();
        for w in [1u32, 4] {
            gpu.set_lane_warps(w).unwrap();
            let t = gpu.time_decode_chain(&plan, &mut out, rounds).unwrap();
            let st = gpu
                .time_decode_chain_stages(&plan, &mut out, rounds)
                .unwrap();
            kernels.push(format!(
                "{w} per CUDA block {:.3} ms = {:.2} GB/s (symbols {:.3} ms)",
                t * 1e3,
                gbs(t),
                st[2] * 1e3
            ));
        }
        gpu.set_lane_warps(LaneShape::DEFAULT.warps()).unwrap();
        println!(
            "decode scaling level {level}, {n} copies -> {:.1} MB f16: plan uploaded once, \
             decode_uploaded_into {:.3} ms = {:.2} GB/s; the chain's kernels alone, lane-decode \
             blocks {}",
            (plan.output().len * 2) as f64 / 1e6,
            reused * 1e3,
            gbs(reused),
            kernels.join(", ")
        );
    }
}

/// The fixture's K/V (f16, every layer) in device memory, its encode context (the middle
/// level, a profile learned with the fixture's queries) and codec-core's bytes of its four
/// 128-token chunks: what the encode benches encode, `copies` times per plan.
struct EncodeInput<'a> {
    d: &'a kvc_io::Dump,
    ctx: &'a codec_core::ChunkContext<'a>,
    source: Source,
    src_bytes: usize,
    dev_src: &'a CudaSlice<u8>,
    level: u8,
    want: Vec<Vec<u8>>,
}

impl EncodeInput<'_> {
    /// A plan of `copies` times the fixture's chunks.
    fn plan(&self, copies: usize) -> codec_cuda::encode_plan::EncodePlan<'_, '_> {
        support::encode_plan(self.ctx, self.source, self.level, copies).0
    }

    /// Whether `got` are codec-core's chunks, the fixture's over and over.
    fn is_codec_cores(&self, got: &[Vec<u8>]) -> bool {
        let n = self.want.len();
        got.iter().enumerate().all(|(i, c)| *c == self.want[i % n])
    }
}

/// The encode benches: `copies` times the fixture's chunks at `level` per plan, then a batch
/// 4x as large.
fn bench_encode_chain(
    gpu: &mut Gpu,
    d: &kvc_io::Dump,
    level: u8,
    (rounds, copies): (usize, usize),
) {
    let profile = support::profile_with_queries(d);
    let ctx = support::encode_context(d, &profile);
    let (src, source) = Source::of_view(&d.kv.view());
    let dev_src = gpu.upload(&src).expect("upload");
    let (_, chunks) = support::encode_plan(&ctx, source, level, 1);
    let want = (chunks.iter())
        .map(|r| {
            ctx.encode_chunk(&d.kv.view(), r.clone(), level)
                .expect("codec-core")
        })
        .collect();
    let input = EncodeInput {
        d,
        ctx: &ctx,
        source,
        src_bytes: src.len(),
        dev_src: &dev_src,
        level,
        want,
    };
    bench_encode_whole(gpu, &input, (rounds, copies));
    bench_encode_scaling(gpu, &input, (rounds, 4 * copies));
}

/// The encode chain from device memory: the whole `Gpu::encode` (inputs packed and uploaded,
/// five launches, sealed chunks copied back), handed over, a plan uploaded once, its launches
/// alone, and in pieces of 960 to 120 blocks.
fn bench_encode_whole(gpu: &mut Gpu, input: &EncodeInput<'_>, (rounds, copies): (usize, usize)) {
    let (level, dev_src) = (input.level, input.dev_src);
    let plan = input.plan(copies);
    let got = gpu.encode(&plan, dev_src).expect("encode");
    assert!(input.is_codec_cores(&got), "not codec-core's bytes");
    let t = gpu.time_encode(&plan, dev_src, rounds).expect("timed");
    let in_bytes = (copies * input.src_bytes) as f64;
    let out_bytes: usize = got.iter().map(Vec::len).sum();
    println!(
        "encode chain level {level}: {:.1} MB of f16 input from device memory to {:.1} MB of \
         chunks (codec-core's bytes): whole Gpu::encode {:.3} ms = {:.2} GB/s (the chunks \
         handed over in pinned memory, Gpu::encode_with: {:.3} ms = {:.2} GB/s); a plan \
         uploaded once (Gpu::encode_uploaded) {:.3} ms = {:.2} GB/s; five launches alone \
         {:.3} ms = {:.2} GB/s (each alone: blocks {:.3}, lane encode {:.3}, blocks placed \
         {:.3}, blocks written {:.3}, sealed {:.3} ms); steps alone: chain built {:.3} ms, inputs uploaded {:.3} ms, \
         sealed chunks copied back {:.3} ms (handed over in pinned memory instead of copied \
         into vectors: {:.3} ms)",
        in_bytes / 1e6,
        out_bytes as f64 / 1e6,
        t.whole * 1e3,
        in_bytes / t.whole / 1e9,
        t.handed_over * 1e3,
        in_bytes / t.handed_over / 1e9,
        t.uploaded * 1e3,
        in_bytes / t.uploaded / 1e9,
        t.launches * 1e3,
        in_bytes / t.launches / 1e9,
        t.stages[0] * 1e3,
        t.stages[1] * 1e3,
        t.stages[2] * 1e3,
        t.stages[3] * 1e3,
        t.stages[4] * 1e3,
        t.chain * 1e3,
        t.upload * 1e3,
        t.copy_back * 1e3,
        t.read_back * 1e3,
    );
    let mut pieces = Vec::new();
    for piece_blocks in [960, 480, 240, 120] {
        gpu.set_encode_piece_blocks(piece_blocks);
        let (t, got_pieces) = best_of(rounds, || gpu.encode(&plan, dev_src).expect("pieces"));
        assert!(
            got_pieces == got,
            "{piece_blocks} blocks a piece: not the whole encode's"
        );
        pieces.push(format!(
            "{piece_blocks}: {:.3} ms = {:.2} GB/s",
            t * 1e3,
            in_bytes / t / 1e9
        ));
    }
    gpu.set_encode_piece_blocks(codec_cuda::DEFAULT_ENCODE_PIECE_BLOCKS);
    println!(
        "encode chain level {level} in pieces (Gpu::set_encode_piece_blocks, of {} blocks), \
         blocks a piece: {}",
        plan.chunks() * 2 * input.d.kv.shape.layers as usize,
        pieces.join(", ")
    );
}

/// The encode chain of a larger batch (`copies` times the fixture's four chunks): whole,
/// handed over, and in pieces of 1920 and 3840 blocks, every chunk codec-core's.
fn bench_encode_scaling(gpu: &mut Gpu, input: &EncodeInput<'_>, (rounds, copies): (usize, usize)) {
    let plan = input.plan(copies);
    let in_bytes = (copies * input.src_bytes) as f64;
    let rate = |t: f64| format!("{:.3} ms = {:.2} GB/s", t * 1e3, in_bytes / t / 1e9);
    let mut lines = Vec::new();
    for piece_blocks in [0, 1920, 3840] {
        gpu.set_encode_piece_blocks(piece_blocks);
        let (t, got) = best_of(rounds, || gpu.encode(&plan, input.dev_src).expect("encode"));
        assert!(
            input.is_codec_cores(&got),
            "{piece_blocks} blocks a piece: not codec-core's"
        );
        lines.push(format!("{piece_blocks} blocks a piece {}", rate(t)));
    }
    gpu.set_encode_piece_blocks(codec_cuda::DEFAULT_ENCODE_PIECE_BLOCKS);
    let handed = || {
        gpu.encode_with(&plan, input.dev_src, |_| ())
            .expect("encode")
    };
    let (t, ()) = best_of(rounds, handed);
    println!(
        "encode scaling level {}, {copies} copies ({:.1} MB of f16 input, {} blocks): \
         Gpu::encode {}; Gpu::encode_with (handed over) {}",
        input.level,
        in_bytes / 1e6,
        plan.chunks() * 2 * input.d.kv.shape.layers as usize,
        lines.join(", "),
        rate(t)
    );
}
