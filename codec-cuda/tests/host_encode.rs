//! The encode kernels (`kernels/encode.cu`), compiled for the host: quantization equal to
//! codec-core's `quantize_block` and the lane encoder equal to codec-core's `encode_lanes` on
//! proptest inputs, and on the real fixture every block of a stream codec-core encoded (step
//! exponents, three levels) re-encoded by the kernels to the same symbol values, the same
//! table indices and the same lane words, word for word.

mod common;

use codec_core::quant::{quantize_block, BlockConsts, ChannelParams, Exps};
use codec_core::rans::{encode_lanes, FreqTable};
use codec_core::{Limits, Stream};
use codec_cuda::encode::{EncTableId, EncodeStatus, LaneEncodeBatch, QuantBatch};
use codec_cuda::quant::ChannelConsts;
use codec_cuda::stream::ChunkLanes;
use proptest::prelude::*;

/// One quantization case: shape, channel parameters, rows and exponents.
#[derive(Clone, Debug)]
struct QuantCase {
    heads: usize,
    head_dim: usize,
    params: Vec<ChannelParams>,
    mult: f32,
    group: usize,
    sink_rows: usize,
    x: Vec<f32>,
    exps: Option<Vec<u8>>,
}

/// Values: small multiples of 1/8 (exact halves of the steps below, the rounding boundary),
/// ordinary reals, or magnitudes that clamp to +-MAX_SYMBOL.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        (-40i32..40).prop_map(|k| k as f32 / 8.0),
        -4.0f32..4.0,
        prop_oneof![Just(3.0e9f32), Just(-3.0e9f32), -1.0e7f32..1.0e7],
    ]
}

fn quant_case() -> impl Strategy<Value = QuantCase> {
    (1usize..=3, 1usize..=5, 0usize..14, 1usize..=5, 0usize..3)
        .prop_flat_map(|(heads, head_dim, rows, group, sink)| {
            let c = heads * head_dim;
            let sink_rows = sink.min(rows);
            let param = (
                -1.0f32..1.0,
                prop_oneof![Just(0.25f32), Just(0.5f32), 0.01f32..2.0],
                prop_oneof![Just(0.125f32), Just(0.5f32), 0.01f32..2.0],
                0u8..=16,
            )
                .prop_map(|(mean, delta_step, anchor_step, weight)| ChannelParams {
                    mean,
                    delta_step,
                    anchor_step,
                    weight,
                });
            (
                Just((heads, head_dim, group, sink_rows)),
                prop::collection::vec(param, c),
                prop_oneof![Just(1.0f32), Just(0.5f32), 0.1f32..4.0],
                prop::collection::vec(value(), rows * c),
                prop::option::of(prop::collection::vec(0u8..16, (rows - sink_rows) * heads)),
            )
        })
        .prop_map(
            |((heads, head_dim, group, sink_rows), params, mult, x, exps)| QuantCase {
                heads,
                head_dim,
                params,
                mult,
                group,
                sink_rows,
                x,
                exps,
            },
        )
}

/// codec-core's symbols for a case.
fn quant_reference(c: &QuantCase) -> Vec<i32> {
    let consts = BlockConsts::new(&c.params, c.mult);
    let exps = Exps {
        exps: c.exps.as_deref().unwrap_or(&[]),
        head_dim: c.head_dim,
    };
    let mut symbols = Vec::new();
    let mut recon = vec![0.0f32; c.x.len()];
    quantize_block(
        &c.x,
        &consts,
        c.group,
        c.sink_rows,
        exps,
        &mut symbols,
        &mut recon,
    );
    symbols
}

/// A table from counts (every symbol at least frequency 1).
fn table() -> impl Strategy<Value = FreqTable> {
    let counts = prop_oneof![
        prop::collection::vec(0u64..1000, 2..12),
        prop::collection::vec(prop_oneof![Just(0u64), 0u64..1 << 40], 2..=256),
    ];
    counts.prop_map(|c| FreqTable::from_counts(&c))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every block of a launch quantizes to codec-core's symbols.
    #[test]
    fn quantization_is_codec_cores(cases in prop::collection::vec(quant_case(), 1..4)) {
        let (heads, head_dim) = (cases[0].heads, cases[0].head_dim);
        let cases: Vec<_> = cases.into_iter().filter(|c| c.heads == heads && c.head_dim == head_dim).collect();
        let mut batch = QuantBatch::new(heads as u32, head_dim as u32);
        for c in &cases {
            let consts = ChannelConsts::of_block(&c.params, c.mult);
            let start = batch.add_consts(&consts);
            batch.add_block(&c.x, c.sink_rows as u32, c.group as u32, c.exps.as_deref(), start).unwrap();
        }
        let got = batch.quantize_host().unwrap();
        for (c, (values, status)) in cases.iter().zip(&got) {
            prop_assert_eq!(*status, EncodeStatus::Ok);
            prop_assert_eq!(values, &quant_reference(c));
        }
    }

    /// Every block of a launch encodes to codec-core's lane words.
    #[test]
    fn lane_encoding_is_codec_cores(
        tables in prop::collection::vec(table(), 1..4),
        blocks in prop::collection::vec(prop::collection::vec((any::<usize>(), any::<u8>()), 0..1200), 1..4),
    ) {
        let mut batch = LaneEncodeBatch::new();
        let ids: Vec<EncTableId> = tables.iter().map(|t| batch.add_table(t)).collect();
        let mut want = Vec::new();
        for b in &blocks {
            let per: Vec<usize> = b.iter().map(|&(t, _)| t % tables.len()).collect();
            let symbols: Vec<u8> = b
                .iter()
                .zip(&per)
                .map(|(&(_, s), &t)| (usize::from(s) % tables[t].len()) as u8)
                .collect();
            let tids: Vec<EncTableId> = per.iter().map(|&t| ids[t]).collect();
            batch.add_block(&symbols, &tids).unwrap();
            want.push(encode_lanes(&symbols, |g| &tables[per[g]]));
        }
        let got = batch.encode_host().unwrap();
        for (i, w) in want.iter().enumerate() {
            prop_assert_eq!(&got.lanes(i).unwrap(), w);
        }
    }

    /// Any quantization block header: a defined status, no out-of-bounds access.
    #[test]
    fn arbitrary_quant_headers_never_crash(
        fields in any::<(u64, u64, u64, u64, u32, u32, u32, u32)>(),
        which in 0u8..8,
    ) {
        let consts = vec![ChannelConsts { mean: 0.5, anchor_step: 0.25, delta_step: 0.125, weight: 0.5 }; 4];
        let mut batch = QuantBatch::new(2, 2);
        let start = batch.add_consts(&consts);
        batch.add_block(&[1.0; 20], 1, 3, Some(&[1; 8]), start).unwrap();
        batch.add_block(&[2.0; 20], 1, 3, Some(&[2; 8]), start).unwrap();
        let b = &mut batch.blocks_mut()[0];
        match which {
            0 => b.x_start = fields.0,
            1 => b.exp_start = fields.1,
            2 => b.q_start = fields.2,
            3 => b.consts_start = fields.3,
            4 => b.rows = fields.4,
            5 => b.sink_rows = fields.5,
            6 => b.group = fields.6,
            _ => b.has_exps = fields.7,
        }
        let got = batch.quantize_host().unwrap();
        prop_assert!(matches!(got[0].1, EncodeStatus::Ok | EncodeStatus::BadRange));
        prop_assert_eq!(got[1].1, EncodeStatus::Ok);
    }

    /// Any lane-encode block header: defined statuses, no out-of-bounds access.
    #[test]
    fn arbitrary_lane_encode_headers_never_crash(
        fields in any::<(u64, u64, u32, u32, u32, u32)>(),
        which in 0u8..6,
        symbols in prop::collection::vec(0u8..4, 0..200),
    ) {
        let t = FreqTable::from_counts(&[3, 1, 0, 7]);
        let mut batch = LaneEncodeBatch::new();
        let id = batch.add_table(&t);
        batch.add_block(&symbols, &vec![id; symbols.len()]).unwrap();
        batch.add_block(&symbols, &vec![id; symbols.len()]).unwrap();
        let b = &mut batch.blocks_mut()[0];
        match which {
            0 => b.symbol_start = fields.0,
            1 => b.word_start = fields.1,
            2 => b.n_symbols = fields.2,
            3 => b.lane_cap = fields.3,
            4 => b.table_start = fields.4,
            _ => b.table_count = fields.5,
        }
        let got = batch.encode_host().unwrap();
        prop_assert_eq!(got.lanes(1).unwrap(), encode_lanes(&symbols, |_| &t));
        let _ = got.lanes(0);
    }
}

#[test]
fn a_symbol_outside_its_table_is_bad_symbol() {
    let t = FreqTable::from_counts(&[3, 1]);
    let mut batch = LaneEncodeBatch::new();
    let id = batch.add_table(&t);
    batch.add_block(&[0, 1, 5, 0], &[id; 4]).unwrap();
    assert_eq!(
        batch.encode_host().unwrap().lanes(0).unwrap_err(),
        (2, EncodeStatus::BadSymbol)
    );
}

/// The real fixture (SmolLM2, 3 layers), encoded by codec-core with step exponents at three
/// levels in 96-token chunks: every block's rows re-quantized by the kernel give the stream's
/// symbol values, which map to the stream's table indices, which the lane encoder turns into
/// the stream's lane words.
#[test]
fn real_fixture_blocks_reencode_word_for_word() {
    let (bytes, tensors) = common::fixture_stream(3);
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let case = common::encode_case(&stream, &tensors, 1);
    let values = case.quant.quantize_host().unwrap();
    let lanes = case.enc.encode_host().unwrap();
    for (b, want) in case.values.iter().enumerate() {
        assert_eq!(values[b].1, EncodeStatus::Ok);
        assert!(&values[b].0 == want, "block {b}: symbol values");
        assert!(
            lanes.lanes(b).unwrap().to_vec() == case.lanes[b],
            "block {b}: lane words"
        );
    }
    let (mut with_exps, mut escapes) = (0, 0);
    for chunk in 0..stream.header().chunks.len() {
        for blk in ChunkLanes::read(&stream, chunk).unwrap().blocks {
            with_exps += usize::from(blk.exp_table.is_some());
            escapes += blk.escapes.len();
        }
    }
    println!(
        "{} blocks ({with_exps} with step exponents, {escapes} escapes) re-encoded",
        case.values.len()
    );
    assert!(with_exps > 0 && escapes > 0);
}
