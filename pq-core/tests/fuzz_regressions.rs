//! Replays every committed input of the cargo-fuzz target `pq_unpack` through its harness
//! (`pq_core::fuzzing::pq_unpack_counting`, the function the target calls):
//! `fuzz/regressions/pq_unpack/*` (inputs that once crashed, kept fixed) and
//! `fuzz/seeds/pq_unpack/*` (the seed corpus), with a counting allocator so that the harness's
//! allocation check runs here too. The fuzz crate itself is not part of the workspace.
//!
//! `write_seeds` (ignored) rewrites the `gen-*` seeds:
//! `cargo test --release -p kvc-pq-core --test fuzz_regressions -- --ignored write_seeds`.

use pq_core::fuzzing::{pq_unpack_counting, pq_unpack_input};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

const TARGET: &str = "pq_unpack";

thread_local! {
    /// Bytes allocated by this thread so far (never decremented). Per thread, because the test
    /// harness runs tests in parallel.
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // `try_with`: the slot may be gone while the thread is being torn down.
    let _ = ALLOCATED.try_with(|a| a.set(a.get().wrapping_add(bytes)));
}

fn allocated_bytes() -> usize {
    ALLOCATED.with(Cell::get)
}

struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// only observes sizes (a const-initialised thread-local `Cell` does not allocate).
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size.saturating_sub(layout.size()));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The input files of `dir` (not hidden files such as `.gitkeep`), sorted.
fn inputs(dir: &Path) -> Vec<PathBuf> {
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

/// Runs every input of `fuzz/<corpus>/pq_unpack/`; returns how many ran and the failures.
fn replay(corpus: &str) -> (usize, Vec<String>) {
    let files = inputs(&fuzz_dir().join(corpus).join(TARGET));
    let mut failures = Vec::new();
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let result = std::panic::catch_unwind(|| pq_unpack_counting(&data, allocated_bytes));
        if let Err(e) = result {
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

#[test]
fn regressions_replay_clean() {
    assert!(fuzz_dir().join("regressions").join(TARGET).is_dir());
    let (_, failures) = replay("regressions");
    assert!(
        failures.is_empty(),
        "fuzz regressions fail:\n{}",
        failures.join("\n")
    );
}

#[test]
fn seeds_replay_clean() {
    let (ran, failures) = replay("seeds");
    assert!(
        failures.is_empty(),
        "fuzz seeds fail:\n{}",
        failures.join("\n")
    );
    assert!(ran >= 8, "only {ran} seeds in fuzz/seeds/{TARGET}");
}

/// The target is a cargo-fuzz binary of the fuzz crate, so `.ci/run` (which runs every target
/// `cargo fuzz list` names) fuzzes it and replays it under ASan.
#[test]
fn fuzz_target_is_registered() {
    assert!(fuzz_dir()
        .join("fuzz_targets")
        .join(format!("{TARGET}.rs"))
        .is_file());
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    assert!(
        manifest.contains(&format!(
            "name = \"{TARGET}\"\npath = \"fuzz_targets/{TARGET}.rs\""
        )),
        "fuzz/Cargo.toml lacks [[bin]] {TARGET}"
    );
}

/// The counting allocator sees the harness's allocations, so the check is not vacuous: a
/// deliberate allocation is counted on this thread.
#[test]
fn allocation_counter_counts() {
    let before = allocated_bytes();
    let v: Vec<u16> = Vec::with_capacity(1000);
    assert!(allocated_bytes() - before >= 2000);
    drop(v);
}

/// The seeds: spec examples, each `n` mode, invalid `b`, wrong lengths, non-zero padding, huge
/// claims. Written by hand once; rerun after changing the input layout.
#[test]
#[ignore]
fn write_seeds() {
    let dir = fuzz_dir().join("seeds").join(TARGET);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap().to_string_lossy().starts_with("gen-") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let bytes: Vec<u8> = (0u32..40).map(|i| (i * 37 + 11) as u8).collect();
    // (name, b_sel, n_sel, n_arg, payload)
    let seeds: &[(&str, u8, u8, u32, &[u8])] = &[
        ("b6-spec-example", 6, 0, 0, &[0x81, 0x30, 0xFC]),
        ("b1-spec-example", 1, 3, 9, &[0x0D, 0x01]),
        ("b12-spec-example", 12, 0, 0, &[0xBC, 0x3A, 0x12]),
        ("b16-spec-example", 16, 0, 0, &[0xEF, 0xBE]),
        ("b3-fit-40-bytes", 3, 0, 0, &bytes),
        ("b7-fit-40-bytes", 7, 0, 0, &bytes),
        ("b13-fit-40-bytes", 13, 0, 0, &bytes),
        ("b6-nonzero-padding", 6, 0, 0, &[0x6A]),
        ("b6-n3-padding-set", 6, 1, 1, &[0x81, 0x30, 0xFC]),
        ("b6-one-long", 6, 2, 1, &[0x81, 0x30, 0xFC]),
        ("b0", 0, 3, 4, &[0x81, 0x30, 0xFC]),
        ("b17", 17, 0, 0, &[0x81, 0x30, 0xFC]),
        ("b255", 0xFF, 0, 0, &[0x81, 0x30, 0xFC]),
        ("b6-n-2pow39", 6, 3 | (31 << 2), 1 << 8, &[0x81, 0x30, 0xFC]),
        ("b16-n-overflows", 16, 3 | (31 << 2), u32::MAX, &[]),
        ("b8-empty", 8, 0, 0, &[]),
    ];
    for &(name, b_sel, n_sel, n_arg, payload) in seeds {
        let data = pq_unpack_input(b_sel, n_sel, n_arg, payload);
        pq_unpack_counting(&data, allocated_bytes);
        std::fs::write(dir.join(format!("gen-{name}.bin")), data).unwrap();
    }
}
