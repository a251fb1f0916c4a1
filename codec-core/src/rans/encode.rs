//! The 32-lane encoder.

use alloc::vec::Vec;

use super::table::{EncSym, FreqTable};
use super::{LANES, PRECISION};

/// One encode step of one lane: renormalise (possibly emitting a word), then
/// `x = ((x / f) << 12) | (c + x % f)`.
#[inline(always)]
fn encode_step(x: &mut u64, out: &mut Vec<u32>, e: EncSym) {
    let f = u64::from(e.freq);
    let mut s = *x;
    if s >= f << (64 - PRECISION) {
        out.push(s as u32);
        s >>= 32;
    }
    // The hardware division's throughput bounded the encoder (32 lanes are independent).
    let q = e.div(s);
    *x = (q << PRECISION) | (u64::from(e.cdf) + (s - q * f));
}

/// Encodes `symbols[g]` with table `table_of(g)` into lane `g % 32`, and returns each lane's
/// words.
///
/// Lane `l`'s words are exactly what constriction's `AnsCoder<u32, u64>` (`DefaultAnsCoder`)
/// gives from `into_compressed()` after `encode_symbols_reverse` of that lane's symbols
/// `symbols[l], symbols[l + 32], ...` with a 12-bit categorical model of the same frequencies
/// (symbols encoded last-to-first, so that decoding yields them first-to-last). See the
/// [module documentation](super) for the arithmetic.
///
/// `table_of` is called exactly once per symbol, in decreasing `g` order.
///
/// # Panics
///
/// Encoder input is trusted: panics if a symbol is `>= table_of(g).len()` (it has no frequency).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // used by tests, benches and fuzzing
pub fn encode_lanes<'t>(
    symbols: &[u8],
    table_of: impl Fn(usize) -> &'t FreqTable,
) -> [Vec<u32>; LANES] {
    let mut lanes: [Vec<u32>; LANES] = core::array::from_fn(|_| Vec::new());
    encode_lanes_into(symbols, table_of, &mut lanes);
    lanes
}

/// [`encode_lanes`] writing into `lanes`, reusing their allocations (each is cleared first).
pub fn encode_lanes_into<'t>(
    symbols: &[u8],
    table_of: impl Fn(usize) -> &'t FreqTable,
    lanes: &mut [Vec<u32>; LANES],
) {
    let n = symbols.len();
    // A rough capacity guess (about 4 bits per symbol); Vec grows as needed beyond it.
    let guess = n / LANES / 8 + 2;
    for lane in lanes.iter_mut() {
        lane.clear();
        lane.reserve(guess);
    }
    let mut state = [0u64; LANES];
    let full = n - n % LANES;
    // Symbols are encoded last-to-first: the partial round at the end first...
    for (l, &sym) in symbols[full..].iter().enumerate().rev() {
        let e = table_of(full + l).enc()[usize::from(sym)];
        encode_step(&mut state[l], &mut lanes[l], e);
    }
    // ...then the full rounds, last round first.
    for (round, chunk) in symbols[..full].chunks_exact(LANES).enumerate().rev() {
        let base = round * LANES;
        for (l, ((x, out), &sym)) in state
            .iter_mut()
            .zip(lanes.iter_mut())
            .zip(chunk)
            .enumerate()
            .rev()
        {
            let e = table_of(base + l).enc()[usize::from(sym)];
            encode_step(x, out, e);
        }
    }
    // Flush: low word then high word of the final state, leaving out leading zero words.
    for (x, out) in state.iter().zip(lanes.iter_mut()) {
        if *x != 0 {
            out.push(*x as u32);
            if *x >> 32 != 0 {
                out.push((*x >> 32) as u32);
            }
        }
    }
}
