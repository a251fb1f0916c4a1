//! Builds `examples/roundtrip.c` with the system C compiler against the crate's static library
//! and runs it, plainly and under AddressSanitizer with leak detection: every step of the
//! example must behave as documented, and nothing may leak or touch memory it does not own.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The crate's static library, built now into this test's target directory and profile
/// (`cargo test` builds the crate as an rlib only, so `libkvc_capi.a` may be stale or absent).
fn staticlib() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable path");
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>");
            let target_dir = profile_dir.parent().expect("target directory");
            let mut cargo = Command::new(env!("CARGO"));
            cargo.args([
                "build",
                "--quiet",
                "-p",
                "kvc-capi",
                "--lib",
                "--target-dir",
            ]);
            cargo.arg(target_dir);
            if profile_dir.ends_with("release") {
                cargo.arg("--release");
            }
            let status = cargo.status().expect("run cargo build");
            assert!(status.success(), "cargo build -p kvc-capi failed");
            profile_dir.join("libkvc_capi.a")
        })
        .clone()
}

fn build_and_run(name: &str, flags: &[&str]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(flags)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(dir.join("include"))
        .arg(dir.join("examples/roundtrip.c"))
        .arg(staticlib())
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out)
        .status()
        .expect("run the C compiler (cc)");
    assert!(
        status.success(),
        "compiling roundtrip.c with {flags:?} failed"
    );
    let run = Command::new(&out)
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        .output()
        .expect("run the example");
    let text = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{name} failed:\n{text}\n{err}");
    assert!(text.contains("all steps behaved as documented"), "{text}");
}

#[test]
fn c_example_runs() {
    build_and_run("roundtrip", &["-O2"]);
}

#[test]
fn c_example_is_clean_under_asan() {
    build_and_run(
        "roundtrip-asan",
        &["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
    );
}

/// The header is valid C99 (pedantic) and C++ on its own.
#[test]
fn header_compiles_as_c99_and_cpp() {
    let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvc.h");
    for (compiler, lang, std) in [("cc", "c", "-std=c99"), ("c++", "c++", "-std=c++11")] {
        let status = Command::new(compiler)
            .args([
                "-fsyntax-only",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
                std,
                "-x",
                lang,
            ])
            .arg(&header)
            .status()
            .expect("run the C/C++ compiler");
        assert!(
            status.success(),
            "include/kvc.h does not compile as {lang} ({std})"
        );
    }
}
