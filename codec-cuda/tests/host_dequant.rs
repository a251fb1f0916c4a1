//! The dequantization kernel, compiled for the host, after the lane decode kernel: whole streams
//! decoded by the kernels to f16 `[T, H, D]` per layer K then V, compared bit for bit with the
//! golden outputs (`spec/vectors/*.out`), with codec-core's decode, and on a stream encoded from
//! the real 512-token fixture with step exponents.

mod common;

use codec_core::{
    decode, encode, Dtype, EncodeParams, Limits, ProfileMode, Stream, Tensor, TensorMut,
};
use codec_cuda::quant::{
    f32_to_f16_bits, ChannelConsts, DequantBatch, DequantInput, DequantStatus,
};
use codec_cuda::stream::{ChunkLanes, Destination};
use common::{golden, vectors_dir};
use half::f16;
use proptest::prelude::*;

/// Decodes a whole stream with the two kernels (lane decode in two launches per chunk, then one
/// dequantization launch for every chunk): f16 bits, per layer K then V, each `[T, H, D]`.
fn decode_with_kernels(stream: &Stream<'_>) -> Vec<u16> {
    let h = stream.header();
    let (tokens, c) = (h.shape.tokens, h.shape.channels());
    let out_len = 2 * h.shape.layers as usize * tokens as usize * c;
    let mut batch = DequantBatch::new(h.shape.kv_heads, h.shape.head_dim, out_len);
    for chunk in 0..h.chunks.len() {
        let lanes = ChunkLanes::read(stream, chunk).unwrap();
        let exp_out = lanes.exponent_batch().unwrap().decode_host(2).unwrap();
        let exps: Vec<&[u8]> = (0..lanes.blocks.len())
            .map(|b| exp_out.symbols(b))
            .collect();
        let sym_out = lanes.symbol_batch(&exps).unwrap().decode_host(2).unwrap();
        let values: Vec<Vec<i32>> = (0..lanes.blocks.len())
            .map(|b| {
                assert_eq!(sym_out.outcome(b), Ok(()), "chunk {chunk} block {b}");
                lanes.symbol_values(b, sym_out.symbols(b), exps[b]).unwrap()
            })
            .collect();
        lanes
            .add_to_dequant(&mut batch, &values, &exps, Destination::dense(tokens, c))
            .unwrap();
    }
    let (out, status) = batch.decode_host().unwrap();
    assert!(status.iter().all(|s| *s == DequantStatus::Ok));
    out
}

/// codec-core's decode of `stream` into f16 buffers (narrowing as the kernel does), in the
/// same layout.
fn decode_with_codec_core(stream: &Stream<'_>) -> Vec<u16> {
    let h = stream.header();
    let n = h.shape.tokens as usize * h.shape.channels();
    let layers = h.shape.layers as usize;
    let mut k = vec![vec![f16::ZERO; n]; layers];
    let mut v = vec![vec![f16::ZERO; n]; layers];
    {
        let mut km: Vec<TensorMut<'_>> = k.iter_mut().map(|t| TensorMut::F16(t)).collect();
        let mut vm: Vec<TensorMut<'_>> = v.iter_mut().map(|t| TensorMut::F16(t)).collect();
        stream.decode_into(&mut km, &mut vm).unwrap();
    }
    let mut out = Vec::with_capacity(2 * layers * n);
    for (k, v) in k.iter().zip(&v) {
        out.extend(k.iter().chain(v).map(|x| x.to_bits()));
    }
    out
}

#[test]
fn golden_streams_dequantize_as_codec_core() {
    let mut f16_outputs = 0;
    for (name, bytes, profile) in golden() {
        // A variant of a vector (its name the vector's file, then a space) has its output.
        let path = vectors_dir().join(name.split(' ').next().unwrap());
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let got = decode_with_kernels(&stream);
        assert!(
            got == decode_with_codec_core(&stream),
            "{name}: differs from codec-core"
        );
        if stream.header().dtype == Dtype::F16 {
            // The golden output file holds the stream-dtype output: here f16, little-endian.
            let want = std::fs::read(path.with_extension("out")).unwrap();
            let got_bytes: Vec<u8> = got.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert!(got_bytes == want, "{name}: differs from its golden output");
            f16_outputs += 1;
        }
    }
    assert!(
        f16_outputs >= 15,
        "{f16_outputs} f16 golden outputs compared"
    );
}

/// The real 512-token fixture (SmolLM2, 3 layers kept), encoded with step exponents (token
/// importance from its queries) at three levels, in 96-token chunks. Its blocks have
/// exponent sections (checked), so the per-token steps are exercised on real data.
#[test]
fn real_fixture_stream_dequantizes_as_codec_core() {
    let (cache, profile) = common::fixture_cache(3);
    let cache = &cache;
    // One level per chunk, cycling through three of the profile's levels.
    let some: Vec<u8> = (0..profile.levels()).step_by(3).take(3).collect();
    let chunks = cache.shape.tokens.div_ceil(96) as usize;
    let levels: Vec<u8> = some.iter().copied().cycle().take(chunks).collect();
    let params = EncodeParams {
        chunk_tokens: 96,
        levels: levels.clone(),
        token_importance: true,
        ..EncodeParams::default()
    };
    let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
    let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
    let got = decode_with_kernels(&stream);
    assert!(
        got == decode_with_codec_core(&stream),
        "differs from codec-core"
    );
    // The stream is f16 like the fixture, so codec-core's own decode is the same bits.
    let back = decode(&bytes, None, &Limits::DEFAULT).unwrap();
    let mut want = Vec::new();
    for (k, v) in back.k.iter().zip(&back.v) {
        for t in [k, v] {
            match t {
                Tensor::F16(x) => want.extend(x.iter().map(|e| e.to_bits())),
                other => panic!("fixture decodes to {:?}", other.dtype()),
            }
        }
    }
    assert!(got == want);
    let with_exps = stream.header().chunks.len();
    println!(
        "{} bytes, {with_exps} chunks, levels {levels:?}",
        bytes.len()
    );
}

#[test]
fn spec_worked_example_rounds_as_written() {
    // spec/FORMAT.md §7.5: mean 0.25, delta_step 0.1, anchor_step 0.05, weight 12, mult 0.5;
    // an anchor row q = 3 and a delta row q = -2, without and with exponents (3 and 1).
    let params = codec_core::quant::ChannelParams {
        mean: 0.25,
        delta_step: 0.1,
        anchor_step: 0.05,
        weight: 12,
    };
    let consts = ChannelConsts::of_block(&[params], 0.5);
    for (exps, want) in [
        (None, [0x3533, 0x329A]),
        (Some(&[3u8, 1][..]), [0x3765, 0x3448]),
    ] {
        let mut batch = DequantBatch::new(1, 1, 2);
        let consts_start = batch.add_consts(&consts);
        batch
            .add_block(DequantInput {
                q: &[3, -2],
                exps,
                sink: &[],
                consts_start,
                rows: 2,
                group: 2,
                out_start: 0,
                token_start: 0,
                page_start: 0,
            })
            .unwrap();
        let (out, status) = batch.decode_host().unwrap();
        assert_eq!((out, status), (want.to_vec(), vec![DequantStatus::Ok]));
    }
}

#[test]
fn f32_to_f16_narrowing_matches_ieee() {
    // Every 4099th bit pattern, and every pattern near the f16 boundaries (subnormal, normal,
    // overflow), against the half crate's IEEE conversion; NaN to a NaN.
    let edges = [
        0x3300_0000u32,
        0x3380_0000,
        0x3880_0000,
        0x477F_E000,
        0x477F_F000,
        0x7F80_0000,
    ];
    for u in common::f32_patterns(&edges, 5000) {
        let x = f32::from_bits(u);
        let got = f32_to_f16_bits(x);
        if x.is_nan() {
            assert!(f16::from_bits(got).is_nan(), "{u:#x}");
        } else {
            assert_eq!(got, f16::from_f32(x).to_bits(), "{u:#x}");
        }
    }
}

proptest! {
    /// Any block header: a defined status, and a block that is refused writes nothing.
    #[test]
    fn arbitrary_block_headers_never_crash(
        fields in any::<(u64, u64, u64, u64, u64, u32, u32, u32, u32)>(),
        which in 0u8..9,
    ) {
        let consts = vec![ChannelConsts { mean: 1.0, anchor_step: 0.5, delta_step: 0.25, weight: 0.5 }; 4];
        let mut batch = DequantBatch::new(2, 2, 40);
        let consts_start = batch.add_consts(&consts);
        let input = DequantInput { q: &[1; 16], exps: Some(&[1; 8]), sink: &[0.5; 4], consts_start, rows: 5, group: 3, out_start: 0, token_start: 0, page_start: 0 };
        batch.add_block(input).unwrap();
        batch.add_block(DequantInput { out_start: 20, ..input }).unwrap();
        let b = &mut batch.blocks_mut()[0];
        match which {
            0 => b.q_start = fields.0,
            1 => b.exp_start = fields.1,
            2 => b.sink_start = fields.2,
            3 => b.out_start = fields.3,
            4 => b.consts_start = fields.4,
            5 => b.rows = fields.5,
            6 => b.sink_rows = fields.6,
            7 => b.group = fields.7,
            _ => b.has_exps = fields.8,
        }
        let (out, status) = batch.decode_host().unwrap();
        prop_assert_eq!(status[1], DequantStatus::Ok);
        prop_assert!(status[0] == DequantStatus::Ok || status[0] == DequantStatus::BadRange);
        if status[0] == DequantStatus::BadRange {
            prop_assert!(out[..20].iter().all(|&x| x == 0));
        }
    }
}
