//! The container layer (`spec/FORMAT.md` §3): a header with the chunk index and its CRC, an
//! optional embedded profile, then the chunks.
//!
//! ```text
//! stream = header | [embedded profile] | chunk 0 | chunk 1 | ...
//! header = fixed fields | model id | chunk index (24 bytes per chunk) | CRC-32C
//! ```
//!
//! `header` reads and writes the header's bytes, `write` encodes a stream, `stream` opens and
//! decodes one, `bound` bounds an encoded stream's size from the format alone.

mod bound;
mod error;
mod header;
mod stream;
mod work;
mod write;

pub use bound::max_encoded_len;
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for tests and fuzzing
pub use bound::{max_block_words, max_lane_words, BLOCK_FIXED_MAX};
pub use error::{DecodeError, HeaderError, OpenError};
pub use header::{ChunkEntry, Header};
pub use stream::{decode, DetachedStream, Stream};
pub use write::{
    assemble, encode, encode_threads, stream_frame, EncodeParams, ProfileMode, StreamFrame,
};
