//! What the command's test files share (not every file uses every helper).
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// The 512-token sample dump shipped in the repository.
pub const SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/smollm2-gpl3-512.safetensors"
);

/// Writes the sample's first `layers` layers (every token, with the queries) to `path`, for
/// tests where the whole sample would only take longer.
pub fn write_sample_layers(path: &Path, layers: usize) {
    let mut dump = kvc_io::load_dump(Path::new(SAMPLE)).unwrap();
    dump.keep_layers(layers);
    kvc_io::write_full_dump(&kvc_io::Output::replacing(path), &dump).unwrap();
}

/// Runs `kvc args`: (success, stdout, stderr).
pub fn kvc(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvc"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Checks that `path` holds one SVG document (`--plot`) and returns its texts (title, axis
/// descriptions, ticks, legend, point labels), trimmed and unescaped, in drawing order.
pub fn svg_texts(path: &Path) -> Vec<String> {
    let svg = std::fs::read_to_string(path).unwrap();
    let body = svg.trim();
    assert!(
        body.starts_with("<svg") || body.starts_with("<?xml"),
        "{svg}"
    );
    assert!(body.ends_with("</svg>"), "{svg}");
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    svg.split("<text")
        .skip(1)
        .map(|t| {
            let inner = &t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()];
            let unescaped = [
                ("&lt;", "<"),
                ("&gt;", ">"),
                ("&quot;", "\""),
                ("&apos;", "'"),
            ]
            .iter()
            .fold(inner.trim().to_string(), |s, (from, to)| {
                s.replace(from, to)
            });
            unescaped.replace("&amp;", "&")
        })
        .collect()
}
