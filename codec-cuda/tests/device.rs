//! The kernels on a device, checked as the host runs are: the golden streams and the real
//! fixture decoded by `Gpu::decode` (f16 and bf16, dense and paged) to codec-core's bits,
//! corrupted lanes and block headers giving the same statuses and symbols as the host-run
//! kernels, the fuzz seeds (intact and damaged) decoded or rejected as codec-core does, streams
//! decoded from page-locked memory (`Gpu::decode_from`), and PQ selections equal to pq-core's.
//!
//! Where `Gpu::new(0)` fails (no driver, no device) or NVRTC is missing, each test prints that
//! it skips and why; with `KVC_REQUIRE_GPU=1` that is a failure instead. NVRTC is loaded from
//! `KVC_NVRTC_LIB`, else from `target/nvrtc/13.5.37/lib` (`tools/fetch-nvrtc`), else by name.

mod common;
// The fuzz corpora's listing (`replay::inputs`); its replay itself is not used here.
#[allow(dead_code)]
#[path = "../../fuzz/replay.rs"]
mod replay;

use std::path::{Path, PathBuf};

use codec_core::{ChunkContext, Limits, Profile, Stream};
use codec_cuda::decode::DecodePlan;
use codec_cuda::encode_plan::{EncodePlan, Source};
use codec_cuda::fuzzing::{
    chain_seed_variants, decode_chain_on, scatter, DecodePath, CHAIN_OUTPUTS,
};
use codec_cuda::pq::{PqBatch, PqStatus};
use codec_cuda::quant::{ChannelConsts, DequantBatch, DequantInput, OutDtype, OutLayout, Output};
use codec_cuda::stream::{ChunkLanes, Destination};
use codec_cuda::{CudaError, Gpu, HostBuffer};
use common::{codec_core_tensors, encode_case, golden, permutation};
use pq_core::{group_score_table, pack, search, Codebook, Method, PqParams};

/// Device 0 with the kernels loaded, or `None` after printing why the test skips (a panic under
/// `KVC_REQUIRE_GPU=1`).
fn gpu(test: &str) -> Option<Gpu> {
    let require = std::env::var("KVC_REQUIRE_GPU").as_deref() == Ok("1");
    let skip = |why: String| {
        assert!(!require, "KVC_REQUIRE_GPU=1 but {test} cannot run: {why}");
        println!("{test}: skipped: {why}");
    };
    let gpu = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            skip(format!("no GPU ({e})"));
            return None;
        }
    };
    let fetched = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nvrtc/13.5.37/lib");
    let dir: Option<PathBuf> = match std::env::var_os("KVC_NVRTC_LIB") {
        Some(d) => Some(PathBuf::from(d)),
        None => fetched.join("libnvrtc.so.13").is_file().then_some(fetched),
    };
    if let Err(e) = gpu.load_kernels(dir.as_deref()) {
        skip(format!(
            "the kernels could not be loaded on {} ({e})",
            gpu.arch()
        ));
        return None;
    }
    println!("{test}: device {} ({})", gpu.ordinal(), gpu.arch());
    Some(gpu)
}

/// Every golden stream, then the real fixture's (4 layers, its profile embedded).
fn golden_and_fixture() -> Vec<(String, Vec<u8>, Option<Profile>)> {
    let mut streams = golden();
    streams.push(("fixture".into(), common::fixture_stream(4).0, None));
    streams
}

#[test]
fn device_golden_streams_decode_as_codec_core() {
    let Some(gpu) = gpu("device_golden_streams_decode_as_codec_core") else {
        return;
    };
    for (name, bytes, profile) in golden() {
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let h = stream.header();
        let (tokens, c) = (h.shape.tokens as usize, h.shape.channels());
        let layers = h.shape.layers as usize;
        for dtype in [OutDtype::F16, OutDtype::Bf16] {
            let tensors = codec_core_tensors(&stream, dtype);
            // Dense.
            let plan = DecodePlan::for_stream(&stream, dtype).unwrap();
            assert!(
                gpu.decode(&plan).unwrap() == tensors.concat(),
                "{name} {dtype:?}"
            );
            // Pages of 16, shuffled.
            let page_size = 16;
            let used = tokens.div_ceil(page_size);
            let table = permutation(used + 2, 3)[..used].to_vec();
            let tensor_len = (used + 2) * page_size * c;
            let output = Output {
                dtype,
                layout: OutLayout::Paged {
                    page_size: page_size as u32,
                },
                len: 2 * layers * tensor_len,
            };
            let mut plan = DecodePlan::new(h.shape.kv_heads, h.shape.head_dim, output);
            let page_start = plan.add_page_table(&table);
            let dest = Destination {
                base: 0,
                tensor_stride: tensor_len as u64,
                page_start,
            };
            plan.add_stream(&stream, dest).unwrap();
            let mut want = vec![0u16; output.len];
            scatter(&mut want, &tensors, &table, page_size, c, tensor_len);
            assert!(gpu.decode(&plan).unwrap() == want, "{name} {dtype:?} paged");
        }
    }
}

/// The fuzz seeds of `decode_chain` (`decode_stream_profile`'s: valid streams of every kind the
/// seed generator makes: f32 and bf16 sources, groups, sink rows, step exponents, every level,
/// no tokens), each with five outputs and damaged (`chain_seed_variants`): `Gpu::decode` decodes
/// exactly the streams codec-core decodes, with its bits, and rejects the others with a typed
/// error (`decode_chain_on`, the fuzz harness with the device as its path), with packed and
/// with compact tables, and with the fused chain.
#[test]
fn device_decodes_the_fuzz_seeds_as_codec_core() {
    let Some(gpu) = gpu("device_decodes_the_fuzz_seeds_as_codec_core") else {
        return;
    };
    // The seeds' own directory (`seeds/decode_chain` links to it).
    let dir = replay::fuzz_dir().join("seeds/decode_stream_profile");
    let seeds = replay::inputs(&dir);
    assert!(
        seeds.len() >= 10,
        "{} seeds in {}",
        seeds.len(),
        dir.display()
    );
    let device = |p: &DecodePlan<'_>, _: &[u8]| gpu.decode(p);
    let mut compact = gpu.fork().unwrap();
    compact.set_lane_tables_compact(true);
    let device_compact = |p: &DecodePlan<'_>, _: &[u8]| compact.decode(p);
    let mut fused = gpu.fork().unwrap();
    fused.set_decode_chain_fused(true);
    let device_fused = |p: &DecodePlan<'_>, _: &[u8]| fused.decode(p);
    let paths: [DecodePath<'_>; 3] = [
        ("device", &device),
        ("device, compact tables", &device_compact),
        ("device, fused chain", &device_fused),
    ];
    let (mut ran, mut decoded) = (0, 0);
    for seed in &seeds {
        let data = std::fs::read(seed).unwrap();
        for v in chain_seed_variants(&data, 16) {
            ran += 1;
            decoded += usize::from(decode_chain_on(&v, &paths));
        }
    }
    assert!(
        decoded >= seeds.len() * CHAIN_OUTPUTS.len() && decoded < ran,
        "{decoded} of {ran}"
    );
    println!("{decoded} of {ran} seed variants decoded, as codec-core's");
}

/// Every chunk's two lane-decode launches, intact and with words flipped, dropped or zeroed:
/// the device gives the host-run kernel's statuses and symbols (which the host tests compare
/// with codec-core's).
#[test]
fn device_lane_decode_matches_the_host_run_kernel() {
    let Some(gpu) = gpu("device_lane_decode_matches_the_host_run_kernel") else {
        return;
    };
    let mut batches = 0;
    for (name, bytes, profile) in golden() {
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        for chunk in 0..stream.header().chunks.len() {
            let lanes = ChunkLanes::read(&stream, chunk).unwrap();
            let exp_batch = lanes.exponent_batch().unwrap();
            let host_exp = exp_batch.decode_host(2).unwrap();
            let exps: Vec<&[u8]> = (0..lanes.blocks.len())
                .map(|b| host_exp.symbols(b))
                .collect();
            let sym_batch = lanes.symbol_batch(&exps).unwrap();
            for (i, mut batch) in [exp_batch, sym_batch].into_iter().enumerate() {
                for corruption in 0..4u32 {
                    let words = batch.words_mut();
                    let n = words.len();
                    if n > 0 {
                        match corruption {
                            1 => words[n / 2] ^= 0x0001_0000,
                            2 => words[n - 1] = 0,
                            3 => words[0] = words[0].rotate_left(7),
                            _ => {}
                        }
                    }
                    let host = batch.decode_host(2).unwrap();
                    let dev = gpu.lane_decode(&batch).unwrap();
                    for b in 0..lanes.blocks.len() {
                        let at = format!("{name} chunk {chunk} launch {i} corruption {corruption}");
                        assert_eq!(dev.status(b), host.status(b), "{at} block {b}");
                        assert!(dev.symbols(b) == host.symbols(b), "{at} block {b}");
                    }
                    batches += 1;
                }
            }
        }
    }
    println!("{batches} launches compared");
}

/// Arbitrary dequantization block headers: the device's statuses and output are the host's.
/// One block per launch: two blocks whose rows overlap would race on the device.
#[test]
fn device_dequant_headers_match_the_host_run_kernel() {
    let Some(gpu) = gpu("device_dequant_headers_match_the_host_run_kernel") else {
        return;
    };
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for case in 0..200 {
        let consts = vec![
            ChannelConsts {
                mean: 1.0,
                anchor_step: 0.5,
                delta_step: 0.25,
                weight: 0.5
            };
            4
        ];
        let dtype = if case % 2 == 0 {
            OutDtype::F16
        } else {
            OutDtype::Bf16
        };
        let layout = if case % 3 == 0 {
            OutLayout::Dense
        } else {
            OutLayout::Paged { page_size: 2 }
        };
        let output = Output {
            dtype,
            layout,
            len: 40,
        };
        let mut batch = DequantBatch::with_output(2, 2, output);
        let consts_start = batch.add_consts(&consts);
        let page_start = batch.add_page_table(&[4, 1, 0, 7, 3]);
        let input = DequantInput {
            q: &[1; 16],
            exps: Some(&[1; 8]),
            sink: &[0.5; 4],
            consts_start,
            rows: 5,
            group: 3,
            out_start: 0,
            token_start: 0,
            page_start,
        };
        batch.add_block(input).unwrap();
        let b = &mut batch.blocks_mut()[0];
        let v = next();
        match case % 11 {
            0 => b.q_start = v % 32,
            1 => b.exp_start = v % 16,
            2 => b.sink_start = v,
            3 => b.out_start = v % 48,
            4 => b.consts_start = v % 8,
            5 => b.rows = (v % 12) as u32,
            6 => b.sink_rows = (v % 8) as u32,
            7 => b.group = (v % 4) as u32,
            8 => b.token_start = (v % 12) as u32,
            9 => b.page_start = v % 8,
            _ => b.has_exps = (v % 2) as u32,
        }
        let host = batch.decode_host().unwrap();
        let dev = gpu.dequant(&batch).unwrap();
        assert_eq!(dev, host, "case {case}");
    }
}

/// The real fixture's PQ selections (layer 0, kvc's residual codes, every stored query head
/// and GQA group, causal) on the device equal pq-core's.
#[test]
fn device_pq_search_selects_what_pq_core_selects() {
    let Some(gpu) = gpu("device_pq_search_selects_what_pq_core_selects") else {
        return;
    };
    let d = kvc_io::load_dump(&kvc_io::fixtures::sample()).expect("fixture present");
    let s = d.kv.shape;
    let (kv_heads, dim, t) = (s.kv_heads as usize, s.head_dim as usize, s.tokens as usize);
    let queries = &d.q.as_ref().expect("the fixture has queries")[0];
    let (q_heads, n_q, q_start) = (d.q_heads, d.n_q(), d.q_start as usize);
    let keys = d.kv.k[0].to_f32_vec();
    for method in [Method::Residual, Method::Product] {
        let mut heads = Vec::new();
        for h in 0..kv_heads {
            let hk: Vec<f32> = (0..t)
                .flat_map(|tok| keys[(tok * kv_heads + h) * dim..][..dim].iter().copied())
                .collect();
            let params = PqParams {
                method,
                seed: PqParams::default().seed ^ h as u64,
                ..PqParams::default()
            };
            let cb = Codebook::train(&hk, dim, &params).unwrap();
            let codes = cb.encode(&hk).unwrap();
            heads.push((cb, codes));
        }
        let mut batch = PqBatch::new(&heads[0].0).unwrap();
        let ids: Vec<_> = heads
            .iter()
            .map(|(cb, c)| batch.add_head(cb, &pack(c, cb.bits()).unwrap(), t).unwrap())
            .collect();
        let mut want = Vec::new();
        let group = q_heads / kv_heads;
        for i in 0..n_q {
            let seen = (q_start + i + 1).min(t);
            let k = seen / 5;
            let row = |qh: usize| &queries[(i * q_heads + qh) * dim..][..dim];
            for qh in 0..q_heads {
                let h = qh / group;
                batch.add_query(ids[h], row(qh), seen, k, 4, 64).unwrap();
                let table = group_score_table(row(qh), &heads[h].0).unwrap();
                let codes = &heads[h].1[..seen * heads[h].0.m()];
                want.push(search(codes, &table, k, 4, 64).unwrap());
            }
        }
        let got = gpu.search(&batch).unwrap();
        let host = batch.search_host().unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_eq!(got.status(i), Some(PqStatus::Ok));
            assert_eq!(got.tokens(i), &w[..], "{method:?} query {i}");
            assert_eq!(host.tokens(i), &w[..]);
        }
    }
}

/// A PQ batch uploaded once (`Gpu::upload_pq`: codes resident), then three decode steps each
/// appending 13 tokens' codes (`Gpu::append_pq`, into the room the head was added with) and
/// searching with new query values (`Gpu::search_uploaded`), selects what the host-run kernel
/// selects for the batch with those tokens and values; values of another length, an append
/// past the room, and a search or an append through another `Gpu` are refused.
#[test]
fn device_pq_resident_codes_select_as_the_host() {
    let Some(gpu) = gpu("device_pq_resident_codes_select_as_the_host") else {
        return;
    };
    let dim = 16;
    let cw: Vec<f32> = (0..2 * 64 * dim)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let cb = Codebook::from_parts(Method::Residual, dim, 2, 6, 1, cw).unwrap();
    let (tokens, room) = (3000, 40);
    let codes: Vec<u16> = (0..2 * (tokens + room))
        .map(|i| (i * 13 % 64) as u16)
        .collect();
    let mut batch = PqBatch::new(&cb).unwrap();
    let packed = pack(&codes[..2 * tokens], 6).unwrap();
    let head = batch
        .add_head_with_room(&cb, &packed, tokens, room)
        .unwrap();
    let step_values = |step: usize| -> Vec<f32> {
        (0..40 * dim)
            .map(|i| (((i * 7 + step * 11) % 23) as f32 - 11.0) / 5.0)
            .collect()
    };
    for q in 0..40 {
        let seen = tokens - 60 * q;
        let v = &step_values(0)[q * dim..][..dim];
        batch.add_query(head, v, seen, seen / 8, 4, 32).unwrap();
    }
    let mut up = gpu.upload_pq(&batch).unwrap();
    assert_eq!(up.query_values(), 40 * dim);
    for step in 1..4 {
        // A decode step: 13 new tokens' codes (straddling bytes), then the queries.
        let new = &codes[2 * (tokens + 13 * (step - 1))..][..2 * 13];
        gpu.append_pq(&mut up, head, new).unwrap();
        batch.append_tokens(head, new).unwrap();
        let values = step_values(step);
        let got = gpu.search_uploaded(&mut up, &values).unwrap();
        batch.set_query_values(&values).unwrap();
        let want = batch.search_host().unwrap();
        for i in 0..batch.len() {
            assert_eq!(got.status(i), Some(PqStatus::Ok), "step {step} query {i}");
            assert_eq!(got.tokens(i), want.tokens(i), "step {step} query {i}");
        }
    }
    let refused = |r: Result<_, CudaError>| matches!(r, Err(CudaError::Input { .. }));
    assert!(refused(gpu.search_uploaded(&mut up, &step_values(1)[1..])));
    let other = Gpu::new(0).unwrap();
    assert!(refused(other.search_uploaded(&mut up, &step_values(1))));
    let append_refused = |r: Result<(), CudaError>| matches!(r, Err(CudaError::Input { .. }));
    assert!(append_refused(other.append_pq(&mut up, head, &codes[..2])));
    assert!(append_refused(gpu.append_pq(&mut up, head, &codes[..4])));
}

/// Long contexts (1024 threads per block, ranking keys in shared memory above the default 48 KiB
/// or in device memory): the device selects what pq-core selects, either way.
#[test]
fn device_pq_long_contexts_select_what_pq_core_selects() {
    let Some(mut gpu) = gpu("device_pq_long_contexts_select_what_pq_core_selects") else {
        return;
    };
    let (m, bits, d, tokens) = (2usize, 6u8, 8usize, 20_000usize);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) as f32 / (1u64 << 31) as f32 - 0.5
    };
    let cw: Vec<f32> = (0..m * 64 * (d / m)).map(|_| next()).collect();
    let cb = Codebook::from_parts(Method::Product, d, m, bits, 1, cw).unwrap();
    let codes: Vec<u16> = (0..tokens * m)
        .map(|_| ((next() + 0.5) * 64.0) as u16 % 64)
        .collect();
    let mut batch = PqBatch::new(&cb).unwrap();
    let head = batch
        .add_head(&cb, &pack(&codes, bits).unwrap(), tokens)
        .unwrap();
    let mut want = Vec::new();
    for (i, seen) in [tokens, tokens - 1, 15_000, 5_000].into_iter().enumerate() {
        let q: Vec<f32> = (0..d).map(|_| next()).collect();
        let k = seen / (2 + i);
        batch.add_query(head, &q, seen, k, 4, 64).unwrap();
        let table = group_score_table(&q, &cb).unwrap();
        want.push(search(&codes[..seen * m], &table, k, 4, 64).unwrap());
    }
    for shared_keys in [u32::MAX, 0] {
        gpu.set_pq_shared_keys(shared_keys);
        let got = gpu.search(&batch).unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_eq!(got.status(i), Some(PqStatus::Ok));
            assert_eq!(got.tokens(i), &w[..], "query {i} keeping {shared_keys}");
        }
    }
}

/// The encode kernels on the device: every block of a stream codec-core encoded from the real
/// fixture (3 layers, step exponents) re-quantized and re-encoded to the stream's symbol values
/// and lane words, as on the host.
#[test]
fn device_encode_reproduces_codec_cores_blocks() {
    let Some(gpu) = gpu("device_encode_reproduces_codec_cores_blocks") else {
        return;
    };
    let (bytes, tensors) = common::fixture_stream(3);
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let case = encode_case(&stream, &tensors, 1);
    let values = gpu.quantize(&case.quant).unwrap();
    let lanes = gpu.lane_encode(&case.enc).unwrap();
    for (b, want) in case.values.iter().enumerate() {
        assert!(&values[b].0 == want, "block {b}: symbol values");
        assert!(
            lanes.lanes(b).unwrap().to_vec() == case.lanes[b],
            "block {b}: lanes"
        );
    }
    println!("{} blocks re-encoded on the device", case.values.len());
}

/// The encode chain on the device (`Gpu::encode`: five launches from K/V in device memory):
/// the real fixture (3 layers, f16, step exponents) in 96-token chunks at three levels and odd
/// ranges, every chunk byte for byte codec-core's and the host-run chain's; a source buffer
/// shorter than the plan's tensors is refused; an uploaded plan encodes again and again, and
/// hands the same chunks over where they lie (`Gpu::encode_uploaded_with`).
#[test]
fn device_encode_plan_writes_codec_cores_chunks() {
    let Some(gpu) = gpu("device_encode_plan_writes_codec_cores_chunks") else {
        return;
    };
    let (cache, profile) = common::fixture_cache(3);
    let ctx = common::fixture_context(&cache, &profile);
    let (src, source) = common::source_of(&cache);
    let chunks = common::fixture_chunks(&profile, cache.shape.tokens);
    let plan = plan_of(&ctx, source, &chunks, 1);
    let dev_src = gpu.upload(&src).unwrap();
    let got = gpu.encode(&plan, &dev_src).unwrap();
    assert!(
        got == plan.encode_host(&src).unwrap(),
        "the host-run chain differs"
    );
    for (i, &(start, end, level)) in chunks.iter().enumerate() {
        let want = ctx.encode_chunk(&cache.view(), start..end, level).unwrap();
        assert!(got[i] == want, "chunk {i} ({start}..{end}, level {level})");
    }
    let short = gpu.upload(&src[..src.len() - 2]).unwrap();
    assert!(matches!(
        gpu.encode(&plan, &short),
        Err(codec_cuda::CudaError::Input { .. })
    ));
    // The plan uploaded once encodes the same source again, then another of its layout (the
    // tokens reversed) to codec-core's chunks of that one: nothing of an earlier encode is
    // left in the scratch. Through another `Gpu` it is refused.
    let mut up = gpu.upload_encode_plan(&plan).unwrap();
    assert!(gpu.encode_uploaded(&mut up, &dev_src).unwrap() == got);
    // The chunks handed over where they lie in pinned memory are the same bytes.
    let read = |chunks: &[&[u8]]| {
        chunks.iter().zip(&got).all(|(c, g)| c == g) && chunks.len() == got.len()
    };
    assert!(gpu.encode_uploaded_with(&mut up, &dev_src, read).unwrap());
    let reversed = common::tokens_reversed(&cache);
    let dev_reversed = gpu.upload(&common::source_of(&reversed).0).unwrap();
    let again = gpu.encode_uploaded(&mut up, &dev_reversed).unwrap();
    for (i, &(start, end, level)) in chunks.iter().enumerate() {
        let want = ctx
            .encode_chunk(&reversed.view(), start..end, level)
            .unwrap();
        assert!(
            again[i] == want,
            "reversed: chunk {i} ({start}..{end}, level {level})"
        );
    }
    assert!(again != got);
    let other = Gpu::new(0).unwrap();
    assert!(matches!(
        other.encode_uploaded(&mut up, &dev_src),
        Err(codec_cuda::CudaError::Input { .. })
    ));
    println!(
        "{} chunks encoded on the device, twice from one upload",
        got.len()
    );
}

/// An encode plan of `ctx`'s `chunks` (`(start, end, level)`), `copies` times over.
fn plan_of<'c, 'p>(
    ctx: &'c ChunkContext<'p>,
    source: Source,
    chunks: &[(u32, u32, u8)],
    copies: usize,
) -> EncodePlan<'c, 'p> {
    let mut plan = EncodePlan::new(ctx, source).unwrap();
    for _ in 0..copies {
        for &(start, end, level) in chunks {
            plan.add_chunk(start..end, level).unwrap();
        }
    }
    plan
}

/// The encode chain in pieces (`Gpu::set_encode_piece_blocks`: runs of whole chunks, each
/// piece's chunks copied back on a copy stream beside the next piece's launches) writes the
/// host-run chain's chunks for every piece size, twice in a row (the scratch of an earlier
/// piece left as it was), and refuses a short source as a whole encode; `Gpu::encode_with`
/// hands the same chunks over.
#[test]
fn device_encodes_in_pieces_as_whole() {
    let Some(mut gpu) = gpu("device_encodes_in_pieces_as_whole") else {
        return;
    };
    let (cache, profile) = common::fixture_cache(3);
    let ctx = common::fixture_context(&cache, &profile);
    let (src, source) = common::source_of(&cache);
    let chunks = common::fixture_chunks(&profile, cache.shape.tokens);
    let plan = plan_of(&ctx, source, &chunks, 3);
    let want = plan.encode_host(&src).unwrap();
    let dev_src = gpu.upload(&src).unwrap();
    let short = gpu.upload(&src[..src.len() - 2]).unwrap();
    // 3 layers' K and V: 6 blocks a chunk.
    for piece_blocks in [0, 1, 6, 12, 20, 6 * plan.chunks() - 1, 100_000] {
        gpu.set_encode_piece_blocks(piece_blocks);
        for round in 0..2 {
            let got = gpu.encode(&plan, &dev_src).unwrap();
            assert!(got == want, "{piece_blocks} blocks a piece, round {round}");
        }
        assert!(matches!(
            gpu.encode(&plan, &short),
            Err(codec_cuda::CudaError::Input { .. })
        ));
    }
    // Handed over in pinned memory: the same bytes, the short source refused, and the next
    // call whole again.
    let handed = gpu.encode_with(&plan, &dev_src, |c| c.concat()).unwrap();
    assert!(handed == want.concat(), "encode_with's chunks");
    assert!(matches!(
        gpu.encode_with(&plan, &short, |c| c.len()),
        Err(codec_cuda::CudaError::Input { .. })
    ));
    assert!(
        gpu.encode(&plan, &dev_src).unwrap() == want,
        "after a refusal"
    );
    println!("{} chunks encoded in pieces of 1 to all", want.len());
}

/// A plan uploaded once (`Gpu::upload_plan`: one packed copy from pinned memory) decodes to
/// codec-core's bits every time it is run, into a fresh buffer or over the last output, in the
/// chain it was uploaded for (fused or five launches) after `Gpu::set_decode_chain_fused`
/// has switched to the other; a plan uploaded through another `Gpu` is refused.
#[test]
fn device_uploaded_plan_decodes_again_and_again() {
    let Some(mut gpu) = gpu("device_uploaded_plan_decodes_again_and_again") else {
        return;
    };
    for (name, bytes, profile) in golden() {
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let want = codec_core_tensors(&stream, OutDtype::Bf16).concat();
        let plan = DecodePlan::for_stream(&stream, OutDtype::Bf16).unwrap();
        for fused in [true, false] {
            gpu.set_decode_chain_fused(fused);
            let up = gpu.upload_plan(&plan).unwrap();
            gpu.set_decode_chain_fused(!fused);
            let mut out = gpu.stream().alloc_zeros::<u16>(want.len().max(1)).unwrap();
            for round in 0..3 {
                gpu.decode_uploaded_into(&up, &mut out).unwrap();
                let mut got = gpu.stream().clone_dtoh(&out).unwrap();
                got.truncate(want.len());
                assert!(got == want, "{name} round {round}, uploaded fused: {fused}");
            }
        }
    }
    gpu.set_decode_chain_fused(false);
    let other = Gpu::new(0).unwrap();
    let (_, bytes, profile) = golden().swap_remove(0);
    let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
    let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
    let up = gpu.upload_plan(&plan).unwrap();
    let mut out = other
        .stream()
        .alloc_zeros::<u16>(plan.output().len)
        .unwrap();
    assert!(other.decode_uploaded_into(&up, &mut out).is_err());
}

/// With compact tables (`Gpu::set_lane_tables_compact`: each table expanded on the device into
/// 2 KiB, read through the cache), every golden stream and the real fixture with step
/// exponents decode to codec-core's bits: fused and in five launches, whole and in pieces, and
/// a plan uploaded with compact tables decodes so after the setting is switched off.
#[test]
fn device_compact_tables_decode_as_codec_core() {
    let Some(mut gpu) = gpu("device_compact_tables_decode_as_codec_core") else {
        return;
    };
    gpu.set_lane_tables_compact(true);
    for (name, bytes, profile) in golden_and_fixture() {
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let want = codec_core_tensors(&stream, OutDtype::F16).concat();
        let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
        let mut out = gpu.stream().alloc_zeros::<u16>(want.len().max(1)).unwrap();
        for (fused, pieces) in [(true, 0), (false, 0), (true, 16)] {
            gpu.set_decode_chain_fused(fused);
            gpu.set_decode_piece_blocks(pieces);
            gpu.stream().memset_zeros(&mut out).unwrap();
            gpu.decode_into(&plan, &mut out).unwrap();
            let mut got = gpu.stream().clone_dtoh(&out).unwrap();
            got.truncate(want.len());
            assert!(got == want, "{name}, fused {fused}, pieces of {pieces}");
        }
        gpu.set_decode_chain_fused(false);
        gpu.set_decode_piece_blocks(0);
        let up = gpu.upload_plan(&plan).unwrap();
        gpu.set_lane_tables_compact(false);
        gpu.decode_uploaded_into(&up, &mut out).unwrap();
        let mut got = gpu.stream().clone_dtoh(&out).unwrap();
        got.truncate(want.len());
        assert!(got == want, "{name}, uploaded with compact tables");
        gpu.set_lane_tables_compact(true);
    }
}

/// Handles forked from one `Gpu` (`Gpu::fork`: a stream, staging and scratch each) decode on
/// four host threads at once, three rounds of every golden stream and the real fixture (4
/// layers, decoded in three pieces), each from a page-locked buffer of the handle's own:
/// codec-core's bits. A plan
/// uploaded through a fork is not decoded through the handle it was forked from.
#[test]
fn device_forked_handles_decode_on_threads_as_codec_core() {
    let Some(mut gpu) = gpu("device_forked_handles_decode_on_threads_as_codec_core") else {
        return;
    };
    // The fixture's stream (48 coded blocks) in three pieces on every fork at once.
    gpu.set_decode_piece_blocks(16);
    let mut streams = golden_and_fixture();
    let want: Vec<Vec<u16>> = streams
        .iter()
        .map(|(_, bytes, profile)| {
            let stream = Stream::open(bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
            codec_core_tensors(&stream, OutDtype::F16).concat()
        })
        .collect();
    let forks: Vec<Gpu> = (0..4).map(|_| gpu.fork().unwrap()).collect();
    std::thread::scope(|s| {
        for (t, fork) in forks.iter().enumerate() {
            let (streams, want) = (&streams, &want);
            s.spawn(move || {
                for round in 0..3 {
                    for ((name, bytes, profile), want) in streams.iter().zip(want) {
                        let mut host = fork.host_buffer(bytes.len()).unwrap();
                        host.as_mut_slice().unwrap().copy_from_slice(bytes);
                        let raw = host.as_slice().unwrap();
                        let limits = Limits::DEFAULT;
                        let stream = Stream::open(raw, profile.as_ref(), &limits).unwrap();
                        let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
                        let got = fork.decode_vec_from(&plan, &host).unwrap();
                        assert!(&got == want, "{name}: thread {t}, round {round}");
                    }
                }
            });
        }
    });
    let (_, bytes, profile) = streams.swap_remove(0);
    let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
    let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
    let up = forks[0].upload_plan(&plan).unwrap();
    let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len).unwrap();
    assert!(gpu.decode_uploaded_into(&up, &mut out).is_err());
}

/// Streams received into page-locked memory (`Gpu::host_buffer`) decode from it
/// (`Gpu::decode_from`: the bytes copied to the device as they are, the lane words gathered
/// there) to codec-core's bits: every golden stream and the real fixture (4 layers) at every
/// byte offset mod 4, dense bf16, an uploaded plan decoded twice; and the decode seeds that
/// decode, f16 (intact and damaged: the host-run chain's verdict and bits, which the fuzz
/// target holds to codec-core's). A plan whose lane words lie outside the buffer is an input
/// error, as on the host.
/// Chunk CRCs checked on the device (`kvc_check_chunks`, `DecodePlan::set_crc_at_decode`):
/// every golden stream and the fixture, at four byte offsets of page-locked memory, decode
/// to codec-core's bits; with each chunk's stored CRC altered in turn, the upload is refused
/// naming that chunk, as the host-run check refuses it.
#[test]
fn device_checks_chunk_crcs_at_decode() {
    let Some(gpu) = gpu("device_checks_chunk_crcs_at_decode") else {
        return;
    };
    let mut refused = 0;
    for (name, bytes, profile) in &golden_and_fixture() {
        let mut host = gpu.host_buffer(bytes.len() + 3).unwrap();
        for at in 0..4 {
            host.as_mut_slice().unwrap()[at..at + bytes.len()].copy_from_slice(bytes);
            let raw = &host.as_slice().unwrap()[at..at + bytes.len()];
            let stream = Stream::open(raw, profile.as_ref(), &Limits::DEFAULT).unwrap();
            let want = codec_core_tensors(&stream, OutDtype::F16).concat();
            let plan = DecodePlan::for_stream_with(&stream, OutDtype::F16, true).unwrap();
            let mut got = gpu.decode_vec_from(&plan, &host).unwrap();
            got.truncate(want.len());
            assert!(got == want, "{name} at {at}");
            let ends: Vec<usize> = (0..stream.header().chunks.len())
                .map(|c| {
                    let chunk = stream.chunk_bytes(c).unwrap();
                    chunk.as_ptr() as usize - raw.as_ptr() as usize + at + chunk.len()
                })
                .collect();
            drop(plan);
            drop(stream);
            for (c, end) in ends.into_iter().enumerate() {
                host.as_mut_slice().unwrap()[end - 1] ^= 0x40;
                let raw = &host.as_slice().unwrap()[at..at + bytes.len()];
                let stream = Stream::open(raw, profile.as_ref(), &Limits::DEFAULT).unwrap();
                let plan = DecodePlan::for_stream_with(&stream, OutDtype::F16, true).unwrap();
                let on_host = plan.decode_chain_host_from(host.as_slice().unwrap());
                let on_device = gpu.upload_plan_from(&plan, &host).map(drop);
                assert_eq!(on_device, on_host.map(drop), "{name} at {at}, chunk {c}");
                let named = matches!(on_device, Err(CudaError::Stream { chunk, .. }) if chunk == c);
                assert!(named, "{name} at {at}, chunk {c}: {on_device:?}");
                refused += 1;
                drop(plan);
                drop(stream);
                host.as_mut_slice().unwrap()[end - 1] ^= 0x40;
            }
        }
    }
    assert!(
        refused >= 4 * 4,
        "refused {refused}: the fixture's chunks at every offset"
    );
}

#[test]
fn device_decodes_streams_in_page_locked_memory() {
    let Some(gpu) = gpu("device_decodes_streams_in_page_locked_memory") else {
        return;
    };
    let streams = golden_and_fixture();
    let mut refused = 0;
    for (name, bytes, profile) in &streams {
        let mut host = gpu.host_buffer(bytes.len() + 3).unwrap();
        for at in 0..4 {
            host.as_mut_slice().unwrap()[at..at + bytes.len()].copy_from_slice(bytes);
            let raw = &host.as_slice().unwrap()[at..at + bytes.len()];
            let stream = Stream::open(raw, profile.as_ref(), &Limits::DEFAULT).unwrap();
            let want = codec_core_tensors(&stream, OutDtype::Bf16).concat();
            let plan = DecodePlan::for_stream(&stream, OutDtype::Bf16).unwrap();
            let up = gpu.upload_plan_from(&plan, &host).unwrap();
            let mut out = gpu.stream().alloc_zeros::<u16>(want.len().max(1)).unwrap();
            for round in 0..2 {
                gpu.decode_uploaded_into(&up, &mut out).unwrap();
                let mut got = gpu.stream().clone_dtoh(&out).unwrap();
                got.truncate(want.len());
                assert!(got == want, "{name} at {at}, round {round}");
            }
            // Another buffer: an input error, as on the host, for a plan that reads lane words
            // (one whose tokens are all sinks or none reads none, and decodes from any buffer).
            let elsewhere = gpu.host_buffer(bytes.len()).unwrap();
            let on_host = plan.decode_chain_host_from(elsewhere.as_slice().unwrap());
            let on_device = gpu.upload_plan_from(&plan, &elsewhere);
            assert!(on_host.is_ok() == on_device.is_ok(), "{name} at {at}");
            match on_device {
                Ok(_) => {}
                Err(codec_cuda::CudaError::Input { .. }) => refused += 1,
                Err(e) => panic!("{name} at {at}: {e}"),
            }
        }
    }
    assert!(
        refused >= 4,
        "refused {refused}: the fixture at every offset at least"
    );
    let dir = replay::fuzz_dir().join("seeds/decode_stream_profile");
    let (mut ran, mut decoded) = (0, 0);
    for seed in replay::inputs(&dir) {
        for v in chain_seed_variants(&std::fs::read(&seed).unwrap(), 16) {
            let case = codec_core::fuzzing::StreamProfileCase::read(&v);
            let mut host = gpu.host_buffer(case.stream.len().max(1)).unwrap();
            host.as_mut_slice().unwrap()[..case.stream.len()].copy_from_slice(&case.stream);
            let raw = &host.as_slice().unwrap()[..case.stream.len()];
            let limits = codec_core::fuzzing::LIMITS;
            let Ok(stream) = Stream::open(raw, case.profile.as_ref(), &limits) else {
                continue;
            };
            let Ok(plan) = DecodePlan::for_stream(&stream, OutDtype::F16) else {
                continue;
            };
            ran += 1;
            match (plan.decode_chain_host(), gpu.decode_vec_from(&plan, &host)) {
                (Ok(w), Ok(g)) => {
                    assert!(w == g, "{}: the bits differ", seed.display());
                    decoded += 1;
                }
                (Err(_), Err(e)) => assert!(matches!(
                    e,
                    codec_cuda::CudaError::Stream { .. } | codec_cuda::CudaError::Input { .. }
                )),
                (w, g) => panic!(
                    "{}: host {:?}, device {:?}",
                    seed.display(),
                    w.err(),
                    g.err()
                ),
            }
        }
    }
    assert!(decoded >= 10 && decoded < ran, "{decoded} of {ran}");
    println!("{decoded} of {ran} seed variants decoded from page-locked memory");
}

/// Every lane-decode shape (coded blocks per CUDA block, tables each stages in shared memory)
/// decodes the golden streams and the real fixture (4 layers, embedded profile) to
/// codec-core's bits.
#[test]
fn device_lane_shapes_decode_as_codec_core() {
    let Some(mut gpu) = gpu("device_lane_shapes_decode_as_codec_core") else {
        return;
    };
    let streams = golden_and_fixture();
    for (warps, tables) in [(1, 0), (4, 0), (32, 0), (2, 7), (7, 2)] {
        gpu.set_lane_warps(1).unwrap();
        gpu.set_lane_shared_tables(tables).unwrap();
        gpu.set_lane_warps(warps).unwrap();
        for (name, bytes, profile) in &streams {
            let stream = Stream::open(bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
            let want = codec_core_tensors(&stream, OutDtype::F16).concat();
            let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
            let got = gpu.decode(&plan).unwrap();
            assert!(got == want, "{name}: {:?}", gpu.lane_shape());
        }
    }
}

/// The 32-bit-state experiment's kernel on the device: the host-run kernel's symbols and
/// statuses on the fixture's blocks (3 layers, levels 0, 3 and 6), intact (all equal to the v2
/// symbols) and with words altered.
#[test]
fn device_lane32_experiment_matches_the_host_run_kernel() {
    let Some(gpu) = gpu("device_lane32_experiment_matches_the_host_run_kernel") else {
        return;
    };
    let (bytes, _) = common::fixture_stream(3);
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
    let exp = plan.exponent_batch().unwrap().decode_host(2).unwrap();
    let exps = plan.exponents(&exp).unwrap();
    let batch = plan.symbol_batch(&exps).unwrap();
    let sym = batch.decode_host(2).unwrap();
    let mut b32 = codec_cuda::experiment::Lane32Batch::encode(&batch, &sym).unwrap();
    for edit in 0..3 {
        let dev = gpu.lane32_decode_experiment(&b32).unwrap();
        let host = b32.decode_host(2).unwrap();
        for b in 0..batch.blocks().len() {
            assert_eq!(dev.status(b), host.status(b), "edit {edit} block {b}");
            assert_eq!(dev.symbols(b), host.symbols(b), "edit {edit} block {b}");
            if edit == 0 {
                assert_eq!(dev.symbols(b), sym.symbols(b), "block {b}");
            }
        }
        let words = b32.words_mut();
        let n = words.len();
        words[(edit * 7919) % n] ^= 0x5A5A;
    }
}

/// `copies` copies of the fixture's stream (4 layers) in one page-locked buffer, each at an
/// offset of its own (odd and even), from the fourth on 128 KiB of other bytes before each
/// (a decode from the buffer copies those copies' chunks apart), and where each starts.
fn fixture_copies(gpu: &Gpu, copies: usize) -> (HostBuffer, Vec<usize>, usize) {
    let (bytes, _) = common::fixture_stream(4);
    let len = bytes.len();
    let apart = |i: usize| i.saturating_sub(2) * (128 << 10);
    let starts: Vec<usize> = (0..copies)
        .map(|i| i * (len + 1) + i % 2 + apart(i))
        .collect();
    let mut host = gpu
        .host_buffer(copies * (len + 1) + 1 + apart(copies))
        .unwrap();
    for &at in &starts {
        host.as_mut_slice().unwrap()[at..at + len].copy_from_slice(&bytes);
    }
    (host, starts, len)
}

/// The streams at `starts` in `host` decoded into one dense f16 output, each copy a sequence
/// of its own, from page-locked memory and packed: `decode_vec_from` and `decode`.
fn decode_copies(
    gpu: &Gpu,
    host: &HostBuffer,
    (starts, len): (&[usize], usize),
    crc_at_decode: bool,
) -> [Result<Vec<u16>, CudaError>; 2] {
    let raw = host.as_slice().unwrap();
    let open = |&at: &usize| Stream::open(&raw[at..at + len], None, &Limits::DEFAULT).unwrap();
    let streams: Vec<Stream<'_>> = starts.iter().map(open).collect();
    // A damaged chunk's structure is refused as it is added.
    let plan = match common::dense_plan_with(&streams.iter().collect::<Vec<_>>(), crc_at_decode) {
        Ok(plan) => plan,
        Err(e) => return [Err(e.clone()), Err(e)],
    };
    [gpu.decode_vec_from(&plan, host), gpu.decode(&plan)]
}

/// A plan decoded in pieces (`Gpu::set_decode_piece_blocks`: each piece's upload on a copy
/// stream beside the launches of the ones before, pieces on compute streams in turn, each
/// piece's chain built on a thread of its own while the one before is queued) gives the
/// whole plan's bits, from page-locked memory and packed, CRCs checked when added or at
/// decode: five copies of the fixture (4 layers) in pieces of 8 to 1000 blocks, and in
/// pieces growing from 8 to 64, the chain in five launches (the default) or fused
/// (`Gpu::set_decode_chain_fused`), 1 to 8 pieces in flight
/// (`Gpu::set_decode_pieces_in_flight`), each piece's bytes copied before or after its chain
/// is built (`Gpu::set_decode_copy_early`; a plan of one piece through the pieces' path
/// then). With a chunk of the middle copy damaged (a stored CRC altered; a lane word altered
/// under a recomputed CRC), every piece size gives the whole plan's verdict.
#[test]
fn device_decodes_in_pieces_as_whole() {
    let Some(mut gpu) = gpu("device_decodes_in_pieces_as_whole") else {
        return;
    };
    let (mut host, starts, len) = fixture_copies(&gpu, 5);
    let at = (&starts[..], len);
    let (bytes, _) = common::fixture_stream(4);
    let one = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let want = codec_core_tensors(&one, OutDtype::F16).concat().repeat(5);
    for crc_at_decode in [false, true] {
        for (piece_blocks, first, fused, in_flight) in [
            (0, 0, true, 2),
            (0, 0, false, 2),
            (8, 0, true, 2),
            (8, 0, false, 1),
            (8, 0, true, 4),
            (20, 0, false, 2),
            (20, 0, true, 3),
            (64, 0, true, 2),
            (1000, 0, true, 2),
            (64, 8, true, 2),
            (64, 8, false, 2),
            (16, 8, false, 4),
            (8, 0, false, 8),
            (20, 0, true, 6),
        ] {
            gpu.set_decode_piece_blocks(piece_blocks);
            gpu.set_decode_first_piece_blocks(first);
            gpu.set_decode_chain_fused(fused);
            gpu.set_decode_pieces_in_flight(in_flight);
            for early in [false, true] {
                gpu.set_decode_copy_early(early);
                for got in decode_copies(&gpu, &host, at, crc_at_decode) {
                    assert!(
                        got.unwrap() == want,
                        "{piece_blocks} blocks, first {first}, {crc_at_decode}, fused {fused}, \
                         {in_flight} in flight, copied early {early}"
                    );
                }
            }
        }
    }
    gpu.set_decode_copy_early(false);
    gpu.set_decode_first_piece_blocks(0);
    gpu.set_decode_chain_fused(false);
    gpu.set_decode_pieces_in_flight(codec_cuda::DEFAULT_PIECES_IN_FLIGHT);
    let chunks: Vec<(usize, usize)> = (0..one.header().chunks.len())
        .map(|c| {
            let chunk = one.chunk_bytes(c).unwrap();
            (
                chunk.as_ptr() as usize - bytes.as_ptr() as usize + starts[2],
                chunk.len(),
            )
        })
        .collect();
    let mut refused = 0;
    for (c, &(start, n)) in chunks.iter().enumerate() {
        for lane_word in [false, true] {
            let saved = host.as_slice().unwrap()[start..start + n].to_vec();
            let chunk = &mut host.as_mut_slice().unwrap()[start..start + n];
            if lane_word {
                chunk[n * 3 / 4] ^= 0x5A;
                let crc = crc32c::crc32c(&chunk[..n - 4]).to_le_bytes();
                chunk[n - 4..].copy_from_slice(&crc);
            } else {
                chunk[n - 1] ^= 0x40;
            }
            gpu.set_decode_piece_blocks(0);
            let whole = decode_copies(&gpu, &host, at, true);
            refused += whole.iter().filter(|r| r.is_err()).count();
            let cases = [(8, 2, false), (20, 2, false), (64, 2, false), (8, 4, false)];
            for (piece_blocks, in_flight, early) in
                cases.into_iter().chain([(8, 4, true), (0, 4, true)])
            {
                gpu.set_decode_piece_blocks(piece_blocks);
                gpu.set_decode_pieces_in_flight(in_flight);
                gpu.set_decode_copy_early(early);
                let got = decode_copies(&gpu, &host, at, true);
                assert_eq!(
                    got, whole,
                    "chunk {c}, lane word {lane_word}, {piece_blocks}, {in_flight} in flight, \
                     copied early {early}"
                );
            }
            gpu.set_decode_copy_early(false);
            gpu.set_decode_pieces_in_flight(codec_cuda::DEFAULT_PIECES_IN_FLIGHT);
            if !lane_word {
                let named = |r: &Result<Vec<u16>, CudaError>| match r {
                    Err(CudaError::Stream { chunk, .. }) => *chunk == c,
                    _ => false,
                };
                assert!(
                    whole.iter().all(named),
                    "chunk {c}: {:?}",
                    whole.map(|r| r.err())
                );
            }
            host.as_mut_slice().unwrap()[start..start + n].copy_from_slice(&saved);
        }
    }
    assert!(
        refused > 2 * chunks.len(),
        "refused {refused} of {}",
        4 * chunks.len()
    );
}
