//! `include/kvc.h` is what cbindgen generates from the crate today: a change to the C ABI that
//! was not followed by a regenerated header fails here (`KVC_BLESS=1` rewrites the file).

use std::path::Path;

#[test]
fn header_matches_the_code() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut generated);
    let path = dir.join("include/kvc.h");
    if std::env::var_os("KVC_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/kvc.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "capi/include/kvc.h is out of date: run `KVC_BLESS=1 cargo test -p kvc-capi --test header`"
    );
}
