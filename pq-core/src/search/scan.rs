//! Stage 2: the scan, codes to scores (`spec/PQ.md` §5.2): token `t` scores
//! `((0.0 + table[0][code(t,0)]) + table[1][code(t,1)]) + ...` in `f32`.
use alloc::vec;
use alloc::vec::Vec;

#[cfg(all(feature = "simd", target_arch = "x86_64"))]
use crate::arch;
use crate::error::PqError;

use super::table::ScoreTable;

/// Approximate scores of `T` tokens from their codes (flat `[T, m]`, token-major): token `t`
/// scores `((0.0 + table[0][code(t,0)]) + table[1][code(t,1)]) + ...` in `f32`.
/// Errors if the length is not a multiple of `m` or a code is `>= 2^b`.
pub fn scores(codes: &[u16], table: &ScoreTable) -> Result<Vec<f32>, PqError> {
    let mut out = vec![0.0f32; codes.len() / table.m.max(1)];
    scores_into(codes, table, &mut out)?;
    Ok(out)
}

/// Checks that `codes` is `[T, m]` with every code below `2^b`.
pub(super) fn check_codes(codes: &[u16], table: &ScoreTable) -> Result<(), PqError> {
    if !codes.len().is_multiple_of(table.m) {
        return Err(PqError::LengthNotMultiple {
            len: codes.len(),
            dim: table.m,
        });
    }
    let max = ((1usize << table.b) - 1) as u16;
    // Every code is below 2^b exactly when their bitwise OR is (one cheap vectorized pass).
    if or_all(codes) > max {
        let index = codes.iter().position(|&c| c > max).unwrap_or(0);
        return Err(PqError::CodeOutOfRange {
            index,
            code: codes[index],
            max,
        });
    }
    Ok(())
}

/// The bitwise OR of all codes.
#[inline]
fn or_all(codes: &[u16]) -> u16 {
    // AVX-512 reads 64 bytes per step where the portable fold runs at SSE2 width; this check
    // precedes every search.
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(x) = arch::or_all(codes) {
        return x;
    }
    codes.iter().fold(0u16, |a, &c| a | c)
}

/// [`scores`] into a caller's buffer of exactly `codes.len() / m` values (no allocation).
pub fn scores_into(codes: &[u16], table: &ScoreTable, out: &mut [f32]) -> Result<(), PqError> {
    check_codes(codes, table)?;
    if out.len() != codes.len() / table.m {
        return Err(PqError::LengthMismatch {
            got: out.len(),
            expected: codes.len() / table.m,
        });
    }
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(rows) = table.m2_rows() {
        if arch::scan_m2(codes, rows, out) {
            return Ok(());
        }
    }
    scan_portable(codes, table, out);
    Ok(())
}

/// The scan of [`scores_into`] over checked codes.
#[inline(always)]
pub(super) fn scan_portable(codes: &[u16], table: &ScoreTable, out: &mut [f32]) {
    let (m, k) = (table.m, 1usize << table.b);
    let v = &table.values;
    // Codes are checked above. With at most 256 centroids the rows are copied into 256-entry
    // arrays indexed by the code's low byte, so the scan has no bounds checks.
    if k <= 256 && m <= 4 {
        let mut rows = [[0.0f32; 256]; 4];
        for (r, src) in rows.iter_mut().zip(v.chunks_exact(k)) {
            r[..k].copy_from_slice(src);
        }
        let at = |c: u16| usize::from(c as u8);
        match m {
            1 => {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = 0.0 + rows[0][at(c)];
                }
            }
            2 => {
                let (r0, r1) = (&rows[0], &rows[1]);
                for (o, p) in out.iter_mut().zip(codes.chunks_exact(2)) {
                    *o = (0.0 + r0[at(p[0])]) + r1[at(p[1])];
                }
            }
            _ => {
                for (o, tok) in out.iter_mut().zip(codes.chunks_exact(m)) {
                    let mut s = 0.0f32;
                    for (row, &c) in rows.iter().zip(tok) {
                        s += row[at(c)];
                    }
                    *o = s;
                }
            }
        }
        return;
    }
    for (o, tok) in out.iter_mut().zip(codes.chunks_exact(m)) {
        let mut s = 0.0f32;
        for (row, &c) in v.chunks_exact(k).zip(tok) {
            s += row[usize::from(c)];
        }
        *o = s;
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Xs;
    use super::*;

    #[test]
    fn dispatched_scan_equals_portable_scan() {
        let mut x = Xs(42);
        for b in [1u8, 5, 6, 7] {
            let k = 1usize << b;
            for m in [1usize, 2, 3] {
                let table = ScoreTable {
                    m,
                    b,
                    values: (0..m * k).map(|_| x.score()).collect(),
                };
                // Fewer lengths under Miri, which interprets every step.
                let lens: &[usize] = if cfg!(miri) {
                    &[0, 1, 17]
                } else {
                    &[0, 1, 15, 16, 17, 100]
                };
                for &t in lens {
                    let codes: Vec<u16> =
                        (0..t * m).map(|_| (x.next() % k as u64) as u16).collect();
                    let mut a = vec![0.0f32; t];
                    let mut p = vec![0.0f32; t];
                    scores_into(&codes, &table, &mut a).unwrap();
                    scan_portable(&codes, &table, &mut p);
                    // Miri gives every NaN an operation makes an arbitrary sign and payload
                    // (Rust leaves them unspecified; x86-64 makes one fixed NaN), so under Miri
                    // all NaNs compare as one value.
                    let bits = |v: &[f32]| {
                        v.iter()
                            .map(|f| match f.is_nan() && cfg!(miri) {
                                true => u32::MAX,
                                false => f.to_bits(),
                            })
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(bits(&a), bits(&p), "b {b} m {m} t {t}");
                }
            }
        }
    }
}
