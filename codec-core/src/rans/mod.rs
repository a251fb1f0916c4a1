//! 32-lane interleaved rANS entropy coder, bit-identical per lane to
//! [`constriction`](https://docs.rs/constriction/0.5.0)'s `AnsCoder<u32, u64>` (its
//! `DefaultAnsCoder`) driven by a categorical model with 12-bit fixed-point probabilities.
//!
//! # Symbols, tables and lanes
//!
//! A message is a sequence of symbols `symbols[0..N]` (each a `u8`). Symbol `g` (its *global
//! index*) is coded with its own frequency table `T_g` (a [`FreqTable`]: `n` symbols, `2 <= n <=
//! 256`, frequencies `f_0..f_{n-1}`, each `>= 1`, summing to exactly `M = 2^PRECISION = 4096`;
//! left cumulative `c_s = f_0 + ... + f_{s-1}`, `c_0 = 0`). Symbol `g` belongs to lane
//! `g % 32`; each lane is an independent rANS stream whose symbols are the lane's subsequence in
//! increasing `g`.
//!
//! # Per-lane arithmetic (exactly constriction's `AnsCoder<u32, u64>` at `PRECISION = 12`)
//!
//! All arithmetic is on unsigned integers; `x` is a `u64` state; words are `u32`.
//!
//! **Encoding** walks the lane's symbols in *reverse* order (last symbol first), so that the
//! decoder yields them in forward order; this is constriction's `encode_symbols_reverse`.
//!
//! * Initial state: `x = 0`; the word list `W` is empty.
//! * Encode symbol `s` (left cumulative `c`, frequency `f`):
//!   1. Renormalise: if `(x >> 52) >= f` (i.e. `x >= f << 52`), append the low word
//!      `x & 0xFFFF_FFFF` to `W` and set `x = x >> 32`.
//!   2. Step: `x = ((x / f) << 12) | (c + x % f)` (integer division; `c + x % f < 4096`).
//! * Flush (constriction's `into_compressed`): if `x != 0`, append `x & 0xFFFF_FFFF` to `W`; then
//!   if `(x >> 32) != 0`, append `x >> 32`. (So a final state of 0 appends nothing, a final state
//!   below `2^32` appends one word, any other two words, low half first.) The lane's output is `W`.
//!
//! Once a word has been emitted the state stays `>= 2^32` (an encode step never decreases the
//! state), so the last word of a non-empty lane is never 0.
//!
//! **Decoding** reads the lane's words *backwards* (from the end, like a stack):
//!
//! * Initial state (constriction's `from_compressed`): if the lane is empty, `x = 0`. Otherwise
//!   the last word `t` must be nonzero (else [`RansError::ZeroFinalWord`]); `x = t`, and if there is
//!   a word before it, `x = (t << 32) | that_word`. One or two words are consumed.
//! * Decode one symbol with table `T`:
//!   1. `slot = x & 4095`; the symbol is the `s` with `c_s <= slot < c_s + f_s`.
//!   2. `x = (x >> 12) * f_s + (slot - c_s)` (never overflows: `(x >> 12) < 2^52`, `f_s < 2^12`).
//!   3. Refill: if `x < 2^32` and unread words remain, `x = (x << 32) | w`, where `w` is the last
//!      unread word (reading proceeds towards the start of the lane). If no words remain the
//!      state is left as is (constriction does the same; this is how the final, small states
//!      near the start of the encoding are decoded).
//! * Final check ([`LaneDecoder::finish`]): every word was consumed (else
//!   [`RansError::TrailingData`]) and `x == 0`, constriction's initial/empty state (else
//!   [`RansError::BadFinalState`]).
//!
//! Decoding *more* symbols than a lane holds is not detectable: a finished lane is in state 0
//! with no words, and from there every further decode step yields symbol 0 (slot 0) and stays in
//! state 0. The caller must know the symbol count.
//!
//! # Speed
//!
//! [`LaneDecoder::decode`] processes symbols in rounds of 32 with the 32 lane states in arrays,
//! so the 32 dependency chains overlap; symbol lookup is one load from a 4096-entry
//! [`DecodeTable`]; the refill is branch-free (select). A round consumes at most one word per
//! lane, so while every lane has `k` unread words the next `k` rounds skip the "words left?"
//! test. [`encode_lanes`] divides by a symbol's frequency with a 128-bit reciprocal multiply
//! (exact for every `u64`; a test checks every frequency), not the hardware division.
//!
//! On x86-64 with the `std` and `simd` features, a CPU with AVX-512 (F and DQ, detected at run
//! time) decodes with the module `x86`: the same arithmetic on 8 lanes per register, one gather
//! of a packed per-slot entry (symbol, frequency, `slot - cdf`) per 8 symbols, and each lane's
//! next word gathered ahead of its refill. Same symbols, states and positions as the portable
//! steps, bit for bit (differential property tests, including arbitrary words and call splits).
//! It is the crate's only `unsafe` code. Measurements, and the AVX-512 encoder that was tried and
//! dropped, are in the README's speed section.

mod decode;
mod encode;
mod table;
#[cfg(all(feature = "std", feature = "simd", target_arch = "x86_64"))]
#[allow(unsafe_code)]
mod x86;

#[cfg(test)]
mod tests;

pub use decode::LaneDecoder;
pub use encode::encode_lanes_into;
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for tests and benches
pub use encode::encode_lanes;
pub use table::{DecodeTable, FreqTable};

use core::fmt;

pub use crate::consts::{LANES, PRECISION};

/// Largest alphabet one [`FreqTable`] may have (symbols are `u8`).
pub const MAX_SYMBOLS: usize = 256;

/// Total frequency of a table, `1 << PRECISION`.
pub(crate) const TOTAL: u32 = 1 << PRECISION;

/// Why a frequency table was rejected by `FreqTable::new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TableError {
    /// Fewer than 2 symbols.
    TooFewSymbols {
        /// Number of frequencies given.
        got: usize,
    },
    /// More than `MAX_SYMBOLS` symbols.
    TooManySymbols {
        /// Number of frequencies given.
        got: usize,
        /// The limit, `MAX_SYMBOLS`.
        max: usize,
    },
    /// A symbol has frequency 0.
    ZeroFrequency {
        /// The first symbol with frequency 0.
        symbol: usize,
    },
    /// The frequencies do not sum to `1 << PRECISION`.
    BadSum {
        /// The actual sum.
        got: u32,
        /// `1 << PRECISION`.
        expected: u32,
    },
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TableError::TooFewSymbols { got } => {
                write!(f, "frequency table has {got} symbols, at least 2 required")
            }
            TableError::TooManySymbols { got, max } => {
                write!(
                    f,
                    "frequency table has {got} symbols, at most {max} allowed"
                )
            }
            TableError::ZeroFrequency { symbol } => {
                write!(f, "symbol {symbol} has frequency 0")
            }
            TableError::BadSum { got, expected } => {
                write!(f, "frequencies sum to {got}, expected {expected}")
            }
        }
    }
}

impl core::error::Error for TableError {}

/// Why decoding failed. Any word content may produce these; the decoder never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RansError {
    /// Reserved: a lane ran out of words. With constriction-compatible semantics a lane that runs
    /// out of words keeps decoding from its remaining (small) state, exactly as a valid stream
    /// does for its first-encoded symbols, so running out cannot be told apart from a valid
    /// tail while decoding; truncation surfaces as [`RansError::BadFinalState`] from
    /// `LaneDecoder::finish`. Currently never returned.
    OutOfWords {
        /// The lane.
        lane: usize,
    },
    /// `LaneDecoder::finish`: the lane has words that were never read.
    TrailingData {
        /// The lane.
        lane: usize,
    },
    /// `LaneDecoder::finish`: the lane's state is not constriction's initial state 0.
    BadFinalState {
        /// The lane.
        lane: usize,
    },
    /// `LaneDecoder::new`: the lane's last word (the first one read) is 0, which no encoder
    /// produces (constriction's `CompressedDataEndsWithZeroWord`).
    ZeroFinalWord {
        /// The lane.
        lane: usize,
    },
    /// `LaneDecoder::decode`: `start` is not the index of the next undecoded symbol.
    PositionMismatch {
        /// The index of the next undecoded symbol.
        expected: usize,
        /// The `start` passed.
        got: usize,
    },
    /// `LaneDecoder::from_concatenated`: the lane lengths do not add up to the number of
    /// words given.
    LaneLengths {
        /// The number of words given.
        words: usize,
    },
    /// `LaneDecoder::decode`: fewer tables than symbols to decode.
    TooFewTables {
        /// `out.len()`.
        needed: usize,
        /// `tables.len()`.
        got: usize,
    },
}

impl fmt::Display for RansError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RansError::OutOfWords { lane } => write!(f, "rANS lane {lane} ran out of words"),
            RansError::TrailingData { lane } => {
                write!(f, "rANS lane {lane} has unread words after the last symbol")
            }
            RansError::BadFinalState { lane } => {
                write!(f, "rANS lane {lane} did not end in the initial state")
            }
            RansError::ZeroFinalWord { lane } => {
                write!(f, "rANS lane {lane} ends with a zero word")
            }
            RansError::PositionMismatch { expected, got } => write!(
                f,
                "rANS decode called at symbol {got}, but the next symbol is {expected}"
            ),
            RansError::LaneLengths { words } => {
                write!(
                    f,
                    "rANS lane lengths do not add up to the {words} words given"
                )
            }
            RansError::TooFewTables { needed, got } => {
                write!(f, "rANS decode of {needed} symbols given only {got} tables")
            }
        }
    }
}

impl core::error::Error for RansError {}
