//! The command never destroys a user's file: an existing output is kept without `--force`, an
//! input is never an output (by path, hard link or symbolic link), and no temporary file is left
//! behind, on errors or on Ctrl-C. Also the messages a new user met first.
//! Unix only: it sends SIGINT and makes symbolic links.
#![cfg(unix)]

mod common;
use common::{kvc, write_sample_layers, SAMPLE};

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// SIGINT's number (2 on every Unix), which `kill -INT` sends.
const SIGINT: i32 = 2;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The names in `dir` that look like temporary files.
fn temporaries(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect()
}

/// A directory with the sample's first two layers (`in.safetensors`: what these tests check
/// does not depend on the size, and every command takes a fifteenth of the time) and a stream
/// of it (`in.kvc`).
fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_sample_layers(&input, 2);
    let stream = dir.path().join("in.kvc");
    let (ok, _, err) = kvc(&["encode", s(&input), s(&stream), "--level", "9"]);
    assert!(ok, "{err}");
    (dir, input, stream)
}

#[test]
fn existing_outputs_are_kept_without_force() {
    let (dir, input, stream) = setup();
    let out = dir.path().join("out");
    let commands: [Vec<&str>; 5] = [
        vec!["encode", s(&input), s(&out)],
        vec!["eval", s(&input), "--plot", s(&out), "--json"],
        vec!["decode", s(&stream), s(&out)],
        vec!["profile", "-o", s(&out), s(&input)],
        vec![
            "pq",
            "select",
            s(&input),
            s(&out),
            "--k",
            "64",
            "--rerank",
            "0",
        ],
    ];
    for args in &commands {
        fs::write(&out, b"precious").unwrap();
        let (ok, _, err) = kvc(args);
        assert!(
            !ok && err.contains("already exists") && err.contains("--force"),
            "{args:?}: {err}"
        );
        assert_eq!(fs::read(&out).unwrap(), b"precious", "{args:?}");
        let mut forced = args.clone();
        forced.push("--force");
        let (ok, _, err) = kvc(&forced);
        assert!(ok, "{forced:?}: {err}");
        assert_ne!(fs::read(&out).unwrap(), b"precious", "{forced:?}");
        assert!(temporaries(dir.path()).is_empty());
    }
    // `-f` is the short form.
    let (ok, _, err) = kvc(&["-f", "encode", s(&input), s(&out), "--level", "9"]);
    assert!(ok, "{err}");
    assert_eq!(fs::read(&out).unwrap(), fs::read(&stream).unwrap());
}

#[test]
fn an_input_is_never_the_output() {
    let (dir, input, stream) = setup();
    let original = fs::read(&stream).unwrap();
    let original_input = fs::read(&input).unwrap();
    let hard = dir.path().join("hard.kvc");
    fs::hard_link(&stream, &hard).unwrap();
    let sym = dir.path().join("sym.kvc");
    std::os::unix::fs::symlink(&stream, &sym).unwrap();
    let dotted = dir.path().join(".").join("in.kvc");
    for out in [&stream, &dotted, &hard, &sym] {
        for force in [false, true] {
            let mut args = vec!["decode", s(&stream), s(out)];
            if force {
                args.push("--force");
            }
            let (ok, _, err) = kvc(&args);
            assert!(!ok && err.contains("destroy the input"), "{args:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }
    assert_eq!(fs::read(&stream).unwrap(), original);
    // The dump, and a profile named as the output.
    let (ok, _, err) = kvc(&["encode", s(&input), s(&input), "-f"]);
    assert!(!ok && err.contains("destroy the input"), "{err}");
    let prof = dir.path().join("p.kvcp");
    let (ok, _, err) = kvc(&["profile", "-o", s(&prof), s(&input)]);
    assert!(ok, "{err}");
    let (ok, _, err) = kvc(&["encode", s(&input), s(&prof), "--profile", s(&prof), "-f"]);
    assert!(!ok && err.contains("destroy the input"), "{err}");
    let (ok, _, err) = kvc(&["profile", "-o", s(&input), s(&input), "-f"]);
    assert!(!ok && err.contains("destroy the input"), "{err}");
    let (ok, _, err) = kvc(&["pq", "select", s(&input), s(&input), "--k", "8", "-f"]);
    assert!(!ok && err.contains("destroy the input"), "{err}");
    assert_eq!(fs::read(&input).unwrap(), original_input);
    assert!(temporaries(dir.path()).is_empty());
}

#[test]
fn failures_leave_no_output_and_no_temporary() {
    let (dir, input, _) = setup();
    // The output is a directory.
    let sub = dir.path().join("sub");
    fs::create_dir(&sub).unwrap();
    let (ok, _, err) = kvc(&["encode", s(&input), s(&sub), "-f"]);
    assert!(!ok && err.contains("is a directory"), "{err}");
    // The output's directory does not exist.
    let (ok, _, err) = kvc(&["encode", s(&input), s(&dir.path().join("no/x.kvc"))]);
    assert!(!ok && err.lines().count() == 1, "{err}");
    // The encoder refuses the parameters after the dump was read.
    let out = dir.path().join("out.kvc");
    let (ok, _, err) = kvc(&["encode", s(&input), s(&out), "--levels", "1,2,3"]);
    assert!(!ok, "{err}");
    assert!(!out.exists());
    assert!(temporaries(dir.path()).is_empty());
}

#[test]
fn ctrl_c_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    fs::copy(SAMPLE, &input).unwrap();
    let out = dir.path().join("out.kvc");
    // Interrupt encodes of the whole sample at moments spread over their run (learning,
    // encoding, writing).
    let mut interrupted = 0;
    for delay_ms in [5, 40, 120, 250, 400, 600, 800, 1000, 1300, 1700] {
        let _ = fs::remove_file(&out);
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvc"))
            .args(["encode", s(&input), s(&out), "--level", "9"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let killed = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        let status = child.wait().unwrap();
        assert!(temporaries(dir.path()).is_empty(), "after {delay_ms} ms");
        if killed.success() && !status.success() {
            interrupted += 1;
            // The handler exits with 130; a signal that comes before it is installed (right
            // after the arguments are parsed, before any file is opened) ends the process itself.
            let by_signal = status.signal() == Some(SIGINT);
            assert!(
                status.code() == Some(130) || by_signal,
                "after {delay_ms} ms: {status}"
            );
            assert!(!out.exists(), "an interrupted encode left {out:?}");
        } else {
            // Finished first: the output is whole.
            let (ok, _, err) = kvc(&["inspect", s(&out)]);
            assert!(ok, "{err}");
        }
    }
    assert!(interrupted > 0, "no run was interrupted");
}

#[test]
fn messages_say_what_was_meant() {
    let (dir, input, _) = setup();
    let out = dir.path().join("out.kvc");
    let levels = ["--levels", "1,7,10", "--chunk-tokens", "128"];
    let (ok, _, err) = kvc(&[&["encode", s(&input), s(&out)][..], &levels].concat());
    assert!(!ok, "{err}");
    assert!(
        err.contains("3 chunk levels")
            && err.contains("512 tokens at 128")
            && err.contains("make 4 chunks"),
        "{err}"
    );
    // inspect names the levels asked for, with their multipliers, in chunk order.
    let levels = ["--levels", "1,7,10,3", "--chunk-tokens", "128"];
    let (ok, _, err) = kvc(&[&["encode", s(&input), s(&out)][..], &levels].concat());
    assert!(ok, "{err}");
    let (ok, text, err) = kvc(&["inspect", s(&out)]);
    assert!(ok, "{err}");
    let rows: Vec<(String, String)> = text
        .lines()
        .skip_while(|l| !l.starts_with("chunk  tokens"))
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[2].to_string(), f[3].to_string())
        })
        .collect();
    let want = [("1", "x0.12"), ("7", "x0.65"), ("10", "x2"), ("3", "x0.17")];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(rows, want, "{text}");
    // decode --level checks those levels.
    let dec = dir.path().join("dec.safetensors");
    let (ok, _, err) = kvc(&["decode", s(&out), s(&dec), "--level", "7"]);
    assert!(!ok && err.contains("coded at level 1, not 7"), "{err}");
    // A level the ladder does not have.
    let (ok, _, err) = kvc(&["encode", s(&input), s(&out), "-f", "--level", "14"]);
    assert!(
        !ok && err.contains("level 14") && err.contains("0 to 11"),
        "{err}"
    );
}
