//! Replaying committed fuzz inputs from a crate's tests: the input files of
//! `fuzz/<corpus>/<target>/` run through the target's harness (the function its cargo-fuzz
//! binary calls), a panic recorded as a failure. Included by the tests of the crates that hold
//! the harnesses (`#[path = "../../fuzz/replay.rs"] mod replay;`), which sit beside `fuzz/`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// The fuzz crate's directory.
pub fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The input files of `dir` (not hidden files such as `.gitkeep`), sorted; none if it does not
/// exist.
pub fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    files.sort();
    files
}

/// Runs every input of `fuzz/<corpus>/<target>/` through `harness`; returns how many ran and
/// the failures (file and panic message).
pub fn replay(corpus: &str, target: &str, harness: impl Fn(&[u8])) -> (usize, Vec<String>) {
    let files = inputs(&fuzz_dir().join(corpus).join(target));
    let mut failures = Vec::new();
    for file in &files {
        let data = std::fs::read(file).unwrap();
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| harness(&data))) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failures.push(format!("{}: {msg}", file.display()));
        }
    }
    (files.len(), failures)
}
