//! Stage 4 (optional): re-ranking a short list with better keys (`spec/PQ.md` §5.4).
use alloc::vec::Vec;

#[cfg(all(feature = "simd", target_arch = "x86_64"))]
use crate::arch;
use crate::codebook::rows;
use crate::error::PqError;
use crate::order::order_key;
use crate::sums::{dot, dot_x8};

/// Re-ranks a short list with better keys: scores each candidate token `i` of `candidates` by
/// `query · keys[i]` (`keys` a flat `[T, D]` buffer, e.g. the codec's decoded keys; the dot product
/// in the crate's fixed summation order) and returns the `k` best candidates by
/// [`select`](crate::select)'s order (score descending, ties to the lower index, NaN lowest),
/// sorted ascending. Duplicate candidates count once. All of them are returned when there are
/// at most `k`.
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
    let sc = candidate_scores(&cand, keys, query);
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

/// `dot(query, key)` of every candidate (checked indices of `keys`, `[T, query.len()]`), in
/// candidate order.
fn candidate_scores(cand: &[u32], keys: &[f32], query: &[f32]) -> Vec<f32> {
    let d = query.len();
    let row = |i: u32| &keys[i as usize * d..(i as usize + 1) * d];
    let mut sc: Vec<f32> = Vec::with_capacity(cand.len());
    // 16 at a time where the AVX-512 kernel runs (the same sums), then 8 at a time.
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    for g in cand.chunks_exact(16) {
        match arch::dot_x16(query, core::array::from_fn(|j| row(g[j]))) {
            Some(s) => sc.extend_from_slice(&s),
            None => break,
        }
    }
    let mut groups = cand[sc.len()..].chunks_exact(8);
    for g in &mut groups {
        sc.extend_from_slice(&dot_x8(query, core::array::from_fn(|j| row(g[j]))));
    }
    sc.extend(groups.remainder().iter().map(|&i| dot(query, row(i))));
    sc
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Xs;
    use super::*;

    /// The 16-row dot kernel (where the CPU has it) equals [`dot`] bit for bit, row by row.
    #[test]
    #[cfg_attr(miri, ignore = "checks an AVX-512 kernel; Miri runs without `simd`")]
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
                #[cfg(all(feature = "simd", target_arch = "x86_64"))]
                if let Some(got) = arch::dot_x16(&q, r) {
                    for (i, g) in got.iter().enumerate() {
                        assert_eq!(g.to_bits(), dot(&q, r[i]).to_bits(), "d {d} row {i}");
                    }
                }
                let _ = (&q, r);
            }
        }
    }
}
