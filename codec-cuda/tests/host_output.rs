//! The dequantization kernel's outputs, compiled for the host: f16 and bf16, dense `[T, H, D]`
//! and vLLM's paged layout (`[num_pages, page_size, H, D]` per layer and K/V, token `t` in page
//! `table[t / page_size]`, slot `t % page_size`), whole streams and several sequences in one
//! batch ([`DecodePlan`]: three launches for every chunk and layer). Compared bit for bit with
//! codec-core's decode into f16 or bf16 buffers, scattered into pages by a few lines of Rust.

mod common;

use codec_core::{encode, EncodeParams, Limits, ProfileMode, Stream};
use codec_cuda::decode::DecodePlan;
use codec_cuda::fuzzing::scatter;
use codec_cuda::quant::{f32_to_bf16_bits, OutDtype, OutLayout, Output};
use codec_cuda::CudaError;
use codec_cuda::Destination;
use common::{codec_core_tensors, golden, permutation};
use half::bf16;
use proptest::prelude::*;

#[test]
fn golden_streams_decode_dense_f16_and_bf16_as_codec_core() {
    for (name, bytes, profile) in golden() {
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        for dtype in [OutDtype::F16, OutDtype::Bf16] {
            let plan = DecodePlan::for_stream(&stream, dtype).unwrap();
            let got = plan.decode_host().unwrap();
            let want: Vec<u16> = codec_core_tensors(&stream, dtype).concat();
            assert!(got == want, "{name} {dtype:?}: differs from codec-core");
            let chained = plan.decode_chain_host().unwrap();
            assert!(
                chained == want,
                "{name} {dtype:?}: the chain differs from codec-core"
            );
        }
    }
}

/// Every golden stream into pages (sizes 1, 5 and 16, pages shuffled, spare pages left
/// untouched), f16 and bf16, against codec-core's decode scattered by [`scatter`].
#[test]
fn golden_streams_decode_into_pages_as_codec_core() {
    for (n, (name, bytes, profile)) in golden().into_iter().enumerate() {
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let h = stream.header();
        let (tokens, c) = (h.shape.tokens as usize, h.shape.channels());
        for (page_size, dtype) in [(16, OutDtype::F16), (5, OutDtype::Bf16), (1, OutDtype::F16)] {
            let used = tokens.div_ceil(page_size);
            let num_pages = used + 3;
            let table: Vec<u32> =
                permutation(num_pages, n as u64 * 31 + page_size as u64)[..used].to_vec();
            let tensor_len = num_pages * page_size * c;
            let output = Output {
                dtype,
                layout: OutLayout::Paged {
                    page_size: page_size as u32,
                },
                len: 2 * h.shape.layers as usize * tensor_len,
            };
            let mut plan = DecodePlan::new(h.shape.kv_heads, h.shape.head_dim, output);
            let page_start = plan.add_page_table(&table);
            let dest = Destination {
                base: 0,
                tensor_stride: tensor_len as u64,
                page_start,
            };
            plan.add_stream(&stream, dest).unwrap();
            let got = plan.decode_host().unwrap();
            let mut want = vec![0u16; output.len];
            let tensors = codec_core_tensors(&stream, dtype);
            scatter(&mut want, &tensors, &table, page_size, c, tensor_len);
            assert!(got == want, "{name} pages of {page_size} {dtype:?}");
            assert!(
                plan.decode_chain_host().unwrap() == want,
                "{name} chain, pages"
            );
        }
    }
}

/// More channels than the chain's blocks have threads (the fixture's 3 heads doubled to 6 x 64 =
/// 384, each copy scaled differently), groups of 3 and 2 sink tokens: the chain's table
/// resolution walks rows and channels across thread strides that are under one row; the output
/// is codec-core's.
#[test]
fn wide_rows_decode_through_the_chain_as_codec_core() {
    use codec_core::{learn_profile, KvCache, LearnParams, Sample, Tensor};
    let (narrow, _) = common::fixture_cache(2);
    let mut shape = narrow.shape;
    let row = shape.channels();
    shape.kv_heads *= 2;
    let widen = |t: &Tensor| {
        let x = t.to_f32_vec();
        let wide: Vec<f32> = x
            .chunks_exact(row)
            .flat_map(|r| r.iter().copied().chain(r.iter().map(|v| 0.5 * v + 0.25)))
            .collect();
        Tensor::from_f32(t.dtype(), &wide)
    };
    let cache = KvCache {
        shape,
        k: narrow.k.iter().map(widen).collect(),
        v: narrow.v.iter().map(widen).collect(),
        meta: narrow.meta.clone(),
    };
    let sample = Sample {
        kv: cache.view(),
        queries: None,
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
    let params = EncodeParams {
        chunk_tokens: 80,
        levels: vec![3],
        group: 3,
        n_sink: 2,
        ..EncodeParams::default()
    };
    let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    assert!(shape.channels() > 256, "wider than a block of the chain");
    let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
    let want: Vec<u16> = codec_core_tensors(&stream, OutDtype::F16).concat();
    assert!(
        plan.decode_chain_host().unwrap() == want,
        "differs from codec-core"
    );
}

/// The real 512-token fixture (3 layers, step exponents) as two sequences sharing one paged
/// bf16 cache: the stream at level 2 in 96-token chunks and at level 6 in 64-token chunks, each
/// with its own page table over disjoint shuffled pages, in one plan (every chunk of both in
/// the same three launches).
#[test]
fn real_fixture_two_sequences_share_a_paged_cache() {
    let (cache, profile) = common::fixture_cache(3);
    let (cache, layers) = (&cache, cache.shape.layers as usize);
    let params = |level: u8, chunk_tokens: u32| EncodeParams {
        chunk_tokens,
        levels: vec![level],
        token_importance: true,
        ..EncodeParams::default()
    };
    let a = encode(
        &cache.view(),
        ProfileMode::Embedded(&profile),
        &params(2, 96),
    )
    .unwrap();
    let b = encode(
        &cache.view(),
        ProfileMode::Embedded(&profile),
        &params(6, 64),
    )
    .unwrap();
    let sa = Stream::open(&a, None, &Limits::DEFAULT).unwrap();
    let sb = Stream::open(&b, None, &Limits::DEFAULT).unwrap();
    let shape = sa.header().shape;
    let c = shape.channels();
    let page_size = 16usize;
    let tokens = shape.tokens as usize;
    let (pages_a, pages_b) = (tokens.div_ceil(page_size), tokens.div_ceil(page_size));
    let num_pages = pages_a + pages_b + 2;
    let perm = permutation(num_pages, 7);
    let (table_a, table_b) = (
        perm[..pages_a].to_vec(),
        perm[pages_a..pages_a + pages_b].to_vec(),
    );
    let tensor_len = num_pages * page_size * c;
    let output = Output {
        dtype: OutDtype::Bf16,
        layout: OutLayout::Paged {
            page_size: page_size as u32,
        },
        len: 2 * layers * tensor_len,
    };
    let mut plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
    for (stream, table) in [(&sa, &table_a), (&sb, &table_b)] {
        let page_start = plan.add_page_table(table);
        let dest = Destination {
            base: 0,
            tensor_stride: tensor_len as u64,
            page_start,
        };
        plan.add_stream(stream, dest).unwrap();
    }
    let got = plan.decode_host().unwrap();
    let mut want = vec![0u16; output.len];
    for (stream, table) in [(&sa, &table_a), (&sb, &table_b)] {
        let tensors = codec_core_tensors(stream, OutDtype::Bf16);
        scatter(&mut want, &tensors, table, page_size, c, tensor_len);
    }
    assert!(got == want);
    assert!(plan.decode_chain_host().unwrap() == want);
    println!("{} chunks in one plan", plan.chunks());
}

/// One cache coded with two profiles (learned to different target errors), both streams and a
/// second copy of the first in one plan: the plan shares level tables, table maps and channel
/// constants between streams by their profile's SHA-256 only, so each chunk decodes with its
/// own profile's to codec-core's bits, through the chain and the stepwise path.
#[test]
fn streams_of_two_profiles_in_one_plan_decode_each_with_its_own() {
    use codec_core::{learn_profile, LearnParams, Sample};
    let (cache, profile) = common::fixture_cache(2);
    let sample = Sample {
        kv: cache.view(),
        queries: None,
    };
    let coarse = LearnParams {
        target_error: LearnParams::default().target_error * 3.0,
        ..LearnParams::default()
    };
    let other = learn_profile(&[sample], &coarse).unwrap();
    assert_ne!(profile.hash(), other.hash());
    let params = EncodeParams {
        chunk_tokens: 128,
        levels: vec![4],
        ..EncodeParams::default()
    };
    let code = |p| encode(&cache.view(), ProfileMode::Embedded(p), &params).unwrap();
    let (a, b) = (code(&profile), code(&other));
    let a2 = a.clone();
    let open = |bytes| Stream::open(bytes, None, &Limits::DEFAULT).unwrap();
    let streams = [open(&a), open(&b), open(&a2)];
    let plan = common::dense_plan(&streams.iter().collect::<Vec<_>>());
    let want: Vec<u16> = streams
        .iter()
        .flat_map(|s| codec_core_tensors(s, OutDtype::F16).concat())
        .collect();
    let per_stream = want.len() / 3;
    assert!(want[..per_stream] != want[per_stream..2 * per_stream]);
    assert!(plan.decode_chain_host().unwrap() == want);
    assert!(plan.decode_host().unwrap() == want);
}

/// Streams received into one buffer, as a server receives them into page-locked memory: the
/// real fixture's stream four times, at byte offsets of every remainder mod 4, in one plan
/// whose lane words the host-run gather takes from the buffer (`decode_chain_host_from`, what
/// `Gpu::decode_from` runs on a device): codec-core's bits.
/// A buffer that lacks some stream of the plan is an input error, never a read outside it.
#[test]
fn streams_in_one_buffer_decode_with_their_words_gathered_from_it() {
    let (bytes, _) = common::fixture_stream(3);
    let mut buf = Vec::new();
    let mut starts = Vec::new();
    for align in 0..4 {
        // The stream at `align` past a multiple of 4, so its words lie at every alignment.
        buf.resize(buf.len() + (4 + align - buf.len() % 4) % 4, 0xEE);
        starts.push(buf.len());
        buf.extend_from_slice(&bytes);
    }
    let open = |at: usize| Stream::open(&buf[at..at + bytes.len()], None, &Limits::DEFAULT);
    let streams: Vec<Stream<'_>> = starts.iter().map(|&at| open(at).unwrap()).collect();
    let plan = common::dense_plan(&streams.iter().collect::<Vec<_>>());
    let want = codec_core_tensors(&streams[0], OutDtype::F16)
        .concat()
        .repeat(4);
    assert!(plan.decode_chain_host_from(&buf).unwrap() == want);
    let last = starts[3];
    for short in [&buf[..last], &buf[last + 1..], &buf.clone()[..]] {
        assert!(matches!(
            plan.decode_chain_host_from(short),
            Err(CudaError::Input { .. })
        ));
    }
}

/// A plan that reads no lane words (the golden streams of no tokens and of one token, a sink
/// kept as it is) reads nothing from the bytes it is given: it decodes from any buffer (which
/// `Gpu::upload_plan_from` matches on a device), to codec-core's values.
#[test]
fn a_plan_without_lane_words_decodes_from_any_bytes() {
    for name in ["v20-zero-tokens.kvc", "v01-one-token.kvc"] {
        let (bytes, profile) = common::read_vector(name);
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let want = codec_core_tensors(&stream, OutDtype::F16).concat();
        let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
        assert!(
            plan.decode_chain_host_from(&[0xEE; 7]).unwrap() == want,
            "{name}"
        );
        assert!(plan.decode_chain_host_from(&[]).unwrap() == want, "{name}");
    }
}

#[test]
fn f32_to_bf16_narrowing_matches_ieee() {
    // Every 4099th bit pattern and every pattern near the rounding and overflow boundaries,
    // against the half crate (IEEE roundTiesToEven); NaN to a quiet NaN with the top bits kept.
    let edges = [
        0x0000_8000u32,
        0x3F80_8000,
        0x7F7F_8000,
        0x7F80_0000,
        0x7FC0_0000,
    ];
    for u in common::f32_patterns(&edges, 3000) {
        let x = f32::from_bits(u);
        let got = f32_to_bf16_bits(x);
        if x.is_nan() {
            assert_eq!(got, ((u >> 16) | 0x40) as u16, "{u:#x}");
        } else {
            assert_eq!(got, bf16::from_f32(x).to_bits(), "{u:#x}");
        }
    }
}

/// A plan whose page table names pages outside the cache, or is too short for the stream, is
/// an error (the kernel writes nothing for such a block), never a panic.
#[test]
fn page_tables_outside_the_cache_are_errors() {
    let (_, bytes, profile) = golden().swap_remove(4);
    let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
    let h = stream.header();
    let (tokens, c) = (h.shape.tokens as usize, h.shape.channels());
    let page_size = 4usize;
    let used = tokens.div_ceil(page_size);
    let tensor_len = used * page_size * c;
    let output = Output {
        dtype: OutDtype::F16,
        layout: OutLayout::Paged {
            page_size: page_size as u32,
        },
        len: 2 * h.shape.layers as usize * tensor_len,
    };
    let good: Vec<u32> = (0..used as u32).collect();
    let mut beyond = good.clone();
    beyond[used / 2] = used as u32 * 2 * h.shape.layers;
    let short = &good[..used - 1];
    for (table, base) in [(&good[..], 1u64), (&beyond[..], 0), (short, 0)] {
        let mut plan = DecodePlan::new(h.shape.kv_heads, h.shape.head_dim, output);
        let page_start = plan.add_page_table(table);
        let dest = Destination {
            base,
            tensor_stride: tensor_len as u64,
            page_start,
        };
        plan.add_stream(&stream, dest).unwrap();
        assert!(matches!(plan.decode_host(), Err(CudaError::Input { .. })));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Any page size, table and base over a small golden stream: the kernel's output is the
    /// reference scatter, or, when a row falls outside the cache, an error.
    #[test]
    fn arbitrary_page_tables_scatter_or_fail(
        page_size in 1usize..40,
        table in proptest::collection::vec(0u32..12, 0..40),
        spare in 0usize..3,
    ) {
        let (_, bytes, profile) = golden().swap_remove(3);
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let h = stream.header();
        let (tokens, c) = (h.shape.tokens as usize, h.shape.channels());
        let num_pages = 9 + spare;
        let tensor_len = num_pages * page_size * c;
        let output = Output {
            dtype: OutDtype::Bf16,
            layout: OutLayout::Paged { page_size: page_size as u32 },
            len: 2 * h.shape.layers as usize * tensor_len,
        };
        let mut plan = DecodePlan::new(h.shape.kv_heads, h.shape.head_dim, output);
        let page_start = plan.add_page_table(&table);
        let dest = Destination { base: 0, tensor_stride: tensor_len as u64, page_start };
        plan.add_stream(&stream, dest).unwrap();
        let fits = tokens.div_ceil(page_size) <= table.len()
            && table[..tokens.div_ceil(page_size)].iter().all(|&p| (p as usize) < num_pages);
        match plan.decode_host() {
            Ok(got) => {
                prop_assert!(fits);
                // Pages may repeat in an arbitrary table: the later token wins, as in the kernel
                // only if blocks run in order, so compare only tables without repeats.
                let used = &table[..tokens.div_ceil(page_size)];
                let mut sorted = used.to_vec();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() == used.len() {
                    let mut want = vec![0u16; output.len];
                    let tensors = codec_core_tensors(&stream, OutDtype::Bf16);
                    scatter(&mut want, &tensors, &table, page_size, c, tensor_len);
                    prop_assert!(got == want);
                }
            }
            Err(e) => {
                prop_assert!(!fits, "{e}");
                let is_input = matches!(e, CudaError::Input { .. });
                prop_assert!(is_input, "{}", e);
            }
        }
    }
}

/// CRC-32C, as chunks carry it.
fn crc32c(bytes: &[u8]) -> u32 {
    crc::Crc::<u32>::new(&crc::CRC_32_ISCSI).checksum(bytes)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// A chunk body with bytes altered (and its CRC fixed, so the change reaches the block
    /// checks and the kernels) decodes to an error or to some output, never a panic; with the
    /// CRC left stale it is the chunk's C1 error.
    #[test]
    fn altered_chunks_never_panic(
        which in 0usize..20,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        fix_crc in any::<bool>(),
    ) {
        let (_, bytes, profile) = golden().swap_remove(which);
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let h = stream.header();
        prop_assume!(!h.chunks.is_empty());
        let chunk = edits[0].0.index(h.chunks.len());
        let e = h.chunks[chunk];
        let (start, len) = (e.offset as usize, e.len_bytes as usize);
        prop_assume!(len > 4);
        let mut altered = bytes.clone();
        for (at, x) in &edits {
            altered[start + at.index(len - 4)] ^= x | 1;
        }
        if fix_crc {
            let crc = crc32c(&altered[start..start + len - 4]);
            altered[start + len - 4..start + len].copy_from_slice(&crc.to_le_bytes());
        }
        let stream = Stream::open(&altered, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let (tokens, c) = (h.shape.tokens, h.shape.channels());
        let output = Output {
            dtype: OutDtype::Bf16,
            layout: OutLayout::Dense,
            len: 2 * h.shape.layers as usize * tokens as usize * c,
        };
        let mut plan = DecodePlan::new(h.shape.kv_heads, h.shape.head_dim, output);
        let added = plan.add_stream(&stream, Destination::dense(tokens, c));
        if !fix_crc {
            let stale = matches!(added, Err(CudaError::Stream { what, .. }) if what.contains("C1"));
            prop_assert!(stale, "{:?}", added);
        } else if added.is_ok() {
            // Both paths agree on whether the chunk decodes, and on its output.
            match (plan.decode_host(), plan.decode_chain_host()) {
                (Ok(a), Ok(b)) => prop_assert!(a == b),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "{:?} / {:?}", a.map(|_| ()), b.map(|_| ())),
            }
        }
    }
}
