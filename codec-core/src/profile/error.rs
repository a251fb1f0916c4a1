//! Why a profile's bytes are rejected: one variant per check of `spec/FORMAT.md` §4.6 (P1-P23).

use crate::bytes::{fmt_truncated, Truncated};
use crate::error::ShapeError;
use crate::rans::TableError;
use core::fmt;

/// A profile failed a check of `spec/FORMAT.md` §4.6; each variant names its check.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ProfileError {
    /// P1: the profile is larger than [`Limits::max_profile_bytes`](crate::Limits).
    TooLarge {
        /// Bytes given.
        got: u64,
        /// The limit.
        max: u64,
    },
    /// P2: the first four bytes are not `"KVCP"`.
    BadMagic {
        /// The bytes found.
        got: [u8; 4],
    },
    /// P3: a version other than 2 or 3.
    UnsupportedVersion {
        /// Version found.
        got: u16,
    },
    /// P4: the reserved u16 at offset 6 is not 0.
    ReservedField {
        /// Value found.
        got: u16,
    },
    /// A field runs past the end of the profile (before its CRC).
    Truncated {
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left.
        available: u64,
    },
    /// P5: the CRC-32C trailer does not match.
    Crc {
        /// CRC stored in the profile.
        stored: u32,
        /// CRC computed over the profile bytes.
        computed: u32,
    },
    /// P6: the shape fails H11-H13.
    Shape(ShapeError),
    /// P7: `n_levels` is 0 or above 16.
    LevelCount {
        /// Level count found.
        got: u8,
    },
    /// P8: a flag other than bit 0 is set.
    Flags {
        /// Flags found.
        got: u8,
    },
    /// P9: the reserved bytes 22..24 are not 0.
    ReservedBytes,
    /// P10: a level multiplier is not finite and `> 0`.
    LevelMultiplier {
        /// The level.
        level: u8,
        /// The multiplier's f32 bits.
        bits: u32,
    },
    /// P11: fewer bytes remain than the channel parameters need.
    ParamsTruncated {
        /// Bytes the records need.
        needed: u64,
        /// Bytes left.
        available: u64,
    },
    /// P12: a channel mean is not finite.
    ChannelMean {
        /// Record index, `(layer * 2 + kv) * C + channel`.
        record: u64,
        /// The mean's f32 bits (widened from bf16 in version 3).
        bits: u32,
    },
    /// P12: a delta or anchor step is not finite and `> 0`.
    ChannelStep {
        /// Record index.
        record: u64,
        /// The step's f32 bits.
        bits: u32,
    },
    /// P12: an anchor weight is above 16.
    AnchorWeight {
        /// Record index.
        record: u64,
        /// Weight found.
        got: u8,
    },
    /// P13: the 3 reserved bytes after `max_exp` are not 0.
    HintsReserved,
    /// P14: the importance parameters are out of range.
    ImportanceParams {
        /// `max_exp` found.
        max_exp: u8,
    },
    /// P15: fewer bytes remain than the query means and thresholds need.
    HintsTruncated {
        /// Bytes they need.
        needed: u64,
        /// Bytes left.
        available: u64,
    },
    /// P16: a query mean or score threshold is not finite.
    HintValue {
        /// Index among the query means then thresholds, in stored order.
        index: u64,
        /// Its f32 bits.
        bits: u32,
    },
    /// P17: a level's `n_tables` is 0 or above 256.
    TableCount {
        /// The level.
        level: u8,
        /// Table count found.
        got: u16,
    },
    /// P18: a table's radius is above 127.
    TableRadius {
        /// The level.
        level: u8,
        /// Radius found.
        got: u8,
    },
    /// P19, P20: a table has a zero frequency or does not sum to 4096.
    Table {
        /// The level.
        level: u8,
        /// Why the table was rejected.
        err: TableError,
    },
    /// P21: a down link names a table the level does not have.
    DownLink {
        /// The level.
        level: u8,
        /// Table id found.
        got: u8,
    },
    /// P22: a map entry names a table the level does not have.
    MapEntry {
        /// The level.
        level: u8,
        /// Table id found.
        got: u8,
    },
    /// P23: bytes remain after the last level's map.
    TrailingBytes {
        /// Bytes left before the CRC.
        got: u64,
    },
}

impl ProfileError {
    /// The spec check this error reports (`"P1"` ... `"P23"`; reads past the end: `"P"`).
    pub fn check(&self) -> &'static str {
        use ProfileError::*;
        match self {
            TooLarge { .. } => "P1",
            BadMagic { .. } => "P2",
            UnsupportedVersion { .. } => "P3",
            ReservedField { .. } => "P4",
            Truncated { .. } => "P",
            Crc { .. } => "P5",
            Shape(_) => "P6",
            LevelCount { .. } => "P7",
            Flags { .. } => "P8",
            ReservedBytes => "P9",
            LevelMultiplier { .. } => "P10",
            ParamsTruncated { .. } => "P11",
            ChannelMean { .. } | ChannelStep { .. } | AnchorWeight { .. } => "P12",
            HintsReserved => "P13",
            ImportanceParams { .. } => "P14",
            HintsTruncated { .. } => "P15",
            HintValue { .. } => "P16",
            TableCount { .. } => "P17",
            TableRadius { .. } => "P18",
            Table { err, .. } => match err {
                TableError::ZeroFrequency { .. } => "P19",
                _ => "P20",
            },
            DownLink { .. } => "P21",
            MapEntry { .. } => "P22",
            TrailingBytes { .. } => "P23",
        }
    }

    /// The spec's error class (`"Truncated"`, `"InvalidField"`, ...), as the golden vectors name
    /// it.
    pub fn kind(&self) -> &'static str {
        use ProfileError::*;
        match self {
            TooLarge { .. } => "LimitExceeded",
            BadMagic { .. } => "BadMagic",
            UnsupportedVersion { .. } => "UnsupportedVersion",
            Truncated { .. } | ParamsTruncated { .. } | HintsTruncated { .. } => "Truncated",
            Crc { .. } => "ProfileCrc",
            Shape(e) => e.kind(),
            Table { .. } => "Table",
            TrailingBytes { .. } => "Inconsistent",
            ReservedField { .. }
            | LevelCount { .. }
            | Flags { .. }
            | ReservedBytes
            | LevelMultiplier { .. }
            | ChannelMean { .. }
            | ChannelStep { .. }
            | AnchorWeight { .. }
            | HintsReserved
            | ImportanceParams { .. }
            | HintValue { .. }
            | TableCount { .. }
            | TableRadius { .. }
            | DownLink { .. }
            | MapEntry { .. } => "InvalidField",
        }
    }
}

impl From<Truncated> for ProfileError {
    fn from(t: Truncated) -> Self {
        ProfileError::Truncated {
            needed: t.needed,
            available: t.available,
        }
    }
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use ProfileError::*;
        let invalid =
            |f: &mut fmt::Formatter<'_>, what: &str, got: u64| write!(f, "invalid {what}: {got}");
        match *self {
            TooLarge { got, max } => write!(f, "profile size = {got} exceeds the limit {max}"),
            BadMagic { got } => write!(f, "not a kvc profile: bad magic {got:02x?}"),
            UnsupportedVersion { got } => write!(f, "unsupported profile format version {got}"),
            ReservedField { got } => invalid(f, "profile reserved field", u64::from(got)),
            Truncated { needed, available } => fmt_truncated(f, "profile", needed, available),
            Crc { stored, computed } => write!(
                f,
                "profile checksum mismatch (stored {stored:08x}, computed {computed:08x}): corrupt profile"
            ),
            Shape(e) => e.fmt(f),
            LevelCount { got } => invalid(f, "profile level count", u64::from(got)),
            Flags { got } => invalid(f, "profile flags", u64::from(got)),
            ReservedBytes => invalid(f, "profile reserved field", 1),
            LevelMultiplier { bits, .. } => invalid(f, "level multiplier", u64::from(bits)),
            ParamsTruncated { needed, available } => {
                fmt_truncated(f, "profile channel parameters", needed, available)
            }
            ChannelMean { bits, .. } => invalid(f, "channel mean", u64::from(bits)),
            ChannelStep { bits, .. } => invalid(f, "channel step", u64::from(bits)),
            AnchorWeight { got, .. } => invalid(f, "anchor weight", u64::from(got)),
            HintsReserved => invalid(f, "profile reserved field", 2),
            ImportanceParams { max_exp } => {
                invalid(f, "importance parameters", u64::from(max_exp))
            }
            HintsTruncated { needed, available } => {
                fmt_truncated(f, "profile query means", needed, available)
            }
            HintValue { bits, .. } => {
                invalid(f, "query mean or score threshold", u64::from(bits))
            }
            TableCount { got, .. } => invalid(f, "table count", u64::from(got)),
            TableRadius { got, .. } => invalid(f, "table radius", u64::from(got)),
            Table { err, .. } => write!(f, "malformed frequency table: {err}"),
            DownLink { got, .. } => invalid(f, "table id in down links", u64::from(got)),
            MapEntry { got, .. } => invalid(f, "table id in map", u64::from(got)),
            TrailingBytes { .. } => {
                f.write_str("inconsistent stream: trailing bytes after profile tables")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ProfileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProfileError::Shape(e) => Some(e),
            ProfileError::Table { err, .. } => Some(err),
            _ => None,
        }
    }
}
