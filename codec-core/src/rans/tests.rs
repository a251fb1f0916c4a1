//! Tests of the rANS module, including differential tests against constriction.

extern crate std;

use alloc::vec;
use alloc::vec::Vec;
use std::string::ToString;

use constriction::stream::model::ContiguousCategoricalEntropyModel;
use constriction::stream::stack::DefaultAnsCoder;
use constriction::stream::Decode;
use proptest::prelude::*;

use super::decode::vector_decode;
use super::*;

type Model = ContiguousCategoricalEntropyModel<u32, Vec<u32>, 12>;

/// SplitMix64: small deterministic generator for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random counts of a random shape: uniform, skewed (geometric), sparse, huge, all zero.
fn random_counts(rng: &mut Rng, n: usize) -> Vec<u64> {
    match rng.below(6) {
        0 => (0..n).map(|_| rng.below(1000)).collect(),
        1 => {
            let decay = 1 + rng.below(8);
            (0..n)
                .map(|s| (1_000_000u64 >> (decay * s as u64).min(63)) + rng.below(3))
                .collect()
        }
        2 => (0..n)
            .map(|_| if rng.below(4) == 0 { rng.below(50) } else { 0 })
            .collect(),
        3 => (0..n).map(|_| rng.next()).collect(),
        4 => vec![0; n],
        _ => (0..n).map(|_| rng.below(3)).collect(),
    }
}

fn random_table(rng: &mut Rng) -> FreqTable {
    let n = match rng.below(4) {
        0 => 2,
        1 => MAX_SYMBOLS,
        _ => 2 + rng.below(MAX_SYMBOLS as u64 - 1) as usize,
    };
    let counts = random_counts(rng, n);
    FreqTable::from_counts(&counts)
}

/// A symbol drawn from the table's own distribution.
fn draw(rng: &mut Rng, t: &FreqTable) -> u8 {
    let slot = rng.below(4096) as u32;
    let mut s = 0;
    while t.cdf(s + 1) <= slot {
        s += 1;
    }
    s as u8
}

fn model_of(t: &FreqTable) -> Model {
    Model::from_nonzero_fixed_point_probabilities(t.freqs().iter().map(|&f| u32::from(f)), false)
        .unwrap()
}

/// Test message: `len` symbols, `table_ix[g]` the index of symbol g's table.
struct Message {
    tables: Vec<FreqTable>,
    table_ix: Vec<usize>,
    symbols: Vec<u8>,
}

fn random_message(rng: &mut Rng, len: usize) -> Message {
    let ntables = 1 + rng.below(7) as usize;
    let tables: Vec<FreqTable> = (0..ntables).map(|_| random_table(rng)).collect();
    let cycling = rng.below(2) == 0;
    let table_ix: Vec<usize> = (0..len)
        .map(|g| {
            if cycling {
                g % ntables
            } else {
                rng.below(ntables as u64) as usize
            }
        })
        .collect();
    let symbols = table_ix
        .iter()
        .map(|&i| {
            // Mostly typical symbols, sometimes any symbol of the alphabet (incl. rare ones).
            if rng.below(8) == 0 {
                rng.below(tables[i].len() as u64) as u8
            } else {
                draw(rng, &tables[i])
            }
        })
        .collect();
    Message {
        tables,
        table_ix,
        symbols,
    }
}

fn encode_message(m: &Message) -> [Vec<u32>; LANES] {
    encode_lanes(&m.symbols, |g| &m.tables[m.table_ix[g]])
}

fn lane_refs(lanes: &[Vec<u32>; LANES]) -> [&[u32]; LANES] {
    core::array::from_fn(|l| lanes[l].as_slice())
}

/// Decodes the whole message with `LaneDecoder`, in pieces cut at `cuts` (sorted).
fn decode_message(
    m: &Message,
    lanes: [&[u32]; LANES],
    cuts: &[usize],
) -> Result<Vec<u8>, RansError> {
    let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
    let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
    let mut dec = LaneDecoder::new(lanes)?;
    let mut out = vec![0u8; m.symbols.len()];
    let mut start = 0;
    for &end in cuts.iter().chain(core::iter::once(&m.symbols.len())) {
        dec.decode(start, &per_pos[start..end], &mut out[start..end])?;
        start = end;
    }
    dec.finish()?;
    Ok(out)
}

#[test]
fn new_rejects_each_bad_case() {
    assert_eq!(
        FreqTable::new(&[]),
        Err(TableError::TooFewSymbols { got: 0 })
    );
    assert_eq!(
        FreqTable::new(&[4096]),
        Err(TableError::TooFewSymbols { got: 1 })
    );
    assert_eq!(
        FreqTable::new(&[16u16; 257]),
        Err(TableError::TooManySymbols { got: 257, max: 256 })
    );
    assert_eq!(
        FreqTable::new(&[4096, 0]),
        Err(TableError::ZeroFrequency { symbol: 1 })
    );
    assert_eq!(
        FreqTable::new(&[1, 0, 4095, 0]),
        Err(TableError::ZeroFrequency { symbol: 1 })
    );
    assert_eq!(
        FreqTable::new(&[1, 4096]),
        Err(TableError::BadSum {
            got: 4097,
            expected: 4096
        })
    );
    assert_eq!(
        FreqTable::new(&[1, 4094]),
        Err(TableError::BadSum {
            got: 4095,
            expected: 4096
        })
    );
    // u16 overflow territory: 256 * 65535 must not wrap to look valid.
    assert!(matches!(
        FreqTable::new(&[u16::MAX; 256]),
        Err(TableError::BadSum { .. })
    ));
    let ok = FreqTable::new(&[16u16; 256]).unwrap();
    assert_eq!(ok.len(), 256);
    let ok = FreqTable::new(&[4095, 1]).unwrap();
    assert_eq!((ok.freq(0), ok.freq(1)), (4095, 1));
    assert_eq!((ok.cdf(0), ok.cdf(1), ok.cdf(2)), (0, 4095, 4096));
    for e in [
        TableError::TooFewSymbols { got: 1 },
        TableError::TooManySymbols { got: 300, max: 256 },
        TableError::ZeroFrequency { symbol: 3 },
        TableError::BadSum {
            got: 1,
            expected: 4096,
        },
    ] {
        assert!(!e.to_string().is_empty());
    }
}

/// The literal greedy loop of `FreqTable::from_counts`'s documentation.
fn from_counts_reference(counts: &[u64]) -> Vec<u16> {
    let n = counts.len();
    let all_zero = counts.iter().all(|&c| c == 0);
    let c: Vec<u128> = counts
        .iter()
        .map(|&c| if all_zero { 1 } else { u128::from(c) })
        .collect();
    let mut f = vec![1u32; n];
    for _ in 0..(4096 - n) {
        let mut best = 0;
        for s in 1..n {
            let lhs = c[s] * u128::from(2 * f[best] + 1);
            let rhs = c[best] * u128::from(2 * f[s] + 1);
            if lhs > rhs {
                best = s;
            }
        }
        f[best] += 1;
    }
    f.iter().map(|&x| x as u16).collect()
}

/// Exact optimum of sum(c log f) (greedy on the true marginal gains, floating point).
fn optimal_cost(counts: &[u64]) -> f64 {
    let n = counts.len();
    let mut f = vec![1u32; n];
    let gain = |c: u64, f: u32| c as f64 * libm::log2((f as f64 + 1.0) / f as f64);
    for _ in 0..(4096 - n) {
        let mut best = 0;
        for s in 1..n {
            if gain(counts[s], f[s]) > gain(counts[best], f[best]) {
                best = s;
            }
        }
        f[best] += 1;
    }
    let freqs: Vec<u16> = f.iter().map(|&x| x as u16).collect();
    FreqTable::new(&freqs).unwrap().cost_bits(counts)
}

#[test]
fn from_counts_invariants_and_reference() {
    let mut rng = Rng(2);
    let mut cases: Vec<Vec<u64>> = vec![
        vec![0, 0],
        vec![0; 256],
        vec![u64::MAX; 256],
        vec![u64::MAX, 0],
        vec![u64::MAX, 1],
        vec![1, 1, 1],
        vec![5, 0, 0, 0, 7],
        (0..256).map(|s| s as u64).collect(),
        (0..256).map(|s| 1u64 << (s % 64)).collect(),
    ];
    for _ in 0..300 {
        let n = 2 + rng.below(255) as usize;
        cases.push(random_counts(&mut rng, n));
    }
    for counts in &cases {
        let t = FreqTable::from_counts(counts);
        assert_eq!(t.len(), counts.len());
        assert_eq!(t.freqs().iter().map(|&f| u32::from(f)).sum::<u32>(), 4096);
        assert!(t.freqs().iter().all(|&f| f >= 1));
        assert_eq!(FreqTable::new(t.freqs()).as_ref(), Ok(&t));
        assert_eq!(FreqTable::from_counts(counts), t, "deterministic");
        assert_eq!(t.freqs(), &from_counts_reference(counts)[..], "{counts:?}");
        if counts.iter().any(|&c| c != 0) {
            for (s, &c) in counts.iter().enumerate() {
                if c == 0 {
                    assert_eq!(t.freq(s), 1);
                }
            }
        }
    }
    // All-zero counts: as uniform as possible, remainder to the lowest symbols.
    let t = FreqTable::from_counts(&[0; 3]);
    assert_eq!(t.freqs(), &[1366, 1365, 1365]);
    let t = FreqTable::from_counts(&[0; 256]);
    assert!(t.freqs().iter().all(|&f| f == 16));
}

#[test]
fn from_counts_is_near_optimal() {
    let mut rng = Rng(3);
    let mut worst = 0.0f64;
    for _ in 0..60 {
        let n = 2 + rng.below(255) as usize;
        let counts = random_counts(&mut rng, n);
        if counts.iter().all(|&c| c == 0) {
            continue;
        }
        let ours = FreqTable::from_counts(&counts).cost_bits(&counts);
        let best = optimal_cost(&counts);
        assert!(ours >= best * (1.0 - 1e-12));
        worst = worst.max((ours - best) / best.max(1e-300));
    }
    assert!(worst < 1e-4, "worst relative excess {worst}");
}

#[test]
fn cost_bits_values() {
    let t = FreqTable::new(&[2048, 1024, 1024]).unwrap();
    assert_eq!(t.cost_bits(&[4, 2, 1]), 4.0 * 1.0 + 2.0 * 2.0 + 2.0);
    assert_eq!(t.cost_bits(&[1]), 1.0);
    assert_eq!(t.cost_bits(&[0, 0, 0, 0]), 0.0);
    assert_eq!(t.cost_bits(&[0, 0, 0, 1]), f64::INFINITY);
}

#[test]
fn decode_table_matches_freq_table() {
    let mut rng = Rng(4);
    for _ in 0..50 {
        let t = random_table(&mut rng);
        let d = DecodeTable::from(&t);
        for slot in 0..4096u32 {
            let (s, f, c) = d.lookup(slot);
            let s = usize::from(s);
            assert!(s < t.len());
            assert_eq!((f, c), (t.freq(s), t.cdf(s)));
            assert!(c <= slot && slot < c + f);
        }
        assert!(!std::format!("{d:?}").is_empty());
    }
}

#[test]
fn matches_constriction_bit_exactly() {
    let mut rng = Rng(5);
    let lengths = [
        0usize, 1, 2, 31, 32, 33, 63, 64, 65, 100, 1000, 1024, 4099, 20000,
    ];
    for (round, &len) in lengths.iter().chain(lengths.iter()).enumerate() {
        let m = random_message(&mut rng, len);
        let lanes = encode_message(&m);
        let models: Vec<Model> = m.tables.iter().map(model_of).collect();
        for (l, ours) in lanes.iter().enumerate() {
            let lane_syms: Vec<(usize, usize)> = (l..len)
                .step_by(LANES)
                .map(|g| (usize::from(m.symbols[g]), m.table_ix[g]))
                .collect();
            let mut coder = DefaultAnsCoder::new();
            coder
                .encode_symbols_reverse(lane_syms.iter().map(|&(s, t)| (s, models[t].as_view())))
                .unwrap();
            let theirs = coder.into_compressed().unwrap();
            assert_eq!(ours, &theirs, "round {round} len {len} lane {l}");

            // constriction decodes our words back.
            let mut dec = DefaultAnsCoder::from_compressed(ours.clone()).unwrap();
            for &(s, t) in &lane_syms {
                assert_eq!(dec.decode_symbol(models[t].as_view()).unwrap(), s);
            }
            assert!(dec.is_empty());
            assert!(dec.bulk().is_empty());
        }
        // And our decoder decodes them.
        assert_eq!(
            decode_message(&m, lane_refs(&lanes), &[]).unwrap(),
            m.symbols
        );
    }
}

#[test]
fn extreme_tables_match_constriction() {
    // Very skewed tables stress renormalisation: long runs of the likely symbol (tiny growth) and
    // the unlikely one (12 bits per symbol).
    let skew = FreqTable::new(&[4095, 1]).unwrap();
    let skew_rev = FreqTable::new(&[1, 4095]).unwrap();
    let mut rng = Rng(6);
    for pattern in 0..4 {
        let symbols: Vec<u8> = (0..5000)
            .map(|g| match pattern {
                0 => 0,
                1 => 1,
                2 => (rng.below(2)) as u8,
                _ => u8::from(g % 97 == 0),
            })
            .collect();
        for table in [&skew, &skew_rev] {
            let lanes = encode_lanes(&symbols, |_| table);
            let model = model_of(table);
            for (l, ours) in lanes.iter().enumerate() {
                let mut coder = DefaultAnsCoder::new();
                coder
                    .encode_iid_symbols_reverse(
                        symbols[l..].iter().step_by(LANES).map(|&s| usize::from(s)),
                        model.as_view(),
                    )
                    .unwrap();
                assert_eq!(ours, &coder.into_compressed().unwrap());
            }
            let dt = DecodeTable::from(table);
            let per_pos = vec![&dt; symbols.len()];
            let mut dec = LaneDecoder::new(lane_refs(&lanes)).unwrap();
            let mut out = vec![0u8; symbols.len()];
            dec.decode(0, &per_pos, &mut out).unwrap();
            dec.finish().unwrap();
            assert_eq!(out, symbols);
        }
    }
}

#[test]
fn round_trip_in_pieces() {
    let mut rng = Rng(7);
    for len in [0usize, 1, 5, 32, 33, 95, 96, 97, 1000, 3001, 10000] {
        for _ in 0..4 {
            let m = random_message(&mut rng, len);
            let lanes = encode_message(&m);
            let mut cuts: Vec<usize> = (0..rng.below(12))
                .map(|_| rng.below(len as u64 + 1) as usize)
                .collect();
            cuts.sort_unstable();
            assert_eq!(
                decode_message(&m, lane_refs(&lanes), &cuts).unwrap(),
                m.symbols
            );
        }
    }
}

#[test]
fn encode_lanes_into_reuses_buffers() {
    let mut rng = Rng(8);
    let mut bufs: [Vec<u32>; LANES] = core::array::from_fn(|_| vec![0xdead_beef; 7]);
    for len in [500usize, 0, 77, 3000] {
        let m = random_message(&mut rng, len);
        encode_lanes_into(&m.symbols, |g| &m.tables[m.table_ix[g]], &mut bufs);
        assert_eq!(bufs, encode_message(&m));
    }
}

#[test]
fn decode_argument_errors() {
    let mut rng = Rng(9);
    let m = random_message(&mut rng, 100);
    let lanes = encode_message(&m);
    let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
    let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
    let mut dec = LaneDecoder::new(lane_refs(&lanes)).unwrap();
    let mut out = vec![0u8; 100];
    assert_eq!(
        dec.decode(1, &per_pos, &mut out[..10]),
        Err(RansError::PositionMismatch {
            expected: 0,
            got: 1
        })
    );
    assert_eq!(
        dec.decode(0, &per_pos[..9], &mut out[..10]),
        Err(RansError::TooFewTables { needed: 10, got: 9 })
    );
    // Nothing was consumed by the failed calls; extra tables are ignored.
    dec.decode(0, &per_pos, &mut out[..10]).unwrap();
    assert_eq!(dec.position(), 10);
    assert_eq!(
        dec.decode(0, &per_pos, &mut out[10..]),
        Err(RansError::PositionMismatch {
            expected: 10,
            got: 0
        })
    );
    dec.decode(10, &per_pos[10..], &mut out[10..]).unwrap();
    dec.finish().unwrap();
    assert_eq!(out, m.symbols);
}

#[test]
fn finish_detects_early_stop_and_zero_word() {
    let mut rng = Rng(10);
    let m = random_message(&mut rng, 5000);
    let lanes = encode_message(&m);
    let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
    let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
    // Stopping early leaves words unread in lane 0 (decoding stops inside lane 0's stream).
    let mut dec = LaneDecoder::new(lane_refs(&lanes)).unwrap();
    let mut out = vec![0u8; 4000];
    dec.decode(0, &per_pos, &mut out).unwrap();
    assert_eq!(dec.finish(), Err(RansError::TrailingData { lane: 0 }));
    // An empty message: every lane empty, finish is fine at once.
    let empty: [&[u32]; LANES] = [&[]; LANES];
    LaneDecoder::new(empty).unwrap().finish().unwrap();
    // A lane ending in a zero word.
    let mut bad = lanes.clone();
    bad[5].push(0);
    assert_eq!(
        LaneDecoder::new(lane_refs(&bad)).err(),
        Some(RansError::ZeroFinalWord { lane: 5 })
    );
    let mut bad = lane_refs(&lanes);
    bad[3] = &[0];
    assert_eq!(
        LaneDecoder::new(bad).err(),
        Some(RansError::ZeroFinalWord { lane: 3 })
    );
    // Decoding more symbols than were encoded cannot be detected: once a lane is back in
    // state 0 with no words left, it decodes symbol 0 (slot 0) and stays in state 0.
    let mut dec = LaneDecoder::new(lane_refs(&lanes)).unwrap();
    let mut out = vec![0u8; 5000];
    dec.decode(0, &per_pos, &mut out).unwrap();
    let mut more = vec![0xffu8; 64];
    dec.decode(5000, &per_pos[..64], &mut more).unwrap();
    assert!(more.iter().all(|&s| s == 0));
    dec.finish().unwrap();
    for e in [
        RansError::OutOfWords { lane: 1 },
        RansError::TrailingData { lane: 1 },
        RansError::BadFinalState { lane: 1 },
        RansError::ZeroFinalWord { lane: 1 },
        RansError::PositionMismatch {
            expected: 1,
            got: 2,
        },
        RansError::TooFewTables { needed: 1, got: 0 },
    ] {
        assert!(!e.to_string().is_empty());
    }
}

/// Decodes `lanes` as if they held `m`; returns whether that reproduced `m` and passed `finish`.
fn decodes_cleanly(m: &Message, lanes: [&[u32]; LANES]) -> bool {
    let mut rng = Rng(lanes.iter().map(|l| l.len() as u64).sum());
    let len = m.symbols.len() as u64;
    let mut cuts: Vec<usize> = (0..3).map(|_| rng.below(len + 1) as usize).collect();
    cuts.sort_unstable();
    matches!(decode_message(m, lanes, &cuts), Ok(out) if out == m.symbols)
}

#[test]
fn corruption_never_panics_and_is_detected() {
    let mut rng = Rng(11);
    for trial in 0..40 {
        let len = 1 + rng.below(4000) as usize;
        let m = random_message(&mut rng, len);
        let lanes = encode_message(&m);
        assert!(decodes_cleanly(&m, lane_refs(&lanes)));

        // Truncate one non-empty lane at the front (words read last) or the back (read first).
        let l = (0..LANES).find(|&l| lanes[l].len() >= 2);
        if let Some(l) = l {
            let mut refs = lane_refs(&lanes);
            let cut = 1 + rng.below(lanes[l].len() as u64 - 1) as usize;
            refs[l] = if trial % 2 == 0 {
                &lanes[l][cut..]
            } else {
                &lanes[l][..lanes[l].len() - cut]
            };
            assert!(!decodes_cleanly(&m, refs), "truncation went unnoticed");
        }

        // Flip one bit somewhere.
        let total: usize = lanes.iter().map(Vec::len).sum();
        if total > 0 {
            let mut bad = lanes.clone();
            let mut k = rng.below(total as u64) as usize;
            let l = (0..LANES)
                .find(|&l| {
                    if k < bad[l].len() {
                        true
                    } else {
                        k -= bad[l].len();
                        false
                    }
                })
                .unwrap();
            bad[l][k] ^= 1 << rng.below(32);
            assert!(
                !decodes_cleanly(&m, lane_refs(&bad)),
                "bit flip went unnoticed"
            );
        }

        // Entirely random words of random lengths: must not panic.
        let garbage: Vec<Vec<u32>> = (0..LANES)
            .map(|_| {
                let n = rng.below(300) as usize;
                (0..n).map(|_| rng.next() as u32).collect()
            })
            .collect();
        let refs: [&[u32]; LANES] = core::array::from_fn(|l| garbage[l].as_slice());
        let _ = decodes_cleanly(&m, refs);
    }
}

#[test]
fn decoder_matches_constriction_on_arbitrary_words() {
    // Not only valid streams: on any words, each lane's symbols, final state and remaining word
    // count equal constriction's `from_compressed` + `decode_symbol` (including the
    // "no words left" path and states that no encoder produces).
    use constriction::stream::Code;
    let mut rng = Rng(12);
    for trial in 0..60 {
        let len = 1 + rng.below(3000) as usize;
        let m = random_message(&mut rng, len);
        let lanes: Vec<Vec<u32>> = (0..LANES)
            .map(|_| {
                let n = rng.below(if trial % 2 == 0 { 4 } else { 120 }) as usize;
                let mut w: Vec<u32> = (0..n)
                    .map(|_| {
                        let shift = rng.below(32);
                        rng.next() as u32 >> shift
                    })
                    .collect();
                if let Some(last) = w.last_mut() {
                    *last |= 1;
                }
                w
            })
            .collect();
        let refs: [&[u32]; LANES] = core::array::from_fn(|l| lanes[l].as_slice());
        let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
        let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
        let mut dec = LaneDecoder::new(refs).unwrap();
        let mut out = vec![0u8; len];
        let cut = rng.below(len as u64 + 1) as usize;
        dec.decode(0, &per_pos[..cut], &mut out[..cut]).unwrap();
        dec.decode(cut, &per_pos[cut..], &mut out[cut..]).unwrap();

        let models: Vec<Model> = m.tables.iter().map(model_of).collect();
        let mut all_clean = true;
        for (l, words) in lanes.iter().enumerate() {
            let mut theirs = DefaultAnsCoder::from_compressed(words.clone()).unwrap();
            for g in (l..len).step_by(LANES) {
                let s = theirs
                    .decode_symbol(models[m.table_ix[g]].as_view())
                    .unwrap();
                assert_eq!(usize::from(out[g]), s, "trial {trial} lane {l} symbol {g}");
            }
            assert_eq!(dec.state[l], theirs.state(), "trial {trial} lane {l}");
            assert_eq!(
                dec.unread()[l],
                theirs.bulk().len(),
                "trial {trial} lane {l}"
            );
            all_clean &= theirs.is_empty() && theirs.bulk().is_empty();
        }
        assert_eq!(dec.finish().is_ok(), all_clean);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn proptest_round_trip(
        counts in prop::collection::vec(
            prop::collection::vec(0u64..10_000, 2..=MAX_SYMBOLS), 1..4),
        raw in prop::collection::vec((any::<u8>(), any::<u8>()), 0..3000),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let tables: Vec<FreqTable> = counts.iter().map(|c| FreqTable::from_counts(c)).collect();
        let table_ix: Vec<usize> = raw.iter().map(|&(t, _)| usize::from(t) % tables.len()).collect();
        let symbols: Vec<u8> = raw
            .iter()
            .zip(&table_ix)
            .map(|(&(_, s), &t)| (usize::from(s) % tables[t].len()) as u8)
            .collect();
        let m = Message { tables, table_ix, symbols };
        let lanes = encode_message(&m);
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(m.symbols.len() + 1)).collect();
        cuts.sort_unstable();
        prop_assert_eq!(decode_message(&m, lane_refs(&lanes), &cuts).unwrap(), m.symbols);
    }

    #[test]
    fn proptest_garbage_never_panics(
        words in prop::collection::vec(prop::collection::vec(any::<u32>(), 0..40), LANES),
        n in 0usize..600,
        start_cut in 0usize..600,
    ) {
        let t = DecodeTable::from(&FreqTable::from_counts(&[5, 1, 9, 0, 3]));
        let per_pos = vec![&t; n];
        let refs: [&[u32]; LANES] = core::array::from_fn(|l| words[l].as_slice());
        if let Ok(mut dec) = LaneDecoder::new(refs) {
            let cut = start_cut.min(n);
            let mut out = vec![0u8; n];
            let (a, b) = out.split_at_mut(cut);
            dec.decode(0, &per_pos, a).unwrap();
            dec.decode(cut, &per_pos, b).unwrap();
            prop_assert!(out.iter().all(|&s| s < 5));
            let _ = dec.finish();
        }
    }
}

/// Decodes `len` symbols of `lanes` twice, with the vector path allowed (where the CPU has one)
/// and with the portable steps only, in the same pieces (`cuts`, sorted); asserts equal symbols,
/// states and unread word counts after every piece and equal `finish` results.
fn assert_paths_agree(
    lanes: [&[u32]; LANES],
    per_pos: &[&DecodeTable],
    cuts: &[usize],
) -> Result<(), TestCaseError> {
    let (Ok(mut fast), Ok(mut slow)) = (LaneDecoder::new(lanes), LaneDecoder::new(lanes)) else {
        prop_assert_eq!(LaneDecoder::new(lanes).err(), LaneDecoder::new(lanes).err());
        return Ok(());
    };
    slow.vector = false;
    let n = per_pos.len();
    let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
    let mut start = 0;
    for &end in cuts.iter().chain(core::iter::once(&n)) {
        fast.decode(start, &per_pos[start..end], &mut a[start..end])
            .unwrap();
        slow.decode(start, &per_pos[start..end], &mut b[start..end])
            .unwrap();
        prop_assert_eq!(&a[start..end], &b[start..end], "symbols {}..{}", start, end);
        prop_assert_eq!(fast.state, slow.state, "states after {}", end);
        prop_assert_eq!(fast.unread(), slow.unread(), "unread words after {}", end);
        start = end;
    }
    prop_assert_eq!(fast.finish(), slow.finish());
    Ok(())
}

/// Whether this machine runs the vector path (else the tests below compare the portable path
/// with itself, and say so).
fn vector_path_here() -> bool {
    #[cfg(all(feature = "std", feature = "simd", target_arch = "x86_64"))]
    {
        super::x86::available()
    }
    #[cfg(not(all(feature = "std", feature = "simd", target_arch = "x86_64")))]
    {
        false
    }
}

#[test]
fn vector_path_is_taken_where_available() {
    // The decoder must use the vector path on a CPU that has one: otherwise the differential
    // tests below would compare the portable path with itself.
    std::eprintln!("vector rANS path on this CPU: {}", vector_path_here());
    let m = random_message(&mut Rng(3), 5000);
    let lanes = encode_message(&m);
    let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
    let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
    let mut dec = LaneDecoder::new(lane_refs(&lanes)).unwrap();
    let mut out = vec![0u8; m.symbols.len()];
    let before = dec.state;
    let taken = vector_decode(
        &mut dec.state,
        &mut dec.pos,
        &dec.start,
        &dec.words,
        0,
        &per_pos,
        &mut out,
    );
    assert_eq!(taken, vector_path_here());
    if taken {
        assert_eq!(out, m.symbols);
    } else {
        assert_eq!(dec.state, before, "a path that did not run changed nothing");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Vector and portable paths agree on valid streams, cut anywhere (partial rounds at both
    /// ends, lanes that run out of words, empty lanes).
    #[test]
    fn proptest_vector_matches_portable_valid(
        seed in any::<u64>(),
        len in 0usize..4000,
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let m = random_message(&mut Rng(seed), len);
        let lanes = encode_message(&m);
        let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
        let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(len + 1)).collect();
        cuts.sort_unstable();
        assert_paths_agree(lane_refs(&lanes), &per_pos, &cuts)?;
    }

    /// ... and on arbitrary words (states no encoder produces, truncated and overlong lanes,
    /// decoding past a lane's end).
    #[test]
    fn proptest_vector_matches_portable_garbage(
        seed in any::<u64>(),
        words in prop::collection::vec(prop::collection::vec(any::<u32>(), 0..24), LANES),
        len in 0usize..1500,
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let m = random_message(&mut Rng(seed), len);
        let dts: Vec<DecodeTable> = m.tables.iter().map(DecodeTable::from).collect();
        let per_pos: Vec<&DecodeTable> = m.table_ix.iter().map(|&i| &dts[i]).collect();
        let refs: [&[u32]; LANES] = core::array::from_fn(|l| words[l].as_slice());
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(len + 1)).collect();
        cuts.sort_unstable();
        assert_paths_agree(refs, &per_pos, &cuts)?;
    }
}

/// The encoder's division by a reciprocal equals the hardware's for every frequency, on the
/// dividends at and around multiples of it, the largest ones, and random ones of every size.
#[test]
fn reciprocal_division_is_exact() {
    let mut rng = Rng(11);
    for f in 1..TOTAL {
        let e = table::EncSym::new(f, 0);
        let f = u64::from(f);
        let q_max = u64::MAX / f;
        let check = |a: u64| assert_eq!(e.div(a), a / f, "{a} / {f}");
        for a in [0, 1, f - 1, f, f + 1, u64::MAX, u64::MAX - 1, q_max * f, q_max * f - 1] {
            check(a);
        }
        for _ in 0..200 {
            let q = rng.below(q_max) + 1;
            check(q * f);
            check(q * f - 1);
            check(rng.next() >> rng.below(64));
        }
    }
}
