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

use crate::codebook::{rows, Codebook};
use crate::error::PqError;
use crate::simd::{columns, dot, dot_x8, Op};

/// Query·centroid inner products of one query (or one GQA group), `[m, 2^b]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreTable {
    pub(crate) m: usize,
    pub(crate) b: u8,
    pub(crate) values: Vec<f32>,
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
    // Scratch for the heads after the first (no allocation for a single query).
    let mut one = if g > 1 { vec![0.0f32; k] } else { Vec::new() };
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
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(x) = x86::or_all(codes) {
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

/// For `1 <= k <= keys.len()`: the `k`-th largest key `tau`, and how many keys equal to `tau` the
/// `k` best hold (the others rank above `tau`).
///
/// Bracketing over the key values between the smallest and largest key: each counting pass
/// (vectorized) tests two keys aimed by interpolation around the rank sought ([`aim`]), and
/// once 32 or fewer keys lie in the interval they are collected and ranked ([`nth_largest`]).
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
    // A first bracket from two order statistics of a 64-key sample around the expected rank; kept where
    // the counts confirm it (a sample is a guess, the counts are exact).
    let n = keys.len();
    if n >= 1024 {
        let stride = n / 64;
        let sample: [u32; 64] = core::array::from_fn(|i| keys[i * stride]);
        let r = k * 64 / n;
        let [ga, gb] = nth_largest(&sample, [(r + 6).min(63), r.saturating_sub(6)]);
        let inside = |g: u64| (g > a && g < b).then_some(g);
        let (guess_a, guess_b) = (inside(u64::from(ga)), inside(u64::from(gb) + 1));
        if let Some(t) = guess_a.or(guess_b) {
            // Both guesses counted in one pass (a missing one stands in for the other).
            let (t1, t2) = (t, guess_b.unwrap_or(t));
            let (c1, c2) = count_ge2(keys, t1 as u32, t2 as u32);
            if guess_a.is_some() && c1 >= k {
                (a, ca) = (t1, c1);
            }
            if guess_b.is_some() && c2 < k {
                (b, cb) = (t2, c2);
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
            let c = collect_range(here, a as u32, (b - a - 1) as u32, ca - cb);
            // The k-th largest key overall is the `need`-th largest of `c`.
            let need = k - cb;
            let [tau] = nth_largest(&c, [need - 1]);
            let above = c.iter().filter(|&&x| x > tau).count();
            return (tau, need - above);
        }
        if !in_work && (ca - cb) * 4 <= n {
            work = collect_range(keys, a as u32, (b - a - 1) as u32, ca - cb);
            in_work = true;
            cb0 = cb;
            continue;
        }
        // Two thresholds per counting pass, aimed by interpolation a little above and below
        // the rank sought (falling back to halving), each of which moves one end.
        let (t1, t2) = aim(a, b, ca, cb, k);
        let (c1, c2) = count_ge2(here, t1 as u32, t2 as u32);
        let base = if in_work { cb0 } else { 0 };
        for (t, c) in [(t1, base + c1), (t2, base + c2)] {
            if c >= k {
                if t > a {
                    (a, ca) = (t, c);
                }
            } else if t < b {
                (b, cb) = (t, c);
            }
        }
    }
    (a as u32, k - cb)
}

/// The keys `x` with `a <= x <= a + w` (one unsigned compare: `x - a <= w`), in order; there
/// are exactly `count` of them.
#[inline]
fn collect_range(keys: &[u32], a: u32, w: u32, count: usize) -> Vec<u32> {
    let _ = count; // a capacity hint for the vectorized kernel
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(v) = x86::collect_range(keys, a, w, count) {
        return v;
    }
    keys.iter()
        .copied()
        .filter(|&x| x.wrapping_sub(a) <= w)
        .collect()
}

/// The `js[i]`-th largest (from 0) of at most 64 keys (each `js[i] < v.len()`).
#[inline]
fn nth_largest<const N: usize>(v: &[u32], js: [usize; N]) -> [u32; N] {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(x) = x86::nth_largest(v, &js) {
        return x;
    }
    let mut v = v.to_vec();
    v.sort_unstable();
    js.map(|j| v[v.len() - 1 - j])
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

/// Two keys `a < t1 <= t2 < b` (`b - a >= 2`) to count at in one pass: where the scores
/// between `a` and `b` are finite, interpolated as if the `ca - cb` keys in `[a, b)` were spread
/// evenly in score, at a margin of `max(12, width / 16)` keys either side of the `k`-th;
/// otherwise, or where that falls outside, [`split`]'s halving point.
#[inline]
fn aim(a: u64, b: u64, ca: usize, cb: usize, k: usize) -> (u64, u64) {
    let half = split(a, b);
    let (va, vb) = (key_value(a as u32), key_value((b - 1) as u32));
    if !(va.is_finite() && vb.is_finite()) || ca <= cb {
        return (half, half);
    }
    let width = (ca - cb) as f64;
    let margin = (width / 16.0).max(12.0);
    let span = f64::from(vb) - f64::from(va);
    let at = |keys_from_top: f64| {
        let f = (keys_from_top / width).clamp(0.0, 1.0);
        let key = u64::from(order_key((f64::from(vb) - f * span) as f32));
        if key > a && key < b {
            key
        } else {
            half
        }
    };
    let need = (k - cb) as f64;
    let (t1, t2) = (at(need + margin), at(need - margin));
    (t1.min(t2), t1.max(t2))
}

/// How many keys are `>= t1` and how many `>= t2`, in one pass.
#[inline]
fn count_ge2(keys: &[u32], t1: u32, t2: u32) -> (usize, usize) {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if let Some(n) = x86::count_ge2(keys, t1, t2) {
        return n;
    }
    keys.iter().fold((0, 0), |(c1, c2), &x| {
        (c1 + usize::from(x >= t1), c2 + usize::from(x >= t2))
    })
}

/// Appends `base + i`, ascending, for every key `> tau` and the first `ties` keys `== tau`
/// (`k` of them in all).
#[inline]
fn emit(keys: &[u32], tau: u32, ties: usize, base: u32, k: usize, out: &mut Vec<u32>) {
    let _ = k; // a capacity hint for the vectorized kernel
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
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::take_best_codes(codes, table, base, k, out) {
        return true;
    }
    let _ = (codes, table, base, k, out);
    false
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
        let rest = &codes[init_end * m..local_start * m];
        if !take_best_codes(rest, table, init_end as u32, k, &mut out) {
            let (keys, range) = score_keys(rest, table);
            take_best_keys(&keys, range, init_end as u32, k, &mut out);
        }
    }
    out.extend(local_start as u32..t as u32);
    Ok(out)
}

/// AVX-512 kernels for x86-64 CPUs that have it, used when the CPU reports `avx512f` (and, for
/// the fixed-point top-k, BW, VBMI2 and BMI2). Each is checked against its portable counterpart
/// by tests (identical results: the same `f32` additions in the same order; integer compares and
/// compaction are exact; the fixed-point top-k ranks by `f32` scores wherever its keys could
/// disagree with them, a bound proved at [`fixed_rows`] and tested by a differential test and the
/// `pq_search` fuzz target).
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
        let (mut vmin, mut vmax) = (_mm512_set1_epi32(-1), _mm512_setzero_si512());
        let mut cs = codes.chunks_exact(32);
        let mut ks = keys.chunks_exact_mut(16);
        for (c, o) in (&mut cs).zip(&mut ks) {
            // SAFETY: `c` is 32 u16 = 64 bytes (x86-64 is little-endian: lane j holds
            // code(j,0) | code(j,1) << 16).
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
            let key = order_keys16(sums16(&t, v));
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

    /// Integer lane types a 64-byte register is appended as ([`push_lanes`]).
    trait Lane: Copy {}
    impl Lane for u16 {}
    impl Lane for u32 {}

    /// Appends the first `count` lanes of `packed` (as `64 / size_of::<T>()` lanes of `T`) to
    /// `v`, storing the whole register into its spare capacity (callers reserve one register's
    /// lanes beyond what they keep; the lanes past `count` are overwritten by the next store or
    /// left outside `v.len()`). No zero-filling of the buffer first: this replaced a `resize`
    /// that measured about 5% of a search.
    #[inline(always)]
    fn push_lanes<T: Lane>(v: &mut Vec<T>, packed: __m512i, count: usize) {
        let lanes = 64 / core::mem::size_of::<T>();
        let spare = v.spare_capacity_mut();
        assert!(spare.len() >= lanes && count <= lanes);
        // SAFETY: `spare` holds at least `lanes` slots of `T` (checked), that is 64 bytes, valid
        // for one unaligned 64-byte store; `T` is a plain integer (`Lane`), so after it the
        // first `count <= lanes` spare slots are initialized and `len + count` covers only
        // initialized elements.
        unsafe {
            _mm512_storeu_si512(spare.as_mut_ptr().cast(), packed);
            v.set_len(v.len() + count);
        }
    }

    /// [`push_lanes`] of 16 `u32` lanes.
    #[inline(always)]
    fn push16(v: &mut Vec<u32>, packed: __m512i, count: usize) {
        push_lanes(v, packed, count);
    }

    /// The two 64-byte registers of a 128-byte chunk (of `u16` or `u32`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load128<T: Copy>(c: &[T]) -> [__m512i; 2] {
        assert_eq!(core::mem::size_of_val(c), 128);
        // SAFETY: `c` spans exactly 128 bytes (checked); unaligned loads are allowed.
        unsafe {
            [
                _mm512_loadu_si512(c.as_ptr().cast()),
                _mm512_loadu_si512(c.as_ptr().cast::<u8>().add(64).cast()),
            ]
        }
    }

    /// The `order_key` of 16 scores, in-register: NaN as -inf, then all bits of negatives
    /// flipped and the top bit of the rest set.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn order_keys16(s: __m512) -> __m512i {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(s, s);
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        finite_order_keys16(_mm512_mask_blend_ps(nan, s, neg_inf))
    }

    /// [`order_keys16`] of 16 scores none of which is NaN.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn finite_order_keys16(s: __m512) -> __m512i {
        let bits = _mm512_castps_si512(s);
        let flip = _mm512_or_si512(_mm512_srai_epi32::<31>(bits), _mm512_set1_epi32(i32::MIN));
        _mm512_xor_si512(bits, flip)
    }

    /// [`super::take_best_codes`] where AVX-512 (F, BW, VBMI2), BMI2 and POPCNT are available.
    #[inline]
    pub(super) fn take_best_codes(
        codes: &[u16],
        table: &ScoreTable,
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> bool {
        let kk = 1usize << table.b;
        let n = codes.len() / 2;
        if table.m == 2
            && kk <= 64
            && n >= BRACKET_MIN_TOKENS
            && 0 < k
            && k < n
            && has_avx512()
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vbmi2")
            && std::is_x86_feature_detected!("bmi2")
            && std::is_x86_feature_detected!("popcnt")
        {
            // Entries past `2^b` (never looked up: codes are checked) repeat the row's first, so
            // that they move no minimum or maximum.
            let mut rows = [[table.values[0]; 64], [table.values[kk]; 64]];
            rows[0][..kk].copy_from_slice(&table.values[..kk]);
            rows[1][..kk].copy_from_slice(&table.values[kk..2 * kk]);
            // SAFETY: every feature the function enables was just detected; it has no other
            // precondition.
            unsafe { take_best_m2_fixed(codes, &rows, base, k, out) }
        } else {
            false
        }
    }

    /// The fewest tokens for which [`take_best_m2_fixed`] samples a bracket.
    const BRACKET_MIN_TOKENS: usize = 512;

    /// Sample size and half-width (in sample ranks) of the bracket of [`take_best_m2_fixed`].
    /// With 64 samples the `k`-th key's sample rank has a standard deviation of about 3.2 at
    /// `k = T/5`; +-9 misses about once in 200 searches.
    const SAMPLE: usize = 64;
    const HALF_WIDTH: usize = 9;

    /// The largest key gap [`fixed_rows`] accepts (a wider one would leave too many tokens to
    /// rank exactly; the exact path runs instead).
    const MAX_GAP: u32 = 1024;

    /// The most tokens near the `k`-th key that [`take_best_m2_fixed`] ranks by their `f32`
    /// scores (more, from many equal keys, leave it to the exact path).
    const MAX_CANDIDATES: usize = 256;

    /// Scale of the fixed-point keys: the two rows' ranges together map onto `0..=60000`.
    const KEY_SPAN: f32 = 60000.0;

    /// Word indices `0, 2, 4, ..` and `1, 3, 5, ..`: the first and second codes of 32 tokens
    /// held in two registers (a two-register word permute reads word `i` of the pair).
    const EVEN: [u16; 32] = {
        let mut a = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            a[i] = 2 * i as u16;
            i += 1;
        }
        a
    };
    const ODD: [u16; 32] = {
        let mut a = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            a[i] = 2 * i as u16 + 1;
            i += 1;
        }
        a
    };

    /// The 16-bit fixed-point rows of an `m = 2` table (two registers of 32 words per row) and
    /// the key gap at which fixed-point keys order the `f32` scores exactly.
    ///
    /// Entry `Q_j[c] = trunc(((t_j[c] - min_j) * s) + 0.5)` in `f32` operations, with
    /// `s = min(KEY_SPAN / (range_0 + range_1), 1 / u)` (`u` below), so a token's key `K = Q_0[c0] + Q_1[c1]` is at most
    /// 60001 and fits a `u16`. Error bound: `(t - min) * s <= 60000 (1 + 2^-22)`; the `f32`
    /// subtraction, multiplication and addition of 0.5 err by at most 0.0072 + 0.0072 + 0.002,
    /// so each entry lies within 0.52 of the exact `(t_j[c] - min_j) * s`, and a key within 1.04
    /// of `s` times the exact sum `t_0[c0] + t_1[c1]` less `min_0 + min_1`. Two tokens whose
    /// keys differ by `gap` or more therefore have exact sums `y` that differ by at least
    /// `(gap - 2.08) / s > u`, where `u = U * 2^-23 + 2^-149` and `U >= |y|` for every token:
    /// `u` exceeds the two roundings to `f32` of such sums together (`|fl(y) - y| <= 2^-24 |y|`,
    /// or `2^-150` below the normal range), so their `f32` scores `(0.0 + t_0) + t_1` differ in
    /// the same direction. `gap = 3 + ceil(u * s)`, at most 5 (`u * s <= 1` up to rounding).
    ///
    /// `None` when an entry is not finite, all sums are equal, `U >= 2^126` (a sum could round
    /// to infinity), or the gap would exceed [`MAX_GAP`]; the exact path runs then.
    #[target_feature(enable = "avx512f,avx512bw")]
    fn fixed_rows(rows: &[[f32; 64]; 2]) -> Option<([[__m512i; 2]; 2], u32)> {
        let t = load_rows(rows);
        let mut lo = [0.0f32; 2];
        let mut hi = [0.0f32; 2];
        for r in 0..2 {
            let mn = _mm512_min_ps(
                _mm512_min_ps(t[r][0], t[r][1]),
                _mm512_min_ps(t[r][2], t[r][3]),
            );
            let mx = _mm512_max_ps(
                _mm512_max_ps(t[r][0], t[r][1]),
                _mm512_max_ps(t[r][2], t[r][3]),
            );
            lo[r] = _mm512_reduce_min_ps(mn);
            hi[r] = _mm512_reduce_max_ps(mx);
        }
        // A NaN entry can hide from min/max: `x - x` is NaN exactly where `x` is not finite.
        let mut bad = 0u16;
        for x in t.iter().flatten() {
            bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(_mm512_sub_ps(*x, *x), _mm512_setzero_ps());
        }
        if bad != 0 {
            return None;
        }
        let total = (hi[0] - lo[0]) + (hi[1] - lo[1]);
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let mag = |r: usize| f64::from(lo[r].abs().max(hi[r].abs()));
        let big_u = (mag(0) + mag(1)) * (1.0 + 1e-12);
        if big_u >= 2f64.powi(126) {
            return None;
        }
        let u = big_u * 2f64.powi(-23) + 2f64.powi(-149);
        // No finer than the `f32` spacing `u` (finer keys would only widen the gap).
        let s = (f64::from(KEY_SPAN / total)).min(1.0 / u) as f32;
        if !(s.is_finite() && s > 0.0) {
            return None;
        }
        let gap = 3.0 + (u * f64::from(s)).ceil();
        if gap > f64::from(MAX_GAP) {
            return None;
        }
        let (sv, half) = (_mm512_set1_ps(s), _mm512_set1_ps(0.5));
        let q = core::array::from_fn(|r| {
            let lv = _mm512_set1_ps(lo[r]);
            let w: [__m256i; 4] = core::array::from_fn(|i| {
                let x = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(t[r][i], lv), sv), half);
                _mm512_cvtepi32_epi16(_mm512_cvttps_epi32(x))
            });
            [
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w[0]), w[1]),
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w[2]), w[3]),
            ]
        });
        Some((q, gap as u32))
    }

    /// [`push_lanes`] of 32 `u16` lanes.
    #[inline(always)]
    fn push32(v: &mut Vec<u16>, packed: __m512i, count: usize) {
        push_lanes(v, packed, count);
    }

    /// The low `len` bits set (`len <= 32`).
    #[inline(always)]
    fn low_bits(len: usize) -> u32 {
        if len >= 32 {
            u32::MAX
        } else {
            (1u32 << len) - 1
        }
    }

    /// How many of `v` are `>= t1` and how many `>= t2`, 32 per step.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,popcnt")]
    fn count_ge2_u16(v: &[u16], t1: u32, t2: u32) -> (usize, usize) {
        let (u1, u2) = (
            _mm512_set1_epi16(t1 as u16 as i16),
            _mm512_set1_epi16(t2 as u16 as i16),
        );
        let (mut n1, mut n2) = (0usize, 0usize);
        for c in v.chunks(32) {
            let live = low_bits(c.len());
            // SAFETY: only the `c.len()` live words are read, all inside `c`.
            let x = unsafe { _mm512_maskz_loadu_epi16(live, c.as_ptr().cast()) };
            n1 += _mm512_mask_cmpge_epu16_mask(live, x, u1).count_ones() as usize;
            n2 += _mm512_mask_cmpge_epu16_mask(live, x, u2).count_ones() as usize;
        }
        (n1, n2)
    }

    /// The `js[i]`-th largest (from 0) of at most 64 keys `v` (every `js[i] < v.len()`):
    /// each key's count of larger keys `g` (one broadcast compare per key and register), then
    /// the `j`-th largest is the smallest key with `g <= j`.
    #[target_feature(enable = "avx512f,avx512bw")]
    fn nth_largest_u16<const N: usize>(v: &[u16], js: [usize; N]) -> [u16; N] {
        let n = v.len().min(64);
        let mut arr = [0u16; 64];
        arr[..n].copy_from_slice(&v[..n]);
        // SAFETY: `arr[32r..32r + 32]` is 32 u16 = 64 bytes in bounds (r < 2).
        let regs: [__m512i; 2] =
            core::array::from_fn(|r| unsafe { _mm512_loadu_si512(arr[32 * r..].as_ptr().cast()) });
        let live = [low_bits(n), low_bits(n.saturating_sub(32))];
        let one = _mm512_set1_epi16(1);
        let mut g = [_mm512_setzero_si512(); 2];
        for &x in &arr[..n] {
            let b = _mm512_set1_epi16(x as i16);
            for r in 0..2 {
                let gt = _mm512_cmpgt_epu16_mask(b, regs[r]);
                g[r] = _mm512_mask_add_epi16(g[r], gt, g[r], one);
            }
        }
        js.map(|j| {
            let jv = _mm512_set1_epi16(j as i16);
            let ones = _mm512_set1_epi16(-1);
            let pick = |r: usize| {
                let m = live[r] & _mm512_cmple_epu16_mask(g[r], jv);
                _mm512_mask_blend_epi16(m, ones, regs[r])
            };
            let mut lanes = [0u16; 32];
            // SAFETY: `lanes` is 32 u16 = 64 bytes.
            unsafe {
                _mm512_storeu_si512(
                    lanes.as_mut_ptr().cast(),
                    _mm512_min_epu16(pick(0), pick(1)),
                )
            };
            lanes.iter().copied().min().unwrap_or(u16::MAX)
        })
    }

    /// The `j`-th largest (from 0) of `v`, whose keys all lie in `lo..=hi` (`j < v.len()`).
    ///
    /// Counting passes with two thresholds each, aimed by interpolation a margin either side of
    /// the rank sought (halving instead after a pass that kept more than half), narrow
    /// `[a, b]` until at most 64 keys lie in it; those are collected and ranked.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
    fn kth_u16(v: &[u16], j: usize, lo: u16, hi: u16) -> u16 {
        // Invariants: the answer is in [a, b]; ca = #keys >= a > j; cb = #keys > b <= j.
        let (mut a, mut b) = (u32::from(lo), u32::from(hi));
        let (mut ca, mut cb) = (v.len(), 0usize);
        let mut halve = false;
        while ca - cb > 64 && a < b {
            let width = ca - cb;
            let (t1, t2) = if halve {
                let mid = (a + b).div_ceil(2);
                (mid, mid)
            } else {
                let (w, span) = (width as f64, f64::from(b - a));
                let margin = (w / 16.0).max(8.0);
                let need = (j - cb) as f64 + 0.5;
                let at = |from_top: f64| {
                    let f = (from_top / w).clamp(0.0, 1.0);
                    ((f64::from(b) - f * span).round() as u32).clamp(a + 1, b)
                };
                (at(need + margin), at(need - margin))
            };
            let (c1, c2) = count_ge2_u16(v, t1, t2);
            for (t, c) in [(t1, c1), (t2, c2)] {
                if c > j {
                    if t > a {
                        (a, ca) = (t, c);
                    }
                } else if t <= b {
                    (b, cb) = (t - 1, c);
                }
            }
            halve = (ca - cb) * 2 > width;
        }
        if a == b {
            return a as u16;
        }
        // At most 64 keys lie in [a, b]; 32 spare slots for the last full-width store.
        let mut buf = [0u16; 96];
        let mut len = 0usize;
        let (av, wv) = (
            _mm512_set1_epi16(a as u16 as i16),
            _mm512_set1_epi16((b - a) as u16 as i16),
        );
        for c in v.chunks(32) {
            let live = low_bits(c.len());
            // SAFETY: only the `c.len()` live words are read, all inside `c`.
            let x = unsafe { _mm512_maskz_loadu_epi16(live, c.as_ptr().cast()) };
            let m = _mm512_mask_cmple_epu16_mask(live, _mm512_sub_epi16(x, av), wv);
            let dst = &mut buf[len..len + 32];
            // SAFETY: `dst` is 32 u16 = 64 bytes.
            unsafe {
                _mm512_storeu_si512(dst.as_mut_ptr().cast(), _mm512_maskz_compress_epi16(m, x))
            };
            len += m.count_ones() as usize;
        }
        // Branch-free bisection over the collected keys (two registers): the largest t in
        // [a, b] with more than j - cb of them >= t.
        let regs = [0, 32].map(|at| {
            // SAFETY: `buf[at..at + 32]` is 32 u16 = 64 bytes in bounds (at <= 32 < 96 - 32).
            unsafe { _mm512_loadu_si512(buf[at..].as_ptr().cast()) }
        });
        let live = [low_bits(len), low_bits(len.saturating_sub(32))];
        let jj = j - cb;
        let steps = 32 - (b - a).leading_zeros();
        for _ in 0..steps {
            let mid = (a + b).div_ceil(2);
            let tv = _mm512_set1_epi16(mid as u16 as i16);
            let c = _mm512_mask_cmpge_epu16_mask(live[0], regs[0], tv).count_ones()
                + _mm512_mask_cmpge_epu16_mask(live[1], regs[1], tv).count_ones();
            let up = c as usize > jj;
            a = if up { mid } else { a };
            b = if up { b } else { mid - 1 };
        }
        a as u16
    }

    /// Top-k in two passes over the tokens on 16-bit fixed-point keys ([`fixed_rows`]), with
    /// the `f32` scores consulted only near the `k`-th key, so that the result is exactly
    /// [`super::take_best_keys`]'s on the `f32` scores:
    /// 1. a bracket `[lo, hi]` of keys from a 64-token sample (scored in registers as pass one
    ///    scores, ranked by broadcast compares), widened by `gap - 1` each side into the band;
    /// 2. pass one, 32 tokens per step: their keys (codes split into first and second by two
    ///    word permutes, each looked up in its row by one more), a mask of those above the band
    ///    and a mask of those in it, whose keys are compacted in index order;
    /// 3. the `k`-th key `tau` among the band's keys ([`kth_u16`]: counting passes aimed by
    ///    interpolation, then a bisection over the last 64 or fewer);
    /// 4. every token whose key is `>= tau + gap` is among the `k` best `f32` scores (at most
    ///    the tokens with keys `> tau`, fewer than `k`, can outrank it) and every token whose key
    ///    is `<= tau - gap` is not (the `k` or more tokens with keys `>= tau` outrank it), so only
    ///    the tokens within `gap - 1` of `tau` are ranked by their `f32` scores and ties, to fill
    ///    the rest; each band key gets a taken bit;
    /// 5. pass two over the masks: the taken mask is the above mask plus the block's taken bits
    ///    deposited (`pdep`) at its band positions; the taken indices are compacted.
    ///
    /// Returns `false`, with `out` untouched, when the tables do not allow fixed-point keys or
    /// the bracket misses (the caller then runs the general path).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,bmi2,popcnt")]
    fn take_best_m2_fixed(
        codes: &[u16],
        rows: &[[f32; 64]; 2],
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> bool {
        let n = codes.len() / 2;
        let Some((tq, gap)) = fixed_rows(rows) else {
            return false;
        };
        let near = gap - 1;
        // SAFETY: `EVEN` and `ODD` are 32 u16 = 64 bytes each.
        let (even, odd) = unsafe {
            (
                _mm512_loadu_si512(EVEN.as_ptr().cast()),
                _mm512_loadu_si512(ODD.as_ptr().cast()),
            )
        };
        // The keys of 32 tokens whose code pairs are the words of `a` (16 tokens) then `b`: the
        // first and second codes split by two word permutes, each looked up in its row.
        let keys32 = |a: __m512i, b: __m512i| {
            let c0 = _mm512_permutex2var_epi16(a, even, b);
            let c1 = _mm512_permutex2var_epi16(a, odd, b);
            _mm512_add_epi16(
                _mm512_permutex2var_epi16(tq[0][0], c0, tq[0][1]),
                _mm512_permutex2var_epi16(tq[1][0], c1, tq[1][1]),
            )
        };
        // 1. The bracket: sample ranks r +- HALF_WIDTH around the expected rank r of the k-th.
        let stride = n / SAMPLE;
        let pairs: [u16; 2 * SAMPLE] =
            core::array::from_fn(|i| codes[2 * ((i / 2) * stride + stride / 2) + i % 2]);
        let mut sample = [0u16; SAMPLE];
        for (h, out) in sample.chunks_exact_mut(32).enumerate() {
            let [a, b] = load128(&pairs[64 * h..64 * h + 64]);
            // SAFETY: `out` is 32 u16 = 64 bytes.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), keys32(a, b)) };
        }
        let r = k * SAMPLE / n;
        let (lo, hi) = if r + HALF_WIDTH < SAMPLE {
            let [lo, hi] = nth_largest_u16(&sample, [r + HALF_WIDTH, r.saturating_sub(HALF_WIDTH)]);
            (lo, if r >= HALF_WIDTH { hi } else { u16::MAX })
        } else {
            (0, u16::MAX)
        };
        let band_lo = u32::from(lo).saturating_sub(near);
        let band_hi = (u32::from(hi) + near).min(0xFFFF);
        // 2. Pass one.
        let (hi_v, lo_v, w_v) = (
            _mm512_set1_epi16(band_hi as u16 as i16),
            _mm512_set1_epi16(band_lo as u16 as i16),
            _mm512_set1_epi16((band_hi - band_lo) as u16 as i16),
        );
        let blocks = n.div_ceil(32);
        // Per block of 32 tokens: the above-band mask in the low 32 bits, the band mask in the
        // high 32.
        let mut masks_stack = [0u64; 128];
        let mut masks_heap = Vec::new();
        let masks: &mut [u64] = if blocks <= masks_stack.len() {
            &mut masks_stack[..blocks]
        } else {
            masks_heap.resize(blocks, 0);
            &mut masks_heap
        };
        // The band's keys; 32 spare slots for the last full-width store (the cursor counts band
        // keys of the blocks before, at most `32 * blocks - 32`).
        let mut band: Vec<u16> = Vec::with_capacity(32 * blocks + 32);
        let mut n_above = 0usize;
        macro_rules! block {
            ($a:expr, $b:expr, $j:expr, $valid:expr) => {{
                let key = keys32($a, $b);
                let above = _mm512_mask_cmpgt_epu16_mask($valid, key, hi_v);
                let inside = _mm512_mask_cmple_epu16_mask($valid, _mm512_sub_epi16(key, lo_v), w_v);
                push32(
                    &mut band,
                    _mm512_maskz_compress_epi16(inside, key),
                    inside.count_ones() as usize,
                );
                n_above += above.count_ones() as usize;
                masks[$j] = u64::from(above) | u64::from(inside) << 32;
            }};
        }
        let mut cs = codes.chunks_exact(64);
        for (j, c) in (&mut cs).enumerate() {
            let [a, b] = load128(c);
            block!(a, b, j, u32::MAX);
        }
        let rem = cs.remainder();
        if !rem.is_empty() {
            let mut pad = [0u16; 64];
            pad[..rem.len()].copy_from_slice(rem);
            let [a, b] = load128(&pad);
            block!(a, b, blocks - 1, low_bits(rem.len() / 2));
        }
        // 3. The k-th key, within the band.
        let n_band = band.len();
        if n_above >= k || n_above + n_band < k {
            return false;
        }
        let tau = u32::from(kth_u16(
            &band,
            k - n_above - 1,
            band_lo as u16,
            band_hi as u16,
        ));
        // Every key within `near` of tau must be in the band (so whenever tau is in [lo, hi]).
        if (band_lo > 0 && tau < band_lo + near) || (band_hi < 0xFFFF && tau + near > band_hi) {
            return false;
        }
        // 4. Taken bits of the band keys, 32 per word in band order (two spare zero words so
        // that pass two can read any word and the next), and the candidates near tau (their
        // band positions, ascending; more than `MAX_CANDIDATES` leaves it to the exact path).
        let words = n_band.div_ceil(32) + 2;
        let mut taken_stack = [0u32; 136];
        let mut taken_heap = Vec::new();
        let taken: &mut [u32] = if words <= taken_stack.len() {
            &mut taken_stack[..words]
        } else {
            taken_heap.resize(words, 0);
            &mut taken_heap
        };
        let mut cands = [0u32; MAX_CANDIDATES];
        let mut n_cands = 0usize;
        let take_at = tau + gap;
        let near_lo = tau.saturating_sub(near);
        let (take_v, near_lo_v, near_w_v) = (
            _mm512_set1_epi16(take_at.min(0xFFFF) as u16 as i16),
            _mm512_set1_epi16(near_lo as u16 as i16),
            _mm512_set1_epi16(((tau + near).min(0xFFFF) - near_lo) as u16 as i16),
        );
        let mut n_taken = n_above;
        for (w, c) in band.chunks(32).enumerate() {
            let live = low_bits(c.len());
            // SAFETY: only the `c.len()` live words are read, all inside `c`.
            let v = unsafe { _mm512_maskz_loadu_epi16(live, c.as_ptr().cast()) };
            let ge = if take_at <= 0xFFFF {
                _mm512_mask_cmpge_epu16_mask(live, v, take_v)
            } else {
                0
            };
            let mut close =
                _mm512_mask_cmple_epu16_mask(live, _mm512_sub_epi16(v, near_lo_v), near_w_v);
            taken[w] = ge;
            n_taken += ge.count_ones() as usize;
            if n_cands + close.count_ones() as usize > MAX_CANDIDATES {
                return false;
            }
            while close != 0 {
                cands[n_cands] = 32 * w as u32 + close.trailing_zeros();
                n_cands += 1;
                close &= close - 1;
            }
        }
        let cands = &cands[..n_cands];
        // At least one and at most all candidates are needed (the argument above); a miss
        // would be a bug, and the exact path still answers right.
        let need = k.wrapping_sub(n_taken);
        if need == 0 || need > n_cands {
            debug_assert!(false, "fixed-point bracket: need {need} of {n_cands}");
            return false;
        }
        // The candidates' exact ranking keys, from their tokens (found from their band
        // positions); then the `need` best by key, ties to the lower token (= candidate) index.
        let mut exact = [(0u32, 0u32); MAX_CANDIDATES];
        let (mut ci, mut seen) = (0usize, 0u32);
        for (j, &mask) in masks.iter().enumerate() {
            if ci == n_cands {
                break;
            }
            let inside = (mask >> 32) as u32;
            let count = inside.count_ones();
            while ci < n_cands && cands[ci] < seen + count {
                let lane = _pdep_u32(1 << (cands[ci] - seen), inside).trailing_zeros() as usize;
                let tok = 32 * j + lane;
                let (c0, c1) = (usize::from(codes[2 * tok]), usize::from(codes[2 * tok + 1]));
                let s = (0.0 + rows[0][c0 & 63]) + rows[1][c1 & 63];
                exact[ci] = (super::order_key(s), ci as u32);
                ci += 1;
            }
            seen += count;
        }
        let exact = &mut exact[..n_cands];
        exact.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, i) in &exact[..need] {
            let p = cands[i as usize];
            taken[p as usize / 32] |= 1 << (p % 32);
        }
        // 5. Pass two: `k` indices in all; 32 spare slots for the last full-width stores.
        out.reserve(k + 32);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mut idx = _mm512_add_epi32(_mm512_set1_epi32(base as i32), lanes);
        let (sixteen, step) = (_mm512_set1_epi32(16), _mm512_set1_epi32(32));
        let mut cursor = 0usize;
        for &mask in masks.iter() {
            let (above, inside) = (mask as u32, (mask >> 32) as u32);
            let at = cursor / 32;
            let window = u64::from(taken[at]) | u64::from(taken[at + 1]) << 32;
            let bits = (window >> (cursor % 32)) as u32;
            cursor += inside.count_ones() as usize;
            let take = above | _pdep_u32(bits, inside);
            let (t0, t1) = (take as u16, (take >> 16) as u16);
            push16(
                out,
                _mm512_maskz_compress_epi32(t0, idx),
                t0.count_ones() as usize,
            );
            let idx1 = _mm512_add_epi32(idx, sixteen);
            push16(
                out,
                _mm512_maskz_compress_epi32(t1, idx1),
                t1.count_ones() as usize,
            );
            idx = _mm512_add_epi32(idx, step);
        }
        true
    }

    /// `Some` of the `js[i]`-th largest (from 0) of at most 64 keys `v` (every `js[i] <
    /// v.len()`), where AVX-512 is available.
    #[inline]
    pub(super) fn nth_largest<const N: usize>(v: &[u32], js: &[usize; N]) -> Option<[u32; N]> {
        if has_avx512() && std::is_x86_feature_detected!("popcnt") {
            // SAFETY: AVX-512F and POPCNT were just detected; no other precondition.
            Some(unsafe { nth_largest_avx512(v, *js) })
        } else {
            None
        }
    }

    /// Branch-free order statistics of at most 64 keys: each key's count of larger keys `g`
    /// (one broadcast compare per key and register), then the `j`-th largest is the smallest
    /// key with `g <= j` (the keys with at most `j` keys above them are the `j + 1` largest,
    /// with all ties of the last).
    #[target_feature(enable = "avx512f,popcnt")]
    fn nth_largest_avx512<const N: usize>(v: &[u32], js: [usize; N]) -> [u32; N] {
        let n = v.len().min(64);
        let mut arr = [0u32; 64];
        arr[..n].copy_from_slice(&v[..n]);
        let regs: [__m512i; 4] = core::array::from_fn(|r| {
            // SAFETY: `arr[16r..16r + 16]` is 16 u32 = 64 bytes in bounds (r < 4).
            unsafe { _mm512_loadu_si512(arr[16 * r..16 * r + 16].as_ptr().cast()) }
        });
        let live: [__mmask16; 4] = core::array::from_fn(|r| {
            let l = n.saturating_sub(16 * r).min(16);
            ((1u32 << l) - 1) as __mmask16
        });
        let used = n.div_ceil(16);
        let one = _mm512_set1_epi32(1);
        let mut g = [_mm512_setzero_si512(); 4];
        for &x in &arr[..n] {
            let b = _mm512_set1_epi32(x as i32);
            for r in 0..used {
                let gt = _mm512_cmpgt_epu32_mask(b, regs[r]);
                g[r] = _mm512_mask_add_epi32(g[r], gt, g[r], one);
            }
        }
        js.map(|j| {
            let jv = _mm512_set1_epi32(j as i32);
            let mut best = u32::MAX;
            for r in 0..used {
                let m = live[r] & _mm512_cmple_epu32_mask(g[r], jv);
                best = best.min(_mm512_mask_reduce_min_epu32(m, regs[r]));
            }
            best
        })
    }

    /// `Some` bitwise OR of all codes where AVX-512 is available (64 bytes per step; the
    /// portable fold runs at SSE2 width, and this check precedes every search).
    #[inline]
    pub(super) fn or_all(codes: &[u16]) -> Option<u16> {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            Some(unsafe { or_all_avx512(codes) })
        } else {
            None
        }
    }

    #[target_feature(enable = "avx512f")]
    fn or_all_avx512(codes: &[u16]) -> u16 {
        let (mut acc0, mut acc1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        let mut pairs = codes.chunks_exact(64);
        for c in &mut pairs {
            let [v0, v1] = load128(c);
            acc0 = _mm512_or_si512(acc0, v0);
            acc1 = _mm512_or_si512(acc1, v1);
        }
        let x = _mm512_reduce_or_epi32(_mm512_or_si512(acc0, acc1)) as u32;
        let folded = (x | x >> 16) as u16;
        pairs.remainder().iter().fold(folded, |a, &c| a | c)
    }

    /// `Some((#keys >= t1, #keys >= t2))` where AVX-512 is available.
    #[inline]
    pub(super) fn count_ge2(keys: &[u32], t1: u32, t2: u32) -> Option<(usize, usize)> {
        if has_avx512() {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            Some(unsafe { count_ge2_avx512(keys, t1, t2) })
        } else {
            None
        }
    }

    #[target_feature(enable = "avx512f")]
    fn count_ge2_avx512(keys: &[u32], t1: u32, t2: u32) -> (usize, usize) {
        let (u1, u2) = (_mm512_set1_epi32(t1 as i32), _mm512_set1_epi32(t2 as i32));
        let one = _mm512_set1_epi32(1);
        // Per-lane counts (each <= keys.len() / 16 + 1 < 2^31), summed at the end.
        let (mut acc1, mut acc2) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for c in keys.chunks(16) {
            let live = ((1u32 << c.len()) - 1) as __mmask16;
            // SAFETY: only the `c.len()` live lanes are read, all inside `c`.
            let v = unsafe { _mm512_maskz_loadu_epi32(live, c.as_ptr().cast()) };
            acc1 = _mm512_mask_add_epi32(acc1, live & _mm512_cmpge_epu32_mask(v, u1), acc1, one);
            acc2 = _mm512_mask_add_epi32(acc2, live & _mm512_cmpge_epu32_mask(v, u2), acc2, one);
        }
        (
            _mm512_reduce_add_epi32(acc1) as u32 as usize,
            _mm512_reduce_add_epi32(acc2) as u32 as usize,
        )
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
        let mut out = Vec::with_capacity(count.min(keys.len()) + 16);
        let (av, wv) = (_mm512_set1_epi32(a as i32), _mm512_set1_epi32(w as i32));
        let mut chunks = keys.chunks_exact(16);
        for c in &mut chunks {
            // SAFETY: `c` holds exactly 16 u32; unaligned loads are allowed.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
            let m = _mm512_cmple_epu32_mask(_mm512_sub_epi32(v, av), wv);
            let packed = _mm512_maskz_compress_epi32(m, v);
            push16(&mut out, packed, m.count_ones() as usize);
        }
        out.extend(
            chunks
                .remainder()
                .iter()
                .filter(|&&x| x.wrapping_sub(a) <= w),
        );
        out
    }

    /// `Some` of `dot(q, rows[i])` for 16 rows (each of `q.len()` floats, a multiple of 16)
    /// where AVX-512 is available, every sum in dim order from `0.0` as [`super::dot`] does.
    #[inline]
    pub(super) fn dot_x16(q: &[f32], rows: [&[f32]; 16]) -> Option<[f32; 16]> {
        if has_avx512() && q.len().is_multiple_of(16) && rows.iter().all(|r| r.len() == q.len()) {
            // SAFETY: AVX-512F was just detected; the function has no other precondition.
            Some(unsafe { dot_x16_avx512(q, rows) })
        } else {
            None
        }
    }

    /// 16 rows at a time, lane `i` summing row `i`: per 16 dims the rows' 16x16 block is
    /// transposed in registers (two unpack stages and two 128-bit shuffle stages), then each
    /// dim's column is multiplied by `q[d]` and added, dims in order.
    #[target_feature(enable = "avx512f")]
    fn dot_x16_avx512(q: &[f32], rows: [&[f32]; 16]) -> [f32; 16] {
        let mut acc = _mm512_setzero_ps();
        for (b, qb) in q.chunks_exact(16).enumerate() {
            let r: [__m512; 16] = core::array::from_fn(|i| {
                let c = &rows[i][16 * b..16 * b + 16];
                // SAFETY: `c` is 16 f32 = 64 bytes.
                unsafe { _mm512_loadu_ps(c.as_ptr()) }
            });
            // Lane group k of t[2p] / t[2p+1]: rows 2p, 2p+1 at dims 4k, 4k+1 / 4k+2, 4k+3.
            let t: [__m512; 16] = core::array::from_fn(|i| {
                let (a, c) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 {
                    _mm512_unpacklo_ps(a, c)
                } else {
                    _mm512_unpackhi_ps(a, c)
                }
            });
            // u[4g + s]: rows 4g..4g+4 at dim 4k + s in lane group k.
            let u: [__m512d; 16] = core::array::from_fn(|i| {
                let (g, s) = (i / 4, i % 4);
                let a = _mm512_castps_pd(t[4 * g + (s / 2)]);
                let c = _mm512_castps_pd(t[4 * g + 2 + (s / 2)]);
                if s % 2 == 0 {
                    _mm512_unpacklo_pd(a, c)
                } else {
                    _mm512_unpackhi_pd(a, c)
                }
            });
            let u: [__m512; 16] = u.map(|x| _mm512_castpd_ps(x));
            let mut col = [_mm512_setzero_ps(); 16];
            for s in 0..4 {
                let (g0, g1, g2, g3) = (u[s], u[4 + s], u[8 + s], u[12 + s]);
                let v0 = _mm512_shuffle_f32x4::<0b10_00_10_00>(g0, g1);
                let v1 = _mm512_shuffle_f32x4::<0b10_00_10_00>(g2, g3);
                let w0 = _mm512_shuffle_f32x4::<0b11_01_11_01>(g0, g1);
                let w1 = _mm512_shuffle_f32x4::<0b11_01_11_01>(g2, g3);
                col[s] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v0, v1);
                col[8 + s] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v0, v1);
                col[4 + s] = _mm512_shuffle_f32x4::<0b10_00_10_00>(w0, w1);
                col[12 + s] = _mm512_shuffle_f32x4::<0b11_01_11_01>(w0, w1);
            }
            for (c, &x) in col.iter().zip(qb) {
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(x), *c));
            }
        }
        let mut out = [0.0f32; 16];
        // SAFETY: `out` is 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), acc) };
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
        // k = (#keys > tau) + ties values are taken; 16 spare slots for the last full-width store.
        out.reserve(k + 16);
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
            // Compress in a register, then store all 16 lanes (a compressing store to memory
            // is microcoded and about 50x slower on AMD Zen 4). Only taken keys advance the
            // length, k in all, so 16 spare slots remain.
            let packed = _mm512_maskz_compress_epi32(take, idx);
            push16(out, packed, take.count_ones() as usize);
            idx = _mm512_add_epi32(idx, step);
            i += 16;
        }
        for (j, &key) in chunks.remainder().iter().enumerate() {
            let tie = key == tau && ties > 0;
            ties -= usize::from(tie);
            if key > tau || tie {
                out.push(base + (i + j) as u32);
            }
        }
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
    // A search's selection is already ascending and distinct: then nothing to sort.
    if !cand.windows(2).all(|w| w[0] < w[1]) {
        cand.sort_unstable();
        cand.dedup();
    }
    let row = |i: u32| &keys[i as usize * d..(i as usize + 1) * d];
    let mut sc: Vec<f32> = Vec::with_capacity(cand.len());
    // 16 at a time where the AVX-512 kernel runs (the same sums), then 8 at a time.
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    for g in cand.chunks_exact(16) {
        match x86::dot_x16(query, core::array::from_fn(|j| row(g[j]))) {
            Some(s) => sc.extend_from_slice(&s),
            None => break,
        }
    }
    let mut groups = cand[sc.len()..].chunks_exact(8);
    for g in &mut groups {
        sc.extend_from_slice(&dot_x8(query, core::array::from_fn(|j| row(g[j]))));
    }
    sc.extend(groups.remainder().iter().map(|&i| dot(query, row(i))));
    let k = k.min(cand.len());
    if k == cand.len() {
        return Ok(cand);
    }
    // One integer per candidate that orders as `rank` does (larger first): the score's ranking
    // key, then the lower index. The k best are those `>=` the k-th largest; every value is
    // distinct, so exactly k are, and they are kept in index order.
    let mut keyed: Vec<u64> = sc
        .iter()
        .enumerate()
        .map(|(i, &s)| u64::from(order_key(s)) << 32 | u64::from(!(i as u32)))
        .collect();
    let mut out = Vec::with_capacity(k);
    if k > 0 {
        let all = keyed.clone();
        let (_, &mut kth, _) = keyed.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        out.extend(
            all.iter()
                .zip(&cand)
                .filter(|(&key, _)| key >= kth)
                .map(|(_, &c)| c),
        );
    }
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

    #[test]
    fn nth_largest_equals_sorting() {
        let mut x = Xs(7);
        for n in 1..=64usize {
            for spread in [3u64, 1 << 32] {
                let v: Vec<u32> = (0..n).map(|_| (x.next() % spread) as u32).collect();
                let mut sorted = v.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                for (j, &want) in sorted.iter().enumerate() {
                    assert_eq!(nth_largest(&v, [j]), [want], "n {n} j {j}");
                    let i = n - 1 - j;
                    assert_eq!(nth_largest(&v, [j, i]), [want, sorted[i]], "n {n} j {j}");
                }
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
        #[cfg(all(feature = "std", target_arch = "x86_64"))]
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
        let (b, t) = (6u8, 2048usize);
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

    /// The 16-row dot kernel (where the CPU has it) equals [`dot`] bit for bit, row by row.
    #[test]
    fn dot_x16_equals_dot() {
        let mut x = Xs(99);
        for d in [16usize, 32, 64, 128] {
            for _ in 0..20 {
                let mut v = || match x.next() % 9 {
                    0 => -0.0,
                    1 => 0.0,
                    2 => 1.0e-30,
                    3 => -3.0e25,
                    _ => ((x.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0,
                };
                let q: Vec<f32> = (0..d).map(|_| v()).collect();
                let rows: Vec<Vec<f32>> = (0..16).map(|_| (0..d).map(|_| v()).collect()).collect();
                let r: [&[f32]; 16] = core::array::from_fn(|i| rows[i].as_slice());
                #[cfg(all(feature = "std", target_arch = "x86_64"))]
                if let Some(got) = x86::dot_x16(&q, r) {
                    for (i, g) in got.iter().enumerate() {
                        assert_eq!(g.to_bits(), dot(&q, r[i]).to_bits(), "d {d} row {i}");
                    }
                }
                let _ = r;
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
