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
use crate::simd::dot;

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
    let cents = codebook.centroids();
    let mut values = vec![0.0f32; m * k];
    for q in queries.chunks_exact(d) {
        for j in 0..m {
            let qj = &q[codebook.book_range(j)];
            let row = &mut values[j * k..(j + 1) * k];
            let cj = &cents[j * k * bd..(j + 1) * k * bd];
            for (v, c) in row.iter_mut().zip(cj.chunks_exact(bd)) {
                *v += dot(qj, c);
            }
        }
    }
    Ok(ScoreTable {
        m,
        b: codebook.bits(),
        values,
    })
}

/// Approximate scores of `T` tokens from their codes (flat `[T, m]`, token-major).
/// Errors if the length is not a multiple of `m` or a code is `>= 2^b`.
pub fn scores(codes: &[u16], table: &ScoreTable) -> Result<Vec<f32>, PqError> {
    let m = table.m;
    if codes.len() % m != 0 {
        return Err(PqError::LengthNotMultiple {
            len: codes.len(),
            dim: m,
        });
    }
    let k = 1usize << table.b;
    let max = (k - 1) as u16;
    if let Some(index) = codes.iter().position(|&c| c > max) {
        return Err(PqError::CodeOutOfRange {
            index,
            code: codes[index],
            max,
        });
    }
    let v = &table.values;
    // Codes are checked above; the scan itself is branch-free.
    let out = match m {
        1 => codes.iter().map(|&c| 0.0 + v[usize::from(c)]).collect(),
        2 => {
            let (r0, r1) = v.split_at(k);
            codes
                .chunks_exact(2)
                .map(|p| (0.0 + r0[usize::from(p[0])]) + r1[usize::from(p[1])])
                .collect()
        }
        _ => codes
            .chunks_exact(m)
            .map(|tok| {
                let mut s = 0.0f32;
                for (row, &c) in v.chunks_exact(k).zip(tok) {
                    s += row[usize::from(c)];
                }
                s
            })
            .collect(),
    };
    Ok(out)
}

/// The ranking order of [`select`]: higher score first, NaN ranked as `-inf`, `-0.0` below `+0.0`
/// (IEEE total order), then lower index first. A total order, so the selection is unique.
fn rank(scores: &[f32], a: u32, b: u32) -> Ordering {
    let key = |i: u32| {
        let s = scores[i as usize];
        if s.is_nan() {
            f32::NEG_INFINITY
        } else {
            s
        }
    };
    key(b).total_cmp(&key(a)).then(a.cmp(&b))
}

/// Token indices to attend to, sorted ascending and without duplicates: every index in
/// `0..min(n_init, T)` and in `T - min(n_local, T)..T`, plus the `k` best of the remaining tokens
/// (all of them if fewer than `k` remain) by the order of score descending, ties to the lower
/// index, NaN ranked lowest. `T = scores.len()` must fit in `u32`.
pub fn select(
    scores: &[f32],
    k: usize,
    n_init: usize,
    n_local: usize,
) -> Result<Vec<u32>, PqError> {
    let t = scores.len();
    let t32 = u32::try_from(t).map_err(|_| PqError::TooLarge)?;
    let init_end = n_init.min(t) as u32;
    let local_start = (t - n_local.min(t)) as u32;
    let mut rest: Vec<u32> = (init_end..local_start.max(init_end)).collect();
    let k = k.min(rest.len());
    if k < rest.len() && k > 0 {
        rest.select_nth_unstable_by(k - 1, |&a, &b| rank(scores, a, b));
    }
    rest.truncate(k);
    let mut out: Vec<u32> = (0..init_end).collect();
    out.extend_from_slice(&rest);
    out.extend(local_start.max(init_end)..t32);
    out.sort_unstable();
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
