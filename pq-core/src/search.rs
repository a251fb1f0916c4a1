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
use crate::simd::{columns, dot, Op};

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

/// [`scores`] into a caller's buffer of exactly `codes.len() / m` values (no allocation).
pub fn scores_into(codes: &[u16], table: &ScoreTable, out: &mut [f32]) -> Result<(), PqError> {
    let m = table.m;
    if codes.len() % m != 0 {
        return Err(PqError::LengthNotMultiple {
            len: codes.len(),
            dim: m,
        });
    }
    if out.len() != codes.len() / m {
        return Err(PqError::LengthMismatch {
            got: out.len(),
            expected: codes.len() / m,
        });
    }
    let k = 1usize << table.b;
    let max = (k - 1) as u16;
    if codes.iter().fold(0u16, |a, &c| a.max(c)) > max {
        let index = codes.iter().position(|&c| c > max).unwrap_or(0);
        return Err(PqError::CodeOutOfRange {
            index,
            code: codes[index],
            max,
        });
    }
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
        return Ok(());
    }
    for (o, tok) in out.iter_mut().zip(codes.chunks_exact(m)) {
        let mut s = 0.0f32;
        for (row, &c) in v.chunks_exact(k).zip(tok) {
            s += row[usize::from(c)];
        }
        *o = s;
    }
    Ok(())
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
/// A histogram of 2048 equal-width bins over `[min, max]` of the keys finds the bin holding the
/// `k`-th largest key; the few keys of that bin are then sorted. Two interleaved histograms keep
/// repeated increments of one bin from serializing.
fn threshold(keys: &[u32], k: usize) -> (u32, usize) {
    const BITS: u32 = 11;
    let (mut lo, mut hi) = (u32::MAX, 0u32);
    for &x in keys {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let span = hi - lo;
    let shift = (32 - span.leading_zeros()).saturating_sub(BITS);
    let bin = |x: u32| ((x - lo) >> shift) as usize;
    let mut hist = [[0u32; 1 << BITS]; 2];
    let mut pairs = keys.chunks_exact(2);
    for p in &mut pairs {
        hist[0][bin(p[0])] += 1;
        hist[1][bin(p[1])] += 1;
    }
    for &x in pairs.remainder() {
        hist[0][bin(x)] += 1;
    }
    // From the top bin down, the first bin at which the running count reaches k.
    let mut above = 0usize;
    let mut at = 0usize;
    for b in (0..1usize << BITS).rev() {
        let n = (hist[0][b] + hist[1][b]) as usize;
        if above + n >= k {
            at = b;
            break;
        }
        above += n;
    }
    let mut cand: Vec<u32> = keys.iter().copied().filter(|&x| bin(x) == at).collect();
    cand.sort_unstable_by(|a, b| b.cmp(a));
    let need = k - above;
    let tau = cand[need - 1];
    let ties = cand[..need].iter().filter(|&&x| x == tau).count();
    (tau, ties)
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
        let keys: Vec<u32> = rest.iter().map(|&s| order_key(s)).collect();
        let (tau, mut ties) = threshold(&keys, k);
        // Branch-free scan: every index is written, the count advances only when it is taken.
        let base = out.len();
        out.resize(base + rest.len(), 0);
        let dst = &mut out[base..];
        let mut n = 0usize;
        for (i, &key) in keys.iter().enumerate() {
            let tie = key == tau && ties > 0;
            ties -= usize::from(tie);
            dst[n] = (init_end + i) as u32;
            n += usize::from(key > tau || tie);
        }
        out.truncate(base + n);
    }
    out.extend(local_start as u32..t as u32);
    Ok(out)
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
    let sc: Vec<f32> = cand
        .iter()
        .map(|&i| dot(query, &keys[i as usize * d..(i as usize + 1) * d]))
        .collect();
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
