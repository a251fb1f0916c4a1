//! Malformed launch records: the kernels (run on the host) give defined statuses and touch
//! nothing outside their buffers, whatever a block's, a chunk's or a result's fields hold.
use std::sync::Arc;

use super::host::HostRun;
use super::*;
use crate::ffi::{self, LANES};
use crate::levels::{LevelCache, LevelConsts, PlacedElsewhere};
use codec_core::{learn_profile, KvCache, KvMeta, KvShape, LearnParams, Profile, Queries, Rope};
use codec_core::{Sample, Tensor};
use proptest::prelude::*;

/// A 2-layer f32 cache of 12 tokens (2 heads of 4) with outliers, its profile (learned
/// with queries: the importance policy is on) and its source bytes.
fn setup() -> (KvCache, Profile, Vec<u8>) {
    let shape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: 4,
        tokens: 12,
    };
    let t = |s: f32| {
        let x = (0..96).map(|i| (i as f32 * s).sin() * if i % 17 == 0 { 90.0 } else { 1.0 });
        Tensor::F32(x.collect())
    };
    let cache = KvCache {
        shape,
        k: vec![t(0.3), t(0.5)],
        v: vec![t(0.7), t(1.1)],
        meta: KvMeta::default(),
    };
    let q: Vec<f32> = (0..96).map(|i| (i as f32 * 0.9).cos()).collect();
    let queries = Queries {
        q: vec![&q, &q],
        q_heads: 2,
        q_start: 0,
    };
    let sample = Sample {
        kv: cache.view(),
        queries: Some(queries),
    };
    let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
    let src = [0.3f32, 0.7, 0.5, 1.1]
        .into_iter()
        .flat_map(|s| t(s).to_f32_vec())
        .flat_map(f32::to_le_bytes)
        .collect();
    (cache, profile, src)
}

/// Edge values for a field.
fn wild() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::from(u32::MAX)),
        Just(u64::MAX),
        Just(u64::MAX / 4 + 1),
        0u64..4096,
    ]
}

/// Sets field `f` (of 18) of `b` to `v` (truncated for 32-bit fields).
fn set_block_field(b: &mut EncBlock, f: usize, v: u64) {
    let w = v as u32;
    match f {
        0 => b.x_start = v,
        1 => b.k_start = v,
        2 => b.qref_start = v,
        3 => b.tau_start = v,
        4 => b.consts_start = v,
        5 => b.map_start = v,
        6 => b.sym_start = v,
        7 => b.q_start = v,
        8 => b.escape_start = v,
        9 => b.word_start = v,
        10 => b.rows = w,
        11 => b.sink_rows = w,
        12 => b.group = w,
        13 => b.importance = w,
        14 => b.table_start = w,
        15 => b.table_count = w,
        16 => b.lane_cap = w,
        _ => b.chunk = w,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn malformed_records_give_defined_statuses(
        block in 0usize..8,
        field in 0usize..18,
        value in wild(),
        chunk_field in 0usize..4,
        chunk_value in wild(),
        result_field in 0usize..5,
        result_value in wild(),
        lane in 0usize..32,
    ) {
        let (cache, profile, src) = setup();
        let ctx = context(&cache, &profile);
        let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
        plan.add_chunk(0..7, 0).unwrap();
        plan.add_chunk(5..12, 1).unwrap();
        let mut ch = plan.chain().unwrap();
        set_block_field(&mut ch.blocks[block], field, value);
        let mut run = HostRun::new(&ch, 0);
        plan.blocks_host(&ch, &src, &mut run).unwrap();
        prop_assert!(run.results.iter().all(|r| r.status <= 2));
        run.lanes_host(&ch).unwrap();
        prop_assert!(run.lane_status.iter().all(|&s| s <= 2));
        // Results and lane lengths as a malformed launch might leave them.
        let r = &mut run.results[block];
        let w = result_value as u32;
        match result_field {
            0 => r.status = w,
            1 => r.n_escapes = w,
            2 => r.n_exp = w,
            3 => run.lane_len[block * LANES + lane] = w,
            _ => {}
        }
        let c = &mut ch.chunks[block / 4];
        match chunk_field {
            0 => c.first_block = chunk_value,
            1 => c.cap = chunk_value,
            2 => c.n_blocks = chunk_value as u32,
            _ => {}
        }
        plan.write_host(&ch, &src, &mut run).unwrap();
        for (c, r) in ch.chunks.iter().zip(&run.chunk_results) {
            prop_assert!(r.status <= 1);
            prop_assert!(r.status != 0 || r.len <= c.cap);
        }
        for (c, r) in run.chunk_results.iter().zip(&run.seal_results) {
            prop_assert!(r.status <= 1);
            prop_assert!(r.status != 0 || r.len == c.len + 4);
            prop_assert!(r.start.saturating_add(r.len) <= ch.n_sealed() as u64);
        }
    }

    /// The last three launches against a plain writer of §5.2's block layout and a second
    /// CRC-32C (the `crc` crate): every chunk whose blocks all ended well and whose body
    /// fits its room, after the ones before it, its CRC after it; the others left out.
    /// Blocks of any size (no lane words to hundreds, sink rows, escapes, exponent
    /// tables), chunks of 0-4 blocks, the kept outputs filled with garbage first.
    #[test]
    fn written_chunks_are_a_plain_writers_with_their_crcs(
        chunks in prop::collection::vec(
            (prop::collection::vec(any_block(), 0..5), 0u64..4),
            1..6,
        ),
        seed in any::<u64>(),
    ) {
        let mut w = SyntheticWrite::new(seed);
        for (blocks, room) in &chunks {
            w.add_chunk(blocks, *room);
        }
        let crc32c = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
        let got = w.run();
        let mut at = 0usize;
        for (c, want) in w.want.iter().enumerate() {
            let r = &got.seal_results[c];
            prop_assert_eq!(r.start, at as u64);
            let Some(body) = want else {
                prop_assert_eq!((r.len, r.status), (0, 1));
                continue;
            };
            prop_assert_eq!((r.len, r.status), (body.len() as u64 + 4, 0));
            prop_assert_eq!(&got.sealed[at..at + body.len()], &body[..]);
            let crc = crc32c.checksum(body).to_le_bytes();
            prop_assert_eq!(&got.sealed[at + body.len()..at + body.len() + 4], &crc[..]);
            at += body.len() + 4;
        }
    }
}

/// A synthetic block for [`SyntheticWrite`]: sink rows, escapes, exponent symbols (1
/// stands for none), words per lane (up to the lane's room), and how it ends (0: its
/// result failed, 1: a lane failed, else well).
type AnyBlock = (u32, u32, u32, Vec<u32>, u32);

fn any_block() -> impl Strategy<Value = AnyBlock> {
    (0u32..3, 0u32..40, 0u32..17, 0u32..12).prop_flat_map(|(sink, esc, exp, cap)| {
        let lanes = prop::collection::vec(0..=cap, 32);
        (Just(sink), Just(esc), Just(exp), lanes, 0u32..12)
    })
}

/// The inputs of the last three launches built by hand, and what a plain writer makes of
/// each chunk (`None` if it is left out).
struct SyntheticWrite {
    rng: u64,
    src: Vec<u8>,
    blocks: Vec<EncBlock>,
    results: Vec<EncResult>,
    escapes: Vec<i32>,
    words: Vec<u32>,
    lane_len: Vec<u32>,
    lane_status: Vec<u32>,
    chunks: Vec<ChunkOut>,
    want: Vec<Option<Vec<u8>>>,
}

/// What the launches leave: the sealed buffer and the seal results.
struct Written {
    sealed: Vec<u8>,
    seal_results: Vec<SealResult>,
}

/// Channels of the synthetic blocks (one head of 4), bytes per source element.
const SYN_C: u32 = 4;
const SYN_ELEM: usize = 2;

impl SyntheticWrite {
    fn new(seed: u64) -> Self {
        let mut w = SyntheticWrite {
            rng: seed | 1,
            src: Vec::new(),
            blocks: Vec::new(),
            results: Vec::new(),
            escapes: Vec::new(),
            words: Vec::new(),
            lane_len: Vec::new(),
            lane_status: Vec::new(),
            chunks: Vec::new(),
            want: Vec::new(),
        };
        w.src = (0..64 * SYN_C as usize * SYN_ELEM)
            .map(|_| w.next() as u8)
            .collect();
        w
    }

    /// A xorshift step.
    fn next(&mut self) -> u32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 32) as u32
    }

    /// Adds a chunk of `blocks`; its room is its body's length, one byte less (`room`
    /// 0) or more.
    fn add_chunk(&mut self, blocks: &[AnyBlock], room: u64) {
        let first_block = self.blocks.len() as u64;
        let mut body = Some(Vec::new());
        for b in blocks {
            let bytes = self.add_block(b, self.chunks.len() as u32);
            body = body.zip(bytes).map(|(mut body, bytes)| {
                body.extend(bytes);
                body
            });
        }
        let len = body.as_ref().map_or(0, |b| b.len() as u64);
        let cap = if room == 0 {
            len.saturating_sub(1)
        } else {
            len + room
        };
        self.want.push(body.filter(|b| b.len() as u64 <= cap));
        self.chunks.push(ChunkOut {
            first_block,
            cap,
            n_blocks: blocks.len() as u32,
            reserved: 0,
        });
    }

    /// Adds a block of chunk `chunk`; returns its bytes as §5.2 lays them out, if it
    /// ends well.
    fn add_block(&mut self, b: &AnyBlock, chunk: u32) -> Option<Vec<u8>> {
        let (sink, n_escapes, exp, lens, ends) = b;
        let n_exp = if *exp == 1 { 0 } else { *exp };
        let lane_cap = lens.iter().copied().max().unwrap_or(0) + ends % 3;
        let x_row = self.next() % (64 - sink);
        let mut freqs = [0u16; 16];
        freqs.iter_mut().for_each(|f| *f = self.next() as u16);
        let block = EncBlock {
            x_start: u64::from(x_row * SYN_C),
            escape_start: self.escapes.len() as u64,
            word_start: self.words.len() as u64,
            sink_rows: *sink,
            lane_cap,
            chunk,
            ..EncBlock::default()
        };
        let result = EncResult {
            status: u32::from(*ends == 0),
            n_escapes: *n_escapes,
            n_exp,
            exp_freqs: freqs,
            ..EncResult::default()
        };
        for _ in 0..*n_escapes {
            let e = self.next() as i32;
            self.escapes.push(e);
        }
        for _ in 0..lane_cap as usize * LANES {
            let w = self.next();
            self.words.push(w);
        }
        self.lane_len.extend(lens);
        let failed_lane = (self.next() % 32) as usize;
        self.lane_status
            .extend((0..LANES).map(|l| u32::from(*ends == 1 && l == failed_lane)));
        self.blocks.push(block);
        self.results.push(result);
        (*ends > 1).then(|| self.plain_block(&block, &result, lens))
    }

    /// A block's bytes written plainly: n_escapes, the lane lengths, n_exp and the
    /// exponent table, the sink rows' stored bytes, the escape values, the lane words.
    fn plain_block(&self, b: &EncBlock, r: &EncResult, lens: &[u32]) -> Vec<u8> {
        let mut o = r.n_escapes.to_le_bytes().to_vec();
        lens.iter().for_each(|l| o.extend(l.to_le_bytes()));
        o.push(r.n_exp as u8);
        let freqs = &r.exp_freqs[..r.n_exp as usize];
        freqs.iter().for_each(|f| o.extend(f.to_le_bytes()));
        let x = b.x_start as usize * SYN_ELEM;
        o.extend(&self.src[x..x + (b.sink_rows * SYN_C) as usize * SYN_ELEM]);
        let escapes = &self.escapes[b.escape_start as usize..][..r.n_escapes as usize];
        escapes.iter().for_each(|e| o.extend(e.to_le_bytes()));
        for (l, &n) in lens.iter().enumerate() {
            let first = b.word_start as usize + l * b.lane_cap as usize;
            let lane = &self.words[first..first + n as usize];
            lane.iter().for_each(|w| o.extend(w.to_le_bytes()));
        }
        o
    }

    /// The three launches on the host, over outputs holding garbage.
    fn run(&self) -> Written {
        let rooms: u64 = self.chunks.iter().map(|c| c.cap).sum();
        let mut sealed = vec![0xA5; rooms as usize + 4 * self.chunks.len()];
        let mut seal_results = vec![SealResult::default(); self.chunks.len()];
        let mut block_at = vec![0x5A5A_5A5A_5A5A_5A5A; self.blocks.len()];
        let mut chunk_results = vec![ChunkResult::default(); self.chunks.len()];
        ffi::host_write_chunks(ffi::WriteIo {
            src: &self.src,
            elem_bytes: SYN_ELEM as u32,
            heads: 1,
            head_dim: SYN_C,
            blocks: &self.blocks,
            results: &self.results,
            escapes: &self.escapes,
            words: &self.words,
            lane_len: &self.lane_len,
            lane_status: &self.lane_status,
            block_at: &mut block_at,
            chunks: &self.chunks,
            chunk_results: &mut chunk_results,
            sealed: &mut sealed,
            seal_results: &mut seal_results,
        })
        .unwrap();
        Written {
            sealed,
            seal_results,
        }
    }
}

/// The chunk context of [`setup`]'s cache (importance policy on: queries at 12).
fn context<'p>(cache: &KvCache, profile: &'p Profile) -> ChunkContext<'p> {
    ChunkContext::new(cache.shape, Dtype::F32, 0, 3, 2, profile, Rope::default())
        .unwrap()
        .with_query_position(Some(12))
}

/// [`setup`]'s source bytes: f32, every tensor 96 elements after the one before.
const SOURCE: Source = Source {
    dtype: Dtype::F32,
    base: 0,
    tensor_stride: 96,
};

/// Unaltered records: every block and chunk ends well (the test above alters one of each).
#[test]
fn intact_records_end_well() {
    let (cache, profile, src) = setup();
    let ctx = context(&cache, &profile);
    let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
    plan.add_chunk(0..7, 0).unwrap();
    plan.add_chunk(5..12, 1).unwrap();
    let got = plan.encode_host(&src).unwrap();
    assert_eq!(got[1], ctx.encode_chunk(&cache.view(), 5..12, 1).unwrap());
}

/// Chunks copied into vectors on any thread count are the chunks, in order.
#[test]
fn chunks_copied_on_threads_are_the_chunks() {
    let big: Vec<u8> = (0..3 << 20).map(|i| (i * 7 % 251) as u8).collect();
    let cuts = [0, 5, 5, 700_000, 1 << 20, 1_500_001, 3 << 20];
    let chunks: Vec<&[u8]> = cuts.windows(2).map(|w| &big[w[0]..w[1]]).collect();
    for threads in [1, 2, 3, 4, 6, 7, 64] {
        let got = copy_chunks(&chunks, threads);
        assert!(
            got.iter().map(Vec::as_slice).eq(chunks.iter().copied()),
            "{threads}"
        );
    }
    assert!(copy_chunks(&[], 4).is_empty());
    assert_eq!(copy_chunks(&[&[1, 2][..], &[]], 2), [vec![1, 2], vec![]]);
}

/// The copy-back parts of chunks one after another: runs of whole chunks from the first
/// to the last, none empty, at most as many as asked, as many where the chunks are
/// equal and enough, each within a chunk of its equal share of the bytes.
#[test]
fn copy_back_parts_are_runs_of_about_equal_bytes() {
    let places = |lens: &[usize]| -> Vec<Range<usize>> {
        let mut at = 0;
        lens.iter()
            .map(|&n| {
                at += n;
                at - n..at
            })
            .collect()
    };
    assert_eq!(part_starts(&[], 4), [0, 0]);
    assert_eq!(part_starts(&places(&[9]), 4), [0, 1]);
    assert_eq!(part_starts(&places(&[10; 10]), 4), [0, 3, 5, 8, 10]);
    assert_eq!(part_starts(&places(&[10; 8]), 0), [0, 8]);
    let cases: [&[usize]; 4] = [
        &[1, 1000, 1, 1],
        &[0, 0, 5, 0, 7],
        &[3; 17],
        &[500, 1, 1, 1],
    ];
    for lens in cases {
        let p = places(lens);
        let total = p.last().map_or(0, |r| r.end);
        let largest = lens.iter().max().copied().unwrap_or(0);
        for parts in 1..8 {
            let starts = part_starts(&p, parts);
            assert_eq!((starts[0], *starts.last().unwrap()), (0, p.len()));
            assert!(starts.windows(2).all(|w| w[0] < w[1]), "{lens:?} {parts}");
            assert!(starts.len() - 1 <= parts, "{lens:?} {parts}");
            for (k, &c) in starts[1..starts.len() - 1].iter().enumerate() {
                let end = p[c - 1].end;
                let share = total * (k + 1) / parts;
                assert!(end + largest >= share && end <= share + largest, "{lens:?}");
            }
        }
    }
}

/// A plan cut into pieces of about so many blocks: runs of whole chunks, in order, of
/// about equal blocks, none empty; each piece's chain run on the host alone seals its
/// chunks as the whole plan's chain does, so the pieces' chunks in order are the plan's.
#[test]
fn pieces_encode_to_the_whole_plans_chunks() {
    let (cache, profile, src) = setup();
    let ctx = context(&cache, &profile);
    let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
    for i in 0..6u32 {
        plan.add_chunk(i..12 - i, (i % 3) as u8).unwrap();
    }
    let want = plan.encode_host(&src).unwrap();
    // 6 chunks of 2 layers' K and V: 24 blocks.
    for (piece_blocks, n) in [(0, 1), (24, 1), (100, 1), (12, 2), (8, 3), (5, 5), (1, 6)] {
        let pieces = plan.pieces(piece_blocks);
        assert_eq!(pieces.len(), n, "{piece_blocks} blocks a piece: {pieces:?}");
        assert_eq!(pieces.first().map(|p| p.start), Some(0));
        assert_eq!(pieces.last().map(|p| p.end), Some(plan.chunks()));
        assert!(pieces.windows(2).all(|w| w[0].end == w[1].start));
        let sizes: Vec<usize> = pieces.iter().map(ExactSizeIterator::len).collect();
        assert!(
            sizes.iter().all(|&s| s > 0 && s.abs_diff(sizes[0]) <= 1),
            "{sizes:?}"
        );
        let mut got = Vec::new();
        for p in pieces {
            let ch = plan.chain_of(&LevelCache::default(), p).unwrap();
            got.extend(plan.run_chain_host(&ch, &src, 0xA5).unwrap());
        }
        assert!(got == want, "{piece_blocks} blocks a piece");
    }
    let past = plan.chain_of(&LevelCache::default(), 5..7);
    assert!(matches!(past, Err(CudaError::Input { .. })));
    let empty = EncodePlan::new(&ctx, SOURCE).unwrap();
    for piece_blocks in [0, 8] {
        assert_eq!(empty.pieces(piece_blocks), vec![0..0]);
    }
}

/// Level constants placed elsewhere (after other constants, as a `Gpu` keeps them resident
/// on its device): the chain's blocks point at them, and the launches over those arrays
/// write the chain's own chunks.
#[test]
fn placed_level_constants_encode_as_the_chains_own() {
    let (cache, profile, src) = setup();
    let ctx = context(&cache, &profile);
    let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
    for (tokens, level) in [(0..4, 0), (4..12, 1), (0..12, 0), (9..12, 2)] {
        plan.add_chunk(tokens, level).unwrap();
    }
    let want = plan.encode_host(&src).unwrap();
    let mut elsewhere = PlacedElsewhere::new();
    let mut place = |h: &[u8; 32], l: u8, c: &Arc<LevelConsts>| elsewhere.place(h, l, c);
    let cache = LevelCache::default();
    let mut ch = plan
        .chain_placed(&cache, 0..plan.chunks(), Some(&mut place))
        .unwrap();
    assert!(ch.map.is_empty() && ch.consts.is_empty());
    assert_eq!(elsewhere.levels(), 3);
    (ch.map, ch.consts) = (elsewhere.maps, elsewhere.consts);
    assert_eq!(plan.run_chain_host(&ch, &src, 0).unwrap(), want);
}

/// Table lists longer than the radii `kvc_encode_blocks` keeps in shared memory (256
/// entries): each block's list given 256 more entries before its level's tables (the maps'
/// indices moved past them), the radii of the indices past 256 read from device memory: the
/// same chunks.
#[test]
fn long_table_lists_encode_the_same_chunks() {
    let (cache, profile, src) = setup();
    let ctx = context(&cache, &profile);
    let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
    plan.add_chunk(0..12, 0).unwrap();
    plan.add_chunk(3..9, 2).unwrap();
    let want = plan.encode_host(&src).unwrap();
    let mut ch = plan.chain().unwrap();
    let old = std::mem::take(&mut ch.table_list);
    for b in &mut ch.blocks {
        let list = &old[b.table_start as usize..][..b.table_count as usize];
        b.table_start = ch.table_list.len() as u32;
        b.table_count += 256;
        ch.table_list.push(list[0]);
        ch.table_list.extend(std::iter::repeat_n(list[1], 256));
        ch.table_list.extend_from_slice(&list[1..]);
    }
    ch.map.iter_mut().for_each(|i| *i += 256);
    assert_eq!(plan.run_chain_host(&ch, &src, 0).unwrap(), want);
}

/// The launches read none of their large outputs before writing them: whatever those
/// buffers hold before the first launch (a `Gpu` keeps them from call to call, unzeroed),
/// the chunks are codec-core's, byte for byte.
#[test]
fn chunks_do_not_depend_on_what_the_kept_outputs_held() {
    let (cache, profile, src) = setup();
    let ctx = context(&cache, &profile);
    let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
    let chunks = [(0..4, 0), (4..12, 1), (0..12, 2), (9..12, 0)];
    for (tokens, level) in chunks.iter().cloned() {
        plan.add_chunk(tokens, level).unwrap();
    }
    let want: Vec<Vec<u8>> = chunks
        .iter()
        .map(|(t, l)| ctx.encode_chunk(&cache.view(), t.clone(), *l).unwrap())
        .collect();
    for fill in [0x00, 0x01, 0x5A, 0xA5, 0x80, 0xFF] {
        assert_eq!(
            plan.encode_host_over(&src, fill).unwrap(),
            want,
            "fill {fill:#x}"
        );
    }
}
