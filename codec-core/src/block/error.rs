//! Why a chunk is rejected: one variant per check of `spec/FORMAT.md` §5.5 (C1-C2, B1-B10).

use crate::bytes::{fmt_truncated, Truncated};
use crate::error::Kv;
use crate::rans::{RansError, TableError};
use core::fmt;

/// A chunk failed a check of `spec/FORMAT.md` §5.5; each variant names its check.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum BlockError {
    /// The chunk is shorter than its CRC (a stream's chunks never are: H27).
    ChunkTooShort {
        /// Bytes given.
        len: u64,
    },
    /// C1: the chunk's CRC does not match.
    Crc {
        /// The chunk.
        chunk: u32,
        /// CRC stored in the chunk.
        stored: u32,
        /// CRC computed over the chunk's other bytes.
        computed: u32,
    },
    /// B4 (and any fixed field): a block runs past the end of the chunk.
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes left in the chunk.
        available: u64,
    },
    /// B1: more escape values than value symbols.
    EscapeCount {
        /// `n_escapes` found.
        got: u64,
        /// The block's value symbols.
        max: u64,
    },
    /// B2: `n_exp` is 1 or above 16.
    ExpAlphabet {
        /// `n_exp` found.
        got: u8,
    },
    /// B3: the exponent table has a zero frequency or does not sum to 4096.
    ExpTable(TableError),
    /// B5: fewer bytes remain than the lane words the counts declare.
    LaneWords {
        /// Bytes the lane words need.
        needed: u64,
        /// Bytes left in the chunk.
        available: u64,
    },
    /// B6, B8: a lane's words do not decode cleanly.
    Rans {
        /// The chunk.
        chunk: u32,
        /// The layer.
        layer: u32,
        /// K or V.
        kv: Kv,
        /// The coder's error.
        err: RansError,
    },
    /// B7: an escape index without an escape value, or an escape value that is not canonical
    /// (`abs(v) <= R` or `abs(v) > 2^24`).
    BadEscape {
        /// The chunk.
        chunk: u32,
        /// The layer.
        layer: u32,
        /// K or V.
        kv: Kv,
    },
    /// B9: escape values left over after the last escape index.
    ExtraEscapes {
        /// The layer.
        layer: u32,
        /// K or V.
        kv: Kv,
    },
    /// B10: a stored sink value is NaN or infinite.
    SinkNotFinite {
        /// The layer.
        layer: u32,
        /// K or V.
        kv: Kv,
    },
    /// C2: bytes remain after the last block.
    TrailingBytes {
        /// Bytes left before the CRC.
        got: u64,
    },
    /// The chunk's level is not in the profile (checked for a whole stream at O4).
    UnknownLevel {
        /// Level asked for.
        level: u8,
        /// Levels in the profile.
        levels: u8,
    },
}

impl BlockError {
    /// The spec check this error reports (`"C1"`, `"B7"`, ...).
    pub fn check(&self) -> &'static str {
        use BlockError::*;
        match self {
            ChunkTooShort { .. } => "H27",
            Crc { .. } => "C1",
            Truncated { .. } => "B4",
            EscapeCount { .. } => "B1",
            ExpAlphabet { .. } => "B2",
            ExpTable(_) => "B3",
            LaneWords { .. } => "B5",
            Rans { err, .. } => match err {
                RansError::ZeroFinalWord { .. } => "B6",
                _ => "B8",
            },
            BadEscape { .. } => "B7",
            ExtraEscapes { .. } => "B9",
            SinkNotFinite { .. } => "B10",
            TrailingBytes { .. } => "C2",
            UnknownLevel { .. } => "O4",
        }
    }

    /// The spec's error class, as the golden vectors name it.
    pub fn kind(&self) -> &'static str {
        use BlockError::*;
        match self {
            ChunkTooShort { .. } | Truncated { .. } | LaneWords { .. } => "Truncated",
            Crc { .. } => "ChunkCrc",
            EscapeCount { .. } => "LimitExceeded",
            ExpAlphabet { .. } | SinkNotFinite { .. } => "InvalidField",
            ExpTable(_) => "Table",
            Rans { .. } => "Rans",
            BadEscape { .. } => "BadEscape",
            ExtraEscapes { .. } | TrailingBytes { .. } => "Inconsistent",
            UnknownLevel { .. } => "UnknownLevel",
        }
    }
}

impl From<Truncated> for BlockError {
    fn from(t: Truncated) -> Self {
        BlockError::Truncated {
            needed: t.needed,
            available: t.available,
        }
    }
}

impl fmt::Display for BlockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use BlockError::*;
        match self {
            ChunkTooShort { len } => fmt_truncated(f, "chunk", 4, *len),
            Crc {
                chunk,
                stored,
                computed,
            } => write!(
                f,
                "chunk {chunk} checksum mismatch (stored {stored:08x}, computed {computed:08x}): corrupt stream"
            ),
            Truncated { needed, available } => fmt_truncated(f, "chunk block", *needed, *available),
            EscapeCount { got, max } => write!(f, "escape count = {got} exceeds the limit {max}"),
            ExpAlphabet { got } => write!(f, "invalid step exponent alphabet size: {got}"),
            ExpTable(e) => write!(f, "malformed frequency table: {e}"),
            LaneWords { needed, available } => fmt_truncated(f, "lane words", *needed, *available),
            Rans {
                chunk,
                layer,
                kv,
                err,
            } => write!(
                f,
                "chunk {chunk}, layer {layer} {kv}: entropy decoding failed: {err}"
            ),
            BadEscape { chunk, .. } => write!(f, "chunk {chunk}: non-canonical escape value"),
            ExtraEscapes { .. } => {
                f.write_str("inconsistent stream: more escape values than escape symbols")
            }
            SinkNotFinite { layer, .. } => write!(f, "invalid sink value (not finite): {layer}"),
            TrailingBytes { .. } => f.write_str("inconsistent stream: trailing bytes in chunk"),
            UnknownLevel { level, levels } => {
                write!(f, "level {level} not in profile (it has {levels} levels)")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for BlockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BlockError::ExpTable(e) => Some(e),
            BlockError::Rans { err, .. } => Some(err),
            _ => None,
        }
    }
}
