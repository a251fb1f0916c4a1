//! The 32-lane decoder.

use alloc::borrow::Cow;
use alloc::vec::Vec;
use core::fmt;

use super::table::DecodeTable;
use super::{RansError, LANES, PRECISION, TOTAL};

/// Decoder over 32 interleaved rANS lanes (see the [module documentation](super) for the
/// arithmetic).
///
/// Symbols must be decoded in order: each [`decode`](Self::decode) call continues where the
/// previous one stopped. Never panics, whatever the words; corrupted input yields an error or
/// valid-but-wrong symbols, which [`finish`](Self::finish) then most likely reports.
pub struct LaneDecoder<'a> {
    /// Every lane's words, lane 0 first: lane `l` owns `words[start[l]..end of lane l]`.
    pub(super) words: Cow<'a, [u32]>,
    /// Index in `words` of each lane's first word.
    pub(super) start: [usize; LANES],
    /// Per lane, one past the index in `words` of the next word to read (words are read
    /// backwards): `words[start[l]..pos[l]]` is unread.
    pub(super) pos: [usize; LANES],
    /// Each lane's state `x`.
    pub(super) state: [u64; LANES],
    /// Global index of the next symbol to decode.
    next: usize,
    /// Whether [`decode`](Self::decode) may use the vector path (tests turn it off to compare
    /// the two).
    pub(super) vector: bool,
}

impl fmt::Debug for LaneDecoder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneDecoder")
            .field("next", &self.next)
            .field("state", &self.state)
            .field("unread", &self.unread())
            .finish()
    }
}

/// One decode step of one lane (general case: the lane may have no unread word left).
#[inline(always)]
fn decode_step(
    x: &mut u64,
    pos: &mut usize,
    start: usize,
    words: &[u32],
    table: &DecodeTable,
) -> u8 {
    let s = *x;
    let slot = (s & u64::from(TOTAL - 1)) as u32;
    let (sym, freq, cdf) = table.lookup(slot);
    let (freq, bias) = (u64::from(freq), u64::from(slot.wrapping_sub(cdf)));
    // (s >> 12) < 2^52 and freq < 2^12, bias < freq: no overflow.
    let s = (s >> PRECISION) * freq + bias;
    let p = *pos;
    let any = p > start;
    let w = if any {
        words.get(p - 1).copied().unwrap_or(0)
    } else {
        0
    };
    let refill = (s < 1 << 32) & any;
    *x = if refill { (s << 32) | u64::from(w) } else { s };
    *pos = p - usize::from(refill);
    sym
}

/// One decode step of a lane known to have at least one unread word (`start < *pos`).
#[inline(always)]
fn decode_step_fast(x: &mut u64, pos: &mut usize, words: &[u32], table: &DecodeTable) -> u8 {
    let s = *x;
    let slot = (s & u64::from(TOTAL - 1)) as u32;
    let (sym, freq, cdf) = table.lookup(slot);
    let (freq, bias) = (u64::from(freq), u64::from(slot.wrapping_sub(cdf)));
    let s = (s >> PRECISION) * freq + bias;
    let p = *pos;
    // In bounds since start < p <= words.len(); `unwrap_or` and `wrapping_sub` keep this
    // panic-free even if that did not hold. The bound is the length of the one word slice of
    // all lanes, which stays in a register.
    let w = words.get(p.wrapping_sub(1)).copied().unwrap_or(0);
    let refill = s < 1 << 32;
    *x = if refill { (s << 32) | u64::from(w) } else { s };
    *pos = p.wrapping_sub(usize::from(refill));
    sym
}

/// One round of 32 `decode_step_fast`s, lane `l` decoding `out[l]` with `tables[l]`.
#[inline(always)]
fn fast_round(
    state: &mut [u64; LANES],
    pos: &mut [usize; LANES],
    words: &[u32],
    out: &mut [u8; LANES],
    tables: &[&DecodeTable; LANES],
) {
    // Unrolled by 4 (indices are provably in bounds, so no checks).
    for q in 0..LANES / 4 {
        for k in 0..4 {
            let l = 4 * q + k;
            out[l] = decode_step_fast(&mut state[l], &mut pos[l], words, tables[l]);
        }
    }
}

/// Decodes with the vector path where the CPU has one (see `super::x86`); `false` if it did
/// not run (nothing is then changed).
#[inline(always)]
pub(super) fn vector_decode(
    state: &mut [u64; LANES],
    pos: &mut [usize; LANES],
    start_of: &[usize; LANES],
    words: &[u32],
    first: usize,
    tables: &[&DecodeTable],
    out: &mut [u8],
) -> bool {
    #[cfg(all(feature = "std", feature = "simd", target_arch = "x86_64"))]
    {
        super::x86::decode(state, pos, start_of, words, first, tables, out)
    }
    #[cfg(not(all(feature = "std", feature = "simd", target_arch = "x86_64")))]
    {
        let _ = (state, pos, start_of, words, first, tables, out);
        false
    }
}

/// The portable decode of `out.len()` symbols from global index `start` (see
/// [`LaneDecoder::decode`]): single symbols up to a round boundary, full rounds of 32, then a
/// partial round.
fn scalar_decode(
    state: &mut [u64; LANES],
    pos: &mut [usize; LANES],
    start_of: &[usize; LANES],
    words: &[u32],
    start: usize,
    tables: &[&DecodeTable],
    out: &mut [u8],
) {
    // Head: single symbols until the next global index is a multiple of 32.
    let head = ((LANES - start % LANES) % LANES).min(out.len());
    let (out_head, out_body) = out.split_at_mut(head);
    let (tables_head, tables_body) = tables.split_at(head);
    for (j, (o, t)) in out_head.iter_mut().zip(tables_head).enumerate() {
        let l = (start + j) % LANES;
        *o = decode_step(&mut state[l], &mut pos[l], start_of[l], words, t);
    }

    // Body: full rounds of 32, lane l = position within the round. A round consumes at
    // most one word per lane, so while every lane has at least `k` unread words the next
    // `k` rounds can skip the "any words left?" test (`fast_round`); rounds where some lane
    // may run out use the general step.
    let mut out_rounds = out_body.chunks_exact_mut(LANES);
    let mut table_rounds = tables_body.chunks_exact(LANES);
    loop {
        let rounds_left = out_rounds.len();
        if rounds_left == 0 {
            break;
        }
        let safe = pos
            .iter()
            .zip(start_of)
            .map(|(&p, &s)| p - s)
            .min()
            .unwrap_or(0)
            .min(rounds_left);
        if safe == 0 {
            if let (Some(o), Some(t)) = (out_rounds.next(), table_rounds.next()) {
                for (l, (o, t)) in o.iter_mut().zip(t).enumerate() {
                    *o = decode_step(&mut state[l], &mut pos[l], start_of[l], words, t);
                }
            }
            continue;
        }
        for (o, t) in (&mut out_rounds).zip(&mut table_rounds).take(safe) {
            if let (Ok(o), Ok(t)) = (o.try_into(), t.try_into()) {
                fast_round(state, pos, words, o, t);
            }
        }
    }
    // Tail: a partial round, lanes 0.. in order.
    let out_tail = out_rounds.into_remainder();
    let tables_tail = table_rounds.remainder();
    for (l, (o, t)) in out_tail.iter_mut().zip(tables_tail).enumerate() {
        *o = decode_step(&mut state[l], &mut pos[l], start_of[l], words, t);
    }
}

impl<'a> LaneDecoder<'a> {
    /// Starts decoding: reads each lane's initial state from the end of its words (constriction's
    /// `from_compressed`): an empty lane starts in state 0; otherwise the last word `t` must be
    /// nonzero ([`RansError::ZeroFinalWord`]) and the state is `t`, or `(t << 32) | w` with `w`
    /// the word before `t` if there is one.
    ///
    /// Copies the words into one buffer; [`from_concatenated`](Self::from_concatenated)
    /// borrows words already laid out lane after lane, as a block stores them.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // used by tests, benches and fuzzing
    pub fn new(lane_words: [&[u32]; LANES]) -> Result<Self, RansError> {
        let lens = lane_words.map(<[u32]>::len);
        let words: Vec<u32> = lane_words.concat();
        Self::start(Cow::Owned(words), lens)
    }

    /// [`new`](Self::new) for the lanes' words stored one after the other in `words`, lane
    /// `l` taking the next `lane_len[l]` words; `words` must hold exactly `sum(lane_len)`
    /// words ([`RansError::LaneLengths`] otherwise).
    pub fn from_concatenated(
        words: &'a [u32],
        lane_len: [usize; LANES],
    ) -> Result<Self, RansError> {
        let total = lane_len
            .iter()
            .try_fold(0usize, |acc, &l| acc.checked_add(l));
        if total != Some(words.len()) {
            return Err(RansError::LaneLengths { words: words.len() });
        }
        Self::start(Cow::Borrowed(words), lane_len)
    }

    fn start(words: Cow<'a, [u32]>, lane_len: [usize; LANES]) -> Result<Self, RansError> {
        let mut start = [0usize; LANES];
        let mut pos = [0usize; LANES];
        let mut state = [0u64; LANES];
        let mut off = 0usize;
        for (lane, ((&len, (s, p)), x)) in lane_len
            .iter()
            .zip(start.iter_mut().zip(pos.iter_mut()))
            .zip(state.iter_mut())
            .enumerate()
        {
            *s = off;
            *p = off;
            let w = &words[off..off + len];
            off += len;
            match *w {
                [] => {}
                [.., 0] => return Err(RansError::ZeroFinalWord { lane }),
                [t] => *x = u64::from(t),
                [ref rest @ .., lo, hi] => {
                    *x = u64::from(hi) << 32 | u64::from(lo);
                    *p = *s + rest.len();
                }
            }
        }
        Ok(LaneDecoder {
            words,
            start,
            pos,
            state,
            next: 0,
            vector: true,
        })
    }

    /// Number of unread words of each lane.
    pub(super) fn unread(&self) -> [usize; LANES] {
        core::array::from_fn(|l| self.pos[l] - self.start[l])
    }

    /// Global index of the next symbol [`decode`](Self::decode) expects (number decoded so far).
    pub fn position(&self) -> usize {
        self.next
    }

    /// Decodes `out.len()` symbols, the symbols with global indices `start..start + out.len()`;
    /// the symbol with global index `g` comes from lane `g % 32` and is decoded with `tables[g -
    /// start]`.
    ///
    /// `start` must equal [`position()`](Self::position), the number of symbols decoded so far
    /// ([`RansError::PositionMismatch`] otherwise), and `tables.len() >= out.len()`
    /// ([`RansError::TooFewTables`]; extra tables are ignored). On error nothing is decoded.
    pub fn decode(
        &mut self,
        start: usize,
        tables: &[&DecodeTable],
        out: &mut [u8],
    ) -> Result<(), RansError> {
        if start != self.next {
            return Err(RansError::PositionMismatch {
                expected: self.next,
                got: start,
            });
        }
        let Some(tables) = tables.get(..out.len()) else {
            return Err(RansError::TooFewTables {
                needed: out.len(),
                got: tables.len(),
            });
        };
        let Some(end) = start.checked_add(out.len()) else {
            // Unreachable in practice (`start` counts decoded symbols).
            return Err(RansError::PositionMismatch {
                expected: self.next,
                got: start,
            });
        };

        let words: &[u32] = &self.words;
        let state = &mut self.state;
        let pos = &mut self.pos;
        let start_of = &self.start;

        if self.vector && vector_decode(state, pos, start_of, words, start, tables, out) {
            self.next = end;
            return Ok(());
        }

        scalar_decode(state, pos, start_of, words, start, tables, out);
        self.next = end;
        Ok(())
    }

    /// Ends decoding: checks that every lane read all its words ([`RansError::TrailingData`])
    /// and is back in constriction's initial state 0 ([`RansError::BadFinalState`]); reports
    /// the lowest failing lane.
    pub fn finish(self) -> Result<(), RansError> {
        for (lane, (&u, &x)) in self.unread().iter().zip(&self.state).enumerate() {
            if u != 0 {
                return Err(RansError::TrailingData { lane });
            }
            if x != 0 {
                return Err(RansError::BadFinalState { lane });
            }
        }
        Ok(())
    }
}
