//! HKVD token selection for CacheBlend (paper §4.3): which tokens of reused chunk caches to
//! recompute, layer by layer, with gradual filtering (figure 9).
//!
//! The first check recomputes every reused token and keeps the `first_ratio` share whose K/V
//! deviate most from the reused ones (High KV Deviation); each later layer recomputes only the
//! tokens kept by the layer before, measures their deviation again and keeps the most deviating
//! of them, the share narrowing linearly from `first_ratio` to `ratio` over `narrow_layers`
//! checks and staying at `ratio` after. [`Filter`] holds that state; the runner computes the
//! deviations ([`deviations`]) from the K/V it recomputed. (A model's first-layer K/V depend on
//! each token alone, so the runner recomputes that layer in full and checks from the second.)
//!
//! ```
//! use codec_core::blend::{Filter, Norm, SelectParams, Tensors};
//!
//! let p = SelectParams { ratio: 0.25, first_ratio: 0.5, narrow_layers: 1, tensors: Tensors::K, norm: Norm::L2 };
//! let mut f = Filter::new(p, 8)?;
//! assert_eq!(f.candidates(), &[0, 1, 2, 3, 4, 5, 6, 7]); // the first layer checks all
//! f.narrow(&[0.1, 0.9, 0.3, 0.8, 0.0, 0.7, 0.2, 0.4])?;
//! assert_eq!(f.candidates(), &[1, 3, 5, 7]);               // the top half, in token order
//! f.narrow(&[0.5, 0.1, 0.6, 0.2])?;
//! assert_eq!(f.candidates(), &[1, 5]);                     // then the top quarter of all
//! # Ok::<(), codec_core::blend::BlendError>(())
//! ```

use core::fmt;

use alloc::vec::Vec;

pub mod plan;

/// Which recomputed tensor the deviation is measured on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tensors {
    /// Keys only (as LMCache's implementation).
    K,
    /// Values only (as the paper's public code).
    V,
    /// Keys and values together.
    KV,
}

/// How a token's deviation row (reused minus recomputed, over its heads and channels) is
/// reduced to one number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// Sum of absolute differences.
    L1,
    /// Euclidean norm.
    L2,
    /// Largest absolute difference.
    Max,
}

/// How many tokens are checked and kept at each layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectParams {
    /// Share of the reused tokens recomputed per layer once the filtering has narrowed
    /// (`r`, 0 to 1).
    pub ratio: f32,
    /// Share kept by the first layer's check (`r1`, `ratio` to 1).
    pub first_ratio: f32,
    /// Checks after the first over which the share narrows linearly from `first_ratio` to
    /// `ratio` (0: straight to `ratio` at the second check).
    pub narrow_layers: u32,
    /// The tensor the deviation is measured on.
    pub tensors: Tensors,
    /// The norm of a token's deviation.
    pub norm: Norm,
}

impl SelectParams {
    /// The paper's 15% of the tokens, 20% kept by the first check and narrowed to 15% over 4
    /// layers, deviations of K and V together in L2. Chosen with `kvc blend-eval` on the
    /// reference model (README, "CacheBlend"): at 15% on six chunk sets, K and V together
    /// removed more of full reuse's KL than K alone (0.5 points) or V alone (2.5 points), L1
    /// and L2 were within 0.4 points of each other and ahead of the maximum, and the first
    /// share (15-30%) and narrowing (0-8 layers) moved it by about one point, where a single
    /// check layer lost 1.3 points. L2 because a stored chunk's coding error can be taken out
    /// of it ([`less_coding_error`]).
    pub const DEFAULT: SelectParams = SelectParams {
        ratio: 0.15,
        first_ratio: 0.2,
        narrow_layers: 4,
        tensors: Tensors::KV,
        norm: Norm::L2,
    };

    /// The same schedule narrowing to `ratio` instead: `first_ratio` scaled by the same factor
    /// (at most 1, at least `ratio`; equal to `ratio` if this one's `ratio` is 0).
    pub fn at_ratio(&self, ratio: f32) -> SelectParams {
        let factor = if self.ratio > 0.0 {
            self.first_ratio / self.ratio
        } else {
            1.0
        };
        SelectParams {
            ratio,
            first_ratio: (ratio * factor).min(1.0).max(ratio),
            ..*self
        }
    }

    /// Checks the shares: finite, `0 <= ratio <= first_ratio <= 1`.
    pub fn check(&self) -> Result<(), BlendError> {
        let ok = |x: f32| x.is_finite() && (0.0..=1.0).contains(&x);
        if !ok(self.ratio) || !ok(self.first_ratio) || self.first_ratio < self.ratio {
            return Err(BlendError::Ratios {
                ratio: self.ratio,
                first_ratio: self.first_ratio,
            });
        }
        Ok(())
    }

    /// The tokens kept by check `i` (0 is the first layer's) out of `tokens`: the share of
    /// `tokens`, rounded up, so that a positive share keeps at least one token.
    pub fn kept(&self, i: u32, tokens: usize) -> usize {
        let share = if i >= self.narrow_layers {
            self.ratio
        } else {
            let step = i as f32 / self.narrow_layers as f32;
            self.first_ratio + (self.ratio - self.first_ratio) * step
        };
        let n = libm::ceilf(share * tokens as f32) as usize;
        n.min(tokens)
    }
}

impl Default for SelectParams {
    fn default() -> Self {
        SelectParams::DEFAULT
    }
}

/// Why a selection step was refused.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum BlendError {
    /// The shares are not `0 <= ratio <= first_ratio <= 1`.
    Ratios {
        /// The final share.
        ratio: f32,
        /// The first layer's share.
        first_ratio: f32,
    },
    /// A slice does not have the length its counterpart implies.
    Length {
        /// What was measured.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length expected.
        expected: usize,
    },
    /// A deviation is NaN.
    NotANumber {
        /// Its index among the candidates.
        at: usize,
    },
    /// The loading controller's input is out of range.
    Plan {
        /// What is wrong.
        reason: &'static str,
    },
}

impl fmt::Display for BlendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlendError::Ratios { ratio, first_ratio } => write!(
                f,
                "recompute ratio {ratio} and first-layer ratio {first_ratio}: need \
                 0 <= ratio <= first ratio <= 1"
            ),
            BlendError::Length {
                what,
                got,
                expected,
            } => write!(f, "{what} has {got} values, expected {expected}"),
            BlendError::NotANumber { at } => write!(f, "the deviation of candidate {at} is NaN"),
            BlendError::Plan { reason } => write!(f, "loading controller: {reason}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for BlendError {}

/// Per token, the deviation between reused and recomputed rows: `k` and `v` are
/// `(reused, recomputed)` pairs of `[n, row]` values (the one `tensors` leaves out may be empty).
/// With both, L1 adds the two, L2 takes the norm of both rows together, Max the larger.
pub fn deviations(
    tensors: Tensors,
    norm: Norm,
    row: usize,
    k: (&[f32], &[f32]),
    v: (&[f32], &[f32]),
) -> Result<Vec<f32>, BlendError> {
    let used: &[(&[f32], &[f32])] = match tensors {
        Tensors::K => &[k],
        Tensors::V => &[v],
        Tensors::KV => &[k, v],
    };
    let n = used[0].0.len() / row.max(1);
    for (a, b) in used {
        for (what, x) in [("reused rows", a), ("recomputed rows", b)] {
            if x.len() != n * row {
                return Err(BlendError::Length {
                    what,
                    got: x.len(),
                    expected: n * row,
                });
            }
        }
    }
    let mut acc = alloc::vec![0.0f64; n];
    for (a, b) in used {
        for ((d, ra), rb) in acc
            .iter_mut()
            .zip(a.chunks_exact(row))
            .zip(b.chunks_exact(row))
        {
            let diffs = ra.iter().zip(rb).map(|(&x, &y)| f64::from(x - y).abs());
            *d = match norm {
                Norm::L1 => *d + diffs.sum::<f64>(),
                Norm::L2 => *d + diffs.map(|e| e * e).sum::<f64>(),
                Norm::Max => diffs.fold(*d, f64::max),
            };
        }
    }
    Ok(acc
        .into_iter()
        .map(|d| match norm {
            Norm::L2 => libm::sqrt(d) as f32,
            _ => d as f32,
        })
        .collect())
}

/// L2 deviations `dev` (one per candidate) with the expected squared error their reused rows
/// carry from coding taken out (`noise`, one per candidate: the [`CodingError`] of the
/// compared heads and tensors, summed): `sqrt(max(0, dev^2 - noise))`. A coded token's measured
/// deviation is its true one plus its coding error, independent of it, so the squares add in
/// expectation; without this, the tokens a stream coded coarsely (on purpose: few queries read
/// them) pass for deviating ones.
///
/// [`CodingError`]: crate::CodingError
pub fn less_coding_error(dev: &mut [f32], noise: &[f32]) -> Result<(), BlendError> {
    if noise.len() != dev.len() {
        return Err(BlendError::Length {
            what: "coding errors",
            got: noise.len(),
            expected: dev.len(),
        });
    }
    for (d, &n) in dev.iter_mut().zip(noise) {
        let rest = f64::from(*d) * f64::from(*d) - f64::from(n);
        *d = libm::sqrt(rest.max(0.0)) as f32;
    }
    Ok(())
}

/// The `n` of `candidates` with the largest deviation `dev` (one per candidate; ties go to the
/// earlier candidate), in ascending token order.
pub fn top(candidates: &[u32], dev: &[f32], n: usize) -> Result<Vec<u32>, BlendError> {
    if dev.len() != candidates.len() {
        return Err(BlendError::Length {
            what: "deviations",
            got: dev.len(),
            expected: candidates.len(),
        });
    }
    if let Some(at) = dev.iter().position(|d| d.is_nan()) {
        return Err(BlendError::NotANumber { at });
    }
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    // Largest first; equal deviations keep candidate order (a stable sort).
    order.sort_by(|&a, &b| dev[b].total_cmp(&dev[a]));
    let mut kept: Vec<u32> = order.iter().take(n).map(|&i| candidates[i]).collect();
    kept.sort_unstable();
    Ok(kept)
}

/// Gradual filtering across layers: the tokens to recompute at the current layer, narrowed by
/// each layer's deviations.
#[derive(Clone, Debug, PartialEq)]
pub struct Filter {
    params: SelectParams,
    tokens: usize,
    checks: u32,
    candidates: Vec<u32>,
}

impl Filter {
    /// Selection among `tokens` reused tokens; the first layer checks them all.
    pub fn new(params: SelectParams, tokens: u32) -> Result<Filter, BlendError> {
        params.check()?;
        Ok(Filter {
            params,
            tokens: tokens as usize,
            checks: 0,
            candidates: (0..tokens).collect(),
        })
    }

    /// The tokens to recompute at the current layer, ascending.
    pub fn candidates(&self) -> &[u32] {
        &self.candidates
    }

    /// The selection's parameters.
    pub fn params(&self) -> &SelectParams {
        &self.params
    }

    /// Narrows the candidates by their deviations at the current layer (`dev[i]` belongs to
    /// `candidates()[i]`) and moves to the next layer.
    pub fn narrow(&mut self, dev: &[f32]) -> Result<(), BlendError> {
        let n = self.params.kept(self.checks, self.tokens);
        self.candidates = top(&self.candidates, dev, n)?;
        self.checks = self.checks.saturating_add(1);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
