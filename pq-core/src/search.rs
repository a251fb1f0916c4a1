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

/// The ranking order of [`select`] (used by [`rerank`]): higher score first, NaN ranked as
/// `-inf`, `-0.0` below `+0.0`, then lower index first. A total order, so the selection is unique.
fn rank(scores: &[f32], a: u32, b: u32) -> Ordering {
    let key = |i: u32| order_key(scores[i as usize]);
    key(b).cmp(&key(a)).then(a.cmp(&b))
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
/// where a kernel that does it in two passes over the tokens is available (x86-64 with AVX-512F
/// and BMI2, `m = 2`, `2^b <= 64`, at least 512 tokens) and its sampled
/// bracket holds the `k`-th key; else returns `false` with `out` untouched.
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

    /// Appends the first `count` (`<= 16`) lanes of `packed` to `v`, storing all 16 lanes into
    /// its spare capacity (callers reserve 16 slots beyond what they keep; the lanes past
    /// `count` are overwritten by the next store or left outside `v.len()`). No zero-filling
    /// of the buffer first: this replaced a `resize` that measured about 5% of a search.
    #[inline(always)]
    fn push16(v: &mut Vec<u32>, packed: __m512i, count: usize) {
        let spare = v.spare_capacity_mut();
        assert!(spare.len() >= 16 && count <= 16);
        // SAFETY: `spare` holds at least 16 slots (checked), valid for one unaligned 64-byte
        // store; after it the first `count <= 16` spare slots are initialized, so `len + count`
        // covers only initialized elements.
        unsafe {
            _mm512_storeu_si512(spare.as_mut_ptr().cast(), packed);
            v.set_len(v.len() + count);
        }
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

    /// [`super::take_best_codes`] where AVX-512F and BMI2 are available.
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
            && std::is_x86_feature_detected!("bmi2")
            && std::is_x86_feature_detected!("popcnt")
        {
            let mut rows = [[0.0f32; 64]; 2];
            rows[0][..kk].copy_from_slice(&table.values[..kk]);
            rows[1][..kk].copy_from_slice(&table.values[kk..2 * kk]);
            // SAFETY: AVX-512F and BMI2 were just detected; the function has no other
            // precondition.
            unsafe { take_best_m2_avx512(codes, &rows, base, k, out) }
        } else {
            false
        }
    }

    /// The fewest tokens for which [`take_best_m2_avx512`] samples a bracket.
    const BRACKET_MIN_TOKENS: usize = 512;

    /// Sample size and half-width (in sample ranks) of the bracket of
    /// [`take_best_m2_avx512`]. With 64 samples the `k`-th key's sample rank has a standard
    /// deviation of about 3.2 at `k = T/5`; +-9 misses about once in 200 searches.
    const SAMPLE: usize = 64;
    const HALF_WIDTH: usize = 9;

    /// Top-k in two passes over the tokens, without storing their keys:
    /// 1. a bracket `[lo, hi]` of key values from a sorted sample of 64 tokens' keys;
    /// 2. pass one: each 16-token block's keys, with a mask of those `> hi` (taken whatever the
    ///    `k`-th key is, if the bracket holds it) and a mask of those in the bracket, whose keys
    ///    are compacted in index order into `band`;
    /// 3. if fewer than `k` keys are `> hi` and at least `k` are `>= lo`, the `k`-th key `tau`
    ///    and its ties are found among the band's keys, and each band key gets a taken bit
    ///    (`> tau`, or one of the first `ties` equal to `tau`), in band order;
    /// 4. pass two: per block, the taken mask is the `> hi` mask plus the block's taken bits
    ///    deposited (`pdep`) at the positions of its band mask; the taken indices are compacted.
    ///
    /// Returns `false`, with `out` untouched, when the bracket misses (the caller then runs the
    /// general path).
    #[target_feature(enable = "avx512f,bmi2,popcnt")]
    fn take_best_m2_avx512(
        codes: &[u16],
        rows: &[[f32; 64]; 2],
        base: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> bool {
        let n = codes.len() / 2;
        // 1. The bracket: sample ranks r +- HALF_WIDTH around the expected rank r of the k-th.
        let stride = n / SAMPLE;
        let mut sample = [0u32; SAMPLE];
        for (i, x) in sample.iter_mut().enumerate() {
            let at = 2 * (i * stride + stride / 2);
            let (c0, c1) = (usize::from(codes[at]), usize::from(codes[at + 1]));
            *x = super::order_key((0.0 + rows[0][c0 & 63]) + rows[1][c1 & 63]);
        }
        let r = k * SAMPLE / n;
        let (lo, hi) = if r + HALF_WIDTH < SAMPLE {
            let [lo, hi] =
                nth_largest_avx512(&sample, [r + HALF_WIDTH, r.saturating_sub(HALF_WIDTH)]);
            (lo, if r >= HALF_WIDTH { hi } else { u32::MAX })
        } else {
            (0, u32::MAX)
        };
        // 2. Pass one.
        let t = load_rows(rows);
        let (hi_v, lo_v, w_v) = (
            _mm512_set1_epi32(hi as i32),
            _mm512_set1_epi32(lo as i32),
            _mm512_set1_epi32(hi.wrapping_sub(lo) as i32),
        );
        let blocks = n.div_ceil(16);
        // Per block: the `> hi` mask in the low 16 bits, the band mask in the high 16.
        let mut masks = vec![0u32; blocks];
        // The band's keys; 16 spare slots for the last full-width store. The cursor counts band
        // keys of the blocks before, at most `16 * blocks - 16 <= n`, so every store fits.
        let mut band: Vec<u32> = Vec::with_capacity(16 * blocks + 16);
        let mut n_above = 0usize;
        // One block of 16 tokens: `v` their code pairs, `valid` the live lanes (a macro, so
        // that the full blocks' loop runs with a constant mask).
        macro_rules! block {
            ($v:expr, $j:expr, $valid:expr, $finite:expr) => {{
                let sum = sums16(&t, $v);
                let key = if $finite {
                    finite_order_keys16(sum)
                } else {
                    order_keys16(sum)
                };
                let above = _mm512_mask_cmpgt_epu32_mask($valid, key, hi_v);
                let inside = _mm512_mask_cmple_epu32_mask($valid, _mm512_sub_epi32(key, lo_v), w_v);
                let packed = _mm512_maskz_compress_epi32(inside, key);
                push16(&mut band, packed, inside.count_ones() as usize);
                n_above += above.count_ones() as usize;
                masks[$j] = u32::from(above) | u32::from(inside) << 16;
            }};
        }
        // With every table entry finite no sum is NaN (a finite sum may round to an infinity,
        // never to NaN), and the NaN test is skipped.
        let finite = rows.iter().flatten().all(|x| x.is_finite());
        let mut cs = codes.chunks_exact(32);
        if finite {
            for (j, c) in (&mut cs).enumerate() {
                // SAFETY: `c` is 32 u16 = 64 bytes (lane j: code(j,0) | code(j,1) << 16).
                block!(
                    unsafe { _mm512_loadu_si512(c.as_ptr().cast()) },
                    j,
                    0xFFFF,
                    true
                );
            }
        } else {
            for (j, c) in (&mut cs).enumerate() {
                // SAFETY: as above.
                block!(
                    unsafe { _mm512_loadu_si512(c.as_ptr().cast()) },
                    j,
                    0xFFFF,
                    false
                );
            }
        }
        let rem = cs.remainder();
        if !rem.is_empty() {
            let mut pad = [0u16; 32];
            pad[..rem.len()].copy_from_slice(rem);
            // SAFETY: `pad` is 32 u16 = 64 bytes; the padding lanes are masked out.
            let v = unsafe { _mm512_loadu_si512(pad.as_ptr().cast()) };
            block!(v, blocks - 1, ((1u32 << (rem.len() / 2)) - 1) as u16, false);
        }
        // 3. The k-th key within the band.
        let n_band = band.len();
        if n_above >= k || n_above + n_band < k {
            return false;
        }
        let (tau, mut ties) = super::kth_key(&band[..n_band], k - n_above, Some((lo, hi)));
        // Taken bits of the band keys, 16 per little-endian word, in band order; 8 spare zero
        // bytes so that pass two can read 8 bytes from any word.
        let mut taken = vec![0u8; 2 * n_band.div_ceil(16) + 8];
        let tau_v = _mm512_set1_epi32(tau as i32);
        for (word, c) in taken.chunks_exact_mut(2).zip(band.chunks(16)) {
            let valid = ((1u32 << c.len()) - 1) as u16;
            // SAFETY: only the `c.len()` live lanes are read, all inside `c`.
            let v = unsafe { _mm512_maskz_loadu_epi32(valid, c.as_ptr().cast()) };
            let mut take = _mm512_mask_cmpgt_epu32_mask(valid, v, tau_v);
            let mut eq = _mm512_mask_cmpeq_epu32_mask(valid, v, tau_v);
            // The first `ties` keys equal to tau, in index order.
            while eq != 0 && ties > 0 {
                let low = eq & eq.wrapping_neg();
                take |= low;
                eq &= !low;
                ties -= 1;
            }
            word.copy_from_slice(&take.to_le_bytes());
        }
        // 4. Pass two: `k` indices in all; 16 spare slots for the last full-width store.
        out.reserve(k + 16);
        let mut idx = _mm512_add_epi32(
            _mm512_set1_epi32(base as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let step = _mm512_set1_epi32(16);
        let mut cursor = 0usize;
        for &mask in &masks {
            let inside = mask >> 16;
            let at = 2 * (cursor / 16);
            let window = taken[at..].first_chunk::<8>().copied().unwrap_or_default();
            let bits = (u64::from_le_bytes(window) >> (cursor % 16)) as u32;
            cursor += inside.count_ones() as usize;
            let take = (mask & 0xFFFF) | _pdep_u32(bits, inside);
            let packed = _mm512_maskz_compress_epi32(take as u16, idx);
            // Only taken tokens advance the length, k of them in all: 16 spare slots remain.
            push16(out, packed, take.count_ones() as usize);
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
    /// portable scan, with NaN, infinities, signed zeros and ties in the table; it runs (does
    /// not miss its bracket) on most inputs.
    #[test]
    fn two_pass_kernel_equals_portable_top_k() {
        let mut x = Xs(0x5EED);
        let (mut ran, mut tried) = (0usize, 0usize);
        for b in [1u8, 5, 6] {
            let kk = 1usize << b;
            for t in [512usize, 513, 700, 1000, 2048, 3001] {
                let table = ScoreTable {
                    m: 2,
                    b,
                    values: (0..2 * kk).map(|_| x.score()).collect(),
                };
                let codes: Vec<u16> = (0..2 * t).map(|_| (x.next() % kk as u64) as u16).collect();
                let mut s = vec![0.0f32; t];
                scan_portable(&codes, &table, &mut s);
                for k in [1usize, 2, 37, t / 10, t / 5, t / 2, t - 1] {
                    let mut want = vec![9u32];
                    take_best_portable(&s, 5, k, &mut want);
                    let mut got = vec![9u32];
                    tried += 1;
                    if take_best_codes(&codes, &table, 5, k, &mut got) {
                        ran += 1;
                        assert_eq!(got, want, "b {b} t {t} k {k}");
                    } else {
                        assert_eq!(got, [9]);
                    }
                }
            }
        }
        #[cfg(all(feature = "std", target_arch = "x86_64"))]
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("bmi2") {
            assert!(ran * 2 > tried, "the kernel ran on {ran} of {tried} inputs");
        }
        let _ = (ran, tried);
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
