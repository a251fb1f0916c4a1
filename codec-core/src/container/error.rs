//! The container's errors: [`HeaderError`] (checks H1-H32 of `spec/FORMAT.md` §3.7),
//! [`OpenError`] (O1-O4), and [`DecodeError`], which wraps every stage's error.

use crate::block::BlockError;
use crate::bytes::{fmt_truncated, Truncated};
use crate::error::ShapeError;
use crate::profile::ProfileError;
use core::fmt;

/// A stream header failed a check of `spec/FORMAT.md` §3.7; each variant names its check.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum HeaderError {
    /// H1-H4: the stream ends inside the fixed fields or before `header_len`.
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        available: u64,
    },
    /// H1: the first four bytes are not `"KVCS"`.
    BadMagic {
        /// The bytes found.
        got: [u8; 4],
    },
    /// H2: a version other than 2.
    UnsupportedVersion {
        /// Version found.
        got: u16,
    },
    /// H3: `header_len` is below the 106 bytes of an empty header.
    HeaderLen {
        /// Value found.
        got: u32,
        /// The smallest valid value.
        min: u32,
    },
    /// H5: the header CRC does not match.
    Crc {
        /// CRC stored in the stream.
        stored: u32,
        /// CRC computed over the header bytes.
        computed: u32,
    },
    /// H6: flags are not 0.
    Flags {
        /// Value found.
        got: u16,
    },
    /// H7: dtype not in `{0, 1, 2}`.
    Dtype {
        /// Code found.
        got: u8,
    },
    /// H8: rope style not in `{0, 1, 2}`.
    RopeStyle {
        /// Code found.
        got: u8,
    },
    /// H9: `k_pre_rope` not 0 or 1.
    KPreRope {
        /// Value found.
        got: u8,
    },
    /// H10: the reserved byte at offset 15 is not 0.
    Reserved {
        /// Value found.
        got: u8,
    },
    /// H11-H13: a zero dimension, or layers or channels above the caller's limits.
    Shape(ShapeError),
    /// H14: more tokens than [`Limits::max_tokens`](crate::Limits).
    Tokens {
        /// Tokens found.
        got: u32,
        /// The limit.
        max: u32,
    },
    /// H15: more decoded elements than [`Limits::max_elements`](crate::Limits), or one tensor
    /// larger than this platform can address (`max` is then `usize::MAX / 8`).
    Elements {
        /// Elements found (of the stream, or of one tensor).
        got: u64,
        /// The limit.
        max: u64,
        /// `true` for the platform's limit on one tensor.
        platform: bool,
    },
    /// H16: rope theta or scaling is NaN or infinite.
    Rope {
        /// Theta's f32 bits.
        theta_bits: u32,
        /// Scaling's f32 bits.
        scaling_bits: u32,
    },
    /// H17: `chunk_tokens` is 0.
    ChunkTokensZero,
    /// H18: `group` is 0 or above 1024.
    Group {
        /// Value found.
        got: u16,
    },
    /// H19: the embedded profile is larger than [`Limits::max_profile_bytes`](crate::Limits).
    ProfileLen {
        /// Bytes declared.
        got: u64,
        /// The limit.
        max: u64,
    },
    /// H20: more chunks than [`Limits::max_chunks`](crate::Limits).
    Chunks {
        /// Chunks declared.
        got: u32,
        /// The limit.
        max: u32,
    },
    /// H21: the model id is longer than 1024 bytes.
    ModelIdLen {
        /// Bytes declared.
        got: u16,
        /// The limit.
        max: u16,
    },
    /// H22: `header_len` is not `102 + model_id_len + 24 * n_chunks + 4`.
    HeaderLenMismatch {
        /// `header_len` found.
        got: u64,
        /// What the model id and chunk count make it.
        expected: u64,
    },
    /// H23: the model id is not UTF-8.
    ModelIdUtf8 {
        /// Its length in bytes.
        len: u16,
    },
    /// H24: the stream ends inside the embedded profile.
    ProfileTruncated {
        /// Bytes the profile declares.
        needed: u64,
        /// Bytes after the header.
        available: u64,
    },
    /// H25: a chunk index entry's reserved bytes are not 0.
    IndexReserved {
        /// The chunk.
        chunk: u32,
    },
    /// H26: a chunk's offset is not where the previous chunk ends.
    ChunkOffset {
        /// The chunk.
        chunk: u32,
        /// Offset found.
        got: u64,
        /// The running offset.
        expected: u64,
    },
    /// H27: a chunk is shorter than its 4-byte CRC.
    ChunkLen {
        /// The chunk.
        chunk: u32,
        /// `len_bytes` found.
        got: u32,
    },
    /// H28: a chunk does not start at the running token count, is empty, or holds more than
    /// `chunk_tokens` tokens.
    ChunkTokens {
        /// The chunk.
        chunk: u32,
    },
    /// H29: a chunk runs past the end of the stream.
    ChunkTruncated {
        /// The chunk.
        chunk: u32,
        /// Stream bytes needed through the end of the chunk.
        needed: u64,
        /// Stream bytes present.
        available: u64,
    },
    /// H30: the running token count exceeds `2^32 - 1`.
    TokenOverflow {
        /// The chunk.
        chunk: u32,
    },
    /// H31: the chunks' token counts do not sum to `tokens`.
    TokenSum {
        /// The sum.
        got: u32,
        /// `tokens`.
        expected: u32,
    },
    /// H32: the last chunk does not end at the end of the stream.
    TrailingBytes {
        /// Where the last chunk ends.
        end: u64,
        /// The stream's length.
        len: u64,
    },
}

impl HeaderError {
    /// The spec check this error reports (`"H1"` ... `"H32"`).
    pub fn check(&self) -> &'static str {
        use HeaderError::*;
        match self {
            Truncated { .. } => "H4",
            BadMagic { .. } => "H1",
            UnsupportedVersion { .. } => "H2",
            HeaderLen { .. } => "H3",
            Crc { .. } => "H5",
            Flags { .. } => "H6",
            Dtype { .. } => "H7",
            RopeStyle { .. } => "H8",
            KPreRope { .. } => "H9",
            Reserved { .. } => "H10",
            Shape(ShapeError::ZeroDimension { .. }) => "H11",
            Shape(ShapeError::Layers { .. }) => "H12",
            Shape(_) => "H13",
            Tokens { .. } => "H14",
            Elements { .. } => "H15",
            Rope { .. } => "H16",
            ChunkTokensZero => "H17",
            Group { .. } => "H18",
            ProfileLen { .. } => "H19",
            Chunks { .. } => "H20",
            ModelIdLen { .. } => "H21",
            HeaderLenMismatch { .. } => "H22",
            ModelIdUtf8 { .. } => "H23",
            ProfileTruncated { .. } => "H24",
            IndexReserved { .. } => "H25",
            ChunkOffset { .. } => "H26",
            ChunkLen { .. } => "H27",
            ChunkTokens { .. } => "H28",
            ChunkTruncated { .. } => "H29",
            TokenOverflow { .. } => "H30",
            TokenSum { .. } => "H31",
            TrailingBytes { .. } => "H32",
        }
    }

    /// The spec's error class (`"Truncated"`, `"InvalidField"`, ...), as the golden vectors name
    /// it.
    pub fn kind(&self) -> &'static str {
        use HeaderError::*;
        match self {
            Truncated { .. } | ProfileTruncated { .. } | ChunkTruncated { .. } => "Truncated",
            BadMagic { .. } => "BadMagic",
            UnsupportedVersion { .. } => "UnsupportedVersion",
            Crc { .. } => "HeaderCrc",
            Shape(e) => e.kind(),
            Tokens { .. }
            | Elements { .. }
            | ProfileLen { .. }
            | Chunks { .. }
            | ModelIdLen { .. } => "LimitExceeded",
            HeaderLenMismatch { .. }
            | ChunkOffset { .. }
            | ChunkTokens { .. }
            | TokenOverflow { .. }
            | TokenSum { .. }
            | TrailingBytes { .. } => "Inconsistent",
            HeaderLen { .. }
            | Flags { .. }
            | Dtype { .. }
            | RopeStyle { .. }
            | KPreRope { .. }
            | Reserved { .. }
            | Rope { .. }
            | ChunkTokensZero
            | Group { .. }
            | ModelIdUtf8 { .. }
            | IndexReserved { .. }
            | ChunkLen { .. } => "InvalidField",
        }
    }
}

impl From<Truncated> for HeaderError {
    fn from(t: Truncated) -> Self {
        HeaderError::Truncated {
            needed: t.needed,
            available: t.available,
        }
    }
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use HeaderError::*;
        let invalid =
            |f: &mut fmt::Formatter<'_>, what: &str, got: u64| write!(f, "invalid {what}: {got}");
        let limit = |f: &mut fmt::Formatter<'_>, what: &str, got: u64, max: u64| {
            write!(f, "{what} = {got} exceeds the limit {max}")
        };
        let inconsistent =
            |f: &mut fmt::Formatter<'_>, what: &str| write!(f, "inconsistent stream: {what}");
        match *self {
            Truncated { needed, available } => fmt_truncated(f, "stream header", needed, available),
            BadMagic { got } => write!(f, "not a kvc stream: bad magic {got:02x?}"),
            UnsupportedVersion { got } => write!(f, "unsupported stream format version {got}"),
            HeaderLen { got, .. } => invalid(f, "header_len", u64::from(got)),
            Crc { stored, computed } => write!(
                f,
                "header checksum mismatch (stored {stored:08x}, computed {computed:08x}): corrupt stream"
            ),
            Flags { got } => invalid(f, "flags", u64::from(got)),
            Dtype { got } => invalid(f, "dtype", u64::from(got)),
            RopeStyle { got } => invalid(f, "rope style", u64::from(got)),
            KPreRope { got } => invalid(f, "k_pre_rope", u64::from(got)),
            Reserved { got } => invalid(f, "reserved byte", u64::from(got)),
            Shape(e) => e.fmt(f),
            Tokens { got, max } => limit(f, "tokens", u64::from(got), u64::from(max)),
            Elements {
                got,
                max,
                platform,
            } => {
                let what = if platform {
                    "tensor elements on this platform"
                } else {
                    "decoded elements"
                };
                limit(f, what, got, max)
            }
            Rope { theta_bits, .. } => invalid(f, "rope theta/scaling", u64::from(theta_bits)),
            ChunkTokensZero => invalid(f, "chunk_tokens", 0),
            Group { got } => invalid(f, "group", u64::from(got)),
            ProfileLen { got, max } => limit(f, "embedded profile size", got, max),
            Chunks { got, max } => limit(f, "chunks", u64::from(got), u64::from(max)),
            ModelIdLen { got, max } => {
                limit(f, "model id length", u64::from(got), u64::from(max))
            }
            HeaderLenMismatch { .. } => {
                inconsistent(f, "header_len does not match model id and chunk count")
            }
            ModelIdUtf8 { len } => invalid(f, "model id (not UTF-8)", u64::from(len)),
            ProfileTruncated { needed, available } => {
                fmt_truncated(f, "embedded profile", needed, available)
            }
            IndexReserved { .. } => invalid(f, "chunk index reserved bytes", 1),
            ChunkOffset { .. } => inconsistent(f, "chunk offsets are not contiguous"),
            ChunkLen { got, .. } => invalid(f, "chunk len_bytes", u64::from(got)),
            ChunkTokens { .. } => inconsistent(f, "chunk token ranges do not tile the stream"),
            ChunkTruncated {
                needed, available, ..
            } => fmt_truncated(f, "chunk", needed, available),
            TokenOverflow { .. } => inconsistent(f, "chunk token ranges overflow"),
            TokenSum { .. } => inconsistent(f, "chunk token ranges do not add up to tokens"),
            TrailingBytes { .. } => inconsistent(f, "trailing bytes after the last chunk"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for HeaderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HeaderError::Shape(e) => Some(e),
            _ => None,
        }
    }
}

/// A stream's header parsed, but its profile does not fit it: checks O1-O4 of
/// `spec/FORMAT.md` §3.7 (an embedded profile that fails to parse is a [`ProfileError`]).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum OpenError {
    /// O1′: the stream does not embed its profile and none was supplied.
    ProfileRequired {
        /// The hash the stream names.
        hash: [u8; 32],
    },
    /// O2: the profile is not the one the stream was encoded with.
    ProfileMismatch {
        /// The hash the stream names.
        expected: [u8; 32],
        /// The hash of the profile at hand.
        got: [u8; 32],
    },
    /// O3: the profile's `(layers, kv_heads, head_dim)` differ from the stream's.
    ProfileShape {
        /// The stream's.
        stream: [u32; 3],
        /// The profile's.
        profile: [u32; 3],
    },
    /// O4: a chunk's level is not in the profile.
    UnknownLevel {
        /// The chunk.
        chunk: u32,
        /// Level found.
        level: u8,
        /// Levels in the profile.
        levels: u8,
    },
}

impl OpenError {
    /// The spec check this error reports (`"O1′"` ... `"O4"`).
    pub fn check(&self) -> &'static str {
        match self {
            OpenError::ProfileRequired { .. } => "O1′",
            OpenError::ProfileMismatch { .. } => "O2",
            OpenError::ProfileShape { .. } => "O3",
            OpenError::UnknownLevel { .. } => "O4",
        }
    }

    /// The spec's error class, as the golden vectors name it.
    pub fn kind(&self) -> &'static str {
        match self {
            OpenError::ProfileRequired { .. } => "ProfileRequired",
            OpenError::ProfileMismatch { .. } => "ProfileMismatch",
            OpenError::ProfileShape { .. } => "ProfileShape",
            OpenError::UnknownLevel { .. } => "UnknownLevel",
        }
    }
}

/// The first 8 bytes of a hash in hex.
fn hex8(h: &[u8; 32]) -> impl fmt::Display + '_ {
    struct H<'a>(&'a [u8; 32]);
    impl fmt::Display for H<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            self.0[..8].iter().try_for_each(|b| write!(f, "{b:02x}"))
        }
    }
    H(h)
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpenError::ProfileRequired { hash } => write!(
                f,
                "stream was encoded with profile {} and does not embed it: pass that profile",
                hex8(hash)
            ),
            OpenError::ProfileMismatch { expected, got } => write!(
                f,
                "wrong profile: stream needs {}, given {}",
                hex8(expected),
                hex8(got)
            ),
            OpenError::ProfileShape { .. } => {
                f.write_str("profile shape (layers, heads, head_dim) differs from the stream's")
            }
            OpenError::UnknownLevel { level, levels, .. } => {
                write!(f, "level {level} not in profile (it has {levels} levels)")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for OpenError {}

/// Everything that can go wrong reading a stream, a chunk or a profile: the error of the stage
/// that rejected the input, or a request the stream cannot serve.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The stream header or chunk index (`spec/FORMAT.md` §3.7, H1-H32).
    Header(HeaderError),
    /// The profile, embedded or supplied (§4.6, P1-P23).
    Profile(ProfileError),
    /// The profile does not fit the stream (§3.7, O1-O4).
    Open(OpenError),
    /// A chunk or one of its blocks (§5.5, C1-C2, B1-B10).
    Block(BlockError),
    /// The caller's output buffers do not match the stream.
    OutputMismatch {
        /// What does not match.
        what: &'static str,
    },
    /// A chunk or token range outside the stream was requested.
    OutOfRange {
        /// What was requested.
        what: &'static str,
    },
    /// A [`DetachedStream`](super::DetachedStream) was attached to bytes other than those it
    /// was opened from.
    OtherBytes {
        /// The length of the bytes it was opened from.
        opened: usize,
        /// The length of the bytes given.
        given: usize,
    },
}

impl DecodeError {
    /// The spec's error class (`"Truncated"`, `"ChunkCrc"`, ...): the names `spec/FORMAT.md`
    /// and the golden vectors in `spec/vectors/` use.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::Header(e) => e.kind(),
            DecodeError::Profile(e) => e.kind(),
            DecodeError::Open(e) => e.kind(),
            DecodeError::Block(e) => e.kind(),
            DecodeError::OutputMismatch { .. } => "OutputMismatch",
            DecodeError::OutOfRange { .. } => "OutOfRange",
            DecodeError::OtherBytes { .. } => "OtherBytes",
        }
    }

    /// The spec check that rejected the input (`"H5"`, `"P19"`, `"B7"`, ...), or `None` for a
    /// request the stream cannot serve.
    pub fn check(&self) -> Option<&'static str> {
        match self {
            DecodeError::Header(e) => Some(e.check()),
            DecodeError::Profile(e) => Some(e.check()),
            DecodeError::Open(e) => Some(e.check()),
            DecodeError::Block(e) => Some(e.check()),
            DecodeError::OutputMismatch { .. }
            | DecodeError::OutOfRange { .. }
            | DecodeError::OtherBytes { .. } => None,
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Header(e) => e.fmt(f),
            DecodeError::Profile(e) => e.fmt(f),
            DecodeError::Open(e) => e.fmt(f),
            DecodeError::Block(e) => e.fmt(f),
            DecodeError::OutputMismatch { what } => {
                write!(f, "output buffer does not match the stream: {what}")
            }
            DecodeError::OutOfRange { what } => write!(f, "requested {what} is outside the stream"),
            DecodeError::OtherBytes { opened, given } => write!(
                f,
                "bytes other than those the stream was opened from ({given} bytes given, \
                 {opened} opened, or another header)"
            ),
        }
    }
}

impl From<HeaderError> for DecodeError {
    fn from(e: HeaderError) -> Self {
        DecodeError::Header(e)
    }
}
impl From<ProfileError> for DecodeError {
    fn from(e: ProfileError) -> Self {
        DecodeError::Profile(e)
    }
}
impl From<OpenError> for DecodeError {
    fn from(e: OpenError) -> Self {
        DecodeError::Open(e)
    }
}
impl From<BlockError> for DecodeError {
    fn from(e: BlockError) -> Self {
        DecodeError::Block(e)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DecodeError::Header(e) => Some(e),
            DecodeError::Profile(e) => Some(e),
            DecodeError::Open(e) => Some(e),
            DecodeError::Block(e) => Some(e),
            _ => None,
        }
    }
}
