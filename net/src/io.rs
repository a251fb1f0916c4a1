//! Frames over async byte streams: what the server and the client share.

use std::fmt;
use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::frame::{decode, FrameError, Head, Limits, Message, HEAD_LEN};

/// Why no frame was read.
#[derive(Debug)]
pub enum ReadError {
    /// The socket failed.
    Io(io::Error),
    /// The bytes are not a valid frame.
    Frame(FrameError),
    /// The peer closed the connection in the middle of a frame.
    Closed,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Frame(e) => write!(f, "{e}"),
            ReadError::Closed => f.write_str("the connection closed in the middle of a frame"),
        }
    }
}

/// Reads one frame: `None` if the peer closed the connection before its first byte. The head
/// is checked (F2-F5, the length against `limits`) before the payload is read; the buffer then
/// grows with the bytes that actually arrive, so a head announcing a large payload costs
/// nothing until its bytes come. Returns the message and the frame's length in bytes.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<Option<(Message, usize)>, ReadError> {
    let mut head = [0u8; HEAD_LEN];
    let first = r.read(&mut head).await.map_err(ReadError::Io)?;
    if first == 0 {
        return Ok(None);
    }
    r.read_exact(&mut head[first..]).await.map_err(closed)?;
    let h = Head::parse(&head, limits).map_err(ReadError::Frame)?;
    let n = h.frame_len();
    let mut buf = Vec::with_capacity(n.min(1 << 16));
    buf.extend_from_slice(&head);
    let rest = (n - HEAD_LEN) as u64;
    let got = r.take(rest).read_to_end(&mut buf).await.map_err(closed)?;
    if got as u64 != rest {
        return Err(ReadError::Closed);
    }
    let (msg, used) = decode(&buf, limits).map_err(ReadError::Frame)?;
    Ok(Some((msg, used)))
}

/// An end of file inside a frame is the peer closing it; other errors stay I/O errors.
fn closed(e: io::Error) -> ReadError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => ReadError::Closed,
        _ => ReadError::Io(e),
    }
}
