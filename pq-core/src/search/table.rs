//! Stage 1: the score table of a query (or GQA group), `[m, 2^b]` query·codeword products
//! (`spec/PQ.md` §5.1).
use alloc::vec;
use alloc::vec::Vec;

use crate::codebook::{rows, Codebook};
use crate::error::PqError;
use crate::sums::{columns, Op};

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

    /// The two rows of an `m = 2` table (the kvc and paper default), the form the `m = 2`
    /// kernels take.
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    #[inline]
    pub(crate) fn m2_rows(&self) -> Option<[&[f32]; 2]> {
        if self.m != 2 {
            return None;
        }
        let (r0, r1) = self.values.split_at(self.values.len() / 2);
        Some([r0, r1])
    }
}

/// The table of `query · centroid` per sub-space for one query of length `codebook.dim()`
/// ([`PqError::LengthMismatch`] for a whole number of queries more: the queries of a GQA
/// group go to [`group_score_table`]).
pub fn score_table(query: &[f32], codebook: &Codebook) -> Result<ScoreTable, PqError> {
    // Other lengths get group_score_table's errors.
    if query.len() > codebook.dim() && query.len().is_multiple_of(codebook.dim()) {
        return Err(PqError::LengthMismatch {
            got: query.len(),
            expected: codebook.dim(),
        });
    }
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
