//! The golden vectors (`spec/vectors/`): every chunk of every valid stream decodes, through the
//! host-run kernel in two launches (exponents, then every symbol), to exactly the symbols
//! codec-core's lane decoder gives with the same tables, every lane ending OK; the two lane
//! corruptions among the invalid vectors give codec-core's error.
//!
//! A lane ends in state 0 with no word left only if every one of its symbols was decoded with
//! the table it was coded with (anything else leaves a different state, with overwhelming
//! probability), so the all-OK statuses also check `codec_cuda::stream`'s table resolution.

mod common;

use codec_core::{decode, BlockError, DecodeError, Kv, Limits, Stream};
use codec_cuda::rans::LaneDecoded;
use codec_cuda::stream::ChunkLanes;
use common::{assert_matches_reference, golden, outcome, read_vector};

/// Decodes chunk `c` of `stream` with the host-run kernel: the exponent launch, then the symbol
/// launch. Checks the exponents against codec-core's decoder, and returns the symbol launch's
/// output with each block's exponents.
fn decode_chunk(lanes: &ChunkLanes<'_>) -> (LaneDecoded, Vec<Vec<u8>>) {
    let exp_out = lanes.exponent_batch().unwrap().decode_host(4).unwrap();
    let exps: Vec<Vec<u8>> = (0..lanes.blocks.len())
        .map(|b| exp_out.symbols(b).to_vec())
        .collect();
    for (b, blk) in lanes.blocks.iter().enumerate() {
        let (want, _) = common::reference(
            &blk.words.to_vec(),
            blk.lane_len,
            &lanes.symbol_tables(b, &[]),
        );
        assert_eq!(exps[b], want[..blk.n_e], "block {b}: exponents");
    }
    let exp_refs: Vec<&[u8]> = exps.iter().map(Vec::as_slice).collect();
    let out = lanes
        .symbol_batch(&exp_refs)
        .unwrap()
        .decode_host(4)
        .unwrap();
    (out, exps)
}

#[test]
fn golden_streams_decode_as_codec_core() {
    let vectors = golden();
    let mut symbols = 0usize;
    for (name, bytes, profile) in &vectors {
        let stream = Stream::open(bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        for c in 0..stream.header().chunks.len() {
            let lanes = ChunkLanes::read(&stream, c).unwrap();
            let (out, exps) = decode_chunk(&lanes);
            for (b, blk) in lanes.blocks.iter().enumerate() {
                let tables = lanes.symbol_tables(b, &exps[b]);
                assert_eq!(outcome(&out, b), Ok(()), "{name} chunk {c} block {b}");
                assert_matches_reference(&out, b, &blk.words.to_vec(), blk.lane_len, &tables);
                symbols += tables.len();
            }
        }
    }
    println!(
        "{} golden streams, {symbols} symbols decoded",
        vectors.len()
    );
}

/// The invalid vectors whose error is in a lane: the kernel reports what codec-core's whole
/// decode reports (chunk 1, block (0, K)), and the other blocks decode.
#[test]
fn golden_lane_corruptions_give_codec_core_errors() {
    for name in ["x07-lane-zero-final-word.kvc", "x08-lane-trailing-word.kvc"] {
        let (bytes, profile) = read_vector(name);
        let want = match decode(&bytes, profile.as_ref(), &Limits::DEFAULT) {
            Err(DecodeError::Block(BlockError::Rans {
                chunk: 1,
                layer: 0,
                kv: Kv::K,
                err,
            })) => err,
            other => panic!("{name}: codec-core gave {other:?}"),
        };
        let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
        let lanes = ChunkLanes::read(&stream, 1).unwrap();
        let exp_out = lanes.exponent_batch().unwrap().decode_host(0).unwrap();
        let exps: Vec<&[u8]> = (0..lanes.blocks.len())
            .map(|b| exp_out.symbols(b))
            .collect();
        let out = lanes.symbol_batch(&exps).unwrap().decode_host(0).unwrap();
        assert_eq!(outcome(&out, 0), Err(want), "{name}");
        for b in 1..lanes.blocks.len() {
            assert_eq!(outcome(&out, b), Ok(()), "{name} block {b}");
        }
    }
}

/// Chunk structure errors are typed errors of `ChunkLanes`, never panics: every truncation
/// of a chunk body, and bytes changed anywhere in it.
#[test]
fn malformed_chunk_bodies_are_errors() {
    let (bytes, profile) = read_vector("v16-step-exponents.kvc");
    let stream = Stream::open(&bytes, profile.as_ref(), &Limits::DEFAULT).unwrap();
    assert!(ChunkLanes::read(&stream, stream.header().chunks.len()).is_err());
    let chunk = stream.chunk_bytes(1).unwrap();
    let body = &chunk[..chunk.len() - 4];
    assert!(ChunkLanes::from_body(&stream, 1, body).is_ok());
    for len in 0..body.len() {
        assert!(
            ChunkLanes::from_body(&stream, 1, &body[..len]).is_err(),
            "{len} bytes"
        );
    }
    let mut longer = body.to_vec();
    longer.push(0);
    assert!(ChunkLanes::from_body(&stream, 1, &longer).is_err());
    // Changed bytes: read or refused, and whatever is read decodes to defined statuses.
    for (i, x) in (0..body.len())
        .step_by(13)
        .zip([0xFFu8, 0x80, 0x01, 0x7F].iter().cycle())
    {
        let mut bad = body.to_vec();
        bad[i] ^= x;
        if let Ok(lanes) = ChunkLanes::from_body(&stream, 1, &bad) {
            let exp_out = lanes.exponent_batch().unwrap().decode_host(1).unwrap();
            let exps: Vec<&[u8]> = (0..lanes.blocks.len())
                .map(|b| exp_out.symbols(b))
                .collect();
            let out = lanes.symbol_batch(&exps).unwrap().decode_host(1).unwrap();
            for b in 0..lanes.blocks.len() {
                let _ = outcome(&out, b);
            }
        }
    }
}
