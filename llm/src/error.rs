//! The runner's errors, one enum with a variant per stage.

use std::fmt;
use std::path::PathBuf;

/// What went wrong loading or running the model.
#[derive(Debug)]
#[non_exhaustive]
pub enum LlmError {
    /// The model file does not exist: it is fetched by `tools/fetch-model`, never at run time.
    ModelMissing {
        /// The path that was looked for.
        path: PathBuf,
    },
    /// Reading the file failed.
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The GGUF file could not be parsed, or a tensor in it could not be read.
    Gguf {
        /// The file.
        path: PathBuf,
        /// candle's message.
        reason: String,
    },
    /// A metadata key the runner needs is absent or has the wrong type or value.
    Metadata {
        /// The key.
        key: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The tokenizer could not be built from the GGUF's metadata, or failed on an input.
    Tokenizer {
        /// The cause.
        reason: String,
    },
    /// An argument does not fit the model: an empty token list, a token id past the vocabulary,
    /// a cache of another shape, more positions than the model was trained for.
    Input {
        /// What is wrong.
        reason: String,
    },
    /// A tensor operation failed (a bug, or memory exhausted).
    Compute {
        /// candle's message.
        reason: String,
    },
}

impl fmt::Display for LlmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LlmError::ModelMissing { path } => write!(
                f,
                "model file {} not found: run tools/fetch-model to download it (it prints the path)",
                path.display()
            ),
            LlmError::Io { path, source } => write!(f, "reading {}: {source}", path.display()),
            LlmError::Gguf { path, reason } => {
                write!(f, "{}: not a readable GGUF model: {reason}", path.display())
            }
            LlmError::Metadata { key, reason } => write!(f, "GGUF metadata {key}: {reason}"),
            LlmError::Tokenizer { reason } => write!(f, "tokenizer: {reason}"),
            LlmError::Input { reason } => write!(f, "invalid input: {reason}"),
            LlmError::Compute { reason } => write!(f, "tensor computation failed: {reason}"),
        }
    }
}

impl std::error::Error for LlmError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LlmError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<candle_core::Error> for LlmError {
    fn from(e: candle_core::Error) -> Self {
        LlmError::Compute {
            reason: candle_reason(e),
        }
    }
}

/// candle's message, without the backtrace candle appends when `RUST_BACKTRACE` is set.
pub(crate) fn candle_reason(e: candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => inner.to_string(),
        e => e.to_string(),
    }
}

/// `Err(LlmError::Input)` with a formatted reason.
macro_rules! bad_input {
    ($($arg:tt)*) => {
        return Err($crate::error::LlmError::Input { reason: format!($($arg)*) })
    };
}
pub(crate) use bad_input;
