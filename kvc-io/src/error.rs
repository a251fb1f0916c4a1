//! The crate's error type: everything a dump, a profile, the codec or the token selector can
//! refuse, with the file concerned where there is one.

use std::fmt;
use std::io;
use std::path::PathBuf;

use codec_core::{DecodeError, EncodeError, ProfileError};
use pq_core::PqError;

use crate::dump::DumpError;

/// Why a kvc-io operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A dump could not be read, parsed or written.
    Dump(DumpError),
    /// A file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A profile file is not a valid profile.
    Profile {
        /// The file.
        path: PathBuf,
        /// What the profile parser found.
        source: ProfileError,
    },
    /// The codec refused to learn a profile or to encode.
    Encode(EncodeError),
    /// A stream could not be opened or decoded.
    Decode(DecodeError),
    /// A level the profile does not have.
    NoSuchLevel {
        /// The level asked for.
        level: u8,
        /// How many levels the profile has.
        levels: u8,
    },
    /// Token selection needs queries and the dump has none.
    NoQueries,
    /// The dump's queries do not fit its cache (only for dumps not built by the loader, which
    /// checks this).
    QueryLayout {
        /// What is wrong.
        reason: String,
    },
    /// The number of selected tokens per query head is not within `1..=tokens`.
    SlotCount {
        /// Slots asked for.
        slots: usize,
        /// The dump's tokens.
        tokens: usize,
    },
    /// The model could not be loaded or run.
    #[cfg(feature = "model")]
    Model(llm::LlmError),
    /// A count asked for is outside what is possible.
    OutOfRange {
        /// What is counted, e.g. `"ctx (context tokens)"`.
        what: &'static str,
        /// The count asked for.
        got: usize,
        /// The smallest possible.
        min: usize,
        /// The largest possible.
        max: usize,
        /// Why the largest is what it is (may be empty).
        why: String,
    },
    /// A text has fewer tokens than asked for.
    TextTooShort {
        /// Tokens the text has.
        have: usize,
        /// Tokens asked for.
        need: usize,
    },
    /// A line of a tiers file is not `name GB/s cost-per-GB`.
    Tiers {
        /// The line number (from 1).
        line: usize,
        /// Its text.
        text: String,
    },
    /// A line of a bandwidth trace file is not `seconds Gbps`, or the trace is empty.
    Trace {
        /// The line number (from 1; 0 for the whole file).
        line: usize,
        /// Its text.
        text: String,
        /// What is wrong.
        why: String,
    },
    /// A simulation was asked for something it cannot do.
    Sim {
        /// What.
        what: &'static str,
    },
    /// The streaming adapter refused its input.
    Adapt(codec_core::adapt::AdaptError),
    /// An output file was refused or could not be written.
    Output(crate::output::OutputError),
    /// A multi-level store is incomplete or inconsistent, or cannot be written.
    Store {
        /// Its directory.
        dir: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The chunks' streams do not share a shape (they are placed one after another).
    ChunkShapes,
    /// `kvc blend-eval` was asked for a method it does not have.
    #[cfg(feature = "model")]
    UnknownMethod {
        /// The name asked for.
        name: String,
    },
    /// A CacheBlend selection step refused its input.
    Blend(codec_core::blend::BlendError),
    /// pq-core refused its input.
    Pq {
        /// Where, e.g. `layer 3 head 1` (empty if nowhere in particular).
        at: String,
        /// pq-core's error.
        source: PqError,
    },
    /// A second implementation run beside the CPU's (`kvc eval --gpu`, `kvc pq eval --gpu`:
    /// codec-cuda on a GPU) failed, or its output differs from the CPU's.
    Companion {
        /// Where, e.g. `level 3` or `selector rq m=2 b=6`.
        at: String,
        /// What the companion reported.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Dump(e) => e.fmt(f),
            Error::Read { path, source } => write!(f, "cannot read {}: {source}", path.display()),
            Error::Profile { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Encode(e) => e.fmt(f),
            Error::Decode(e) => e.fmt(f),
            Error::NoSuchLevel { level, levels } => {
                write!(
                    f,
                    "level {level} does not exist (the levels are 0 to {})",
                    levels.saturating_sub(1)
                )
            }
            Error::NoQueries => write!(
                f,
                "the dump has no queries (q.{{i}} tensors), which token selection needs (kvc dump writes them)"
            ),
            Error::QueryLayout { reason } => f.write_str(reason),
            Error::SlotCount { slots, tokens } => write!(
                f,
                "{slots} slots per query head: must be within 1..={tokens} (the dump's tokens)"
            ),
            #[cfg(feature = "model")]
            Error::Model(e) => e.fmt(f),
            Error::OutOfRange {
                what,
                got,
                min,
                max,
                why,
            } => {
                write!(f, "{what} = {got}: must be within {min}..={max}")?;
                if !why.is_empty() {
                    write!(f, " ({why})")?;
                }
                Ok(())
            }
            Error::TextTooShort { have, need } => write!(
                f,
                "the text has {have} tokens; {need} are needed (use a longer text or fewer tokens)"
            ),
            Error::Tiers { line, text } => write!(
                f,
                "tiers line {line} ({text:?}): expected `name GB/s cost-per-GB` with a positive \
                 throughput and a cost of 0 or more"
            ),
            Error::Trace { line: 0, why, .. } => write!(f, "bandwidth trace: {why}"),
            Error::Trace { line, text, why } => {
                write!(f, "bandwidth trace line {line} ({text:?}): {why}")
            }
            Error::Sim { what } => write!(f, "stream simulation: {what}"),
            Error::Adapt(e) => e.fmt(f),
            Error::Output(e) => e.fmt(f),
            Error::Store { dir, reason } => write!(f, "store {}: {reason}", dir.display()),
            Error::ChunkShapes => write!(f, "the chunks' caches differ in layers or KV heads"),
            #[cfg(feature = "model")]
            Error::UnknownMethod { name } => write!(
                f,
                "no method {name:?}: the methods are {}",
                crate::blend::METHODS.join(", ")
            ),
            Error::Blend(e) => e.fmt(f),
            Error::Pq { at, source } if at.is_empty() => source.fmt(f),
            Error::Pq { at, source } => write!(f, "{at}: {source}"),
            Error::Companion { at, source } => write!(f, "{at}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // The wrapped errors are transparent (their message is this one), so the chain goes on
        // from their own source.
        match self {
            Error::Dump(e) => e.source(),
            #[cfg(feature = "model")]
            Error::Model(e) => e.source(),
            Error::Encode(e) => e.source(),
            Error::Decode(e) => e.source(),
            Error::Read { source, .. } => Some(source),
            Error::Profile { source, .. } => Some(source),
            Error::Pq { source, .. } => Some(source),
            Error::Companion { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

impl From<codec_core::adapt::AdaptError> for Error {
    fn from(e: codec_core::adapt::AdaptError) -> Self {
        Error::Adapt(e)
    }
}

impl From<crate::output::OutputError> for Error {
    fn from(e: crate::output::OutputError) -> Self {
        Error::Output(e)
    }
}

impl From<DumpError> for Error {
    fn from(e: DumpError) -> Self {
        Error::Dump(e)
    }
}

#[cfg(feature = "model")]
impl From<llm::LlmError> for Error {
    fn from(e: llm::LlmError) -> Self {
        Error::Model(e)
    }
}

impl From<EncodeError> for Error {
    fn from(e: EncodeError) -> Self {
        Error::Encode(e)
    }
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        Error::Decode(e)
    }
}

impl From<codec_core::blend::BlendError> for Error {
    fn from(e: codec_core::blend::BlendError) -> Self {
        Error::Blend(e)
    }
}

impl From<PqError> for Error {
    fn from(source: PqError) -> Self {
        Error::Pq {
            at: String::new(),
            source,
        }
    }
}
