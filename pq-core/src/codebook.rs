//! Per-(layer, KV head) key quantizers: product quantization (PQ, the PQCache paper's) and
//! residual quantization (RQ, kvc's default, which recalls more at the same bits: `spec/PQ.md`
//! §6).
//!
//! Both give every key `m` codes of `b` bits, stored as a flat `[T, m]` buffer of `u16`,
//! token-major, and both score a query the same way: `score = sum_j table[j][code_j]`, where
//! `table[j][c]` is the query's inner product with codeword `c` of book `j` restricted to the dims
//! book `j` covers. They differ in what a book is:
//!
//! - [`Method::Product`]: the `dim` key dims are split into `m` sub-spaces, sub-space `j` covering
//!   dims `[j * dim/m, (j+1) * dim/m)`; each has `2^b` centroids of `dim/m` values and a key's
//!   code `j` is the nearest centroid to its slice. The reconstruction concatenates the codewords.
//! - [`Method::Residual`]: every book covers all `dim` dims. Book 0 quantizes the key, book 1 what
//!   book 0 left (the residual), and so on; the reconstruction is the sum of the codewords, added in
//!   book order starting from `0.0`. Training runs k-means on each stage's residuals, then
//!   `refine_rounds` rounds of coordinate descent (see [`Codebook::train`]). Encoding is greedy
//!   stage by stage, then `refine_rounds` rounds that re-pick each code given the others.
//!
//! All "nearest" choices use squared L2 with the fixed summation order of the crate, ties to the
//! lower index, so codes are identical on every platform.
use alloc::vec;
use alloc::vec::Vec;

use crate::error::PqError;
use crate::kmeans::{check_centroid_values, kmeans, KMeansParams};
use crate::sums::{columns, transpose, Op};

/// How the books of a [`Codebook`] split the key (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// Product quantization over `m` equal sub-spaces of contiguous dims (PQCache).
    Product,
    /// Residual quantization: `m` stages over all dims, each quantizing the previous residual.
    Residual,
}

impl Method {
    /// The one-byte id used in files and on the command line: 0 = product, 1 = residual.
    pub fn id(self) -> u8 {
        match self {
            Method::Product => 0,
            Method::Residual => 1,
        }
    }
    /// The method of an id, or `None`.
    pub fn from_id(id: u8) -> Option<Self> {
        match id {
            0 => Some(Method::Product),
            1 => Some(Method::Residual),
            _ => None,
        }
    }
    /// A short name: `"pq"` or `"rq"`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Product => "pq",
            Method::Residual => "rq",
        }
    }
}

/// The largest bits per code a codebook accepts (4096 centroids per sub-space).
pub const MAX_CODEBOOK_BITS: u8 = 12;

/// Training parameters. [`Default`] is kvc's choice: residual quantization with `m = 2` stages of
/// `b = 6` bits (12 bits per key), 8 Lloyd iterations, 1 refinement round.
/// [`PqParams::paper`] is PQCache's product quantization at the same 12 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqParams {
    /// How the books split the key.
    pub method: Method,
    /// Number of books (codes per key): sub-spaces for [`Method::Product`] (must divide the key
    /// dimension), stages for [`Method::Residual`].
    pub m: usize,
    /// Bits per code, `1..=MAX_CODEBOOK_BITS`; each sub-space has `2^b` centroids.
    pub b: u8,
    /// Cap on Lloyd iterations per sub-space (PQCache caps them to hide clustering under prefill).
    pub max_iters: u32,
    /// Base seed. Sub-space `j` is clustered with seed
    /// `seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)`; callers give each (layer, head)
    /// its own `seed` if they want independent draws.
    pub seed: u64,
    /// [`Method::Residual`] only: rounds of coordinate descent after the stage-wise k-means, and
    /// of code re-picking when encoding. Ignored by [`Method::Product`].
    pub refine_rounds: u32,
}

impl Default for PqParams {
    fn default() -> Self {
        Self {
            method: Method::Residual,
            m: 2,
            b: 6,
            max_iters: 8,
            seed: 0,
            refine_rounds: 1,
        }
    }
}

impl PqParams {
    /// PQCache's setting: product quantization, `m = 2` sub-spaces of `b = 6` bits, 20 Lloyd
    /// iterations (the fixtures README's numpy baseline).
    pub fn paper() -> Self {
        Self {
            method: Method::Product,
            m: 2,
            b: 6,
            max_iters: 20,
            seed: 0,
            refine_rounds: 0,
        }
    }

    /// Checks the parameters for keys of `dim` dimensions, as [`Codebook::train`] does first:
    /// `dim > 0`, `m` within `1..=`[`MAX_BOOKS`] (and dividing `dim` for
    /// [`Method::Product`]), `b` within `1..=`[`MAX_CODEBOOK_BITS`], and a codebook of at most
    /// [`MAX_CENTROID_VALUES`](crate::kmeans::MAX_CENTROID_VALUES) values.
    pub fn check(&self, dim: usize) -> Result<(), PqError> {
        check_shape(self.method, dim, self.m, self.b).map(|_| ())
    }
}

/// The seed that sub-space `j` is clustered with (see [`PqParams::seed`]).
pub fn subspace_seed(seed: u64, j: usize) -> u64 {
    seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The largest number of books (codes per key) a codebook accepts.
pub const MAX_BOOKS: usize = 64;

/// The codewords of one (layer, KV head).
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    method: Method,
    dim: usize,
    m: usize,
    b: u8,
    /// `[m, 2^b, book_dim]` row-major: codeword `c` of book `j` starts at
    /// `(j * 2^b + c) * book_dim`, where `book_dim` is `dim/m` (product) or `dim` (residual).
    centroids: Vec<f32>,
    /// Residual only: re-picking rounds in [`Codebook::encode`].
    refine_rounds: u32,
    /// Each book transposed, `[m, book_dim, 2^b]` (derived from `centroids`, for the kernels).
    cols: Vec<f32>,
}

/// Every book of `centroids` (`[m, k, bd]`) transposed to `[bd, k]`.
fn transpose_books(centroids: &[f32], k: usize, bd: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(centroids.len());
    for book in centroids.chunks_exact(k * bd) {
        out.extend_from_slice(&transpose(book, bd));
    }
    out
}

fn check_shape(method: Method, dim: usize, m: usize, b: u8) -> Result<BookShape, PqError> {
    if dim == 0 {
        return Err(PqError::ZeroDim);
    }
    if m == 0 {
        return Err(PqError::ZeroSubspaces);
    }
    if m > MAX_BOOKS {
        return Err(PqError::TooManyBooks { m, max: MAX_BOOKS });
    }
    if method == Method::Product && !dim.is_multiple_of(m) {
        return Err(PqError::DimNotDivisible { dim, m });
    }
    if b == 0 || b > MAX_CODEBOOK_BITS {
        return Err(PqError::BitsOutOfRange {
            b,
            max: MAX_CODEBOOK_BITS,
        });
    }
    let bd = book_dim(method, dim, m);
    let values = m.checked_mul(1 << b).and_then(|x| x.checked_mul(bd));
    Ok(BookShape {
        book_dim: bd,
        values: check_centroid_values(values)?,
    })
}

/// The sizes of a codebook [`check_shape`] accepted.
struct BookShape {
    /// Dimensions of each book's codewords.
    book_dim: usize,
    /// Codeword values of all books.
    values: usize,
}

/// Dimensions of each book's codewords: `dim / m` for [`Method::Product`], `dim` for
/// [`Method::Residual`].
fn book_dim(method: Method, dim: usize, m: usize) -> usize {
    match method {
        Method::Product => dim / m,
        Method::Residual => dim,
    }
}

/// Checks that `x` is a flat `[n, dim]` buffer and returns `n`.
pub(crate) fn rows(x: &[f32], dim: usize) -> Result<usize, PqError> {
    if !x.len().is_multiple_of(dim) {
        return Err(PqError::LengthNotMultiple { len: x.len(), dim });
    }
    Ok(x.len() / dim)
}

fn check_finite(x: &[f32]) -> Result<(), PqError> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(PqError::NonFinite { index }),
        None => Ok(()),
    }
}

/// Index of the smallest of `d`, ties to the lower index.
#[inline]
fn argmin(d: &[f32]) -> usize {
    let (mut best, mut best_d) = (0usize, d[0]);
    for (c, &x) in d.iter().enumerate().skip(1) {
        if x < best_d {
            best = c;
            best_d = x;
        }
    }
    best
}

/// `out = x - sum of book t's codeword for t != skip`, subtracted in book order (residual).
fn residual_target(
    x: &[f32],
    codes: &[u16],
    books: &[f32],
    k: usize,
    skip: usize,
    out: &mut [f32],
) {
    let d = x.len();
    out.copy_from_slice(x);
    for (t, &c) in codes.iter().enumerate() {
        if t == skip {
            continue;
        }
        let w = &books[(t * k + usize::from(c)) * d..(t * k + usize::from(c) + 1) * d];
        for (o, &v) in out.iter_mut().zip(w) {
            *o -= v;
        }
    }
}

impl Codebook {
    /// Trains a codebook on `keys`, a flat `[T, dim]` buffer (`T >= 1`, finite values).
    ///
    /// - [`Method::Product`]: [`kmeans`] with `k = 2^b` on each sub-space, sub-space `j` seeded with
    ///   [`subspace_seed`]`(seed, j)`.
    /// - [`Method::Residual`]: stage `j` runs [`kmeans`] (seed [`subspace_seed`]`(seed, j)`) on the
    ///   residuals `r_j` (`r_0` = the keys, `r_{j+1} = r_j - codeword`, in `f32`), with the
    ///   assignments k-means returns as the stage's codes. Then `refine_rounds` rounds, each visiting
    ///   the stages in order: the stage's target is `x - sum of the other stages' codewords`
    ///   (subtracted in stage order); every key re-picks its nearest codeword to the target (ties to
    ///   the lower index); then each codeword with at least one key becomes the mean of its keys'
    ///   targets (summed in `f64` in key order, divided, rounded to `f32`).
    pub fn train(keys: &[f32], dim: usize, params: &PqParams) -> Result<Self, PqError> {
        let BookShape {
            book_dim: bd,
            values: total,
        } = check_shape(params.method, dim, params.m, params.b)?;
        let t = rows(keys, dim)?;
        if t == 0 {
            return Err(PqError::Empty);
        }
        check_finite(keys)?;
        let (m, k) = (params.m, 1usize << params.b);
        let mut centroids = Vec::with_capacity(total);
        match params.method {
            Method::Product => {
                let mut sub = Vec::with_capacity(t * bd);
                for j in 0..m {
                    sub.clear();
                    for key in keys.chunks_exact(dim) {
                        sub.extend_from_slice(&key[j * bd..(j + 1) * bd]);
                    }
                    let r = kmeans(&sub, bd, &kmeans_params(params, k, j))?;
                    centroids.extend_from_slice(&r.centroids);
                }
            }
            Method::Residual => {
                let mut resid = keys.to_vec();
                let mut codes = vec![0u16; t * m];
                for j in 0..m {
                    let r = kmeans(&resid, dim, &kmeans_params(params, k, j))?;
                    for (i, (row, &a)) in
                        resid.chunks_exact_mut(dim).zip(&r.assignments).enumerate()
                    {
                        codes[i * m + j] = a as u16;
                        let w = &r.centroids[a as usize * dim..(a as usize + 1) * dim];
                        for (x, &v) in row.iter_mut().zip(w) {
                            *x -= v;
                        }
                    }
                    centroids.extend_from_slice(&r.centroids);
                }
                drop(resid);
                refine_residual(
                    keys,
                    dim,
                    m,
                    k,
                    &mut centroids,
                    &mut codes,
                    params.refine_rounds,
                );
            }
        }
        Ok(Self {
            method: params.method,
            dim,
            m,
            b: params.b,
            cols: transpose_books(&centroids, k, bd),
            centroids,
            refine_rounds: params.refine_rounds,
        })
    }

    /// Builds a codebook from stored codewords (`[m, 2^b, book_dim]` row-major, finite), with
    /// `refine_rounds` used by [`Codebook::encode`] for [`Method::Residual`].
    pub fn from_parts(
        method: Method,
        dim: usize,
        m: usize,
        b: u8,
        refine_rounds: u32,
        centroids: Vec<f32>,
    ) -> Result<Self, PqError> {
        let BookShape {
            book_dim: bd,
            values: expected,
        } = check_shape(method, dim, m, b)?;
        if centroids.len() != expected {
            return Err(PqError::LengthMismatch {
                got: centroids.len(),
                expected,
            });
        }
        check_finite(&centroids)?;
        Ok(Self {
            method,
            dim,
            m,
            b,
            cols: transpose_books(&centroids, 1 << b, bd),
            centroids,
            refine_rounds,
        })
    }

    /// The quantization method.
    pub fn method(&self) -> Method {
        self.method
    }
    /// Key dimension `D`.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// Number of books `m` (codes per key).
    pub fn m(&self) -> usize {
        self.m
    }
    /// Bits per code `b`.
    pub fn bits(&self) -> u8 {
        self.b
    }
    /// Codewords per book, `2^b`.
    pub fn n_centroids(&self) -> usize {
        1 << self.b
    }
    /// Values per codeword: `D / m` (product) or `D` (residual).
    pub fn book_dim(&self) -> usize {
        match self.method {
            Method::Product => self.dim / self.m,
            Method::Residual => self.dim,
        }
    }
    /// The key dims book `j` covers: `j * D/m .. (j+1) * D/m` (product) or `0..D` (residual).
    pub fn book_range(&self, j: usize) -> core::ops::Range<usize> {
        match self.method {
            Method::Product => {
                let sd = self.dim / self.m;
                j * sd..(j + 1) * sd
            }
            Method::Residual => 0..self.dim,
        }
    }
    /// Re-picking rounds used by [`Codebook::encode`] (residual only).
    pub fn refine_rounds(&self) -> u32 {
        self.refine_rounds
    }
    /// Every book transposed, `[m, book_dim, 2^b]`.
    pub(crate) fn cols(&self) -> &[f32] {
        &self.cols
    }
    /// All codewords, `[m, 2^b, book_dim]` row-major.
    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }
    /// Codeword `c` of book `j`, or `None` if out of range.
    pub fn centroid(&self, j: usize, c: usize) -> Option<&[f32]> {
        if j >= self.m || c >= self.n_centroids() {
            return None;
        }
        let bd = self.book_dim();
        let at = (j * self.n_centroids() + c) * bd;
        Some(&self.centroids[at..at + bd])
    }

    /// Codes of `keys` (flat `[T, dim]`): a flat `[T, m]` buffer, token-major (see the module
    /// docs for how each method picks them). Used both after training and for new tokens.
    /// Non-finite keys are rejected.
    pub fn encode(&self, keys: &[f32]) -> Result<Vec<u16>, PqError> {
        let t = rows(keys, self.dim)?;
        check_finite(keys)?;
        let (bd, k, m) = (self.book_dim(), self.n_centroids(), self.m);
        let mut codes = vec![0u16; t * m];
        let mut dbuf = vec![0.0f32; k];
        match self.method {
            Method::Product => {
                for (key, out) in keys.chunks_exact(self.dim).zip(codes.chunks_exact_mut(m)) {
                    for (j, (x, o)) in key.chunks_exact(bd).zip(out.iter_mut()).enumerate() {
                        columns(
                            Op::SqL2,
                            x,
                            &self.cols[j * k * bd..(j + 1) * k * bd],
                            &mut dbuf,
                        );
                        *o = argmin(&dbuf) as u16;
                    }
                }
            }
            Method::Residual => {
                let mut r = vec![0.0f32; bd];
                for (key, out) in keys.chunks_exact(self.dim).zip(codes.chunks_exact_mut(m)) {
                    r.copy_from_slice(key);
                    for (j, o) in out.iter_mut().enumerate() {
                        let book = &self.centroids[j * k * bd..(j + 1) * k * bd];
                        columns(
                            Op::SqL2,
                            &r,
                            &self.cols[j * k * bd..(j + 1) * k * bd],
                            &mut dbuf,
                        );
                        let c = argmin(&dbuf);
                        *o = c as u16;
                        for (x, &v) in r.iter_mut().zip(&book[c * bd..(c + 1) * bd]) {
                            *x -= v;
                        }
                    }
                    for _ in 0..self.refine_rounds {
                        for j in 0..m {
                            residual_target(key, out, &self.centroids, k, j, &mut r);
                            columns(
                                Op::SqL2,
                                &r,
                                &self.cols[j * k * bd..(j + 1) * k * bd],
                                &mut dbuf,
                            );
                            out[j] = argmin(&dbuf) as u16;
                        }
                    }
                }
            }
        }
        Ok(codes)
    }

    /// Reconstructs keys from codes (flat `[T, m]`): a flat `[T, dim]` buffer: the codewords
    /// concatenated (product) or summed in book order from `0.0` (residual).
    pub fn decode(&self, codes: &[u16]) -> Result<Vec<f32>, PqError> {
        self.check_codes(codes)?;
        let (bd, k) = (self.book_dim(), self.n_centroids());
        let mut out = Vec::with_capacity(codes.len() / self.m * self.dim);
        for tok in codes.chunks_exact(self.m) {
            match self.method {
                Method::Product => {
                    for (j, &c) in tok.iter().enumerate() {
                        let at = (j * k + usize::from(c)) * bd;
                        out.extend_from_slice(&self.centroids[at..at + bd]);
                    }
                }
                Method::Residual => {
                    let start = out.len();
                    out.resize(start + bd, 0.0);
                    for (j, &c) in tok.iter().enumerate() {
                        let at = (j * k + usize::from(c)) * bd;
                        for (o, &v) in out[start..].iter_mut().zip(&self.centroids[at..at + bd]) {
                            *o += v;
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Checks that `codes` is a flat `[T, m]` buffer of codes below `2^b`.
    pub(crate) fn check_codes(&self, codes: &[u16]) -> Result<(), PqError> {
        if !codes.len().is_multiple_of(self.m) {
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

fn kmeans_params(params: &PqParams, k: usize, j: usize) -> KMeansParams {
    KMeansParams {
        k,
        max_iters: params.max_iters,
        seed: subspace_seed(params.seed, j),
    }
}

/// The refinement rounds of residual training (see [`Codebook::train`]).
fn refine_residual(
    keys: &[f32],
    dim: usize,
    m: usize,
    k: usize,
    books: &mut [f32],
    codes: &mut [u16],
    rounds: u32,
) {
    let t = keys.len() / dim;
    let mut target = vec![0.0f32; t * dim];
    let mut dbuf = vec![0.0f32; k];
    let mut sums = vec![0.0f64; k * dim];
    let mut counts = vec![0u32; k];
    for _ in 0..rounds {
        for j in 0..m {
            let cols = transpose(&books[j * k * dim..(j + 1) * k * dim], dim);
            for (i, (x, tg)) in keys
                .chunks_exact(dim)
                .zip(target.chunks_exact_mut(dim))
                .enumerate()
            {
                residual_target(x, &codes[i * m..(i + 1) * m], books, k, j, tg);
                columns(Op::SqL2, tg, &cols, &mut dbuf);
                codes[i * m + j] = argmin(&dbuf) as u16;
            }
            sums.iter_mut().for_each(|s| *s = 0.0);
            counts.iter_mut().for_each(|c| *c = 0);
            for (i, tg) in target.chunks_exact(dim).enumerate() {
                let c = usize::from(codes[i * m + j]);
                counts[c] += 1;
                for (s, &v) in sums[c * dim..(c + 1) * dim].iter_mut().zip(tg) {
                    *s += f64::from(v);
                }
            }
            let book = &mut books[j * k * dim..(j + 1) * k * dim];
            for c in 0..k {
                if counts[c] == 0 {
                    continue;
                }
                let n = f64::from(counts[c]);
                for (w, &s) in book[c * dim..(c + 1) * dim]
                    .iter_mut()
                    .zip(&sums[c * dim..(c + 1) * dim])
                {
                    *w = (s / n) as f32;
                }
            }
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
            ..PqParams::paper()
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
        let cb = Codebook::from_parts(Method::Product, 2, 2, 1, 0, alloc::vec![0.0; 4]).unwrap();
        assert_eq!(
            cb.decode(&[0, 2]),
            Err(PqError::CodeOutOfRange {
                index: 1,
                code: 2,
                max: 1
            })
        );
        assert!(Codebook::from_parts(Method::Product, 2, 2, 1, 0, alloc::vec![0.0; 3]).is_err());
    }
}
