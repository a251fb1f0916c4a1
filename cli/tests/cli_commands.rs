//! The `kvc` binary end to end: encode, inspect, decode, profile, and clean failures.

mod common;
use common::{kvc, svg_texts, write_sample_layers, SAMPLE};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn p(d: &Path, name: &str) -> PathBuf {
    d.join(name)
}

#[test]
fn encode_inspect_decode_with_and_without_profile() {
    let dir = tempfile::tempdir().unwrap();
    let s = |x: &PathBuf| x.to_str().unwrap().to_string();
    let (kvc_sc, out_sc, prof, kvc_ref, out_ref) = (
        p(dir.path(), "a.kvc"),
        p(dir.path(), "a.safetensors"),
        p(dir.path(), "m.kvcp"),
        p(dir.path(), "b.kvc"),
        p(dir.path(), "b.safetensors"),
    );
    let (ok, _, err) = kvc(&[
        "encode",
        SAMPLE,
        &s(&kvc_sc),
        "--level",
        "1",
        "--chunk-tokens",
        "200",
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = kvc(&["inspect", &s(&kvc_sc)]);
    assert!(ok, "{err}");
    assert!(
        out.contains("embedded") && out.contains("profile v3") && out.contains("200..400"),
        "{out}"
    );
    let (ok, _, err) = kvc(&["decode", &s(&kvc_sc), &s(&out_sc)]);
    assert!(ok, "{err}");
    // Decoding again writes the same bytes (the header's metadata in sorted key order).
    let again = p(dir.path(), "a2.safetensors");
    let (ok, _, err) = kvc(&["decode", &s(&kvc_sc), &s(&again)]);
    assert!(ok, "{err}");
    assert!(std::fs::read(&out_sc).unwrap() == std::fs::read(&again).unwrap());
    let (ok, _, err) = kvc(&["profile", "-o", &s(&prof), SAMPLE]);
    assert!(ok, "{err}");
    let (ok, _, err) = kvc(&[
        "encode",
        SAMPLE,
        &s(&kvc_ref),
        "--profile",
        &s(&prof),
        "--levels",
        "0,3,4",
        "--chunk-tokens",
        "200",
    ]);
    assert!(ok, "{err}");
    // Without its profile a referenced stream must fail cleanly and leave no output.
    let (ok, _, err) = kvc(&["decode", &s(&kvc_ref), &s(&out_ref)]);
    assert!(!ok && err.contains("profile"), "{err}");
    assert!(!out_ref.exists());
    let (ok, _, err) = kvc(&["decode", &s(&kvc_ref), &s(&out_ref), "--profile", &s(&prof)]);
    assert!(ok, "{err}");
    // The decoded file has the original layout and dtype.
    let bytes = std::fs::read(&out_ref).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let k = st.tensor("k.29").unwrap();
    assert_eq!(k.shape(), &[512, 3, 64]);
    assert_eq!(k.dtype(), safetensors::Dtype::F16);
}

#[test]
fn bad_inputs_fail_with_one_message_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = p(dir.path(), "out.kvc");
    let o = out.to_str().unwrap();
    let (ok, _, err) = kvc(&["encode", "/nonexistent.safetensors", o]);
    assert!(
        !ok && err.starts_with("kvc: error:") && err.lines().count() == 1,
        "{err}"
    );
    assert!(!out.exists());
    // A truncated stream.
    let good = p(dir.path(), "good.kvc");
    let (ok, _, err) = kvc(&["encode", SAMPLE, good.to_str().unwrap()]);
    assert!(ok, "{err}");
    let bytes = std::fs::read(&good).unwrap();
    let cut = p(dir.path(), "cut.kvc");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let dec = p(dir.path(), "dec.safetensors");
    let (ok, _, err) = kvc(&["decode", cut.to_str().unwrap(), dec.to_str().unwrap()]);
    assert!(!ok && err.contains("truncated"), "{err}");
    assert!(!dec.exists());
    // A corrupt stream.
    let mut bad = bytes.clone();
    let n = bad.len();
    bad[n - 100] ^= 0x40;
    std::fs::write(&cut, &bad).unwrap();
    let (ok, _, err) = kvc(&["decode", cut.to_str().unwrap(), dec.to_str().unwrap()]);
    assert!(!ok && err.contains("checksum"), "{err}");
    assert!(!dec.exists());
    // Not a dump at all.
    let (ok, _, err) = kvc(&["encode", good.to_str().unwrap(), o]);
    assert!(!ok && err.lines().count() == 1, "{err}");
    assert!(!out.exists());
}

#[test]
fn demo_plot_draws_levels_and_baselines() {
    let dir = tempfile::tempdir().unwrap();
    let svg = p(dir.path(), "demo.svg");
    let (ok, out, err) = kvc(&["demo", "--plot", svg.to_str().unwrap()]);
    assert!(ok, "{err}");
    // The table is printed as without --plot.
    assert!(
        out.contains("kvc level 11") && out.contains("minmax int3"),
        "{out}"
    );
    assert!(err.contains(&format!("wrote {}", svg.display())), "{err}");
    let texts = svg_texts(&svg);
    for want in [
        "kvc eval: smollm2-gpl3-512.safetensors",
        "bits per element (every byte of the stream)",
        "attention output error ||out'-out||/||out||",
        "kvc levels",
        "minmax int8",
        "minmax int4",
        "minmax int3",
        "0",
        "11",
    ] {
        assert!(texts.iter().any(|t| t == want), "{want} in {texts:?}");
    }
    // A path that cannot be written fails cleanly, after the table (`eval`, which `demo` runs,
    // on the sample's first two layers).
    let small = p(dir.path(), "small.safetensors");
    common::write_sample_layers(&small, 2);
    let bad = p(dir.path(), "missing/demo.svg");
    let (ok, out, err) = kvc(&[
        "eval",
        small.to_str().unwrap(),
        "--json",
        "--plot",
        bad.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("kvc: error:"), "{err}");
    assert!(serde_json::from_str::<serde_json::Value>(&out).is_ok());
    assert!(!bad.exists());
}

#[test]
fn shift_and_decode_at_a_position_move_keys_not_values() {
    let dir = tempfile::tempdir().unwrap();
    let s = |x: &PathBuf| x.to_str().unwrap().to_string();
    let (moved, back, stream, dec, shifted) = (
        p(dir.path(), "moved.safetensors"),
        p(dir.path(), "back.safetensors"),
        p(dir.path(), "a.kvc"),
        p(dir.path(), "dec.safetensors"),
        p(dir.path(), "shifted.safetensors"),
    );
    let (ok, _, err) = kvc(&["shift", SAMPLE, &s(&moved), "--to", "1000"]);
    assert!(ok && err.contains("moved from position 0 to 1000"), "{err}");
    let (ok, _, err) = kvc(&["shift", &s(&moved), &s(&back), "--to", "0"]);
    assert!(ok, "{err}");
    let tensors = |f: &PathBuf, name: &str| -> Vec<f32> {
        let bytes = std::fs::read(f).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    };
    let sample = PathBuf::from(SAMPLE);
    for l in ["k.0", "k.29"] {
        let (orig, m, b) = (tensors(&sample, l), tensors(&moved, l), tensors(&back, l));
        let worst = |x: &[f32]| {
            x.iter()
                .zip(&orig)
                .map(|(a, o)| (a - o).abs())
                .fold(0.0, f32::max)
        };
        assert!(worst(&m) > 0.1, "{l}: the keys did not move");
        assert!(worst(&b) < 0.05, "{l}: there and back is {}", worst(&b));
    }
    assert_eq!(tensors(&sample, "v.3"), tensors(&moved, "v.3"));
    // Decoding at a position equals decoding, then shifting.
    assert!(kvc(&["encode", SAMPLE, &s(&stream)]).0);
    let (ok, _, err) = kvc(&["decode", &s(&stream), &s(&moved), "--position", "77", "-f"]);
    assert!(ok, "{err}");
    assert!(kvc(&["decode", &s(&stream), &s(&dec)]).0);
    assert!(kvc(&["shift", &s(&dec), &s(&shifted), "--to", "77"]).0);
    assert_eq!(tensors(&moved, "k.5"), tensors(&shifted, "k.5"));
    // A cache without rotary pairing cannot move.
    let (ok, _, err) = kvc(&[
        "shift",
        SAMPLE,
        &s(&back),
        "--to",
        "5",
        "--theta",
        "0.5",
        "-f",
    ]);
    assert!(!ok && err.contains("theta"), "{err}");
}

#[test]
fn blend_plan_reproduces_the_papers_examples() {
    let dir = tempfile::tempdir().unwrap();
    let tiers = p(dir.path(), "tiers.txt");
    std::fs::write(
        &tiers,
        "# name GB/s cost-per-GB\nobject-store 0.5 0.02\nnvme 4.194304 0.1  # an SSD\nram 64 3\n",
    )
    .unwrap();
    let t = tiers.to_str().unwrap();
    let plan = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["blend-plan", "--tiers", t, "--tokens", "4096", "--json"];
        all.extend_from_slice(args);
        let (ok, out, err) = kvc(&all);
        assert!(ok, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    // Llama-7B: 20 ms per layer to prefill, 64 MiB per layer (512 KiB per token over 32
    // layers); only RAM loads within the 3 ms of a 15% recompute.
    let v = plan(&[
        "--prefill-s",
        "0.64",
        "--layers",
        "32",
        "--bytes-per-token",
        "524288",
    ]);
    assert_eq!(
        (v["tier"].as_str(), v["hidden"].as_bool()),
        (Some("ram"), Some(true))
    );
    let nvme = &v["tiers"][1];
    assert!((nvme["load_ms_per_layer"].as_f64().unwrap() - 16.0).abs() < 1e-6);
    // Llama-70B: 7 ms for 15% of a layer, 16 MiB per layer loads from the SSD in 4 ms.
    let v = plan(&[
        "--prefill-s",
        "3.7333333333",
        "--layers",
        "80",
        "--bytes-per-token",
        "327680",
    ]);
    assert_eq!(v["tier"].as_str(), Some("nvme"));
    assert!((v["ratio"].as_f64().unwrap() - 0.15).abs() < 1e-9);
    // A malformed tiers line is named.
    std::fs::write(&tiers, "ram fast 3\n").unwrap();
    let (ok, _, err) = kvc(&[
        "blend-plan",
        "--tiers",
        t,
        "--tokens",
        "8",
        "--prefill-s",
        "1",
        "--layers",
        "2",
        "--bytes-per-token",
        "4",
    ]);
    assert!(!ok && err.contains("line 1"), "{err}");
}

#[test]
fn encode_store_keeps_every_level_and_refuses_to_clobber() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = p(dir.path(), "ctx");
    let c = ctx.to_str().unwrap();
    let args = ["encode", SAMPLE, "--store", c, "--levels", "11,1,7"];
    let (ok, _, err) = kvc(&[&args[..], &["--chunk-tokens", "256"]].concat());
    assert!(ok, "{err}");
    assert!(err.contains("2 chunks at 3 levels"), "{err}");
    assert!(err.contains("no token ids"), "{err}");
    for f in [
        "store.json",
        "profile.kvcp",
        "level-01.kvc",
        "level-07.kvc",
        "level-11.kvc",
    ] {
        assert!(ctx.join(f).is_file(), "{f}");
    }
    // Each level's stream is a stream of its own, decodable with the store's profile.
    let out = p(dir.path(), "l7.safetensors");
    let prof = ctx.join("profile.kvcp");
    let l7 = ctx.join("level-07.kvc");
    let (ok, _, err) = kvc(&[
        "decode",
        l7.to_str().unwrap(),
        out.to_str().unwrap(),
        "--profile",
        prof.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = kvc(&args);
    assert!(!ok && err.contains("already exists"), "{err}");
    let (ok, _, err) = kvc(&["encode", SAMPLE, "--store", c]);
    assert!(!ok && err.contains("--levels"), "{err}");
}

#[test]
fn stream_sim_compares_the_adapter_with_every_level() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = p(dir.path(), "ctx");
    let c = ctx.to_str().unwrap();
    let (ok, _, err) = kvc(&[
        "encode",
        SAMPLE,
        "--store",
        c,
        "--levels",
        "1,7,11",
        "--chunk-tokens",
        "128",
    ]);
    assert!(ok, "{err}");
    let svg = p(dir.path(), "sim.svg");
    let run = |extra: &[&str]| {
        let base = [
            "stream-sim",
            c,
            "--traces",
            "20",
            "--seed",
            "3",
            "--slo",
            "0.05,0.02",
        ];
        kvc(&[&base[..], extra].concat())
    };
    let (ok, out, err) = run(&["--json", "--plot", svg.to_str().unwrap()]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 4, "adaptive and 3 levels at 2 deadlines");
    for r in rows {
        for key in [
            "slo_s",
            "violation_rate",
            "mean_error",
            "ttft_p50_s",
            "ttft_p95_s",
        ] {
            assert!(r[key].is_number(), "{key} in {r}");
        }
        let policy = r["policy"].as_str().unwrap();
        assert!(
            ["adaptive", "level-1", "level-7", "level-11"].contains(&policy),
            "{policy}"
        );
    }
    let texts = svg_texts(&svg);
    assert!(
        texts.iter().any(|t| t.contains("adaptive, SLO 0.05 s")),
        "{texts:?}"
    );
    // The same seed gives the same table; no token ids, no text policy.
    assert_eq!(run(&["--json"]).1, out);
    let (ok, _, err) = run(&["--text-ms-per-token", "2"]);
    assert!(!ok && err.contains("no token ids"), "{err}");
    let (ok, _, err) = run(&["--bytes-scale", "0"]);
    assert!(!ok && err.contains("--bytes-scale 0"), "{err}");
}

/// `--threads` changes no byte: streams encoded (alone and into a store) and dumps decoded on
/// 1, 2, 3 or every core are the same files; and the decode straight into the output file's
/// buffer writes what decoding to a cache, then writing it, does (`--position 0` takes that
/// path).
#[test]
fn thread_counts_change_no_byte() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    for t in ["1", "3"] {
        let args = ["--threads", t, "encode", SAMPLE, &p(&format!("s{t}.kvc"))];
        let (ok, _, err) =
            kvc(&[&args[..], &["--levels", "1,7,11", "--chunk-tokens", "200"]].concat());
        assert!(ok, "{err}");
        let store = p(&format!("store{t}"));
        let args = [
            "encode",
            SAMPLE,
            "--store",
            &store,
            "--levels",
            "1,9",
            "--threads",
            t,
        ];
        let (ok, _, err) = kvc(&args);
        assert!(ok, "{err}");
    }
    assert!(read("s1.kvc") == read("s3.kvc"));
    assert!(read("store1/level-09.kvc") == read("store3/level-09.kvc"));
    for t in ["1", "2", "0"] {
        let (ok, _, err) = kvc(&[
            "decode",
            &p("s1.kvc"),
            &p(&format!("d{t}.safetensors")),
            "--threads",
            t,
        ]);
        assert!(ok, "{err}");
    }
    let (ok, _, err) = kvc(&[
        "decode",
        &p("s1.kvc"),
        &p("owned.safetensors"),
        "--position",
        "0",
    ]);
    assert!(ok, "{err}");
    let one = read("d1.safetensors");
    assert!(one == read("d2.safetensors") && one == read("d0.safetensors"));
    assert!(one == read("owned.safetensors"));
}

#[test]
fn inputs_that_are_not_regular_files_are_refused_before_they_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = p(dir.path(), "fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let out = p(dir.path(), "out.st");
    let out = out.to_str().unwrap();
    // Before: /dev/zero was read until memory ran out, and a FIFO blocked forever.
    for special in ["/dev/zero", fifo.to_str().unwrap()] {
        let cases: [&[&str]; 3] = [
            &["inspect", special],
            &["decode", special, out],
            &[
                "blend-plan",
                "--tiers",
                special,
                "--tokens",
                "64",
                "--prefill-s",
                "1",
            ],
        ];
        for args in cases {
            let (ok, _, err) = kvc(args);
            assert!(!ok, "{args:?}");
            assert!(
                err.contains(&format!("cannot read {special}: ")),
                "{args:?}: {err}"
            );
        }
    }
}

#[test]
fn pq_refinement_rounds_and_iterations_are_bounded() {
    // Before: u32::MAX rounds ran for years.
    for (flag, value) in [("--refine", "17"), ("--iters", "1001")] {
        let (ok, _, err) = kvc(&["pq", "eval", SAMPLE, flag, value]);
        assert!(!ok);
        assert!(err.contains("is not in 0.."), "{flag}: {err}");
    }
}

/// Runs `kvc args` with `stdout` and `stderr` as given: (exit code, stderr).
fn kvc_to(args: &[&str], stdout: Stdio, stderr: Stdio) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvc"))
        .args(args)
        .stdout(stdout)
        .stderr(stderr)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[cfg(target_os = "linux")]
#[test]
fn results_that_cannot_be_written_fail_cleanly_and_a_reader_gone_is_no_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (store, tiers) = (p(dir.path(), "store"), p(dir.path(), "tiers.txt"));
    std::fs::write(&tiers, "ram 64 3\n").unwrap();
    let (st, t) = (store.to_str().unwrap(), tiers.to_str().unwrap());
    let (ok, _, err) = kvc(&["encode", SAMPLE, "--store", st, "--levels", "1,7"]);
    assert!(ok, "{err}");
    let small = p(dir.path(), "small.safetensors");
    write_sample_layers(&small, 2);
    let stream = store.join("level-01.kvc");
    let stream = stream.to_str().unwrap();
    let plan = [
        "blend-plan",
        "--tiers",
        t,
        "--tokens",
        "64",
        "--prefill-s",
        "1",
    ];
    let commands: [&[&str]; 4] = [
        &["inspect", stream],
        &[&plan[..], &["--stream", stream]].concat(),
        &["eval", small.to_str().unwrap(), "--json"],
        &["stream-sim", st, "--traces", "2", "--slo", "0.05"],
    ];
    let full = || Stdio::from(std::fs::File::create("/dev/full").unwrap());
    // Before: each panicked ("failed printing to stdout") with exit code 101.
    for args in commands {
        let (code, err) = kvc_to(args, full(), Stdio::piped());
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("kvc: error: writing to stdout: No space left on device"),
            "{args:?}: {err}"
        );
        // A reader that closed the pipe before the first line (`| head -0`) stopped on purpose.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let (code, err) = kvc_to(args, writer.into(), Stdio::piped());
        assert_eq!((code, err.as_str()), (Some(0), ""), "{args:?}");
    }
    // A failure that cannot be told on stderr still fails, with its own exit code.
    let (code, _) = kvc_to(&["inspect", t], Stdio::null(), full());
    assert_eq!(code, Some(1));
}
