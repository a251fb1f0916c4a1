//! # kvc pq-core
//!
//! PQCache-style token selection for KV caches, `no_std` + `alloc`: a few bits per key pick the
//! tokens a decode step attends to.
//!
//! Per (layer, KV head) a [`Codebook`] of `m` books of `2^b` codewords, trained by deterministic
//! seeded k-means++ ([`mod@kmeans`]), gives every key `m` codes ([`mod@codebook`]): either the
//! paper's product quantization ([`Method::Product`]: book `j` covers a slice of the dims) or
//! kvc's default, residual quantization ([`Method::Residual`]: every book covers all dims and
//! quantizes what the previous ones left), which recalls more of the exact top-k at the same
//! bits (`spec/PQ.md` §6). Codes are stored `b` bits each ([`mod@pack`]). At a decode step a
//! query becomes a table of query·codeword products per book; every token's score is the sum of
//! its codes' entries; the tokens to attend to are the top-k plus the first `n_init` and last
//! `n_local` tokens ([`search()`], [`select`]); a short list can be re-scored with better keys
//! ([`rerank`]). [`HeadIndex`] codes new tokens as they leave the local window;
//! [`cache::BlockCache`] simulates a GPU block cache and reports its hit rate.
//!
//! ```text
//! keys [T, D] --Codebook::train--> Codebook --encode--> codes [T, m] --pack--> bytes
//! query [D] --score_table--> ScoreTable --search(codes)--> token indices [--rerank--> top k]
//! ```
//!
//! Everything is deterministic: the same inputs and seed give the same codewords, codes and
//! selections bit for bit on every platform (no fused multiply-add, sums in dim order). With
//! the `simd` feature (default) on x86-64, AVX2/AVX-512 kernels are picked at run time; they
//! compute the same results as the portable code, which tests check.
//!
//! # Features
//!
//! - `std` (default): `std::error::Error` for [`PqError`]. Without it the crate is `no_std` +
//!   `alloc`.
//! - `simd` (default, implies `std` for run-time CPU detection): the x86-64 AVX2/AVX-512 kernels
//!   of the private `arch` module, the crate's only `unsafe` code. Without it the portable code
//!   runs everywhere, with the same results.
//! - `fuzzing`: the `fuzzing` module, the harnesses of the cargo-fuzz targets.
#![cfg_attr(not(feature = "std"), no_std)]
#![deny(unsafe_code)]
#![warn(missing_docs)]
extern crate alloc;

#[cfg(all(feature = "simd", target_arch = "x86_64"))]
#[allow(unsafe_code)]
mod arch;
pub mod cache;
pub mod codebook;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod head;
pub mod kmeans;
mod order;
pub mod pack;
mod rng;
pub mod search;
mod sums;

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
