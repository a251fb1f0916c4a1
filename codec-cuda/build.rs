//! Compiles every kernel in `kernels/*.cu` for the host as C++17 (see `kernels/host_shim.h`), into
//! one static library that `src/ffi/` links: tests run the kernels' own source on the CPU.
//!
//! `-ffp-contract=off`: the kernels' f32 arithmetic must round after every operation, as
//! codec-core's does (spec/FORMAT.md §1.2); on the device `__fmul_rn`/`__fadd_rn` ensure it.

use std::path::Path;

fn main() {
    let dir = Path::new("kernels");
    println!("cargo:rerun-if-changed=kernels");
    let mut sources: Vec<_> = std::fs::read_dir(dir)
        .expect("codec-cuda/kernels is readable")
        .map(|e| e.expect("kernels/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .include(dir)
        .flag("-x")
        .flag("c++")
        .std("c++17")
        .flag("-ffp-contract=off")
        .flag("-fno-exceptions")
        .flag("-include")
        .flag(dir.join("host_shim.h").to_str().expect("UTF-8 path"))
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true);
    // Under AddressSanitizer (cargo fuzz's default, or `RUSTFLAGS=-Zsanitizer=address`) the
    // kernels are instrumented too, so that an out-of-bounds access in a kernel is reported as
    // one in the Rust code is.
    println!("cargo:rerun-if-env-changed=CARGO_CFG_SANITIZE");
    if std::env::var("CARGO_CFG_SANITIZE").is_ok_and(|s| s.split(',').any(|x| x == "address")) {
        build.flag("-fsanitize=address");
    }
    for s in &sources {
        build.file(s);
    }
    build.compile("kvc_kernels_host");
}
