//! The decode-step search: score every token from its codes and pick the tokens to attend to.
//!
//! 1. [`score_table`]: for a query `q` (length `D`), `table[j][c] = q_j · centroid(j, c)`, where
//!    `q_j` is the query's slice of the dims book `j` covers ([`Codebook::book_range`]: a sub-space
//!    for product quantization, all dims for residual quantization).
//! 2. [`scores`]: token `t` scores `table[0][code(t,0)] + table[1][code(t,1)] + ...`, summed in
//!    `f32` in sub-space order starting from `0.0`. This approximates `q · k_t`.
//! 3. [`select`]: the first `n_init` and last `n_local` tokens, plus the `k` best of the others.
//!
//! **GQA.** The query heads that share a KV head score against that head's codes. Their scores are
//! combined by *summing* ([`group_score_table`]): a token's group score is the sum over the group's
//! query heads of its per-head scores. Because the score is linear in the table, this is computed as
//! one table whose entries are the per-head entries summed in head order, then one scan over the
//! codes; the result equals the sum of per-head [`scores`] up to `f32` rounding order. (A max over
//! heads would need one scan per head; the sum costs one scan and ranks tokens that several heads
//! like above a token only one head likes, which is the behaviour wanted for a shared selection.)
use alloc::vec;
use alloc::vec::Vec;
use core::cmp::Ordering;

use crate::codebook::{rows, Codebook};
use crate::error::PqError;
use crate::simd::{columns, dot, dot_x8, Op};

/// Query·centroid inner products of one query (or one GQA group), `[m, 2^b]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreTable {
    m: usize,
    b: u8,
    values: Vec<f32>,
}

impl ScoreTable {
    /// Number of sub-spaces.
    pub fn m(&self) -> usize {
        self.m
    }
    /// Bits per code.
    pub fn bits(&self) -> u8 {
        self.b
    }
    /// `[m, 2^b]` row-major: entry `(j, c)` is at `j * 2^b + c`.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
}

/// The table of `query · centroid` per sub-space for one query of length `codebook.dim()`.
pub fn score_table(query: &[f32], codebook: &Codebook) -> Result<ScoreTable, PqError> {
    group_score_table(query, codebook)
}

/// The table of a GQA group: `queries` is a flat `[G, D]` buffer (`G >= 1`) of the query heads
/// that share `codebook`'s KV head; entry `(j, c)` is `sum_g q_g,j · centroid(j, c)`, summed in
/// head order. With `G = 1` this is [`score_table`].
pub fn group_score_table(queries: &[f32], codebook: &Codebook) -> Result<ScoreTable, PqError> {
    let d = codebook.dim();
    let g = rows(queries, d)?;
    if g == 0 {
        return Err(PqError::Empty);
    }
    if let Some(index) = queries.iter().position(|v| !v.is_finite()) {
        return Err(PqError::NonFinite { index });
    }
    let (m, bd, k) = (codebook.m(), codebook.book_dim(), codebook.n_centroids());
    let cols = codebook.cols();
    let mut values = vec![0.0f32; m * k];
    let mut one = vec![0.0f32; k];
    for (h, q) in queries.chunks_exact(d).enumerate() {
        for j in 0..m {
            let qj = &q[codebook.book_range(j)];
            let row = &mut values[j * k..(j + 1) * k];
            let cj = &cols[j * k * bd..(j + 1) * k * bd];
            if h == 0 {
                columns(Op::Dot, qj, cj, row);
            } else {
                columns(Op::Dot, qj, cj, &mut one);
                for (v, &x) in row.iter_mut().zip(&one) {
                    *v += x;
                }
            }
        }
    }
    Ok(ScoreTable {
        m,
        b: codebook.bits(),
        values,
    })
}

/// Approximate scores of `T` tokens from their codes (flat `[T, m]`, token-major): token `t`
/// scores `((0.0 + table[0][code(t,0)]) + table[1][code(t,1)]) + ...` in `f32`.
/// Errors if the length is not a multiple of `m` or a code is `>= 2^b`.
pub fn scores(codes: &[u16], table: &ScoreTable) -> Result<Vec<f32>, PqError> {
    let mut out = vec![0.0f32; codes.len() / table.m.max(1)];
    scores_into(codes, table, &mut out)?;
    Ok(out)
}

/// Checks that `codes` is `[T, m]` with every code below `2^b`.
fn check_codes(codes: &[u16], table: &ScoreTable) -> Result<(), PqError> {
    if !codes.len().is_multiple_of(table.m) {
        return Err(PqError::LengthNotMultiple {
            len: codes.len(),
            dim: table.m,
        });
    }
    let max = ((1usize << table.b) - 1) as u16;
    // Every code is below 2^b exactly when their bitwise OR is (one cheap vectorized pass).
    if codes.iter().fold(0u16, |a, &c| a | c) > max {
        let index = codes.iter().position(|&c| c > max).unwrap_or(0);
        return Err(PqError::CodeOutOfRange {
            index,
            code: codes[index],
            max,
        });
    }
    Ok(())
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
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::scan(codes, table, out) {
        return Ok(());
    }
    scan_portable(codes, table, out);
    Ok(())
}

/// The scan of [`scores_into`] over checked codes.
#[inline(always)]
fn scan_portable(codes: &[u16], table: &ScoreTable, out: &mut [f32]) {
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

/// The ranking key of a score: a larger key ranks higher. It orders scores as IEEE `totalOrder`
/// does (`-0.0` below `+0.0`), with NaN mapped to the key of `-inf`.
#[inline(always)]
fn order_key(s: f32) -> u32 {
    let b = if s.is_nan() {
        f32::NEG_INFINITY.to_bits()
    } else {
        s.to_bits()
    };
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The ranking order of [`select`] (used by [`rerank`]): higher score first, NaN ranked as
/// `-inf`, `-0.0` below `+0.0`, then lower index first. A total order, so the selection is unique.
fn rank(scores: &[f32], a: u32, b: u32) -> Ordering {
    let key = |i: u32| order_key(scores[i as usize]);
    key(b).cmp(&key(a)).then(a.cmp(&b))
}

/// For `1 <= k <= keys.len()`: the `k`-th largest key `tau`, and how many keys equal to `tau` the
/// `k` best hold (the others rank above `tau`).
///
/// Bisection over the key values between the smallest and largest key, each step one counting
/// pass (vectorized); once 32 or fewer keys lie in the interval they are collected and sorted.
#[inline(always)]
fn kth_key(keys: &[u32], k: usize, range: Option<(u32, u32)>) -> (u32, usize) {
    let (lo, hi) = range.unwrap_or_else(|| {
        let (mut lo, mut hi) = (u32::MAX, 0u32);
        for &x in keys {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        (lo, hi)
    });
    // Invariants: at least k keys are >= a (ca of them), fewer than k are >= b (cb of them).
    let (mut a, mut b) = (u64::from(lo), u64::from(hi) + 1);
    let (mut ca, mut cb) = (keys.len(), 0usize);
    // A first bracket from a sorted sample of 64 keys around the expected rank; kept only where
    // the counts confirm it (a sample is a guess, the counts are exact).
    let n = keys.len();
    if n >= 512 {
        let stride = n / 64;
        let mut sample: [u32; 64] = core::array::from_fn(|i| keys[i * stride]);
        sample.sort_unstable();
        // Ascending order: the r-th largest sample is sample[63 - r].
        let r = k * 64 / n;
        let guess_a = u64::from(sample[63 - (r + 6).min(63)]);
        let guess_b = u64::from(sample[63 - r.saturating_sub(6)]) + 1;
        if guess_a > a && guess_a < b {
            let c = count_ge(keys, guess_a as u32);
            if c >= k {
                (a, ca) = (guess_a, c);
            }
        }
        if guess_b > a && guess_b < b {
            let c = count_ge(keys, guess_b as u32);
            if c < k {
                (b, cb) = (guess_b, c);
            }
        }
    }
    // Once the interval holds a small share of the keys, they are collected once and the
    // bisection counts only them: for a < t < b, #keys >= t is cb0 + #work >= t.
    let mut work: Vec<u32> = Vec::new();
    let mut in_work = false;
    let mut cb0 = 0usize;
    while b - a > 1 {
        let here: &[u32] = if in_work { &work } else { keys };
        if ca - cb <= 32 {
            let mut c = collect_range(here, a as u32, (b - a - 1) as u32, ca - cb);
            c.sort_unstable();
            let need = k - cb;
            let top = &c[c.len() - need..];
            let tau = top[0];
            let ties = top.iter().filter(|&&x| x == tau).count();
            return (tau, ties);
        }
        if !in_work && (ca - cb) * 4 <= n {
            work = collect_range(keys, a as u32, (b - a - 1) as u32, ca - cb);
            in_work = true;
            cb0 = cb;
            continue;
        }
        let mid = split(a, b);
        let cm = if in_work {
            cb0 + count_ge(&work, mid as u32)
        } else {
            count_ge(keys, mid as u32)
        };
        if cm >= k {
            a = mid;
            ca = cm;
        } else {
            b = mid;
            cb = cm;
        }
    }
    (a as u32, k - cb)
}

/// The keys `x` with `a <= x <= a + w` (one unsigned compare: `x - a <= w`), in order; there
/// are exactly `count` of them.
#[inline]
fn collect_range(keys: &[u32], a: u32, w: u32, count: usize) -> Vec<u32> {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(v) = x86::collect_range(keys, a, w, count) {
        return v;
    }
    keys.iter()
        .copied()
        .filter(|&x| x.wrapping_sub(a) <= w)
        .collect()
}

/// The score of a key (the inverse of `order_key` on non-NaN scores).
#[inline]
fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 {
        key & 0x7FFF_FFFF
    } else {
        !key
    })
}

/// A key strictly between `a` and `b` (`b - a >= 2`): the key of the midpoint of their scores when
/// that is strictly inside (so that bisection halves the score range, not the key range, which
/// near 0 is mostly tiny magnitudes), else the midpoint of the keys.
#[inline]
fn split(a: u64, b: u64) -> u64 {
    let key_mid = a + (b - a) / 2;
    let (va, vb) = (key_value(a as u32), key_value((b - 1) as u32));
    if va.is_finite() && vb.is_finite() {
        let m = ((f64::from(va) + f64::from(vb)) * 0.5) as f32;
        let km = u64::from(order_key(m));
        if km > a && km < b {
            return km;
        }
    }
    key_mid
}

/// How many keys are `>= t`.
#[inline]
fn count_ge(keys: &[u32], t: u32) -> usize {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(n) = x86::count_ge(keys, t) {
        return n;
    }
    keys.iter().filter(|&&x| x >= t).count()
}

/// Appends `base + i`, ascending, for every key `> tau` and the first `ties` keys `== tau`
/// (`k` of them in all).
#[inline]
fn emit(keys: &[u32], tau: u32, ties: usize, base: u32, k: usize, out: &mut Vec<u32>) {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::emit(keys, tau, ties, base, k, out) {
        return;
    }
    emit_portable(keys, tau, ties, base, out)
}

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

/// Token indices to attend to, sorted ascending and without duplicates: every index in
/// `0..min(n_init, T)` and in `T - min(n_local, T)..T`, plus the `k` best of the remaining tokens
/// (all of them if fewer than `k` remain) by the order of score descending, ties to the lower
/// index, NaN ranked lowest, `-0.0` below `+0.0`. `T = scores.len()` must fit in `u32`.
///
/// It runs in time linear in `T`: a radix select finds the `k`-th best score, then one scan in
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

/// Appends to `out`, ascending, `base + i` for the `k` best `rest[i]` (`0 < k < rest.len()`).
fn take_best(rest: &[f32], base: u32, k: usize, out: &mut Vec<u32>) {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::take_best(rest, base, k, out) {
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
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::take_best_keys(keys, range, base, k, out) {
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

/// Ranking keys and, when known, their `(min, max)`.
type KeysAndRange = (Vec<u32>, Option<(u32, u32)>);

/// The ranking keys of the scores of `codes` (checked), one per token, and their `(min, max)`
/// when the kernel has it at hand.
fn score_keys(codes: &[u16], table: &ScoreTable) -> KeysAndRange {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(r) = x86::score_keys(codes, table) {
        return r;
    }
    let mut s = vec![0.0f32; codes.len() / table.m];
    scan_portable(codes, table, &mut s);
    (s.iter().map(|&x| order_key(x)).collect(), None)
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
        let (keys, range) = score_keys(&codes[init_end * m..local_start * m], table);
        take_best_keys(&keys, range, init_end as u32, k, &mut out);
    }
    out.extend(local_start as u32..t as u32);
    Ok(out)
}

/// AVX-512 kernels for x86-64 CPUs that have it, used when the CPU reports `avx512f`. Each is
/// checked against its portable counterpart by tests (identical results: the same `f32` additions
/// in the same order; integer compares and compaction are exact).
#[cfg(all(feature = "std", target_arch = "x86_64"))]
#[allow(unsafe_code)]
mod x86 {
    use super::ScoreTable;
    use alloc::vec;
    use alloc::vec::Vec;
    use core::arch::x86_64::*;

    fn has_avx512() -> bool {
        std::is_x86_feature_detected!("avx512f")
    }

    /// [`super::take_best_portable`] compiled for AVX-512 (the key mapping and the min/max scan
    /// vectorize; SSE2 has no unsigned 32-bit min/max); returns whether it ran.
    #[inline]
    pub(super) fn take_best(rest: &[f32], base: u32, k: usize, out: &mut Vec<u32>) -> bool {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            unsafe { take_best_avx512(rest, base, k, out) };
            true
        } else {
            false
        }
    }

    #[target_feature(enable = "avx512f")]
    fn take_best_avx512(rest: &[f32], base: u32, k: usize, out: &mut Vec<u32>) {
        super::take_best_portable(rest, base, k, out)
    }

    /// [`super::take_best_keys_portable`] compiled for AVX-512; returns whether it ran.
    #[inline]
    pub(super) fn take_best_keys(
        keys: &[u32],
        range: Option<(u32, u32)>,
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> bool {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            unsafe { take_best_keys_avx512(keys, range, base, k, out) };
            true
        } else {
            false
        }
    }

    #[target_feature(enable = "avx512f")]
    fn take_best_keys_avx512(
        keys: &[u32],
        range: Option<(u32, u32)>,
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) {
        super::take_best_keys_portable(keys, range, base, k, out)
    }

    /// `Some` ranking keys of the scores of checked `codes` for `m = 2`, `2^b <= 64`, where
    /// AVX-512 is available: [`scan_m2_avx512`]'s sums mapped in-register as `order_key` does.
    #[inline]
    pub(super) fn score_keys(codes: &[u16], table: &ScoreTable) -> Option<super::KeysAndRange> {
        let k = 1usize << table.b;
        if table.m == 2 && k <= 64 && has_avx512() {
            let mut rows = [[0.0f32; 64]; 2];
            rows[0][..k].copy_from_slice(&table.values[..k]);
            rows[1][..k].copy_from_slice(&table.values[k..2 * k]);
            let mut keys = vec![0u32; codes.len() / 2];
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            let range = unsafe { keys_m2_avx512(codes, &rows, &mut keys) };
            Some((keys, Some(range)))
        } else {
            None
        }
    }

    /// The two 64-entry rows of an `m = 2` table, four registers each.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load_rows(rows: &[[f32; 64]; 2]) -> [[__m512; 4]; 2] {
        core::array::from_fn(|r| {
            core::array::from_fn(|q| {
                // SAFETY: `rows[r][16q..16q + 16]` is 16 f32 = 64 bytes in bounds (q < 4).
                unsafe { _mm512_loadu_ps(rows[r][16 * q..16 * q + 16].as_ptr()) }
            })
        })
    }

    /// The scores of 16 tokens whose code pairs are the 16 u32 lanes of `v` (`code0 | code1 <<
    /// 16`, codes < 64): each row looked up with two two-register permutes and a blend on bit 5,
    /// summed as `(0.0 + t0) + t1` per lane, the portable scan's `f32` additions.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sums16(t: &[[__m512; 4]; 2], v: __m512i) -> __m512 {
        let bit5 = _mm512_set1_epi32(32);
        let look = |t: &[__m512; 4], i: __m512i| {
            let lo = _mm512_permutex2var_ps(t[0], i, t[1]);
            let hi = _mm512_permutex2var_ps(t[2], i, t[3]);
            _mm512_mask_blend_ps(_mm512_test_epi32_mask(i, bit5), lo, hi)
        };
        let i0 = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
        let i1 = _mm512_srli_epi32::<16>(v);
        _mm512_add_ps(
            _mm512_add_ps(_mm512_setzero_ps(), look(&t[0], i0)),
            look(&t[1], i1),
        )
    }

    #[target_feature(enable = "avx512f")]
    fn keys_m2_avx512(codes: &[u16], rows: &[[f32; 64]; 2], keys: &mut [u32]) -> (u32, u32) {
        let t = load_rows(rows);
        let top = _mm512_set1_epi32(i32::MIN);
        let neg_inf = _mm512_set1_epi32(f32::NEG_INFINITY.to_bits() as i32);
        let (mut vmin, mut vmax) = (_mm512_set1_epi32(-1), _mm512_setzero_si512());
        let mut cs = codes.chunks_exact(32);
        let mut ks = keys.chunks_exact_mut(16);
        for (c, o) in (&mut cs).zip(&mut ks) {
            // SAFETY: `c` is 32 u16 = 64 bytes (x86-64 is little-endian: lane j holds
            // code(j,0) | code(j,1) << 16).
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
            let s = sums16(&t, v);
            // order_key: NaN as -inf; then flip all bits of negatives, set the top bit of the rest.
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(s, s);
            let bits = _mm512_mask_blend_epi32(nan, _mm512_castps_si512(s), neg_inf);
            let flip = _mm512_or_si512(_mm512_srai_epi32::<31>(bits), top);
            let key = _mm512_xor_si512(bits, flip);
            vmin = _mm512_min_epu32(vmin, key);
            vmax = _mm512_max_epu32(vmax, key);
            // SAFETY: `o` is 16 u32 = 64 bytes.
            unsafe { _mm512_storeu_si512(o.as_mut_ptr().cast(), key) };
        }
        let (mut lo, mut hi) = (_mm512_reduce_min_epu32(vmin), _mm512_reduce_max_epu32(vmax));
        for (p, o) in cs.remainder().chunks_exact(2).zip(ks.into_remainder()) {
            let s = (0.0 + rows[0][usize::from(p[0])]) + rows[1][usize::from(p[1])];
            *o = super::order_key(s);
            lo = lo.min(*o);
            hi = hi.max(*o);
        }
        (lo, hi)
    }

    /// `Some(#keys >= t)` where AVX-512 is available.
    #[inline]
    pub(super) fn count_ge(keys: &[u32], t: u32) -> Option<usize> {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            Some(unsafe { count_ge_avx512(keys, t) })
        } else {
            None
        }
    }

    #[target_feature(enable = "avx512f")]
    fn count_ge_avx512(keys: &[u32], t: u32) -> usize {
        let tv = _mm512_set1_epi32(t as i32);
        let one = _mm512_set1_epi32(1);
        // Per-lane counts (each <= keys.len() / 16 + 1 < 2^31 for any slice), summed at the end.
        let (mut acc0, mut acc1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        let mut pairs = keys.chunks_exact(32);
        for c in &mut pairs {
            // SAFETY: `c` holds exactly 32 u32 = 128 bytes; unaligned loads are allowed.
            let (v0, v1) = unsafe {
                (
                    _mm512_loadu_si512(c.as_ptr().cast()),
                    _mm512_loadu_si512(c[16..].as_ptr().cast()),
                )
            };
            acc0 = _mm512_mask_add_epi32(acc0, _mm512_cmpge_epu32_mask(v0, tv), acc0, one);
            acc1 = _mm512_mask_add_epi32(acc1, _mm512_cmpge_epu32_mask(v1, tv), acc1, one);
        }
        let lanes = _mm512_add_epi32(acc0, acc1);
        let mut arr = [0u32; 16];
        // SAFETY: `arr` is 16 u32 = 64 bytes; unaligned stores are allowed.
        unsafe { _mm512_storeu_si512(arr.as_mut_ptr().cast(), lanes) };
        let n: usize = arr.iter().map(|&x| x as usize).sum();
        n + pairs.remainder().iter().filter(|&&x| x >= t).count()
    }

    /// [`super::scan_portable`] for `m = 2` and at most 64 centroids, where AVX-512 is
    /// available; returns whether it ran. Codes must be checked (`< 2^b`).
    #[inline]
    pub(super) fn scan(codes: &[u16], table: &ScoreTable, out: &mut [f32]) -> bool {
        let k = 1usize << table.b;
        if table.m == 2 && k <= 64 && has_avx512() {
            let mut rows = [[0.0f32; 64]; 2];
            rows[0][..k].copy_from_slice(&table.values[..k]);
            rows[1][..k].copy_from_slice(&table.values[k..2 * k]);
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            unsafe { scan_m2_avx512(codes, &rows, out) };
            true
        } else {
            false
        }
    }

    /// 16 tokens at a time: each 64-entry row lives in four registers and is looked up with two
    /// two-register permutes and a blend on bit 5 of the code; the sum is `(0.0 + t0) + t1` per
    /// lane, the same `f32` additions as the portable scan.
    #[target_feature(enable = "avx512f")]
    fn scan_m2_avx512(codes: &[u16], rows: &[[f32; 64]; 2], out: &mut [f32]) {
        let t = load_rows(rows);
        let mut cs = codes.chunks_exact(32);
        let mut os = out.chunks_exact_mut(16);
        for (c, o) in (&mut cs).zip(&mut os) {
            // SAFETY: `c` is 32 u16 = 64 bytes; lane j holds code(j,0) | code(j,1) << 16 on a
            // little-endian target (x86-64 is).
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
            let s = sums16(&t, v);
            // SAFETY: `o` is 16 f32 = 64 bytes.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), s) };
        }
        for (p, o) in cs.remainder().chunks_exact(2).zip(os.into_remainder()) {
            *o = (0.0 + rows[0][usize::from(p[0])]) + rows[1][usize::from(p[1])];
        }
    }

    /// `Some` of [`super::collect_range`] where AVX-512 is available.
    #[inline]
    pub(super) fn collect_range(keys: &[u32], a: u32, w: u32, count: usize) -> Option<Vec<u32>> {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            Some(unsafe { collect_range_avx512(keys, a, w, count) })
        } else {
            None
        }
    }

    #[target_feature(enable = "avx512f")]
    fn collect_range_avx512(keys: &[u32], a: u32, w: u32, count: usize) -> Vec<u32> {
        // `count` matching keys plus 16 spare slots for the last full-width store. The cursor
        // never passes `count` (it counts matches), so every store fits.
        let mut out = vec![0u32; count.min(keys.len()) + 16];
        let (av, wv) = (_mm512_set1_epi32(a as i32), _mm512_set1_epi32(w as i32));
        let mut n = 0usize;
        let mut chunks = keys.chunks_exact(16);
        for c in &mut chunks {
            // SAFETY: `c` holds exactly 16 u32; unaligned loads are allowed.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
            let m = _mm512_cmple_epu32_mask(_mm512_sub_epi32(v, av), wv);
            let packed = _mm512_maskz_compress_epi32(m, v);
            let dst = &mut out[n..n + 16];
            // SAFETY: `dst` is a (bounds-checked) slice of 16 u32, valid for the 64-byte
            // unaligned store.
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), packed) };
            n += m.count_ones() as usize;
        }
        for &x in chunks.remainder() {
            if x.wrapping_sub(a) <= w {
                out[n] = x;
                n += 1;
            }
        }
        out.truncate(n);
        out
    }

    /// Appends like [`super::emit_portable`] and returns `true` where AVX-512 is available.
    #[inline]
    pub(super) fn emit(
        keys: &[u32],
        tau: u32,
        ties: usize,
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> bool {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            unsafe { emit_avx512(keys, tau, ties, base, k, out) };
            true
        } else {
            false
        }
    }

    #[target_feature(enable = "avx512f")]
    fn emit_avx512(
        keys: &[u32],
        tau: u32,
        mut ties: usize,
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) {
        let at = out.len();
        // k = (#keys > tau) + ties values are taken; 16 spare slots for the last full-width store.
        out.resize(at + k + 16, 0);
        let mut n = at;
        let tv = _mm512_set1_epi32(tau as i32);
        let step = _mm512_set1_epi32(16);
        let mut idx = _mm512_add_epi32(
            _mm512_set1_epi32(base as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let mut chunks = keys.chunks_exact(16);
        let mut i = 0usize;
        for c in &mut chunks {
            // SAFETY: `c` holds exactly 16 u32; unaligned loads are allowed.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
            let mut take = _mm512_cmpgt_epu32_mask(v, tv);
            let eq = _mm512_cmpeq_epu32_mask(v, tv);
            if eq != 0 && ties > 0 {
                // Rare: take the first `ties` equal keys, in index order.
                let mut e = eq;
                while e != 0 && ties > 0 {
                    let low = e & e.wrapping_neg();
                    take |= low;
                    e &= !low;
                    ties -= 1;
                }
            }
            // Compress in a register, then store all 16 lanes: the lanes past popcount(take)
            // are overwritten by the next store or cut by the final truncate. (A compressing
            // store to memory is microcoded and about 50x slower on AMD Zen 4.)
            let packed = _mm512_maskz_compress_epi32(take, idx);
            let dst = &mut out[n..n + 16];
            // SAFETY: `dst` is a (bounds-checked) slice of 16 u32, valid for the 64-byte
            // unaligned store. (The cursor stays <= at + k: only taken keys advance it.)
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), packed) };
            n += take.count_ones() as usize;
            idx = _mm512_add_epi32(idx, step);
            i += 16;
        }
        for (j, &key) in chunks.remainder().iter().enumerate() {
            let tie = key == tau && ties > 0;
            ties -= usize::from(tie);
            if key > tau || tie {
                out[n] = base + (i + j) as u32;
                n += 1;
            }
        }
        out.truncate(n);
    }
}

/// Re-ranks a short list with better keys: scores each candidate token `i` of `candidates` by
/// `query · keys[i]` (`keys` a flat `[T, D]` buffer, e.g. the codec's decoded keys; the dot product
/// in the crate's fixed summation order) and returns the `k` best candidates by [`select`]'s order
/// (score descending, ties to the lower index, NaN lowest), sorted ascending. Duplicate candidates
/// count once. All of them are returned when there are at most `k`.
///
/// This is the second stage of a two-stage search: the PQ scores pick `candidates` (say `2k`
/// tokens) cheaply from a few bits per key, and only those tokens' full keys are read.
pub fn rerank(
    candidates: &[u32],
    keys: &[f32],
    query: &[f32],
    k: usize,
) -> Result<Vec<u32>, PqError> {
    let d = query.len();
    if d == 0 {
        return Err(PqError::ZeroDim);
    }
    let t = rows(keys, d)?;
    if let Some(&index) = candidates.iter().find(|&&i| i as usize >= t) {
        return Err(PqError::CandidateOutOfRange { index, tokens: t });
    }
    let mut cand = candidates.to_vec();
    cand.sort_unstable();
    cand.dedup();
    let row = |i: u32| &keys[i as usize * d..(i as usize + 1) * d];
    let mut sc: Vec<f32> = Vec::with_capacity(cand.len());
    let mut groups = cand.chunks_exact(8);
    for g in &mut groups {
        sc.extend_from_slice(&dot_x8(query, core::array::from_fn(|j| row(g[j]))));
    }
    sc.extend(groups.remainder().iter().map(|&i| dot(query, row(i))));
    let mut order: Vec<u32> = (0..cand.len() as u32).collect();
    let k = k.min(order.len());
    if k < order.len() && k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| rank(&sc, a, b));
    }
    order.truncate(k);
    let mut out: Vec<u32> = order.iter().map(|&o| cand[o as usize]).collect();
    out.sort_unstable();
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

#[cfg(test)]
mod tests {
    use super::*;

    struct Xs(u64);
    impl Xs {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Scores with repeats, signed zeros, infinities and NaN now and then.
        fn score(&mut self) -> f32 {
            match self.next() % 40 {
                0 => f32::NAN,
                1 => -0.0,
                2 => 0.0,
                3 => f32::INFINITY,
                4 => f32::NEG_INFINITY,
                5..=9 => (self.next() % 8) as f32 - 4.0,
                _ => ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0,
            }
        }
    }

    /// The dispatched kernels (AVX-512 where this CPU has it) and the portable ones give the
    /// same results; `select`'s brute-force property tests cover whichever path the CPU takes.
    #[test]
    fn dispatched_and_portable_kernels_agree() {
        let mut x = Xs(0x9E37_79B9_7F4A_7C15);
        for n in [
            0usize, 1, 15, 16, 17, 31, 33, 100, 511, 512, 513, 2048, 3001,
        ] {
            let rest: Vec<f32> = (0..n).map(|_| x.score()).collect();
            let keys: Vec<u32> = rest.iter().map(|&s| order_key(s)).collect();
            for t in [0u32, 1, 0x8000_0000, u32::MAX] {
                assert_eq!(count_ge(&keys, t), keys.iter().filter(|&&v| v >= t).count());
            }
            if let Some(&t) = keys.get(n / 2) {
                assert_eq!(count_ge(&keys, t), keys.iter().filter(|&&v| v >= t).count());
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
                for t in [0usize, 1, 15, 16, 17, 100] {
                    let codes: Vec<u16> =
                        (0..t * m).map(|_| (x.next() % k as u64) as u16).collect();
                    let mut a = vec![0.0f32; t];
                    let mut p = vec![0.0f32; t];
                    scores_into(&codes, &table, &mut a).unwrap();
                    scan_portable(&codes, &table, &mut p);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&p), "b {b} m {m} t {t}");
                }
            }
        }
    }
}
