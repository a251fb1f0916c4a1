//! Per-(layer, KV head) product-quantization codebooks.
//!
//! A key of `dim` values is split into `m` sub-spaces; sub-space `j` covers dims
//! `[j * dim/m, (j+1) * dim/m)`. Each sub-space has `2^b` centroids, and a key's code in sub-space
//! `j` is the index of the nearest centroid (squared L2, ties to the lower index). Codes of `T` keys
//! are a flat `[T, m]` buffer of `u16`, token-major.
use alloc::vec::Vec;

use crate::error::PqError;
use crate::kmeans::{kmeans, KMeansParams};
use crate::simd::sq_l2;

/// The largest bits per code a codebook accepts (4096 centroids per sub-space).
pub const MAX_CODEBOOK_BITS: u8 = 12;

/// Training parameters. [`Default`] is the PQCache default: `m = 2`, `b = 6`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqParams {
    /// Number of sub-spaces; must divide the key dimension.
    pub m: usize,
    /// Bits per code, `1..=MAX_CODEBOOK_BITS`; each sub-space has `2^b` centroids.
    pub b: u8,
    /// Cap on Lloyd iterations per sub-space (PQCache caps them to hide clustering under prefill).
    pub max_iters: u32,
    /// Base seed. Sub-space `j` is clustered with seed
    /// `seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)`; callers give each (layer, head)
    /// its own `seed` if they want independent draws.
    pub seed: u64,
}

impl Default for PqParams {
    fn default() -> Self {
        Self {
            m: 2,
            b: 6,
            max_iters: 16,
            seed: 0,
        }
    }
}

/// The seed that sub-space `j` is clustered with (see [`PqParams::seed`]).
pub fn subspace_seed(seed: u64, j: usize) -> u64 {
    seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The centroids of one (layer, KV head).
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    dim: usize,
    m: usize,
    b: u8,
    /// `[m, 2^b, dim/m]` row-major: centroid `c` of sub-space `j` starts at
    /// `(j * 2^b + c) * dim/m`.
    centroids: Vec<f32>,
}

fn check_shape(dim: usize, m: usize, b: u8) -> Result<(), PqError> {
    if dim == 0 {
        return Err(PqError::ZeroDim);
    }
    if m == 0 {
        return Err(PqError::ZeroSubspaces);
    }
    if dim % m != 0 {
        return Err(PqError::DimNotDivisible { dim, m });
    }
    if b == 0 || b > MAX_CODEBOOK_BITS {
        return Err(PqError::BitsOutOfRange {
            b,
            max: MAX_CODEBOOK_BITS,
        });
    }
    Ok(())
}

/// Checks that `x` is a flat `[n, dim]` buffer and returns `n`.
pub(crate) fn rows(x: &[f32], dim: usize) -> Result<usize, PqError> {
    if x.len() % dim != 0 {
        return Err(PqError::LengthNotMultiple { len: x.len(), dim });
    }
    Ok(x.len() / dim)
}

impl Codebook {
    /// Trains a codebook on `keys`, a flat `[T, dim]` buffer (`T >= 1`, finite values), by
    /// running [`kmeans`] with `k = 2^b` on each sub-space.
    pub fn train(keys: &[f32], dim: usize, params: &PqParams) -> Result<Self, PqError> {
        check_shape(dim, params.m, params.b)?;
        let t = rows(keys, dim)?;
        if t == 0 {
            return Err(PqError::Empty);
        }
        if let Some(index) = keys.iter().position(|v| !v.is_finite()) {
            return Err(PqError::NonFinite { index });
        }
        let (m, sd, k) = (params.m, dim / params.m, 1usize << params.b);
        let total = m
            .checked_mul(k)
            .and_then(|x| x.checked_mul(sd))
            .ok_or(PqError::TooLarge)?;
        let mut centroids = Vec::with_capacity(total);
        let mut sub = Vec::with_capacity(t * sd);
        for j in 0..m {
            sub.clear();
            for key in keys.chunks_exact(dim) {
                sub.extend_from_slice(&key[j * sd..(j + 1) * sd]);
            }
            let kp = KMeansParams {
                k,
                max_iters: params.max_iters,
                seed: subspace_seed(params.seed, j),
            };
            let r = kmeans(&sub, sd, &kp)?;
            centroids.extend_from_slice(&r.centroids);
        }
        Ok(Self {
            dim,
            m,
            b: params.b,
            centroids,
        })
    }

    /// Builds a codebook from stored centroids (`[m, 2^b, dim/m]` row-major, finite).
    pub fn from_parts(dim: usize, m: usize, b: u8, centroids: Vec<f32>) -> Result<Self, PqError> {
        check_shape(dim, m, b)?;
        let expected = (1usize << b).checked_mul(dim).ok_or(PqError::TooLarge)?;
        if centroids.len() != expected {
            return Err(PqError::LengthMismatch {
                got: centroids.len(),
                expected,
            });
        }
        if let Some(index) = centroids.iter().position(|v| !v.is_finite()) {
            return Err(PqError::NonFinite { index });
        }
        Ok(Self {
            dim,
            m,
            b,
            centroids,
        })
    }

    /// Key dimension `D`.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// Number of sub-spaces `m`.
    pub fn m(&self) -> usize {
        self.m
    }
    /// Bits per code `b`.
    pub fn bits(&self) -> u8 {
        self.b
    }
    /// Centroids per sub-space, `2^b`.
    pub fn n_centroids(&self) -> usize {
        1 << self.b
    }
    /// Dims per sub-space, `D / m`.
    pub fn sub_dim(&self) -> usize {
        self.dim / self.m
    }
    /// All centroids, `[m, 2^b, D/m]` row-major.
    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }
    /// Centroid `c` of sub-space `j`, or `None` if out of range.
    pub fn centroid(&self, j: usize, c: usize) -> Option<&[f32]> {
        if j >= self.m || c >= self.n_centroids() {
            return None;
        }
        let sd = self.sub_dim();
        let at = (j * self.n_centroids() + c) * sd;
        Some(&self.centroids[at..at + sd])
    }

    /// Codes of `keys` (flat `[T, dim]`): a flat `[T, m]` buffer, token-major, each code the
    /// nearest centroid of its sub-space (ties to the lower index). Used both after training and
    /// for new tokens. Non-finite keys are rejected.
    pub fn encode(&self, keys: &[f32]) -> Result<Vec<u16>, PqError> {
        let t = rows(keys, self.dim)?;
        if let Some(index) = keys.iter().position(|v| !v.is_finite()) {
            return Err(PqError::NonFinite { index });
        }
        let (sd, k) = (self.sub_dim(), self.n_centroids());
        let mut codes = Vec::with_capacity(t * self.m);
        for key in keys.chunks_exact(self.dim) {
            for (j, x) in key.chunks_exact(sd).enumerate() {
                let table = &self.centroids[j * k * sd..(j + 1) * k * sd];
                let mut best = 0usize;
                let mut best_d = f32::INFINITY;
                for (c, cen) in table.chunks_exact(sd).enumerate() {
                    let d = sq_l2(x, cen);
                    if d < best_d {
                        best = c;
                        best_d = d;
                    }
                }
                codes.push(best as u16);
            }
        }
        Ok(codes)
    }

    /// Reconstructs keys from codes (flat `[T, m]`): a flat `[T, dim]` buffer of centroids.
    pub fn decode(&self, codes: &[u16]) -> Result<Vec<f32>, PqError> {
        self.check_codes(codes)?;
        let (sd, k) = (self.sub_dim(), self.n_centroids());
        let mut out = Vec::with_capacity(codes.len() / self.m * self.dim);
        for tok in codes.chunks_exact(self.m) {
            for (j, &c) in tok.iter().enumerate() {
                let at = (j * k + usize::from(c)) * sd;
                out.extend_from_slice(&self.centroids[at..at + sd]);
            }
        }
        Ok(out)
    }

    /// Checks that `codes` is a flat `[T, m]` buffer of codes below `2^b`.
    pub(crate) fn check_codes(&self, codes: &[u16]) -> Result<(), PqError> {
        if codes.len() % self.m != 0 {
            return Err(PqError::LengthNotMultiple {
                len: codes.len(),
                dim: self.m,
            });
        }
        let max = (self.n_centroids() - 1) as u16;
        match codes.iter().position(|&c| c > max) {
            Some(index) => Err(PqError::CodeOutOfRange {
                index,
                code: codes[index],
                max,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes() {
        let p = PqParams {
            m: 3,
            ..PqParams::default()
        };
        assert_eq!(
            Codebook::train(&[0.0; 8], 4, &p),
            Err(PqError::DimNotDivisible { dim: 4, m: 3 })
        );
        let p = PqParams {
            b: 0,
            ..PqParams::default()
        };
        assert!(matches!(
            Codebook::train(&[0.0; 8], 4, &p),
            Err(PqError::BitsOutOfRange { b: 0, .. })
        ));
        let p = PqParams::default();
        assert_eq!(Codebook::train(&[], 4, &p), Err(PqError::Empty));
        let mut keys = [0.0f32; 8];
        keys[7] = f32::INFINITY;
        assert_eq!(
            Codebook::train(&keys, 4, &p),
            Err(PqError::NonFinite { index: 7 })
        );
        let cb = Codebook::from_parts(2, 2, 1, alloc::vec![0.0; 4]).unwrap();
        assert_eq!(
            cb.decode(&[0, 2]),
            Err(PqError::CodeOutOfRange {
                index: 1,
                code: 2,
                max: 1
            })
        );
        assert!(Codebook::from_parts(2, 2, 1, alloc::vec![0.0; 3]).is_err());
    }
}
