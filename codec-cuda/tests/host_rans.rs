//! The rANS lane decode kernel, compiled for the host, against codec-core's lane encoder and
//! decoder: proptest symbol streams, corrupted words, and corrupted batch structure.

mod common;

use codec_core::consts::LANES;
use codec_core::rans::{encode_lanes, FreqTable};
use codec_cuda::rans::{LaneBatch, LaneShape, LaneStatus};
use common::{assert_matches_reference, outcome};
use proptest::prelude::*;

/// One coded block: each symbol's table (an index into the case's tables) and value.
#[derive(Clone, Debug)]
struct BlockCase {
    table_of: Vec<usize>,
    symbols: Vec<u8>,
}

/// Tables, blocks over them, and the launch's shape (coded blocks per CUDA block, tables each
/// stages in shared memory).
#[derive(Clone, Debug)]
struct Case {
    tables: Vec<FreqTable>,
    blocks: Vec<BlockCase>,
    shape: LaneShape,
}

/// A table from counts: many zero counts give frequency-1 symbols, the rANS extreme.
fn table() -> impl Strategy<Value = FreqTable> {
    let counts = prop_oneof![
        prop::collection::vec(0u64..1000, 2..12),
        prop::collection::vec(prop_oneof![Just(0u64), 0u64..1 << 40], 2..=256),
    ];
    counts.prop_map(|c| FreqTable::from_counts(&c))
}

/// A block over `n_tables` tables: symbols drawn in proportion to nothing in particular (a
/// mismatch between table and data only costs bits, which exercises long lanes).
fn block(tables: Vec<FreqTable>) -> impl Strategy<Value = BlockCase> {
    let n = tables.len();
    prop::collection::vec((0..n, any::<u8>()), 0..1200).prop_map(move |v| BlockCase {
        symbols: v
            .iter()
            .map(|&(t, s)| (usize::from(s) % tables[t].len()) as u8)
            .collect(),
        table_of: v.iter().map(|&(t, _)| t).collect(),
    })
}

/// A launch shape: 1 to 4 warps per CUDA block (so that 1 to 3 blocks often leave a CUDA block
/// part empty), as many shared tables as fit.
fn shape() -> impl Strategy<Value = LaneShape> {
    (1u32..=4)
        .prop_flat_map(|w| (Just(w), 0..=LaneShape::MAX_SHARED_TABLES / w))
        .prop_map(|(w, t)| LaneShape::new(w, t).unwrap())
}

fn case() -> impl Strategy<Value = Case> {
    prop::collection::vec(table(), 1..5)
        .prop_flat_map(|tables| {
            let blocks = prop::collection::vec(block(tables.clone()), 1..4);
            (Just(tables), blocks, shape())
        })
        .prop_map(|(tables, blocks, shape)| Case {
            tables,
            blocks,
            shape,
        })
}

/// A block's words and lane lengths as codec-core's encoder writes them.
fn encode(tables: &[FreqTable], b: &BlockCase) -> (Vec<u32>, [usize; LANES]) {
    let lanes = encode_lanes(&b.symbols, |g| &tables[b.table_of[g]]);
    (lanes.concat(), lanes.each_ref().map(Vec::len))
}

/// A changed copy of a block's words: what `Mutation` says, applied to a lane chosen by `pick`.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    FlipBit(usize, u32),
    DropLastWord(usize),
    AppendWord(usize, u32),
    ZeroLastWord(usize),
    MoveWord(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u32..32).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        any::<usize>().prop_map(Mutation::DropLastWord),
        (any::<usize>(), any::<u32>()).prop_map(|(p, w)| Mutation::AppendWord(p, w)),
        any::<usize>().prop_map(Mutation::ZeroLastWord),
        any::<usize>().prop_map(Mutation::MoveWord),
    ]
}

/// Applies `m` to the lanes `lanes` (a no-op where the chosen lane has no word to change).
fn mutate(lanes: &mut [Vec<u32>; LANES], m: Mutation) {
    let lane = |p: usize| p % LANES;
    match m {
        Mutation::FlipBit(p, bit) => {
            let l = &mut lanes[lane(p)];
            if !l.is_empty() {
                let i = (p / LANES) % l.len();
                l[i] ^= 1 << bit;
            }
        }
        Mutation::DropLastWord(p) => {
            lanes[lane(p)].pop();
        }
        Mutation::AppendWord(p, w) => lanes[lane(p)].push(w),
        Mutation::ZeroLastWord(p) => {
            if let Some(w) = lanes[lane(p)].last_mut() {
                *w = 0;
            }
        }
        Mutation::MoveWord(p) => {
            // A word leaves one lane for the next: lane boundaries shift, the words do not.
            if let Some(w) = lanes[lane(p)].pop() {
                lanes[lane(p + 1)].insert(0, w);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Valid streams: every block decodes to exactly the encoded symbols, every lane ends OK,
    /// and the kernel agrees with codec-core's decoder, whichever tables sit in shared memory
    /// and however many blocks share a CUDA block.
    #[test]
    fn kernel_decodes_what_codec_core_encodes(case in case()) {
        let mut batch = LaneBatch::new();
        let ids: Vec<_> = case.tables.iter().map(|t| batch.add_table(t)).collect();
        let mut coded = Vec::new();
        for b in &case.blocks {
            let (words, lane_len) = encode(&case.tables, b);
            let per_symbol: Vec<_> = b.table_of.iter().map(|&t| ids[t]).collect();
            batch.add_block(&words, lane_len, &per_symbol).unwrap();
            coded.push((words, lane_len));
        }
        let got = batch.decode_host_shaped(case.shape).unwrap();
        for (i, (b, (words, lane_len))) in case.blocks.iter().zip(&coded).enumerate() {
            prop_assert_eq!(got.symbols(i), &b.symbols[..]);
            prop_assert!(got.status(i).iter().all(|s| *s == LaneStatus::Ok));
            let tables: Vec<_> = b.table_of.iter().map(|&t| &case.tables[t]).collect();
            assert_matches_reference(&got, i, words, *lane_len, &tables);
        }
    }

    /// Corrupted words: the kernel reports what codec-core reports, and decodes the same
    /// symbols, never crashing.
    #[test]
    fn corrupted_words_give_codec_core_errors(case in case(), muts in prop::collection::vec(mutation(), 1..4)) {
        let mut batch = LaneBatch::new();
        let ids: Vec<_> = case.tables.iter().map(|t| batch.add_table(t)).collect();
        let mut coded = Vec::new();
        for b in &case.blocks {
            let mut lanes = encode_lanes(&b.symbols, |g| &case.tables[b.table_of[g]]);
            muts.iter().for_each(|&m| mutate(&mut lanes, m));
            let (words, lane_len) = (lanes.concat(), lanes.each_ref().map(Vec::len));
            let per_symbol: Vec<_> = b.table_of.iter().map(|&t| ids[t]).collect();
            batch.add_block(&words, lane_len, &per_symbol).unwrap();
            coded.push((words, lane_len));
        }
        let got = batch.decode_host_shaped(case.shape).unwrap();
        for (i, (b, (words, lane_len))) in case.blocks.iter().zip(&coded).enumerate() {
            let tables: Vec<_> = b.table_of.iter().map(|&t| &case.tables[t]).collect();
            assert_matches_reference(&got, i, words, *lane_len, &tables);
        }
    }

    /// Arbitrary block headers (ranges, table lists) and table indices: the launch finishes and
    /// every lane gets a defined status. (Out-of-bounds accesses are excluded by the kernel's
    /// checks; this test drives them with values near and far from the real ones.)
    #[test]
    fn arbitrary_block_headers_never_crash(
        case in case(),
        fields in prop::collection::vec((any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<[u32; 32]>(), 0u8..6), 1..4),
        bad_index in any::<(usize, u16)>(),
    ) {
        let mut batch = LaneBatch::new();
        let ids: Vec<_> = case.tables.iter().map(|t| batch.add_table(t)).collect();
        for b in &case.blocks {
            let (words, lane_len) = encode(&case.tables, b);
            let per_symbol: Vec<_> = b.table_of.iter().map(|&t| ids[t]).collect();
            batch.add_block(&words, lane_len, &per_symbol).unwrap();
        }
        for (blk, f) in batch.blocks_mut().iter_mut().zip(&fields) {
            // Small values often (near the real ones), huge ones sometimes.
            match f.6 {
                0 => blk.word_start = f.0,
                1 => blk.symbol_start = f.1,
                2 => blk.n_symbols = f.2,
                3 => blk.table_start = f.3,
                4 => blk.table_count = f.4,
                _ => blk.lane_len = f.5,
            }
        }
        let n = batch.symbol_tables_mut().len();
        if n > 0 {
            batch.symbol_tables_mut()[bad_index.0 % n] = bad_index.1;
        }
        let got = batch.decode_host_shaped(case.shape).unwrap();
        for i in 0..case.blocks.len() {
            prop_assert_eq!(got.status(i).len(), LANES);
            prop_assert!(got.status(i).iter().all(|s| !matches!(s, LaneStatus::Unknown(_))));
        }
    }
}

/// Four blocks over one table (the same block four times), for tests that spoil some.
fn small_batch() -> (LaneBatch, Vec<u8>) {
    small_batch_of(4)
}

/// `n` copies of a 300-symbol block over one table.
fn small_batch_of(n: usize) -> (LaneBatch, Vec<u8>) {
    let t = FreqTable::new(&[1000, 3000, 96]).unwrap();
    let symbols: Vec<u8> = (0..300u32).map(|i| (i * 7 % 3) as u8).collect();
    let lanes = encode_lanes(&symbols, |_| &t);
    let mut batch = LaneBatch::new();
    let id = batch.add_table(&t);
    let words = lanes.concat();
    for _ in 0..n {
        batch
            .add_block(&words, lanes.each_ref().map(Vec::len), &vec![id; 300])
            .unwrap();
    }
    (batch, symbols)
}

#[test]
fn block_ranges_outside_the_batch_are_bad_range() {
    let (mut batch, symbols) = small_batch();
    batch.blocks_mut()[1].word_start = u64::MAX;
    batch.blocks_mut()[2].n_symbols = u32::MAX;
    batch.blocks_mut()[3].lane_len[31] = u32::MAX;
    let got = batch.decode_host(1).unwrap();
    assert_eq!(got.symbols(0), &symbols[..]);
    assert_eq!(outcome(&got, 0), Ok(()));
    for b in 1..4 {
        assert!(
            got.status(b).iter().all(|s| *s == LaneStatus::BadRange),
            "block {b}"
        );
    }
}

/// Every launch shape gives the same symbols and statuses, good blocks and bad ones alike,
/// with the last CUDA block part empty or full; shapes past the limits are refused.
#[test]
fn every_lane_shape_decodes_the_same() {
    let (mut batch, symbols) = small_batch_of(7);
    batch.blocks_mut()[2].lane_len[7] += 1; // lane 7 takes a word of lane 8, ...
    batch.blocks_mut()[6].lane_len[0] += 1; // the last block's lanes end past the words
    batch.symbol_tables_mut()[5 * 300 + 40] = 3; // lane 8 of block 5: BadTable
    let want = batch.decode_host(0).unwrap();
    assert_eq!(want.symbols(0), &symbols[..]);
    assert!(outcome(&want, 2).is_err());
    assert!(want.status(6).iter().all(|s| *s == LaneStatus::BadRange));
    assert_eq!(want.status(5)[8], LaneStatus::BadTable);
    for warps in [1, 2, 3, 4, 7, 8, 32] {
        for tables in [
            0,
            1.min(LaneShape::MAX_SHARED_TABLES / warps),
            LaneShape::MAX_SHARED_TABLES / warps,
        ] {
            let shape = LaneShape::new(warps, tables).unwrap();
            let got = batch.decode_host_shaped(shape).unwrap();
            for b in 0..7 {
                assert_eq!(got.symbols(b), want.symbols(b), "{shape:?} block {b}");
                assert_eq!(got.status(b), want.status(b), "{shape:?} block {b}");
            }
        }
    }
    assert!(LaneShape::new(0, 0).is_err());
    assert!(LaneShape::new(LaneShape::MAX_WARPS + 1, 0).is_err());
    assert!(LaneShape::new(2, LaneShape::MAX_SHARED_TABLES / 2 + 1).is_err());
}

#[test]
fn table_lists_and_indices_out_of_range_are_bad_table() {
    let (mut batch, _) = small_batch();
    batch.blocks_mut()[1].table_count = 4; // entries 1..5 of a 4-entry table list
    batch.blocks_mut()[2].table_start = 7;
    // Symbol 5 of block 3 (lane 5) names table 1 of a one-table block.
    batch.symbol_tables_mut()[3 * 300 + 5] = 1;
    for shared in [0, 1, LaneShape::MAX_SHARED_TABLES] {
        let got = batch.decode_host(shared).unwrap();
        assert_eq!(outcome(&got, 0), Ok(()));
        for b in 1..3 {
            assert!(
                got.status(b).iter().all(|s| *s == LaneStatus::BadTable),
                "block {b}"
            );
        }
        for (lane, s) in got.status(3).iter().enumerate() {
            let want = if lane == 5 {
                LaneStatus::BadTable
            } else {
                LaneStatus::Ok
            };
            assert_eq!(*s, want, "block 3 lane {lane}");
        }
    }
}

#[test]
fn spec_worked_example_decodes() {
    // spec/FORMAT.md §6.6: one lane (lane 0) with these words and table.
    let t = FreqTable::new(&[1, 4093, 1, 1]).unwrap();
    let mut batch = LaneBatch::new();
    let id = batch.add_table(&t);
    let mut lane_len = [0usize; LANES];
    lane_len[0] = 3;
    // Symbols p = 0, 32, 64, ... are lane 0's; the other lanes' positions are filled by
    // symbols the lanes without words decode as 0 (state 0, slot 0).
    let want = [3u8, 2, 0, 1, 3, 2, 0, 3];
    let n = 7 * LANES + 1;
    batch
        .add_block(
            &[0x1403C000, 0x70FFEFFF, 0x00100200],
            lane_len,
            &vec![id; n],
        )
        .unwrap();
    let got = batch.decode_host(0).unwrap();
    let lane0: Vec<u8> = got.symbols(0).iter().step_by(LANES).copied().collect();
    assert_eq!(lane0, want);
    assert_eq!(outcome(&got, 0), Ok(()));
}

#[test]
fn empty_and_degenerate_batches() {
    assert_eq!(LaneBatch::new().decode_host(0).unwrap().status(0), &[]);
    let mut batch = LaneBatch::new();
    batch.add_block(&[], [0; LANES], &[]).unwrap();
    let got = batch.decode_host(0).unwrap();
    assert!(got.status(0).iter().all(|s| *s == LaneStatus::Ok));
    assert!(batch.decode_host(LaneShape::MAX_SHARED_TABLES + 1).is_err());
    // A block whose lane lengths do not add up, or naming a table not added, is refused.
    assert!(batch.add_block(&[1], [0; LANES], &[]).is_err());
    let t = FreqTable::new(&[2048, 2048]).unwrap();
    let mut other = LaneBatch::new();
    let id = other.add_table(&t);
    assert!(batch.add_block(&[], [0; LANES], &[id]).is_err());
    assert_eq!(
        outcome(&LaneBatch::new().decode_host(0).unwrap(), 3),
        Ok(()),
        "no block 3: no status"
    );
}
