//! Stage 3: top-k selection (`spec/PQ.md` §5.3): the first `n_init` and last `n_local` tokens
//! plus the `k` best of the others by score descending, ties to the lower index, NaN lowest.
//!
//! Scores become `u32` ranking keys (`crate::order`); the `k`-th largest key is found in linear
//! time by counting passes (`kth.rs`); one scan in index order then emits every token above it
//! and the first tokens equal to it ([`emit`]). [`search`] fuses this with the scan, and on
//! x86-64 with AVX-512 runs a two-pass kernel on 16-bit fixed-point keys instead
//! (`crate::arch`, exact by the error bound of `spec/PQ.md` §5.3).
use alloc::vec;
use alloc::vec::Vec;

#[cfg(all(feature = "simd", target_arch = "x86_64"))]
use crate::arch;
use crate::error::PqError;
use crate::order::order_key;

use super::kth::kth_key;
use super::scan::{check_codes, scan_portable};
use super::table::ScoreTable;

/// Token indices to attend to, sorted ascending and without duplicates: every index in
/// `0..min(n_init, T)` and in `T - min(n_local, T)..T`, plus the `k` best of the remaining tokens
/// (all of them if fewer than `k` remain) by the order of score descending, ties to the lower
/// index, NaN ranked lowest, `-0.0` below `+0.0`. `T = scores.len()` must fit in `u32`.
///
/// It runs in time linear in `T`: counting passes find the `k`-th best score, then one scan in
/// index order takes every token above it and the first tokens equal to it.
pub fn select(
    scores: &[f32],
    k: usize,
    n_init: usize,
    n_local: usize,
) -> Result<Vec<u32>, PqError> {
    let t = scores.len();
    u32::try_from(t).map_err(|_| PqError::TooLarge)?;
    let init_end = n_init.min(t);
    let local_start = (t - n_local.min(t)).max(init_end);
    let rest = &scores[init_end..local_start];
    let k = k.min(rest.len());
    let mut out: Vec<u32> = Vec::with_capacity(init_end + rest.len() + (t - local_start));
    out.extend(0..init_end as u32);
    if k == rest.len() {
        out.extend(init_end as u32..local_start as u32);
    } else if k > 0 {
        take_best(rest, init_end as u32, k, &mut out);
    }
    out.extend(local_start as u32..t as u32);
    Ok(out)
}

/// `select(&scores(codes, table)?, k, n_init, n_local)`, the whole decode-step search for one
/// query (or GQA group) table, computed without materializing the scores where it can: on
/// x86-64 with AVX-512 and `m = 2`, `2^b <= 64`, one pass turns codes into ranking keys.
pub fn search(
    codes: &[u16],
    table: &ScoreTable,
    k: usize,
    n_init: usize,
    n_local: usize,
) -> Result<Vec<u32>, PqError> {
    let m = table.m;
    check_codes(codes, table)?;
    let t = codes.len() / m;
    u32::try_from(t).map_err(|_| PqError::TooLarge)?;
    let init_end = n_init.min(t);
    let local_start = (t - n_local.min(t)).max(init_end);
    let n_rest = local_start - init_end;
    let k = k.min(n_rest);
    let mut out: Vec<u32> = Vec::with_capacity(init_end + k + 16 + (t - local_start));
    out.extend(0..init_end as u32);
    if k == n_rest {
        out.extend(init_end as u32..local_start as u32);
    } else if k > 0 {
        let rest = &codes[init_end * m..local_start * m];
        if !take_best_codes(rest, table, init_end as u32, k, &mut out) {
            let (keys, range) = score_keys(rest, table);
            take_best_keys(&keys, range, init_end as u32, k, &mut out);
        }
    }
    out.extend(local_start as u32..t as u32);
    Ok(out)
}

/// `floor(T * num / den)` without overflow: the `k` for "a fraction `num/den` of the tokens"
/// (PQCache uses 1/5 and 1/10). Errors if `den == 0`.
pub fn k_for_fraction(t: usize, num: u32, den: u32) -> Result<usize, PqError> {
    if den == 0 {
        return Err(PqError::ZeroDenominator);
    }
    let k = (t as u128 * u128::from(num)) / u128::from(den);
    usize::try_from(k).map_err(|_| PqError::TooLarge)
}

/// Appends to `out`, ascending, `base + i` for the `k` best `rest[i]` (`0 < k < rest.len()`).
fn take_best(rest: &[f32], base: u32, k: usize, out: &mut Vec<u32>) {
    // Compiled for AVX-512, the key mapping and the min/max scan vectorize (SSE2 has no
    // unsigned 32-bit min/max).
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if arch::with_avx512f(
        #[inline(always)]
        || take_best_portable(rest, base, k, out),
    )
    .is_some()
    {
        return;
    }
    take_best_portable(rest, base, k, out)
}

#[inline(always)]
fn take_best_portable(rest: &[f32], base: u32, k: usize, out: &mut Vec<u32>) {
    let keys: Vec<u32> = rest.iter().map(|&s| order_key(s)).collect();
    take_best_keys_portable(&keys, None, base, k, out)
}

/// [`take_best`] from the ranking keys of the scores (`0 < k < keys.len()`), with their
/// `(min, max)` if known.
fn take_best_keys(
    keys: &[u32],
    range: Option<(u32, u32)>,
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) {
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if arch::with_avx512f(
        #[inline(always)]
        || take_best_keys_portable(keys, range, base, k, out),
    )
    .is_some()
    {
        return;
    }
    take_best_keys_portable(keys, range, base, k, out)
}

#[inline(always)]
fn take_best_keys_portable(
    keys: &[u32],
    range: Option<(u32, u32)>,
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) {
    let (tau, ties) = kth_key(keys, k, range);
    emit(keys, tau, ties, base, k, out);
}

/// Appends the `k` best tokens of checked `codes` like [`take_best_keys`] and returns `true`,
/// where a kernel that does it in two passes over the tokens on 16-bit fixed-point keys is
/// available (x86-64 with AVX-512 F, BW and VBMI2, BMI2, `m = 2`, `2^b <= 64`, at least 512
/// tokens), the table allows fixed-point keys, and its sampled bracket holds the `k`-th key;
/// else returns `false` with `out` untouched. Either way the result is the exact one.
#[inline]
fn take_best_codes(
    codes: &[u16],
    table: &ScoreTable,
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) -> bool {
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(rows) = table.m2_rows() {
        return arch::take_best_m2(codes, rows, base, k, out);
    }
    let _ = (codes, table, base, k, out);
    false
}

/// Ranking keys and, when known, their `(min, max)`.
type KeysAndRange = (Vec<u32>, Option<(u32, u32)>);

/// The ranking keys of the scores of `codes` (checked), one per token, and their `(min, max)`
/// when the kernel has it at hand.
fn score_keys(codes: &[u16], table: &ScoreTable) -> KeysAndRange {
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(rows) = table.m2_rows() {
        if let Some((keys, range)) = arch::keys_m2(codes, rows) {
            return (keys, Some(range));
        }
    }
    let mut s = vec![0.0f32; codes.len() / table.m];
    scan_portable(codes, table, &mut s);
    (s.iter().map(|&x| order_key(x)).collect(), None)
}

/// Appends `base + i`, ascending, for every key `> tau` and the first `ties` keys `== tau`
/// (`k` of them in all).
#[inline]
fn emit(keys: &[u32], tau: u32, ties: usize, base: u32, k: usize, out: &mut Vec<u32>) {
    let _ = k; // a capacity hint for the vectorized kernel
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if arch::emit(keys, tau, ties, base, k, out) {
        return;
    }
    emit_portable(keys, tau, ties, base, out)
}

/// [`emit`] in portable code.
fn emit_portable(keys: &[u32], tau: u32, mut ties: usize, base: u32, out: &mut Vec<u32>) {
    // Branch-free scan: every index is written, the count advances only when it is taken.
    let at = out.len();
    out.resize(at + keys.len(), 0);
    let dst = &mut out[at..];
    let mut n = 0usize;
    for (i, &key) in keys.iter().enumerate() {
        let tie = key == tau && ties > 0;
        ties -= usize::from(tie);
        dst[n] = base + i as u32;
        n += usize::from(key > tau || tie);
    }
    out.truncate(at + n);
}

#[cfg(test)]
mod tests {
    use super::super::kth::{collect_range, count_ge2};
    use super::super::scan::scores;
    use super::super::test_util::Xs;
    use super::*;

    /// The dispatched kernels (AVX-512 where this CPU has it) and the portable ones give the
    /// same results; `select`'s brute-force property tests cover whichever path the CPU takes.
    #[test]
    fn dispatched_and_portable_kernels_agree() {
        let mut x = Xs(0x9E37_79B9_7F4A_7C15);
        // A subset of the lengths under Miri, which interprets every step.
        let lens: &[usize] = if cfg!(miri) {
            &[0, 1, 15, 17, 100, 300]
        } else {
            &[0, 1, 15, 16, 17, 31, 33, 100, 511, 512, 513, 2048, 3001]
        };
        for &n in lens {
            let rest: Vec<f32> = (0..n).map(|_| x.score()).collect();
            let keys: Vec<u32> = rest.iter().map(|&s| order_key(s)).collect();
            for t in [0u32, 1, 0x8000_0000, u32::MAX] {
                let u = t.wrapping_add(0x1234_5678);
                let brute = |t: u32| keys.iter().filter(|&&v| v >= t).count();
                assert_eq!(count_ge2(&keys, t, u), (brute(t), brute(u)));
            }
            if let Some(&t) = keys.get(n / 2) {
                let brute = |t: u32| keys.iter().filter(|&&v| v >= t).count();
                assert_eq!(count_ge2(&keys, t, t), (brute(t), brute(t)));
                let w = 1 << 28;
                let want: Vec<u32> = keys
                    .iter()
                    .copied()
                    .filter(|&v| v.wrapping_sub(t) <= w)
                    .collect();
                assert_eq!(collect_range(&keys, t, w, want.len()), want);
            }
            for k in [1usize, 2, n / 5, n / 2, n.saturating_sub(1)] {
                if k == 0 || k >= n {
                    continue;
                }
                let (tau, ties) = kth_key(&keys, k, None);
                let mut a = vec![7u32];
                let mut b = vec![7u32];
                emit(&keys, tau, ties, 100, k, &mut a);
                emit_portable(&keys, tau, ties, 100, &mut b);
                assert_eq!(a, b);
                assert_eq!(a.len(), k + 1);
                let mut c = vec![7u32];
                take_best(&rest, 100, k, &mut c);
                let mut d = vec![7u32];
                take_best_portable(&rest, 100, k, &mut d);
                assert_eq!(c, a);
                assert_eq!(d, a);
            }
        }
    }

    /// The two-pass top-k kernel (where the CPU has it) equals the portable top-k over the
    /// portable scan, on tables of every kind its fixed-point filter must get right: NaN,
    /// infinities and signed zeros (it must decline or agree), many exact ties, continuous
    /// values, a large common offset with differences near the `f32` spacing (where rounding
    /// merges sums and the key gap grows), subnormal and huge magnitudes. It runs (does not
    /// decline or miss its bracket) on most inputs of continuous values.
    #[test]
    #[cfg_attr(miri, ignore = "checks an AVX-512 kernel; Miri runs without `simd`")]
    fn two_pass_kernel_equals_portable_top_k() {
        let mut x = Xs(0x5EED);
        let (mut ran, mut tried) = (0usize, 0usize);
        for kind in 0..7 {
            for b in [1u8, 5, 6] {
                let kk = 1usize << b;
                for t in [512usize, 513, 700, 1000, 2048, 3001] {
                    let value = |x: &mut Xs| {
                        let u = (x.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                        match kind {
                            0 => x.score(),
                            1 => (x.next() % 8) as f32 - 4.0,
                            2 => u * 60.0,
                            3 => 3000.0 + (x.next() % 9) as f32 * 2.4e-4,
                            4 => -70.0 + u * 1e-4,
                            5 => u * 1e-40,
                            _ => u * 1e37,
                        }
                    };
                    let table = ScoreTable {
                        m: 2,
                        b,
                        values: (0..2 * kk).map(|_| value(&mut x)).collect(),
                    };
                    let codes: Vec<u16> =
                        (0..2 * t).map(|_| (x.next() % kk as u64) as u16).collect();
                    let mut s = vec![0.0f32; t];
                    scan_portable(&codes, &table, &mut s);
                    for k in [1usize, 2, 37, t / 10, t / 5, t / 2, t - 1] {
                        let mut want = vec![9u32];
                        take_best_portable(&s, 5, k, &mut want);
                        let mut got = vec![9u32];
                        // Continuous values: few keys near the k-th, so it should run.
                        let continuous = matches!(kind, 2 | 4 | 6);
                        tried += usize::from(continuous);
                        if take_best_codes(&codes, &table, 5, k, &mut got) {
                            ran += usize::from(continuous);
                            assert_eq!(got, want, "kind {kind} b {b} t {t} k {k}");
                        } else {
                            assert_eq!(got, [9]);
                        }
                    }
                }
            }
        }
        #[cfg(all(feature = "simd", target_arch = "x86_64"))]
        if ["avx512f", "avx512bw", "avx512vbmi2", "bmi2"]
            .iter()
            .all(|f| match *f {
                "avx512f" => std::is_x86_feature_detected!("avx512f"),
                "avx512bw" => std::is_x86_feature_detected!("avx512bw"),
                "avx512vbmi2" => std::is_x86_feature_detected!("avx512vbmi2"),
                _ => std::is_x86_feature_detected!("bmi2"),
            })
        {
            assert!(ran * 2 > tried, "the kernel ran on {ran} of {tried} inputs");
        }
        let _ = (ran, tried);
    }

    /// A code `>= 2^b` anywhere (first window, the tokens between, last window) gives the same
    /// error from `search` as from `scores` (the first bad code), on the inputs the two-pass
    /// kernel takes.
    #[test]
    fn search_reports_the_first_bad_code() {
        let mut x = Xs(7);
        // Fewer tokens under Miri, which interprets every step (positions past them skipped).
        let (b, t) = (6u8, if cfg!(miri) { 600 } else { 2048usize });
        let table = ScoreTable {
            m: 2,
            b,
            values: (0..128)
                .map(|_| ((x.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0)
                .collect(),
        };
        let good: Vec<u16> = (0..2 * t).map(|_| (x.next() % 64) as u16).collect();
        assert_eq!(
            search(&good, &table, 410, 4, 64).unwrap().len(),
            4 + 410 + 64
        );
        for at in [0usize, 7, 8, 1000, 3001, 2 * t - 128, 2 * t - 1] {
            if at >= 2 * t {
                continue;
            }
            for (bad, second) in [(64u16, None), (u16::MAX, Some(40usize))] {
                let mut codes = good.clone();
                codes[at] = bad;
                if let Some(d) = second {
                    codes[(at + 2 * d) % (2 * t)] = 100;
                }
                let want = scores(&codes, &table).unwrap_err();
                assert_eq!(
                    search(&codes, &table, 410, 4, 64).unwrap_err(),
                    want,
                    "at {at}"
                );
            }
        }
    }
}
