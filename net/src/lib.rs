//! # kvc-net
//!
//! The transport of streamed contexts (`spec/STREAM.md` §4): a server that sends the chunks of
//! multi-level stores (`kvc_io::store`) over TCP, and a client that fetches a context chunk by
//! chunk, choosing each chunk's level with `codec_core::adapt` to meet a deadline, decoding
//! while the next chunk arrives.
//!
//! - [`frame`]: the frame codec, pure and synchronous (what the fuzzer drives).
//! - `rate`, `server` and `client` (feature `runtime`, default): the token bucket that replays
//!   a bandwidth trace on the server's sends, the tokio server and the fetch client.
#![warn(missing_docs)]

pub mod frame;
pub mod fuzzing;

#[cfg(feature = "runtime")]
pub mod client;
#[cfg(feature = "runtime")]
mod io;
#[cfg(feature = "runtime")]
pub mod rate;
#[cfg(feature = "runtime")]
pub mod server;
