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
    let text = "/usr/share/common-licenses/Apache-2.0";
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
