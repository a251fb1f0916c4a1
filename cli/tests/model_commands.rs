//! `kvc dump`, then `kvc encode` / `kvc decode` of that dump, then `kvc judge`, end to end.
//! Skipped (and said so) without the model; CI fetches it and sets `KVC_REQUIRE_MODEL=1`.

mod common;
use common::{kvc, svg_texts};

use std::path::Path;

#[test]
fn dump_encode_decode_judge() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let Some(model) = llm::test_model(&root) else {
        return;
    };
    let model = model.to_str().unwrap();
    let text = root.join("testdata/texts/Apache-2.0");
    let text = text.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let (dump, stream, back) = (f("a.safetensors"), f("a.kvc"), f("b.safetensors"));
    let (ok, _, err) = kvc(&[
        "dump",
        model,
        text,
        &dump,
        "--tokens",
        "300",
        "--queries",
        "16",
    ]);
    assert!(ok, "{err}");
    let d = kvc_io::load_dump(Path::new(&dump)).unwrap();
    assert_eq!((d.kv.shape.tokens, d.n_q(), d.q_start), (300, 16, 284));
    assert_eq!(d.kv.meta.rope.style, codec_core::RopeStyle::GptJ);
    let (ok, _, err) = kvc(&["encode", &dump, &stream, "--level", "3"]);
    assert!(ok, "{err}");
    let (ok, _, err) = kvc(&["decode", &stream, &back]);
    assert!(ok, "{err}");
    let b = kvc_io::load_dump(Path::new(&back)).unwrap();
    assert_eq!(b.kv.shape, d.kv.shape);
    let svg = f("judge.svg");
    let (ok, out, err) = kvc(&[
        "judge", model, text, "--ctx", "200", "--cont", "24", "--levels", "1,9", "--json",
        "--plot", &svg,
    ]);
    assert!(ok, "{err}");
    // The levels as one curve labelled 1 and 9, the baselines as points, not the uncompressed row.
    let texts = svg_texts(Path::new(&svg));
    for want in [
        "KL(original || decoded), nats per token",
        "kvc levels",
        "minmax-int8",
        "minmax-int3",
        "1",
        "9",
    ] {
        assert!(texts.iter().any(|t| t == want), "{want} in {texts:?}");
    }
    assert!(!texts.iter().any(|t| t == "uncompressed"), "{texts:?}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = j["rows"].as_array().unwrap();
    let methods: Vec<_> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(
        methods,
        [
            "uncompressed",
            "kvc",
            "kvc",
            "minmax-int8",
            "minmax-int4",
            "minmax-int3"
        ]
    );
    for r in rows {
        for k in ["bits_per_elem", "ppl", "kl", "top1"] {
            assert!(r[k].is_f64(), "{k} in {r}");
        }
    }
    assert_eq!(rows[1]["level"], 1);
    assert!(rows[0]["level"].is_null());
    assert_eq!(rows[0]["kl"], 0.0);
    assert!(rows[1]["kl"].as_f64() < rows[2]["kl"].as_f64());
    let (ok, _, err) = kvc(&["judge", "/nonexistent.gguf", text]);
    assert!(!ok && err.contains("tools/fetch-model"), "{err}");
}

#[test]
fn blend_eval_reports_every_method_as_json() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let Some(model) = llm::test_model(&root) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("q.txt");
    std::fs::write(
        &q,
        "Permission is granted to copy, distribute and modify this text.",
    )
    .unwrap();
    let l = |n: &str| root.join("testdata/texts").join(n).display().to_string();
    let chunks = format!("{},{}", l("GPL-2"), l("Apache-2.0"));
    let base = [
        "blend-eval",
        model.to_str().unwrap(),
        "--chunks",
        &chunks,
        "--question",
        q.to_str().unwrap(),
        "--chunk-tokens",
        "32",
        "--scored",
        "8",
    ];
    let run = |extra: &[&str]| kvc(&[&base[..], extra].concat());
    let (ok, out, err) = run(&["--ratio", "0,15", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let methods: std::collections::BTreeSet<&str> =
        rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    let want = [
        "cacheblend",
        "full-recompute",
        "full-reuse",
        "oracle",
        "prefix-caching",
        "random",
        "single-layer-k",
        "single-layer-v",
    ];
    assert_eq!(methods.into_iter().collect::<Vec<_>>(), want);
    let stores = v["storages"].as_array().unwrap();
    assert_eq!(stores.len(), 2, "lossless and level 7");
    assert!(stores[1]["codec_kl"].as_f64().is_some_and(|k| k > 0.0));
    for r in rows {
        for key in ["ratio", "kl", "top1", "prefill_ms"] {
            assert!(r[key].is_number(), "{key} in {r}");
        }
        assert!((0.0..=1.0).contains(&r["ratio"].as_f64().unwrap()));
    }
    let (ok, _, err) = run(&["--ratio", "150"]);
    assert!(!ok && err.contains("--ratio 150"), "{err}");
    let (ok, out, err) = run(&["--level", "none", "--methods", "full-reuse", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 1);
    assert_eq!(v["storages"].as_array().unwrap().len(), 1);
    let (ok, _, err) = run(&["--first-share", "0.5"]);
    assert!(!ok && err.contains("--first-share 0.5"), "{err}");
    let (ok, _, err) = run(&["--level", "twelve"]);
    assert!(!ok && err.contains("not a level"), "{err}");
}
