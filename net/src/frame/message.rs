//! The messages and their payloads (`spec/STREAM.md` §4.3). Decoding is canonical: a payload
//! decodes only if encoding its message gives it back byte for byte (no slack in lengths,
//! reserved bits or padding).

use codec_core::adapt::Choice;

use super::{frame, frame_with, FrameError, Kind, Limits, MIN_MAX_PAYLOAD};

/// One message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Client, first: the largest payload the client accepts.
    Hello {
        /// Bytes, at least [`MIN_MAX_PAYLOAD`].
        max_payload: u32,
    },
    /// Client: the context to stream (`[A-Za-z0-9_-][A-Za-z0-9._-]*`, at most `max_name` bytes).
    Open {
        /// The context's name (its store's directory name on the server).
        context: String,
    },
    /// Client: chunk `chunk` sent as `choice`.
    Get {
        /// The chunk's index.
        chunk: u32,
        /// A level on offer, or the chunk's text.
        choice: Choice,
    },
    /// Client: the session is over.
    Bye,
    /// Server, after `Open`: what the context is and how it can be sent.
    Info(Info),
    /// Server, after `Get` of a level: the chunk's bytes (its CRC included).
    Chunk {
        /// The chunk's index.
        chunk: u32,
        /// Its level.
        level: u8,
        /// Its bytes.
        bytes: Vec<u8>,
    },
    /// Server, after `Get` of text: the chunk's token ids.
    Text {
        /// The chunk's index.
        chunk: u32,
        /// Its token ids.
        tokens: Vec<u32>,
    },
    /// Server: the request is refused; the server closes the connection after it.
    Error {
        /// Why, for programs.
        code: ErrorCode,
        /// Why, for people (UTF-8, at most `max_message` bytes).
        message: String,
    },
}

/// What the server says about a context in `Info`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Info {
    /// The chunks' token ids can be sent (`Get` of text is allowed).
    pub text: bool,
    /// The levels on offer, strictly ascending (finest first).
    pub levels: Vec<u8>,
    /// `sizes[i * levels.len() + j]`: bytes of chunk `i` at `levels[j]`, its CRC included.
    pub sizes: Vec<u32>,
    /// The header template (`spec/STREAM.md` §4.3): the context's stream header with
    /// `profile_len` 0 and every chunk entry a 4-byte placeholder at the first level.
    pub header: Vec<u8>,
    /// The profile the chunks are coded against.
    pub profile: Vec<u8>,
}

impl Info {
    /// Chunks described.
    pub fn chunks(&self) -> usize {
        self.sizes.len() / self.levels.len().max(1)
    }
}

/// Why the server refused a request (`spec/STREAM.md` §4.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The client's protocol version is not spoken.
    Version = 1,
    /// The client's frame is malformed (F1-F8).
    Malformed = 2,
    /// A message out of order (`Get` before `Open`, a second `Hello`, a server message).
    Unexpected = 3,
    /// No context of that name.
    UnknownContext = 4,
    /// A chunk index, level or text that is not on offer.
    BadRequest = 5,
    /// A reply would be over the client's `max_payload`.
    TooLarge = 6,
    /// The server is at its connection cap.
    Busy = 7,
    /// The server failed (a store that does not open, I/O).
    Internal = 8,
    /// The client took too long to send a frame.
    Timeout = 9,
}

impl ErrorCode {
    /// The code of a wire value.
    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        use ErrorCode::*;
        [
            Version,
            Malformed,
            Unexpected,
            UnknownContext,
            BadRequest,
            TooLarge,
            Busy,
            Internal,
            Timeout,
        ]
        .into_iter()
        .find(|&c| c as u16 == v)
    }
}

/// `Get`'s choice byte.
const CHOICE_LEVEL: u8 = 0;
const CHOICE_TEXT: u8 = 1;
/// `Info`'s flag bit: token ids available.
const INFO_TEXT: u8 = 1;

impl Message {
    /// The message's type.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Hello { .. } => Kind::Hello,
            Message::Open { .. } => Kind::Open,
            Message::Get { .. } => Kind::Get,
            Message::Bye => Kind::Bye,
            Message::Info(_) => Kind::Info,
            Message::Chunk { .. } => Kind::Chunk,
            Message::Text { .. } => Kind::Text,
            Message::Error { .. } => Kind::Error,
        }
    }

    /// The whole frame of the message. Payloads must stay under 4 GiB (a sender checks them
    /// against the receiver's `max_payload` first).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            // The one large payload: written straight into the frame.
            Message::Chunk {
                chunk,
                level,
                bytes,
            } => encode_chunk(*chunk, *level, bytes),
            _ => frame(self.kind(), &self.payload()),
        }
    }

    /// The payload's bytes (but a `Chunk`'s: see [`encode_chunk`]).
    fn payload(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            Message::Hello { max_payload } => b.extend_from_slice(&max_payload.to_le_bytes()),
            Message::Open { context } => b.extend_from_slice(context.as_bytes()),
            Message::Get { chunk, choice } => {
                b.extend_from_slice(&chunk.to_le_bytes());
                b.extend_from_slice(&match *choice {
                    Choice::Level(l) => [CHOICE_LEVEL, l],
                    Choice::Text => [CHOICE_TEXT, 0],
                });
            }
            Message::Bye | Message::Chunk { .. } => {}
            Message::Info(info) => info.write(&mut b),
            Message::Text { chunk, tokens } => {
                b.extend_from_slice(&chunk.to_le_bytes());
                tokens
                    .iter()
                    .for_each(|t| b.extend_from_slice(&t.to_le_bytes()));
            }
            Message::Error { code, message } => {
                b.extend_from_slice(&(*code as u16).to_le_bytes());
                b.extend_from_slice(message.as_bytes());
            }
        }
        b
    }

    /// Decodes the payload of a frame of type `kind` (F7, F8).
    pub(super) fn decode_payload(
        kind: Kind,
        payload: &[u8],
        limits: &Limits,
    ) -> Result<Message, FrameError> {
        let mut r = Reader {
            kind,
            rest: payload,
        };
        let msg = match kind {
            Kind::Hello => {
                let max_payload = r.u32()?;
                if max_payload < MIN_MAX_PAYLOAD {
                    return Err(r.bad("max_payload is under 4096"));
                }
                Message::Hello { max_payload }
            }
            Kind::Open => Message::Open {
                context: context_name(&mut r, limits)?,
            },
            Kind::Get => get(&mut r)?,
            Kind::Bye => Message::Bye,
            Kind::Info => Message::Info(Info::read(&mut r, limits)?),
            Kind::Chunk => Message::Chunk {
                chunk: r.u32()?,
                level: r.u8()?,
                bytes: r.rest().to_vec(),
            },
            Kind::Text => text(&mut r)?,
            Kind::Error => error(&mut r, limits)?,
        };
        r.end()?;
        Ok(msg)
    }
}

/// Bytes of a `Chunk` payload before its chunk's bytes: the chunk's index and its level.
pub const CHUNK_PREFIX: usize = 5;
/// Bytes of a `Text` payload before its token ids (4 bytes each): the chunk's index.
pub const TEXT_PREFIX: usize = 4;

/// The frame of `Message::Chunk { chunk, level, bytes }` from borrowed bytes (what a server
/// sends out of its store without copying the chunk twice).
pub fn encode_chunk(chunk: u32, level: u8, bytes: &[u8]) -> Vec<u8> {
    frame_with(Kind::Chunk, CHUNK_PREFIX + bytes.len(), |b| {
        b.extend_from_slice(&chunk.to_le_bytes());
        b.push(level);
        b.extend_from_slice(bytes);
    })
}

fn get(r: &mut Reader<'_>) -> Result<Message, FrameError> {
    let chunk = r.u32()?;
    let choice = match (r.u8()?, r.u8()?) {
        (CHOICE_LEVEL, l) => Choice::Level(l),
        (CHOICE_TEXT, 0) => Choice::Text,
        (CHOICE_TEXT, _) => return Err(r.bad("a text choice with a non-zero level byte")),
        _ => return Err(r.bad("choice is neither 0 (level) nor 1 (text)")),
    };
    Ok(Message::Get { chunk, choice })
}

fn text(r: &mut Reader<'_>) -> Result<Message, FrameError> {
    let chunk = r.u32()?;
    let ids = r.rest();
    if !ids.len().is_multiple_of(4) {
        return Err(r.bad("token ids are not a whole number of u32"));
    }
    let tokens = ids
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Message::Text { chunk, tokens })
}

fn error(r: &mut Reader<'_>, limits: &Limits) -> Result<Message, FrameError> {
    let v = r.u16()?;
    let code = ErrorCode::from_u16(v).ok_or_else(|| r.bad("unknown error code"))?;
    let text = r.rest();
    r.limit("message bytes", text.len(), limits.max_message)?;
    let message = std::str::from_utf8(text)
        .map_err(|_| r.bad("the message is not UTF-8"))?
        .to_string();
    Ok(Message::Error { code, message })
}

/// `Open`'s name: 1 to `max_name` bytes of `[A-Za-z0-9._-]`, not starting with a dot (a
/// directory name under the server's root that cannot climb out of it or hide).
fn context_name(r: &mut Reader<'_>, limits: &Limits) -> Result<String, FrameError> {
    let name = r.rest();
    r.limit("context name bytes", name.len(), limits.max_name)?;
    let ok = |c: &u8| c.is_ascii_alphanumeric() || b"._-".contains(c);
    if name.is_empty() || name[0] == b'.' || !name.iter().all(ok) {
        return Err(r.bad("the context name is not [A-Za-z0-9_-][A-Za-z0-9._-]*"));
    }
    Ok(name.iter().map(|&c| char::from(c)).collect())
}

impl Info {
    /// `flags u8 | n_levels u8 | levels | n_chunks u32 | sizes u32[n_chunks * n_levels] |
    /// header_len u32 | header | profile`.
    fn write(&self, b: &mut Vec<u8>) {
        b.push(if self.text { INFO_TEXT } else { 0 });
        b.push(self.levels.len() as u8);
        b.extend_from_slice(&self.levels);
        b.extend_from_slice(&(self.chunks() as u32).to_le_bytes());
        self.sizes
            .iter()
            .for_each(|s| b.extend_from_slice(&s.to_le_bytes()));
        b.extend_from_slice(&(self.header.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.header);
        b.extend_from_slice(&self.profile);
    }

    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Info, FrameError> {
        let flags = r.u8()?;
        if flags & !INFO_TEXT != 0 {
            return Err(r.bad("reserved flag bits are set"));
        }
        let n_levels = r.u8()?;
        let levels = r.take(usize::from(n_levels))?.to_vec();
        if levels.is_empty() || !levels.windows(2).all(|w| w[0] < w[1]) {
            return Err(r.bad("the levels are empty or not strictly ascending"));
        }
        let chunks = r.u32()?;
        r.limit("chunks", chunks as usize, limits.max_chunks as usize)?;
        // At most 1M chunks x 255 levels x 4 bytes: no overflow; `take` checks the bytes exist
        // before anything is allocated.
        let raw = r.take(chunks as usize * levels.len() * 4)?;
        let sizes: Vec<u32> = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if sizes.iter().any(|&s| s < 4) {
            return Err(r.bad("a chunk size is under 4 bytes (its CRC)"));
        }
        let header_len = r.u32()?;
        let header = r.take(header_len as usize)?.to_vec();
        let profile = r.rest().to_vec();
        Ok(Info {
            text: flags & INFO_TEXT != 0,
            levels,
            sizes,
            header,
            profile,
        })
    }
}

/// Reads a payload's fields, each checked against the bytes left.
struct Reader<'a> {
    kind: Kind,
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if n > self.rest.len() {
            return Err(self.bad("a field runs past the payload's end"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// Everything left.
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }
    /// The payload must end here.
    fn end(&self) -> Result<(), FrameError> {
        match self.rest.is_empty() {
            true => Ok(()),
            false => Err(self.bad("bytes after the last field")),
        }
    }
    fn bad(&self, why: &'static str) -> FrameError {
        FrameError::Payload {
            kind: self.kind,
            why,
        }
    }
    fn limit(&self, what: &'static str, got: usize, max: usize) -> Result<(), FrameError> {
        if got > max {
            let (got, max) = (got as u64, max as u64);
            return Err(FrameError::Limit {
                kind: self.kind,
                what,
                got,
                max,
            });
        }
        Ok(())
    }
}
