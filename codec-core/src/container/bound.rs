//! An upper bound on the length of an encoded stream, from the format alone.

use super::EncodeParams;
use crate::consts::{HEADER_FIXED_LEN, INDEX_ENTRY_LEN};
use crate::kv::{Dtype, KvShape};
use crate::rans::LANES;

/// Bytes of a block besides its sink rows, escape values and lane words: `n_escapes` (4), the 32
/// lane word counts (128), `n_exp` (1) and the largest exponent table (16 frequencies, 32).
pub const BLOCK_FIXED_MAX: u64 = 4 + 4 * LANES as u64 + 1 + 2 * 16;

/// Most words a rANS lane holding `k` symbols can have: `ceil(12 k / 32)`, i.e. 12 bits per
/// symbol, flush words included (see [`max_encoded_len`] for the proof).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // used by tests, benches and fuzzing
pub const fn max_lane_words(k: u64) -> u64 {
    (3 * k).div_ceil(8)
}

/// Most lane words, over all 32 lanes, of a block coding `n` symbols (symbol `p` in lane
/// `p mod 32`, so `n mod 32` lanes hold `n div 32 + 1` symbols and the others `n div 32`).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // used by tests, benches and fuzzing
pub const fn max_block_words(n: u64) -> u64 {
    // At most about 3 n / 8 + 28 <= u64::MAX: the narrowing is exact.
    block_words_wide(n as u128) as u64
}

/// [`max_block_words`] in `u128`, for symbol counts beyond `u64`.
const fn block_words_wide(n: u128) -> u128 {
    let lanes = LANES as u128;
    let (q, r) = (n / lanes, n % lanes);
    r * (3 * (q + 1)).div_ceil(8) + (lanes - r) * (3 * q).div_ceil(8)
}

/// An upper bound on the bytes of the stream [`encode`](super::encode) writes for a cache of
/// `shape` and `dtype` with `params`, whatever its values: `profile_len` is the length of the
/// embedded profile (`profile.as_bytes().len()` for
/// [`ProfileMode::Embedded`](super::ProfileMode::Embedded), 0 for
/// [`ProfileMode::Referenced`](super::ProfileMode::Referenced)) and `model_id_len` the byte length
/// of `meta.model_id`. Useful to size an output buffer before encoding. Saturates at `u64::MAX`.
///
/// # The bound
///
/// With `C = kv_heads * head_dim`, `H = kv_heads`, `L = layers`, chunks of `rows` tokens (every
/// chunk has `chunk_tokens` rows except a shorter last one; `ceil(tokens / chunk_tokens)`
/// chunks), and `W(n) = sum over the 32 lanes of ceil(3 k_l / 8)` where lane `l` holds
/// `k_l = |{p < n : p mod 32 = l}|` symbols:
///
/// ```text
/// len <= header + profile_len + sum over chunks of (4 + 2L * block(rows))
/// header     = 102 + model_id_len + 24 * n_chunks + 4
/// block(rows) = 165 + 4 * rows * C + 4 * W(rows * (C + H))
/// ```
///
/// # Proof
///
/// The header and chunk index are exactly `102 + m + 24 n + 4` bytes (`spec/FORMAT.md` §3.2),
/// the embedded profile exactly `profile_len`, and a chunk is its `2L` blocks plus a 4-byte CRC
/// (§3.6). A block of `rows` rows of which `S` are sinks (§5.2) has:
///
/// - 165 bytes of fixed fields at most: `n_escapes` (4), 32 lane word counts (128), `n_exp` (1)
///   and at most 16 exponent frequencies (32);
/// - `S * C * dsize` sink bytes, `dsize <= 4`;
/// - `4 * n_escapes` bytes of escape values, with `n_escapes <= n_sym = (rows - S) * C` (one
///   escape at most per value symbol, §5.5 B1);
/// - the lane words of `N = n_e + n_sym <= (rows - S) * (H + C)` coded symbols.
///
/// *Lane lemma*: a lane whose encoder (§6.5) codes `k` symbols emits at most `ceil(12 k / 32)`
/// words, flush included. Let `j` symbols be coded and `w` words emitted so far, state `x`. The
/// invariant is `x + 1 <= 2^(12 j - 32 w)`; it holds at the start (`x = 0`, `j = w = 0`).
/// Coding a symbol with frequency `f >= 1` and cumulative frequency `c` (`c + f <= 4096`) from a
/// state `y` gives `x' = floor(y / f) * 4096 + c + (y mod f) <= floor(y / f) * 4096 + 4095`, so
/// `x' + 1 <= (floor(y / f) + 1) * 4096 <= (y + 1) * 4096`. Without renormalisation `y = x`
/// and the exponent grows by 12 (`j + 1`). With renormalisation one word is emitted and
/// `y = floor(x / 2^32)`; since `x + 1 <= 2^E` with `E = 12 j - 32 w >= 53` (renormalisation
/// needs `x >= f * 2^52`), `y <= floor((2^E - 1) / 2^32) = 2^(E - 32) - 1`, so `y + 1 <=
/// 2^(E - 32)` and `x' + 1 <= 2^(12 (j + 1) - 32 (w + 1))`. So after the `k` symbols `32 w <= 12
/// k` (as `x + 1 >= 1`), and the flush emits as many words as `x` has nonzero 32-bit halves,
/// `ceil(bits(x) / 32) <= ceil((12 k - 32 w) / 32)` words; in all `w + ceil((12 k - 32 w) / 32)
/// = ceil(12 k / 32)`. (The bound is reached: a lane of `k` symbols of frequency 1 and
/// cumulative frequency 4095 has exactly `ceil(12 k / 32)` words.)
///
/// Summing the lemma over the lanes gives at most `W(N)` words of 4 bytes, and `W` does not
/// decrease with `N`. Finally a sink row costs `C * dsize <= 4 C` bytes, no more than the
/// `4 C` escape bytes the same row may cost as a non-sink row, and removing it from the coded
/// rows does not increase `W`; so the block is largest with `S = 0`: `165 + 4 * rows * C + 4 *
/// W(rows * (C + H))`.
///
/// The bound is for the worst case, where every value escapes (4 bytes each) and every symbol
/// costs 12 bits: about `5.5 + 1.5 H / C` bytes per element. Real caches code at a few bits per
/// element, so typical streams are an order of magnitude below it; a cache whose values all lie
/// far outside the profile's tables comes within a few percent of it (tested).
pub fn max_encoded_len(
    shape: &KvShape,
    dtype: Dtype,
    params: &EncodeParams,
    profile_len: u64,
    model_id_len: usize,
) -> u64 {
    // Sink bytes are bounded by escape bytes (dsize <= 4), so the dtype does not enter the bound.
    debug_assert!(dtype.size_bytes() <= 4);
    let tokens = u64::from(shape.tokens);
    let chunk_tokens = u64::from(params.chunk_tokens.max(1));
    let c = u64::from(shape.kv_heads) * u64::from(shape.head_dim);
    let h = u64::from(shape.kv_heads);
    let l = u64::from(shape.layers);
    let full = tokens / chunk_tokens;
    let rem = tokens % chunk_tokens;
    let n_chunks = full + u64::from(rem > 0);
    // In u128, a block of any shape fits (rows < 2^32, C + H < 2^64: under 2^100); a chunk's
    // 2L blocks and the sum over chunks may not, so those saturate.
    let chunk = |rows: u64| -> u128 {
        let rows = u128::from(rows);
        let words = block_words_wide(rows * (u128::from(c) + u128::from(h)));
        let block = u128::from(BLOCK_FIXED_MAX) + 4 * rows * u128::from(c) + 4 * words;
        (2 * u128::from(l)).saturating_mul(block).saturating_add(4)
    };
    let header = u128::from(HEADER_FIXED_LEN as u64)
        + model_id_len as u128
        + u128::from(INDEX_ENTRY_LEN as u64) * u128::from(n_chunks)
        + 4;
    let mut total = header + u128::from(profile_len);
    total = total.saturating_add(u128::from(full).saturating_mul(chunk(chunk_tokens)));
    if rem > 0 {
        total = total.saturating_add(chunk(rem));
    }
    u64::try_from(total).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rans::{encode_lanes, FreqTable};
    use alloc::vec;

    #[test]
    fn lane_lemma_is_reached_by_frequency_one_symbols() {
        // Symbol 1 of [4095, 1]: frequency 1, cumulative frequency 4095, 12 bits each.
        let t = FreqTable::new(&[4095, 1]).unwrap();
        for k in [0usize, 1, 2, 3, 5, 8, 13, 100, 1001] {
            let symbols = vec![1u8; k * LANES];
            let lanes = encode_lanes(&symbols, |_| &t);
            for lane in &lanes {
                assert_eq!(lane.len() as u64, max_lane_words(k as u64), "k = {k}");
            }
            assert_eq!(
                lanes.iter().map(|l| l.len() as u64).sum::<u64>(),
                max_block_words((k * LANES) as u64)
            );
        }
    }

    #[test]
    fn lane_lemma_holds_for_mixed_tables() {
        let tables = [
            FreqTable::new(&[1, 4095]).unwrap(),
            FreqTable::new(&[2048, 2048]).unwrap(),
            FreqTable::new(&[4095, 1]).unwrap(),
            FreqTable::from_counts(&[1, 2, 3, 1000, 5, 0, 7]),
        ];
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for n in [1usize, 31, 32, 33, 500, 4099] {
            let mut symbols = vec![0u8; n];
            let mut which = vec![0usize; n];
            for (s, w) in symbols.iter_mut().zip(which.iter_mut()) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *w = (seed % 4) as usize;
                *s = ((seed >> 8) % tables[*w].len() as u64) as u8;
            }
            let lanes = encode_lanes(&symbols, |g| &tables[which[g]]);
            let total: u64 = lanes.iter().map(|l| l.len() as u64).sum();
            assert!(total <= max_block_words(n as u64));
            for (l, lane) in lanes.iter().enumerate() {
                let k = (n + LANES - 1 - l) / LANES;
                assert!(lane.len() as u64 <= max_lane_words(k as u64));
            }
        }
    }

    #[test]
    fn block_words_sum_lanes() {
        assert_eq!(max_block_words(0), 0);
        assert_eq!(max_block_words(1), 1);
        assert_eq!(max_block_words(32), 32);
        assert_eq!(max_block_words(64), 32);
        assert_eq!(max_block_words(65), 32 + 1);
        assert_eq!(max_block_words(256), 96);
    }

    #[test]
    fn bound_counts_header_profile_and_chunks() {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            tokens: 0,
        };
        let p = EncodeParams::default();
        assert_eq!(max_encoded_len(&shape, Dtype::F16, &p, 0, 0), 106);
        assert_eq!(max_encoded_len(&shape, Dtype::F16, &p, 1000, 3), 1109);
        let one = KvShape { tokens: 1, ..shape };
        // One chunk of one row: 4 + 2 * 2 * (165 + 4 * 16 + 4 * W(18)), W(18) = 18.
        assert_eq!(
            max_encoded_len(&one, Dtype::F32, &p, 0, 0),
            106 + 24 + 4 + 4 * (165 + 64 + 72)
        );
        let huge = KvShape {
            layers: u32::MAX,
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            tokens: u32::MAX,
        };
        assert_eq!(max_encoded_len(&huge, Dtype::F32, &p, 0, 0), u64::MAX);
    }
}
