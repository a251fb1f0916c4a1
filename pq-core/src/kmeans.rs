//! Deterministic k-means: k-means++ seeding from a `u64` seed, then Lloyd iterations up to a
//! caller-set cap. `f32` data, squared L2 distance.
//!
//! The algorithm, exactly (so that another implementation can reproduce the centroids):
//!
//! 1. **Seeding** (k-means++, Arthur & Vassilvitskii 2007) with [SplitMix64] seeded by `seed`.
//!    The first centroid is point `below(n)`. Each next one is drawn with probability proportional
//!    to `d(x)`, the squared distance to the nearest centroid so far: `r = unit_f64() * total`
//!    (`total` the `f64` sum of `d` in point order), and the pick is the first point whose running
//!    `f64` sum exceeds `r` and whose `d` is positive. If `total == 0` (fewer distinct points than
//!    `k`) the pick is point `below(n)`. `below(n) = (next_u64() * n) >> 64`;
//!    `unit_f64() = (next_u64() >> 11) * 2^-53`.
//! 2. **Assignment**: every point goes to its nearest centroid, ties to the lower index.
//! 3. **Empty clusters**, in increasing cluster order: an empty cluster takes the point with the
//!    largest distance to its centroid (ties to the lower point index) among points whose cluster
//!    has more than one member and whose distance is positive; that point becomes the centroid. If
//!    there is no such point the cluster stays empty and keeps its centroid.
//! 4. **Iteration** (at most `max_iters` times): each non-empty cluster's centroid becomes the mean
//!    of its points (summed in `f64` in point order, divided, rounded to `f32`), *unless* that mean
//!    has a larger sum of squared distances over the cluster than the old centroid (possible only by
//!    rounding), in which case the old centroid is kept. Then points are reassigned: a point moves
//!    only to a centroid strictly nearer than its current one (the lowest such index among the
//!    nearest), and step 3 runs again. The loop stops early when no point moved.
//!
//! Distances are squared L2 in `f32`, summed in dim order from `0.0` (see the crate's `sums`
//! module); the objective is their `f64` sum in point order. Reassignment and step 3 can only lower each point's distance, and the guarded update
//! can only lower each cluster's sum, so the objective never increases (up to the rounding of the
//! `f64` sums, about 1e-16 relative).
//!
//! [SplitMix64]: https://prng.di.unimi.it/splitmix64.c
use alloc::vec;
use alloc::vec::Vec;

use crate::error::PqError;
use crate::rng::SplitMix64;
use crate::sums::{argmin_from, columns, sq_l2, sq_l2_x8, transpose, Op};

/// The largest number of clusters: codes are `u16`.
pub const MAX_K: usize = 1 << 16;
// The error messages quote the same bound without importing this module.
const _: () = assert!(MAX_K == crate::error::MAX_CLUSTERS);

/// The most centroid values (`k * dim`) one k-means run, or a whole codebook, holds: 256 MiB
/// of `f32`, 2^26 values (a residual codebook of 64 books of 4096 codewords of 256 dimensions).
/// A caller's data need not be that large: one point may ask for 65 536 clusters.
pub const MAX_CENTROID_VALUES: usize = 1 << 26;

/// Checks a count of centroid values (`None`: it overflowed) against [`MAX_CENTROID_VALUES`].
pub(crate) fn check_centroid_values(values: Option<usize>) -> Result<usize, PqError> {
    match values {
        Some(v) if v <= MAX_CENTROID_VALUES => Ok(v),
        _ => Err(PqError::TooManyCentroidValues {
            max: MAX_CENTROID_VALUES,
        }),
    }
}

/// Parameters of one k-means run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KMeansParams {
    /// Number of clusters, `1..=MAX_K`.
    pub k: usize,
    /// Cap on Lloyd iterations after seeding; 0 returns the k-means++ seeds.
    pub max_iters: u32,
    /// Seed of the k-means++ draw.
    pub seed: u64,
}

/// The result of [`kmeans`].
#[derive(Debug, Clone, PartialEq)]
pub struct KMeans {
    /// Row length of the data and of each centroid.
    pub dim: usize,
    /// Number of centroids.
    pub k: usize,
    /// `[k, dim]` row-major.
    pub centroids: Vec<f32>,
    /// For each point, the index of its cluster.
    pub assignments: Vec<u32>,
    /// Lloyd iterations run (`<= max_iters`).
    pub iterations: u32,
    /// The objective (sum of squared distances of points to their assigned centroid) after the
    /// first assignment, then after each iteration. Non-increasing; the last entry belongs to the
    /// returned centroids and assignments.
    pub objective_history: Vec<f64>,
}

/// Clusters `data` (`[n, dim]` row-major, finite values) into `params.k` clusters.
///
/// `n < k` is allowed: some centroids are then duplicates. Errors: `dim == 0`, `n == 0`, a length
/// that is not a multiple of `dim`, non-finite values, `k` out of `1..=MAX_K`, or sizes that
/// overflow.
pub fn kmeans(data: &[f32], dim: usize, params: &KMeansParams) -> Result<KMeans, PqError> {
    if dim == 0 {
        return Err(PqError::ZeroDim);
    }
    if !data.len().is_multiple_of(dim) {
        return Err(PqError::LengthNotMultiple {
            len: data.len(),
            dim,
        });
    }
    let n = data.len() / dim;
    if n == 0 {
        return Err(PqError::Empty);
    }
    if u32::try_from(n).is_err() {
        return Err(PqError::TooLarge);
    }
    let k = params.k;
    if k == 0 || k > MAX_K {
        return Err(PqError::ClustersOutOfRange { k });
    }
    check_centroid_values(k.checked_mul(dim))?;
    if let Some(index) = data.iter().position(|v| !v.is_finite()) {
        return Err(PqError::NonFinite { index });
    }
    let mut st = State::new(data, dim, k);
    st.seed(params.seed);
    st.assign_initial();
    st.fix_empty();
    let mut history = vec![st.objective()];
    let mut iterations = 0;
    while iterations < params.max_iters {
        st.update();
        let moved = st.reassign();
        let moved_empty = st.fix_empty();
        iterations += 1;
        history.push(st.objective());
        if !moved && !moved_empty {
            break;
        }
    }
    Ok(KMeans {
        dim,
        k,
        centroids: st.centroids,
        assignments: st.assign,
        iterations,
        objective_history: history,
    })
}

struct State<'a> {
    data: &'a [f32],
    dim: usize,
    n: usize,
    k: usize,
    centroids: Vec<f32>,
    assign: Vec<u32>,
    /// Squared distance of each point to its assigned centroid.
    dist: Vec<f32>,
    counts: Vec<u32>,
    /// The data transposed, `[dim, n]` (for the seeding kernel).
    data_t: Vec<f32>,
}

impl<'a> State<'a> {
    fn new(data: &'a [f32], dim: usize, k: usize) -> Self {
        let n = data.len() / dim;
        Self {
            data,
            dim,
            n,
            k,
            centroids: vec![0.0; k * dim],
            assign: vec![0; n],
            dist: vec![0.0; n],
            counts: vec![0; k],
            data_t: transpose(data, dim),
        }
    }

    fn point(&self, i: usize) -> &'a [f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }

    fn centroid(&self, c: usize) -> &[f32] {
        &self.centroids[c * self.dim..(c + 1) * self.dim]
    }

    fn set_centroid(&mut self, c: usize, v: &[f32]) {
        self.centroids[c * self.dim..(c + 1) * self.dim].copy_from_slice(v);
    }

    fn seed(&mut self, seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let first = rng.below(self.n);
        self.set_centroid(0, self.point(first));
        // d[i]: squared distance to the nearest centroid chosen so far.
        let mut d = vec![0.0f32; self.n];
        columns(Op::SqL2, self.centroid(0), &self.data_t, &mut d);
        let mut nd = vec![0.0f32; self.n];
        for c in 1..self.k {
            let total: f64 = d.iter().map(|&x| f64::from(x)).sum();
            let pick = if total > 0.0 {
                let r = rng.unit_f64() * total;
                let mut acc = 0.0f64;
                let mut pick = None;
                let mut last_positive = 0;
                for (i, &x) in d.iter().enumerate() {
                    if x > 0.0 {
                        acc += f64::from(x);
                        last_positive = i;
                        if acc > r {
                            pick = Some(i);
                            break;
                        }
                    }
                }
                // Rounding can leave r >= the running sum at the end: take the last positive.
                pick.unwrap_or(last_positive)
            } else {
                rng.below(self.n)
            };
            self.set_centroid(c, self.point(pick));
            let cen = &self.centroids[c * self.dim..(c + 1) * self.dim];
            columns(Op::SqL2, cen, &self.data_t, &mut nd);
            for (di, &x) in d.iter_mut().zip(&nd) {
                if x < *di {
                    *di = x;
                }
            }
        }
    }

    fn assign_initial(&mut self) {
        let mut dbuf = vec![0.0f32; self.k];
        let cent_t = transpose(&self.centroids, self.dim);
        for i in 0..self.n {
            columns(Op::SqL2, self.point(i), &cent_t, &mut dbuf);
            // The first strictly smallest, from centroid 0.
            let best = argmin_from(&dbuf, 0);
            self.assign[i] = best as u32;
            self.dist[i] = dbuf[best];
        }
        self.recount();
    }

    /// Moves points only to strictly nearer centroids. Returns whether any point moved.
    fn reassign(&mut self) -> bool {
        let mut moved = false;
        let mut dbuf = vec![0.0f32; self.k];
        let cent_t = transpose(&self.centroids, self.dim);
        for i in 0..self.n {
            columns(Op::SqL2, self.point(i), &cent_t, &mut dbuf);
            // The first centroid strictly nearer than the current one and nearest, else stay.
            let cur = self.assign[i] as usize;
            let best = argmin_from(&dbuf, cur);
            if best != cur {
                moved = true;
            }
            self.assign[i] = best as u32;
            self.dist[i] = dbuf[best];
        }
        self.recount();
        moved
    }

    fn recount(&mut self) {
        self.counts.iter_mut().for_each(|c| *c = 0);
        for &a in &self.assign {
            self.counts[a as usize] += 1;
        }
    }

    /// Step 3 of the module docs. Returns whether any point moved.
    fn fix_empty(&mut self) -> bool {
        let mut moved = false;
        for c in 0..self.k {
            if self.counts[c] != 0 {
                continue;
            }
            let mut far: Option<usize> = None;
            for i in 0..self.n {
                let d = self.dist[i];
                if d > 0.0
                    && self.counts[self.assign[i] as usize] > 1
                    && far.is_none_or(|f| d > self.dist[f])
                {
                    far = Some(i);
                }
            }
            if let Some(i) = far {
                self.counts[self.assign[i] as usize] -= 1;
                self.assign[i] = c as u32;
                self.counts[c] = 1;
                self.dist[i] = 0.0;
                self.set_centroid(c, self.point(i));
                moved = true;
            }
        }
        moved
    }

    /// Guarded Lloyd update: the mean replaces a centroid unless it is worse over the cluster.
    fn update(&mut self) {
        let dim = self.dim;
        let mut sums = vec![0.0f64; self.k * dim];
        for i in 0..self.n {
            let c = self.assign[i] as usize;
            for (s, &x) in sums[c * dim..(c + 1) * dim].iter_mut().zip(self.point(i)) {
                *s += f64::from(x);
            }
        }
        let mut means = vec![0.0f32; self.k * dim];
        for c in 0..self.k {
            let cnt = self.counts[c];
            let dst = &mut means[c * dim..(c + 1) * dim];
            if cnt == 0 {
                dst.copy_from_slice(&self.centroids[c * dim..(c + 1) * dim]);
            } else {
                for (m, &s) in dst.iter_mut().zip(&sums[c * dim..(c + 1) * dim]) {
                    *m = (s / f64::from(cnt)) as f32;
                }
            }
        }
        let mut old_sse = vec![0.0f64; self.k];
        let mut new_sse = vec![0.0f64; self.k];
        // Each point's distance to its mean, 8 points at a time (the same sums), then added
        // into the clusters' totals in point order.
        let mean = |i: usize| {
            let c = self.assign[i] as usize;
            &means[c * dim..(c + 1) * dim]
        };
        let mut nd = vec![0.0f32; self.n];
        let mut groups = nd.chunks_exact_mut(8);
        for (g, out) in (&mut groups).enumerate() {
            let i0 = 8 * g;
            out.copy_from_slice(&sq_l2_x8(
                core::array::from_fn(|l| self.point(i0 + l)),
                core::array::from_fn(|l| mean(i0 + l)),
            ));
        }
        let done = self.n - groups.into_remainder().len();
        for (i, d) in nd.iter_mut().enumerate().skip(done) {
            *d = sq_l2(self.point(i), mean(i));
        }
        for ((&a, &d), &e) in self.assign.iter().zip(&self.dist).zip(&nd) {
            old_sse[a as usize] += f64::from(d);
            new_sse[a as usize] += f64::from(e);
        }
        for c in 0..self.k {
            if self.counts[c] != 0 && new_sse[c] <= old_sse[c] {
                self.centroids[c * dim..(c + 1) * dim]
                    .copy_from_slice(&means[c * dim..(c + 1) * dim]);
            }
        }
    }

    fn objective(&self) -> f64 {
        self.dist.iter().map(|&d| f64::from(d)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_parameters() {
        let p = KMeansParams {
            k: 2,
            max_iters: 3,
            seed: 1,
        };
        assert_eq!(kmeans(&[1.0; 4], 0, &p), Err(PqError::ZeroDim));
        assert_eq!(kmeans(&[], 2, &p), Err(PqError::Empty));
        assert_eq!(
            kmeans(&[1.0; 5], 2, &p),
            Err(PqError::LengthNotMultiple { len: 5, dim: 2 })
        );
        assert_eq!(
            kmeans(&[1.0, f32::NAN], 1, &p),
            Err(PqError::NonFinite { index: 1 })
        );
        let p0 = KMeansParams { k: 0, ..p };
        assert_eq!(
            kmeans(&[1.0; 4], 2, &p0),
            Err(PqError::ClustersOutOfRange { k: 0 })
        );
    }

    #[test]
    fn fewer_points_than_clusters() {
        let data = [0.0, 1.0, 5.0];
        let p = KMeansParams {
            k: 8,
            max_iters: 10,
            seed: 7,
        };
        let r = kmeans(&data, 1, &p).unwrap();
        assert_eq!(r.centroids.len(), 8);
        assert_eq!(*r.objective_history.last().unwrap(), 0.0);
    }
}
