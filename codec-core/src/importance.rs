//! Token importance: coarser steps for the tokens future queries will barely read.
//!
//! This is encoder policy, not format: the format only carries, per block, one *step exponent*
//! `e` per `(token, KV head)` (`spec/FORMAT.md`, "Step exponents"), and the decoder multiplies
//! that token's steps by `2^(e/2)` ([`crate::consts::EXP_MULT`]). How the encoder picks `e` can
//! change without a format change.
//!
//! Why: the attention output is `sum_t a_t v_t`, so an error in token `t`'s V (and, through the
//! softmax, in its K) reaches the output scaled by the attention `a_t` it receives. On real caches
//! `a_t` is very uneven: a few percent of the tokens take most of the attention mass, and which
//! ones is largely a property of the key, not of the query: `log a_t` tracks the score of `k_t`
//! against the model's *mean* query (rotated to where the queries will be, after the cache).
//! Measured on SmolLM2 (`smollm2-gpl3-2048`, mean query learned from another text), giving
//! tokens whose score is below the chunk's 90th percentile a step `2^(slope (tau - s) / 2)` times
//! coarser cut the bits at attention error 0.10 from 3.26 to 2.12 per element (numpy, ideal
//! entropy).
//!
//! The policy, per chunk, `(layer, KV head)`:
//! - `q` = the profile's mean pre-rotary query of the head's query group, rotated to the absolute
//!   position `query_position` (the first position after the stream, by default);
//! - the score of token `t` is `s_t = q . k_t / sqrt(head_dim)` (with `k_t` rotated to its
//!   position if the cache stores K before the rotary embedding);
//! - `tau` = a per-`(layer, head)` threshold stored in the profile: the `quantile` of the scores
//!   of the profile's sample tokens (scored against queries after each sample). It is a constant
//!   rather than a per-chunk statistic so that a token's exponent depends only on the token and
//!   the query position, not on how the stream is cut into chunks (a per-chunk quantile cost
//!   0.23 bits per element on `smollm2-gpl3-2048`: the old chunk's threshold drops with its
//!   scores, and its tokens stay fine);
//! - `e_t = clamp(round(slope * (tau - s_t)), 0, max_exp)`.
//!
//! All of it is f64 arithmetic with `libm` in a fixed order, so it is deterministic everywhere.

use crate::consts::MAX_EXP;
use crate::kv::Rope;
use crate::rope::{pair_rotations, rotate_by};
use alloc::vec::Vec;

/// Parameters of the token-importance policy; stored in a profile, since the profile's steps are
/// calibrated with the policy on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImportanceParams {
    /// Exponent units (half-octaves of step) per unit of score below `tau`.
    pub slope: f32,
    /// Quantile of the sample tokens' scores that sets each head's threshold `tau` when a profile
    /// is learned (tokens scoring above it keep the base step).
    pub quantile: f32,
    /// Largest exponent used (at most [`MAX_EXP`]).
    pub max_exp: u8,
}

impl Default for ImportanceParams {
    fn default() -> Self {
        ImportanceParams {
            slope: 1.0,
            quantile: 0.95,
            max_exp: 6,
        }
    }
}

impl ImportanceParams {
    /// `true` if the parameters are usable (finite slope >= 0, quantile in [0, 1],
    /// max_exp <= [`MAX_EXP`]).
    pub fn is_valid(&self) -> bool {
        self.slope.is_finite()
            && self.slope >= 0.0
            && self.quantile.is_finite()
            && (0.0..=1.0).contains(&self.quantile)
            && self.max_exp <= MAX_EXP
    }
}

/// The reference queries of one layer: the mean pre-rotary queries `query_mean` (`heads * d`)
/// rotated to absolute position `position`. Several layers' means side by side give theirs
/// side by side (the rotations are computed once for all heads).
pub fn reference_queries(query_mean: &[f32], d: usize, position: u64, rope: &Rope) -> Vec<f64> {
    let mut out: Vec<f64> = query_mean.iter().map(|&x| x as f64).collect();
    let rotations = pair_rotations(rope, d, position as f64);
    for h in out.chunks_exact_mut(d) {
        rotate_by(h, rope.style, &rotations);
    }
    out
}

/// Appends the step exponents of one block to `out`: for each non-sink row of `k` (`rows * C`
/// values, row 0 at absolute position `first_position`), one exponent per head, row-major.
/// `qref` comes from [`reference_queries`]; `tau` holds one threshold per head; `rope` is used to
/// rotate K rows when the cache stores K before the rotary embedding (`rope.k_pre_rope`).
#[allow(clippy::too_many_arguments)]
pub fn block_exponents(
    k: &[f32],
    c: usize,
    d: usize,
    sink: usize,
    first_position: u64,
    qref: &[f64],
    tau: &[f32],
    rope: &Rope,
    params: &ImportanceParams,
    out: &mut Vec<u8>,
) {
    let heads = c / d;
    let rows = k.len() / c;
    let n = rows.saturating_sub(sink);
    let base = out.len();
    out.resize(base + n * heads, 0);
    if n == 0 || params.slope == 0.0 || params.max_exp == 0 {
        return;
    }
    let mut scores = alloc::vec![0f64; n * heads];
    block_scores(k, c, d, sink, first_position, qref, rope, &mut scores);
    for (i, s) in scores.iter().enumerate() {
        let e = libm::round(params.slope as f64 * (tau[i % heads] as f64 - s));
        out[base + i] = e.clamp(0.0, params.max_exp as f64) as u8;
    }
}

/// Scores `q . k_t / sqrt(d)` of the non-sink rows of `k` against `qref`, row-major by head, into
/// `scores` (`(rows - sink) * heads` values).
#[allow(clippy::too_many_arguments)]
pub fn block_scores(
    k: &[f32],
    c: usize,
    d: usize,
    sink: usize,
    first_position: u64,
    qref: &[f64],
    rope: &Rope,
    scores: &mut [f64],
) {
    let heads = c / d;
    let inv = 1.0 / libm::sqrt(d as f64);
    let mut kr = alloc::vec![0f64; d];
    for (i, row) in k.chunks_exact(c).skip(sink).enumerate() {
        // The row's rotations, computed once for its heads.
        let rotations = if rope.k_pre_rope {
            let pos = first_position.saturating_add((sink + i) as u64) as f64;
            pair_rotations(rope, d, pos)
        } else {
            Vec::new()
        };
        for h in 0..heads {
            for (dst, &src) in kr.iter_mut().zip(&row[h * d..(h + 1) * d]) {
                *dst = src as f64;
            }
            rotate_by(&mut kr, rope.style, &rotations);
            let q = &qref[h * d..(h + 1) * d];
            let mut acc = 0f64;
            for (a, b) in q.iter().zip(&kr) {
                acc += a * b;
            }
            scores[i * heads + h] = acc * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::RopeStyle;
    use crate::rope::rotate;
    use alloc::vec;

    #[test]
    fn reference_queries_of_layers_side_by_side_are_each_layers() {
        let rope = Rope {
            theta: 10000.0,
            style: RopeStyle::NeoX,
            scaling: 1.0,
            k_pre_rope: false,
        };
        let means: Vec<f32> = (0..3 * 2 * 8).map(|i| (i as f32 * 0.37).cos()).collect();
        let all = reference_queries(&means, 8, 777, &rope);
        let each: Vec<f64> = means
            .chunks(16)
            .flat_map(|m| reference_queries(m, 8, 777, &rope))
            .collect();
        assert_eq!(all, each);
        let unturned: Vec<f64> = means.iter().map(|&x| x as f64).collect();
        assert_ne!(all, unturned, "position 777 turns the queries");
    }

    #[test]
    fn rotation_round_trips_and_preserves_norm() {
        let rope = Rope {
            theta: 100000.0,
            style: RopeStyle::NeoX,
            scaling: 1.0,
            k_pre_rope: false,
        };
        let v0: Vec<f64> = (0..64).map(|i| libm::sin(i as f64 * 0.7)).collect();
        let mut v = v0.clone();
        rotate(&mut v, 1234.0, &rope);
        let n0: f64 = v0.iter().map(|x| x * x).sum();
        let n1: f64 = v.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-9);
        assert!(v.iter().zip(&v0).any(|(a, b)| (a - b).abs() > 1e-3));
        rotate(&mut v, -1234.0, &rope);
        for (a, b) in v.iter().zip(&v0) {
            assert!((a - b).abs() < 1e-9);
        }
    }

    #[test]
    fn low_scores_get_coarser_exponents() {
        // One head of 2 channels, query (1, 0): score = k0 / sqrt(2).
        let rope = Rope::default();
        let rows = 11;
        let k: Vec<f32> = (0..rows).flat_map(|i| [i as f32, 0.0]).collect();
        let p = ImportanceParams {
            slope: 1.0,
            quantile: 1.0,
            max_exp: 4,
        };
        let mut out = vec![];
        let tau = [10.0 / core::f32::consts::SQRT_2];
        block_exponents(&k, 2, 2, 1, 0, &[1.0, 0.0], &tau, &rope, &p, &mut out);
        assert_eq!(out.len(), rows - 1);
        // Highest score keeps exponent 0; exponents never increase with the score.
        assert_eq!(*out.last().unwrap(), 0);
        assert!(out.windows(2).all(|w| w[0] >= w[1]));
        assert_eq!(out[0], 4);
        let off = ImportanceParams { slope: 0.0, ..p };
        let mut z = vec![];
        block_exponents(&k, 2, 2, 1, 0, &[1.0, 0.0], &tau, &rope, &off, &mut z);
        assert!(z.iter().all(|&e| e == 0));
    }
}
