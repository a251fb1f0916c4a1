//! The `frame_decode` fuzz target's seeds (`fuzz/seeds/frame_decode/`) and regressions
//! (`fuzz/regressions/frame_decode/`, if any) run through its body, and the seeds are what
//! the messages encode to today: a change to the frame layout shows here first.
//!
//! After a deliberate change to the layout, rewrite the seeds with
//!
//! ```text
//! cargo test -p kvc-net --test fuzz_seeds -- --ignored
//! ```

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvc_net::frame;
use kvc_net::fuzzing::frame_decode;

fn dir(kind: &str) -> PathBuf {
    common::root().join("fuzz").join(kind).join("frame_decode")
}

/// The seeds: one file per message type, and all of them back to back, each after the flags
/// byte 1 (fix CRCs), so that the fuzzer's mutations reach the payload checks.
fn seeds() -> BTreeMap<String, Vec<u8>> {
    let frames: Vec<Vec<u8>> = common::sample_messages()
        .iter()
        .map(|m| m.encode())
        .collect();
    let seed = |bytes: &[u8]| [&[1u8][..], bytes].concat();
    let mut out = BTreeMap::new();
    for (i, (m, f)) in common::sample_messages().iter().zip(&frames).enumerate() {
        out.insert(format!("gen-{i:02}-{:?}", m.kind()).to_lowercase(), seed(f));
    }
    out.insert("gen-all".into(), seed(&frames.concat()));
    out
}

/// Files of `dir` (none if it does not exist).
fn files(dir: &PathBuf) -> BTreeMap<String, Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

#[test]
fn seeds_are_todays_frames_and_decode_whole() {
    let want = seeds();
    let have = files(&dir("seeds"));
    assert_eq!(
        have.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "fuzz/seeds/frame_decode (rewrite it: see this file's docs)"
    );
    for (name, bytes) in &want {
        assert_eq!(&have[name], bytes, "{name} is stale (rewrite the seeds)");
        let frames = if name == "gen-all" {
            common::sample_messages().len()
        } else {
            1
        };
        assert_eq!(frame_decode(bytes), frames, "{name}");
        // Without the CRC fix-up the same frames pass: their CRCs are right.
        assert_eq!(
            frame_decode(&[&[0u8][..], &bytes[1..]].concat()),
            frames,
            "{name}"
        );
    }
    // A changed payload byte gets past F6 with the fix-up, and is caught by it without.
    let mut open = want["gen-01-open"].clone();
    open[1 + frame::HEAD_LEN] = b'h';
    assert_eq!(frame_decode(&open), 1);
    open[0] = 0;
    assert_eq!(frame_decode(&open), 0);
    let crc_error = frame::decode(&open[1..], &frame::Limits::DEFAULT).unwrap_err();
    assert_eq!(crc_error.check(), "F6");
}

/// Inputs that once crashed the target (`fuzz/README.md`): each must now run through it (the
/// body asserts what it checks; a panic fails this test).
#[test]
fn regressions_replay() {
    let found = files(&dir("regressions"));
    assert!(
        found.contains_key(".gitkeep"),
        "fuzz/regressions/frame_decode is missing"
    );
    for (name, bytes) in found.iter().filter(|(n, _)| !n.starts_with('.')) {
        println!("{name}: {} frames", frame_decode(bytes));
    }
}

#[test]
#[ignore = "writes fuzz/seeds/frame_decode"]
fn write_seeds() {
    let d = dir("seeds");
    std::fs::create_dir_all(&d).unwrap();
    for (name, _) in files(&d).into_iter().filter(|(n, _)| n.starts_with("gen-")) {
        std::fs::remove_file(d.join(name)).unwrap();
    }
    for (name, bytes) in seeds() {
        std::fs::write(d.join(name), bytes).unwrap();
    }
}
