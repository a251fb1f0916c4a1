//! rANS throughput: the 32-lane coder of `codec_core::rans` against constriction's single-lane
//! `AnsCoder<u32, u64>` on the same data.
//!
//! Data: ~1M symbols from 6 discretised Laplace distributions (33 symbols, scales 0.9..1.3,
//! about 2.5 bits/symbol), like 192 channels of 5461 tokens sharing 6 tables: symbol `g` uses
//! table `g % 6`.

use codec_core::rans::{encode_lanes_into, DecodeTable, FreqTable, LaneDecoder, LANES};
use constriction::stream::model::{
    ContiguousCategoricalEntropyModel, ContiguousLookupDecoderModel,
};
use constriction::stream::stack::DefaultAnsCoder;
use constriction::stream::Decode;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

const CHANNELS: usize = 192;
const TOKENS: usize = 5461;
const N: usize = CHANNELS * TOKENS;
const NTABLES: usize = 6;
const SCALES: [f64; NTABLES] = [0.9, 1.0, 1.05, 1.15, 1.2, 1.3];

struct Data {
    tables: Vec<FreqTable>,
    symbols: Vec<u8>,
}

fn data() -> Data {
    let tables: Vec<FreqTable> = SCALES
        .iter()
        .map(|&b| {
            let counts: Vec<u64> = (0..33)
                .map(|k: i32| (1e9 * (-f64::from((k - 16).abs()) / b).exp()) as u64)
                .collect();
            FreqTable::from_counts(&counts)
        })
        .collect();
    let decode: Vec<DecodeTable> = tables.iter().map(DecodeTable::from).collect();
    // SplitMix64 draws of a uniform slot, mapped through the table: exact table distribution.
    let mut seed = 0x1234_5678u64;
    let symbols = (0..N)
        .map(|g| {
            seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            decode[g % NTABLES].lookup((z >> 52) as u32).0
        })
        .collect();
    Data { tables, symbols }
}

fn bench(c: &mut Criterion) {
    let d = data();
    let decode_tables: Vec<DecodeTable> = d.tables.iter().map(DecodeTable::from).collect();
    let per_token: Vec<&DecodeTable> = (0..CHANNELS)
        .map(|ch| &decode_tables[ch % NTABLES])
        .collect();

    let mut lanes: [Vec<u32>; LANES] = std::array::from_fn(|_| Vec::new());
    encode_lanes_into(&d.symbols, |g| &d.tables[g % NTABLES], &mut lanes);
    let words: usize = lanes.iter().map(Vec::len).sum();
    let ideal: f64 = d
        .symbols
        .iter()
        .enumerate()
        .map(|(g, &s)| {
            let t = &d.tables[g % NTABLES];
            12.0 - f64::from(t.freq(usize::from(s))).log2()
        })
        .sum();
    eprintln!(
        "rans: {N} symbols, {:.3} bits/symbol coded, {:.3} bits/symbol ideal",
        words as f64 * 32.0 / N as f64,
        ideal / N as f64
    );

    // Constriction, one lane, same symbols and tables; decoded with its lookup-table model.
    let models: Vec<ContiguousCategoricalEntropyModel<u16, Vec<u16>, 12>> = d
        .tables
        .iter()
        .map(|t| {
            ContiguousCategoricalEntropyModel::from_nonzero_fixed_point_probabilities(
                t.freqs().iter().copied(),
                false,
            )
            .unwrap()
        })
        .collect();
    let lookup: Vec<ContiguousLookupDecoderModel<u16, Vec<u16>, Box<[u16]>, 12>> =
        models.iter().map(|m| m.to_lookup_decoder_model()).collect();
    let encode_constriction = || {
        let mut coder = DefaultAnsCoder::new();
        coder
            .encode_symbols_reverse(
                d.symbols
                    .iter()
                    .enumerate()
                    .map(|(g, &s)| (usize::from(s), models[g % NTABLES].as_view())),
            )
            .unwrap();
        coder.into_compressed().unwrap()
    };
    let single_lane = encode_constriction();

    let mut group = c.benchmark_group("rans");
    group.throughput(Throughput::Elements(N as u64));
    group.sample_size(20);

    group.bench_function("encode_32_lanes", |b| {
        let mut bufs: [Vec<u32>; LANES] = std::array::from_fn(|_| Vec::new());
        b.iter(|| {
            encode_lanes_into(black_box(&d.symbols), |g| &d.tables[g % NTABLES], &mut bufs);
            black_box(&bufs);
        })
    });

    group.bench_function("decode_32_lanes", |b| {
        let refs: [&[u32]; LANES] = std::array::from_fn(|l| lanes[l].as_slice());
        let mut out = vec![0u8; N];
        b.iter(|| {
            let mut dec = LaneDecoder::new(black_box(refs)).unwrap();
            for (t, chunk) in out.chunks_exact_mut(CHANNELS).enumerate() {
                dec.decode(t * CHANNELS, &per_token, chunk).unwrap();
            }
            dec.finish().unwrap();
            black_box(&out);
        });
        assert_eq!(out, d.symbols);
    });

    group.bench_function("constriction_encode_1_lane", |b| {
        b.iter(|| black_box(encode_constriction()))
    });

    group.bench_function("constriction_decode_1_lane_lookup", |b| {
        let mut out = vec![0u8; N];
        b.iter(|| {
            let mut coder =
                DefaultAnsCoder::from_compressed_slice(black_box(&single_lane)).unwrap();
            for (g, o) in out.iter_mut().enumerate() {
                *o = coder.decode_symbol(&lookup[g % NTABLES]).unwrap() as u8;
            }
            assert!(coder.is_empty());
            black_box(&out);
        });
        assert_eq!(out, d.symbols);
    });

    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
