//! Where the workspace's test data lie: the 512-token sample in `testdata/` and the larger dumps
//! in `../shared/fixtures/` beside the repository. Load them with [`crate::load_dump`].
//!
//! The paths are fixed when this crate is built (from its source folder), so they serve the
//! workspace's own tests, benches and examples, and the `kvc demo` sample.

use std::path::{Path, PathBuf};

/// File name of the built-in sample: 512 tokens of SmolLM2-135M's KV cache with 64 queries.
pub const SAMPLE_NAME: &str = "smollm2-gpl3-512.safetensors";

/// The built-in sample, `testdata/smollm2-gpl3-512.safetensors` (in the repository).
pub fn sample() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata")
        .join(SAMPLE_NAME)
}

/// The dump `name` in `../shared/fixtures/` beside the repository (for example
/// `smollm2-gpl3-2048.safetensors`), if it is there.
pub fn shared(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures")
        .join(name);
    p.exists().then_some(p)
}
