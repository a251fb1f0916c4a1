//! # kvc-io
//!
//! What the `kvc` command and the bindings share, on top of the `no_std` cores (`codec-core`,
//! `pq-core`): files, measurements and policies, with typed errors.
//!
//! - [`dump`]: KV dumps as safetensors files in and out ([`load_dump`], [`write_dump`]);
//!   [`fixtures`] says where the workspace's test dumps are.
//! - [`input`]: files read whole within a limit, regular files only.
//! - [`output`]: files written whole or not at all, never over an input, over an existing file
//!   only when allowed, with no temporary file left behind on error or Ctrl-C.
//! - [`metrics`]: relative error, attention-output error (the one attention oracle,
//!   [`codec_core::attention`]), the minmax int8/int4/int3 baselines; [`eval`]: every level of a
//!   profile on a dump, as `kvc eval` reports it.
//! - [`pq`]: PQCache-style token selection measured on a dump's queries (`kvc pq eval`) and the
//!   selected indices (`kvc pq select`).
//! - [`judge`]: the model as the judge: dumps made by the reference runner (`kvc dump`) and
//!   perplexity, KL and top-1 agreement after a round trip through each level (`kvc judge`).
//! - [`store`]: multi-level stores, a context at several levels any mix of which assembles
//!   into a stream, with its token ids (`kvc encode --store`, `kvc serve`).
//! - [`sim`]: a context streamed over bandwidth traces by the adapter and by every fixed level
//!   (`kvc stream-sim`).
//! - [`policy`]: how a stream gets its profile (referenced, or self-contained with only the
//!   levels it uses), profile files and learning.
//! - `fuzzing` (feature `fuzzing`): the body of the cargo-fuzz target `load_dump`, the dump
//!   reader on any bytes.
//!
//! Long computations report to a [`Progress`]; the command draws it as bars.
//!
//! [`judge`] and [`blend`] run the reference model (`kvc-llm`, on candle) and come with the
//! `model` feature, on by default; without it the rest builds without candle.
//!
//! ```
//! use kvc_io::{fixtures, load_dump, metrics};
//!
//! let dump = load_dump(&fixtures::sample())?;
//! assert_eq!((dump.kv.shape.layers, dump.kv.shape.tokens), (30, 512));
//! assert_eq!((dump.q_heads, dump.n_q()), (9, 64));
//!
//! // Per-token-head int4 keys of layer 0 and their relative error.
//! let k = dump.kv.k[0].to_f32_vec();
//! let k4 = metrics::minmax_quantize(&k, 64, 4);
//! let e = metrics::rel_error(&k, &k4);
//! assert!(e > 0.0 && e < 0.2, "{e}");
//! # Ok::<(), kvc_io::Error>(())
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

#[cfg(feature = "model")]
pub mod blend;
#[cfg(feature = "model")]
mod compare;
pub mod dump;
mod error;
pub mod eval;
pub mod fixtures;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod input;
#[cfg(feature = "model")]
pub mod judge;
pub mod metrics;
pub mod output;
pub mod policy;
pub mod pq;
mod progress;
pub mod sim;
pub mod store;
mod tensorfile;
mod tensorread;

pub use dump::{load_dump, parse_dump, write_dump, write_full_dump, Dump, DumpError};
pub use error::Error;
pub use output::{Output, OutputError};
pub use progress::{Progress, Silent};
