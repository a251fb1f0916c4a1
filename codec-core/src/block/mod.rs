//! The block layer (`spec/FORMAT.md` §5): a chunk is `2L` blocks, layer 0 K, layer 0 V, layer 1
//! K, ..., then a CRC-32C; a block is one layer's K or V over the chunk's tokens.
//!
//! ```text
//! chunk = block(0, K) | block(0, V) | ... | block(L-1, V) | CRC-32C
//! block = n_escapes | lane_len[32] | n_exp | exp_freqs | sink rows | escapes | lane words
//! ```
//!
//! [`ChunkContext`] holds what a chunk is coded against; `layout` reads and writes a block's
//! bytes, `tables` resolves which table codes each symbol, `encode` and `decode` are the two
//! directions.

mod context;
mod decode;
mod encode;
mod error;
mod layout;
mod tables;

pub use context::ChunkContext;
pub(crate) use decode::{BlockDecoder, ChunkAt, RowSink};
pub(crate) use layout::BlockParts;
pub use encode::ChunkEncoder;
pub use error::BlockError;
