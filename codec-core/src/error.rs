//! Typed errors. Decoding untrusted bytes yields [`DecodeError`]; encoding and profile learning
//! yield [`EncodeError`]. Both implement `Display` (and `std::error::Error` with the `std` feature).

use crate::rans::{RansError, TableError};
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

/// Everything that can go wrong reading a stream, a chunk or a profile.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended before a field or section it promised.
    Truncated {
        /// The section being read.
        what: &'static str,
        /// Bytes the section needs.
        needed: u64,
        /// Bytes left in the input.
        available: u64,
    },
    /// The first four bytes are not the expected magic.
    BadMagic {
        /// What was expected (`"stream"` or `"profile"`).
        what: &'static str,
        /// The bytes found.
        got: [u8; 4],
    },
    /// A format version this decoder does not implement.
    UnsupportedVersion {
        /// What was being read.
        what: &'static str,
        /// Version found.
        got: u16,
    },
    /// The header checksum does not match.
    HeaderCrc {
        /// CRC stored in the stream.
        stored: u32,
        /// CRC computed over the header bytes.
        computed: u32,
    },
    /// A chunk's checksum does not match.
    ChunkCrc {
        /// Chunk index.
        chunk: u32,
        /// CRC stored in the chunk.
        stored: u32,
        /// CRC computed over the chunk payload.
        computed: u32,
    },
    /// The profile's checksum does not match.
    ProfileCrc {
        /// CRC stored in the profile.
        stored: u32,
        /// CRC computed over the profile bytes.
        computed: u32,
    },
    /// A count exceeds a caller-set limit or a format limit.
    LimitExceeded {
        /// The field.
        what: &'static str,
        /// Value found.
        got: u64,
        /// Largest accepted value.
        max: u64,
    },
    /// A field has a value the format does not allow.
    InvalidField {
        /// The field.
        what: &'static str,
        /// Value found (widened).
        got: u64,
    },
    /// Sections of the stream disagree with each other.
    Inconsistent {
        /// What disagrees.
        what: &'static str,
    },
    /// The stream names a profile that was not supplied (it is not self-contained).
    ProfileRequired {
        /// The hash the stream names.
        hash: [u8; 32],
    },
    /// The supplied profile is not the one the stream was encoded with.
    ProfileMismatch {
        /// The hash the stream names.
        expected: [u8; 32],
        /// The hash of the supplied profile.
        got: [u8; 32],
    },
    /// The profile's shape does not match the stream's.
    ProfileShape,
    /// A chunk asks for a level the profile does not have.
    UnknownLevel {
        /// Level found.
        level: u8,
        /// Number of levels in the profile.
        levels: u8,
    },
    /// A frequency table is malformed.
    Table(TableError),
    /// An entropy-coded block failed to decode.
    Rans {
        /// Chunk index.
        chunk: u32,
        /// Layer.
        layer: u32,
        /// K or V.
        kv: Kv,
        /// The coder's error.
        err: RansError,
    },
    /// An escaped symbol is out of range or could have been coded without escape.
    BadEscape {
        /// Chunk index.
        chunk: u32,
    },
    /// The caller's output buffer does not match the stream.
    OutputMismatch {
        /// What does not match.
        what: &'static str,
    },
    /// A chunk or token range outside the stream was requested.
    OutOfRange {
        /// What was requested.
        what: &'static str,
    },
}

fn hex8(h: &[u8; 32]) -> impl fmt::Display + '_ {
    struct H<'a>(&'a [u8; 32]);
    impl fmt::Display for H<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            for b in &self.0[..8] {
                write!(f, "{b:02x}")?;
            }
            Ok(())
        }
    }
    H(h)
}

impl DecodeError {
    /// The variant's name (`"Truncated"`, `"ChunkCrc"`, ...): the error names `spec/FORMAT.md`
    /// and the golden vectors in `spec/vectors/` use.
    pub fn kind(&self) -> &'static str {
        use DecodeError::*;
        match self {
            Truncated { .. } => "Truncated",
            BadMagic { .. } => "BadMagic",
            UnsupportedVersion { .. } => "UnsupportedVersion",
            HeaderCrc { .. } => "HeaderCrc",
            ChunkCrc { .. } => "ChunkCrc",
            ProfileCrc { .. } => "ProfileCrc",
            LimitExceeded { .. } => "LimitExceeded",
            InvalidField { .. } => "InvalidField",
            Inconsistent { .. } => "Inconsistent",
            ProfileRequired { .. } => "ProfileRequired",
            ProfileMismatch { .. } => "ProfileMismatch",
            ProfileShape => "ProfileShape",
            UnknownLevel { .. } => "UnknownLevel",
            Table(_) => "Table",
            Rans { .. } => "Rans",
            BadEscape { .. } => "BadEscape",
            OutputMismatch { .. } => "OutputMismatch",
            OutOfRange { .. } => "OutOfRange",
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use DecodeError::*;
        match self {
            Truncated { what, needed, available } => write!(
                f,
                "truncated input: {what} needs {needed} bytes, only {available} left"
            ),
            BadMagic { what, got } => write!(f, "not a kvc {what}: bad magic {got:02x?}"),
            UnsupportedVersion { what, got } => {
                write!(f, "unsupported {what} format version {got}")
            }
            HeaderCrc { stored, computed } => write!(
                f,
                "header checksum mismatch (stored {stored:08x}, computed {computed:08x}): corrupt stream"
            ),
            ChunkCrc { chunk, stored, computed } => write!(
                f,
                "chunk {chunk} checksum mismatch (stored {stored:08x}, computed {computed:08x}): corrupt stream"
            ),
            ProfileCrc { stored, computed } => write!(
                f,
                "profile checksum mismatch (stored {stored:08x}, computed {computed:08x}): corrupt profile"
            ),
            LimitExceeded { what, got, max } => {
                write!(f, "{what} = {got} exceeds the limit {max}")
            }
            InvalidField { what, got } => write!(f, "invalid {what}: {got}"),
            Inconsistent { what } => write!(f, "inconsistent stream: {what}"),
            ProfileRequired { hash } => write!(
                f,
                "stream was encoded with profile {} and does not embed it: pass that profile",
                hex8(hash)
            ),
            ProfileMismatch { expected, got } => write!(
                f,
                "wrong profile: stream needs {}, given {}",
                hex8(expected),
                hex8(got)
            ),
            ProfileShape => f.write_str("profile shape (layers, heads, head_dim) differs from the stream's"),
            UnknownLevel { level, levels } => {
                write!(f, "level {level} not in profile (it has {levels} levels)")
            }
            Table(e) => write!(f, "malformed frequency table: {e}"),
            Rans { chunk, layer, kv, err } => {
                write!(f, "chunk {chunk}, layer {layer} {kv}: entropy decoding failed: {err}")
            }
            BadEscape { chunk } => write!(f, "chunk {chunk}: non-canonical escape value"),
            OutputMismatch { what } => write!(f, "output buffer does not match the stream: {what}"),
            OutOfRange { what } => write!(f, "requested {what} is outside the stream"),
        }
    }
}

impl From<TableError> for DecodeError {
    fn from(e: TableError) -> Self {
        DecodeError::Table(e)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DecodeError::Table(e) => Some(e),
            DecodeError::Rans { err, .. } => Some(err),
            _ => None,
        }
    }
}

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
    ProfileShape,
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
    /// No sample data was given to learn a profile.
    NoSamples,
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use EncodeError::*;
        match self {
            InvalidParam { what, got } => write!(f, "invalid parameter {what}: {got}"),
            ShapeMismatch { what } => write!(f, "input does not match its shape: {what}"),
            ProfileShape => {
                f.write_str("profile shape (layers, heads, head_dim) differs from the input's")
            }
            UnknownLevel { level, levels } => {
                write!(f, "level {level} not in profile (it has {levels} levels)")
            }
            NonFinite { layer, kv } => write!(f, "layer {layer} {kv} holds NaN or infinity"),
            NoSamples => f.write_str("no sample caches given to learn a profile from"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for EncodeError {}
