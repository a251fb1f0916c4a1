//! Replays every committed fuzz input through its target's harness (`codec_core::fuzzing`, the
//! same function the cargo-fuzz target calls): `fuzz/regressions/<target>/*` (inputs that once
//! crashed, kept fixed) and `fuzz/seeds/<target>/*` (the seed corpora). Runs under plain
//! `cargo test`; the fuzz crate itself is not part of the workspace.

#[path = "../../fuzz/replay.rs"]
mod replay;

use codec_core::fuzzing::{Harness, Target};
use replay::{fuzz_dir, inputs};

/// Runs every input of `fuzz/<corpus>/<target>/` for every target; returns how many ran and
/// the failures.
fn replay(harness: &Harness, corpus: &str) -> (usize, Vec<String>) {
    let mut ran = 0;
    let mut failures = Vec::new();
    for target in Target::ALL {
        let (n, failed) = replay::replay(corpus, target.name(), |data| harness.run(target, data));
        ran += n;
        failures.extend(failed);
    }
    (ran, failures)
}

#[test]
fn regressions_replay_clean() {
    let (_, failures) = replay(&Harness::new(), "regressions");
    assert!(
        failures.is_empty(),
        "fuzz regressions fail:\n{}",
        failures.join("\n")
    );
}

#[test]
fn seeds_replay_clean() {
    let (ran, failures) = replay(&Harness::new(), "seeds");
    assert!(
        failures.is_empty(),
        "fuzz seeds fail:\n{}",
        failures.join("\n")
    );
    assert!(
        ran >= Target::ALL.len(),
        "every target has seeds ({ran} inputs)"
    );
    for target in Target::ALL {
        let dir = fuzz_dir().join("seeds").join(target.name());
        assert!(!inputs(&dir).is_empty(), "no seeds in {}", dir.display());
    }
}

/// Targets of `fuzz/` whose harness lives in another crate: pq-core's (`pq_core::fuzzing`,
/// replayed by `pq-core/tests/fuzz_regressions.rs`), kvc-net's (`kvc_net::fuzzing`, replayed
/// by `net/tests/fuzz_seeds.rs`), codec-cuda's (`codec_cuda::fuzzing`, replayed by
/// `codec-cuda/tests/fuzz_regressions.rs`), kvc-llm's (`kvc_llm::fuzzing`, replayed by
/// `llm/tests/gguf.rs`) and kvc-io's (`kvc_io::fuzzing`, replayed by
/// `kvc-io/tests/fuzz_seeds.rs`).
const OTHER_CRATES_TARGETS: &[&str] = &[
    "pq_search",
    "pq_unpack",
    "frame_decode",
    "decode_chain",
    "encode_chain",
    "load_gguf",
    "load_dump",
];

/// Every cargo-fuzz target (but [`OTHER_CRATES_TARGETS`]) has a harness, a seed directory and a
/// regression directory, and vice versa.
#[test]
fn fuzz_targets_match_the_harnesses() {
    let mut files: Vec<String> = inputs(&fuzz_dir().join("fuzz_targets"))
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|name| !OTHER_CRATES_TARGETS.contains(&name.as_str()))
        .collect();
    files.sort();
    let mut names: Vec<String> = Target::ALL.iter().map(|t| t.name().to_string()).collect();
    names.sort();
    assert_eq!(
        files, names,
        "fuzz/fuzz_targets/*.rs vs codec_core::fuzzing::Target"
    );
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    for t in Target::ALL {
        assert_eq!(Target::from_name(t.name()), Some(t));
        assert!(
            manifest.contains(&format!("name = \"{}\"", t.name())),
            "fuzz/Cargo.toml lacks [[bin]] {}",
            t.name()
        );
        assert!(fuzz_dir().join("regressions").join(t.name()).is_dir());
    }
}
