//! The frame codec of the wire protocol (`spec/STREAM.md` §4): pure and synchronous, so that
//! the fuzzer and the tests drive it without a runtime.
//!
//! ```text
//! offset size field
//!  0     4    magic "KVCN"
//!  4     1    protocol version (1)
//!  5     1    message type
//!  6     4    payload length n (u32 LE), checked against the receiver's limit before reading
//! 10     n    payload (the message's fields, §4.3)
//! 10+n   4    CRC-32C of bytes 0 .. 10+n (u32 LE)
//! ```
//!
//! ```
//! use kvc_net::frame::{decode, Limits, Message, FrameError};
//!
//! let bytes = Message::Open { context: "gpl3".into() }.encode();
//! let (msg, used) = decode(&bytes, &Limits::DEFAULT)?;
//! assert_eq!((msg, used), (Message::Open { context: "gpl3".into() }, bytes.len()));
//! // A head announcing more than the receiver accepts is refused from its 10 bytes alone.
//! let tight = Limits { max_payload: 3, ..Limits::DEFAULT };
//! assert!(matches!(decode(&bytes[..10], &tight), Err(FrameError::TooLong { len: 4, max: 3 })));
//! # Ok::<(), FrameError>(())
//! ```

mod error;
mod message;

pub use error::FrameError;
pub use message::{encode_chunk, ErrorCode, Info, Message, CHUNK_PREFIX, TEXT_PREFIX};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVCN";
/// The protocol version this implementation speaks (byte 4 of every frame).
pub const VERSION: u8 = 1;
/// Bytes of a frame's head (magic, version, type, payload length).
pub const HEAD_LEN: usize = 10;
/// Bytes of a frame's CRC.
pub const CRC_LEN: usize = 4;
/// The least `max_payload` a `Hello` may announce: every `Error` frame fits in it.
pub const MIN_MAX_PAYLOAD: u32 = 4096;

/// The length every chunk entry of an `Info`'s header template has (`spec/STREAM.md` §4.3):
/// the template is the header of a stream whose chunks are this long, which a receiver checks
/// as such (`FORMAT.md` §3.7) before taking the real sizes from the `Info`.
pub const PLACEHOLDER_CHUNK_LEN: u32 = 4;

/// Message types (byte 5 of a frame): client messages below 0x80, server messages from 0x80.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Client: opens the session.
    Hello = 0x01,
    /// Client: names the context.
    Open = 0x02,
    /// Client: asks for a chunk.
    Get = 0x03,
    /// Client: ends the session.
    Bye = 0x04,
    /// Server: describes the context.
    Info = 0x81,
    /// Server: a chunk's bytes at a level.
    Chunk = 0x82,
    /// Server: a chunk's token ids.
    Text = 0x83,
    /// Server: refuses a request; the connection closes after it.
    Error = 0x84,
}

impl Kind {
    /// The type of a type byte.
    pub fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            0x01 => Kind::Hello,
            0x02 => Kind::Open,
            0x03 => Kind::Get,
            0x04 => Kind::Bye,
            0x81 => Kind::Info,
            0x82 => Kind::Chunk,
            0x83 => Kind::Text,
            0x84 => Kind::Error,
            _ => return None,
        })
    }
}

/// What a receiver accepts. Every count and length of a frame is checked against these (and
/// against the bytes present) before anything is allocated for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload, bytes.
    pub max_payload: u32,
    /// Longest context name, bytes.
    pub max_name: usize,
    /// Most chunks an `Info` may describe.
    pub max_chunks: u32,
    /// Longest `Error` message, bytes.
    pub max_message: usize,
}

impl Limits {
    /// The defaults of `spec/STREAM.md` §4.5: 256 MiB payloads, 255-byte names, 1M chunks,
    /// 1 KiB error messages.
    pub const DEFAULT: Limits = Limits {
        max_payload: 256 << 20,
        max_name: 255,
        max_chunks: 1 << 20,
        max_message: 1024,
    };
    /// What a server accepts from clients: client frames are small (a name at most).
    pub const CLIENT_FRAMES: Limits = Limits {
        max_payload: 4096,
        ..Limits::DEFAULT
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// A frame's head, checked (F2-F5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    /// The message type.
    pub kind: Kind,
    /// Payload bytes.
    pub len: u32,
}

impl Head {
    /// Parses and checks the head at the start of `bytes` (magic, version, type, length
    /// against `limits`): what a reader does before reading, or allocating for, the payload.
    pub fn parse(bytes: &[u8], limits: &Limits) -> Result<Head, FrameError> {
        let h: &[u8; HEAD_LEN] = bytes
            .get(..HEAD_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(FrameError::Truncated {
                needed: HEAD_LEN as u64,
                available: bytes.len() as u64,
            })?;
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(FrameError::Magic { got: magic });
        }
        if h[4] != VERSION {
            let (got, supported) = (h[4], VERSION);
            return Err(FrameError::Version { got, supported });
        }
        let kind = Kind::from_byte(h[5]).ok_or(FrameError::Kind { got: h[5] })?;
        let len = u32::from_le_bytes([h[6], h[7], h[8], h[9]]);
        if len > limits.max_payload {
            let max = limits.max_payload;
            return Err(FrameError::TooLong { len, max });
        }
        Ok(Head { kind, len })
    }

    /// Bytes of the whole frame: head, payload and CRC.
    pub fn frame_len(&self) -> usize {
        HEAD_LEN + self.len as usize + CRC_LEN
    }
}

/// Decodes the frame at the start of `bytes`: the message and the frame's length in bytes
/// (bytes after it are left alone). Checks F1-F8 of `spec/STREAM.md` §4.2.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<(Message, usize), FrameError> {
    let head = Head::parse(bytes, limits)?;
    let n = head.frame_len();
    let frame = bytes.get(..n).ok_or(FrameError::Truncated {
        needed: n as u64,
        available: bytes.len() as u64,
    })?;
    let (body, crc) = frame.split_at(n - CRC_LEN);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(FrameError::Crc { stored, computed });
    }
    let msg = Message::decode_payload(head.kind, &body[HEAD_LEN..], limits)?;
    Ok((msg, n))
}

/// A whole frame around `payload`: head, payload, CRC.
fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
    frame_with(kind, payload.len(), |b| b.extend_from_slice(payload))
}

/// A whole frame whose payload of `len` bytes `write` appends.
fn frame_with(kind: Kind, len: usize, write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEAD_LEN + len + CRC_LEN);
    b.extend_from_slice(&MAGIC);
    b.push(VERSION);
    b.push(kind as u8);
    // Senders keep payloads under 4 GiB (Message::encode); past it the length field would not
    // match and the receiver would refuse the frame.
    b.extend_from_slice(&(len as u32).to_le_bytes());
    write(&mut b);
    debug_assert_eq!(b.len(), HEAD_LEN + len);
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}
