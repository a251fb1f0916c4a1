//! `kvc blend-eval`'s measurement on the reference model, on short chunks: the baselines are
//! where they must be, CacheBlend spans full reuse to full recompute, and the report is whole.
//! Skipped (and said so) without the model; CI fetches it and sets `KVC_REQUIRE_MODEL=1`.

use kvc_io::blend::{blend_eval, BlendParams};
use kvc_io::judge::JudgeProfile;
use kvc_io::Silent;
use llm::Model;
use std::path::Path;

fn model() -> Option<&'static Model> {
    llm::shared_test_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

fn licence(name: &str) -> String {
    llm::test_text(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."), name)
}

/// Three licences' chunks, a question from a fourth, and the parameters both tests start from.
fn inputs() -> ([String; 3], String, BlendParams) {
    let chunks = [licence("GPL-2"), licence("Apache-2.0"), licence("MPL-2.0")];
    let question: String = licence("GFDL-1.3").chars().take(300).collect();
    let params = BlendParams {
        chunk_tokens: 48,
        scored: 16,
        ratios: vec![0.0, 0.5, 1.0],
        level: Some(9),
        seed: 1,
        ..BlendParams::default()
    };
    (chunks, question, params)
}

#[test]
fn baselines_and_cacheblend_on_short_chunks() {
    let Some(m) = model() else { return };
    let (chunks, question, params) = inputs();
    let r = blend_eval(
        m,
        &chunks,
        &question,
        &params,
        JudgeProfile::SelfLearned,
        &mut Silent,
    )
    .unwrap();
    assert_eq!(r.reused_tokens, 144);
    // Per storage: 5 selecting methods x 3 ratios, and 3 baselines.
    assert_eq!(r.rows.len(), 2 * (5 * 3 + 3));
    let get = |method: &str, storage: &str, ratio: f64| {
        r.rows
            .iter()
            .find(|x| x.method == method && x.storage == storage && x.ratio == ratio)
            .unwrap_or_else(|| panic!("no row {method} {storage} {ratio}"))
    };
    for storage in ["lossless", "kvc level 9"] {
        let full = get("full-recompute", storage, 1.0);
        assert!(full.kl < 1e-6 && full.top1 == 1.0, "{full:?}");
        assert!((full.flop_share - 1.0).abs() < 1e-9);
        let reuse = get("full-reuse", storage, 0.0);
        assert!(
            reuse.kl > 1e-3,
            "chunks prefilled alone must differ: {reuse:?}"
        );
        let cb0 = get("cacheblend", storage, 0.0);
        assert!(
            (cb0.kl - reuse.kl).abs() < 0.1 * reuse.kl,
            "{cb0:?} vs {reuse:?}"
        );
        let cb1 = get("cacheblend", storage, 1.0);
        assert!(cb1.kl < 1e-6, "{cb1:?}");
        let cb = get("cacheblend", storage, 0.5);
        assert!(cb.kl < reuse.kl && cb.flop_share < 1.0, "{cb:?}");
        assert!(cb.recall.is_some_and(|x| (0.0..=1.0).contains(&x)));
        // The oracle spans the same range: nothing recomputed is full reuse, everything full
        // recompute, half of the tokens (the most deviating) something between.
        assert_eq!(get("oracle", storage, 0.0).kl, reuse.kl);
        assert!(get("oracle", storage, 1.0).kl < 1e-6);
        let oracle = get("oracle", storage, 0.5);
        assert!(
            oracle.kl < reuse.kl && oracle.flop_share < 1.0,
            "{oracle:?}"
        );
    }
    // The first chunk is a true prefix: reused as computed, it costs prefix caching nothing.
    let prefix = get("prefix-caching", "lossless", 96.0 / 144.0);
    assert!(prefix.kl < 1e-6, "{prefix:?}");
    // Each storage says what the codec costs on its own: nothing lossless, something at level 9.
    assert_eq!(r.storages.len(), 2);
    assert_eq!(
        (r.storages[0].codec_kl, r.storages[0].bits_per_elem),
        (0.0, None)
    );
    let l9 = &r.storages[1];
    assert!(l9.codec_kl > 0.0 && l9.bits_per_elem.is_some_and(|b| b > 0.5 && b < 16.0));
}

#[test]
fn methods_are_picked_and_bad_requests_refused() {
    let Some(m) = model() else { return };
    let (chunks, question, params) = inputs();
    // Methods can be picked; unknown ones and zero repeats are refused by name.
    let only = BlendParams {
        methods: vec!["full-reuse".into()],
        level: None,
        repeat: 2,
        ..params.clone()
    };
    let r = blend_eval(
        m,
        &chunks,
        &question,
        &only,
        JudgeProfile::SelfLearned,
        &mut Silent,
    )
    .unwrap();
    assert_eq!(r.rows.len(), 1);
    assert_eq!(r.rows[0].method, "full-reuse");
    for (bad, says) in [
        (
            BlendParams {
                methods: vec!["blend".into()],
                ..params.clone()
            },
            "no method \"blend\"",
        ),
        (
            BlendParams {
                repeat: 0,
                ..params.clone()
            },
            "repeat",
        ),
    ] {
        let e = blend_eval(
            m,
            &chunks,
            &question,
            &bad,
            JudgeProfile::SelfLearned,
            &mut Silent,
        );
        assert!(
            e.as_ref().is_err_and(|e| e.to_string().contains(says)),
            "{e:?}"
        );
    }
    // No chunk at all is an error, not a panic.
    assert!(blend_eval(
        m,
        &[],
        &question,
        &params,
        JudgeProfile::SelfLearned,
        &mut Silent
    )
    .is_err());
    // Too short a question is an error, not a panic.
    let p = BlendParams {
        scored: 10_000,
        ..params
    };
    assert!(blend_eval(
        m,
        &chunks,
        &question,
        &p,
        JudgeProfile::SelfLearned,
        &mut Silent
    )
    .is_err());
}
