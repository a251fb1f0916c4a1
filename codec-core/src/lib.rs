//! # kvc codec-core
//!
//! A CacheGen-style codec for LLM KV caches: per-channel anchor/delta quantization with
//! profile-learned steps, 32-lane rANS entropy coding with per-(layer, channel) tables, and a
//! checksummed, chunked, self-describing container. `no_std` + `alloc`.
//!
//! The normative description of every byte is `spec/FORMAT.md`.
//!
//! ```text
//! learn_profile --Profile--> encode --bytes--> Stream::open / decode
//! ```
#![cfg_attr(not(feature = "std"), no_std)]
#![warn(missing_docs)]
extern crate alloc;

pub mod block;
mod bytes;
pub mod consts;
pub mod container;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod importance;
pub mod kv;
pub mod learn;
pub mod limits;
pub mod profile;
pub mod quant;
pub mod rans;

pub use block::{BlockError, ChunkContext};
pub use container::{
    decode, encode, max_encoded_len, DecodeError, EncodeParams, HeaderError, OpenError,
    ProfileMode, Stream,
};
pub use error::{EncodeError, Kv, ShapeError};
pub use kv::{
    Dtype, KvCache, KvMeta, KvShape, KvView, Rope, RopeStyle, Tensor, TensorMut, TensorRef,
};
pub use learn::{learn_profile, LearnParams, Queries, Sample};
pub use limits::Limits;
pub use profile::{Profile, ProfileError};
