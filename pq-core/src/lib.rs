//! # kvc pq-core
//!
//! PQCache-style product quantization of KV-cache keys, `no_std` + `alloc`.
//!
//! Per (layer, KV head) the `D` key dims are split into `m` sub-spaces and each sub-space is
//! clustered into `2^b` centroids by deterministic seeded k-means++ ([`mod@kmeans`]); a [`Codebook`]
//! holds the centroids and turns keys into `m` codes per token. Codes are stored `b` bits each
//! ([`mod@pack`]). At a decode step a query is turned into a table of query·centroid inner products per
//! sub-space, every token is scored by summing its codes' entries, and the tokens to attend to are
//! the top-k by score plus the first `n_init` and last `n_local` tokens ([`search`]).
//!
//! ```text
//! keys [T, D] --Codebook::train--> Codebook --encode--> codes [T, m] --pack--> bytes
//! query [D] --score_table--> ScoreTable --scores(codes)--> [T] --select--> token indices
//! ```
//!
//! Everything is deterministic: the same inputs and seed give the same centroids, codes and
//! selections bit for bit on every platform (no fused multiply-add, fixed summation orders).
#![cfg_attr(not(feature = "std"), no_std)]
#![warn(missing_docs)]
extern crate alloc;

pub mod cache;
pub mod codebook;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod head;
pub mod kmeans;
pub mod pack;
mod rng;
pub mod search;
mod simd;

pub use cache::{blocks_of, BlockCache, Policy, DEFAULT_BLOCK_TOKENS};
pub use codebook::{Codebook, Method, PqParams};
pub use error::PqError;
pub use head::HeadIndex;
pub use kmeans::{kmeans, KMeans, KMeansParams};
pub use pack::{pack, packed_len, unpack};
pub use search::{
    group_score_table, k_for_fraction, rerank, score_table, scores, scores_into, search, select,
    ScoreTable,
};
