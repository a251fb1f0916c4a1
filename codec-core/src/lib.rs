//! # kvc codec-core
//!
//! A CacheGen-style codec for LLM KV caches: per-channel anchor/delta quantization with
//! profile-learned steps, 32-lane rANS entropy coding with per-(layer, channel) tables, and a
//! checksummed, chunked, self-describing container. `no_std` + `alloc`; the normative
//! description of every byte is `spec/FORMAT.md`.
//!
//! ```text
//! learn_profile --Profile--> encode --bytes--> Stream::open --> decode / decode_into / chunks
//! ```
//!
//! # Quick start
//!
//! Learn a profile from a sample cache, encode a cache into a self-contained stream (the profile
//! travels inside it), and decode it back. The same input and parameters give the same bytes on
//! every platform, which the last line pins.
//!
//! ```
//! use codec_core::{decode, encode, learn_profile, Dtype, EncodeParams, KvCache, KvMeta};
//! use codec_core::{KvShape, LearnParams, Limits, ProfileMode, Sample, Tensor};
//!
//! // 2 layers, 2 KV heads of 4 dims, 24 tokens of f32 (values exact on every platform).
//! let shape = KvShape { layers: 2, kv_heads: 2, head_dim: 4, tokens: 24 };
//! let tensor = |seed: usize| {
//!     let v = (0..shape.tensor_len()).map(|i| ((i * 37 + seed) % 101) as f32 / 50.0 - 1.0);
//!     Tensor::F32(v.collect())
//! };
//! let cache = KvCache {
//!     shape,
//!     k: vec![tensor(0), tensor(1)],
//!     v: vec![tensor(2), tensor(3)],
//!     meta: KvMeta::default(),
//! };
//!
//! let sample = Sample { kv: cache.view(), queries: None };
//! let profile = learn_profile(&[sample], &LearnParams::default())?;
//! let params = EncodeParams { levels: vec![0], ..EncodeParams::default() };
//! let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params)?;
//!
//! let back = decode(&bytes, None, &Limits::DEFAULT)?;
//! assert_eq!((back.shape, back.dtype()), (shape, Dtype::F32));
//! let (x, y) = (cache.k[1].to_f32_vec(), back.k[1].to_f32_vec());
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 0.05));
//!
//! assert_eq!(&bytes[..4], b"KVCS");
//! assert_eq!(codec_core::profile::hex(&sha2_digest(&bytes)[..8]), "b955a423756b2759");
//! # fn sha2_digest(b: &[u8]) -> [u8; 32] { use sha2::Digest; sha2::Sha256::digest(b).into() }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Errors
//!
//! Decoding never panics and allocates only after checking every count against the input and
//! [`Limits`]. A [`DecodeError`] wraps the error of the stage that rejected the input
//! ([`HeaderError`], [`OpenError`], [`ProfileError`], [`BlockError`]); each variant names the
//! check of `spec/FORMAT.md` it reports ([`DecodeError::check`]).
//!
//! # Features
//!
//! - `std` (default): `std::error::Error` for the errors, the hardware CRC-32C, the AVX-512
//!   rANS decoder (picked at run time on x86-64), and the threads of [`encode_threads`] and
//!   [`Stream::decode_range_into_threads`] (without `std` they run on the caller's thread).
//! - `internals`: makes the layers public (`container`, `block`, `quant`, `rans`, `learn`, ...)
//!   for the project's tests, benches and fuzz harnesses. Not a stable API.
//! - `fuzzing`: the fuzz targets' bodies (the module `fuzzing`).
#![cfg_attr(not(feature = "std"), no_std)]
#![warn(missing_docs)]
extern crate alloc;

/// Declares the crate's layers: public with the `internals` feature, private otherwise (what
/// users need is re-exported at the root).
macro_rules! layers {
    ($($(#[$attr:meta])* mod $name:ident;)*) => {$(
        #[cfg(feature = "internals")]
        $(#[$attr])*
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        $(#[$attr])*
        mod $name;
    )*};
}

pub mod adapt;
pub mod attention;
pub mod blend;
mod bytes;
pub mod consts;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod profile;

layers! {
    mod block;
    mod container;
    mod error;
    mod importance;
    mod kv;
    mod learn;
    mod limits;
    mod quant;
    mod rans;
    mod rope;
    mod threads;
}

pub use block::{BlockError, ChunkContext};
pub use container::{
    assemble, decode, encode, encode_threads, max_encoded_len, stream_frame, ChunkEntry,
    DecodeError, DetachedStream, EncodeParams, Header, HeaderError, OpenError, ProfileMode, Stream,
    StreamFrame,
};
pub use error::{EncodeError, Kv, ShapeError};
pub use importance::ImportanceParams;
pub use kv::{
    CodingError, Dtype, KvCache, KvMeta, KvShape, KvView, Rope, RopeStyle, Tensor, TensorMut,
    TensorRef,
};
pub use learn::{learn_profile, LearnParams, Queries, Sample};
pub use limits::Limits;
pub use profile::{Profile, ProfileError};
pub use rans::{RansError, TableError};
pub use rope::{rotate_to_positions, shift_cache, RopeError, Shift};
pub use threads::{thread_count, MAX_THREADS};
