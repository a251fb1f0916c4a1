//! The errors every layer shares: [`EncodeError`] (encoding and profile learning), [`ShapeError`]
//! (a cache shape against the limits, checked by the stream header and the profile alike), and
//! [`Kv`], which names a block's tensor. The decoder's errors are typed per stage and live with
//! their stage; [`DecodeError`](crate::DecodeError) wraps them.

use core::fmt;

/// Which tensor of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kv {
    /// Keys.
    K,
    /// Values.
    V,
}

impl fmt::Display for Kv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kv::K => "K",
            Kv::V => "V",
        })
    }
}

/// Why a cache shape is rejected: checks H11-H13 of a stream header (`spec/FORMAT.md` §3.7) and
/// P6 of a profile (§4.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShapeError {
    /// H11: `layers`, `kv_heads` or `head_dim` is 0 (the first of them, in that order).
    ZeroDimension {
        /// `"layers"`, `"kv_heads"` or `"head_dim"`.
        field: &'static str,
    },
    /// H12: more layers than [`Limits::max_layers`](crate::Limits::max_layers).
    Layers {
        /// Layers found.
        got: u32,
        /// The limit.
        max: u32,
    },
    /// H13: more channels (`kv_heads * head_dim`) than
    /// [`Limits::max_channels`](crate::Limits::max_channels).
    Channels {
        /// Channels found.
        got: u64,
        /// The limit.
        max: u64,
    },
}

impl ShapeError {
    /// The spec's error class (`"InvalidField"` or `"LimitExceeded"`).
    pub fn kind(&self) -> &'static str {
        match self {
            ShapeError::ZeroDimension { .. } => "InvalidField",
            ShapeError::Layers { .. } | ShapeError::Channels { .. } => "LimitExceeded",
        }
    }
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShapeError::ZeroDimension { field } => write!(f, "invalid {field}: 0"),
            ShapeError::Layers { got, max } => write!(f, "layers = {got} exceeds the limit {max}"),
            ShapeError::Channels { got, max } => write!(
                f,
                "channels (kv_heads * head_dim) = {got} exceeds the limit {max}"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ShapeError {}

/// Everything that can go wrong encoding a cache or learning a profile.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EncodeError {
    /// An encoding parameter is out of range.
    InvalidParam {
        /// The parameter.
        what: &'static str,
        /// Value given.
        got: u64,
    },
    /// The input tensors do not match the declared shape.
    ShapeMismatch {
        /// What does not match.
        what: &'static str,
    },
    /// The profile was learned for another shape.
    ProfileShape {
        /// The profile's `[layers, kv_heads, head_dim]`.
        profile: [u32; 3],
        /// The input's.
        input: [u32; 3],
    },
    /// Sample caches of different shapes were given to learn one profile.
    SampleShape {
        /// The sample that differs from the first.
        sample: usize,
        /// Its `[layers, kv_heads, head_dim]`.
        shape: [u32; 3],
        /// The first sample's.
        first: [u32; 3],
    },
    /// A level outside the profile was requested.
    UnknownLevel {
        /// Level requested.
        level: u8,
        /// Levels in the profile.
        levels: u8,
    },
    /// The input holds NaN or infinite values.
    NonFinite {
        /// Layer.
        layer: u32,
        /// K or V.
        kv: Kv,
    },
    /// No sample data was given to learn a profile: no sample, or samples of no tokens (a
    /// profile's size follows the shape, which empty samples would not bound).
    NoSamples,
    /// The number of chunk levels is neither 1 nor the number of chunks.
    ChunkLevels {
        /// Levels given.
        given: usize,
        /// The cache's tokens.
        tokens: u32,
        /// Tokens per chunk.
        chunk_tokens: u32,
    },
    /// The profile to learn would be refused by a decoder with the default limits
    /// ([`Limits::DEFAULT`](crate::Limits::DEFAULT)): too many layers or channels, or too
    /// many bytes.
    OverLimit {
        /// `"layers"`, `"channels"` or `"profile bytes"`.
        what: &'static str,
        /// Its size.
        got: u64,
        /// The default limit.
        max: u64,
    },
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use EncodeError::*;
        match self {
            InvalidParam { what, got } => write!(f, "invalid parameter {what}: {got}"),
            ShapeMismatch { what } => write!(f, "input does not match its shape: {what}"),
            ProfileShape { profile, input } => write!(
                f,
                "the profile is for {}, the input has {} (a profile serves one model)",
                Dims(profile),
                Dims(input)
            ),
            SampleShape {
                sample,
                shape,
                first,
            } => write!(
                f,
                "sample {sample} has {}, sample 0 has {} (learn a profile from one model's caches)",
                Dims(shape),
                Dims(first)
            ),
            UnknownLevel { level, levels } => write!(
                f,
                "level {level} is not in the profile (its levels are 0 to {})",
                levels.saturating_sub(1)
            ),
            NonFinite { layer, kv } => write!(f, "layer {layer} {kv} holds NaN or infinity"),
            NoSamples => f.write_str("no sample tokens given to learn a profile from"),
            ChunkLevels {
                given,
                tokens,
                chunk_tokens,
            } => write!(
                f,
                "{given} chunk levels given, but {tokens} tokens at {chunk_tokens} tokens per \
                 chunk make {} chunks: give one level per chunk, or one level for all",
                tokens.div_ceil(*chunk_tokens)
            ),
            OverLimit { what, got, max } => write!(
                f,
                "a profile of {got} {what} would be refused by decoders (at most {max})"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for EncodeError {}

/// `[layers, kv_heads, head_dim]` in words.
pub(crate) struct Dims<'a>(pub &'a [u32; 3]);

impl fmt::Display for Dims<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [l, h, d] = self.0;
        write!(f, "{l} layers x {h} KV heads x {d} head dim")
    }
}
