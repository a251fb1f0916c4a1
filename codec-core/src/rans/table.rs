//! Frequency tables ([`FreqTable`]) and their decoding lookup tables ([`DecodeTable`]).

use alloc::vec::Vec;
use core::fmt;

use super::{TableError, MAX_SYMBOLS, PRECISION, TOTAL};

/// Per-symbol data the encoder needs, precomputed once per table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EncSym {
    /// Frequency `f_s` (1..=4095).
    pub(crate) freq: u32,
    /// Left cumulative frequency `c_s`.
    pub(crate) cdf: u32,
    /// `ceil(2^127 / f_s)`, high and low 64 bits: the encoder divides by `f_s` with it
    /// ([`EncSym::div`]).
    rcp: [u64; 2],
}

impl EncSym {
    pub(crate) fn new(freq: u32, cdf: u32) -> Self {
        // f >= 1, so the reciprocal is at most 2^127 and fits.
        let f = u128::from(freq.max(1));
        let m = (1u128 << 127).div_ceil(f);
        EncSym {
            freq,
            cdf,
            rcp: [(m >> 64) as u64, m as u64],
        }
    }

    /// `a / f_s` for any `a`, without a division: `floor(a * ceil(2^127 / f) / 2^127)`, exact
    /// since 127 bits are at least the dividend's 64 plus the divisor's 12 (Lemire, Kaser and
    /// Kurz, "Faster remainder by direct computation", 2019, theorem 1).
    #[inline(always)]
    pub(crate) fn div(&self, a: u64) -> u64 {
        let [hi, lo] = self.rcp;
        let low = (u128::from(lo) * u128::from(a)) >> 64;
        // hi <= 2^63, so the sum stays below 2^128; shifted, it is the quotient, at most `a`.
        let mid = u128::from(hi) * u128::from(a) + low;
        (mid >> 63) as u64
    }
}

/// A validated frequency table: `n` symbols (`2 <= n <= 256`), every frequency `>= 1`, the
/// frequencies summing to exactly `1 << PRECISION = 4096`.
///
/// Symbol `s` has frequency [`freq(s)`](Self::freq) and left cumulative frequency
/// [`cdf(s)`](Self::cdf) `= freq(0) + ... + freq(s - 1)`; this is the `(left_cumulative,
/// probability)` pair constriction's `ContiguousCategoricalEntropyModel::
/// from_nonzero_fixed_point_probabilities(freqs, false)` gives at `PRECISION = 12`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreqTable {
    freqs: Vec<u16>,
    enc: Vec<EncSym>,
}

impl FreqTable {
    /// Validates `freqs` (frequency of symbol `s` at index `s`).
    ///
    /// Checks, in this order: `freqs.len() >= 2` ([`TableError::TooFewSymbols`]), `freqs.len()
    /// <= 256` ([`TableError::TooManySymbols`]), no frequency is 0
    /// ([`TableError::ZeroFrequency`] with the first such symbol), the sum is exactly 4096
    /// ([`TableError::BadSum`]).
    pub fn new(freqs: &[u16]) -> Result<Self, TableError> {
        let n = freqs.len();
        if n < 2 {
            return Err(TableError::TooFewSymbols { got: n });
        }
        if n > MAX_SYMBOLS {
            return Err(TableError::TooManySymbols {
                got: n,
                max: MAX_SYMBOLS,
            });
        }
        if let Some(symbol) = freqs.iter().position(|&f| f == 0) {
            return Err(TableError::ZeroFrequency { symbol });
        }
        // At most 256 * 65535 < 2^32: no overflow.
        let sum: u32 = freqs.iter().map(|&f| u32::from(f)).sum();
        if sum != TOTAL {
            return Err(TableError::BadSum {
                got: sum,
                expected: TOTAL,
            });
        }
        Ok(Self::from_valid(freqs.to_vec()))
    }

    /// Builds the derived data of an already validated table.
    fn from_valid(freqs: Vec<u16>) -> Self {
        let mut cdf = 0u32;
        let enc = freqs
            .iter()
            .map(|&f| {
                let freq = u32::from(f);
                let e = EncSym::new(freq, cdf);
                cdf += freq;
                e
            })
            .collect();
        FreqTable { freqs, enc }
    }

    /// Deterministic, integer-only quantisation of symbol counts to a valid table.
    ///
    /// The result is the frequency vector maximising `sum(counts[s] * log2(f_s))` under the
    /// constraints (every `f_s >= 1`, sum 4096) when the marginal gain of one more unit for
    /// symbol `s`, `c_s * log2((f_s + 1) / f_s)`, is approximated by `c_s / (f_s + 1/2)` (a
    /// Sainte-Laguë / Webster apportionment with a floor of 1; the approximation is within 4% at
    /// `f = 1` and far closer above). Exactly:
    ///
    /// 1. Let `n = counts.len()`. If every count is 0, use `c_s = 1` for all `s`; otherwise
    ///    `c_s = counts[s]`.
    /// 2. Start with `f_s = 1` for every symbol.
    /// 3. Repeat `4096 - n` times: pick the symbol `s` maximising `c_s / (2 f_s + 1)`, ties going
    ///    to the lowest `s`, and increment `f_s`. Compare exactly with 128-bit integers:
    ///    `s` beats `t` iff `c_s * (2 f_t + 1) > c_t * (2 f_s + 1)`, or the products are equal and
    ///    `s < t`.
    ///
    /// Symbols with count 0 therefore get exactly 1 (unless all counts are 0). This implementation
    /// reaches the same result faster (a proportional first guess, then the same comparisons to
    /// add and exchange units; tested against the literal loop above), so ports may implement
    /// either.
    ///
    /// # Panics
    ///
    /// If `counts.len()` is not in `2..=256`.
    pub fn from_counts(counts: &[u64]) -> Self {
        let n = counts.len();
        assert!(
            (2..=MAX_SYMBOLS).contains(&n),
            "FreqTable::from_counts: {n} counts, expected 2..={MAX_SYMBOLS}"
        );
        let all_zero = counts.iter().all(|&c| c == 0);
        let c: Vec<u128> = counts
            .iter()
            .map(|&c| if all_zero { 1 } else { u128::from(c) })
            .collect();
        let total: u128 = c.iter().sum(); // <= 256 * 2^64: fits.
        let budget = u128::from(TOTAL) - n as u128; // units beyond the floor of 1, >= 3840
                                                    // First guess: 1 + floor(c_s * budget / total); sums to at most 4096.
        let mut f: Vec<u32> = c
            .iter()
            .map(|&cs| 1 + (cs * budget / total) as u32)
            .collect();
        let mut sum: u32 = f.iter().sum();

        // "Seat" (s, k) is the k-th unit of symbol s (k >= 2), with priority c_s / (2k - 1). The
        // greedy loop of the doc comment selects the 4096 - n first seats in the order: priority
        // descending, then s ascending, then k ascending. `before(s, k, t, m)`: seat (s, k)
        // comes before seat (t, m).
        let before = |c: &[u128], s: usize, k: u32, t: usize, m: u32| -> bool {
            let lhs = c[s] * u128::from(2 * m - 1);
            let rhs = c[t] * u128::from(2 * k - 1);
            lhs > rhs || (lhs == rhs && (s < t || (s == t && k < m)))
        };
        loop {
            // Best unselected seat: the next unit of some symbol.
            let mut add = 0usize;
            for s in 1..n {
                if before(&c, s, f[s] + 1, add, f[add] + 1) {
                    add = s;
                }
            }
            if sum < TOTAL {
                f[add] += 1;
                sum += 1;
                continue;
            }
            // Worst selected seat: the last unit of some symbol that has more than one.
            let mut worst: Option<usize> = None;
            for s in 0..n {
                if f[s] > 1 {
                    match worst {
                        Some(w) if before(&c, s, f[s], w, f[w]) => {}
                        _ => worst = Some(s),
                    }
                }
            }
            match worst {
                Some(w) if before(&c, add, f[add] + 1, w, f[w]) => {
                    f[add] += 1;
                    f[w] -= 1;
                }
                _ => break,
            }
        }
        debug_assert_eq!(sum, TOTAL);
        Self::from_valid(f.iter().map(|&x| x as u16).collect())
    }

    /// Number of symbols `n` (2..=256).
    pub fn len(&self) -> usize {
        self.freqs.len()
    }

    /// Always `false` (a table has at least 2 symbols); provided for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The frequencies, indexed by symbol.
    pub fn freqs(&self) -> &[u16] {
        &self.freqs
    }

    /// Frequency `f_s` of symbol `s`. Panics if `s >= len()`.
    pub fn freq(&self, s: usize) -> u32 {
        u32::from(self.freqs[s])
    }

    /// Left cumulative frequency `c_s = f_0 + ... + f_{s-1}` (`cdf(0) = 0`, `cdf(len()) =
    /// 4096`). Panics if `s > len()`.
    pub fn cdf(&self, s: usize) -> u32 {
        if s == self.enc.len() {
            TOTAL
        } else {
            self.enc[s].cdf
        }
    }

    /// Ideal cost in bits of coding `counts` with this table: `sum(counts[s] * (12 -
    /// log2(f_s)))`. Counts beyond `len()` must be 0 (otherwise the cost is infinite); missing
    /// counts are taken as 0. Floating point, for estimation only.
    pub fn cost_bits(&self, counts: &[u64]) -> f64 {
        let mut bits = 0.0;
        for (s, &c) in counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            match self.freqs.get(s) {
                Some(&f) => bits += c as f64 * (f64::from(PRECISION) - libm::log2(f64::from(f))),
                None => return f64::INFINITY,
            }
        }
        bits
    }

    /// Per-symbol encoder data.
    pub(crate) fn enc(&self) -> &[EncSym] {
        &self.enc
    }
}

/// The lookup table for decoding with one [`FreqTable`]: the symbol of each of the 4096 slots
/// (one byte each) and, per symbol, its frequency and left cumulative frequency.
///
/// 5 KiB, stored inline. A decode step reads `sym[slot]`, then `info[sym]`; the second read
/// almost always hits L1. (A block's rows use tens of tables, so the portable decoder keeps the
/// footprint small rather than packing one `u32` per slot.)
///
/// On x86-64 with the `std` and `simd` features the table also holds that packed form (21 KiB in
/// all): the AVX-512 decoder gathers it, one gather per 8 symbols instead of two dependent ones.
///
/// `#[repr(C)]`: the vector decoder relies on the field order for its offsets.
#[derive(Clone)]
#[repr(C)]
pub struct DecodeTable {
    /// Symbol of each slot.
    pub(crate) sym: [u8; TOTAL as usize],
    /// Per symbol: frequency in bits 0..16, left cumulative frequency in bits 16..32.
    pub(crate) info: [u32; 256],
    /// Per slot, for the vector decoder (`super::x86`): symbol in bits 0..8, frequency in bits
    /// 8..20, `slot - cdf` in bits 20..32.
    #[cfg(all(feature = "std", feature = "simd", target_arch = "x86_64"))]
    pub(crate) packed: [u32; TOTAL as usize],
}

impl DecodeTable {
    /// Builds the lookup table for `table`.
    pub fn new(table: &FreqTable) -> Self {
        let mut t = DecodeTable {
            sym: [0u8; TOTAL as usize],
            info: [0u32; 256],
            #[cfg(all(feature = "std", feature = "simd", target_arch = "x86_64"))]
            packed: [0u32; TOTAL as usize],
        };
        t.rebuild(table);
        t
    }

    /// Makes `self` the lookup table for `table`, in place (a table reused for one block after
    /// another is not built and moved anew). Every slot is written: a valid table's
    /// frequencies sum to 4096.
    pub(crate) fn rebuild(&mut self, table: &FreqTable) {
        self.info = [0u32; 256];
        let mut cdf = 0u32;
        for ((s, e), inf) in table.enc.iter().enumerate().zip(self.info.iter_mut()) {
            *inf = e.freq | cdf << 16;
            let slots = cdf as usize..(cdf + e.freq) as usize;
            self.sym[slots.clone()].fill(s as u8);
            #[cfg(all(feature = "std", feature = "simd", target_arch = "x86_64"))]
            for (k, p) in self.packed[slots].iter_mut().enumerate() {
                *p = s as u32 | e.freq << 8 | (k as u32) << 20;
            }
            cdf += e.freq;
        }
    }

    /// Symbol, frequency and left cumulative frequency for `slot` (reduced modulo 4096).
    #[inline(always)]
    pub fn lookup(&self, slot: u32) -> (u8, u32, u32) {
        let s = self.sym[(slot & (TOTAL - 1)) as usize];
        let i = self.info[s as usize];
        (s, i & 0xFFFF, i >> 16)
    }
}

impl From<&FreqTable> for DecodeTable {
    fn from(table: &FreqTable) -> Self {
        DecodeTable::new(table)
    }
}

impl PartialEq for DecodeTable {
    fn eq(&self, other: &Self) -> bool {
        self.sym[..] == other.sym[..] && self.info[..] == other.info[..]
    }
}

impl Eq for DecodeTable {}

impl fmt::Debug for DecodeTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Print the frequencies (one per symbol) instead of 4096 slots.
        f.write_str("DecodeTable")?;
        let n = usize::from(self.sym[TOTAL as usize - 1]) + 1;
        let mut list = f.debug_list();
        for i in &self.info[..n] {
            list.entry(&(i & 0xFFFF));
        }
        list.finish()
    }
}
