//! The 32-bit-state lane coder experiment (`codec_cuda::experiment`, not part of any format):
//! its host-run kernel decodes what its reference encoder wrote from the symbols and tables of
//! real v2 streams, and malformed words or headers give defined statuses. Also prints the
//! payload sizes of the two coders on the real fixture (spec/FORMAT.md's appendix "Proposed:
//! format v3 lane coder" quotes them).

#[path = "../benches/support/mod.rs"]
mod support;

use codec_core::rans::{encode_lanes, FreqTable};
use codec_cuda::experiment::Lane32Batch;
use codec_cuda::rans::{LaneBatch, LaneDecoded, LaneShape, LaneStatus};
use proptest::prelude::*;

/// The symbol launch of the fixture's stream at `level` (all 30 layers, 128-token chunks),
/// decoded by the v2 host kernel; with the stream's size and the elements it holds.
fn fixture_symbols(level: u8) -> (LaneBatch, LaneDecoded, usize, usize) {
    // Loaded and profiled once for the tests of this binary.
    static FIXTURE: std::sync::OnceLock<(kvc_io::Dump, codec_core::Profile)> =
        std::sync::OnceLock::new();
    let (d, profile) = FIXTURE.get_or_init(support::fixture);
    let bytes = support::stream_bytes(&d.kv, profile, level);
    let stream = support::open(&bytes);
    let plan = support::decode_plan(&stream, 1);
    let exp = plan.exponent_batch().unwrap().decode_host(4).unwrap();
    let exps = plan.exponents(&exp).unwrap();
    let batch = plan.symbol_batch(&exps).unwrap();
    let sym = batch.decode_host(4).unwrap();
    let elements = d.kv.shape.total_elements() as usize;
    (batch, sym, bytes.len(), elements)
}

#[test]
fn real_streams_reencoded_with_a_32_bit_state_decode_to_the_same_symbols() {
    println!("level | stream bits/el | v2 lane payload | 32-bit payload | difference bits/el");
    for level in [0u8, 6, 11] {
        let (batch, sym, stream_bytes, elements) = fixture_symbols(level);
        for b in 0..batch.blocks().len() {
            assert_eq!(sym.outcome(b), Ok(()), "v2 block {b}");
        }
        let b32 = Lane32Batch::encode(&batch, &sym).unwrap();
        let out = b32.decode_host(2).unwrap();
        for b in 0..batch.blocks().len() {
            assert_eq!(out.outcome(b), Ok(()), "level {level} block {b}");
            assert_eq!(out.symbols(b), sym.symbols(b), "level {level} block {b}");
        }
        // Shared memory or not: the same.
        let out0 = b32.decode_host(0).unwrap();
        assert!((0..batch.blocks().len()).all(|b| out0.symbols(b) == sym.symbols(b)));
        // One block per CUDA block or several: the same, for both kernels (the fixture's 240
        // blocks, the last CUDA block of 7 part empty; one level, for time).
        if level == 6 {
            let shape = LaneShape::new(7, 2).unwrap();
            let v2_in_7 = batch.decode_host_shaped(shape).unwrap();
            let b32_in_7 = b32.decode_host_shaped(shape).unwrap();
            for b in 0..batch.blocks().len() {
                assert_eq!(v2_in_7.outcome(b), Ok(()), "block {b}");
                assert_eq!(v2_in_7.symbols(b), sym.symbols(b), "block {b}");
                assert_eq!(b32_in_7.symbols(b), sym.symbols(b), "block {b}");
            }
        }
        let (v2, v3) = (batch.payload_bytes(), b32.payload_bytes());
        let bpe = |bytes: usize| bytes as f64 * 8.0 / elements as f64;
        assert!(v2 < stream_bytes, "the lane words are part of the stream");
        println!(
            "{level} | {:.4} | {v2} B ({:.4} bits/el) | {v3} B ({:.4} bits/el) | {:+.4}",
            bpe(stream_bytes),
            bpe(v2),
            bpe(v3),
            bpe(v3) - bpe(v2)
        );
    }
}

/// Seven blocks, each over a table of its own (so staged in shared memory), 3 or 7 per CUDA
/// block, each warp with its own tables: the symbols encoded, in both kernels.
#[test]
fn blocks_sharing_a_cuda_block_stage_their_own_tables() {
    let mut batch = LaneBatch::new();
    let mut want = Vec::new();
    for b in 0..7u32 {
        let t = FreqTable::from_counts(&[u64::from(1000 + 300 * b), u64::from(3000 - 200 * b), 96]);
        let symbols: Vec<u8> = (0..300 + b).map(|i| ((i * 7 + b) % 3) as u8).collect();
        let lanes = encode_lanes(&symbols, |_| &t);
        let id = batch.add_table(&t);
        let ids = vec![id; symbols.len()];
        batch
            .add_block(&lanes.concat(), lanes.each_ref().map(Vec::len), &ids)
            .unwrap();
        want.push(symbols);
    }
    let sym = batch.decode_host(0).unwrap();
    let b32 = Lane32Batch::encode(&batch, &sym).unwrap();
    for shape in [LaneShape::new(3, 4), LaneShape::new(7, 2)] {
        let shape = shape.unwrap();
        let (v2, s32) = (
            batch.decode_host_shaped(shape).unwrap(),
            b32.decode_host_shaped(shape).unwrap(),
        );
        for (b, symbols) in want.iter().enumerate() {
            assert_eq!(v2.outcome(b), Ok(()), "{shape:?} block {b}");
            assert_eq!(v2.symbols(b), &symbols[..], "{shape:?} block {b}");
            assert_eq!(s32.outcome(b), Ok(()), "{shape:?} block {b}");
            assert_eq!(s32.symbols(b), &symbols[..], "{shape:?} block {b}");
        }
    }
}

/// A small batch: the fixture's first 8 blocks at level 6.
fn small() -> (Lane32Batch, LaneDecoded) {
    let (batch, sym, _, _) = fixture_symbols(6);
    let b32 = Lane32Batch::encode(&batch, &sym).unwrap();
    (b32, sym)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Altered words: every lane ends with a defined status; where all lanes are OK the symbols
    /// may differ (the coder has no checksum), but nothing is read out of range.
    #[test]
    fn altered_words_and_headers_give_defined_statuses(
        edits in proptest::collection::vec((any::<usize>(), any::<u16>()), 1..8),
        header in proptest::option::of((any::<usize>(), 0usize..32, any::<u32>())),
    ) {
        let (mut b32, _) = SMALL.with(|s| s.clone());
        let words = b32.words_mut();
        let n = words.len();
        for (at, v) in &edits {
            words[at % n] = *v;
        }
        if let Some((blk, lane, len)) = header {
            let blocks = b32.blocks_mut();
            let k = blk % blocks.len();
            blocks[k].lane_len[lane] = len;
        }
        let out = b32.decode_host(2).unwrap();
        for b in 0..b32.blocks_mut().len() {
            for s in out.status(b) {
                prop_assert!(!matches!(s, LaneStatus::Unknown(_)), "{s:?}");
            }
        }
    }
}

thread_local! {
    static SMALL: (Lane32Batch, LaneDecoded) = small();
}

#[test]
fn a_lane_of_one_word_or_a_changed_final_state_is_reported() {
    let (b32, sym) = small();
    let mut short = b32.clone();
    short.blocks_mut()[0].lane_len[0] = 1;
    let out = short.decode_host(2).unwrap();
    // Lane 0 has one word: refused; lane 1 now starts a word early: some other failure.
    assert_eq!(out.status(0)[0], LaneStatus::ZeroFinalWord);
    assert_ne!(out.status(0)[1], LaneStatus::Ok);
    let mut flipped = b32.clone();
    flipped.words_mut()[0] ^= 1;
    let out = flipped.decode_host(2).unwrap();
    assert_ne!(out.outcome(0), Ok(()));
    assert!((1..8).all(|b| out.symbols(b) == sym.symbols(b)));
}
