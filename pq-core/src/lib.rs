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
//! # Example
//!
//! Train on 96 keys of dimension 8, code them, and pick the tokens one query attends to:
//!
//! ```
//! use pq_core::{score_table, search, Codebook, PqParams};
//!
//! let d = 8;
//! // A stand-in for real keys: 96 tokens of `d` values in [-0.5, 0.5) from a xorshift stream.
//! let mut s = 0x2545_f491_4f6c_dd1d_u64;
//! let keys: Vec<f32> = (0..96 * d)
//!     .map(|_| {
//!         s ^= s << 13;
//!         s ^= s >> 7;
//!         s ^= s << 17;
//!         (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
//!     })
//!     .collect();
//! // kvc's default (residual quantization, 2 books) with 8 codewords per book: 6 bits a key.
//! let params = PqParams { b: 3, ..PqParams::default() };
//! let codebook = Codebook::train(&keys, d, &params)?;
//! let codes = codebook.encode(&keys)?; // [96, 2], token-major
//! let query = &keys[40 * d..41 * d]; // token 40's own key as the query
//! let table = score_table(query, &codebook)?;
//! // The 6 best-scoring tokens, plus the first 2 and the last 4, ascending.
//! let picked = search(&codes, &table, 6, 2, 4)?;
//! assert_eq!(picked, [0, 1, 25, 33, 40, 44, 70, 77, 92, 93, 94, 95]);
//! # Ok::<(), pq_core::PqError>(())
//! ```
//!
//! The same inputs give these indices on every platform, with or without the `simd` feature.
//! (Five of the six are among the six largest exact `q · k`; token 40 itself is picked.)
//!
//! # Features
//!
//! - `std` (default): `std::error::Error` for [`PqError`]. Without it the crate is `no_std` +
//!   `alloc`.
//! - `simd` (default, implies `std` for run-time CPU detection): the x86-64 AVX2/AVX-512 kernels
//!   of the private `arch` module, the crate's only `unsafe` code. Without it the portable code
//!   runs everywhere, with the same results.
//! - `fuzzing`: the `fuzzing` module, the harnesses of the cargo-fuzz targets.
//!
//! # Layout
//!
//! - [`mod@kmeans`], [`mod@codebook`]: training and encoding; [`mod@pack`]: `b`-bit code
//!   packing (`spec/PQ.md` §2); [`mod@head`], [`mod@cache`]: per-head index and block cache.
//! - [`mod@search`]: the decode-step search, one file per stage (score table, scan, top-k,
//!   re-rank), each using only the ones before it.
//! - Private: `sums` (the `f32` sums in the crate's fixed order), `order` (scores as ranking
//!   keys), `rng`, and `arch` (the AVX2/AVX-512 kernels, feature `simd`, the crate's only
//!   `unsafe` code, with its safety invariants). `arch` depends on `order` only; `sums` and
//!   `search` call into it.
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
