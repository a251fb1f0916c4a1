//! `kvc eval --gpu`, `kvc pq eval --gpu`, `kvc encode --gpu` and `kvc decode --gpu`: on a
//! machine with a GPU the GPU's figures next to the CPU's (its outputs checked equal inside the
//! command), the CPU's stream and the CPU's dump byte for byte; without one (CI) a clear error
//! naming why, exit code != 0, nothing printed on stdout and no output file.
//! `KVC_REQUIRE_GPU=1` makes a failure on a GPU machine a test failure rather than "no GPU".

mod common;
use common::{kvc, write_sample_layers, SAMPLE};
use std::path::Path;

/// Whether this test must see the GPU path succeed.
fn gpu_required() -> bool {
    std::env::var("KVC_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// A failed `--gpu` run: one message saying why, on stderr only.
fn assert_says_why_not(out: &str, err: &str) {
    assert!(!gpu_required(), "KVC_REQUIRE_GPU=1 but: {err}");
    assert!(err.contains("--gpu: no usable GPU 0: "), "{err}");
    let reasons = ["CUDA driver", "no CUDA device", "NVRTC"];
    assert!(reasons.iter().any(|w| err.contains(w)), "{err}");
    assert!(out.is_empty(), "printed despite the error: {out}");
}

#[test]
fn eval_on_the_gpu_reports_its_speed_or_says_why_not() {
    let (ok, out, err) = kvc(&["eval", SAMPLE, "--gpu", "--json"]);
    if !ok {
        return assert_says_why_not(&out, &err);
    }
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["mode"]
        .as_str()
        .unwrap()
        .contains("bit for bit the CPU decode"));
    let rows = j["rows"].as_array().unwrap();
    let levels: Vec<_> = rows.iter().filter(|r| !r["bytes"].is_null()).collect();
    assert_eq!(levels.len(), 12);
    for r in levels {
        let gpu = r["gpu_decode_mb_s"].as_f64().unwrap();
        assert!(gpu > 0.0 && gpu.is_finite(), "{r}");
    }
    assert!(rows
        .iter()
        .filter(|r| r["bytes"].is_null())
        .all(|r| r["gpu_decode_mb_s"].is_null()));
}

#[test]
fn pq_eval_on_the_gpu_reports_token_scores_or_says_why_not() {
    let (ok, out, err) = kvc(&["pq", "eval", SAMPLE, "--gpu", "--json"]);
    if !ok {
        return assert_says_why_not(&out, &err);
    }
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = j["rows"].as_array().unwrap();
    // The default selectors: the paper's pq, kvc's rq, and rq re-ranked by a kvc stream.
    assert_eq!(rows.len(), 3, "{rows:?}");
    for r in rows {
        let whole = r["gpu_token_scores_per_s"].as_f64().unwrap();
        let kernel = r["gpu_kernel_token_scores_per_s"].as_f64().unwrap();
        assert!(whole > 0.0 && kernel >= whole, "{r}");
    }
}

#[test]
fn encode_on_the_gpu_writes_the_cpu_stream_or_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let (gpu, cpu) = (dir.path().join("gpu.kvc"), dir.path().join("cpu.kvc"));
    let p = |x: &std::path::Path| x.to_str().unwrap().to_owned();
    // Three chunks at two levels, the importance policy on (the default).
    let args = ["--chunk-tokens", "200", "--levels", "3,7,7"];
    let (ok, out, err) = kvc(&[&["encode", SAMPLE, &p(&gpu), "--gpu"][..], &args].concat());
    if !ok {
        assert!(!gpu.exists(), "an output after a failed --gpu encode");
        return assert_says_why_not(&out, &err);
    }
    assert!(err.contains("chunks coded on GPU 0"), "{err}");
    let (ok, _, err) = kvc(&[&["encode", SAMPLE, &p(&cpu)][..], &args].concat());
    assert!(ok, "{err}");
    let (g, c) = (std::fs::read(&gpu).unwrap(), std::fs::read(&cpu).unwrap());
    assert!(g == c, "the GPU's stream differs from the CPU's");
}

#[test]
fn decode_on_the_gpu_writes_the_cpu_dump_or_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (stream, gpu, cpu) = (p("s.kvc"), p("gpu.safetensors"), p("cpu.safetensors"));
    let args = ["--chunk-tokens", "200", "--levels", "0,6,11"];
    let (ok, _, err) = kvc(&[&["encode", SAMPLE, &stream][..], &args].concat());
    assert!(ok, "{err}");
    let (ok, out, err) = kvc(&["decode", &stream, &gpu, "--gpu"]);
    if !ok {
        assert!(
            !Path::new(&gpu).exists(),
            "an output after a failed --gpu decode"
        );
        return assert_says_why_not(&out, &err);
    }
    let (ok, _, err) = kvc(&["decode", &stream, &cpu]);
    assert!(ok, "{err}");
    let (g, c) = (std::fs::read(&gpu).unwrap(), std::fs::read(&cpu).unwrap());
    assert!(g == c, "the GPU's dump differs from the CPU's");
}

#[test]
fn without_the_flag_there_is_no_gpu_figure() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_sample_layers(&input, 2);
    let input = input.to_str().unwrap();
    let (ok, out, err) = kvc(&["pq", "eval", input, "--json"]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    for r in j["rows"].as_array().unwrap() {
        assert!(r["gpu_token_scores_per_s"].is_null(), "{r}");
    }
    let (ok, out, err) = kvc(&["eval", input, "--json"]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    for r in j["rows"].as_array().unwrap() {
        assert!(r["gpu_decode_mb_s"].is_null(), "{r}");
    }
}
