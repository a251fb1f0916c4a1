//! `kvc pq eval` and `kvc pq select` on the built-in sample (real SmolLM2 keys and queries).

mod common;
use common::{svg_texts, SAMPLE};

use std::path::Path;
use std::process::Command;

/// `kvc args`: (success, stdout as bytes, stderr).
fn kvc(args: &[&str]) -> (bool, Vec<u8>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvc"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn eval_json_reports_every_figure_and_reranking_helps() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("pq.svg");
    let (ok, out, err) = kvc(&[
        "pq",
        "eval",
        SAMPLE,
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    // --plot leaves the JSON as it is and draws one point per selector.
    let j: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(j["k_t5"], 102); // round(512 / 5)
    let rows = j["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    let texts = svg_texts(&svg);
    for want in names.iter().copied().chain([
        "code bits per key (per KV head)",
        "miss rate 1 - recall of the exact top-102",
    ]) {
        assert!(texts.iter().any(|t| t == want), "{want} in {texts:?}");
    }
    assert!(names[0].starts_with("pq "), "{names:?}");
    assert!(names[1].starts_with("rq "), "{names:?}");
    assert!(names[2].contains("rerank"), "{names:?}");
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    for r in rows {
        assert_eq!(r["bits_per_key_per_head"], 12);
        for k in [
            "recall_t5",
            "recall_t10",
            "mass_t5_windows",
            "mass_t5_union_windows",
        ] {
            let v = f(r, k);
            assert!(v > 0.2 && v <= 1.0, "{k} = {v}");
        }
        assert!(f(r, "train_ms_per_head") > 0.0);
        assert!(f(r, "token_scores_per_s") > 0.0);
        let caches = r["block_cache"].as_array().unwrap();
        assert_eq!(caches.len(), 4);
        for c in caches {
            let h = f(c, "hit_rate");
            assert!((0.0..=1.0).contains(&h));
        }
    }
    // Re-scoring a 2k short list with the codec's keys recalls far more of the exact top-k than
    // either quantizer alone (measured 0.91 vs 0.70 on the 2048-token fixture).
    assert!(f(&rows[2], "recall_t5") > f(&rows[1], "recall_t5") + 0.05);
    assert!(f(&rows[2], "mass_t5_windows") >= f(&rows[1], "mass_t5_windows"));
}

/// Checks every `sel.{i}` of the file and returns their values, layer by layer.
fn check_selection(path: &Path, n: usize, n_init: usize, n_local: usize) -> Vec<Vec<i32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut layers = 0;
    let mut all = Vec::new();
    while let Ok(t) = st.tensor(&format!("sel.{layers}")) {
        assert_eq!(t.dtype(), safetensors::Dtype::I32);
        let shape = t.shape().to_vec();
        assert_eq!(shape, vec![64, 9, n]);
        let v: Vec<i32> = t
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        for (row_i, row) in v.chunks_exact(n).enumerate() {
            let pos = 448 + row_i / 9; // queries at positions 448..511
            let taken: Vec<i32> = row.iter().copied().take_while(|&x| x >= 0).collect();
            assert!(
                row[taken.len()..].iter().all(|&x| x == -1),
                "padding at the end"
            );
            assert!(taken.windows(2).all(|w| w[0] < w[1]), "ascending, distinct");
            assert!(taken.iter().all(|&x| x as usize <= pos), "causal");
            assert_eq!(taken.len(), n.min(pos + 1));
            for i in 0..n_init {
                assert!(taken.contains(&(i as i32)));
            }
            for i in pos + 1 - n_local..=pos {
                assert!(taken.contains(&(i as i32)));
            }
        }
        all.push(v);
        layers += 1;
    }
    assert_eq!(layers, 30);
    all
}

#[test]
fn select_writes_causal_padded_indices_deterministically() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.safetensors");
    let b = dir.path().join("b.safetensors");
    let c = dir.path().join("c.safetensors");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (ok, _, err) = kvc(&["pq", "select", SAMPLE, &s(&a), "--k", "100"]);
    assert!(ok, "{err}");
    let (ok, _, err) = kvc(&["pq", "select", SAMPLE, &s(&b), "--k", "100"]);
    assert!(ok, "{err}");
    let x = check_selection(&a, 100, 4, 64);
    let y = check_selection(&b, 100, 4, 64);
    assert!(x == y, "the same selection twice");
    // The same bytes too (the metadata's keys in sorted order, not a hash map's).
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
    // More slots than a query can see (queries at 448..511, 500 slots): -1 padding; no windows;
    // plain PQ without re-ranking.
    let (ok, _, err) = kvc(&[
        "pq",
        "select",
        SAMPLE,
        &s(&c),
        "--k",
        "500",
        "--n-init",
        "0",
        "--n-local",
        "0",
        "--rerank",
        "0",
        "--method",
        "pq",
    ]);
    assert!(ok, "{err}");
    check_selection(&c, 500, 0, 0);
    // More slots than tokens is refused (they could only be padding), with no output.
    let d = dir.path().join("d.safetensors");
    let (ok, _, err) = kvc(&["pq", "select", SAMPLE, &s(&d), "--k", "513"]);
    assert!(!ok && err.contains("--k 513"), "{err}");
    assert!(!d.exists());
}

#[test]
fn codebooks_that_outgrow_the_keys_are_noted() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sel.safetensors");
    let select = |m: &str, b: &str| {
        let args = ["pq", "select", SAMPLE, out.to_str().unwrap(), "--k", "20"];
        let (ok, _, err) = kvc(&[&args[..], &["--m", m, "--b", b, "--rerank", "0", "-f"]].concat());
        assert!(ok, "{err}");
        err
    };
    // One book of 1024 codewords of 64 dims: 65 536 multiply-adds a table, 512 keys of 64 dims.
    let err = select("1", "10");
    let want = "a query's score table takes 65536 multiply-adds, more than scoring all 512 keys \
                exactly (32768); the 90 codebooks come to 23.6 MB";
    assert!(err.contains(want), "{err}");
    // The default's two books of 64 codewords: 8192.
    let err = select("2", "6");
    assert!(!err.contains("score table"), "{err}");
}

#[test]
fn select_without_queries_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let kvcf = dir.path().join("x.kvc");
    let noq = dir.path().join("noq.safetensors");
    let out = dir.path().join("sel.safetensors");
    assert!(kvc(&["encode", SAMPLE, &s(&kvcf)]).0);
    assert!(kvc(&["decode", &s(&kvcf), &s(&noq)]).0);
    let (ok, _, err) = kvc(&["pq", "select", &s(&noq), &s(&out), "--k", "10"]);
    assert!(!ok);
    assert!(err.contains("no queries"), "{err}");
    assert!(!out.exists());
    let (ok, _, err) = kvc(&["pq", "eval", &s(&noq), "--rerank", "0.5"]);
    assert!(!ok);
    assert!(err.contains("--rerank"), "{err}");
}
