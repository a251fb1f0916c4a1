//! Bit packing of PQ codes.
//!
//! # Layout (normative; to be copied into `spec/PQ.md`)
//!
//! A flat sequence of `n` codes `c[0..n]`, each `< 2^b` with `1 <= b <= 16`, is stored as
//! `ceil(n * b / 8)` bytes. For codes of `T` tokens with `m` sub-spaces the sequence is
//! token-major: `c[t * m + j]` is the code of token `t` in sub-space `j`.
//!
//! * The bytes form a bit stream; stream bit `p` is bit `p % 8` (value `1 << (p % 8)`) of byte
//!   `p / 8` (LSB-first, little-endian).
//! * Code `i` occupies stream bits `i*b .. i*b + b`; bit `q` of the code (value `1 << q`) is stream
//!   bit `i*b + q`. Codes therefore straddle bytes freely; there is no alignment or per-token padding.
//! * The `8 * len - n * b` bits after the last code are zero. A decoder rejects non-zero padding and
//!   any byte length other than `ceil(n * b / 8)`.
//!
//! Equivalently: the stream is the little-endian integer `sum_i c[i] << (i * b)`, written in
//! `ceil(n * b / 8)` bytes, least significant byte first.
//!
//! Example (`b = 6`, codes `[1, 2, 3, 63]`): `[0x81, 0x30, 0xFC]`.
use alloc::vec;
use alloc::vec::Vec;

use crate::error::PqError;

/// The largest bits per code [`pack`] accepts.
pub const MAX_PACK_BITS: u8 = 16;

fn check_bits(b: u8) -> Result<(), PqError> {
    if b == 0 || b > MAX_PACK_BITS {
        return Err(PqError::BitsOutOfRange {
            b,
            max: MAX_PACK_BITS,
        });
    }
    Ok(())
}

/// Bytes taken by `n` codes of `b` bits: `ceil(n * b / 8)`.
pub fn packed_len(n: usize, b: u8) -> Result<usize, PqError> {
    check_bits(b)?;
    let bits = n.checked_mul(usize::from(b)).ok_or(PqError::TooLarge)?;
    Ok(bits.div_ceil(8))
}

/// Packs `codes` at `b` bits each (layout in the module docs). Errors if `b` is out of
/// `1..=MAX_PACK_BITS` or a code is `>= 2^b`.
pub fn pack(codes: &[u16], b: u8) -> Result<Vec<u8>, PqError> {
    let len = packed_len(codes.len(), b)?;
    let max = ((1u32 << b) - 1) as u16;
    let mut out = vec![0u8; len];
    // A 32-bit accumulator holds at most 7 pending bits plus one 16-bit code.
    let mut acc: u32 = 0;
    let mut nbits: u32 = 0;
    let mut at = 0;
    for (index, &code) in codes.iter().enumerate() {
        if code > max {
            return Err(PqError::CodeOutOfRange { index, code, max });
        }
        acc |= u32::from(code) << nbits;
        nbits += u32::from(b);
        while nbits >= 8 {
            out[at] = acc as u8;
            at += 1;
            acc >>= 8;
            nbits -= 8;
        }
    }
    if nbits > 0 {
        out[at] = acc as u8;
    }
    Ok(out)
}

/// Unpacks `n` codes of `b` bits from `bytes`. Errors if `bytes.len() != packed_len(n, b)` or the
/// padding bits are not zero.
pub fn unpack(bytes: &[u8], b: u8, n: usize) -> Result<Vec<u16>, PqError> {
    let expected = packed_len(n, b)?;
    if bytes.len() != expected {
        return Err(PqError::LengthMismatch {
            got: bytes.len(),
            expected,
        });
    }
    let mask = (1u32 << b) - 1;
    let mut out = Vec::with_capacity(n);
    let mut acc: u32 = 0;
    let mut nbits: u32 = 0;
    let mut bytes_iter = bytes.iter();
    for _ in 0..n {
        while nbits < u32::from(b) {
            // Cannot run out: the length was checked above.
            let byte = bytes_iter.next().copied().unwrap_or(0);
            acc |= u32::from(byte) << nbits;
            nbits += 8;
        }
        out.push((acc & mask) as u16);
        acc >>= b;
        nbits -= u32::from(b);
    }
    if acc != 0 {
        return Err(PqError::NonZeroPadding);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden vectors: these exact bytes are part of the format.
    #[test]
    fn golden_vectors() {
        let cases: &[(u8, &[u16], &[u8])] = &[
            (6, &[1, 2, 3, 63], &[0x81, 0x30, 0xFC]),
            (6, &[0x2A], &[0x2A]),
            (6, &[0x3F, 0x3F], &[0xFF, 0x0F]),
            (1, &[1, 0, 1, 1, 0, 0, 0, 0, 1], &[0x0D, 0x01]),
            (4, &[0xA, 0x5, 0xF], &[0x5A, 0x0F]),
            (8, &[0x12, 0xFF], &[0x12, 0xFF]),
            (12, &[0xABC, 0x123], &[0xBC, 0x3A, 0x12]),
            (16, &[0xBEEF], &[0xEF, 0xBE]),
            (6, &[], &[]),
        ];
        for &(b, codes, bytes) in cases {
            assert_eq!(pack(codes, b).unwrap(), bytes, "pack b={b} {codes:?}");
            assert_eq!(
                unpack(bytes, b, codes.len()).unwrap(),
                codes,
                "unpack b={b}"
            );
        }
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(
            pack(&[64], 6),
            Err(PqError::CodeOutOfRange {
                index: 0,
                code: 64,
                max: 63
            })
        );
        assert!(matches!(pack(&[0], 0), Err(PqError::BitsOutOfRange { .. })));
        assert!(matches!(
            pack(&[0], 17),
            Err(PqError::BitsOutOfRange { .. })
        ));
        assert_eq!(
            unpack(&[0x2A, 0], 6, 1),
            Err(PqError::LengthMismatch {
                got: 2,
                expected: 1
            })
        );
        assert_eq!(unpack(&[0x6A], 6, 1), Err(PqError::NonZeroPadding));
        assert_eq!(packed_len(usize::MAX, 2), Err(PqError::TooLarge));
    }
}
