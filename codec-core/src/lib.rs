//! # kvc codec-core
//!
//! A CacheGen-style codec for LLM KV caches: per-channel anchor/delta quantization with
//! profile-learned steps, 32-lane rANS entropy coding with per-(layer, channel) tables, and a
//! checksummed, chunked, self-describing container. `no_std` + `alloc`.
//!
//! The normative description of every byte is `spec/FORMAT.md`.
//!
//! ```text
//! profile::learn_profile  --Profile-->  codec::encode  --bytes-->  codec::Stream::open/decode
//! ```
#![cfg_attr(not(feature = "std"), no_std)]
#![warn(missing_docs)]
extern crate alloc;

pub mod attention;
mod bytes;
pub mod codec;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod importance;
pub mod kv;
pub mod limits;
pub mod profile;
pub mod quant;
pub mod rans;

pub use codec::{decode, encode, ChunkContext, EncodeParams, ProfileMode, Stream};
pub use error::{DecodeError, EncodeError, Kv};
pub use kv::{
    Dtype, KvCache, KvMeta, KvShape, KvView, Rope, RopeStyle, Tensor, TensorMut, TensorRef,
};
pub use limits::Limits;
pub use profile::{learn_profile, LearnParams, Profile, Queries, Sample};
