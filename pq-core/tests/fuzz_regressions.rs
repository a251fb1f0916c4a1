//! Replays every committed input of pq-core's cargo-fuzz targets through their harnesses (the
//! functions the targets call): `pq_unpack` (`pq_core::fuzzing::pq_unpack_counting`, with a
//! counting allocator so that the harness's allocation check runs here too) and `pq_search`
//! (`pq_core::fuzzing::pq_search`), from `fuzz/regressions/<target>/*` (inputs that once
//! crashed, kept fixed) and `fuzz/seeds/<target>/*` (the seed corpus). The fuzz crate itself is
//! not part of the workspace.
//!
//! `write_seeds` and `write_search_seeds` (ignored) rewrite the `gen-*` seeds:
//! `cargo test --release -p kvc-pq-core --test fuzz_regressions -- --ignored write_`.

#[path = "../../fuzz/replay.rs"]
mod replay;

use pq_core::fuzzing::{pq_search, pq_search_input, pq_unpack_counting, pq_unpack_input};
use replay::{fuzz_dir, replay};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

const TARGET: &str = "pq_unpack";
const SEARCH: &str = "pq_search";

/// A harness: runs one input, panics on a failed check.
type Harness = fn(&[u8]);

/// Each target and the harness its inputs run through.
fn targets() -> [(&'static str, Harness); 2] {
    [
        (TARGET, |d| pq_unpack_counting(d, allocated_bytes)),
        (SEARCH, pq_search),
    ]
}

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

#[test]
fn regressions_replay_clean() {
    for (target, harness) in targets() {
        assert!(fuzz_dir().join("regressions").join(target).is_dir());
        let (_, failures) = replay("regressions", target, harness);
        assert!(
            failures.is_empty(),
            "fuzz regressions fail:\n{}",
            failures.join("\n")
        );
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "searches of up to 3001 tokens, too slow under Miri; the harnesses' own tests run"
)]
fn seeds_replay_clean() {
    for (target, harness) in targets() {
        let (ran, failures) = replay("seeds", target, harness);
        assert!(
            failures.is_empty(),
            "fuzz seeds fail:\n{}",
            failures.join("\n")
        );
        assert!(ran >= 8, "only {ran} seeds in fuzz/seeds/{target}");
    }
}

/// The targets are cargo-fuzz binaries of the fuzz crate, so `.ci/run` (which runs every target
/// `cargo fuzz list` names) fuzzes them and replays them under ASan.
#[test]
fn fuzz_targets_are_registered() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    for (target, _) in targets() {
        assert!(fuzz_dir()
            .join("fuzz_targets")
            .join(format!("{target}.rs"))
            .is_file());
        assert!(
            manifest.contains(&format!(
                "name = \"{target}\"\npath = \"fuzz_targets/{target}.rs\""
            )),
            "fuzz/Cargo.toml lacks [[bin]] {target}"
        );
    }
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

/// Creates seed directory `dir` and removes the seeds an earlier run wrote there (`gen-*`),
/// leaving hand-placed ones.
fn clear_generated_seeds(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap().to_string_lossy().starts_with("gen-") {
            std::fs::remove_file(p).unwrap();
        }
    }
}

/// The seeds: spec examples, each `n` mode, invalid `b`, wrong lengths, non-zero padding, huge
/// claims. Written by hand once; rerun after changing the input layout.
#[test]
#[ignore]
fn write_seeds() {
    let dir = fuzz_dir().join("seeds").join(TARGET);
    clear_generated_seeds(&dir);
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

/// The `pq_search` seeds: every table mode at lengths below and above the AVX-512 kernel's
/// 512-token minimum, `k` at the edges and at `T/5`, windows, `b` from 1 to 7, and long
/// searches from short inputs (codes from the seed). Rerun after changing the input layout.
#[test]
#[ignore]
fn write_search_seeds() {
    let dir = fuzz_dir().join("seeds").join(SEARCH);
    clear_generated_seeds(&dir);
    let bytes: Vec<u8> = (0u32..600).map(|i| (i * 37 + 11) as u8).collect();
    let raw: Vec<u8> = [1.5f32, -2.25, 0.0, -0.0, 3.0e-39, 7.0, -7.0, 1.0e30]
        .iter()
        .cycle()
        .take(128)
        .flat_map(|v| v.to_le_bytes())
        .collect();
    // (name, b_sel, mode, t_arg, k_arg, n_init, n_local, seed, payload)
    type Seed<'a> = (&'a str, u8, u8, u16, u16, u8, u8, u32, &'a [u8]);
    let seeds: &[Seed] = &[
        ("b6-continuous-2048-k410", 5, 3, 2048, 410, 4, 64, 7, &[]),
        ("b6-continuous-3001-k600", 5, 3, 3001, 600, 0, 0, 8, &[]),
        ("b6-continuous-700-k1", 5, 3, 700, 1, 4, 64, 9, &[]),
        ("b6-continuous-700-kmax", 5, 3, 700, 698, 0, 0, 10, &[]),
        ("b5-palette-2048-k410", 4, 1, 2048, 410, 4, 64, 11, &bytes),
        ("b6-spacing-1000-k200", 5, 2, 1000, 200, 4, 64, 12, &bytes),
        ("b6-raw-bits-1024-k205", 5, 0, 1024, 205, 4, 64, 13, &raw),
        ("b1-continuous-600-k120", 0, 3, 600, 120, 1, 1, 14, &[]),
        ("b7-continuous-900-k90", 6, 3, 900, 90, 4, 64, 15, &[]),
        ("b6-short-100-k20", 5, 3, 100, 20, 4, 8, 16, &bytes),
        ("empty", 0, 0, 0, 0, 0, 0, 0, &[]),
    ];
    for &(name, b_sel, mode, t_arg, k_arg, n_init, n_local, seed, payload) in seeds {
        let data = pq_search_input(b_sel, mode, t_arg, k_arg, n_init, n_local, seed, payload);
        pq_search(&data);
        std::fs::write(dir.join(format!("gen-{name}.bin")), data).unwrap();
    }
}
