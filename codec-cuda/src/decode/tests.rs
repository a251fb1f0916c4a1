use codec_core::{encode, learn_profile, EncodeParams, KvCache, KvMeta, KvShape, Limits};
use codec_core::{LearnParams, ProfileMode, Sample, Stream, Tensor};

use std::sync::Arc;

use super::checks::CRC_MISMATCH;
use super::host::LaneInputs;
use super::*;
use crate::copy_runs::MERGE_GAP_BYTES;
use crate::ffi::{self, ResolveBlock, LANES};
use crate::levels::{LevelCache, LevelConsts, PlacedElsewhere};

/// An empty plan for `streams` (of one shape), each into dense f16 tensors of its own, and
/// their destinations.
fn layout<'s>(streams: &[&'s Stream<'s>]) -> (DecodePlan<'s>, Vec<(&'s Stream<'s>, Destination)>) {
    let shape = streams[0].header().shape;
    let per = 2 * shape.layers as usize * shape.tensor_len();
    let output = Output {
        dtype: OutDtype::F16,
        layout: OutLayout::Dense,
        len: streams.len() * per,
    };
    let plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
    let dests = streams.iter().enumerate().map(|(i, &s)| {
        let dest = Destination {
            base: (i * per) as u64,
            ..Destination::dense(shape.tokens, shape.channels())
        };
        (s, dest)
    });
    (plan, dests.collect())
}

/// A plan of `streams`, each into dense f16 tensors of its own.
fn plan_of<'s>(streams: &[&'s Stream<'s>]) -> DecodePlan<'s> {
    let (mut plan, dests) = layout(streams);
    for (s, dest) in dests {
        plan.add_stream(s, dest).unwrap();
    }
    plan
}

/// A small stream (2 layers, 1 head of 8 channels, 64 tokens in chunks of 16), its profile
/// embedded.
fn small_stream() -> Vec<u8> {
    small_stream_with(EncodeParams::default())
}

/// [`small_stream`] coded with `params` (in chunks of 16 tokens).
fn small_stream_with(params: EncodeParams) -> Vec<u8> {
    let shape = KvShape {
        layers: 2,
        kv_heads: 1,
        head_dim: 8,
        tokens: 64,
    };
    let t = |s: f32| Tensor::F32((0..512).map(|i| (i as f32 * s).sin()).collect());
    let cache = KvCache {
        shape,
        k: vec![t(0.3), t(0.5)],
        v: vec![t(0.7), t(1.1)],
        meta: KvMeta::default(),
    };
    let sample = Sample {
        kv: cache.view(),
        queries: None,
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
    let params = EncodeParams {
        chunk_tokens: 16,
        ..params
    };
    encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap()
}

/// A plan's pieces are runs of its chunks in order, none empty, about `piece_blocks`
/// blocks each; their chains run on the host one after another into one output give the
/// whole chain's bits.
#[test]
fn pieces_decode_to_the_whole_plans_bits() {
    let bytes = small_stream();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let plan = plan_of(&[&stream, &stream, &stream]);
    let want = plan.decode_chain_host().unwrap();
    // 3 streams of 4 chunks of 2 layers' K and V: 48 blocks.
    assert_eq!(plan.blocks, 48);
    for (piece_blocks, n) in [(0, 1), (48, 1), (100, 1), (24, 2), (16, 3), (8, 6), (1, 12)] {
        let pieces = plan.pieces(piece_blocks, 0);
        assert_eq!(pieces.len(), n, "{piece_blocks} blocks a piece: {pieces:?}");
        assert_eq!(pieces.first().map(|p| p.start), Some(0));
        assert_eq!(pieces.last().map(|p| p.end), Some(plan.chunks()));
        assert!(pieces.windows(2).all(|w| w[0].end == w[1].start));
        assert!(pieces.iter().all(|p| !p.is_empty()));
        assert!(
            decode_pieces_host(&plan, pieces) == want,
            "{piece_blocks} a piece"
        );
    }
    let past = plan.chain_of(&LevelCache::default(), 11..13);
    assert!(matches!(past, Err(CudaError::Input { .. })));
}

/// A ramp of pieces starts at the first piece's size and doubles up to the piece size,
/// then cuts the rest evenly; every end lies inside the plan, in order.
#[test]
fn piece_ends_ramp_from_the_first_then_cut_the_rest_evenly() {
    let sizes = |blocks, piece, first| {
        let mut ends = piece_ends(blocks, piece, first);
        ends.push(blocks);
        let starts = std::iter::once(0).chain(ends.clone());
        ends.iter()
            .zip(starts)
            .map(|(e, s)| e - s)
            .collect::<Vec<_>>()
    };
    assert_eq!(sizes(7680, 2048, 256), [256, 512, 1024, 1962, 1963, 1963]);
    assert_eq!(sizes(7680, 2048, 0), [1920; 4]);
    assert_eq!(sizes(7680, 2048, 4096), [1920; 4]);
    assert_eq!(sizes(1000, 2048, 256), [256, 512, 232]);
    assert_eq!(sizes(100, 2048, 256), [100]);
    assert_eq!(sizes(100, 0, 16), [100]);
    assert_eq!(sizes(100, usize::MAX, usize::MAX - 1), [100]);
    assert_eq!(sizes(100, usize::MAX, 40), [40, 60]);
    for blocks in [1, 2, 7, 100, 1919, 7680] {
        for (piece, first) in [(1, 0), (3, 1), (64, 5), (512, 100), (4096, 1)] {
            let s = sizes(blocks, piece, first);
            assert_eq!(s.iter().sum::<usize>(), blocks);
            assert!(s.iter().all(|&n| n > 0), "{blocks} {piece} {first}: {s:?}");
            // The ramp: the doublings below the piece size that end inside the plan.
            let ramp: Vec<_> = (0..16)
                .map(|k| first << k)
                .take_while(|&n| n > 0 && n < piece)
                .scan(0, |at, n| {
                    *at += n;
                    (*at < blocks).then_some(n)
                })
                .collect();
            assert_eq!(s[..ramp.len()], ramp, "{blocks} {piece} {first}: {s:?}");
            let rest = &s[ramp.len()..];
            let (lo, hi) = (rest.iter().min(), rest.iter().max());
            assert!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{s:?}");
            assert!(rest.len() == 1 || rest.iter().all(|&n| 2 * n >= piece && n < 2 * piece));
        }
    }
}

/// Pieces of a ramp hold whole chunks, in order, and decode to the whole plan's bits.
#[test]
fn a_ramp_of_pieces_decodes_to_the_whole_plans_bits() {
    let bytes = small_stream();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let plan = plan_of(&[&stream, &stream, &stream]);
    let want = plan.decode_chain_host().unwrap();
    // 48 blocks in chunks of 4: ramp ends at 4 and 12, then 36 blocks in two.
    let pieces = plan.pieces(16, 4);
    assert_eq!(pieces, [0..1, 1..3, 3..8, 8..12]);
    assert!(decode_pieces_host(&plan, pieces) == want);
}

/// `plan` decoded by the host-run chains of `pieces`, one after another, into one output.
fn decode_pieces_host(plan: &DecodePlan<'_>, pieces: Vec<Range<usize>>) -> Vec<u16> {
    let mut out = vec![0u16; plan.output().len];
    for p in pieces {
        let ch = plan.chain_of(&LevelCache::default(), p).unwrap();
        plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (true, false))
            .unwrap();
    }
    out
}

/// The five-launch chain (tables resolved into a buffer, every value written; the default,
/// which the tests against codec-core run) decodes to the bits of the fused one, on
/// streams with escapes.
#[test]
fn fused_and_five_launch_chains_decode_alike() {
    let (a, b) = (small_stream(), small_stream_with(EncodeParams::default()));
    let sa = Stream::open(&a, None, &Limits::DEFAULT).unwrap();
    let sb = Stream::open(&b, None, &Limits::DEFAULT).unwrap();
    let plan = plan_of(&[&sa, &sb]);
    let ch = plan.chain().unwrap();
    assert!(ch.n_escapes > 0, "the streams have no escapes");
    let run = |fused| {
        let mut out = vec![0u16; plan.output().len];
        plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (fused, false))
            .unwrap();
        out
    };
    let compact = |fused| {
        let mut out = vec![0u16; plan.output().len];
        plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (fused, true))
            .unwrap();
        out
    };
    assert!(compact(true) == run(true) && compact(false) == run(true));
    let want = run(false);
    assert!(want.iter().filter(|&&x| x != 0).count() > want.len() / 2);
    assert!(run(true) == want);
}

/// The real fixture (8 layers) with step exponents (a profile learned with its queries, so
/// every coded block has an exponent table, a layer's K and V blocks the same one, which
/// the chain uploads once) at three levels in four chunks: the host-run chain with compact
/// tables decodes the bits of the one with packed tables, fused and in
/// five launches, and these are codec-core's.
#[test]
fn compact_tables_decode_the_fixture_as_packed_ones() {
    let mut d = kvc_io::load_dump(&kvc_io::fixtures::sample()).unwrap();
    d.keep_layers(8);
    let profile = learn_profile(&[d.sample()], &LearnParams::default()).unwrap();
    let (mid, last) = (profile.levels() / 2, profile.levels() - 1);
    let params = EncodeParams {
        chunk_tokens: 128,
        levels: vec![0, mid, last, mid],
        token_importance: true,
        ..EncodeParams::default()
    };
    let bytes = encode(&d.kv.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let plan = plan_of(&[&stream]);
    let ch = plan.chain().unwrap();
    let exp_ids: Vec<u32> = (ch.resolve.iter().zip(&ch.values))
        .filter(|(r, _)| r.has_exps == 1)
        .map(|(_, v)| ch.table_list[v.list_start as usize])
        .collect();
    assert!(exp_ids.len() == ch.sym_blocks.len(), "no exponent tables");
    // A layer's K and V blocks (one after the other) share their exponent table.
    assert!(exp_ids.chunks(2).all(|kv| kv[0] == kv[1]));
    let run = |form| {
        let mut out = vec![0u16; plan.output().len];
        plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, form)
            .unwrap();
        out
    };
    let want = run((true, false));
    assert!(run((true, true)) == want && run((false, true)) == want);
    let cpu = crate::fuzzing::codec_core_bits(&stream, OutDtype::F16).unwrap();
    assert!(cpu.concat() == want, "not codec-core's bits");
}

/// The fused chain's symbol lanes (`kvc_rans_lane_decode_mapped`) decode what the lanes
/// given the resolved tables decode; a block whose resolve record does not describe it
/// (other symbols, a map or exponents past their buffers, no group) is
/// `KVC_LANE_BAD_RANGE` on every lane, the other blocks decoded as before.
#[test]
fn mapped_lanes_decode_as_the_resolved_ones_and_check_their_records() {
    let bytes = small_stream();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let plan = plan_of(&[&stream]);
    let ch = plan.chain().unwrap();
    let (heads, head_dim) = (plan.heads, plan.head_dim);
    let shape = LaneShape::new(1, 0).unwrap();
    let (words, tables) = (ch.words(), ch.expanded_tables(false).unwrap());
    let inputs = LaneInputs {
        words: &words,
        tables: &tables,
        compact: false,
    };
    let (exps, _) = ch.host_exps(inputs, shape).unwrap();
    let mut sym_table = vec![0u16; ch.n_symbols];
    let mut resolve_status = vec![9u32; ch.resolve.len()];
    let maps = ch.table_maps(&exps, (heads, head_dim));
    ffi::host_resolve_tables(ffi::ResolveIo {
        symbol_table: &mut sym_table,
        maps,
        status: &mut resolve_status,
    })
    .unwrap();
    assert!(resolve_status.iter().all(|&s| s == 0));
    let lanes = |resolve: Option<&[ResolveBlock]>| {
        let mut symbols = vec![0u8; ch.n_symbols];
        let mut status = vec![9u32; ch.sym_blocks.len() * LANES];
        let out = (&mut symbols[..], &mut status[..]);
        let io = ch.lane_io(inputs, shape, (&sym_table, &ch.sym_blocks), out);
        match resolve {
            None => ffi::host_lane_decode(io).unwrap(),
            Some(resolve) => {
                let maps = ffi::TableMaps { resolve, ..maps };
                ffi::host_lane_decode_mapped(io, maps).unwrap()
            }
        }
        (symbols, status)
    };
    let want = lanes(None);
    assert!(want.1.iter().all(|&s| s == 0));
    assert!(lanes(Some(&ch.resolve)) == want);
    let first = ch.resolve[0];
    let n = first.n_e as usize + first.n_sym as usize;
    let corruptions: [fn(&mut ResolveBlock); 4] = [
        |r| r.n_sym -= 1,
        |r| r.map_start = u64::MAX - 7,
        |r| (r.has_exps, r.exp_start) = (1, u64::MAX / 2),
        |r| r.group = 0,
    ];
    for corrupt in corruptions {
        let mut resolve = ch.resolve.clone();
        corrupt(&mut resolve[0]);
        let (symbols, status) = lanes(Some(&resolve));
        assert!(status[..LANES].iter().all(|&s| s == 5), "{:?}", resolve[0]);
        assert_eq!(status[LANES..], want.1[LANES..]);
        assert_eq!(symbols[n..], want.0[n..]);
    }
}

/// Level constants placed outside the chain (as a `Gpu` keeps them resident on its
/// device), after other bytes and each level once, decode to the chain's own bits: every
/// block's map and constants start follows the placer's.
#[test]
fn placed_level_constants_decode_as_the_chains_own() {
    let (a, b) = (small_stream(), small_stream_with(EncodeParams::default()));
    let sa = Stream::open(&a, None, &Limits::DEFAULT).unwrap();
    let sb = Stream::open(&b, None, &Limits::DEFAULT).unwrap();
    let plan = plan_of(&[&sa, &sb, &sa]);
    let want = plan.decode_chain_host().unwrap();
    let mut elsewhere = PlacedElsewhere::new();
    let mut place = |h: &[u8; 32], l: u8, c: &Arc<LevelConsts>| elsewhere.place(h, l, c);
    let all = 0..plan.chunks();
    let cache = LevelCache::default();
    let mut ch = plan.chain_placed(&cache, all, Some(&mut place)).unwrap();
    assert!(ch.map.is_empty() && ch.dequant.io(&mut [], &mut []).consts.is_empty());
    assert!(elsewhere.levels() > 0);
    ch.map = elsewhere.maps;
    assert_eq!(ch.dequant.add_consts(&elsewhere.consts), 0);
    let mut out = vec![0u16; plan.output().len];
    plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (true, false))
        .unwrap();
    assert!(out == want);
}

/// `add_streams` on 1-5 threads builds the plan `add_stream` builds one stream at a time:
/// the same chunks, decoded to the same bits; with a chunk whose CRC fails, the same
/// error and the same chunks added before it.
#[test]
fn add_streams_on_any_threads_is_add_stream_in_order() {
    let bytes = small_stream();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let mut bad = bytes.clone();
    bad[stream.header().chunks[2].offset as usize + 9] ^= 0x10;
    let broken = Stream::open(&bad, None, &Limits::DEFAULT).unwrap();
    for (streams, fails) in [
        (vec![&stream, &stream, &stream], false),
        (vec![&stream, &broken, &stream], true),
    ] {
        let (mut serial, dests) = layout(&streams);
        let serial_result = dests.iter().try_for_each(|&(s, d)| serial.add_stream(s, d));
        assert_eq!(serial_result.is_err(), fails);
        let want = (serial.chunks(), serial.decode_chain_host().unwrap());
        for threads in 1..=5 {
            let (mut plan, dests) = layout(&streams);
            let result = plan.add_streams(&dests, threads);
            assert_eq!(result, serial_result, "{threads} threads");
            let got = (plan.chunks(), plan.decode_chain_host().unwrap());
            assert!(got == want, "{threads} threads");
        }
    }
}

/// Two streams over two copies of one stream's bytes (one embedded profile) add no table
/// map and no channel constants to the chain of one: the plan shares them by the
/// profile's SHA-256, not by the stream.
#[test]
fn streams_of_one_profile_share_table_maps_and_constants() {
    let bytes = small_stream();
    let copy = bytes.clone();
    let one = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let two = Stream::open(&copy, None, &Limits::DEFAULT).unwrap();
    let single = plan_of(&[&one]);
    let both = plan_of(&[&one, &two]);
    let (a, b) = (single.chain().unwrap(), both.chain().unwrap());
    assert!(!a.map.is_empty());
    assert_eq!(a.map, b.map);
    let consts = |c: &Chain<'_>| c.dequant.io(&mut [], &mut []).consts.len();
    assert_eq!(consts(&a), consts(&b));
    assert_eq!(b.values.len(), 2 * a.values.len());
}

/// A chain whose level constants come from a cache that other chains filled (in another
/// order, with a level this plan lacks) is the chain built with none kept: the same
/// tables, maps, constants and blocks, so the same bits.
#[test]
fn a_chain_from_kept_level_constants_is_the_one_built_afresh() {
    let at = |level| {
        small_stream_with(EncodeParams {
            levels: vec![level],
            ..EncodeParams::default()
        })
    };
    let (b0, b2, b5) = (at(0), at(2), at(5));
    let open = |b| Stream::open(b, None, &Limits::DEFAULT).unwrap();
    let (s0, s2, s5) = (open(&b0), open(&b2), open(&b5));
    let plan = plan_of(&[&s2, &s0, &s2]);
    let cache = LevelCache::default();
    plan_of(&[&s5, &s0]).chain_with(&cache).unwrap();
    let afresh = format!("{:?}", plan.chain().unwrap());
    for _ in 0..2 {
        assert_eq!(format!("{:?}", plan.chain_with(&cache).unwrap()), afresh);
    }
    assert_eq!(cache.len(), 3);
}

/// A plan whose CRCs are checked at decode decodes the bits of one checked when chunks are
/// added, on every host path; a chunk whose lane words or stored CRC were altered (its
/// structure intact) is added, then refused at decode with the error the other plan gives
/// when adding it, naming the chunk of the right stream.
#[test]
fn crcs_checked_at_decode_refuse_what_adding_refuses() {
    fn at_decode<'s>(streams: &[&'s Stream<'s>]) -> Result<DecodePlan<'s>, CudaError> {
        let (mut plan, dests) = layout(streams);
        plan.set_crc_at_decode(true);
        plan.add_streams(&dests, 2)?;
        Ok(plan)
    }
    let bytes = small_stream();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let want = plan_of(&[&stream, &stream]).decode_chain_host().unwrap();
    let plan = at_decode(&[&stream, &stream]).unwrap();
    assert_eq!(
        crc_checks(&plan.chunks).len(),
        2 * stream.header().chunks.len()
    );
    assert_eq!(plan.decode_chain_host().unwrap(), want);
    assert_eq!(plan.decode_chain_host_from(&bytes).unwrap(), want);
    assert_eq!(plan.decode_host().unwrap(), want);
    let chunk = stream.chunk_bytes(2).unwrap();
    let end = chunk.as_ptr() as usize - bytes.as_ptr() as usize + chunk.len();
    // Both copies of the stream in one buffer: the second's chunk 2 altered.
    for at in [end - 5, end - 1] {
        let mut two = [&bytes[..], &bytes[..]].concat();
        two[bytes.len() + at] ^= 0x10;
        let (good, bad) = two.split_at(bytes.len());
        let open = |b| Stream::open(b, None, &Limits::DEFAULT).unwrap();
        let (good, bad) = (open(good), open(bad));
        let (mut checked, dests) = layout(&[&good, &bad]);
        let refused = checked.add_streams(&dests, 2).unwrap_err();
        let want_err = CudaError::Stream {
            chunk: 2,
            what: CRC_MISMATCH,
        };
        assert_eq!(refused, want_err);
        let plan = at_decode(&[&good, &bad]).unwrap();
        assert_eq!(plan.decode_chain_host(), Err(want_err.clone()));
        assert_eq!(plan.decode_chain_host_from(&two), Err(want_err.clone()));
        assert_eq!(plan.decode_host(), Err(want_err));
    }
}

/// Two streams in one buffer with more than [`MERGE_GAP_BYTES`] of other bytes between
/// them: a decode from the buffer copies one run a stream (never its header, nor the bytes
/// between the streams), from its first chunk to its last when the chunks are checked at
/// decode, within them when not, and decodes both streams' bits.
#[test]
fn a_decode_from_host_bytes_copies_the_chunks_and_not_what_lies_between() {
    let bytes = small_stream();
    let gap = vec![0xEE; MERGE_GAP_BYTES + 1];
    let buf = [&bytes[..], &gap, &bytes].concat();
    let second = bytes.len() + gap.len();
    let open = |b| Stream::open(b, None, &Limits::DEFAULT).unwrap();
    let (a, b) = (open(&buf[..bytes.len()]), open(&buf[second..]));
    let entries = &a.header().chunks;
    let first = entries.first().unwrap().offset as usize;
    let last = entries.last().unwrap();
    let chunks = first..last.offset as usize + last.len_bytes as usize - 4;
    let second_chunks = chunks.start + second..chunks.end + second;
    for crc_at_decode in [true, false] {
        let (mut plan, dests) = layout(&[&a, &b]);
        plan.set_crc_at_decode(crc_at_decode);
        plan.add_streams(&dests, 1).unwrap();
        let ch = plan.chain().unwrap();
        let places = ch.gather_parts(&buf, MERGE_GAP_BYTES).unwrap();
        let (runs, parts, checks) = (places.runs, places.parts, places.checks);
        let with_escapes = ch.escape_parts.iter().filter(|e| !e.is_empty()).count();
        assert_eq!(plan.bytes_copied_from(&buf).unwrap(), runs.len());
        // The runs found before the chain is built: these, or none to copy early.
        let early = plan.checked_runs(0..plan.chunks(), &buf, MERGE_GAP_BYTES);
        match crc_at_decode {
            true => assert_eq!(early.unwrap(), runs),
            false => assert_eq!(early.unwrap().len(), 0),
        }
        assert_eq!(places.word_parts, ch.word_parts.len());
        assert_eq!(parts.len(), ch.word_parts.len() + with_escapes);
        if crc_at_decode {
            assert_eq!(runs.runs(), &[chunks.clone(), second_chunks.clone()]);
            assert_eq!(checks.len(), 2 * entries.len());
        } else {
            let [one, two] = runs.runs() else {
                panic!("{:?}", runs.runs());
            };
            assert!(
                chunks.start <= one.start && one.end <= chunks.end,
                "{one:?}"
            );
            assert!(second_chunks.start <= two.start && two.end <= second_chunks.end);
            assert!(checks.is_empty());
        }
        let want = plan_of(&[&a, &b]).decode_chain_host().unwrap();
        assert_eq!(plan.decode_chain_host_from(&buf).unwrap(), want);
    }
}

/// The runs a decode in pieces copies before a piece's chain is built are the ones the
/// piece's chain finds, for every piece of a plan of streams apart in one buffer, gaps
/// merged or not; a checked chunk outside the buffer, or chunks past the plan's, are
/// input errors.
#[test]
fn each_pieces_early_runs_are_the_ones_its_chain_finds() {
    let bytes = small_stream();
    let between = vec![0xEE; 100];
    let buf = [&bytes[..], &between, &bytes, &between, &bytes].concat();
    let at = |i: usize| i * (bytes.len() + between.len());
    let open = |i| Stream::open(&buf[at(i)..at(i) + bytes.len()], None, &Limits::DEFAULT);
    let streams: Vec<Stream<'_>> = (0..3).map(|i| open(i).unwrap()).collect();
    let (mut plan, dests) = layout(&streams.iter().collect::<Vec<_>>());
    plan.set_crc_at_decode(true);
    plan.add_streams(&dests, 1).unwrap();
    let cache = LevelCache::default();
    for piece_blocks in [0, 1, 8, 16, 24] {
        for gap in [0, 100, MERGE_GAP_BYTES] {
            for piece in plan.pieces(piece_blocks, 0) {
                let early = plan.checked_runs(piece.clone(), &buf, gap).unwrap();
                let ch = plan.chain_of(&cache, piece.clone()).unwrap();
                let runs = ch.gather_parts(&buf, gap).unwrap().runs;
                assert!(early.len() > 0, "{piece:?}");
                assert_eq!(early, runs, "{piece_blocks} blocks, gap {gap}, {piece:?}");
            }
        }
    }
    let elsewhere = bytes.clone();
    let outside = plan.checked_runs(0..plan.chunks(), &elsewhere, 0);
    assert!(matches!(outside, Err(CudaError::Input { .. })));
    let past = plan.checked_runs(0..plan.chunks() + 1, &buf, 0);
    assert!(matches!(past, Err(CudaError::Input { .. })));
}
