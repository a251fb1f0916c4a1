//! `kvc serve` and `kvc fetch` as a user runs them: a fetched dump is, byte for byte, the
//! `kvc decode` of the store's stream at the level fetched; refusals name what is wrong.

mod common;

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::thread::JoinHandle;

use common::{kvc, SAMPLE};

/// `kvc serve ROOT` on a free loopback port: the child, the address it printed, and the
/// thread that collects the rest of its stderr (until it exits).
fn serve(root: &str, extra: &[&str]) -> (Child, String, JoinHandle<Vec<String>>) {
    let (child, addr, lines) = start_server(root, extra);
    // The rest of the server's lines are read as they come, so it never blocks on a full pipe.
    let rest = std::thread::spawn(move || lines.map_while(|l| l.ok()).collect());
    (child, addr, rest)
}

/// `kvc serve ROOT` on a free loopback port: the child, the address it printed, and the
/// rest of its stderr.
fn start_server(root: &str, extra: &[&str]) -> (Child, String, Lines<BufReader<ChildStderr>>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvc"))
        .args(["serve", root, "--addr", "127.0.0.1:0"])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .strip_prefix("kvc serve: listening on ")
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{first}"))
        .to_string();
    assert!(
        first.ends_with(&format!("1 contexts in {root}: ctx")),
        "{first}"
    );
    (child, addr, lines)
}

#[test]
fn a_fetched_dump_is_the_decode_of_the_level_fetched() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("stores");
    let store = root.join("ctx");
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let (ok, _, err) = kvc(&[
        "encode",
        SAMPLE,
        "--store",
        &p(&store),
        "--levels",
        "1,7,11",
        "--chunk-tokens",
        "128",
    ]);
    assert!(ok, "{err}");
    let (mut server, addr, log) = serve(&p(&root), &["--gbps", "100"]);
    for level in ["1", "7", "11"] {
        let fetched = dir.path().join(format!("fetched-{level}.safetensors"));
        let (ok, out, err) = kvc(&[
            "fetch",
            &addr,
            "ctx",
            &p(&fetched),
            "--deadline-ms",
            "60000",
            "--level",
            level,
        ]);
        assert!(ok, "{err}");
        assert_eq!(
            out.lines()
                .filter(|l| l.contains(&format!("level {level}")))
                .count(),
            4,
            "{out}"
        );
        assert!(out.contains("deadline 60000 ms met"), "{out}");
        let decoded = dir.path().join(format!("decoded-{level}.safetensors"));
        let stream = store.join(format!("level-{level:0>2}.kvc"));
        let profile = store.join("profile.kvcp");
        let (ok, _, err) = kvc(&[
            "decode",
            &p(&stream),
            &p(&decoded),
            "--profile",
            &p(&profile),
        ]);
        assert!(ok, "{err}");
        assert!(
            std::fs::read(&fetched).unwrap() == std::fs::read(&decoded).unwrap(),
            "level {level}"
        );
    }
    // Adaptive, as JSON: one row per chunk, each a level on offer.
    let out_path = dir.path().join("adaptive.safetensors");
    let (ok, out, err) = kvc(&[
        "fetch",
        &addr,
        "ctx",
        &p(&out_path),
        "--deadline-ms",
        "60000",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["levels_offered"], serde_json::json!([1, 7, 11]));
    assert_eq!(v["chunks"].as_array().unwrap().len(), 4);
    assert_eq!(v["deadline_met"], true);
    // The output is not replaced without -f.
    let (ok, _, err) = kvc(&["fetch", &addr, "ctx", &p(&out_path), "--deadline-ms", "100"]);
    assert!(!ok && err.contains("already exists"), "{err}");
    // Refusals name the context and the reason.
    let nowhere = dir.path().join("x.safetensors");
    let (ok, _, err) = kvc(&[
        "fetch",
        &addr,
        "nosuch",
        &p(&nowhere),
        "--deadline-ms",
        "100",
    ]);
    assert!(
        !ok && err.contains("no context \"nosuch\" on this server"),
        "{err}"
    );
    let (ok, _, err) = kvc(&[
        "fetch",
        &addr,
        "ctx",
        &p(&nowhere),
        "--deadline-ms",
        "100",
        "--level",
        "4",
    ]);
    assert!(
        !ok && err.contains("level 4 is not on offer (levels [1, 7, 11])"),
        "{err}"
    );
    assert!(!nowhere.exists());
    stop(&mut server);
    let log = log.join().unwrap();
    let last = log.last().map_or("", String::as_str);
    assert!(
        last.starts_with("kvc serve: stopped, 0 sessions cut; "),
        "{log:?}"
    );
    assert!(last.contains("refused"), "{last}");
}

/// Stops the server as a service manager does (SIGTERM): it exits with success.
#[cfg(unix)]
fn stop(server: &mut Child) {
    let pid = server.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let status = server.wait().unwrap();
    assert!(status.success(), "a stopped server exits 0: {status:?}");
}

#[cfg(not(unix))]
fn stop(server: &mut Child) {
    server.kill().unwrap();
    server.wait().unwrap();
}

#[test]
fn serve_refuses_what_it_cannot_serve() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let missing = format!("{d}/nope");
    let (ok, _, err) = kvc(&["serve", &missing, "--addr", "127.0.0.1:0"]);
    assert!(!ok && err.contains("not a directory"), "{err}");
    let (ok, _, err) = kvc(&["serve", d, "--addr", "127.0.0.1:0", "--gbps", "0"]);
    assert!(!ok && err.contains("--gbps 0"), "{err}");
    let trace = format!("{d}/t.trace");
    std::fs::write(&trace, "0 1\n0.5 -2\n").unwrap();
    let (ok, _, err) = kvc(&["serve", d, "--addr", "127.0.0.1:0", "--trace", &trace]);
    assert!(
        !ok && err.contains("t.trace") && err.contains("line 2"),
        "{err}"
    );
    let (ok, _, err) = kvc(&["serve", d, "--addr", "127.0.0.1:0", "--grace-s", "0"]);
    assert!(!ok && err.contains("--grace-s 0"), "{err}");
    let (ok, _, err) = kvc(&["serve", d, "--addr", "256.0.0.1:1"]);
    assert!(!ok && err.contains("cannot listen on 256.0.0.1:1"), "{err}");
}

#[cfg(unix)]
#[test]
fn a_server_whose_log_cannot_be_written_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("stores");
    let store = root.join("ctx").to_str().unwrap().to_string();
    let (ok, _, err) = kvc(&["encode", SAMPLE, "--store", &store, "--levels", "7"]);
    assert!(ok, "{err}");
    let (mut server, addr, log) = start_server(root.to_str().unwrap(), &[]);
    // Nobody reads the server's stderr any more: each line it logs now fails to be written.
    drop(log);
    for i in 0..2 {
        let out = dir.path().join(format!("{i}.safetensors"));
        let (ok, _, err) = kvc(&[
            "fetch",
            &addr,
            "ctx",
            out.to_str().unwrap(),
            "--deadline-ms",
            "60000",
        ]);
        assert!(ok, "fetch {i}: {err}");
    }
    // Before: the first session's report panicked its task, and the stop message the server.
    stop(&mut server);
}
