//! rANS targets: frequency tables, the lane decoder, and the lane coder's round trip.

use super::input::Input;
use crate::container::max_lane_words;
use crate::rans::{
    encode_lanes, encode_lanes_into, DecodeTable, FreqTable, LaneDecoder, RansError, TableError,
    LANES, MAX_SYMBOLS, PRECISION,
};
use alloc::vec;
use alloc::vec::Vec;

/// Frequencies of the fixed tables of [`rans_lanes`]: extremes of the alphabet size and of the
/// skew (frequency 1 next to 4095, 256 symbols).
pub const FIXED_TABLES: [&[u16]; 6] = [
    &[2048, 2048],
    &[1, 4095],
    &[4095, 1],
    &[1, 1, 4094],
    &[1365, 1365, 1366],
    &[16; 256],
];

/// The 8 tables of [`rans_lanes`]: [`FIXED_TABLES`], then 255 symbols of frequency 1 and one of
/// 3841, then a geometric table from [`FreqTable::from_counts`].
pub fn fixed_tables() -> Vec<FreqTable> {
    let mut v: Vec<FreqTable> = FIXED_TABLES
        .iter()
        .map(|f| FreqTable::new(f).expect("fixed table"))
        .collect();
    let mut one_big = [1u16; 256];
    one_big[255] = 4096 - 255;
    v.push(FreqTable::new(&one_big).expect("fixed table"));
    let geometric: Vec<u64> = (0..16).map(|i| 1u64 << (30 - 2 * i)).collect();
    v.push(FreqTable::from_counts(&geometric));
    v
}

/// What the reference lane decoder gives: the error of starting (a lane ending in a zero word),
/// or the decoded symbols and the end-of-lane check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaneDecodeResult {
    /// [`LaneDecoder::new`] fails with this error.
    BadStart(RansError),
    /// The symbols, and what [`LaneDecoder::finish`] returns.
    Decoded(Vec<u8>, Result<(), RansError>),
}

/// A plain transcription of `spec/FORMAT.md` §6.3: decodes symbol `g` from lane `g % 32` with
/// `tables[g]`, one symbol at a time, looking the slot up by a linear search of the cdf.
pub fn reference_lane_decode(lanes: [&[u32]; LANES], tables: &[&FreqTable]) -> LaneDecodeResult {
    let mut state = [0u64; LANES];
    let mut unread = [0usize; LANES];
    for (lane, w) in lanes.iter().enumerate() {
        let n = w.len();
        if n == 0 {
            continue;
        }
        if w[n - 1] == 0 {
            return LaneDecodeResult::BadStart(RansError::ZeroFinalWord { lane });
        }
        if n == 1 {
            state[lane] = u64::from(w[0]);
        } else {
            state[lane] = (u64::from(w[n - 1]) << 32) | u64::from(w[n - 2]);
            unread[lane] = n - 2;
        }
    }
    let mask = (1u64 << PRECISION) - 1;
    let mut out = Vec::with_capacity(tables.len());
    for (g, t) in tables.iter().enumerate() {
        let l = g % LANES;
        let x = state[l];
        let slot = (x & mask) as u32;
        let i = (0..t.len())
            .find(|&i| t.cdf(i) <= slot && slot < t.cdf(i) + t.freq(i))
            .expect("the cdf covers every slot");
        let mut x = (x >> PRECISION) * u64::from(t.freq(i)) + u64::from(slot - t.cdf(i));
        if x < 1 << 32 && unread[l] > 0 {
            unread[l] -= 1;
            x = (x << 32) | u64::from(lanes[l][unread[l]]);
        }
        state[l] = x;
        out.push(i as u8);
    }
    let mut end = Ok(());
    for lane in 0..LANES {
        if unread[lane] != 0 {
            end = Err(RansError::TrailingData { lane });
            break;
        }
        if state[lane] != 0 {
            end = Err(RansError::BadFinalState { lane });
            break;
        }
    }
    LaneDecodeResult::Decoded(out, end)
}

/// Lane words and how to cut the decoding, read from fuzz input.
struct LaneInput {
    /// Decode call lengths, cycled; 0 = everything left.
    segments: [u8; 4],
    /// Each lane's words.
    words: [Vec<u32>; LANES],
}

impl LaneInput {
    /// `segments: [u8; 4] | 32 lane lengths: u8 (mod 64) | words: u32 LE, lane 0's first` (a
    /// lane gets fewer words if the input ends).
    fn read(input: &mut Input<'_>) -> Self {
        let segments = [input.u8(), input.u8(), input.u8(), input.u8()];
        let lens: [usize; LANES] = core::array::from_fn(|_| usize::from(input.u8() % 64));
        let words = core::array::from_fn(|l| {
            let mut w = Vec::with_capacity(lens[l]);
            for _ in 0..lens[l] {
                let b = input.bytes(4);
                if b.len() < 4 {
                    break;
                }
                w.push(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
            w
        });
        LaneInput { segments, words }
    }

    fn lanes(&self) -> [&[u32]; LANES] {
        core::array::from_fn(|l| self.words[l].as_slice())
    }
}

/// Bytes of the lane part of a [`rans_lanes`] or [`freq_table`] input.
fn write_lanes(out: &mut Vec<u8>, segments: [u8; 4], lanes: &[Vec<u32>; LANES]) {
    out.extend_from_slice(&segments);
    for l in lanes {
        out.push(l.len() as u8);
    }
    for l in lanes {
        for w in l {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// Decodes symbol `g` with `tables[which[g]]` using [`LaneDecoder`] in calls of the lengths
/// `segments` gives and asserts that the symbols and errors are those of
/// [`reference_lane_decode`]. Also checks, once, that a call at the wrong position or with too
/// few tables fails without decoding anything.
fn check_lanes(lanes: [&[u32]; LANES], segments: [u8; 4], tables: &[FreqTable], which: &[usize]) {
    let per_symbol: Vec<&FreqTable> = which.iter().map(|&t| &tables[t]).collect();
    let reference = reference_lane_decode(lanes, &per_symbol);
    let mut dec = match LaneDecoder::new(lanes) {
        Ok(d) => d,
        Err(e) => {
            assert_eq!(reference, LaneDecodeResult::BadStart(e), "LaneDecoder::new");
            return;
        }
    };
    let LaneDecodeResult::Decoded(expected, expected_end) = reference else {
        panic!("LaneDecoder::new accepted lanes the reference rejects: {reference:?}");
    };
    let decode_tables: Vec<DecodeTable> = tables.iter().map(DecodeTable::new).collect();
    let refs: Vec<&DecodeTable> = which.iter().map(|&t| &decode_tables[t]).collect();
    let n = which.len();
    let mut out = vec![0u8; n];
    let mut pos = 0;
    let mut call = 0;
    while pos < n {
        let seg = usize::from(segments[call % 4]);
        let len = if seg == 0 { n - pos } else { seg.min(n - pos) };
        if call == 1 {
            let mut scratch = [0u8; 2];
            assert_eq!(
                dec.decode(pos + 1, &refs[pos..], &mut scratch[..1]),
                Err(RansError::PositionMismatch {
                    expected: pos,
                    got: pos + 1
                })
            );
            assert_eq!(
                dec.decode(pos, &refs[pos..pos + 1], &mut scratch),
                Err(RansError::TooFewTables { needed: 2, got: 1 })
            );
            assert_eq!(dec.position(), pos, "a failed call decodes nothing");
        }
        dec.decode(pos, &refs[pos..pos + len], &mut out[pos..pos + len])
            .expect("decode at the right position with enough tables");
        pos += len;
        call += 1;
    }
    assert_eq!(dec.position(), n);
    assert_eq!(
        out, expected,
        "LaneDecoder symbols differ from the reference decoder"
    );
    assert_eq!(dec.finish(), expected_end, "LaneDecoder::finish");
}

/// Arbitrary words through [`LaneDecoder`] with a fixed table set, against the reference
/// decoder (`fuzz_targets/rans_lanes.rs`).
///
/// Input: `n: u16` (symbols, mod 4097) | `k: u8` then `1 + k % 16` table selectors (symbol `g`
/// uses fixed table `sel[g % len] % 8`: [`FIXED_TABLES`], then 255 ones and a 3841, then a
/// geometric table) | the lane part: `segments: [u8; 4]` (lengths of successive decode calls,
/// cycled, 0 = the rest) | 32 lane lengths `u8` (mod 64) | the words, `u32` LE, lane 0 first.
pub fn rans_lanes(data: &[u8]) {
    let tables = fixed_tables();
    let mut input = Input::new(data);
    let n = usize::from(input.u16()) % 4097;
    let k = 1 + usize::from(input.u8() % 16);
    let sel: Vec<usize> = (0..k)
        .map(|_| usize::from(input.u8()) % tables.len())
        .collect();
    let lanes = LaneInput::read(&mut input);
    let which: Vec<usize> = (0..n).map(|g| sel[g % k]).collect();
    check_lanes(lanes.lanes(), lanes.segments, &tables, &which);
}

/// The input of [`rans_lanes`] (see there for the layout).
pub fn rans_lanes_input(
    n: u16,
    selectors: &[u8],
    segments: [u8; 4],
    lanes: &[Vec<u32>; LANES],
) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&n.to_le_bytes());
    v.push((selectors.len().clamp(1, 16) - 1) as u8);
    v.extend_from_slice(&selectors[..selectors.len().min(16)]);
    write_lanes(&mut v, segments, lanes);
    v
}

/// The input of [`freq_table`] for `mode`, the frequencies, and `symbols` symbols in `lanes`
/// (see there for the layout).
pub fn freq_table_input(
    mode: u8,
    freqs: &[u16],
    symbols: u16,
    segments: [u8; 4],
    lanes: &[Vec<u32>; LANES],
) -> Vec<u8> {
    let mut v = vec![mode];
    v.extend_from_slice(&(freqs.len() as u16).to_le_bytes());
    for f in freqs {
        v.extend_from_slice(&f.to_le_bytes());
    }
    v.extend_from_slice(&symbols.to_le_bytes());
    write_lanes(&mut v, segments, lanes);
    v
}

/// The literal greedy definition of [`FreqTable::from_counts`] (its doc comment, steps 1–3).
fn from_counts_literal(counts: &[u64]) -> Vec<u16> {
    let n = counts.len();
    let all_zero = counts.iter().all(|&c| c == 0);
    let c: Vec<u128> = counts
        .iter()
        .map(|&x| if all_zero { 1 } else { u128::from(x) })
        .collect();
    let mut f = vec![1u32; n];
    for _ in 0..(1usize << PRECISION) - n {
        let mut best = 0;
        for s in 1..n {
            if c[s] * u128::from(2 * f[best] + 1) > c[best] * u128::from(2 * f[s] + 1) {
                best = s;
            }
        }
        f[best] += 1;
    }
    f.iter().map(|&x| x as u16).collect()
}

/// Frequency tables from arbitrary numbers (`fuzz_targets/freq_table.rs`).
///
/// Input: `mode: u8` | `n: u16` (mod 300) | `n` frequencies `u16` | the lane part of
/// [`rans_lanes`] preceded by `symbols: u16` (mod 4097). Bit 0 of `mode` adjusts the last
/// frequency so the sum is 4096 when it can; `mode >> 1` (mod 48) shifts the frequencies left
/// to make counts for [`FreqTable::from_counts`].
///
/// Asserts: [`FreqTable::new`] returns exactly the documented error (or accepts); an accepted
/// table's [`DecodeTable`] maps every slot to the symbol whose cdf range holds it; lanes
/// decoded with it agree with the reference decoder; `from_counts` of counts gives a valid
/// table with frequency 1 exactly for zero counts (unless all are zero) and, for up to 24
/// symbols, the table of its literal definition.
pub fn freq_table(data: &[u8]) {
    let mut input = Input::new(data);
    let mode = input.u8();
    let n = usize::from(input.u16()) % 300;
    let mut freqs: Vec<u16> = (0..n).map(|_| input.u16()).collect();
    if mode & 1 != 0 && n >= 1 {
        let others: u32 = freqs[..n - 1].iter().map(|&f| u32::from(f)).sum();
        if let Some(last) = 4096u32.checked_sub(others).filter(|&l| l >= 1) {
            freqs[n - 1] = last as u16;
        }
    }

    // FreqTable::new: exactly the documented checks, in order.
    let sum: u32 = freqs.iter().map(|&f| u32::from(f)).sum();
    let expected = if n < 2 {
        Err(TableError::TooFewSymbols { got: n })
    } else if n > MAX_SYMBOLS {
        Err(TableError::TooManySymbols {
            got: n,
            max: MAX_SYMBOLS,
        })
    } else if let Some(symbol) = freqs.iter().position(|&f| f == 0) {
        Err(TableError::ZeroFrequency { symbol })
    } else if sum != 4096 {
        Err(TableError::BadSum {
            got: sum,
            expected: 4096,
        })
    } else {
        Ok(())
    };
    let table = FreqTable::new(&freqs);
    assert_eq!(table.as_ref().map(|_| ()).map_err(|e| *e), expected);

    if let Ok(t) = table {
        assert_eq!(t.freqs(), &freqs[..]);
        assert_eq!(t.cdf(t.len()), 4096);
        let dt = DecodeTable::new(&t);
        for slot in 0..4096u32 {
            let (s, f, c) = dt.lookup(slot);
            let s = usize::from(s);
            assert!(s < t.len());
            assert_eq!((f, c), (t.freq(s), t.cdf(s)), "slot {slot}");
            assert!(c <= slot && slot < c + f, "slot {slot}");
        }
        let symbols = usize::from(input.u16()) % 4097;
        let lanes = LaneInput::read(&mut input);
        check_lanes(lanes.lanes(), lanes.segments, &[t], &vec![0; symbols]);
    }

    // FreqTable::from_counts on the same numbers, as counts.
    if (2..=MAX_SYMBOLS).contains(&n) {
        let shift = u32::from(mode >> 1) % 48;
        let counts: Vec<u64> = freqs.iter().map(|&f| u64::from(f) << shift).collect();
        let t = FreqTable::from_counts(&counts);
        assert!(
            FreqTable::new(t.freqs()).is_ok(),
            "from_counts gives a valid table"
        );
        assert_eq!(t.len(), n);
        let all_zero = counts.iter().all(|&c| c == 0);
        for (&c, &f) in counts.iter().zip(t.freqs()) {
            if !all_zero && c == 0 {
                assert_eq!(f, 1, "a zero count gets frequency 1");
            }
        }
        if n <= 24 {
            assert_eq!(
                t.freqs(),
                &from_counts_literal(&counts)[..],
                "literal from_counts"
            );
        }
    }
}

/// Arbitrary symbols and tables through [`encode_lanes`] and back through [`LaneDecoder`]
/// (`fuzz_targets/roundtrip_rans.rs`).
///
/// Input: `t: u8` (`1 + t % 8` tables), per table `a: u8` (`2 + a % 255` symbols), `mode: u8`
/// and one byte per symbol (count `b`, or `2^(b % 48)` if `mode` is odd) for
/// [`FreqTable::from_counts`] | `n: u16` (symbols, mod 8193) | `segments: [u8; 4]` | per symbol
/// a table byte and a symbol byte (each reduced modulo the count), from the pseudo-random stream
/// once the input ends.
///
/// Asserts: decoding gives the symbols back and every lane ends clean; each lane has at most
/// [`max_lane_words`] words and does not end in a zero word; [`encode_lanes_into`] over dirty
/// buffers gives the same words.
pub fn roundtrip_rans(data: &[u8]) {
    let mut input = Input::new(data);
    let n_tables = 1 + usize::from(input.u8() % 8);
    let tables: Vec<FreqTable> = (0..n_tables)
        .map(|_| {
            let a = 2 + usize::from(input.u8() % 255);
            let mode = input.u8();
            let counts: Vec<u64> = (0..a)
                .map(|_| {
                    let b = input.u8_or_rng();
                    if mode & 1 != 0 {
                        1u64 << (b % 48)
                    } else {
                        u64::from(b)
                    }
                })
                .collect();
            FreqTable::from_counts(&counts)
        })
        .collect();
    let n = usize::from(input.u16()) % 8193;
    let segments = [input.u8(), input.u8(), input.u8(), input.u8()];
    let mut which = Vec::with_capacity(n);
    let mut symbols = Vec::with_capacity(n);
    for _ in 0..n {
        let t = usize::from(input.u8_or_rng()) % n_tables;
        which.push(t);
        symbols.push((usize::from(input.u8_or_rng()) % tables[t].len()) as u8);
    }
    let lanes = encode_lanes(&symbols, |g| &tables[which[g]]);
    let mut dirty: [Vec<u32>; LANES] = core::array::from_fn(|l| vec![0xDEAD_BEEF; l % 3]);
    encode_lanes_into(&symbols, |g| &tables[which[g]], &mut dirty);
    assert_eq!(dirty, lanes, "encode_lanes_into reuses buffers cleanly");
    for (l, lane) in lanes.iter().enumerate() {
        let k = (n + LANES - 1 - l) / LANES;
        assert!(
            lane.len() as u64 <= max_lane_words(k as u64),
            "lane {l}: {} words for {k} symbols",
            lane.len()
        );
        assert_ne!(lane.last(), Some(&0), "a lane never ends in a zero word");
    }
    let decode_tables: Vec<DecodeTable> = tables.iter().map(DecodeTable::new).collect();
    let refs: Vec<&DecodeTable> = which.iter().map(|&t| &decode_tables[t]).collect();
    let words: [&[u32]; LANES] = core::array::from_fn(|l| lanes[l].as_slice());
    let mut dec = LaneDecoder::new(words).expect("encoded lanes start");
    let mut out = vec![0u8; n];
    let mut pos = 0;
    let mut call = 0;
    while pos < n {
        let seg = usize::from(segments[call % 4]);
        let len = if seg == 0 { n - pos } else { seg.min(n - pos) };
        dec.decode(pos, &refs[pos..pos + len], &mut out[pos..pos + len])
            .expect("decode in order");
        pos += len;
        call += 1;
    }
    assert_eq!(out, symbols, "rANS round trip");
    assert_eq!(dec.finish(), Ok(()), "encoded lanes end clean");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_from_counts_matches_the_fast_one() {
        for counts in [&[0u64, 0][..], &[5, 0, 7], &[1, 1, 1, 1_000_000], &[3; 20]] {
            assert_eq!(
                FreqTable::from_counts(counts).freqs(),
                &from_counts_literal(counts)[..]
            );
        }
    }
}
