//! Fuzz harnesses (feature `fuzzing`): the bodies of the cargo-fuzz targets `fuzz/fuzz_targets/
//! pq_unpack.rs` and `fuzz/fuzz_targets/pq_search.rs`.
//!
//! The target is one call of [`pq_unpack_counting`], and `tests/fuzz_regressions.rs` replays the
//! committed inputs in `fuzz/seeds/pq_unpack/` and `fuzz/regressions/pq_unpack/` through the
//! same function, so a crash found by fuzzing stays fixed under plain `cargo test`. The harness
//! returns normally for every input; it panics (a crash, for the fuzzer) only when [`unpack`]
//! panics or one of the assertions below fails.
//!
//! | target | entry points | invariants asserted |
//! |---|---|---|
//! | `pq_search` | [`search`], [`select`], [`scores`] | the fused search (with its AVX-512 fixed-point kernel where the CPU has it) returns exactly `select(scores(..))`, on tables with NaN, infinities, ties, and sums one `f32` spacing apart; [`pq_search`] gives the input layout |
//! | `pq_unpack` | [`unpack`], [`pack`], [`packed_len`] | exactly the errors `spec/PQ.md` §2 requires: `b` outside `1..=16`, a byte length other than `ceil(n * b / 8)`, non-zero padding; an accepted input gives `n` codes, each `< 2^b` and equal to a bit-by-bit reading of the spec, and [`pack`] of them gives the input bytes back; a rejected input with non-zero padding decodes once its padding is cleared; [`unpack`] allocates nothing when the length is wrong and at most `n` codes when it is right |
//!
//! # Input layout
//!
//! ```text
//! b_sel u8 | n_sel u8 | n_arg u32 (little-endian) | payload (the packed bytes, to the end)
//! ```
//!
//! Missing header bytes read as zero. See [`PqUnpackCase::from_input`] for how `b` and `n` are
//! derived: mostly an `n` that fits the payload (or misses it by a little), sometimes an
//! arbitrary `n` up to `2^63` to check that a huge claim is rejected before anything is
//! allocated.
use alloc::vec::Vec;

use crate::error::PqError;
use crate::pack::{pack, packed_len, unpack, MAX_PACK_BITS};
use crate::search::{scores, search, select, ScoreTable};
use alloc::vec;

/// Bytes before the payload in a `pq_unpack` input.
pub const PQ_UNPACK_HEADER_LEN: usize = 6;

/// One `pq_unpack` case: the arguments given to [`unpack`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PqUnpackCase<'a> {
    /// Bits per code (may be invalid: 0, or above 16).
    pub b: u8,
    /// The number of codes claimed.
    pub n: usize,
    /// The packed bytes.
    pub payload: &'a [u8],
}

impl<'a> PqUnpackCase<'a> {
    /// Reads a case from fuzz bytes (layout in the module docs).
    ///
    /// * `b`: `b_sel % 20` (0, the valid `1..=16`, and `17..=19`) when `b_sel < 0xF0`, else
    ///   `b_sel` itself (`240..=255`).
    /// * `n`, by `n_sel & 3`, where `fit = 8 * payload.len() / b` is the most codes the payload
    ///   can hold (and `n_arg` when `b = 0`): `0` gives `fit`; `1` gives `fit - n_arg % 16`
    ///   (saturating); `2` gives `fit + n_arg % 16`; `3` gives `n_arg << ((n_sel >> 2) & 31)`,
    ///   up to `2^63` (saturated to `usize::MAX` on narrower targets).
    pub fn from_input(data: &'a [u8]) -> Self {
        let mut header = [0u8; PQ_UNPACK_HEADER_LEN];
        let split = data.len().min(PQ_UNPACK_HEADER_LEN);
        header[..split].copy_from_slice(&data[..split]);
        let payload = &data[split..];
        let [b_sel, n_sel, a0, a1, a2, a3] = header;
        let n_arg = u32::from_le_bytes([a0, a1, a2, a3]);
        let b = if b_sel < 0xF0 { b_sel % 20 } else { b_sel };
        let n_arg_usize = usize::try_from(n_arg).unwrap_or(usize::MAX);
        let fit = match b {
            0 => n_arg_usize,
            _ => payload.len().saturating_mul(8) / usize::from(b),
        };
        let near = (n_arg % 16) as usize;
        let n = match n_sel & 3 {
            0 => fit,
            1 => fit.saturating_sub(near),
            2 => fit.saturating_add(near),
            _ => {
                let wide = u64::from(n_arg) << ((n_sel >> 2) & 31);
                usize::try_from(wide).unwrap_or(usize::MAX)
            }
        };
        PqUnpackCase { b, n, payload }
    }
}

/// Builds a `pq_unpack` input from its header fields and payload (the inverse of the layout
/// read by [`PqUnpackCase::from_input`]); for writing seeds.
pub fn pq_unpack_input(b_sel: u8, n_sel: u8, n_arg: u32, payload: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(PQ_UNPACK_HEADER_LEN + payload.len());
    data.push(b_sel);
    data.push(n_sel);
    data.extend_from_slice(&n_arg.to_le_bytes());
    data.extend_from_slice(payload);
    data
}

/// Stream bit `p` of `bytes` (`spec/PQ.md` §2: bit `p % 8` of byte `p / 8`).
fn stream_bit(bytes: &[u8], p: usize) -> u16 {
    u16::from((bytes[p / 8] >> (p % 8)) & 1)
}

/// Code `i` read bit by bit as `spec/PQ.md` §2 defines it: bit `q` of the code is stream bit
/// `i * b + q`.
fn reference_code(bytes: &[u8], b: u8, i: usize) -> u16 {
    let b = usize::from(b);
    (0..b).fold(0u16, |code, q| code | (stream_bit(bytes, i * b + q) << q))
}

/// `true` if every stream bit from `used_bits` to the end of `bytes` is zero.
fn padding_is_zero(bytes: &[u8], used_bits: usize) -> bool {
    (used_bits..bytes.len() * 8).all(|p| stream_bit(bytes, p) == 0)
}

/// [`pq_unpack_counting`] without the allocation check.
pub fn pq_unpack(data: &[u8]) {
    pq_unpack_counting(data, || 0);
}

/// The `pq_unpack` target: runs [`unpack`] on the case [`PqUnpackCase::from_input`] reads from
/// `data` and asserts the invariants of the module docs.
///
/// `allocated_bytes` returns the total number of bytes the global allocator has handed out so
/// far on this thread (a counter that only grows); the harness reads it around the [`unpack`]
/// call and asserts that the call allocated nothing if the byte length is wrong, and at most
/// `n` codes (`2 * n` bytes, with `ceil(n * b / 8)` equal to the input length) otherwise.
/// Pass `|| 0` where no counting allocator is installed.
pub fn pq_unpack_counting(data: &[u8], allocated_bytes: impl Fn() -> usize) {
    let PqUnpackCase { b, n, payload } = PqUnpackCase::from_input(data);
    let before = allocated_bytes();
    let result = unpack(payload, b, n);
    let allocated = allocated_bytes().wrapping_sub(before);

    let len = match packed_len(n, b) {
        Err(e) => {
            // b outside 1..=16, or n * b overflows: nothing else can be checked.
            if b == 0 || b > MAX_PACK_BITS {
                assert_eq!(
                    e,
                    PqError::BitsOutOfRange {
                        b,
                        max: MAX_PACK_BITS
                    }
                );
            } else {
                assert_eq!(e, PqError::TooLarge);
            }
            assert_eq!(result, Err(e), "b={b} n={n}");
            assert_eq!(allocated, 0, "allocated {allocated} bytes for b={b} n={n}");
            return;
        }
        Ok(len) => len,
    };
    if payload.len() != len {
        assert_eq!(
            result,
            Err(PqError::LengthMismatch {
                got: payload.len(),
                expected: len
            }),
            "b={b} n={n}"
        );
        assert_eq!(
            allocated,
            0,
            "allocated {allocated} bytes for a rejected length (b={b} n={n} len={})",
            payload.len()
        );
        return;
    }
    // The length is right, so n * b <= 8 * len: n codes are what the bytes pay for.
    let code_bytes = n * core::mem::size_of::<u16>();
    assert!(
        allocated <= code_bytes,
        "allocated {allocated} bytes for {n} codes"
    );
    let used_bits = n * usize::from(b);
    let canonical = padding_is_zero(payload, used_bits);
    let codes = match result {
        Ok(codes) => {
            assert!(canonical, "accepted non-zero padding (b={b} n={n})");
            // Canonical input: pack gives the same bytes back.
            assert_eq!(pack(&codes, b).as_deref(), Ok(payload), "b={b} n={n}");
            codes
        }
        Err(e) => {
            assert_eq!(e, PqError::NonZeroPadding, "b={b} n={n}");
            assert!(!canonical, "rejected zero padding (b={b} n={n})");
            // Clearing the padding bits gives the canonical form, which decodes.
            let mut cleared = payload.to_vec();
            if let Some(last) = cleared.last_mut() {
                let used_in_last = used_bits - (len - 1) * 8;
                *last &= ((1u16 << used_in_last) - 1) as u8;
            }
            let codes = unpack(&cleared, b, n).expect("canonical form decodes");
            assert_eq!(pack(&codes, b).as_deref(), Ok(&cleared[..]));
            codes
        }
    };
    assert_eq!(codes.len(), n);
    let max = (1u32 << b) - 1;
    for (i, &code) in codes.iter().enumerate() {
        assert!(u32::from(code) <= max, "code {i} = {code} >= 2^{b}");
        assert_eq!(
            code,
            reference_code(payload, b, i),
            "code {i} (b={b} n={n})"
        );
    }
}

/// Bytes before the payload in a `pq_search` input.
pub const PQ_SEARCH_HEADER_LEN: usize = 12;

/// The `pq_search` target: the fused [`search`] equals [`select`] over [`scores`] (the
/// definition `spec/PQ.md` §5 gives), for an `m = 2` table and codes read from `data`:
///
/// ```text
/// b_sel u8 | mode u8 | t_arg u16 | k_arg u16 | n_init u8 | n_local u8 | seed u32 | payload
/// ```
///
/// (little-endian; missing bytes read as zero). `b = 1 + b_sel % 7`, `T = t_arg % 4097` tokens,
/// `k = k_arg % (T + 2)`, windows `n_init % 80` and `n_local % 200`. The table's `2 * 2^b`
/// entries come from the payload by `mode % 4`: 0, raw `f32` bits (NaN, infinities and
/// subnormals included); 1, a palette of 16 small integers, signed zeros and the specials (many
/// exact ties); 2, `3000 + byte * 2.4e-4` (sums that differ by about one `f32` spacing, where
/// rounding merges them); 3, continuous values from `seed`. The codes follow: one payload byte
/// each (modulo `2^b`), then values from `seed` once the payload runs out, so that long
/// searches (the AVX-512 kernel's sampled bracket needs 512 tokens) come from short inputs.
pub fn pq_search(data: &[u8]) {
    let byte = |i: usize| data.get(i).copied().unwrap_or(0);
    let u16_at = |i: usize| u16::from_le_bytes([byte(i), byte(i + 1)]);
    let b = 1 + byte(0) % 7;
    let mode = byte(1) % 4;
    let t = usize::from(u16_at(2)) % 4097;
    let k = usize::from(u16_at(4)) % (t + 2);
    let (n_init, n_local) = (usize::from(byte(6) % 80), usize::from(byte(7)) % 200);
    let mut state = u64::from(u32::from_le_bytes([byte(8), byte(9), byte(10), byte(11)])) | 1 << 40;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let payload = data.get(PQ_SEARCH_HEADER_LEN..).unwrap_or(&[]);
    let mut at = 0usize;
    let kk = 1usize << b;
    let mut values = Vec::with_capacity(2 * kk);
    for _ in 0..2 * kk {
        let v = match mode {
            0 => {
                let mut w = [0u8; 4];
                for x in &mut w {
                    *x = payload.get(at).copied().unwrap_or(0);
                    at += 1;
                }
                f32::from_le_bytes(w)
            }
            1 | 2 => {
                let x = payload.get(at).copied().unwrap_or(0);
                at += 1;
                if mode == 2 {
                    3000.0 + f32::from(x) * 2.4e-4
                } else {
                    match x % 24 {
                        16 => -0.0,
                        17 => 0.0,
                        18 => f32::NAN,
                        19 => f32::INFINITY,
                        20 => f32::NEG_INFINITY,
                        v => f32::from(v % 16) - 8.0,
                    }
                }
            }
            _ => ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0,
        };
        values.push(v);
    }
    let table = ScoreTable { m: 2, b, values };
    let codes: Vec<u16> = (0..2 * t)
        .map(|_| {
            let c = match payload.get(at) {
                Some(&x) => u64::from(x),
                None => next() >> 20,
            };
            at += 1;
            (c % kk as u64) as u16
        })
        .collect();
    let want = select(
        &scores(&codes, &table).expect("valid codes"),
        k,
        n_init,
        n_local,
    )
    .expect("T fits u32");
    let got = search(&codes, &table, k, n_init, n_local).expect("valid codes");
    assert_eq!(got, want, "search differs from select over scores");
}

/// Builds a `pq_search` input from its header fields and payload; for writing seeds.
#[allow(clippy::too_many_arguments)]
pub fn pq_search_input(
    b_sel: u8,
    mode: u8,
    t_arg: u16,
    k_arg: u16,
    n_init: u8,
    n_local: u8,
    seed: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut data = vec![b_sel, mode];
    data.extend_from_slice(&t_arg.to_le_bytes());
    data.extend_from_slice(&k_arg.to_le_bytes());
    data.extend_from_slice(&[n_init, n_local]);
    data.extend_from_slice(&seed.to_le_bytes());
    data.extend_from_slice(payload);
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_layout() {
        let data = pq_unpack_input(6, 0, 0, &[0x81, 0x30, 0xFC]);
        assert_eq!(
            PqUnpackCase::from_input(&data),
            PqUnpackCase {
                b: 6,
                n: 4,
                payload: &[0x81, 0x30, 0xFC]
            }
        );
        assert_eq!(PqUnpackCase::from_input(&[]).b, 0);
        assert_eq!(PqUnpackCase::from_input(&[13]).b, 13);
        assert_eq!(PqUnpackCase::from_input(&[0xFF]).b, 0xFF);
        let huge = pq_unpack_input(6, 3 | (31 << 2), u32::MAX, &[]);
        assert_eq!(
            PqUnpackCase::from_input(&huge).n,
            usize::try_from(u64::from(u32::MAX) << 31).unwrap_or(usize::MAX)
        );
        assert_eq!(
            PqUnpackCase::from_input(&pq_unpack_input(6, 1, 3, &[0; 3])).n,
            1
        );
        assert_eq!(
            PqUnpackCase::from_input(&pq_unpack_input(6, 2, 3, &[0; 3])).n,
            7
        );
    }

    #[test]
    fn harness_accepts_its_edge_cases() {
        // Under Miri, which interprets every step, a subset of the same `b` selectors.
        let b_sels: &[u8] = if cfg!(miri) {
            &[0, 1, 6, 16, 17, 0xFF]
        } else {
            &[0, 1, 3, 6, 8, 12, 13, 16, 17, 19, 0xF0, 0xFF]
        };
        for &b_sel in b_sels {
            for n_sel in 0..8u8 {
                for payload in [
                    &[][..],
                    &[0xFF],
                    &[0x81, 0x30, 0xFC],
                    &[0x12, 0x34, 0x56, 0x78],
                ] {
                    for n_arg in [0, 1, 5, u32::MAX] {
                        pq_unpack(&pq_unpack_input(b_sel, n_sel, n_arg, payload));
                    }
                }
            }
        }
    }
}
