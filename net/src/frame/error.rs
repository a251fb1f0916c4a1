//! Why bytes are not a frame.

use std::fmt;

use super::Kind;

/// Why a frame was refused (`spec/STREAM.md` §4.2, checks F1-F8). Decoding returns one of these
/// for any bytes that are not exactly one valid frame; it never panics.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    /// F1: the bytes end before the frame does (the head, or the payload and CRC it announces).
    Truncated {
        /// Bytes the frame needs so far.
        needed: u64,
        /// Bytes there are.
        available: u64,
    },
    /// F2: the frame does not start with `KVCN`.
    Magic {
        /// The first four bytes.
        got: [u8; 4],
    },
    /// F3: a protocol version this side does not speak.
    Version {
        /// The frame's version.
        got: u8,
        /// The one version spoken.
        supported: u8,
    },
    /// F4: an unknown message type.
    Kind {
        /// The type byte.
        got: u8,
    },
    /// F5: the announced payload is longer than the receiver accepts (refused before reading
    /// or allocating it).
    TooLong {
        /// Payload bytes announced.
        len: u32,
        /// The receiver's limit.
        max: u32,
    },
    /// F6: the CRC-32C does not match the head and payload.
    Crc {
        /// The CRC in the frame.
        stored: u32,
        /// The CRC of the bytes.
        computed: u32,
    },
    /// F7: a payload field is out of its allowed range or the payload's length does not match
    /// its fields.
    Payload {
        /// The message type.
        kind: Kind,
        /// What is wrong.
        why: &'static str,
    },
    /// F8: a count or length in the payload is over the receiver's limit.
    Limit {
        /// The message type.
        kind: Kind,
        /// What was counted.
        what: &'static str,
        /// The count.
        got: u64,
        /// The limit.
        max: u64,
    },
}

impl FrameError {
    /// The check of `spec/STREAM.md` §4.2 that failed.
    pub fn check(&self) -> &'static str {
        match self {
            FrameError::Truncated { .. } => "F1",
            FrameError::Magic { .. } => "F2",
            FrameError::Version { .. } => "F3",
            FrameError::Kind { .. } => "F4",
            FrameError::TooLong { .. } => "F5",
            FrameError::Crc { .. } => "F6",
            FrameError::Payload { .. } => "F7",
            FrameError::Limit { .. } => "F8",
        }
    }
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Truncated { needed, available } => {
                write!(
                    f,
                    "truncated frame: {needed} bytes needed, {available} there"
                )
            }
            FrameError::Magic { got } => {
                write!(f, "not a kvc frame (starts with {got:02x?}, not \"KVCN\")")
            }
            FrameError::Version { got, supported } => write!(
                f,
                "protocol version {got} is not supported (this side speaks version {supported})"
            ),
            FrameError::Kind { got } => write!(f, "unknown message type 0x{got:02x}"),
            FrameError::TooLong { len, max } => {
                write!(f, "frame payload of {len} bytes is over the limit of {max}")
            }
            FrameError::Crc { stored, computed } => write!(
                f,
                "frame CRC mismatch (stored {stored:08x}, computed {computed:08x})"
            ),
            FrameError::Payload { kind, why } => write!(f, "bad {kind:?} frame: {why}"),
            FrameError::Limit {
                kind,
                what,
                got,
                max,
            } => write!(
                f,
                "bad {kind:?} frame: {got} {what}, over the limit of {max}"
            ),
        }
    }
}

impl std::error::Error for FrameError {}
