//! The decode-step search: score every token from its codes and pick the tokens to attend to.
//! One file per stage, each using only the stages before it:
//!
//! 1. **Score table** ([`score_table`], `table.rs`): for a query `q` (length `D`),
//!    `table[j][c] = q_j · centroid(j, c)`, where `q_j` is the query's slice of the dims book `j`
//!    covers ([`Codebook::book_range`](crate::Codebook::book_range): a sub-space for product
//!    quantization, all dims for residual quantization).
//! 2. **Scan** ([`scores`], `scan.rs`): token `t` scores
//!    `table[0][code(t,0)] + table[1][code(t,1)] + ...`, summed in `f32` in sub-space order
//!    starting from `0.0`. This approximates `q · k_t`.
//! 3. **Top-k** ([`select`], `topk.rs`, with the `k`-th largest key found by `kth.rs`): the
//!    first `n_init` and last `n_local` tokens, plus the `k` best of the others. [`search()`] is
//!    scan and top-k fused, without materializing the scores where a kernel can.
//! 4. **Re-rank** ([`rerank()`], `rerank.rs`, optional): a short list re-scored with better keys.
//!
//! `spec/PQ.md` §5 defines each stage's arithmetic exactly. The AVX2/AVX-512 kernels the stages
//! dispatch to live in `crate::arch` (feature `simd`) and compute the same results as the
//! portable code here.
//!
//! **GQA.** The query heads that share a KV head score against that head's codes. Their scores are
//! combined by *summing* ([`group_score_table`]): a token's group score is the sum over the group's
//! query heads of its per-head scores. Because the score is linear in the table, this is computed as
//! one table whose entries are the per-head entries summed in head order, then one scan over the
//! codes; the result equals the sum of per-head [`scores`] up to `f32` rounding order. (A max over
//! heads would need one scan per head; the sum costs one scan and ranks tokens that several heads
//! like above a token only one head likes, which is the behaviour wanted for a shared selection.)
mod kth;
mod rerank;
mod scan;
mod table;
mod topk;

pub use rerank::rerank;
pub use scan::{scores, scores_into};
pub use table::{group_score_table, score_table, ScoreTable};
pub use topk::{k_for_fraction, search, select};

/// Test inputs shared by the stages' unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    /// A xorshift64 stream.
    pub(crate) struct Xs(pub(crate) u64);

    impl Xs {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// Scores with repeats, signed zeros, infinities and NaN now and then.
        pub(crate) fn score(&mut self) -> f32 {
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
}
